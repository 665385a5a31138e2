"""Which float tensors of a graph are weights: decided by the role they play.

A published model holds its weights as initializers or as ``Constant`` nodes
(paddle2onnx, older torch exports, constant-folded graphs), also inside
``If``/``Loop`` bodies. Beside them sit constants of the function itself: a
LayerNorm's epsilon, the exponent of ``Pow(x - mean, 2)``, GELU's 0.5 and
sqrt(2), an attention scale. Training those breaks the model (a NaN gradient
for an exponent of a negative base, an epsilon driven negative), so the
default trains weights only:

- what a layer reads as its weights and biases (Conv, ConvTranspose, Gemm,
  MatMul, Einsum, the normalisations, the recurrent nodes, PRelu's slope, an
  embedding table read by Gather), whatever its size, also through the
  layout ops between them (an LSTM's gates reordered by Slice and Concat, a
  Linear weight transposed, a fused weight split);
- an ``Add`` operand whose other operand is a product (the bias after a
  MatMul or a Conv, even of one element: a one-output regressor's);
- any other float initializer of more than one element that a node reads
  where a gradient flows, except an exponent of round values (a square, a
  square root, a polynomial's powers: a learnt exponent trains) and a tensor
  holding infinities (a causal mask). torch's exporters write parameters as
  initializers; a ``Constant`` node is a weight only by one of the roles
  above (an attention mask's zeros stay a constant).

A factor of a product (``Mul``, ``MatMul``, ...) whose other factors are
computed from shapes only is no weight there: rotary embeddings' inverse
frequencies times the positions a ``Range`` counts out (a buffer in torch).

BatchNormalization's running statistics are statistics: buffers, never
trained. :func:`lift_constant_weights` turns the ``Constant`` nodes holding
weights or statistics into initializers, so they become parameters and
buffers exactly as initializers do; ``to_onnx()`` writes them back into their
nodes (:func:`._variants.with_weights`).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ._onnx_utils import FLOAT_TYPES, all_graphs, node_reads, subgraphs

# Inputs (by position) through which no gradient flows, per op type.
NON_DIFFERENTIABLE_SLOTS = {
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
    "QuantizeLinear": {1, 2},
    "DequantizeLinear": {1, 2},
    # onnxruntime's 4-bit weight-only product: packed weight, scales, zero
    # points and group index stay as the file has them (a frozen base)
    "MatMulNBits": {1, 2, 3, 4},
    # rotary embeddings (onnxruntime's, and ONNX's from opset 23): positions and
    # the cosine and sine caches are inputs 1-3 in both
    "RotaryEmbedding": {1, 2, 3},
    # grouped-query attention: sequence lengths, total length, rotary caches
    "GroupQueryAttention": {5, 6, 7, 8},
    # onnxruntime's dynamically quantized LSTM: sequence lengths, the int8
    # weights' scales and zero points
    "DynamicQuantizeLSTM": {4, 8, 9, 10, 11},
}
#: Inputs differentiated only where a weight read there is named trainable:
#: a fake quantization's scale (LSQ), fixed by default.
ON_REQUEST_SLOTS = {"QuantizeLinear": {1}, "DequantizeLinear": {1}}
#: The inputs no gradient ever reaches: the settings but those on request.
FIXED_SLOTS = {
    op: frozenset(slots - ON_REQUEST_SLOTS.get(op, set()))
    for op, slots in NON_DIFFERENTIABLE_SLOTS.items()
}


def scales_only(model: onnx.ModelProto) -> set[str]:
    """Tensors of the main graph read only where a gradient goes on request
    (a fake quantization's scale: trained when named, fixed by default)."""
    on_request, elsewhere = set(), set()
    for node in model.graph.node:
        slots = ON_REQUEST_SLOTS.get(node.op_type, ())
        for pos, name in enumerate(node.input):
            (on_request if pos in slots else elsewhere).add(name)
    return on_request - elsewhere


#: Ops a gradient passes straight through (fake quantization, :mod:`.quantized`):
#: from the float output to the data input, through the integers between.
STRAIGHT_THROUGH = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
#: Integer inputs whose float weights (lifted, :mod:`.quantized`) a node's
#: gradient reaches: onnxruntime's dynamically quantized LSTM, differentiated
#: as ONNX's LSTM of its dequantized weights.
STRAIGHT_THROUGH_SLOTS = {
    "DynamicQuantizeLSTM": {1, 2},
    # a dynamically quantized product (its kernel kept for inference), read
    # in float for the gradient: the activation's and the weight's integers
    "ConvInteger": {0, 1},
    "MatMulInteger": {0, 1},
}
# Ops whose outputs carry no gradient at all.
NON_DIFFERENTIABLE_OPS = frozenset(
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

#: Differentiable almost everywhere with a derivative of zero: torch gives
#: what reaches the outputs only through them a zero gradient.
ZERO_DERIVATIVE_OPS = frozenset({"Round", "Floor", "Ceil", "Sign"})

WEIGHT = "weight"
STATISTIC = "statistic"
CONSTANT = "constant"

#: Input positions a layer reads as its weights, per op type.
_LAYER_SLOTS = {
    "Conv": {1, 2},
    "ConvTranspose": {1, 2},
    "Gemm": {0, 1, 2},
    "MatMul": {0, 1},
    "Einsum": None,  # every operand
    "BatchNormalization": {1, 2},
    "InstanceNormalization": {1, 2},
    "LayerNormalization": {1, 2},
    "GroupNormalization": {1, 2},
    "SkipLayerNormalization": {2, 3, 4},
    "LSTM": {1, 2, 3},
    "GRU": {1, 2, 3},
    "RNN": {1, 2, 3},
    "PRelu": {1},
    "Gather": {0},
}
_STATISTIC_SLOTS = {"BatchNormalization": {3, 4}}
#: Positions holding a constant of the function, whatever its size.
_CONSTANT_SLOTS = {"Pow": {1}}
#: Ops whose output is a product of their operands: an Add after one adds a bias.
_PRODUCTS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})
#: Ops multiplying their operands: a factor of shapes makes the other no weight.
_FACTORS = _PRODUCTS | {"Mul"}
#: Ops that pass a tensor on unchanged in value: roles are read through them.
_PASS_THROUGH = frozenset({"Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast"})
#: Ops that move a tensor's values (input position 0, every position of a
#: Concat): a layer's weight slots (:data:`_THROUGH_LAYOUT`) are read through
#: them, no other role (a mask sliced to the length and added is no bias).
_LAYOUT = frozenset({"Slice", "Concat", "Gather", "Transpose", "Split"})
_THROUGH_LAYOUT = frozenset({"LSTM", "GRU", "RNN", "Conv", "ConvTranspose", "Gemm", "MatMul"})


def constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The float value a ``Constant`` node holds, or None (not float, or not a tensor)."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    a = node.attribute[0]
    if a.name == "value" and a.t.data_type in FLOAT_TYPES and not a.t.HasField("data_location"):
        return numpy_helper.to_array(a.t)
    if a.name == "value_float":
        return np.array(a.f, np.float32)
    if a.name == "value_floats":
        return np.array(list(a.floats), np.float32)
    return None


def round_values(value: np.ndarray) -> bool:
    """Whether every value is a simple fraction (halves, thirds, quarters ...
    twelfths: 2, 0.5, 1/3, 1.5): an exponent of the function, not a learnt one."""
    twelfths = np.asarray(value, np.float64) * 12
    return bool(np.isfinite(twelfths).all() and np.allclose(twelfths, np.round(twelfths), 0, 1e-4))


def roles(model: onnx.ModelProto) -> dict[str, str]:
    """The role of each float initializer and float ``Constant`` output, in every graph."""
    sizes: dict[str, int] = {}
    tensors: dict[str, onnx.TensorProto | np.ndarray] = {}  # values, read for exponents only
    masks: set[str] = set()  # tensors holding infinities
    held: set[str] = set()  # outputs of Constant nodes
    unit: set[str] = set()  # Constant outputs of all ones or all zeros
    producers: dict[str, onnx.NodeProto] = {}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = collections.defaultdict(list)
    for graph in all_graphs(model.graph):
        for init in graph.initializer:
            if init.data_type in FLOAT_TYPES:
                sizes[init.name] = int(np.prod(init.dims, dtype=np.int64))
                tensors[init.name] = init
                if not np.isfinite(numpy_helper.to_array(init)).all():
                    masks.add(init.name)
        for node in graph.node:
            value = constant_value(node)
            if value is not None:
                sizes[node.output[0]] = value.size
                tensors[node.output[0]] = value
                held.add(node.output[0])
                if value.size and ((value == 1).all() or (value == 0).all()):
                    unit.add(node.output[0])
                if not np.isfinite(value).all():
                    masks.add(node.output[0])
            for name in node.output:
                producers[name] = node
            for pos, name in enumerate(node.input):
                if name:
                    readers[name].append((node, pos))

    shaped = _from_shapes(model)

    def product_behind(name: str) -> bool:
        node = producers.get(name)
        while node is not None and node.op_type in _PASS_THROUGH:
            node = producers.get(node.input[0])
        return node is not None and node.op_type in _PRODUCTS

    def uses(name: str):
        """(node, position, tensor read, after a layout op) of every reader,
        through pass-through ops; a layout op is a reader and is read through."""
        todo, seen = [(name, False)], set()
        while todo:
            current, moved = todo.pop()
            for node, pos in readers.get(current, ()):
                passes = node.op_type in _PASS_THROUGH and pos == 0
                if passes or (node.op_type in _LAYOUT and (pos == 0 or node.op_type == "Concat")):
                    for out in node.output:
                        key = (out, moved or not passes)
                        if out and key not in seen:
                            seen.add(key)
                            todo.append(key)
                    if passes:
                        continue
                yield node, pos, current, moved

    out = {}
    for name, size in sizes.items():
        role = None
        exponent = read = False
        for node, pos, seen_as, moved in uses(name):
            slots = _LAYER_SLOTS.get(node.op_type, ())
            if moved:
                # Past a layout op only a layer's weight slot gives a role:
                # Silero's LSTM weights, their gates reordered in an If branch
                shaped_factor = node.op_type in _FACTORS and all(
                    other in shaped for j, other in enumerate(node.input) if j != pos and other
                )
                if node.op_type in _THROUGH_LAYOUT and pos in slots and not shaped_factor:
                    role = WEIGHT
                continue
            if node.op_type in NON_DIFFERENTIABLE_OPS:
                # read for a comparison, a shape: no role; rounded, it is read
                # as torch reads a parameter it rounds (a zero gradient)
                read = read or node.op_type in ZERO_DERIVATIVE_OPS
                continue
            if node.op_type in _FACTORS and all(
                other in shaped for j, other in enumerate(node.input) if j != pos and other
            ):
                exponent = True  # scales what shapes give: no weight
                continue
            if node.op_type == "InstanceNormalization" and name in unit:
                # TorchScript's GroupNorm: a plain normalisation over groups
                # (Constant ones and zeros), the layer's affine weights after it
                read = True
                continue
            if slots is None or pos in slots:
                role = WEIGHT
            elif pos in _STATISTIC_SLOTS.get(node.op_type, ()):
                role = role or STATISTIC
            elif pos in _CONSTANT_SLOTS.get(node.op_type, ()) and round_values(
                numpy_helper.to_array(tensors[name])
                if isinstance(tensors[name], onnx.TensorProto)
                else tensors[name]
            ):
                # x**2, sqrt: a constant of the function; distinct values such
                # as 0.3 .. 2.3 are a learnt exponent (torch.pow(x, param))
                exponent = True
            elif pos in NON_DIFFERENTIABLE_SLOTS.get(node.op_type, ()):
                continue  # Resize scales, Clip bounds: settings, not weights
            elif node.op_type == "Add" and len(node.input) == 2:
                other = node.input[1 - pos]
                if other != seen_as and product_behind(other):
                    role = WEIGHT
            read = True
        if role is None:
            # A tensor no node reads (a graph output as it is) computes nothing;
            # one holding infinities (a causal mask) cannot be trained. torch's
            # exporters write parameters as initializers: a Constant node (an
            # attention mask's zeros, a window) is a weight only by a layer's role.
            plain = read and size > 1 and not exponent and name not in masks | held
            role = WEIGHT if plain else CONSTANT
        out[name] = role
    return out


def gradient_cut(model: onnx.ModelProto, name: str) -> tuple[onnx.NodeProto, str] | None:
    """The node nearest to tensor ``name`` that passes no gradient on from it
    toward the outputs, and why; None where no node reads it or its paths end
    in no output. Walks the main graph as :func:`._load.summarize` finds what a
    gradient reaches (a body's reads of outer tensors are its node's inputs)."""
    from ._lookup import _elem_types  # a whole shape inference: only for an error

    types = _elem_types(model)
    readers: dict[str, list[tuple[onnx.NodeProto, int | None]]] = collections.defaultdict(list)
    for node in model.graph.node:
        for pos, read in enumerate(node.input):
            if read:
                readers[read].append((node, pos))
        for read in set(node_reads(node)) - set(node.input):
            readers[read].append((node, None))
    todo, seen = collections.deque([name]), {name}
    while todo:
        for node, pos in readers.get(todo.popleft(), ()):
            # (Round and the like pass a zero gradient on, as summarize counts)
            if node.op_type in NON_DIFFERENTIABLE_OPS - ZERO_DERIVATIVE_OPS:
                return node, "it reads values by comparison, index or shape only"
            if pos in FIXED_SLOTS.get(node.op_type, ()):
                return node, f"its input {pos} is a setting, not differentiated"
            floats = [
                o for o in node.output if o and types.get(o, TensorProto.FLOAT) in FLOAT_TYPES
            ]
            if not floats and any(node.output):
                return node, "its outputs are integer tensors"
            for out in floats:
                if out not in seen:
                    seen.add(out)
                    todo.append(out)
    return None


#: Operand positions holding a product's weight (not its bias), per op type.
_PRODUCT_WEIGHT_SLOTS = {
    "MatMul": {0, 1},
    "Gemm": {0, 1},
    "Conv": {1},
    "ConvTranspose": {1},
    # onnxruntime's fusions (com.microsoft): a product's factors, attention's
    # packed query-key-value weight (one update spans the three projections)
    "FusedMatMul": {0, 1},
    "Attention": {1},
}


def product_weights(model: onnx.ModelProto) -> set[str]:
    """Float initializers a MatMul, Gemm, Conv or ConvTranspose (or onnxruntime's
    FusedMatMul and Attention) of the main graph reads as its weight, directly
    or through layout ops (dynamo's transposed Linear weights): where low-rank
    adapters go (:func:`ortbridge.adapters.lora`)."""
    graph = model.graph
    floats = {i.name for i in graph.initializer if i.data_type in FLOAT_TYPES}
    # A quantized weight (lifted, :mod:`.quantized`) reaches its product through its pair.
    through = _PASS_THROUGH | {"Transpose"} | STRAIGHT_THROUGH
    source = {name: name for name in floats}  # tensor -> the initializer it passes on
    found = set()
    for node in graph.node:
        if node.op_type in through and node.input and node.input[0] in source:
            source[node.output[0]] = source[node.input[0]]
        slots = _PRODUCT_WEIGHT_SLOTS.get(node.op_type, ())
        for pos, name in enumerate(node.input):
            if pos in slots and name in source:
                found.add(source[name])
    return found


def _from_shapes(model: onnx.ModelProto) -> set[str]:
    """Main-graph tensors computed from shapes and counts (``Shape``, ``Size``,
    ``Range``: positions, whatever its bounds: dynamo writes an arange's as
    float constants) and constants only, with no input depending on a graph
    input's values or on a float initializer."""
    graph = model.graph
    data = {i.name for i in graph.input}
    data.update(init.name for init in graph.initializer if init.data_type in FLOAT_TYPES)
    shaped: set[str] = set()
    for node in graph.node:
        if node.op_type in ("Shape", "Size", "Range"):
            shaped.update(node.output)
        elif any(name in data for name in node.input) or subgraphs(node):
            data.update(node.output)
        elif any(name in shaped for name in node.input):
            shaped.update(node.output)
    return shaped


def lift_constant_weights(model: onnx.ModelProto) -> list[str]:
    """Turn ``Constant`` nodes holding weights or statistics into main-graph initializers.

    In place; returns the names lifted. A body of an ``If`` or ``Loop`` then
    reads its weights from the outer scope, as bodies may.
    """
    kinds = roles(model)
    taken = {init.name for init in model.graph.initializer}
    lifted = []
    for graph in all_graphs(model.graph):
        kept = []
        for node in graph.node:
            value = constant_value(node)
            name = node.output[0] if value is not None else None
            if name and kinds.get(name) in (WEIGHT, STATISTIC) and name not in taken:
                taken.add(name)
                tensor = numpy_helper.from_array(value, name)
                model.graph.initializer.append(tensor)
                lifted.append(name)
            else:
                kept.append(node)
        if len(kept) != len(graph.node):
            del graph.node[:]
            graph.node.extend(kept)
    return lifted


def write_constants(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> set[str]:
    """Write ``weights`` into the ``Constant`` nodes that output them, in place.

    Returns the names written. The node keeps its form when it was a
    ``value_float(s)``; otherwise it holds a tensor of the node's type.
    """
    written = set()
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if node.op_type != "Constant" or not node.output or node.output[0] not in weights:
                continue
            old = constant_value(node)
            if old is None:
                continue
            name = node.output[0]
            value = np.asarray(weights[name]).astype(old.dtype).reshape(old.shape)
            a = node.attribute[0]
            if a.name == "value":
                a.t.CopyFrom(numpy_helper.from_array(value, a.t.name))
            else:
                del node.attribute[:]
                node.attribute.append(
                    helper.make_attribute("value", numpy_helper.from_array(value))
                )
            written.add(name)
    return written
