"""A user's model as given: loading and validating it, and what the bridge must know of it.

:func:`load_model` reads a path, bytes or ``onnx.ModelProto`` into a private
copy; :func:`summarize` lists the inputs, the outputs, the float initializers
and those a gradient can reach (a static walk over the nodes through which
gradients flow).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..exceptions import OnnxModelError, OnnxTypeError
from . import _weights
from ._checks import check_loaded
from ._lookup import _elem_types
from ._onnx_utils import FLOAT_TYPES, all_graphs, node_reads, np_dtype, topological
from .quantized._dynamic import rounded_bias


def load_model(model) -> onnx.ModelProto:
    """Return a private copy of ``model`` (a path, bytes or ``onnx.ModelProto``)."""
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return check_loaded(copy, "the model given")
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _parse(bytes(model), "the bytes given")
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise OnnxModelError(f"ONNX file {path!r} does not exist")
        try:
            # onnx.load also reads weights stored as external data beside the file.
            loaded = onnx.load(path)
        except Exception as exc:
            raise OnnxModelError(f"file {path!r} is not a valid ONNX model: {exc}") from exc
        return check_loaded(loaded, f"file {path!r}")
    raise OnnxTypeError(
        f"model must be a path, bytes or onnx.ModelProto, got {type(model).__name__}"
    )


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise OnnxModelError(f"{where} is not a valid ONNX model: {exc}") from exc
    return check_loaded(model, where)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, element type and shape (ints or symbolic names, None if unknown)."""

    name: str
    elem_type: int
    shape: tuple | None

    @property
    def dtype(self) -> np.dtype:
        return np_dtype(self.elem_type)


def tensor_spec(value_info: onnx.ValueInfoProto) -> TensorSpec:
    """Name, element type and shape (ints, names of symbolic sizes, None) of a value."""
    tensor_type = value_info.type.tensor_type
    shape = None
    if tensor_type.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor_type.shape.dim
        )
    return TensorSpec(value_info.name, tensor_type.elem_type, shape)


@dataclasses.dataclass
class GraphSummary:
    """What the bridge needs to know about a user's graph."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    float_initializers: dict[str, np.ndarray]
    differentiable_initializers: set[str]
    #: What ``trainable=None`` trains: the weights a gradient reaches
    #: (:mod:`._weights`; not the constants of the function).
    default_trainable: set[str] = dataclasses.field(default_factory=set)
    #: Float initializers the file held in ``Constant`` nodes.
    from_constants: set[str] = dataclasses.field(default_factory=set)
    #: Float inputs and initializers the outputs depend on only through ops
    #: of zero derivative (Round, Floor, Ceil, Sign): their gradient is zeros,
    #: as torch's is, not None (AdamW decays a zero gradient, skips a None).
    zero_gradient: set[str] = dataclasses.field(default_factory=set)


def summarize(model: onnx.ModelProto, original: onnx.ModelProto | None = None) -> GraphSummary:
    """Inputs, outputs and float initializers of a normalised model.

    ``original`` (the model as given, before :func:`._normalize.normalize`) is
    where the weights' roles are read: normalisation rewrites some layers
    into elementary ops (PRelu, AveragePool) that no longer show them.
    """
    graph = model.graph
    source = original if original is not None else model
    init_names = {init.name for init in graph.initializer}
    inputs = [tensor_spec(i) for i in graph.input if i.name not in init_names]
    outputs = [tensor_spec(o) for o in graph.output]
    if len(source.graph.output) == len(outputs):  # names as the file gives them
        # (normalisation renames an output that is an input)
        outputs = [
            dataclasses.replace(spec, name=given.name)
            for spec, given in zip(outputs, source.graph.output)
        ]
    floats = {
        init.name: numpy_helper.to_array(init)
        for init in graph.initializer
        if init.data_type in FLOAT_TYPES
    }
    float_inputs = {s.name for s in inputs if s.elem_type in FLOAT_TYPES}
    reachable = _gradient_reachable(model, set(floats) | float_inputs)
    zero = _gradient_reachable(model, set(floats) | float_inputs, through_zero=True) - reachable
    reachable = (reachable | zero) & set(floats)
    # The quantized weights normalisation lifted: integers in the file, float here.
    given = {init.name: init.data_type for init in source.graph.initializer}
    lifted = {n for n in floats if n in given and given[n] not in FLOAT_TYPES}
    _warn_unreached(model, lifted - reachable)
    kinds = _weights.roles(source)
    constants = {
        node.output[0]
        for g in all_graphs(source.graph)
        for node in g.node
        if node.op_type == "Constant" and node.output
    }
    return GraphSummary(
        name=graph.name or "onnx_graph",
        inputs=inputs,
        outputs=outputs,
        float_initializers=floats,
        differentiable_initializers=reachable,
        default_trainable={
            n
            for n in reachable - _weights.scales_only(model)
            if kinds.get(n, _weights.WEIGHT) == _weights.WEIGHT
        },  # fmt: skip
        from_constants=constants & set(floats),
        zero_gradient=zero,
    )


#: Nodes that read a weight's or an activation's integers as ortbridge's
#: gradient does (pairs, integer products, a weight's parts joined).
_READ_AS_QUANTIZED = frozenset(
    {"DequantizeLinear", "MatMulInteger", "ConvInteger", "Concat", "DynamicQuantizeLSTM"}
)


def _warn_unreached(model: onnx.ModelProto, unreached: set[str]) -> None:
    """Name the lifted quantized weights no gradient reaches (the default
    freezes them): an op the file runs on integers between them and the
    outputs (one not read as its float op) stops it, named where there is
    one, or the outputs they reach are not float."""
    if not unreached:
        return
    quantized = {n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    blocking = next(
        (
            n for n in model.graph.node
            if n.op_type not in _READ_AS_QUANTIZED and set(n.input) & quantized
        ),
        None,
    )  # fmt: skip
    where = (
        f" (node {blocking.name!r}, op type {blocking.op_type}, reads quantized integers)"
        if blocking is not None
        else " (the outputs they lead to are not float: an ArgMax's indices ...)"
    )
    warnings.warn(
        f"{len(unreached)} quantized weights stay frozen: no gradient reaches them from the "
        f"file's float outputs{where}: {sorted(unreached)[:5]}; python -m ortbridge inspect "
        "lists what trains",
        stacklevel=4,
    )


def _gradient_reachable(
    model: onnx.ModelProto, candidates: set[str], through_zero: bool = False
) -> set[str]:
    """Candidates from which a gradient path leads to a float graph output;
    ``through_zero``: also through ops whose derivative is zero (Round ...)."""
    types = _elem_types(model)

    def is_float(name):
        return types.get(name, TensorProto.FLOAT) in FLOAT_TYPES

    needed = {o.name for o in model.graph.output if is_float(o.name)}
    # The integer sums of ConvInteger / MatMulInteger and the bias adds on them
    # (the float bias each adds, rounded: read unrounded for the gradient).
    sums: set[str] = set()
    biases: dict[str, str] = {}
    producer = {out: node for node in model.graph.node for out in node.output}
    inits = {i.name: i for i in model.graph.initializer}
    ordered = topological(model.graph)
    for node in ordered:
        if node.op_type in ("ConvInteger", "MatMulInteger"):
            sums.update(node.output)
        elif node.op_type == "Add" and any(i in sums for i in node.input):
            sums.update(node.output)
            product = next(i for i in node.input if i in sums)
            bias = rounded_bias(node, product, producer, inits)
            if bias:
                biases[node.output[0]] = bias
    # A quantized tensor needs a gradient where the float one it dequantizes to does.
    # Walk nodes backwards: a node whose float output needs a gradient passes
    # the need on to its differentiable float inputs.
    passing = _weights.ZERO_DERIVATIVE_OPS if through_zero else ()
    for node in reversed(ordered):
        if node.op_type in _weights.NON_DIFFERENTIABLE_OPS and node.op_type not in passing:
            continue
        if not any(out in needed for out in node.output):
            continue
        skip = _weights.FIXED_SLOTS.get(node.op_type, ())
        # (a Concat of integers joins a weight's per-direction fake quantizations;
        # a Cast or Add of an integer product's sum rescales it or adds its bias)
        straight = (
            node.op_type in _weights.STRAIGHT_THROUGH
            or (node.op_type == "Concat" and not is_float(node.output[0]))
            or (node.op_type in ("Cast", "Add") and any(i in sums for i in node.input))
        )
        integers = _weights.STRAIGHT_THROUGH_SLOTS.get(node.op_type, ())
        if node.output and node.output[0] in biases:
            needed.add(biases[node.output[0]])
        for pos, name in enumerate(node.input):
            if name and pos not in skip and (is_float(name) or straight or pos in integers):
                needed.add(name)
        # A Loop, Scan or If body reads outer tensors without listing them as
        # inputs (nn.EmbeddingBag's weight, read inside its Loop).
        explicit = set(node.input)
        needed.update(n for n in node_reads(node) if n not in explicit and is_float(n))
    return candidates & needed
