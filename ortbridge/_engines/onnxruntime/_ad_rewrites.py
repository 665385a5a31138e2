"""Graph rewrites that let onnx-ad 0.3.0 differentiate a graph correctly.

:func:`prepare_for_reverse` runs before ``onnx_ad.reverse``. Each rewrite
keeps the forward values (exactly, or to float rounding where noted) and
works around one onnx-ad defect, each checked against finite differences in
``tests/engines/test_ad_rewrites.py``, which also fails once onnx-ad fixes one:

- Shape arithmetic (``Shape``, ``Gather``, ``Concat``, ...) on static
  shapes: folded to constants, as onnx-ad folds it after these rewrites, so
  that the rewrites below see the sizes and operands it computes.
- ai.onnx opset below 16: upgraded. The adjoints of Gather, GatherND,
  GatherElements, SoftmaxCrossEntropyLoss and MaxPool scatter with
  ``reduction="add"`` (opset 16).
- ``CastLike``: a ``Cast`` to the statically known type. onnx-ad counts the
  "like" operand as data, which makes it work on adjoints nobody reads.
- ``Pow`` of a float base with an integer exponent: the exponent is cast to
  the base's type (refused for non-double bases; rounding only).
- Reductions with an empty constant ``axes``: onnx-ad reduces nothing (the
  gradient of a mean is 1, not 1/n). Without ``noop_with_empty_axes`` the
  operand goes (reduce all); with it, ReduceL1/L2/SumSquare become the
  ``Abs``/``Mul`` onnxruntime computes in their place.
- Reductions of a statically empty tensor: the adjoint has the wrong shape
  or divides by zero. They read ``ConstantOfShape(Shape(x))``, equal to
  ``x`` (no elements) and constant, so the gradient is the empty one.
- ``Pad`` with negative widths: a ``Slice`` then a ``Pad``.
- ``Pad`` in reflect, edge or wrap mode (onnx-ad refuses them): a ``Gather``
  per padded axis (:mod:`._ad_rewrites_pad`; Silero VAD's STFT pads by
  reflection), and ``Pad`` whose widths the graph computes from constants
  and static shapes: onnx-ad reads widths from a constant only.
- ``Slice`` with steps other than 1 (onnx-ad refuses them; Swin's patch
  merging): a ``Gather`` per strided axis (:mod:`._ad_rewrites_slice`).
- ``SpaceToDepth`` mode CRD (opset 28), differentiated as DCR: a
  ``Reshape``, ``Transpose``, ``Reshape`` (static channels and sizes).
- ``Resize`` (tf_crop_and_resize) with an ``extrapolation_value``: onnx-ad
  takes the fill for a derivative. It becomes a Resize filling 0 plus a
  constant holding the fill where the crop leaves the input.
- Inference ``BatchNormalization`` whose mean or variance is not a
  constant: elementwise ops (onnx-ad gives those two a zero gradient).
- Conv, ConvTranspose and pools: :mod:`._ad_rewrites_conv`.
- onnxruntime's fused transformer nodes (com.microsoft ``SkipLayerNormalization``,
  ``BiasGelu``, ``FusedMatMul`` ...): the standard ops they compute
  (:mod:`._ad_rewrites_fused`).
- Sequences (onnx-ad has no rule for any sequence operator): those of
  known length read by constant position, and loops appending to one, as
  tensors (:mod:`ortbridge._prepare._sequences`).
- In subgraph bodies (Loop, If, Scan): ``CastLike`` as above, and a
  ``Slice`` of a float tensor whose bounds the body computes (onnx-ad
  differentiates constant bounds only; dynamo's ``nn.EmbeddingBag`` slices
  each bag's rows so) as a ``Gather`` of the ``Range`` of the clamped bounds
  (:mod:`._ad_rewrites_bodies`).

Otherwise only the main graph is rewritten, not subgraph bodies. Nodes
onnx-ad gets wrong and that stay are named by :func:`known_wrong`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

from ortbridge._prepare._lookup import _all_names, _infer, _unique
from ortbridge._prepare._onnx_utils import FLOAT_TYPES, NodeBuilder, attr, np_dtype
from ortbridge._prepare._sequences import sequences_as_tensors
from ortbridge._prepare.quantized._dynamic import integer_products_as_pairs
from ortbridge.exceptions import OnnxModelError

from . import _ad_rewrites_conv as conv
from ._ad_rewrites_bodies import _inferred, _opset, rewrite_bodies
from ._ad_rewrites_conv import copy_node, ints
from ._ad_rewrites_fused import declare_foreign_ranks, fused_as_standard
from ._ad_rewrites_pad import copying_pad
from ._ad_rewrites_quant import fake_quantize_nodes, quantized_lstms_as_float
from ._ad_rewrites_slice import strided_slice

REDUCTIONS = frozenset(
    {
        "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
        "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare", "ReduceLogSum",
    }
)  # fmt: skip
# What onnxruntime computes for a reduction with no axes and noop_with_empty_axes=1
# where that is not the identity onnx-ad differentiates (ReduceLogSum is expanded right).
_NOOP_ELEMENTWISE = {"ReduceL1": "Abs", "ReduceL2": "Abs", "ReduceSumSquare": "Mul"}
_POOLS = frozenset({"MaxPool", "AveragePool", "LpPool"})
_INT_TYPES = frozenset(
    {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64}
    | {TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}
)


def upgrade_opset(model: onnx.ModelProto, minimum: int = 16) -> onnx.ModelProto:
    """``model`` with its ai.onnx opset raised to at least ``minimum``.

    The IR version is raised to the lowest one that allows the new opset,
    never lowered. A model already there is returned as it is; one onnx's
    version converter cannot convert raises :class:`OnnxModelError`.

    Examples
    --------
    >>> from onnx import helper
    >>> x = helper.make_tensor_value_info("x", 1, [2])
    >>> graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
    ...                           [helper.make_tensor_value_info("y", 1, [2])])
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    >>> model.ir_version = 7
    >>> new = upgrade_opset(model)
    >>> new.opset_import[0].version, new.ir_version
    (16, 8)
    """
    current = _opset(model)
    if current >= minimum:
        return model
    try:
        upgraded = onnx.version_converter.convert_version(model, minimum)
    except Exception as exc:  # the converter raises bare RuntimeErrors and more
        raise OnnxModelError(
            f"onnx's version converter cannot take this model from ai.onnx opset {current} "
            f"to {minimum} ({exc}); re-export it at opset {minimum} or later"
        ) from exc
    # The converter keeps the old IR version, which may predate the new opset.
    needed = helper.find_min_ir_version_for(list(upgraded.opset_import), ignore_unknown=True)
    upgraded.ir_version = max(model.ir_version, needed)
    return upgraded


def prepare_for_reverse(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` rewritten so that ``onnx_ad.reverse`` differentiates it correctly.

    Trained weights must already be graph inputs. The forward values do not
    change; the rewrites are listed in :mod:`ortbridge._engines.onnxruntime._ad_rewrites`. Nodes
    that need a static size which is unknown are left as they are.

    Examples
    --------
    >>> import numpy as np
    >>> from onnx import helper, numpy_helper
    >>> axes = numpy_helper.from_array(np.zeros(0, np.int64), "axes")
    >>> graph = helper.make_graph(
    ...     [helper.make_node("ReduceMean", ["x", "axes"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("x", 1, [2, 3])],
    ...     [helper.make_tensor_value_info("y", 1, None)], [axes])
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    >>> list(prepare_for_reverse(model).graph.node[0].input)
    ['x']
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    try:
        model = upgrade_opset(copy)
    except OnnxModelError:  # onnx-ad then refuses, by name, the nodes that need opset 16
        model = copy
    integer_products_as_pairs(model)  # the file's ConvInteger / MatMulInteger, in float
    model = declare_foreign_ranks(fused_as_standard(quantized_lstms_as_float(model)))
    model = _shapes_folded(rewrite_bodies(sequences_as_tensors(model)))
    graph = model.graph
    g = _Graph(model)
    taken = _all_names(graph)
    rewritten, changed = [], set()
    for node in graph.node:
        new = None
        if node.domain in ("", "ai.onnx") and node.input:
            elem = g.types.get(node.input[0], TensorProto.FLOAT)
            fresh = lambda base: _unique(base, taken)  # noqa: E731
            b = NodeBuilder(elem, fresh, prefix=f"{node.output[0]}_")
            new = _rewrite(node, b, g)
        if new is not None:
            changed.update(node.output)
        rewritten.extend([node] if new is None else new)
    del graph.node[:]
    graph.node.extend(rewritten)
    return fake_quantize_nodes(_reinferred(model, changed))


def _shapes_folded(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its shape arithmetic folded to constants, as onnx-ad folds it
    (but only after these rewrites): a grouped Conv fed by ``Reshape(x,
    Concat(Shape(..)..))``, as exporters write with dynamic axes, then has the
    static shape its rewrite needs once the input shapes are set. After the
    sequence rewrites, which read the loops and sequences as exported."""
    from ._fold import fold_constants

    return fold_constants(model)


def known_wrong(node: onnx.NodeProto) -> str | None:
    """Why onnx-ad 0.3.0 silently differentiates ``node`` wrong, or None.

    For nodes :func:`prepare_for_reverse` could not rewrite: an engine
    refuses a graph in which such a node lies on a gradient path.

    Examples
    --------
    >>> from onnx import helper
    >>> known_wrong(helper.make_node("Det", ["a"], ["d"]))
    'onnx-ad 0.3.0 gives Det a zero derivative (the true one is det(A) inv(A)^T)'
    >>> known_wrong(helper.make_node("Relu", ["a"], ["b"])) is None
    True
    """
    if node.domain not in ("", "ai.onnx"):
        return None
    kind = node.op_type
    if kind == "Det":
        return "onnx-ad 0.3.0 gives Det a zero derivative (the true one is det(A) inv(A)^T)"
    if kind == "Resize" and _crop_fill(node):
        return (
            "onnx-ad 0.3.0 counts the extrapolation_value of a tf_crop_and_resize Resize as "
            "a derivative; prepare_for_reverse rewrites it when the output shape is static"
        )
    if kind == "SpaceToDepth" and attr(node, "mode", "DCR") == "CRD":
        return (
            "onnx-ad 0.3.0 differentiates SpaceToDepth mode CRD as mode DCR; "
            "prepare_for_reverse rewrites it when the input shape is static"
        )
    return None


class _Graph:
    """What the rewrites read about the model: types, static shapes, constant values."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self.opset = _opset(model)
        self.types, shapes = _infer(model)
        self.shape = shapes.get
        self._model, self._shapes, self._folder = model, shapes, None
        self.values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.constants = set(self.values)
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute:
                self.constants.add(node.output[0])
                value = helper.get_attribute_value(node.attribute[0])  # value, value_ints, ...
                if isinstance(value, onnx.TensorProto):
                    self.values[node.output[0]] = numpy_helper.to_array(value)
                elif node.attribute[0].name.startswith(("value_int", "value_float")):
                    self.values[node.output[0]] = np.asarray(value)

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def folded(self, name: str):
        """The value of ``name`` where constants and static shapes decide it, else None."""
        if name in self.values:
            return self.values[name]
        if self._folder is None:
            from ortbridge._prepare._control_flow import Folder

            self._folder = Folder(self._model, {}, self._shapes, self.opset)
        return self._folder.value(name)


def _rewrite(node, b, g):
    kind, types = node.op_type, g.types
    if kind == "CastLike" and types.get(node.input[1]):
        cast = helper.make_node("Cast", node.input[:1], node.output, node.name)
        cast.attribute.append(helper.make_attribute("to", types[node.input[1]]))
        return [cast]
    if kind == "Pow" and types.get(node.input[0]) in FLOAT_TYPES:
        if types.get(node.input[1]) in _INT_TYPES:
            exponent = b.op("Cast", node.input[1], to=types[node.input[0]])
            return [*b.nodes, copy_node(node, [node.input[0], exponent])]
        return None
    if kind in REDUCTIONS:
        return _reduction(node, b, g)
    if kind == "Pad" and attr(node, "mode", "constant") in ("reflect", "edge", "wrap"):
        axes = g.folded(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        widths = g.folded(node.input[1]) if len(node.input) > 1 else None
        return copying_pad(node, b, widths, g.shape(node.input[0]), axes)
    if kind == "Pad" and len(node.input) > 1 and node.input[1] not in g.values:
        widths = g.folded(node.input[1])
        if widths is None:
            return None
        # computed widths, constant here (old torch exports of F.pad, Swin's windows)
        g.values[node.input[1]] = widths
        return _negative_pad(node, b, g) or [
            *b.nodes,
            copy_node(node, [node.input[0], ints(b, widths.reshape(-1)), *node.input[2:]]),
        ]
    if kind == "Pad" and len(node.input) > 1 and node.input[1] in g.values:
        return _negative_pad(node, b, g)
    if kind == "Slice" and len(node.input) > 4 and types.get(node.input[0]) in FLOAT_TYPES:
        return strided_slice(node, b, g.shape(node.input[0]), g.folded)
    if kind == "SpaceToDepth" and attr(node, "mode", "DCR") == "CRD":
        return _space_to_depth_crd(node, b, g)
    if kind == "Resize" and _crop_fill(node):
        return _resize_fill(node, b, g)
    if kind == "BatchNormalization" and len(node.output) == 1:
        if not (g.is_constant(node.input[3]) and g.is_constant(node.input[4])):
            return _batch_norm(node, b, g)
        return None
    if kind == "Conv":
        return conv.conv(node, b, g.shape, g.is_constant)
    if kind == "ConvTranspose":
        return conv.conv_transpose(node, b, g.shape, g.is_constant)
    if kind in _POOLS:
        return conv.pool(node, b, g.shape, types.get(node.input[0], TensorProto.FLOAT))
    return None


def _reduction(node, b, g):
    x = node.input[0]
    dims = g.shape(x)
    inputs, drop = list(node.input), []
    if len(inputs) > 1 and inputs[1] in g.values and g.values[inputs[1]].size == 0:
        if attr(node, "noop_with_empty_axes", 0):
            if node.op_type not in _NOOP_ELEMENTWISE:
                return None
            kind = _NOOP_ELEMENTWISE[node.op_type]
            return [helper.make_node(kind, [x] * (1 + (kind == "Mul")), node.output, node.name)]
        inputs, drop = inputs[:1], ["noop_with_empty_axes"]
    elif attr(node, "axes") == []:
        drop = ["axes"]
    if dims is not None and 0 in dims and g.types.get(x) in FLOAT_TYPES:
        # x has no elements, so any tensor of its shape equals it; a constant one has no adjoint
        zero = numpy_helper.from_array(np.zeros(1, np_dtype(g.types[x])))
        inputs[0] = b.op("ConstantOfShape", b.op("Shape", x), value=zero)
    elif not drop:
        return None
    return [*b.nodes, copy_node(node, inputs, drop=drop)]


def _negative_pad(node, b, g):
    widths = [int(v) for v in g.values[node.input[1]].reshape(-1)]
    dims = g.shape(node.input[0])
    if min(widths, default=0) >= 0 or dims is None or None in dims or len(node.input) > 3:
        return None
    half = len(widths) // 2
    crop = [min(0, w) for w in widths]
    cropped = conv.pad_or_crop(b, node.input[0], dims, crop[:half], crop[half:], first=0)
    padded = ints(b, [max(0, w) for w in widths])
    return [*b.nodes, copy_node(node, [cropped, padded, *node.input[2:]])]


def _space_to_depth_crd(node, b, g):
    dims = g.shape(node.input[0])
    if dims is None or len(dims) != 4 or None in dims[1:]:
        return None
    _, c, h, w = dims
    k = attr(node, "blocksize")
    blocks = b.op("Reshape", node.input[0], ints(b, [0, c, h // k, k, w // k, k]))
    moved = b.op("Transpose", blocks, perm=[0, 1, 3, 5, 2, 4])
    b.op("Reshape", moved, ints(b, [0, c * k * k, h // k, w // k]))
    return b.replacing(node)


def _crop_fill(node) -> bool:
    crop = attr(node, "coordinate_transformation_mode") == "tf_crop_and_resize"
    return crop and attr(node, "extrapolation_value", 0.0) != 0.0


def _resize_fill(node, b, g):
    """Resize filling 0, plus a constant: the fill where the crop leaves the input, else 0."""
    dims, elem = g.shape(node.input[0]), g.types.get(node.input[0])
    operands = [name for name in node.input[1:] if name]
    if dims is None or None in dims or elem not in FLOAT_TYPES:
        return None
    if not all(name in g.values for name in operands):
        return None
    # The constant is the node itself run on zeros, by onnx's numpy reference.
    from onnx.reference import ReferenceEvaluator

    inits = [numpy_helper.from_array(g.values[name], name) for name in operands]
    probe = helper.make_graph(
        [copy_node(node, ["zeros", *node.input[1:]])],
        "fill",
        [helper.make_tensor_value_info("zeros", elem, dims)],
        [helper.make_tensor_value_info(node.output[0], elem, None)],
        inits,
    )
    probe = helper.make_model(probe, opset_imports=[helper.make_opsetid("", g.opset)])
    zeros = np.zeros(dims, np_dtype(elem))
    (fill,) = ReferenceEvaluator(probe).run(None, {"zeros": zeros})
    resized = b.fresh(f"{b.prefix}resize")
    b.nodes.append(copy_node(node, extrapolation_value=0.0))
    b.nodes[-1].output[0], b.nodes[-1].name = resized, resized
    b.op("Add", resized, b.op("Constant", value=numpy_helper.from_array(fill)))
    return b.replacing(node)


def _batch_norm(node, b, g):
    """Inference BatchNormalization as ``x * factor + (bias - mean * factor)``,
    ``factor = scale / sqrt(var + eps)``: two passes over ``x`` (torch's own
    CPU inference form), the rest on per-channel vectors."""
    dims = g.shape(node.input[0])
    if dims is None or len(dims) < 2 or attr(node, "training_mode", 0):
        return None
    x, scale, bias, mean, var = node.input[:5]
    axes = ints(b, range(1, len(dims) - 1)) if len(dims) > 2 else None

    def channel(name):
        return b.op("Unsqueeze", name, axes) if axes else name

    eps = b.const(attr(node, "epsilon", 1e-5))
    factor = b.op("Div", scale, b.op("Sqrt", b.op("Add", var, eps)))
    shift = b.op("Sub", bias, b.op("Mul", mean, factor))
    b.op("Add", b.op("Mul", x, channel(factor)), channel(shift))
    return b.replacing(node)


def _reinferred(model: onnx.ModelProto, changed: set[str]) -> onnx.ModelProto:
    """``model`` with the shapes of the ``changed`` tensors inferred again.

    A declared shape may be onnx's and not onnxruntime's (a ceil_mode pool's
    last window), and onnx-ad sizes the seeds from the graph outputs.
    """
    graph = model.graph
    kept = [v for v in graph.value_info if v.name not in changed]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    declared = {}
    for value in graph.output:
        tensor = value.type.tensor_type
        if value.name in changed and tensor.HasField("shape"):
            declared[value.name] = onnx.TensorShapeProto()
            declared[value.name].CopyFrom(tensor.shape)
            tensor.ClearField("shape")
    model = _inferred(model)
    for value in model.graph.output:
        if value.name in declared and not value.type.tensor_type.HasField("shape"):
            value.type.tensor_type.shape.CopyFrom(declared[value.name])
    return model
