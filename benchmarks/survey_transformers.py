"""Held-out survey: fifteen transformers architectures, both torch exporters, each engine.

Small configurations with random weights (``tests/_transformers_zoo.py``),
exported by TorchScript (a dynamic batch) and dynamo (static shapes, eager
attention), loaded with ``backend="auto"`` and with each engine installed,
then one backward of ``sum(out**2)`` compared with torch autograd on the
same weights.

Hypothesis: every architecture both exporters can export trains under
``auto`` with torch's gradients (every parameter's gradient within 1e-3 of
torch's, relative to its largest value), and building plus the first step
takes seconds. Printed per architecture, exporter and engine: the outcome
(``ok``, ``wrong`` with the worst parameter, ``refused``/``failed`` with the
error), the engine ``auto`` chose and the seconds to build and take the first
step; a summary count per engine. Results go to
``results/survey_transformers[_training_env].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

from _transformers_zoo import EXPORTERS, ZOO, exported, gradient_errors  # noqa: E402

import ortbridge  # noqa: E402
from ortbridge import _engines  # noqa: E402
from ortbridge._runtime import _ort  # noqa: E402
from ortbridge.exceptions import NotDifferentiableError  # noqa: E402

TOLERANCE = 1e-3


def _one(model, inputs, proto, engine) -> dict:
    start = time.perf_counter()
    try:
        layer = ortbridge.OnnxModule(proto, backend=engine)
        found = gradient_errors(model, layer, inputs)
    except Exception as exc:  # a survey reports every failure, whatever raised it
        kind = "refused" if isinstance(exc, NotDifferentiableError) else "failed"
        return {"outcome": kind, "error": f"{type(exc).__name__}: {exc}"[:300]}
    seconds = time.perf_counter() - start
    worst = max(found["errors"].items(), key=lambda item: item[1], default=("", 0.0))
    wrong = worst[1] > TOLERANCE or found["output"] > 1e-4 or found["missing"]
    return {
        "outcome": "wrong" if wrong else "ok",
        "engine": layer.backend,
        "build_and_first_step_s": round(seconds, 2),
        "output_error": found["output"],
        "worst_parameter": worst[0],
        "worst_relative_error": worst[1],
        "not_parameters": found["missing"],
        "trains_what_torch_freezes": found["frozen"],
        "parameters": len(found["errors"]) + len(found["frozen"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(ZOO), choices=list(ZOO))
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(os.cpu_count() or 1)
    engines = ["auto", *_engines.installed()]
    rows = []
    for name in args.models:
        for exporter in EXPORTERS:
            try:
                model, inputs, proto = exported(name, exporter)
            except Exception as exc:  # the exporter's failure, not ortbridge's
                row = {"model": name, "exporter": exporter, "outcome": "not exported"}
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                rows.append(row)
                print(f"{name:16s} {exporter:11s} not exported: {row['error'][:90]}", flush=True)
                continue
            for engine in engines:
                row = {"model": name, "exporter": exporter, "backend": engine}
                row.update(_one(model, inputs, proto, engine))
                rows.append(row)
                detail = (
                    f"{row['engine']:14s} {row['build_and_first_step_s']:6.2f} s  "
                    f"worst {row['worst_relative_error']:.1e} ({row['worst_parameter']})"
                    if "engine" in row
                    else row["error"][:110]
                )
                print(f"{name:16s} {exporter:11s} {engine:14s} {row['outcome']:8s} {detail}")
    print()
    for engine in engines:
        mine = [r for r in rows if r.get("backend") == engine]
        ok = sum(r["outcome"] == "ok" for r in mine)
        print(f"{engine}: {ok}/{len(mine)} exports train with torch's gradients")
    out = args.out or os.path.join(
        HERE,
        "results",
        "survey_transformers" + ("_training_env" if _ort.has_training() else "") + ".json",
    )
    info = {
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "onnxruntime": ".".join(map(str, _ort.version())),
    }
    with open(out, "w") as f:
        json.dump({"environment": info, "rows": rows}, f, indent=1)
    print(f"results: {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
