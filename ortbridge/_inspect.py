"""``python -m ortbridge inspect MODEL.onnx``: what OnnxModule would make of a model."""

from __future__ import annotations

import sys

from . import _graph
from .exceptions import OrtBridgeError


def inspect_model(path: str, out=None, backend: str = "auto", check: bool = False) -> bool:
    """Print inputs, outputs, initializers, the engine and whether it trains (True if so).

    ``check``: also compare the gradients with finite differences
    (:func:`ortbridge.gradcheck`) on random inputs of the graph's shapes, a
    symbolic dimension taken as 2; True then also needs the check to pass.
    """
    out = out if out is not None else sys.stdout
    from .module import OnnxModule

    model = _graph.load_model(path)
    summary = _graph.summarize(_graph.normalize(_graph.load_model(model)))
    print(
        f"graph {summary.name!r}: {len(model.graph.node)} nodes, opsets "
        + ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import),
        file=out,
    )
    print("inputs:", file=out)
    for spec in summary.inputs:
        print(f"  {spec.name}: {spec.dtype} {_shape(spec.shape)}", file=out)
    print("outputs:", file=out)
    for spec in summary.outputs:
        print(f"  {spec.name}: {spec.dtype} {_shape(spec.shape)}", file=out)
    try:
        module = OnnxModule(model, backend=backend)
        trainable = {name for name, _ in module.named_onnx_parameters()}
        verdict, ok = "a gradient graph can be built", True
        engine = f"{module.backend} ({module.backend_reason})"
    except OrtBridgeError as exc:
        trainable = summary.differentiable_initializers
        verdict, ok = f"no gradient graph: {exc}", False
        engine = f"none that trains it (backend={backend!r})"
    print(f"float initializers ({len(summary.float_initializers)}):", file=out)
    total = 0
    for name, array in summary.float_initializers.items():
        kind = "trainable" if name in trainable else "frozen"
        total += array.size
        print(
            f"  {name}: {kind:9s} {array.dtype} {tuple(array.shape)} ({array.size:,} values)",
            file=out,
        )
    n_other = len(model.graph.initializer) - len(summary.float_initializers)
    print(
        f"  ({total:,} values in all; {n_other} non-float initializers kept as constants)", file=out
    )
    print(f"engine: {engine}", file=out)
    print(f"training: {verdict}", file=out)
    if check and ok:
        from ._gradcheck import gradcheck

        report = gradcheck(module.eval(), *_random_inputs(summary.inputs))
        print(report, file=out)
        ok = report.passed
    return ok


def _random_inputs(specs):
    """Inputs of the declared shapes: floats from a normal law, other types zeros."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    tensors = []
    for spec in specs:
        shape = [d if isinstance(d, int) else 2 for d in (spec.shape or [])]
        if spec.dtype.kind == "f":
            value = rng.standard_normal(shape).astype(spec.dtype)
        else:
            value = np.zeros(shape, dtype=spec.dtype)
        tensors.append(torch.from_numpy(value))
    return tensors


def _shape(shape) -> str:
    if shape is None:
        return "(unknown shape)"
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
