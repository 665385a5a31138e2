"""``python -m ortbridge inspect MODEL.onnx``: what OnnxModule would make of a model.

:func:`describe_model` gathers it in a dict (what ``--json`` prints);
:func:`inspect_model` prints it as text or JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import sys

import onnx

from .. import _prepare
from .._prepare._onnx_utils import FLOAT_TYPES
from .._prepare.quantized import quantized_weights, recurrent_weights
from .._runtime import _ort
from ..exceptions import OrtBridgeError


def inspect_model(
    path: str, out=None, backend: str = "auto", check: bool = False, as_json: bool = False
) -> bool:
    """Print what :func:`describe_model` finds, as text or JSON; True if the model trains.

    ``check``: also compare the gradients with finite differences
    (:func:`ortbridge.gradcheck`) on random inputs of the graph's shapes, a
    symbolic dimension taken as 2; True then also needs the check to pass.
    """
    out = out if out is not None else sys.stdout
    info = describe_model(path, backend=backend, check=check)
    if as_json:
        print(json.dumps(_json_safe(info), indent=2), file=out)
    else:
        _print_text(info, out)
    return info["training"]["ok"] and (info["check"] is None or info["check"]["passed"])


def describe_model(path: str, backend: str = "auto", check: bool = False) -> dict:
    """The model's graph, the rewrites ortbridge applies, its weights, engine and providers.

    Raises :class:`~ortbridge.OrtBridgeError` when the model cannot be loaded
    or prepared at all.
    """
    import torch

    from .._runtime._sessions import providers_for
    from ..module import OnnxModule

    model = _prepare.load_model(path)
    wrong_shapes = []
    prepared = _prepare.normalize(_prepare.load_model(model), wrong_shapes=wrong_shapes)
    summary = _prepare.summarize(prepared, model)
    half_inputs, half_outputs, half_weights = _prepare.bfloat16_names(model)
    info = {
        "model": str(path),
        "graph": summary.name,
        "producer": " ".join(p for p in (model.producer_name, model.producer_version) if p),
        "ir_version": model.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "nodes": len(model.graph.node),
        "op_types": dict(_op_types(model).most_common()),
        "rewrites": {**_rewrites(model, prepared), "bfloat16_weights": len(half_weights)},
        # Declarations the graph contradicts, replaced by what it computes.
        "wrong_shapes": [
            {
                "name": w.name,
                "where": w.where,
                "declared": list(w.declared),
                "computed": list(w.computed),
            }
            for w in wrong_shapes
        ],
        "inputs": [_spec(s, s.name in half_inputs) for s in summary.inputs],
        "outputs": [_spec(s, s.name in half_outputs) for s in summary.outputs],
    }
    try:
        module = OnnxModule(model, backend=backend)
        trainable = {name for name, _ in module.named_onnx_parameters()}
        info["engine"] = {"backend": module.backend, "reason": module.backend_reason}
        info["training"] = {"ok": True, "error": None}
    except OrtBridgeError as exc:
        module = None
        trainable = summary.default_trainable
        info["engine"] = {"backend": None, "reason": f"none trains it (backend={backend!r})"}
        info["training"] = {"ok": False, "error": str(exc)}
    info["engine"]["requested"] = backend
    ort = _ort.runtime()
    info["providers"] = {
        "used": [p if isinstance(p, str) else p[0] for p in providers_for(torch.device("cpu"))],
        "available": list(ort.get_available_providers()),
        "onnxruntime": ort.__version__,
    }
    info["cuda"] = _cuda(torch, info["providers"]["available"])
    info["initializers"] = [
        {
            "name": name,
            "trainable": name in trainable,
            "from_constant": name in summary.from_constants,
            "dtype": "bfloat16" if name in half_weights else str(array.dtype),
            "shape": list(array.shape),
            "size": int(array.size),
        }
        for name, array in summary.float_initializers.items()
    ]
    quantized = quantized_weights(model)
    recurrent = recurrent_weights(model)
    info["non_float_initializers"] = sum(
        1
        for init in model.graph.initializer
        if init.data_type not in FLOAT_TYPES and init.name not in quantized
    )
    info["quantized"] = {
        "weights": [
            {
                "name": q.name,
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(q.elem_type).name,
                "per": _per(q),
                "trains": "fake quantization" if q.paired else "float",
                # DynamicQuantizeLSTM's: differentiated as ONNX's LSTM of them
                "recurrent": q.name in recurrent,
            }
            for q in quantized.values()
        ],
        # Activations under a QuantizeLinear/DequantizeLinear pair of the file.
        "activation_pairs": sum(
            1
            for n in model.graph.node
            if n.op_type in ("QuantizeLinear", "DynamicQuantizeLinear")
            and n.input[0] not in quantized
        ),
    }
    info["check"] = None
    if check and module is not None:
        from .._gradcheck import gradcheck

        report = gradcheck(module.eval(), *_random_inputs(summary.inputs))
        info["check"] = {**dataclasses.asdict(report), "passed": report.passed}
    return info


def _cuda(torch, available: list[str]) -> dict:
    """Whether onnxruntime's CUDA provider suits torch's CUDA, and if not what to install."""
    found, built_for = _ort.build()
    provider = "CUDAExecutionProvider" in available
    torch_cuda = torch.version.cuda
    # Same major version: the provider loads the CUDA libraries torch's wheels bring.
    match = bool(provider and built_for and torch_cuda) and (
        built_for.split(".")[0] == torch_cuda.split(".")[0]
    )
    hint = None if match else _ort.cuda_hint()
    if match:
        text = (
            f"{found} is built for CUDA {built_for}, torch {torch.__version__} for CUDA "
            f"{torch_cuda}: they match"
        )
    elif not provider:
        text = f"{found} has no CUDAExecutionProvider; {hint}"
    else:
        text = f"{found} is built for CUDA {built_for or '(not recorded)'}; {hint}"
    return {
        "torch": torch_cuda,
        "onnxruntime": built_for,
        "provider": provider,
        "install": hint,
        "text": text,
    }


def _op_types(model: onnx.ModelProto) -> collections.Counter:
    """Nodes of the main graph by op type, ``domain.OpType`` outside the standard domain."""
    return collections.Counter(
        f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        for n in model.graph.node
    )


def _rewrites(model: onnx.ModelProto, prepared: onnx.ModelProto) -> dict:
    """What normalisation (:func:`ortbridge._prepare.normalize`) changed: versions, nodes by
    op type, outputs, names."""

    def opset(m):
        return next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)

    before, after = _op_types(model), _op_types(prepared)
    # Optional outputs named (Dropout's mask, LayerNormalization's statistics):
    # the node keeps its first output, so it is found again by it.
    widths = {n.output[0]: sum(1 for o in n.output if o) for n in model.graph.node if n.output}
    outputs = collections.Counter(
        n.op_type
        for n in prepared.graph.node
        if n.output
        and n.output[0] in widths
        and sum(1 for o in n.output if o) > widths[n.output[0]]
    )
    return {
        "opset": [opset(model), opset(prepared)] if opset(model) != opset(prepared) else None,
        "ir_version": (
            [model.ir_version, prepared.ir_version]
            if model.ir_version != prepared.ir_version
            else None
        ),
        "nodes_removed": dict((before - after).most_common()),
        "nodes_added": dict((after - before).most_common()),
        "outputs_named": dict(outputs.most_common()),
        "nodes_named": sum(1 for n in model.graph.node if not n.name),
    }


def _print_text(info: dict, out) -> None:
    opsets = ", ".join(f"{domain} {version}" for domain, version in info["opsets"].items())
    print(
        f"graph {info['graph']!r}: {info['nodes']} nodes, IR version {info['ir_version']}, "
        f"opsets {opsets}" + (f" (from {info['producer']})" if info["producer"] else ""),
        file=out,
    )
    print(f"op types: {_counts(info['op_types']) or 'none'}", file=out)
    print("inputs:", file=out)
    for spec in info["inputs"]:
        print(f"  {spec['name']}: {spec['dtype']} {_shape(spec['shape'])}", file=out)
    print("outputs:", file=out)
    for spec in info["outputs"]:
        print(f"  {spec['name']}: {spec['dtype']} {_shape(spec['shape'])}", file=out)
    if info["wrong_shapes"]:
        print("declared shapes the graph contradicts (trained as it computes them):", file=out)
        for wrong in info["wrong_shapes"]:
            print(
                f"  {wrong['where']} {wrong['name']!r}: declared {_shape(wrong['declared'])}, "
                f"computed {_shape(wrong['computed'])}",
                file=out,
            )
    lines = _rewrite_lines(info["rewrites"])
    print("rewrites before onnxruntime sees the graph:" + ("" if lines else " none"), file=out)
    for line in lines:
        print(f"  {line}", file=out)
    inits = info["initializers"]
    print(f"float initializers ({len(inits)}):", file=out)
    for init in inits:
        kind = "trainable" if init["trainable"] else "frozen"
        where = ", from a Constant node" if init["from_constant"] else ""
        print(
            f"  {init['name']}: {kind:9s} {init['dtype']} {tuple(init['shape'])} "
            f"({init['size']:,} values{where})",
            file=out,
        )
    quantized = info["quantized"]
    if quantized["weights"] or quantized["activation_pairs"]:
        print(
            f"quantized: {len(quantized['weights'])} integer weights train as float "
            "(dequantized values; saved as the file's integers, same scales and zero "
            f"points), {quantized['activation_pairs']} activations quantized by the file",
            file=out,
        )
        for q in quantized["weights"]:
            how = (
                "under fake quantization (straight-through gradient inside the range)"
                if q["trains"] == "fake quantization"
                else "unquantized (rounded to its step on saving)"
            )
            if q["recurrent"]:
                how += "; its DynamicQuantizeLSTM trains as ONNX's LSTM of the dequantized weights"
            print(f"  {q['name']}: {q['dtype']} per {q['per']}, trains {how}", file=out)
    total = sum(init["size"] for init in inits)
    print(
        f"  ({total:,} values in all; {info['non_float_initializers']} non-float initializers "
        "kept as constants)",
        file=out,
    )
    engine = info["engine"]
    shown = f"{engine['backend']} ({engine['reason']})" if engine["backend"] else engine["reason"]
    print(f"engine: {shown}", file=out)
    providers = info["providers"]
    print(
        f"providers: {', '.join(providers['used'])} on the CPU (onnxruntime "
        f"{providers['onnxruntime']} has {', '.join(providers['available'])})",
        file=out,
    )
    print(f"cuda: {info['cuda']['text']}", file=out)
    training = info["training"]
    verdict = "a gradient graph can be built" if training["ok"] else "no gradient graph: "
    print(f"training: {verdict}{training['error'] or ''}", file=out)
    if info["check"] is not None:
        from .._gradcheck import GradcheckEntry, GradcheckReport

        fields = {f.name for f in dataclasses.fields(GradcheckReport)}
        report = GradcheckReport(**{k: v for k, v in info["check"].items() if k in fields})
        report.entries = [GradcheckEntry(**e) for e in report.entries]
        print(report, file=out)


def _rewrite_lines(rewrites: dict) -> list[str]:
    lines = []
    if rewrites["opset"]:
        old, new = rewrites["opset"]
        lines.append(f"ai.onnx opset {old} -> {new} (onnx's version converter)")
    if rewrites["ir_version"]:
        old, new = rewrites["ir_version"]
        lines.append(f"IR version {old} -> {new}")
    if rewrites["nodes_removed"] or rewrites["nodes_added"]:
        lines.append(
            f"nodes replaced: {_counts(rewrites['nodes_removed']) or 'none'}; "
            f"added: {_counts(rewrites['nodes_added']) or 'none'}"
        )
    if rewrites["outputs_named"]:
        lines.append(f"optional outputs named: {_counts(rewrites['outputs_named'])}")
    if rewrites["nodes_named"]:
        lines.append(f"unnamed nodes named: {rewrites['nodes_named']}")
    if n := rewrites.get("bfloat16_weights"):
        lines.append(
            f"bfloat16 computed in float32 ({n} weight{'s' * (n != 1)}; onnxruntime's CPU "
            "provider has no bfloat16 kernels for most ops)"
        )
    return lines


def _counts(counts: dict) -> str:
    return ", ".join(f"{op} x{n}" for op, n in counts.items())


def _json_safe(value):
    """``value`` with tuples as lists and non-finite floats as None (strict JSON)."""
    if isinstance(value, dict):
        return {key: _json_safe(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _spec(spec, bfloat16: bool = False) -> dict:
    try:
        dtype = "bfloat16" if bfloat16 else str(spec.dtype)
    except (KeyError, TypeError, ValueError):  # not a tensor (a sequence, a map)
        dtype = "?"
    shape = None if spec.shape is None else list(spec.shape)
    return {"name": spec.name, "dtype": dtype, "shape": shape}


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


def _per(weight) -> str:
    """What a quantized weight's scale varies along."""
    if weight.scale.ndim == 2:  # an LSTM's (directions, 4 * hidden)
        return f"axes 0 and {weight.axis}"
    return f"axis {weight.axis}" if weight.scale.size > 1 else "tensor"
