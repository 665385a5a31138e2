"""Training steps of real architectures: the onnxruntime engine against torch eager and the agent.

transformers' ConvNeXt, SegFormer, MobileViT, ResNet, ViT and Whisper encoder
in small configurations with random weights (``tests/_transformers_zoo.py``,
TorchScript export with a dynamic batch, eval mode), and PP-OCRv6's text
recogniser from the published corpus (no torch source: no eager column), on
batches of ``--batch`` rows (16). A step is a forward and the backward of
``sum(out**2)``, the gradients set to None before it as torch's optimizers
do; each engine installed runs it as ``OnnxModule(..., backend=engine)``.

Hypothesis (the engine-speed work's targets): the onnxruntime engine's step
is at most the training agent's and torch eager's, its construction plus
first step at most 3x the agent's, and the tensors it saves for the backward
at most 1.2x torch's. Printed per model: step ms of each way and the ratios
measured side by side (interleaved rounds, medians), seconds to build and
take the first step (the imports a process makes once done before),
bytes saved for the backward (torch's saved-tensor
hooks: what eager and the onnxruntime engine keep; the agent keeps its own
inside onnxruntime), and with ``--profile`` the op types that take the
onnxruntime engine's time (onnxruntime's profiler, forward and backward
sessions). Results go to ``results/bench_zoo[_training_env].json`` and a plot.

``--device cuda`` runs every way on the GPU (torch's model, its inputs and
the ONNX layers; results suffixed ``_cuda``); ``--profile`` is for the CPU.

``--build-profile`` instead times the onnxruntime engine's construction and
first step, and each stage of its build (cProfile's cumulative seconds):
``results/bench_zoo_build[_training_env].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

from _measure import saved_bytes  # noqa: E402
from _profiles import engine_ms_by_op, profiling_options  # noqa: E402

import ortbridge  # noqa: E402
from ortbridge import _engines  # noqa: E402
from ortbridge._runtime import _ort  # noqa: E402

ARCHITECTURES = ["convnext", "segformer", "mobilevit", "resnet", "vit", "whisper-encoder"]
RECOGNISER = "PP-OCRv6_rec_small"
CPU = torch.device("cpu")


def _cases(names, batch):
    """(name, torch model or None, inputs, ONNX model or path) per model; the
    inputs repeated to ``batch`` rows (the exports' batch axis is dynamic)."""
    from _transformers_zoo import exported

    for name in names:
        if name == RECOGNISER:
            from _published import CORPUS, fetch

            model = next(m for m in CORPUS if m.id == RECOGNISER)
            inputs, source, model = model.feeds(["x"]), str(fetch(model)), None
        else:
            model, inputs, source = exported(name, "torchscript")
        inputs = [t.repeat(-(-batch // len(t)), *[1] * (t.dim() - 1))[:batch] for t in inputs]
        yield name, model, inputs, source


def _step(net, inputs):
    # Gradients reset to None first, as torch's optimizers do (and
    # bench_step.py): the backward then hands each gradient over instead of
    # adding it to the last step's.
    net.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    out = net(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    sum(o.float().square().sum() for o in out if o.is_floating_point()).backward()


def _profile(layer, inputs, steps=5) -> dict:
    """Milliseconds per step by op type in the onnxruntime engine's sessions
    (:func:`_profiles.engine_ms_by_op`)."""
    folder = tempfile.mkdtemp()
    profiled = ortbridge.OnnxModule(layer.to_onnx(), backend="onnxruntime",
                                    session_options=profiling_options(folder)).eval()  # fmt: skip
    for _ in range(steps + 1):
        _step(profiled, inputs)
    return engine_ms_by_op(profiled, folder, shown=12)


#: The stages of the onnxruntime engine's build, as (label, module, function):
#: cumulative seconds of each (stages may nest: shape inference runs inside
#: the optimiser's passes). Each optimiser pass is a stage of its own too.
BUILD_STAGES = [
    (
        "prepare (ortbridge rewrites for onnx-ad)",
        "ortbridge._engines.onnxruntime._reverse_prep",
        "prepare",
    ),
    ("onnx-ad reverse pass", "onnx_ad.reverse", "reverse"),
    ("onnx-ad constant folding (inside a pass)", "onnx_ad.fold", "fold_constants"),
    ("optimiser passes, all", "ortbridge._engines.onnxruntime.passes._pipeline", "run"),
    ("split in forward and backward", "ortbridge._engines.onnxruntime._split", "split"),
    ("onnx shape inference (inside the above)", "onnx.shape_inference", "infer_shapes"),
    ("session creation (forward and backward)", "ortbridge._runtime._sessions", "_session"),
]


def _stage_codes() -> list:
    """(label, code object) of every stage timed, the passes in their order."""
    import importlib

    from ortbridge._engines.onnxruntime.passes import PASSES

    codes = []
    for label, module, function in BUILD_STAGES:
        code = getattr(importlib.import_module(module), function)
        codes.append((label, getattr(code, "__wrapped__", code).__code__))
    codes += [(f"  pass: {one.name}", one.call.__code__) for one in PASSES]
    return codes


def _build_profile(source, inputs) -> dict:
    """Seconds of construction, of the first step, and by build stage (cProfile)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    layer = ortbridge.OnnxModule(source, backend=_engines.ONNXRUNTIME).eval()
    built = time.perf_counter()
    _step(layer, inputs)
    profiler.disable()
    done = time.perf_counter()
    stats = pstats.Stats(profiler).stats
    stages = {}
    for label, code in _stage_codes():
        key = (code.co_filename, code.co_firstlineno, code.co_name)
        stages[label] = stats[key][3] if key in stats else 0.0
    return {"construction_s": built - start, "first_step_s": done - built, "stages_s": stages}


def _warm_imports() -> None:
    """What a process imports once (each engine's modules, onnx's reference
    evaluator that onnx-ad folds constants with): not counted in a model's build."""
    import onnx.reference.ops  # noqa: F401

    from ortbridge.examples import linear_model

    for engine in _engines.installed():
        layer = ortbridge.OnnxModule(linear_model(3, 2), backend=engine)
        layer(torch.ones(2, 3)).sum().backward()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one(name, model, inputs, source, rounds, steps, profile, device=CPU) -> dict:
    row: dict = {"model": name}
    inputs = [t.to(device) for t in inputs]
    if model is not None:
        model.to(device)
    ways = {}
    if model is not None:
        inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        ways["eager"] = model
        row["eager_saved_bytes"] = saved_bytes(model, *inputs)
    for engine in _engines.installed():
        start = time.perf_counter()
        try:
            layer = ortbridge.OnnxModule(source, backend=engine).to(device).eval()
            _step(layer, inputs)
            _sync(device)
        except ortbridge.OrtBridgeError as exc:
            row[f"{engine}_error"] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        row[f"{engine}_build_and_first_step_s"] = time.perf_counter() - start
        ways[engine] = layer
        if engine == _engines.ONNXRUNTIME:
            row["onnxruntime_saved_bytes"] = saved_bytes(layer, *inputs)
            if profile and device.type == "cpu":
                row["onnxruntime_profile_ms"] = _profile(layer, inputs)
    times = {way: [] for way in ways}
    for _ in range(rounds):  # interleaved: each round times every way in turn
        for way, net in ways.items():
            _step(net, inputs)  # a warm step, then the timed ones
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                _step(net, inputs)
            _sync(device)
            times[way].append((time.perf_counter() - start) / steps * 1e3)
    row["step_ms"] = {way: statistics.median(t) for way, t in times.items()}
    return row


def _ratio(row, a, b):
    ms = row["step_ms"]
    return ms[a] / ms[b] if a in ms and b in ms else None


def _print(row):
    ms = row["step_ms"]
    cells = [f"{row['model']:20s}"]
    for way in ("eager", _engines.TRAINING_AGENT, _engines.ONNXRUNTIME):
        cells.append(f"{ms[way]:8.1f}" if way in ms else f"{'-':>8s}")
    for a, b in (("onnxruntime", "eager"), ("onnxruntime", "training-agent")):
        r = _ratio(row, a, b)
        cells.append(f"{r:8.2f}" if r is not None else f"{'-':>8s}")
    for engine in (_engines.TRAINING_AGENT, _engines.ONNXRUNTIME):
        s = row.get(f"{engine}_build_and_first_step_s")
        cells.append(f"{s:7.1f}" if s is not None else f"{'-':>7s}")
    saved, eager = row.get("onnxruntime_saved_bytes"), row.get("eager_saved_bytes")
    cells.append(f"{saved / eager:7.2f}" if saved and eager else f"{'-':>7s}")
    print(" ".join(cells), flush=True)
    for key, value in row.items():
        if key.endswith("_error"):
            print(f"    {key[:-6]}: {value}")
    if "onnxruntime_profile_ms" in row:
        top = ", ".join(f"{op} {ms:.1f}" for op, ms in row["onnxruntime_profile_ms"].items())
        print(f"    onnxruntime engine, ms per step by op type: {top}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.38
    for k, (other, colour) in enumerate((("eager", "tab:gray"), ("training-agent", "tab:green"))):
        values = [_ratio(r, "onnxruntime", other) or 0 for r in rows]
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        ax.bar(xs, values, width, label=f"onnxruntime engine / {other}", color=colour)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=20)
    ax.set_ylabel("step time ratio (lower is better)")
    ax.set_title("One training step, median of interleaved rounds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=ARCHITECTURES + [RECOGNISER])
    parser.add_argument("--batch", type=int, default=16, help="rows per step")
    parser.add_argument("--rounds", type=int, default=5)
    # As bench_step.py's: the first steps after another way ran are slower
    # (caches, the other way's threads), and 3 steps a round measured that
    # switch as much as the step (Whisper's engine 1.83 ms in its second step
    # after the agent's, 1.55 from the fourth on).
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--profile", action="store_true", help="the engine's time by op type")
    parser.add_argument(
        "--build-profile",
        action="store_true",
        help="only where the onnxruntime engine's construction and first step spend their time",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    warnings.simplefilter("ignore")
    if args.build_profile:
        return _main_build_profile(args)
    header = (f"{'model':20s} {'eager':>8s} {'agent':>8s} {'ort eng':>8s} {'ort/eag':>8s} "
              f"{'ort/agt':>8s} {'agt 1st':>7s} {'ort 1st':>7s} {'saved':>7s}")  # fmt: skip
    print("step ms (median), ratios, build + first step s, saved bytes / eager's")
    print(header)
    _warm_imports()
    rows = []
    for name, model, inputs, source in _cases(args.models, args.batch):
        rows.append(
            _one(name, model, inputs, source, args.rounds, args.steps, args.profile, device)
        )
        _print(rows[-1])
    suffix = "_training_env" if _ort.has_training() else ""
    suffix += "" if device.type == "cpu" else f"_{device.type}"
    record = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
        },  # fmt: skip
        "onnxruntime": _ort.runtime().__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "batch": args.batch,
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_zoo{suffix}.json"), "w") as f:
        json.dump(record, f, indent=1)
    plot(rows, os.path.join(args.out, f"bench_zoo{suffix}.png"))
    print(f"wrote {args.out}/bench_zoo{suffix}.json and .png")
    return 0


def _main_build_profile(args) -> int:
    _warm_imports()
    rows = []
    for name, _, inputs, source in _cases(args.models, args.batch):
        inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        row = {"model": name, **_build_profile(source, inputs)}
        rows.append(row)
        print(f"{name}: construction {row['construction_s']:.2f} s, "
              f"first step {row['first_step_s']:.2f} s", flush=True)  # fmt: skip
        for label, seconds in row["stages_s"].items():
            print(f"    {label:58s} {seconds:6.3f} s")
    suffix = "_training_env" if _ort.has_training() else ""
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_zoo_build{suffix}.json")
    with open(path, "w") as f:
        json.dump({"onnxruntime": _ort.runtime().__version__, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
