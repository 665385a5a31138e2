"""Preparing a user's ONNX graph for onnxruntime's gradient builder.

Plain graph code, no torch and no onnxruntime: loading and validating a model,
a normalisation pass (rewrites of nodes the gradient builder refuses), the
train/eval variants of a graph, and moving weights to graph inputs.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

from . import _activations
from ._model_checks import check_loaded, check_runnable
from ._onnx_utils import FLOAT_TYPES, node_reads, np_dtype, set_input_shapes
from ._sequence_rewrites import sequences_as_tensors
from .exceptions import NotDifferentiableError, OnnxModelError, OnnxTypeError

# Inputs (by position) through which no gradient flows, per op type.
_NON_DIFFERENTIABLE_SLOTS = {
    "BatchNormalization": {3, 4},
    "Dropout": {1, 2},
    "Reshape": {1},
    "Expand": {1},
    "Tile": {1},
    "Slice": {1, 2, 3, 4},
    "Gather": {1},
    "GatherElements": {1},
    "GatherND": {1},
    "ScatterElements": {1},
    "ScatterND": {1},
    "Pad": {1, 3},
    "Resize": {1, 2, 3},
    "Upsample": {1},
    "Unsqueeze": {1},
    "Squeeze": {1},
    "ReduceSum": {1},
    "ReduceMean": {1},
    "ReduceMax": {1},
    "ReduceMin": {1},
    "ReduceProd": {1},
    "ReduceL2": {1},
    "ReduceLogSumExp": {1},
    "TopK": {1},
    "Split": {1},
    "Where": {0},
    "Clip": {1, 2},
    "Trilu": {1},
    "CumSum": {1},
}
# Ops whose outputs carry no gradient at all.
_NON_DIFFERENTIABLE_OPS = frozenset(
    {
        "Shape",
        "Size",
        "Equal",
        "Less",
        "Greater",
        "LessOrEqual",
        "GreaterOrEqual",
        "Not",
        "And",
        "Or",
        "Xor",
        "ArgMax",
        "ArgMin",
        "NonZero",
        "Range",
        "ConstantOfShape",
        "Round",
        "Sign",
        "Floor",
        "Ceil",
        "IsNaN",
        "IsInf",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
        "EyeLike",
        "OneHot",
    }
)

TRAIN = "train"
EVAL = "eval"


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


def _spec(value_info: onnx.ValueInfoProto) -> TensorSpec:
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


def summarize(model: onnx.ModelProto) -> GraphSummary:
    """Inputs, outputs and float initializers of a normalised model."""
    graph = model.graph
    init_names = {init.name for init in graph.initializer}
    inputs = [_spec(i) for i in graph.input if i.name not in init_names]
    outputs = [_spec(o) for o in graph.output]
    floats = {
        init.name: numpy_helper.to_array(init)
        for init in graph.initializer
        if init.data_type in FLOAT_TYPES
    }
    return GraphSummary(
        name=graph.name or "onnx_graph",
        inputs=inputs,
        outputs=outputs,
        float_initializers=floats,
        differentiable_initializers=_gradient_reachable(model, set(floats)),
    )


def _infer(model: onnx.ModelProto, symbolic: bool = False) -> tuple[dict[str, int], dict]:
    """Element type and shape (ints, None for unknown dimensions) of every named
    tensor that onnx's shape inference can type, in one inference pass.

    ``symbolic``: a symbolic dimension is given by its name, not None.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph shape inference cannot handle still runs
        inferred = model
    graph = inferred.graph
    types = {init.name: init.data_type for init in graph.initializer}
    shapes = {}
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        tensor_type = vi.type.tensor_type
        if tensor_type.elem_type:
            types[vi.name] = tensor_type.elem_type
        if tensor_type.HasField("shape"):
            shapes[vi.name] = tuple(
                d.dim_value
                if d.HasField("dim_value")
                else ((d.dim_param or None) if symbolic else None)
                for d in tensor_type.shape.dim
            )
    for init in graph.initializer:
        shapes.setdefault(init.name, tuple(init.dims))
    return types, shapes


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    return _infer(model)[0]


def _gradient_reachable(model: onnx.ModelProto, candidates: set[str]) -> set[str]:
    """Candidates from which a gradient path leads to a float graph output."""
    types = _elem_types(model)

    def is_float(name):
        return types.get(name, TensorProto.FLOAT) in FLOAT_TYPES

    needed = {o.name for o in model.graph.output if is_float(o.name)}
    # Walk nodes backwards: a node whose float output needs a gradient passes
    # the need on to its differentiable float inputs.
    for node in reversed(_topological(model.graph)):
        if node.op_type in _NON_DIFFERENTIABLE_OPS:
            continue
        if not any(out in needed for out in node.output):
            continue
        skip = _NON_DIFFERENTIABLE_SLOTS.get(node.op_type, ())
        for pos, name in enumerate(node.input):
            if name and pos not in skip and is_float(name):
                needed.add(name)
        # A Loop, Scan or If body reads outer tensors without listing them as
        # inputs (nn.EmbeddingBag's weight, read inside its Loop).
        explicit = set(node.input)
        needed.update(n for n in node_reads(node) if n not in explicit and is_float(n))
    return candidates & needed


def _topological(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes in an order where producers come first (exporters usually comply)."""
    produced = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    remaining, ordered = list(graph.node), []
    while remaining:
        ready = [n for n in remaining if all(i in produced for i in n.input)]
        if not ready:  # inputs from an outer scope or a cycle: keep file order
            ordered.extend(remaining)
            break
        for node in ready:
            produced.update(node.output)
        ordered.extend(ready)
        remaining = [n for n in remaining if all(n is not r for r in ready)]
    return ordered


def _unique(base: str, taken: set[str]) -> str:
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    names |= {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.output)
        names.add(node.name)
    return names


def normalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite nodes onnxruntime's gradient builder refuses into equivalent ones.

    The model is first checked (:func:`._model_checks.check_runnable`): what
    onnxruntime could not load is refused in plain words.

    - ``CastLike`` has no registered gradient: it becomes a ``Cast`` to the
      statically known type of its second input.
    - ``LayerNormalization`` with only its first output fails inside the
      builder: its optional mean and inverse-std outputs are named.
    - ``AveragePool`` over a tensor with a dynamic dimension: onnxruntime
      1.19.2's ``AveragePoolGrad`` kills the process (SIGFPE); it becomes the
      equivalent depthwise ``Conv`` with constant weights.
    - ``Dropout`` without its mask output: the gradient needs the mask.
    - Activations without a registered gradient (ELU, CELU, SELU, Softplus,
      Mish, HardSigmoid, HardSwish, PRelu) become standard ops
      (:mod:`._activations`).
    - ``ReverseSequence`` reads ``Max(sequence_lens, 1)``: the same result
      (a sequence of 0 or 1 element stays as it is), but onnxruntime 1.19.2
      leaves a batch entry of length 0 unwritten, uninitialised memory in the
      output and so in its gradient.
    - Unnamed nodes get a name.
    - An ai.onnx opset below 13 is converted to 13: the gradient builder
      writes nodes in the forms of recent opsets (a ``Gemm`` without ``C``).
    - Sequences of known length read back by constant position (dynamo's
      ``torch.split``: ``SplitToSequence`` + ``SequenceAt``) become tensors
      (:func:`._sequence_rewrites.sequences_as_tensors`): the builder follows
      no weight into a sequence.
    """
    check_runnable(model)
    model = _at_least_opset(model, MIN_OPSET)
    model = sequences_as_tensors(model, loops=False)
    graph = model.graph
    types, shapes = _infer(model)
    taken = _all_names(graph)
    rewritten = []
    for node in graph.node:
        if node.domain == "org.pytorch.aten":
            raise OnnxModelError(
                f"node {node.name!r} ({node.op_type} of domain org.pytorch.aten) runs torch code "
                "through ORTModule's ATen executor, which ortbridge does not use: export the "
                "model in a process where ORTModule was never created"
            )
        if node.op_type == "AveragePool" and node.domain in ("", "ai.onnx"):
            rewritten.extend(_average_pool_as_conv(node, shapes, types, taken))
            continue
        if node.op_type == "ReverseSequence" and node.domain in ("", "ai.onnx"):
            rewritten.extend(_at_least_one_step(node, graph, taken))
            continue
        if node.domain in ("", "ai.onnx") and node.op_type in _activations.ALL_OPS:
            elem = types.get(node.input[0])
            if elem in FLOAT_TYPES and _activations.rewrites(node.op_type, elem):
                fresh = lambda base: _unique(base, taken)  # noqa: E731
                rewritten.extend(_activations.decompose(node, elem, fresh))
                continue
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)
    for node in graph.node:
        if not node.name:  # errors and BatchNorm bookkeeping refer to nodes by name
            node.name = _unique(f"{node.op_type}_{node.output[0]}", taken)
        if node.op_type == "CastLike" and node.domain in ("", "ai.onnx"):
            target = types.get(node.input[1])
            if target is None:
                raise OnnxModelError(
                    f"node {node.name!r} (CastLike): the type of {node.input[1]!r} is unknown, "
                    "the node cannot be rewritten as a Cast for the gradient builder"
                )
            data = node.input[0]
            del node.input[:]
            node.input.append(data)
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("to", target))
            node.op_type = "Cast"
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            # DropoutGrad reads the mask: the builder fails when it is unnamed.
            if len(node.output) < 2:
                node.output.append(_unique(f"{node.output[0]}_mask", taken))
            elif not node.output[1]:
                node.output[1] = _unique(f"{node.output[0]}_mask", taken)
        elif node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            while len(node.output) < 3:
                node.output.append(_unique(f"{node.output[0]}_ln_stat", taken))
            for pos in (1, 2):
                if not node.output[pos]:
                    node.output[pos] = _unique(f"{node.output[0]}_ln_stat", taken)
    return model


#: Lowest ai.onnx opset handed to the gradient builder.
MIN_OPSET = 13


def _at_least_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if current is None or current >= opset:
        return model
    try:
        converted = onnx.version_converter.convert_version(model, opset)
    except Exception as exc:
        raise OnnxModelError(
            f"the model uses ai.onnx opset {current}; onnxruntime's gradient builder needs "
            f"{opset} or later and onnx could not convert it: {exc}"
        ) from exc
    converted.ir_version = max(converted.ir_version, 7)
    return converted


@dataclasses.dataclass
class BatchNormStats:
    """A BatchNormalization node whose running statistics the bridge updates."""

    node_name: str
    output: str
    mean: str
    var: str
    momentum: float


def batch_norm_nodes(model: onnx.ModelProto) -> list[BatchNormStats]:
    """BatchNormalization nodes whose running statistics are float initializers."""
    inits = {i.name for i in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        mean, var = node.input[3], node.input[4]
        if mean in inits and var in inits:
            found.append(
                BatchNormStats(
                    node.name, node.output[0], mean, var, float(attrs.get("momentum", 0.9))
                )
            )
    return found


def values_per_channel(
    model: onnx.ModelProto, batch_norms: list[BatchNormStats], shapes: dict[str, tuple]
) -> list[int | None]:
    """How many values each BatchNormalization averages per channel, for these input shapes.

    ``shapes``: the shape of each graph input. None where shape inference
    cannot tell the node's input shape.
    """
    sized = onnx.ModelProto()
    sized.CopyFrom(model)
    set_input_shapes(sized, shapes)
    try:
        inferred = onnx.shape_inference.infer_shapes(sized)
    except Exception:  # noqa: BLE001 - an unknown count is checked after the run instead
        return [None] * len(batch_norms)
    known = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info]:
        dims = value.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            known[value.name] = [d.dim_value for d in dims]
    inputs = {n.name: n.input[0] for n in model.graph.node if n.op_type == "BatchNormalization"}
    counts = []
    for stats in batch_norms:
        shape = known.get(inputs.get(stats.node_name))
        ok = shape is not None and len(shape) >= 2 and shape[1] > 0
        counts.append(int(np.prod(shape)) // shape[1] if ok else None)
    return counts


def make_variant(
    model: onnx.ModelProto, mode: str, frozen_batch_norm: bool, for_gradient: bool
) -> tuple[onnx.ModelProto, list[str]]:
    """The graph as it computes in ``mode`` (``"train"`` or ``"eval"``).

    Returns the model and the names of the extra outputs it gains (new
    running mean and variance of each BatchNormalization updated in train
    mode, in :func:`batch_norm_nodes` order; only when ``for_gradient`` is
    false: the gradient graph gets them from its own training-mode kernel).

    - Dropout: active in train mode (``training_mode`` forced true), an
      Identity in eval mode.
    - BatchNormalization: batch statistics in train mode; running statistics
      (as elementary ops, since the gradient builder turns an inference-mode
      BatchNormalization into a training-mode one) in eval mode or when
      ``frozen_batch_norm``.
    """
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    graph = variant.graph
    taken = _all_names(graph)
    ranks = _ranks(variant)
    true_name = None
    new_nodes, extra_outputs, batch_norms = [], [], []
    consumed = {name for node in graph.node for name in node.input}
    consumed |= {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            if mode == EVAL:
                if len(node.output) > 1 and node.output[1] in consumed:
                    # The mask is used: keep the node, switched off.
                    _set_dropout_training(node, graph, taken, False)
                    new_nodes.append(node)
                else:
                    new_nodes.append(
                        helper.make_node("Identity", [node.input[0]], [node.output[0]], node.name)
                    )
                continue
            if true_name is None:
                true_name = _set_dropout_training(node, graph, taken, True)
            else:
                _set_dropout_input(node, 2, true_name)
            new_nodes.append(node)
        elif node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            if mode == EVAL or frozen_batch_norm:
                new_nodes.extend(_decompose_batch_norm(node, ranks, taken, graph))
            elif not for_gradient:
                # Inference session in train mode: the training kernel
                # computes batch statistics and the new running statistics.
                _strip_training_attr(node)
                node.attribute.append(helper.make_attribute("training_mode", 1))
                outs = [_unique(f"{node.output[0]}_running_{s}", taken) for s in ("mean", "var")]
                node.output.extend(outs)
                new_nodes.append(node)
                batch_norms.append((node, outs))
            else:
                new_nodes.append(node)
        else:
            new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    for node, (mean, var) in batch_norms:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        elem = _elem_type_of(graph, node.input[4])
        momentum = float(attrs.get("momentum", 0.9))
        x = node.input[0]
        if x not in ranks:
            raise OnnxModelError(
                f"node {node.name!r} (BatchNormalization): the rank of its input {x!r} is "
                "unknown; run onnx.shape_inference on the model or give the input a shape"
            )
        batch_var = _batch_var(graph, x, ranks[x])
        extra_outputs.append(mean)
        extra_outputs.append(unbiased_running_var(graph, x, var, batch_var, momentum, elem))
    for name in extra_outputs:
        graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return variant, extra_outputs


def predicting_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as it predicts: Dropout off, BatchNormalization on running statistics.

    A graph exported in train mode runs Dropout and batch statistics in any
    onnxruntime session; predictions must not. A model with neither node is
    returned as it is.
    """
    ops = {node.op_type for node in model.graph.node}
    if not ops & {"Dropout", "BatchNormalization"}:
        return model
    variant, _ = make_variant(normalize(model), EVAL, False, for_gradient=False)
    return variant


def unbiased_running_var(
    graph: onnx.GraphProto, x: str, new_var: str, batch_var: str, momentum: float, elem: int
) -> str:
    """Append nodes turning onnxruntime's running variance into torch's; return its name.

    onnxruntime updates the running variance with the biased batch variance
    ``v``, torch with the unbiased one, ``n / (n - 1)`` times larger (``n``
    values per channel): torch's value is ``new + (1 - momentum) * v / (n - 1)``.
    The old running variance is not read again: onnxruntime may have updated
    it in place.
    """
    taken = _all_names(graph)

    def new(suffix):
        return _unique(f"{new_var}_{suffix}", taken)

    rate, one = new("rate"), new("one")
    dtype = np_dtype(elem)
    graph.initializer.append(numpy_helper.from_array(np.array(1 - momentum, dtype=dtype), rate))
    graph.initializer.append(numpy_helper.from_array(np.array(1, dtype=dtype), one))
    size, channels, count, count_f, count_m1 = (
        new("size"),
        new("c"),
        new("n"),
        new("nf"),
        new("n_1"),
    )
    share, step, out = new("share"), new("step"), new("unbiased")
    graph.node.extend(
        [
            helper.make_node("Size", [x], [size]),
            helper.make_node("Size", [new_var], [channels]),
            helper.make_node("Div", [size, channels], [count]),
            helper.make_node("Cast", [count], [count_f], to=elem),
            helper.make_node("Sub", [count_f, one], [count_m1]),
            helper.make_node("Div", [batch_var, count_m1], [share]),
            helper.make_node("Mul", [share, rate], [step]),
            helper.make_node("Add", [new_var, step], [out]),
        ]
    )
    return out


def batch_var_from_inv_std(graph: onnx.GraphProto, inv_std: str, epsilon: float, elem: int):
    """Biased batch variance from a saved ``1 / sqrt(var + epsilon)``."""
    taken = _all_names(graph)
    eps, square, inv, out = (_unique(f"{inv_std}_{s}", taken) for s in ("eps", "sq", "inv", "var"))
    graph.initializer.append(numpy_helper.from_array(np.array(epsilon, dtype=np_dtype(elem)), eps))
    graph.node.extend(
        [
            helper.make_node("Mul", [inv_std, inv_std], [square]),
            helper.make_node("Reciprocal", [square], [inv]),
            helper.make_node("Sub", [inv, eps], [out]),
        ]
    )
    return out


def _batch_var(graph: onnx.GraphProto, x: str, rank: int) -> str:
    """Biased per-channel variance of ``x`` (channels on axis 1)."""
    taken = _all_names(graph)
    axes, mean, diff, square, out = (
        _unique(f"{x}_{s}", taken) for s in ("axes", "mean", "diff", "sq", "var")
    )
    reduce = [0, *range(2, rank)]
    graph.initializer.append(numpy_helper.from_array(np.array(reduce, dtype=np.int64), axes))
    graph.node.extend(
        [
            helper.make_node("ReduceMean", [x, axes], [mean], keepdims=1),
            helper.make_node("Sub", [x, mean], [diff]),
            helper.make_node("Mul", [diff, diff], [square]),
            helper.make_node("ReduceMean", [square, axes], [out], keepdims=0),
        ]
    )
    return out


def _strip_training_attr(node):
    keep = [a for a in node.attribute if a.name != "training_mode"]
    del node.attribute[:]
    node.attribute.extend(keep)


def _set_dropout_input(node, pos, name):
    while len(node.input) <= pos:
        node.input.append("")
    node.input[pos] = name


def _set_dropout_training(node, graph, taken, value: bool) -> str:
    name = _unique("ortbridge_training_true" if value else "ortbridge_training_false", taken)
    graph.initializer.append(numpy_helper.from_array(np.array(value), name))
    _set_dropout_input(node, 2, name)
    return name


def _at_least_one_step(node, graph, taken) -> list[onnx.NodeProto]:
    """``node`` (ReverseSequence) reading ``Max(sequence_lens, 1)``."""
    one = _unique(f"{node.name or node.output[0]}/one", taken)
    lens = _unique(f"{node.input[1]}/at_least_one", taken)
    graph.initializer.append(numpy_helper.from_array(np.array(1, np.int64), one))
    clamp = helper.make_node("Max", [node.input[1], one], [lens], name=lens)
    node.input[1] = lens
    return [clamp, node]


def _average_pool_as_conv(node, shapes, types, taken) -> list[onnx.NodeProto]:
    shape = shapes.get(node.input[0])
    if shape is not None and all(d is not None for d in shape):
        return [node]  # static shapes: onnxruntime's own gradient works
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    pads = list(attrs.get("pads", []))
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    exact = (
        shape is not None
        and len(shape) >= 3
        and shape[1] is not None
        and auto_pad == "NOTSET"
        and not attrs.get("ceil_mode", 0)
        and (not any(pads) or attrs.get("count_include_pad", 0))
    )
    if not exact:
        raise NotDifferentiableError(
            f"node {node.name!r} (AveragePool): onnxruntime 1.19.2 crashes computing its "
            "gradient when a dimension is dynamic, and it cannot be rewritten as a Conv "
            "(needs a known channel count, no ceil_mode, no auto_pad, and no padding unless "
            "count_include_pad=1); give the input static dimensions or use MaxPool"
        )
    kernel = list(attrs["kernel_shape"])
    channels = shape[1]
    elem = types.get(node.input[0], TensorProto.FLOAT)
    weight = np.full([channels, 1, *kernel], 1.0 / float(np.prod(kernel)), dtype=np_dtype(elem))
    weight_name = _unique(f"{node.name or 'avgpool'}_weight", taken)
    conv_attrs = {"group": channels, "kernel_shape": kernel}
    for key in ("strides", "pads", "dilations"):
        if key in attrs:
            conv_attrs[key] = list(attrs[key])
    return [
        helper.make_node(
            "Constant", [], [weight_name], value=numpy_helper.from_array(weight, weight_name)
        ),
        helper.make_node(
            "Conv", [node.input[0], weight_name], [node.output[0]], node.name, **conv_attrs
        ),
    ]


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    return {name: len(shape) for name, shape in _infer(model)[1].items()}


def _decompose_batch_norm(node, ranks, taken, graph) -> list[onnx.NodeProto]:
    """Inference-mode BatchNormalization as ops the gradient builder keeps as they are."""
    x, scale, bias, mean, var = node.input[:5]
    rank = ranks.get(x)
    if rank is None:
        raise OnnxModelError(
            f"node {node.name!r} (BatchNormalization): the rank of its input {x!r} is unknown; "
            "run onnx.shape_inference on the model or give the input a shape"
        )
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    eps = float(attrs.get("epsilon", 1e-5))
    prefix = _unique(f"{node.name or 'bn'}_frozen", taken)

    def new(suffix):
        return _unique(f"{prefix}_{suffix}", taken)

    eps_name, shape_name = new("eps"), new("shape")
    graph.initializer.append(numpy_helper.from_array(np.array(eps, dtype=np.float32), eps_name))
    graph.initializer.append(
        numpy_helper.from_array(np.array([-1] + [1] * (rank - 2), dtype=np.int64), shape_name)
    )
    eps_like, var_eps, std, factor = new("eps_like"), new("var_eps"), new("std"), new("factor")
    shift, offset, factor_b, offset_b = (
        new("shift"),
        new("offset"),
        new("factor_b"),
        new("offset_b"),
    )
    scaled = new("scaled")
    return [
        helper.make_node("Cast", [eps_name], [eps_like], to=_elem_type_of(graph, var)),
        helper.make_node("Add", [var, eps_like], [var_eps]),
        helper.make_node("Sqrt", [var_eps], [std]),
        helper.make_node("Div", [scale, std], [factor]),
        helper.make_node("Mul", [mean, factor], [shift]),
        helper.make_node("Sub", [bias, shift], [offset]),
        helper.make_node("Reshape", [factor, shape_name], [factor_b]),
        helper.make_node("Reshape", [offset, shape_name], [offset_b]),
        helper.make_node("Mul", [x, factor_b], [scaled]),
        helper.make_node("Add", [scaled, offset_b], [node.output[0]], name=node.name),
    ]


def _elem_type_of(graph, name) -> int:
    for init in graph.initializer:
        if init.name == name:
            return init.data_type
    for vi in list(graph.input) + list(graph.value_info):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type.tensor_type.elem_type
    return TensorProto.FLOAT


def weights_as_inputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """Move the initializers ``names`` to graph inputs (in that order, after the user inputs)."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    moved = set(names)
    keep = [init for init in graph.initializer if init.name not in moved]
    # Models of IR version < 4 also list their initializers as inputs.
    inputs = [i for i in graph.input if i.name not in moved]
    del graph.input[:]
    graph.input.extend(inputs)
    for name in names:
        init = inits[name]
        graph.input.append(helper.make_tensor_value_info(name, init.data_type, list(init.dims)))
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return model


def with_weights(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers ``weights`` hold new values."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in weights:
            value = np.ascontiguousarray(weights[init.name]).astype(np_dtype(init.data_type))
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    return out
