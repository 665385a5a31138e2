"""A layer's LoRA adapters in onnxruntime's adapter format (``.onnx_adapter``).

onnxruntime's multi-LoRA serving (``RunOptions.add_active_adapter``, and
onnxruntime-genai) feeds an adapter's parameters to graph inputs of the same
names. So the base file reads each adapted weight ``W`` as

    W = W.lora_base + Reshape(MatMul(W.lora_B, W.lora_A), shape of W)

with ``W.lora_A`` (rank, columns) and ``W.lora_B`` (rows, rank) graph inputs
whose rank is symbolic, defaulting to initializers of zeros: run without an
adapter, the file is the model before fine-tuning. The adapter file holds
``A`` and ``scale * B``, so adapters of any rank and alpha fit one base file.
A branch beside a 4-bit product (``Y = MatMulNBits(X) + (X @ A) @ B``) reads
its ``<packed weight>.lora_A`` (in, rank) and ``.lora_B`` (rank, out) as
such inputs too.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch.nn.utils import parametrize

from ._module_weights import weight_array
from ._prepare import with_weights
from ._prepare._onnx_utils import FLOAT_TYPES, attr
from ._prepare.quantized import quantized_weights
from ._runtime import _ort
from .exceptions import MissingDependencyError, OnnxInputError

_RANK = "lora_rank"


def adapted(layer) -> dict[str, tuple[torch.Tensor, object]]:
    """Initializer name -> (its weight before the update, the LowRank update)."""
    from .adapters import LowRank

    found = {}
    for name in layer._weight_names:
        path = layer._onnx_names[name]
        owner = layer._owner(path)
        if not parametrize.is_parametrized(owner, path[-1]):
            continue
        chain = owner.parametrizations[path[-1]]
        updates = [p for p in chain if isinstance(p, LowRank)]
        if updates and len(chain) > 1:
            raise OnnxInputError(
                f"weight {name!r} has other parametrizations beside its LowRank update: "
                "an adapter file holds only the update; remove them, or ship the merged file"
            )
        if updates:
            found[name] = (chain.original, updates[0])
    return found


def base_model(layer) -> onnx.ModelProto:
    """The layer's file with each adapted weight read through adapter inputs,
    and each branch beside a 4-bit product reading its adapters as inputs."""
    updates = adapted(layer)
    side = sorted(side_adapters(layer._original))
    if not updates:
        if side:
            return _branches_as_inputs(layer.to_onnx(), side)
        raise OnnxInputError(
            "the layer has no LowRank update: call ortbridge.lora() on it first, or ship "
            "to_onnx()'s file"
        )
    held = sorted(set(updates) & set(quantized_weights(layer._original)))
    if held:
        # The module rounds W + B @ A to the file's integers; an adapter file
        # would add B @ A unrounded to the rounded W: another function.
        raise OnnxInputError(
            f"weight {held[0]!r} is quantized in the file ({len(held)} adapted weights are): "
            "its update trains under the file's fake quantization, which an adapter beside "
            "the int8 weight does not compute; ship save()'s merged int8 file, or "
            "save(path, quantized=False)'s float model"
        )
    model = with_weights(
        layer.to_onnx(),
        {name: w.detach().cpu().numpy() for name, (w, _) in updates.items()},
    )
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    producers = {
        out: node for node in graph.node if node.op_type == "Constant" for out in node.output
    }
    nodes = []
    for name, (weight, update) in updates.items():
        base = f"{name}.lora_base"
        if name in inits:
            inits[name].name = base
            elem = inits[name].data_type
        elif name in producers and producers[name].attribute[0].name == "value":
            node = producers[name]  # a Constant node's weight becomes an initializer
            graph.node.remove(node)
            graph.initializer.append(numpy_helper.from_array(_value(node), base))
            elem = node.attribute[0].t.data_type
        else:
            raise OnnxInputError(
                f"weight {name!r} is neither an initializer nor a Constant node's value of the "
                "main graph: its adapter cannot be written; ship to_onnx()'s merged file"
            )
        for i, value_info in enumerate(graph.input):
            if value_info.name == name:  # an initializer also listed as input (IR < 4)
                del graph.input[i]
                break
        rank, rows = update.A.shape[0], weight.shape[0]
        columns = update.A.shape[1]
        a_name, b_name, shape_name = f"{name}.lora_A", f"{name}.lora_B", f"{name}.lora_shape"
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        graph.input.append(helper.make_tensor_value_info(a_name, elem, [_RANK, columns]))
        graph.input.append(helper.make_tensor_value_info(b_name, elem, [rows, _RANK]))
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.zeros((rank, columns), dtype), a_name),
                numpy_helper.from_array(np.zeros((rows, rank), dtype), b_name),
                numpy_helper.from_array(np.array(weight.shape, np.int64), shape_name),
            ]
        )
        if model.ir_version < 4:  # every initializer an input
            graph.input.append(helper.make_tensor_value_info(base, elem, list(weight.shape)))
            graph.input.append(
                helper.make_tensor_value_info(shape_name, onnx.TensorProto.INT64, [weight.dim()])
            )
        product, delta = f"{name}.lora_product", f"{name}.lora_delta"
        nodes += [
            helper.make_node("MatMul", [b_name, a_name], [product], name=f"{name}/lora_matmul"),
            helper.make_node(
                "Reshape", [product, shape_name], [delta], name=f"{name}/lora_reshape"
            ),
            helper.make_node("Add", [base, delta], [name], name=f"{name}/lora_add"),
        ]
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)  # before every reader of the weights
    return _branches_as_inputs(model, side) if side else model


def _branches_as_inputs(model: onnx.ModelProto, side: list[str]) -> onnx.ModelProto:
    """The branches beside 4-bit products (:func:`with_side_adapters`) reading
    their ``A`` (in, rank) and ``B`` (rank, out) as graph inputs of symbolic
    rank, defaulting to zeros (no branch: the 4-bit file as it was), their
    scale 1 (the adapter file holds ``scale * B``). In place, returned."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    for name in side:
        init = inits[name]
        shape = list(init.dims)
        shape[1 if name.endswith(".lora_A") else 0] = _RANK
        graph.input.append(helper.make_tensor_value_info(name, init.data_type, shape))
        dims = [d if isinstance(d, int) else 0 for d in shape]
        dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        init.CopyFrom(numpy_helper.from_array(np.zeros(dims, dtype), name))
        scale = _branch_scale(inits, name)
        if scale is not None:
            scale.CopyFrom(numpy_helper.from_array(np.ones((), dtype), scale.name))
    return model


def _value(node: onnx.NodeProto) -> np.ndarray:
    return numpy_helper.to_array(node.attribute[0].t)


def adapter_parameters(layer) -> dict[str, np.ndarray]:
    """The adapter file's values: ``A`` and ``scale * B`` of each update."""
    params = {}
    for name, (_, update) in adapted(layer).items():
        with torch.no_grad():
            params[f"{name}.lora_A"] = update.A.detach().cpu().numpy()
            params[f"{name}.lora_B"] = (update.B * update.scale).detach().cpu().numpy()
    inits = {i.name: i for i in layer._original.graph.initializer}
    for name in sorted(side_adapters(layer._original)):
        value = weight_array(layer.onnx_weight(name))
        if name.endswith(".lora_B"):  # the branch's scale goes into B, as above
            scale = _branch_scale(inits, name)
            value = value * (numpy_helper.to_array(scale) if scale is not None else 1)
        params[name] = value
    return params


def write_adapter(params: dict[str, np.ndarray], path: str | os.PathLike) -> None:
    """Write ``params`` as an onnxruntime adapter file (maintained onnxruntime >= 1.20)."""
    ort = _ort.runtime()
    if not hasattr(ort, "AdapterFormat"):
        raise MissingDependencyError(
            f"onnxruntime {ort.__version__} cannot write adapter files (AdapterFormat came in "
            "onnxruntime 1.20; the training build is 1.19.2): install maintained onnxruntime "
            '(`pip install "ortbridge[ort]"`) to write them, or ship to_onnx()\'s merged file'
        )
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters(
        {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}
    )
    adapter.export_adapter(os.fspath(path))


def _branch_scale(inits: dict, adapter: str) -> onnx.TensorProto | None:
    """The scale initializer of the branch ``adapter`` (``<packed>.lora_A`` or
    ``.lora_B``) belongs to, as :func:`with_side_adapters` names it."""
    return inits.get(f"{adapter.rsplit('.lora_', 1)[0]}.lora_scale")


def branch_products(model: onnx.ModelProto, patterns, quantized: bool = False) -> list:
    """(node, weight name) of the main graph's products an adapter goes beside,
    whose weight ``patterns`` match (all where None) and that have none yet:
    4-bit ``MatMulNBits`` (their packed weight: no update can be merged into
    it), and with ``quantized`` each ``MatMul`` or ``Gemm`` reading an integer
    weight of two axes through a ``DequantizeLinear`` (the QLoRA form: the
    integers stay, the adapters beside them float)."""
    import fnmatch

    adapted = side_adapters(model)
    integers = {
        i.name
        for i in model.graph.initializer
        if i.data_type not in FLOAT_TYPES and len(i.dims) == 2
    }
    dequantized = {
        node.output[0]: node.input[0]
        for node in model.graph.node
        if node.op_type == "DequantizeLinear" and node.input[0] in integers
    }
    found = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            weight = node.input[1]
        elif quantized and node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx"):
            weight = dequantized.get(node.input[1])
            if weight is None or attr(node, "transA", 0):
                continue
        else:
            continue
        if f"{weight}.lora_A" in adapted:
            continue
        if not patterns or any(fnmatch.fnmatchcase(weight, p) for p in patterns):
            found.append((node, weight))
    return found


def side_adapters(model: onnx.ModelProto) -> set[str]:
    """The adapters of the branches :func:`with_side_adapters` wrote in ``model``."""
    return {
        node.input[1]
        for node in model.graph.node
        if node.op_type == "MatMul" and node.name.endswith(("/lora_down", "/lora_up"))
    }


def with_side_adapters(model: onnx.ModelProto, products, rank: int, scale: float) -> list[str]:
    """Put a low-rank branch beside each of ``products`` (:func:`branch_products`)
    in ``model``: ``Y = product(X) + scale * (X @ A) @ B``, ``A`` (K, rank)
    drawn as nn.Linear's weight is, ``B`` (rank, N) zeros, float initializers
    named ``<weight>.lora_A`` / ``.lora_B``. In place; the adapters' names."""
    graph = model.graph
    types = {i.name: i.data_type for i in graph.initializer}
    dims = {i.name: list(i.dims) for i in graph.initializer}
    scales = {n.input[0]: n.input[1] for n in graph.node if n.op_type == "DequantizeLinear"}
    added = []
    for node, packed in products:
        if node.op_type == "MatMulNBits":
            k, n = attr(node, "K", 0), attr(node, "N", 0)
            elem = types.get(node.input[2], onnx.TensorProto.FLOAT)  # the scales' float type
        else:  # the integers' (K, N), or (N, K) under a Gemm's transB
            k, n = dims[packed][::-1] if attr(node, "transB", 0) else dims[packed]
            elem = types.get(scales.get(packed, ""), onnx.TensorProto.FLOAT)
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        a = torch.empty(rank, k)
        torch.nn.init.kaiming_uniform_(a, a=5**0.5)  # as LowRank's A (rank, K)
        a_name, b_name, s_name = f"{packed}.lora_A", f"{packed}.lora_B", f"{packed}.lora_scale"
        graph.initializer.extend(
            [
                numpy_helper.from_array(a.T.numpy().astype(dtype), a_name),
                numpy_helper.from_array(np.zeros((rank, n), dtype), b_name),
                numpy_helper.from_array(np.array(scale, dtype), s_name),
            ]
        )
        out = node.output[0]
        base, down, up, scaled = (f"{out}/lora_{s}" for s in ("base", "down", "up", "scaled"))
        node.output[0] = base
        branch = [
            helper.make_node("MatMul", [node.input[0], a_name], [down], name=f"{packed}/lora_down"),
            helper.make_node("MatMul", [down, b_name], [up], name=f"{packed}/lora_up"),
            helper.make_node("Mul", [up, s_name], [scaled], name=f"{packed}/lora_scale"),
            helper.make_node("Add", [base, scaled], [out], name=f"{packed}/lora_add"),
        ]
        at = list(graph.node).index(node) + 1
        for offset, new in enumerate(branch):
            graph.node.insert(at + offset, new)
        added += [a_name, b_name]
    return added
