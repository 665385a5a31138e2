"""Time of one training step: ortbridge's two engines vs onnxruntime's ORTModule vs torch eager.

Runs in the separate environment that ``benchmarks/ortmodule_env.sh`` builds
(ORTModule of onnxruntime-training 1.19.2 needs a torch older than 2.9). A
step is forward, loss (cross-entropy or MSE, in torch), backward and a torch
SGD step, on every model of ``bench_step.py`` (``_models.py``), the same
weights and the same batch, five ways:

- ``eager``: the torch model itself;
- ``ortmodule``: ``ORTModule(model)``, onnxruntime's own bridge, with its
  default session options (onnxruntime's intra-op threads spin) and its
  fallback to torch turned off (a model it cannot run is reported as such,
  not timed as torch);
- ``ortmodule_nospin``: the same with intra-op spinning off and
  ``torch.get_num_threads()`` threads, the settings ortbridge uses by
  default (ORTModule has no option for it: its session-options method is
  wrapped for this one instance);
- ``ortbridge[agent]`` and ``ortbridge[onnxruntime]``: ``OnnxModule`` with
  ``backend="training-agent"`` and ``backend="onnxruntime"`` on the graph
  torch's TorchScript exporter writes for the model (the same export for
  both, the model's parameters in it), with ``torch.optim.SGD``.

Hypothesis: both ortbridge engines step no slower than ORTModule
(ortbridge / ORTModule <= 1.0): ``ortbridge[agent]`` runs the same kind of
gradient graph in a TrainingAgent with a thinner Python layer, and
``ortbridge[onnxruntime]`` runs its own, rewritten, gradient graph.

A way that cannot build or train a model (an error on its first step) is
named with the error's first line and left out of that model's timing. The
first step's loss is printed for every way (same weights, same batch: the
same loss, or the way is left out as not comparable). Repetitions are
interleaved (each round times every way in turn, the ways' order rotating
from round to round), the medians are compared; results go to a JSON file
and a PNG of the ratios to torch eager.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import io
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings

# ORTModule falls back to running the torch model when it cannot export or
# run it: that would time torch under ORTModule's name. Read at import.
os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

import onnx  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models  # noqa: E402

try:
    from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule
    from onnxruntime.training.ortmodule import _graph_execution_manager as _gem
    from onnxruntime.training.ortmodule import _graph_transition_manager as _gtm
except ImportError as exc:  # torch >= 2.9, or the C++ extensions not built
    raise SystemExit(
        f"ORTModule cannot be imported here ({exc}): run this script with the python "
        "of the environment benchmarks/ortmodule_env.sh builds"
    ) from exc

import ortbridge  # noqa: E402
from ortbridge import OnnxModule  # noqa: E402

LR = 0.01
ENGINES = {"ortbridge[agent]": "training-agent", "ortbridge[onnxruntime]": "onnxruntime"}
VARIANTS = ("eager", "ortmodule", "ortmodule_nospin", *ENGINES)
#: Short column names for the printed tables.
SHORT = {
    "eager": "eager",
    "ortmodule": "ORTM",
    "ortmodule_nospin": "ORTM-ns",
    "ortbridge[agent]": "ob[agent]",
    "ortbridge[onnxruntime]": "ob[ort]",
}

# Set while an ORTModule that must not spin creates its session (on its first
# training forward).
_NO_SPIN = False
_original_session_config = _gem.GraphExecutionManager._get_session_config


def _session_config(self):
    options, providers, provider_options = _original_session_config(self)
    if _NO_SPIN:
        options.intra_op_num_threads = torch.get_num_threads()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options, providers, provider_options


_gem.GraphExecutionManager._get_session_config = _session_config


OPSET = 17  # ORTModule's default


def _drop_ortmodule_export_rules() -> None:
    """Constructing an ORTModule registers its own export rules in torch.onnx
    for the whole process (MaxPool as an ATen fallback node run by torch,
    com.microsoft contrib ops); the graph given to ortbridge must hold
    standard ONNX ops only. The next ORTModule registers them again."""
    from onnxruntime.tools import pytorch_export_contrib_ops
    from onnxruntime.training.ortmodule._custom_op_symbolic_registry import (
        CustomOpSymbolicRegistry,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytorch_export_contrib_ops.unregister()
        for name in CustomOpSymbolicRegistry._SYMBOLICS:
            torch.onnx.unregister_custom_op_symbolic(name, OPSET)


# ORTModule runs onnxruntime's symbolic shape inference on its export, and it
# fails on the TransformerEncoderLayer graph of torch 2.3 (an assertion in
# _infer_Reshape, on the Reshape nodes of MultiheadAttention's packed input
# projection): ORTModule then raises. Where it fails, onnx's own shape
# inference is used; the graph and what onnxruntime runs are the same.
SHAPE_INFERENCE_FALLBACKS = []
_original_infer_shapes = _gtm.GraphTransitionManager._infer_shapes


def _infer_shapes(model):
    try:
        return _original_infer_shapes(model)
    except AssertionError:
        SHAPE_INFERENCE_FALLBACKS.append(model.graph.name)
        return onnx.shape_inference.infer_shapes(model)


_gtm.GraphTransitionManager._infer_shapes = staticmethod(_infer_shapes)


def export_torchscript(model: torch.nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    """The TorchScript exporter, in training mode, no constant folding: the
    parameters stay initializers under their torch names (an LSTM's are
    sliced and joined into the node's layout by nodes of the graph)."""
    _drop_ortmodule_export_rules()
    kwargs = {}
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        kwargs["dynamo"] = False
    buffer = io.BytesIO()
    # The exporter feeds the defaults of optional arguments to the tracer,
    # which makes TransformerEncoderLayer's is_causal=False a tensor and
    # scaled_dot_product_attention refuse it: trace a forward of x alone.
    forward = type(model).forward
    model.forward = lambda x: forward(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            buffer,
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
            opset_version=OPSET,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            **kwargs,
        )
    del model.forward
    return onnx.load_from_string(buffer.getvalue())


def ortbridge_layer(model: torch.nn.Module, proto: onnx.ModelProto, backend: str) -> OnnxModule:
    """``OnnxModule`` of ``model``'s export on one engine; its parameters are
    the model's."""
    params = dict(model.named_parameters())
    names = {init.name for init in proto.graph.initializer}
    missing = sorted(set(params) - names)
    if missing:
        raise RuntimeError(f"parameters not exported under their own names: {missing}")
    layer = OnnxModule(proto, trainable=list(params), backend=backend)
    with torch.no_grad():
        for name, param in layer.named_onnx_parameters():
            param.copy_(params[name])
    return layer


def _reason(exc: BaseException) -> str:
    """An error in one line: its type and the first line of its message,
    without onnxruntime's source location and C++ signature."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = re.sub(r"/onnxruntime_src/\S+:\d+ [^(]*\([^)]*\) ", "", lines[0] if lines else "")
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}"


def build(name: str, model: torch.nn.Module, x: torch.Tensor) -> tuple[dict, dict]:
    """The modules to time, and why the others could not be built."""
    modules = {"eager": model}
    failed = {}
    try:
        proto = export_torchscript(copy.deepcopy(model), x)  # before any ORTModule
    except Exception as exc:
        for variant in ENGINES:
            failed[variant] = f"the TorchScript export failed: {_reason(exc)}"
    else:
        for variant, backend in ENGINES.items():
            try:
                modules[variant] = ortbridge_layer(copy.deepcopy(model), proto, backend)
            except Exception as exc:
                failed[variant] = _reason(exc)
    quiet = DebugOptions(log_level=LogLevel.ERROR)  # no feature table per instance
    for variant in ("ortmodule", "ortmodule_nospin"):
        try:
            modules[variant] = ORTModule(copy.deepcopy(model), quiet)
        except Exception as exc:
            failed[variant] = _reason(exc)
    return modules, failed


def measure(name: str, rounds: int, steps: int, slot_s: float) -> dict:
    global _NO_SPIN
    factory, _, _ = _models.MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x, y = _models.data(name, torch.device("cpu"))
    modules, failed = build(name, model, x)
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=LR) for v, m in modules.items()}
    loss_fn = _models.loss_fn(name)

    def run(variant):
        return _models.train_step(modules[variant], optimizers[variant], loss_fn, x, y)

    first = {}
    for v in VARIANTS:  # the first call exports and builds the graphs
        if v not in modules:
            continue
        _NO_SPIN = v == "ortmodule_nospin"
        try:
            first[v] = float(run(v))
        except Exception as exc:
            failed[v] = _reason(exc)
        finally:
            _NO_SPIN = False
    tolerance = 1e-4 * max(1.0, abs(first["eager"]))
    for v, loss in list(first.items()):
        if abs(loss - first["eager"]) > tolerance:
            failed[v] = f"first-step loss {loss:.6f}, torch eager's {first['eager']:.6f}"
    timed = [v for v in VARIANTS if v in first and v not in failed]
    warm = {v: [] for v in timed}
    for v in timed:  # warm-up, and the step count of a round
        for _ in range(3):
            start = time.perf_counter()
            run(v)
            warm[v].append(time.perf_counter() - start)
    if steps <= 0:  # the slowest way's share of a round takes about slot_s
        slowest = max(statistics.median(t) for t in warm.values())
        steps = max(1, min(50, round(slot_s / slowest)))
    times = {v: [] for v in timed}
    for k in range(rounds):
        order = timed[k % len(timed) :] + timed[: k % len(timed)]
        for v in order:
            start = time.perf_counter()
            for _ in range(steps):
                run(v)
            times[v].append((time.perf_counter() - start) / steps * 1e3)
    ms = {v: statistics.median(t) for v, t in times.items()}
    fallbacks = len(SHAPE_INFERENCE_FALLBACKS)
    SHAPE_INFERENCE_FALLBACKS.clear()
    ratios = {}
    for a in VARIANTS[1:]:
        for b in ("eager", "ortmodule", "ortmodule_nospin"):
            if a != b and a in ms and b in ms and VARIANTS.index(a) > VARIANTS.index(b):
                ratios[f"{a}/{b}"] = ms[a] / ms[b]
    return {
        "model": name,
        "steps_per_round": steps,
        "not_run": {v: failed[v] for v in VARIANTS if v in failed},
        "ortmodule_shape_inference_fallbacks": fallbacks,
        "first_loss": first,
        "ms": ms,
        "ms_min": {v: min(t) for v, t in times.items()},
        "all_ms": times,
        "ratios": ratios,
    }


def report(results: list[dict]) -> None:
    def cell(value, width, fmt):
        return f"{value:{width}{fmt}}" if value is not None else f"{'-':>{width}s}"

    print()
    print(f"{'model':12s}" + "".join(f" {SHORT[v]:>9s}" for v in VARIANTS))
    for r in results:
        cells = "".join(f" {cell(r['ms'].get(v), 9, '.3f')}" for v in VARIANTS)
        print(f"{r['model']:12s}{cells}")
    print("(ms per step, median of the rounds; ORTM-ns: ORTModule without spinning; -: not run)")
    print()
    pairs = [
        ("ortmodule", "eager"),
        ("ortbridge[agent]", "eager"),
        ("ortbridge[onnxruntime]", "eager"),
        ("ortbridge[agent]", "ortmodule"),
        ("ortbridge[onnxruntime]", "ortmodule"),
        ("ortbridge[agent]", "ortmodule_nospin"),
        ("ortbridge[onnxruntime]", "ortmodule_nospin"),
    ]
    names = [f"{SHORT[a]}/{SHORT[b]}" for a, b in pairs]
    print(f"{'model':12s}" + "".join(f" {n:>{max(len(n), 8)}s}" for n in names))
    for r in results:
        cells = "".join(
            f" {cell(r['ratios'].get(f'{a}/{b}'), max(len(n), 8), '.2f')}"
            for (a, b), n in zip(pairs, names)
        )
        print(f"{r['model']:12s}{cells}")
    print("(ratios of the medians, measured side by side in one run; -: a way not run)")
    print()
    for r in results:
        losses = ", ".join(f"{SHORT[k]} {v:.6f}" for k, v in r["first_loss"].items())
        print(f"first-step loss {r['model']}: {losses}")
    for r in results:
        for v, why in r["not_run"].items():
            print(f"{r['model']}: {v} could not run it: {why}")
        if r["ortmodule_shape_inference_fallbacks"]:
            print(
                f"{r['model']}: ORTModule's symbolic shape inference failed "
                f"{r['ortmodule_shape_inference_fallbacks']} time(s), onnx's was used"
            )


def plot(results: list[dict], info: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = VARIANTS[1:]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        offset = (i - (len(variants) - 1) / 2) * width
        xs = [k + offset for k, r in enumerate(results) if v in r["ms"]]
        heights = [r["ms"][v] / r["ms"]["eager"] for r in results if v in r["ms"]]
        ax.bar(xs, heights, width, label=v, color=f"C{i}")
        for k, r in enumerate(results):
            if v not in r["ms"]:
                ax.text(k + offset, 0.05, "n/a", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(results)), [r["model"] for r in results])
    ax.set_ylabel("step time / torch eager")
    ax.set_title(
        f"One training step (median), lower is better; {info['cores']} cores, "
        f"torch {info['torch']}, onnxruntime-training {info['onnxruntime']}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(_models.MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="steps timed per round (0: as many as fill --slot seconds for the slowest way)",
    )
    parser.add_argument(
        "--slot", type=float, default=0.25, help="seconds of the slowest way in a round"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--output", default=os.path.join(here, "results", "ortmodule.json"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    load_before = os.getloadavg()
    results = []
    for name in args.models:
        print(f"measuring {name} ...", flush=True)
        results.append(measure(name, args.rounds, args.steps, args.slot))
    load_after = os.getloadavg()
    report(results)
    print(f"load average: {load_before[0]:.2f} before, {load_after[0]:.2f} after")

    import onnxruntime

    info = {
        "machine": platform.machine(),
        "processor": _processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "onnx_ad": _version("onnx-ad"),
        "ortbridge": ortbridge.__version__,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "rounds": args.rounds,
        "steps_per_round": args.steps or f"auto ({args.slot} s for the slowest way)",
        "seconds": time.perf_counter() - start,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    print(f"wrote {args.output}")
    png = os.path.splitext(args.output)[0] + ".png"
    try:
        plot(results, info, png)
    except ImportError as exc:
        print(f"no plot ({exc}): pip install matplotlib")
    else:
        print(f"wrote {png}")
    print(f"{info['seconds']:.0f} s in all")
    return 0


def _processor() -> str:
    """The CPU's model name (platform.processor() is empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
