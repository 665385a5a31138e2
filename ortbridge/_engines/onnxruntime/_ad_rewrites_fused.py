"""onnxruntime's fused transformer nodes written as the standard ops they compute, for onnx-ad.

onnxruntime's transformer optimizer (``optimize_model``, optimum's O2-O4)
fuses a layer's subgraphs into com.microsoft kernels onnx-ad has no rule
for. Before onnx-ad runs, :func:`fused_as_standard` writes each as the ops
it fuses (the contrib-op specs'), so the gradient graph differentiates
standard ops and the forward computes the same function (summed otherwise:
to float rounding). Inference sessions run the file's fused kernels.

- ``SkipLayerNormalization``: ``LayerNormalization(input + skip [+ bias])``;
  its optional outputs (mean, inverse standard deviation, the sum) kept.
- ``SimplifiedLayerNormalization`` / ``SkipSimplifiedLayerNormalization``
  (RMSNorm): ``x / sqrt(mean(x^2) + epsilon) * gamma``.
- ``BiasGelu``, ``FastGelu`` (the tanh form), ``Gelu``: the elementwise
  formulas (the engine's primal pass fuses the erf form again).
- ``FusedMatMul``: ``alpha * op(A) @ op(B)`` with the transposes of its
  ``transA``/``transB`` (batch transposes are left: refused by name).
- ``EmbedLayerNormalization``: the word, position (``0..S-1`` or its
  ``position_ids``) and segment embeddings gathered and summed, layer
  normalised; its mask index is the mask's sum per sequence.
- ``Attention``: the input times the packed QKV weight plus its bias,
  split into heads, ``softmax(Q K^T * scale + mask) V``; a mask index of
  one length per sequence (right padding) or a raw 0/1 mask adds
  ``mask_filter_value`` where masked, and so does ``unidirectional`` above
  the diagonal; an attention bias is added as it is (one broadcast over the
  batch from onnxruntime 1.20: 1.19's kernel reads it otherwise).
- ``MultiHeadAttention`` (separate query, key and value of three axes):
  the same, with its packed bias, key padding mask and attention bias (the
  mask and the bias from onnxruntime 1.20: 1.19's kernel reads them
  otherwise). Other forms are left: refused by name.
- A past state (``Attention``'s stacked keys and values, or
  ``MultiHeadAttention``'s two) goes before the new keys and values, the
  present outputs their concatenation, and a causal mask is offset by its
  length; ``MultiHeadAttention``'s key padding mask beside it is a raw one
  over past and new keys (lengths are left: refused by name).
- ``MatMulNBits`` (4 bits, the quantizer's blockwise weight-only form): the
  input times the weight dequantized from its packed blocks (low nibble
  first, ``(q - zero point) * scale`` per block, zero point 8 when absent),
  so that the gradient reaches the input and the weights before the node;
  the packed weight, scales and zero points are not differentiated (frozen:
  :data:`ortbridge._prepare._weights.NON_DIFFERENTIABLE_SLOTS`). The
  forward of the gradient graph multiplies in float, as accuracy level 0
  does (a higher level rounds the input to int8 in the kernel).
- ``GroupQueryAttention`` (causal; separate or packed query, key and
  value): each key-value head serves ``num_heads / kv_num_heads`` query
  heads, rotary embeddings from its caches at positions after the past
  state, keys after a sequence's last token (``seqlens_k``) and after the
  query masked; the past state goes before the new keys (its present
  outputs); a softcap (``softcap * tanh(scores / softcap)``, before the
  masks) and, from onnxruntime 1.20, a local window (each query's own key
  and the ``local_window_size - 1`` before it; a padding query that sees
  none outputs 0, as the kernel's does), ``causal=0``, a smooth softmax
  (one more logit of 0 in each row), an attention bias (added after the
  softcap) and head sinks (each head's logit one more in its rows'
  softmax). Position ids (1.31's kernel reads a prompt's otherwise), query
  and key norms, a quantized or window-shared cache, a scores
  output, a window beside a softcap (the kernel windows the capped scores
  otherwise), and on onnxruntime 1.19 (whose kernel reads them otherwise or
  lacks them) a window, a past state, ``causal=0``, a smooth softmax, a bias
  and sinks are left: refused by name.
- ``RotaryEmbedding`` (input of three axes, batch by sequence by hidden;
  position ids per token or one offset): each head's first rotary
  dimensions turned by the cosines and sines its positions gather, in
  halves or interleaved pairs; the caches are not differentiated (frozen).
  Packed batching, a scale and four-axis input are left: refused by name.

A com.microsoft node with no decomposition (such as ``Inverse``) is left
too, its outputs' ranks
declared as onnxruntime's own shape inference gives them
(:func:`declare_foreign_ranks`): onnx-ad then refuses it by name, and the
weights after it train.

Every writer shares one ``_Writer``'s naming, constants and its LayerNorm,
RMS and attention pieces, so the fusions stay in one module (the folder
holds the most modules the layout allows).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortbridge._prepare._lookup import _all_names, _infer, _unique
from ortbridge._prepare._onnx_utils import FLOAT_TYPES, attr, np_dtype
from ortbridge._runtime import _ort
from ortbridge._runtime._sessions import make_session

_MS = "com.microsoft"
#: How a fused node left as it is says why (its ``doc_string``; the engine's
#: refusal quotes it).
LEFT_FUSED = "not decomposed: "
FUSED = frozenset(
    {
        "SkipLayerNormalization", "SimplifiedLayerNormalization",
        "SkipSimplifiedLayerNormalization", "BiasGelu", "FastGelu", "Gelu", "FusedMatMul",
        "Attention", "MultiHeadAttention", "EmbedLayerNormalization", "MatMulNBits",
        "RotaryEmbedding", "GroupQueryAttention", "QuickGelu",
    }
)  # fmt: skip


def fused_as_standard(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each fused node of :data:`FUSED` as standard ops; in place, returned."""
    graph = model.graph
    if not any(_fused(n) for n in graph.node):
        return model
    types, shapes = _infer(model)
    taken = _all_names(graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    producers = {out: n for n in graph.node for out in n.output}
    nodes = []
    for node in graph.node:
        if not _fused(node):
            nodes.append(node)
            continue
        # The first float operand's type onnx knows (not an output of another
        # fused node; an embedding's ids are integers).
        known = [types[n] for n in node.input if types.get(n) in FLOAT_TYPES]
        elem = known[0] if known else TensorProto.FLOAT
        writer = _Writer(node, graph, taken, elem, (shapes, producers), opset)
        new = getattr(writer, node.op_type)()
        if new is None:
            _declare_ranks(graph, node, shapes, elem)
        nodes.extend([node] if new is None else new)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


#: The ranks of the outputs of a fused node left as it is (refused by name:
#: onnx knows no com.microsoft op's shapes, and onnx-ad needs the ranks of
#: what a trained weight after it meets): output index -> rank, from the
#: first input's (None: as it).
_LEFT_RANKS = {
    **dict.fromkeys(
        ("Attention", "MultiHeadAttention", "GroupQueryAttention"), {0: None, 1: 4, 2: 4}
    ),
    **dict.fromkeys(
        (
            "RotaryEmbedding",
            "MatMulNBits",
            "QuickGelu",
            "FastGelu",
            "BiasGelu",
            "Gelu",
            "FusedMatMul",
            "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization",
            "SimplifiedLayerNormalization",
        ),
        {0: None},
    ),  # fmt: skip
}


def _declare_ranks(graph: onnx.GraphProto, node: onnx.NodeProto, shapes, elem: int) -> None:
    """Declare the ranks of ``node``'s outputs (unknown sizes) where onnx cannot infer them."""
    rank = len(shapes.get(node.input[0]) or ()) if node.input else 0
    ranks = dict(_LEFT_RANKS.get(node.op_type, {}))
    if node.op_type == "Attention":  # its present: key and value stacked
        ranks[1] = 5
    declared = {vi.name for vi in graph.value_info}
    for index, out in enumerate(node.output):
        if not out or out in declared or index not in ranks or not rank:
            continue
        size = ranks[index] or rank
        graph.value_info.append(helper.make_tensor_value_info(out, elem, [None] * size))


def declare_foreign_ranks(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the undeclared outputs of its com.microsoft nodes (onnx
    knows no contrib op's shapes) declared as onnxruntime types them (an
    inference session resolves each contrib op's shapes); in place,
    returned. A graph onnxruntime cannot load is returned as it is."""
    graph = model.graph
    known = {vi.name for vi in [*graph.value_info, *graph.output, *graph.input]}
    known |= {i.name for i in graph.initializer}
    unknown = [
        out for node in graph.node if node.domain == _MS and node.op_type not in _PAIRS
        for out in node.output if out and out not in known
    ]  # fmt: skip
    if not unknown:
        return model
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in unknown)
    ort = _ort.runtime()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = make_session(probe, options)
    except Exception:  # (onnx-ad then says which rank it lacks)
        return model
    for arg in session.get_outputs():
        elem = _ORT_TYPES.get(arg.type)
        if arg.name in unknown and elem is not None and arg.shape is not None:
            dims = [d if isinstance(d, int) else None for d in arg.shape]
            graph.value_info.append(helper.make_tensor_value_info(arg.name, elem, dims))
    return model


#: com.microsoft's quantization pairs (4-bit weights): rewritten as standard
#: ops for onnx-ad later (:func:`fake_quantize_nodes`), no session needed.
_PAIRS = frozenset({"QuantizeLinear", "DequantizeLinear"})

#: onnxruntime's type strings of the tensors a declared output may hold.
_ORT_TYPES = {
    "tensor(float)": TensorProto.FLOAT, "tensor(double)": TensorProto.DOUBLE,
    "tensor(float16)": TensorProto.FLOAT16, "tensor(bfloat16)": TensorProto.BFLOAT16,
    "tensor(int64)": TensorProto.INT64, "tensor(int32)": TensorProto.INT32,
    "tensor(int8)": TensorProto.INT8, "tensor(uint8)": TensorProto.UINT8,
    "tensor(bool)": TensorProto.BOOL,
}  # fmt: skip


def _fused(node: onnx.NodeProto) -> bool:
    # onnxruntime registers SimplifiedLayerNormalization in the ONNX domain
    # (its optimizer writes it there), the others in com.microsoft.
    if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx"):
        return True
    return node.domain == _MS and node.op_type in FUSED


def _plain_cache(node: onnx.NodeProto) -> bool:
    """Whether a GroupQueryAttention keeps its key-value cache in float, in
    buffers of its own (no quantization, no sliding-window cache, no scores
    output)."""
    none = ("NONE", b"NONE")
    return (
        attr(node, "k_quant_type", "NONE") in none
        and attr(node, "v_quant_type", "NONE") in none
        and not attr(node, "kv_cache_bit_width", 0)
        and not attr(node, "sliding_window_cache", 0)
        and not attr(node, "qk_output", 0)
    )


class _Writer:
    def __init__(self, node, graph, taken, elem, facts, opset):
        self.node, self.graph, self.taken, self.elem = node, graph, taken, elem
        (self.shapes, self.producers), self.opset = facts, opset
        self.out: list[onnx.NodeProto] = []
        self.base = node.name or node.output[0]

    def _name(self, stem: str) -> str:
        return _unique(f"{self.base}/{stem}", self.taken)

    def op(self, op_type: str, inputs, output: str | None = None, **attrs) -> str:
        name = output or self._name(op_type.lower())
        self.out.append(
            helper.make_node(op_type, list(inputs), [name], self._name(op_type), **attrs)
        )
        return name

    def const(self, value: float) -> str:
        name = self._name("const")
        array = np.asarray(value, np_dtype(self.elem))
        self.graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    def _in(self, pos: int) -> str:
        return self.node.input[pos] if len(self.node.input) > pos else ""

    def _out(self, pos: int) -> str:
        return self.node.output[pos] if len(self.node.output) > pos else ""

    def _sum(self, names) -> str:
        names = [n for n in names if n]
        total = names[0]
        for name in names[1:]:
            total = self.op("Add", [total, name])
        return total

    def SkipLayerNormalization(self):
        total = self._sum([self._in(0), self._in(1), self._in(4)])
        if self._out(3):
            self.op("Identity", [total], self._out(3))
        outputs = (self._out(0), self._out(1), self._out(2))
        self._layer_norm(
            total, self._in(2), self._in(3), outputs, attr(self.node, "epsilon", 1e-12)
        )
        return self.out

    def _mean(self, x: str, output: str | None = None) -> str:
        """The mean over the last axis, kept (ReduceMean's axes: an input from opset 18)."""
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self._axes([-1])], output or None, keepdims=1)
        return self.op("ReduceMean", [x], output or None, axes=[-1], keepdims=1)

    def _rms(self, x: str, gamma: str, output: str) -> None:
        mean = self._mean(self.op("Mul", [x, x]))
        epsilon = attr(self.node, "epsilon", 1e-6)
        root = self.op("Sqrt", [self.op("Add", [mean, self.const(epsilon)])])
        self.op("Mul", [self.op("Div", [x, root]), gamma], output)

    def _left(self, why: str) -> None:
        """Leave the node fused (refused by name), saying which of its forms it has."""
        self.node.doc_string = f"{LEFT_FUSED}{why}"

    def _axes(self, axes) -> str:
        name = self._name("axes")
        self.graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), name))
        return name

    def SimplifiedLayerNormalization(self):
        if any(self.node.output[1:]) or attr(self.node, "axis", -1) != -1:
            return self._left("a statistics output or an axis other than the last")
        self._rms(self._in(0), self._in(1), self._out(0))
        return self.out

    def SkipSimplifiedLayerNormalization(self):
        if self._out(1) or self._out(2):
            return self._left("a statistics output")
        total = self._sum([self._in(0), self._in(1), self._in(3)])
        if self._out(3):
            self.op("Identity", [total], self._out(3))
        self._rms(total, self._in(2), self._out(0))
        return self.out

    def _gelu_erf(self, x: str, output: str) -> None:
        scaled = self.op("Div", [x, self.const(math.sqrt(2.0))])
        half = self.op("Mul", [x, self.const(0.5)])
        self.op("Mul", [half, self.op("Add", [self.op("Erf", [scaled]), self.const(1.0)])], output)

    def Gelu(self):
        self._gelu_erf(self._in(0), self._out(0))
        return self.out

    def BiasGelu(self):
        self._gelu_erf(self.op("Add", [self._in(0), self._in(1)]), self._out(0))
        return self.out

    def QuickGelu(self):  # CLIP's: x * sigmoid(alpha * x)
        x = self._in(0)
        scaled = self.op("Mul", [x, self.const(attr(self.node, "alpha", 1.702))])
        self.op("Mul", [x, self.op("Sigmoid", [scaled])], self._out(0))
        return self.out

    def FastGelu(self):
        x = self._sum([self._in(0), self._in(1)])
        cube = self.op("Mul", [self.op("Mul", [x, x]), x])
        inner = self.op("Add", [x, self.op("Mul", [cube, self.const(0.044715)])])
        tanh = self.op("Tanh", [self.op("Mul", [inner, self.const(math.sqrt(2.0 / math.pi))])])
        half = self.op("Mul", [x, self.const(0.5)])
        self.op("Mul", [half, self.op("Add", [tanh, self.const(1.0)])], self._out(0))
        return self.out

    def FusedMatMul(self):
        if attr(self.node, "transBatchA", 0) or attr(self.node, "transBatchB", 0):
            return self._left("transBatchA or transBatchB")
        a, b = self._in(0), self._in(1)
        if attr(self.node, "transA", 0):
            a = self._transposed_last(a)
        if attr(self.node, "transB", 0):
            b = self._transposed_last(b)
        if a is None or b is None:
            return None
        alpha = attr(self.node, "alpha", 1.0)
        if alpha == 1.0:
            self.op("MatMul", [a, b], self._out(0))
        else:
            self.op("Mul", [self.op("MatMul", [a, b]), self.const(alpha)], self._out(0))
        return self.out

    def MatMulNBits(self):
        node = self.node
        k, n = attr(node, "K", 0), attr(node, "N", 0)
        block = attr(node, "block_size", 0)
        if attr(node, "bits", 4) != 4 or self._in(4) or not (k and n and block):
            return self._left("a width other than 4 bits or a group index")
        blocks = -(-k // block)
        packed, scales, zero_points, bias = self._in(1), self._in(2), self._in(3), self._in(5)
        q = self._nibbles(packed, [n, blocks * block])  # [N, blocks * block], integers
        if not zero_points:
            zero = self.const(8.0)
        elif self._float(zero_points):
            zero = self.op("Reshape", [zero_points, self._axes([n, blocks, 1])])
        else:  # packed like the weight, two blocks a byte, padded to whole bytes
            unpacked = self._nibbles(zero_points, [n, 2 * -(-blocks // 2)])
            first = self._slice_last(unpacked, 0, blocks)
            zero = self.op("Reshape", [first, self._axes([n, blocks, 1])])
        grouped = self.op("Reshape", [q, self._axes([n, blocks, block])])
        per_block = self.op("Reshape", [scales, self._axes([n, blocks, 1])])
        weight = self.op("Mul", [self.op("Sub", [grouped, zero]), per_block])
        rows = self.op("Reshape", [weight, self._axes([n, blocks * block])])
        if blocks * block != k:  # the last block's padding
            rows = self._slice_last(rows, 0, k)
        product = self.op("MatMul", [self._in(0), self.op("Transpose", [rows], perm=[1, 0])])
        if bias:
            self.op("Add", [product, bias], self._out(0))
        else:
            self.out[-1].output[0] = self._out(0)
        return self.out

    def RotaryEmbedding(self):
        node = self.node
        x, positions, cos, sin = (self._in(i) for i in range(4))
        shape, cache = self.shapes.get(x), self.shapes.get(cos)
        if attr(node, "is_packed_batching", 0) or attr(node, "scale", 1.0) != 1.0:
            return self._left("packed batching or a scale")
        if shape is None or len(shape) != 3 or cache is None or len(cache) != 2:
            return self._left("an input of other than three axes, or caches of unknown shape")
        hidden, half = shape[2], cache[1]
        if not isinstance(hidden, int) or not isinstance(half, int):
            return self._left("sizes unknown when the graph is built")
        rotary = attr(node, "rotary_embedding_dim", 0) or 2 * half
        heads = attr(node, "num_heads", 0) or hidden // rotary
        head = hidden // heads
        if rotary != 2 * half or heads * head != hidden or rotary > head:
            return self._left("a rotary dimension that does not fit the heads")
        ids = self.shapes.get(positions)
        if ids is not None and len(ids) == 1:  # one offset: offset + 0..S-1 for every row
            steps = self.op("Unsqueeze", [self._positions(x), self._axes([0])])
            row = self.op("Add", [steps, positions])
            ids_shape = self.op("Concat", [self._shape_part(x, 0), self._shape_part(x, 1)], axis=0)
            positions = self.op("Expand", [row, ids_shape])
        # cos and sin per token, one per head: (B, S, 1, half)
        c, s = (
            self.op("Unsqueeze", [self.op("Gather", [t, positions], axis=0), self._axes([2])])
            for t in (cos, sin)
        )
        heads_of = self.op("Reshape", [x, self._axes([0, 0, heads, head])])
        result = self._rotate(heads_of, (c, s), half, head, attr(node, "interleaved", 0))
        self.op("Reshape", [result, self._axes([0, 0, hidden])], self._out(0))
        return self.out

    def _rotate(self, heads_of: str, cos_sin, half: int, head: int, interleaved) -> str:
        """(B, S, N, head) with each head's first ``2 * half`` dimensions turned by
        cosines and sines (B or 1, S, 1, half), in halves or interleaved pairs."""
        (c, s), rotary = cos_sin, 2 * half
        turned = self._slice_last(heads_of, 0, rotary)
        if interleaved:
            pairs = self.op("Reshape", [turned, self._axes([0, 0, 0, half, 2])])
            first, second = (self.op("Gather", [pairs, self._int(i)], axis=4) for i in (0, 1))
        else:
            first, second = (
                self._slice_last(turned, 0, half),
                self._slice_last(turned, half, rotary),
            )
        new_first = self.op("Sub", [self.op("Mul", [first, c]), self.op("Mul", [second, s])])
        new_second = self.op("Add", [self.op("Mul", [second, c]), self.op("Mul", [first, s])])
        if interleaved:
            last = self._axes([-1])
            ends = [self.op("Unsqueeze", [t, last]) for t in (new_first, new_second)]
            stacked = self.op("Concat", ends, axis=-1)
            result = self.op("Reshape", [stacked, self._axes([0, 0, 0, rotary])])
        else:
            result = self.op("Concat", [new_first, new_second], axis=-1)
        if rotary < head:
            result = self.op("Concat", [result, self._slice_last(heads_of, rotary, head)], axis=-1)
        return result

    def _slice_last(self, x: str, start: int, end: int) -> str:
        return self.op("Slice", [x, self._axes([start]), self._axes([end]), self._axes([-1])])

    def _float(self, name: str) -> bool:
        """Whether initializer or graph input ``name`` holds floats."""
        for init in self.graph.initializer:
            if init.name == name:
                return init.data_type in FLOAT_TYPES
        for value in self.graph.input:
            if value.name == name:
                return value.type.tensor_type.elem_type in FLOAT_TYPES
        return False

    def _nibbles(self, packed: str, shape: list[int]) -> str:
        """uint8 bytes as their 4-bit values in this float type, low nibble
        first, reshaped to ``shape``."""
        wide = self.op("Cast", [packed], to=TensorProto.INT64)
        sixteen = self._int(16)
        high = self.op("Div", [wide, sixteen])
        low = self.op("Sub", [wide, self.op("Mul", [high, sixteen])])
        last = self._axes([-1])
        pairs = self.op("Concat", [self.op("Unsqueeze", [low, last]),
                                   self.op("Unsqueeze", [high, last])], axis=-1)  # fmt: skip
        flat = self.op("Reshape", [pairs, self._axes(shape)])
        return self.op("Cast", [flat], to=self.elem)

    def _shape_part(self, x: str, index: int) -> str:
        """Dimension ``index`` of ``x``, as a one-element int64 tensor."""
        shape = self.op("Shape", [x])
        return self.op("Gather", [shape, self._axes([index])], axis=0)

    def EmbedLayerNormalization(self):
        if attr(self.node, "mask_index_type", 1) != 1 or (self._out(1) and not self._in(7)):
            return self._left("mask_index_type other than 1, or a mask index of no mask")
        ids, segments, words, positions, segment_table = (self._in(i) for i in range(5))
        gamma, beta, mask, position_ids = (self._in(i) for i in (5, 6, 7, 8))
        terms = [self.op("Gather", [words, ids], axis=0)]
        if position_ids:
            terms.append(self.op("Gather", [positions, position_ids], axis=0))
        else:  # 0..S-1, broadcast over the batch
            terms.append(self.op("Gather", [positions, self._positions(ids)], axis=0))
        if segments and segment_table:
            terms.append(self.op("Gather", [segment_table, segments], axis=0))
        total = self._sum(terms)
        if self._out(2):
            self.op("Identity", [total], self._out(2))
        epsilon = attr(self.node, "epsilon", 1e-12)
        self._layer_norm(total, gamma, beta, (self._out(0), "", ""), epsilon)
        if self._out(1):
            counted = self.op("Cast", [mask], to=TensorProto.INT32)
            self.op("ReduceSum", [counted, self._axes([1])], self._out(1), keepdims=0)
        return self.out

    def _int(self, value: int) -> str:
        name = self._name("index")
        self.graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
        return name

    def _layer_norm(self, x, gamma, beta, outputs, epsilon) -> None:
        """LayerNormalization over the last axis into ``outputs`` (the result, and
        optionally the mean and inverse standard deviation: "" for none)."""
        output, mean_out, inverse_out = outputs
        inputs = [x, gamma] + ([beta] if beta else [])
        if self.opset >= 17:
            names = [output, mean_out, inverse_out]
            while not names[-1]:  # no trailing empty optional outputs
                names.pop()
            self.out.append(
                helper.make_node(
                    "LayerNormalization",
                    inputs,
                    names,
                    self._name("layer_norm"),
                    axis=-1,
                    epsilon=epsilon,
                )  # fmt: skip
            )
            return
        # Before opset 17, its ops: (x - mean) / sqrt(var + epsilon) * gamma + beta.
        mean = self._mean(x, mean_out)
        centred = self.op("Sub", [x, mean])
        var = self._mean(self.op("Mul", [centred, centred]))
        root = self.op("Sqrt", [self.op("Add", [var, self.const(epsilon)])])
        inverse = self.op("Reciprocal", [root], inverse_out or None)
        scaled = self.op("Mul", [self.op("Mul", [centred, inverse]), gamma])
        self.op("Add" if beta else "Identity", [scaled, beta] if beta else [scaled], output)

    def _positions(self, x: str, axis: int = 1) -> str:
        """``0 .. n-1`` along ``axis`` of ``x`` (int64)."""
        length = self.op("Squeeze", [self._shape_part(x, axis), self._axes([0])])
        return self.op("Range", [self._int(0), length, self._int(1)])

    def Attention(self):
        node = self.node
        if (
            any(node.input[6:])
            or any(node.output[2:])
            or attr(node, "past_present_share_buffer", 0)
        ):
            return self._left("a shared cache (its past length) or a scores output")
        if self._in(5) and _ort.version() < (1, 20):
            bias, x = self.shapes.get(self._in(5)), self.shapes.get(self._in(0))
            if not bias or not x or bias[0] is None or bias[0] != x[0]:
                return self._left("a bias broadcast over the batch (onnxruntime 1.19)")
        past = self._in(4)  # (2, B, N, P, head): keys, values
        if past and self._in(3) and len(self.shapes.get(self._in(3)) or ()) != 2:
            return self._left("a mask index beside a past state")
        if attr(node, "do_rotary", 0) or attr(node, "qkv_hidden_sizes", None):
            return self._left("do_rotary or qkv_hidden_sizes")
        heads = attr(node, "num_heads")
        weight_shape = self.shapes.get(self._in(1))
        if not heads or weight_shape is None or weight_shape[-1] is None:
            return None
        hidden = weight_shape[-1] // 3
        qkv = self.op("MatMul", [self._in(0), self._in(1)])
        if self._in(2):
            qkv = self.op("Add", [qkv, self._in(2)])
        names = self._split3(qkv, hidden)
        penalties = []
        if self._in(3):
            penalties.append(self._mask_penalty(self._in(3), self._in(0)))
        if self._in(5):
            penalties.append(self._in(5))  # (B or 1, N, S, T): added as it is
        if not past:
            return self._attend(*names, heads, hidden, penalties)
        states = [self.op("Gather", [past, self._int(i)], axis=0) for i in (0, 1)]
        return self._attend(*names, heads, hidden, penalties, states, (self._out(1),))

    def MultiHeadAttention(self):
        node = self.node
        past = (self._in(6), self._in(7))
        if self._in(9) or node.output[3:4] and node.output[3]:
            return self._left("beam indices or a scores output")
        if any(past) and not all(past):
            return self._left("a past key without a past value, or the reverse")
        if self._in(8) and (not all(past) or self._in(4) or self._in(5)):
            return self._left("a shared cache's length without a past, or beside a mask or bias")
        if any(past) and self._in(4) and len(self.shapes.get(self._in(4)) or ()) != 2:
            return self._left("a key padding mask of lengths beside a past state")
        if (self._in(4) or self._in(5)) and _ort.version() < (1, 20):
            # onnxruntime 1.19's kernel reads a key padding mask and an
            # attention bias otherwise (its outputs differ from these ops').
            return self._left("a key padding mask or a bias (onnxruntime 1.19)")
        heads = attr(node, "num_heads")
        query, key, value = self._in(0), self._in(1), self._in(2)
        shape = self.shapes.get(query)
        if not heads or not key or not value or shape is None or len(shape) != 3 or not shape[2]:
            return self._left("packed query, key and value, or unknown sizes")
        if len(self.shapes.get(key) or ()) != 3:
            return None
        hidden = shape[2]
        if self._in(3):  # one bias for the three: [q | k | v]
            biases = self._split3(self._in(3), hidden)
            query, key, value = (
                self.op("Add", [t, b]) for t, b in zip((query, key, value), biases)
            )
        penalties = []
        if self._in(4):
            penalties.append(self._mask_penalty(self._in(4), key))
        if self._in(5):
            penalties.append(self._in(5))  # (B or 1, N, S, T): added as it is
        if any(past):
            return self._attend(
                query, key, value, heads, hidden, penalties, past, (self._out(1), self._out(2)),
                self._in(8),
            )  # fmt: skip
        return self._attend(query, key, value, heads, hidden, penalties)

    def GroupQueryAttention(self):
        node = self.node
        if self._in(9) and attr(node, "do_rotary", 0) and _ort.version() < (1, 31):
            return self._left("rotary position ids before onnxruntime 1.31")
        if any(node.input[12:]) or any(node.output[3:]) or not _plain_cache(node):
            return self._left("key scales, norms, a quantized or window cache, scores out")
        window, softcap = attr(node, "local_window_size", -1), attr(node, "softcap", 0.0)
        causal, smooth = attr(node, "causal", 1), attr(node, "smooth_softmax", -1) > 0
        if window > 0 and (softcap or not causal):
            return self._left("a local window beside a softcap or causal=0")
        newer = self._in(3) or any(node.input[10:12]) or window > 0 or smooth or not causal
        if newer and _ort.version() < (1, 20):
            # onnxruntime 1.19's kernel reads a past state and a window
            # otherwise, and has no bias, sinks, smooth softmax or causal=0
            return self._left("a past, window, causal=0, smooth softmax, bias or sinks (1.19)")
        heads, kv_heads = attr(node, "num_heads", 0), attr(node, "kv_num_heads", 0)
        query, key, value = self._in(0), self._in(1), self._in(2)
        shape = self.shapes.get(query)
        if not heads or not kv_heads or heads % kv_heads or not shape or len(shape) != 3:
            return None
        if not isinstance(shape[2], int) or not self._in(5):
            return None
        if not key:  # packed: query | key | value along the last axis
            head = shape[2] // (heads + 2 * kv_heads)
            names = [self._name(part) for part in ("q", "k", "v")]
            sizes = self._axes([heads * head, kv_heads * head, kv_heads * head])
            self.out.append(
                helper.make_node("Split", [query, sizes], names, self._name("split"), axis=-1)
            )
            query, key, value = names
        else:
            head = shape[2] // heads
        q, k, v = (
            self.op("Reshape", [t, self._axes([0, 0, n, head])])
            for t, n in ((query, heads), (key, kv_heads), (value, kv_heads))
        )  # (B, S, N, head)
        if attr(node, "do_rotary", 0):
            cache = self.shapes.get(self._in(7))
            if not cache or len(cache) != 2 or not isinstance(cache[1], int):
                return None
            steps = self._rotary_steps()  # (B, S)
            c, s = (
                self.op("Unsqueeze", [self.op("Gather", [t, steps], axis=0), self._axes([2])])
                for t in (self._in(7), self._in(8))
            )  # (B, S, 1, half)
            interleaved = attr(node, "rotary_interleaved", 0)
            q, k = (self._rotate(t, (c, s), cache[1], head, interleaved) for t in (q, k))
        q, k, v = (self.op("Transpose", [t], perm=[0, 2, 1, 3]) for t in (q, k, v))
        if self._in(3):  # each row's past, then its new keys and values
            k, v = self._present([(self._in(3), k), (self._in(4), v)])
        for pos, t in ((1, k), (2, v)):
            if self._out(pos):
                self.op("Identity", [t], self._out(pos))
        if heads != kv_heads:  # each key-value head serves heads / kv_heads query heads
            group = heads // kv_heads
            k, v = (
                self.op(
                    "Reshape",
                    [
                        self.op(
                            "Concat", [self.op("Unsqueeze", [t, self._axes([2])])] * group, axis=2
                        ),
                        self._axes([0, heads, -1, head]),
                    ],
                )  # fmt: skip
                for t in (k, v)
            )
        scale = attr(node, "scale", 0.0) or 1.0 / math.sqrt(head)
        scores = self.op(
            "Mul",
            [
                self.op("MatMul", [q, self.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                self.const(scale),
            ],
        )
        if softcap > 0:  # softcap * tanh(scores / softcap), before the masks
            capped = self.op("Tanh", [self.op("Mul", [scores, self.const(1.0 / softcap)])])
            scores = self.op("Mul", [capped, self.const(softcap)])
        if self._in(10):  # (B or 1, N or 1, S, T)
            scores = self.op("Add", [scores, self._in(10)])
        keep = self._valid_keys(k, self._in(5))
        if causal and self._in(3):
            keep = self.op("And", [self._causal_after_past(k, window), keep])
        elif causal:
            keep = self.op("And", [self._causal_keep(scores, window if window > 0 else None), keep])
        lowest = self.const(float(np.finfo(np_dtype(self.elem)).min))
        scores = self.op("Where", [keep, scores, lowest])
        if smooth or self._in(11):  # one more logit in each row's softmax, dropped after
            extra = self.op("Mul", [self._slice_last(scores, 0, 1), self.const(0.0)])
            if self._in(11):  # each head's sink: (N,) as (1, N, 1, 1)
                sink = self.op("Reshape", [self._in(11), self._axes([1, heads, 1, 1])])
                extra = self.op("Add", [extra, sink])
            probs = self.op("Softmax", [self.op("Concat", [scores, extra], axis=-1)], axis=-1)
            probs = self._slice_last(probs, 0, -1)
        else:
            probs = self.op("Softmax", [scores], axis=-1)
        if window > 0:  # a padding query may see no key in its window: its output is 0
            probs = self.op("Mul", [probs, self.op("Cast", [keep], to=self.elem)])
        context = self.op("Transpose", [self.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        self.op("Reshape", [context, self._axes([0, 0, heads * head])], self._out(0))
        return self.out

    # GroupQueryAttention's past state, as onnxruntime's CPU kernel reads it:
    # row b's past is its first seqlens_k[b] + 1 - S keys (none in a first
    # prompt, S == total_sequence_length), whatever the buffer's length P; the
    # present state, max(P, total) long, holds that past, the S new keys after
    # it, and zeros; query i sits at position past + i.

    # (each computed once a node: the rotary positions, both states and the
    # causal mask read them)
    @functools.cached_property
    def _first_prompt(self) -> str:
        """Whether the call is a first prompt (S == total_sequence_length): (1,) bool."""
        total = self.op("Cast", [self._in(6)], to=TensorProto.INT64)
        return self.op("Equal", [self._shape_part(self._in(0), 1), self._flat(total)])

    @functools.cached_property
    def _row_pasts(self) -> str:
        """Each row's past length, (B, 1) int64."""
        lengths = self.op("Cast", [self._in(5)], to=TensorProto.INT64)
        after = self.op(
            "Sub", [self.op("Add", [lengths, self._int(1)]), self._shape_part(self._in(0), 1)]
        )
        past = self.op("Where", [self._first_prompt, self._int(0), after])
        return self.op("Unsqueeze", [past, self._axes([1])])

    @functools.cached_property
    def _query_steps(self) -> str:
        """``0 .. S-1`` as (1, S) int64."""
        return self.op("Unsqueeze", [self._positions(self._in(0)), self._axes([0])])

    def _flat(self, x: str) -> str:
        return self.op("Reshape", [x, self._axes([-1])])

    def _rotary_steps(self) -> str:
        """The positions the rotary caches are read at, (B, S) int64: the
        position ids (a first prompt reads their first element, counting on
        from it), else each row's past length on."""
        steps = self._query_steps
        if self._in(9):
            first = self.op("Gather", [self._flat(self._in(9)), self._int(0)], axis=0)
            counted = self.op("Add", [steps, first])
            return self.op("Where", [self._first_prompt, counted, self._in(9)])
        if not self._in(3):
            return steps
        return self.op("Add", [steps, self._row_pasts])

    def _present(self, pairs) -> list[str]:
        """Each (past, new) of ``pairs`` as (B, N, max(P, total), head): row b's
        past keys, its new ones after them, zeros after those."""
        buffer = self._shape_part(pairs[0][0], 2)
        total = self.op("Cast", [self._flat(self._in(6))], to=TensorProto.INT64)
        length = self.op("Max", [buffer, total])
        return self._written(pairs, self._row_pasts, length)

    def _written(self, pairs, pasts, length, keep_past: bool = False) -> list[str]:
        """Each (past buffer, new) of ``pairs`` (keys and values: one shape) as
        (B, N, length, head): the new written after each row's ``pasts`` (B or
        1, 1) entries of the buffer; after them zeros, or (``keep_past``) the
        buffer as it was. One gather each from the past, the new and a zero
        row, at indices computed once."""
        state, new = pairs[0]
        buffer, count = self._shape_part(state, 2), self._shape_part(new, 2)
        j = self.op("Unsqueeze", [self._positions_to(length), self._axes([0])])  # (1, T)
        offset = self.op("Sub", [j, pasts])  # (B, T): the new key's index
        is_past = self.op("Less", [j, pasts])
        is_new = self.op("And", [self.op("Not", [is_past]), self.op("Less", [offset, count])])
        old = self.op("Not", [is_new]) if keep_past else is_past
        zero_row = self.op("Add", [buffer, count])
        index = self.op(
            "Where",
            [is_new, self.op("Add", [offset, buffer]), self.op("Where", [old, j, zero_row])],
        )  # (B, T) into the past, the new keys and a zero row, joined
        shape = self.op("Shape", [new])
        full = self.op(
            "Concat",
            [self.op("Slice", [shape, self._axes([0]), self._axes([2])]), length,
             self.op("Slice", [shape, self._axes([3]), self._axes([4])])],
            axis=0,
        )  # fmt: skip
        spread = self.op("Expand", [self.op("Unsqueeze", [index, self._axes([1, 3])]), full])
        out = []
        for state, new in pairs:
            zeros = self.op("Mul", [self._slice_axis(new, 2, 0, 1), self.const(0.0)])
            joined = self.op("Concat", [state, new, zeros], axis=2)
            out.append(self.op("GatherElements", [joined, spread], axis=2))
        return out

    def _positions_to(self, length: str) -> str:
        """``0 .. length-1`` (int64) for a one-element ``length``."""
        end = self.op("Squeeze", [length, self._axes([0])])
        return self.op("Range", [self._int(0), end, self._int(1)])

    def _slice_axis(self, x: str, axis: int, start: int, end: int) -> str:
        return self.op("Slice", [x, self._axes([start]), self._axes([end]), self._axes([axis])])

    def _causal_after_past(self, k: str, window: int) -> str:
        """(B, 1, S, T): key ``j`` for query ``i`` of row b where ``j <= past_b + i``
        (and ``j > past_b + i - window`` with a window)."""
        at = self.op("Add", [self._row_pasts, self._query_steps])
        at = self.op("Unsqueeze", [at, self._axes([2])])  # (B, S, 1)
        j = self.op("Reshape", [self._positions(k, 2), self._axes([1, 1, -1])])
        keep = self.op("LessOrEqual", [j, at])
        if window > 0:
            start = self.op("Sub", [at, self._int(window)])
            keep = self.op("And", [keep, self.op("Greater", [j, start])])
        return self.op("Unsqueeze", [keep, self._axes([1])])

    def _valid_keys(self, k: str, lengths: str) -> str:
        """(B, 1, 1, T): key ``j`` where ``j <= seqlens_k[b]`` (its sequence's last token)."""
        last = self.op("Cast", [lengths], to=TensorProto.INT64)
        valid = self.op(
            "LessOrEqual",
            [self.op("Unsqueeze", [self._positions(k, 2), self._axes([0])]),
             self.op("Unsqueeze", [last, self._axes([1])])],
        )  # fmt: skip
        return self.op("Unsqueeze", [valid, self._axes([1, 2])])

    def _split3(self, packed: str, hidden: int) -> list[str]:
        names = [self._name(part) for part in ("q", "k", "v")]
        split = self._axes([hidden, hidden, hidden])
        self.out.append(
            helper.make_node("Split", [packed, split], names, self._name("split"), axis=-1)
        )
        return names

    def _attend(self, q, k, v, heads, hidden, penalties, past=(), present=(), shared=""):
        """``softmax(Q K^T * scale + penalties [+ causal]) V`` over ``heads``
        heads, as (B, S, hidden); ``past``: the key and value states (B, N,
        P, head) before the new ones, the concatenations written to
        ``present`` (two names, or one: Attention's, stacked). ``shared``: the
        past's length in a buffer of P (MultiHeadAttention's shared cache):
        the new keys written there, the keys after them masked."""
        if any(p is None for p in penalties):
            return None
        size = hidden // heads
        scale = attr(self.node, "scale", 0.0) or 1.0 / math.sqrt(size)
        heads_shape = self._axes([0, 0, heads, size])
        q, k, v = (self.op("Reshape", [n, heads_shape]) for n in (q, k, v))
        q = self.op("Transpose", [q], perm=[0, 2, 1, 3])
        v = self.op("Transpose", [v], perm=[0, 2, 1, 3])
        written = None
        if shared:  # (1, 1): every row's past length
            lengths = self.op("Reshape", [shared, self._axes([1, 1])])
            written = self.op("Cast", [lengths], to=TensorProto.INT64)
            k = self.op("Transpose", [k], perm=[0, 2, 1, 3])
            length = self._shape_part(past[0], 2)
            k, v = self._written(list(zip(past, (k, v))), written, length, keep_past=True)
        elif past:
            k = self.op("Concat", [past[0], self.op("Transpose", [k], perm=[0, 2, 1, 3])], axis=2)
            v = self.op("Concat", [past[1], v], axis=2)
        if past:
            if len(present) == 1 and present[0]:  # Attention's: the two stacked
                stacked = [self.op("Unsqueeze", [t, self._axes([0])]) for t in (k, v)]
                self.op("Concat", stacked, present[0], axis=0)
            for out, state in zip(present if len(present) == 2 else (), (k, v)):
                if out:
                    self.op("Identity", [state], out)
            k = self.op("Transpose", [k], perm=[0, 1, 3, 2])
        else:
            k = self.op("Transpose", [k], perm=[0, 2, 3, 1])
        scores = self.op("Mul", [self.op("MatMul", [q, k]), self.const(scale)])
        if written is not None:  # keys past the new ones: not computed by the kernel
            after = self.op("Add", [written, self._shape_part(q, 2)])
            beyond = self.op("Less", [self._positions(scores, 3), self._flat(after)])
            penalties = [*penalties, self.op("Where", [beyond, self.const(0.0), self.const(-1e30)])]
        if attr(self.node, "unidirectional", 0):
            offset = None if written is None else self._flat(written)
            penalties = [*penalties, self._causal_penalty(scores, offset)]
        for penalty in penalties:
            scores = self.op("Add", [scores, penalty])
        probs = self.op("Softmax", [scores], axis=-1)
        context = self.op("Transpose", [self.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        self.op("Reshape", [context, self._axes([0, 0, hidden])], self._out(0))
        return self.out

    def _causal_penalty(self, scores: str, offset: str | None = None) -> str:
        """``mask_filter_value`` where a key comes after its query, as (S, T)."""
        fill = self.const(attr(self.node, "mask_filter_value", -10000.0))
        return self.op("Where", [self._causal_keep(scores, offset=offset), self.const(0.0), fill])

    def _causal_keep(self, scores: str, window: int | None = None, offset=None) -> str:
        """(S, T): key ``j`` for query ``i`` where ``j <= i + T - S`` (the queries
        the last S of T positions, after a past state; ``offset``: one int64
        for ``T - S``), and with a ``window`` ``j > i + T - S - window`` (the
        query's own key and ``window - 1`` before)."""
        shape = self.op("Shape", [scores])
        square = self.op("Slice", [shape, self._axes([2]), self._axes([4])])
        ones = self.op(
            "ConstantOfShape", [square], value=numpy_helper.from_array(np.ones(1, np.int64))
        )
        if offset is None:
            sizes = [self.op("Gather", [shape, self._int(axis)], axis=0) for axis in (3, 2)]
            offset = self.op("Sub", sizes)
        else:
            offset = self.op("Squeeze", [offset, self._axes([0])])
        kept = self.op("Trilu", [ones, offset], upper=0)
        if window is not None:
            start = self.op("Sub", [offset, self._int(window - 1)])
            kept = self.op("Trilu", [kept, start], upper=1)
        return self.op("Cast", [kept], to=TensorProto.BOOL)

    def _mask_penalty(self, mask: str, x: str) -> str | None:
        """``mask_filter_value`` where a key is masked, 0 elsewhere, as (B, 1, 1, T)."""
        shape = self.shapes.get(mask)
        source = self.producers.get(mask)
        if shape is None and source is not None and source.op_type == "EmbedLayerNormalization":
            shape = (None,)  # its mask index: one length a sequence
        rank = len(shape or ())
        fill = self.const(attr(self.node, "mask_filter_value", -10000.0))
        zero = self.const(0.0)
        if rank == 1:  # one length a sequence: right padding
            steps = self._positions(x)
            ends = self.op(
                "Unsqueeze", [self.op("Cast", [mask], to=TensorProto.INT64), self._axes([1])]
            )
            keep = self.op("Less", [self.op("Unsqueeze", [steps, self._axes([0])]), ends])
        elif rank == 2:  # raw: 1 attends, 0 is masked
            keep = self.op("Cast", [mask], to=TensorProto.BOOL)
        else:
            return None
        penalty = self.op("Where", [keep, zero, fill])
        return self.op("Unsqueeze", [penalty, self._axes([1, 2])])

    def _transposed_last(self, name: str) -> str | None:
        shape = self.shapes.get(name)
        if shape is None:
            return None
        perm = list(range(len(shape)))
        perm[-2:] = perm[-1:-3:-1]
        return self.op("Transpose", [name], perm=perm)
