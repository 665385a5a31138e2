"""Time of one training step: ortbridge vs onnxruntime's ORTModule vs torch eager.

Runs in the separate environment that ``benchmarks/ortmodule_env.sh`` builds
(ORTModule of onnxruntime-training 1.19.2 needs a torch older than 2.9). A
step is forward, loss (cross-entropy or MSE, in torch), backward and a torch
SGD step, on the models of ``bench_step.py`` (``_models.py``), the same
weights and the same batch, four ways:

- ``eager``: the torch model itself;
- ``ortmodule``: ``ORTModule(model)``, onnxruntime's own bridge, with its
  default session options (onnxruntime's intra-op threads spin);
- ``ortmodule_nospin``: the same with intra-op spinning off and
  ``torch.get_num_threads()`` threads, the settings ortbridge uses by
  default (ORTModule has no option for it: its session-options method is
  wrapped for this one instance);
- ``ortbridge``: ``OnnxModule`` on the graph torch's TorchScript exporter
  writes for the model (weights named as the torch parameters, so the same
  values), with ``torch.optim.SGD``.

Hypothesis: ortbridge's step is no slower than ORTModule's
(ortbridge / ortmodule <= 1.0): both run the forward and backward of one
gradient graph in a TrainingAgent, and ortbridge's Python layer is thinner.

The first step's loss is printed for every way (same weights, same batch:
the same loss, or the comparison is not fair). Repetitions are interleaved
(each round times every way in turn), the medians are compared; results go
to a JSON file.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import io
import json
import os
import platform
import statistics
import sys
import time
import warnings

import onnx
import torch

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
VARIANTS = ("eager", "ortmodule", "ortmodule_nospin", "ortbridge")

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
    """The TorchScript exporter, in training mode, no constant folding: every
    parameter stays an initializer under its torch name."""
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


def ortbridge_layer(model: torch.nn.Module, x: torch.Tensor) -> OnnxModule:
    """``OnnxModule`` of ``model``'s export; its parameters are the model's."""
    proto = export_torchscript(model, x)
    params = dict(model.named_parameters())
    names = {init.name for init in proto.graph.initializer}
    missing = sorted(set(params) - names)
    if missing:
        raise RuntimeError(f"parameters not exported under their own names: {missing}")
    layer = OnnxModule(proto, trainable=list(params))
    with torch.no_grad():
        for name, param in layer.named_onnx_parameters():
            param.copy_(params[name])
    return layer


def measure(name: str, rounds: int, steps: int) -> dict:
    global _NO_SPIN
    factory, _, _ = _models.MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x, y = _models.data(name, torch.device("cpu"))
    layer = ortbridge_layer(copy.deepcopy(model), x)  # export before any ORTModule
    quiet = DebugOptions(log_level=LogLevel.ERROR)  # no feature table per instance
    modules = {
        "eager": model,
        "ortmodule": ORTModule(copy.deepcopy(model), quiet),
        "ortmodule_nospin": ORTModule(copy.deepcopy(model), quiet),
        "ortbridge": layer,
    }
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=LR) for v, m in modules.items()}
    loss_fn = _models.loss_fn(name)

    def run(variant):
        return _models.train_step(modules[variant], optimizers[variant], loss_fn, x, y)

    first = {}
    for v in VARIANTS:  # the first call exports and builds the graphs
        _NO_SPIN = v == "ortmodule_nospin"
        try:
            first[v] = float(run(v))
        finally:
            _NO_SPIN = False
    spread = max(first.values()) - min(first.values())
    if spread > 1e-4 * max(1.0, abs(first["eager"])):
        raise RuntimeError(f"{name}: first-step losses differ: {first}")
    for v in VARIANTS:  # warm-up
        for _ in range(steps):
            run(v)
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            start = time.perf_counter()
            for _ in range(steps):
                run(v)
            times[v].append((time.perf_counter() - start) / steps * 1e3)
    ms = {v: statistics.median(t) for v, t in times.items()}
    fallbacks = len(SHAPE_INFERENCE_FALLBACKS)
    SHAPE_INFERENCE_FALLBACKS.clear()
    return {
        "model": name,
        "ortmodule_shape_inference_fallbacks": fallbacks,
        "first_loss": first,
        "ms": ms,
        "ms_min": {v: min(t) for v, t in times.items()},
        "all_ms": times,
        "ortbridge/ortmodule": ms["ortbridge"] / ms["ortmodule"],
        "ortbridge/ortmodule_nospin": ms["ortbridge"] / ms["ortmodule_nospin"],
        "ortbridge/eager": ms["ortbridge"] / ms["eager"],
        "ortmodule/eager": ms["ortmodule"] / ms["eager"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(_models.MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps timed per round")
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--output", default=os.path.join(here, "results", "ortmodule.json"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = []
    for name in args.models:
        print(f"measuring {name} ...", flush=True)
        results.append(measure(name, args.rounds, args.steps))
    load_after = os.getloadavg()

    print()
    print(
        f"{'model':12s} {'eager':>8s} {'ortmod':>8s} {'ortm-ns':>8s} {'ortbr':>8s}"
        f" {'ob/ortm':>8s} {'ob/ortm-ns':>10s} {'ob/eager':>8s} {'ortm/eager':>10s}"
    )
    for r in results:
        ms = r["ms"]
        print(
            f"{r['model']:12s} {ms['eager']:8.3f} {ms['ortmodule']:8.3f}"
            f" {ms['ortmodule_nospin']:8.3f} {ms['ortbridge']:8.3f}"
            f" {r['ortbridge/ortmodule']:8.2f} {r['ortbridge/ortmodule_nospin']:10.2f}"
            f" {r['ortbridge/eager']:8.2f} {r['ortmodule/eager']:10.2f}"
        )
    print("(ms per step, median of the rounds; ortm-ns: ORTModule without spinning)")
    for r in results:
        losses = ", ".join(f"{k} {v:.6f}" for k, v in r["first_loss"].items())
        print(f"first-step loss {r['model']}: {losses}")
    for r in results:
        if r["ortmodule_shape_inference_fallbacks"]:
            print(
                f"{r['model']}: ORTModule's symbolic shape inference failed "
                f"{r['ortmodule_shape_inference_fallbacks']} time(s), onnx's was used"
            )
    print(f"load average: {load_before[0]:.2f} before, {load_after[0]:.2f} after")

    import onnxruntime

    info = {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "ortbridge": ortbridge.__version__,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
