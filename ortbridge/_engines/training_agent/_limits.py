"""What onnxruntime-training 1.19.2's gradient builder gets wrong, cannot run, or crashes on.

One table, :data:`LIMITS`: each entry names a node configuration, what the
builder does with it (:data:`WRONG` gradient, :data:`CRASH` of the process,
:data:`NO_KERNEL` for the gradient on the CPU, :data:`FAILS` at build or run
time) and, where one exists, a rewrite into a form it differentiates
correctly. Each entry's ``probe`` is a graph showing the defect:
``tests/engines/test_builder_limits.py`` runs the builder on every probe with the
table switched off (:func:`unguarded`) and fails once an entry is no longer
true on the installed runtime.

Before the builder is called, :func:`rewrite_for_builder` applies the
rewrites; a configuration left after them sends the graph to the onnxruntime
engine under ``backend="auto"`` (:func:`first_limit` over the whole graph)
and is refused by name under ``backend="training-agent"``
(:func:`refuse_limits`, over the nodes on a gradient path). The builder is
never handed a graph known to crash it.

The table stays one module: each entry beside the predicate it names is
what a reader checks an entry against.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import onnx
from onnx import TensorProto, numpy_helper

from ortbridge._prepare._onnx_utils import (
    FLOAT_TYPES,
    attr,
    gradient_path,
    node_reads,
    subgraph_reads,
)

WRONG = "silently wrong gradient"
CRASH = "kills the process"
NO_KERNEL = "no CPU kernel for its gradient"
FAILS = "fails at build or run time"


@dataclasses.dataclass(frozen=True)
class Limit:
    """One node configuration the builder must not see as it is."""

    key: str
    op_types: tuple[str, ...]
    kind: str
    #: The configuration, in words ("auto_pad=SAME_UPPER or SAME_LOWER").
    configuration: str
    applies: Callable[[onnx.NodeProto, _Facts], bool]
    #: A graph showing the defect: a name of ONNX's node test cases
    #: (``onnx.backend.test.case.node``) or of :mod:`tests.builder_probes`.
    probe: str
    #: Whether :func:`rewrite_for_builder` rewrites it where shapes allow.
    rewritten: bool = False


class _Facts:
    """What the entries read about a graph: element types, consumers, opset,
    and the tensors to be trained (``targets``: none where a graph is only
    judged for ``auto``)."""

    def __init__(self, model: onnx.ModelProto, targets=()):
        from ortbridge._prepare._lookup import _infer

        self.targets = frozenset(targets)

        self.opset = max(
            [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [1]
        )
        self.types, self.shapes = _infer(model)
        self.arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        self.raw = {t.name for t in model.graph.initializer if t.HasField("raw_data")}
        self.constants = {k: v for k, v in self.arrays.items() if v.ndim == 0}
        self.graph_outputs = {o.name for o in model.graph.output}
        self.graph_inputs = {i.name for i in model.graph.input}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in model.graph.node:
            for name in node_reads(node):
                self.consumers.setdefault(name, []).append(node)

    def float64(self, name: str) -> bool:
        return self.types.get(name) == TensorProto.DOUBLE

    def read(self, name: str) -> bool:
        return bool(name) and bool(self.consumers.get(name))


def _same(node, _):
    return str(attr(node, "auto_pad", "NOTSET")).startswith("SAME")


def _avg_dilations(node, _):
    return node.op_type == "AveragePool" and any(d != 1 for d in attr(node, "dilations", []) or [])


def _avg_3d(node, _):
    return node.op_type == "AveragePool" and len(attr(node, "kernel_shape", []) or []) == 3


def _avg_dynamic(node, facts):
    # What normalisation could not rewrite as a depthwise Conv is left as it is.
    shape = facts.shapes.get(node.input[0])
    return node.op_type == "AveragePool" and (shape is None or None in shape)


def _indices(node, _):
    return len(node.output) > 1 and bool(node.output[1])


def _reduction(node, _):
    return attr(node, "reduction", "none") != "none"


def inference_dropout(node, constants) -> bool:
    """A Dropout with its mask output, ``training_mode`` absent or a constant false."""
    if node.op_type != "Dropout" or len(node.output) < 2 or not node.output[1]:
        return False
    if len(node.input) < 3 or not node.input[2]:
        return True
    value = constants.get(node.input[2])
    return value is not None and not bool(value.any())


def _eval_dropout_mask(node, facts):
    # The builder scales the gradient by 1 / (1 - ratio) in inference mode too.
    return inference_dropout(node, facts.constants)


def _nan_rows(node, facts):
    # The graph expects rows of -inf (fully masked attention) and replaces the
    # NaN rows after the Softmax (IsNaN, or a Where selecting zeros): the
    # builder's gradient there is NaN where the true one is 0.
    names = [node.output[0]]
    while names:
        for reader in facts.consumers.get(names.pop(), []):
            if reader.op_type in ("Cast", "Identity"):
                names.append(reader.output[0])
            elif reader.op_type == "IsNaN" or reader.op_type == "Where":
                return True
    return False


def _bidirectional(node, _):
    return attr(node, "direction", "forward") == "bidirectional"


def _sequence_lens(node, _):
    return len(node.input) > 4 and bool(node.input[4])


def _concat64(node, facts):
    return facts.float64(node.output[0])


def _negative_steps(node, _):
    return len(node.input) > 4 and bool(node.input[4])


def _reduce_l2_old(node, facts):
    return facts.opset < 18


def _unread_output(node, facts):
    return any(not facts.read(o) and o not in facts.graph_outputs for o in node.output)


def _allow_zero(node, facts):
    # Only a 0 in the shape makes allowzero matter (dynamo writes allowzero=1 on
    # every Reshape); a shape computed at run time fails loudly, named, if it has one.
    shape = facts.arrays.get(node.input[1]) if len(node.input) > 1 else None
    return bool(attr(node, "allowzero", 0)) and shape is not None and bool((shape == 0).any())


def _per_axis(node, facts):
    # The scale is a frozen weight the module feeds: its declared shape tells.
    shape = facts.shapes.get(node.input[1]) if len(node.input) > 1 else None
    return shape is not None and any(d is None or d > 1 for d in shape)


def _float16_input(node, facts):
    return facts.types.get(node.input[0]) == TensorProto.FLOAT16


def _raw_zero_point(node, facts):
    return len(node.input) > 2 and node.input[2] in facts.raw


def _trainable_scale(node, facts):
    return len(node.input) > 1 and node.input[1] in facts.targets


def _shared_zero_point(node, facts):
    # One pair reads it twice; a second pair's reads are more.
    zero = node.input[2] if len(node.input) > 2 else ""
    return bool(zero) and len(facts.consumers.get(zero, ())) > 2


def _into_integer_product(node, facts):
    return any(
        c.op_type in ("MatMulInteger", "ConvInteger")
        for c in facts.consumers.get(node.output[0], ())
    )


def _always(node, _):
    return True


def _outer_float_reads(node, facts) -> list[str]:
    """Float tensors (or of unknown type) ``node``'s bodies read from outside."""
    reads = set()
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            reads |= subgraph_reads(a.g)
    return [n for n in sorted(reads) if facts.types.get(n, TensorProto.FLOAT) in FLOAT_TYPES]


def _if_reads_computed(node, facts):
    given = facts.graph_inputs | set(facts.arrays)
    return any(n not in given for n in _outer_float_reads(node, facts))


def _if_reads_given(node, facts):
    given = facts.graph_inputs | set(facts.arrays)
    return any(n in given for n in _outer_float_reads(node, facts))


#: The table. ``probe``: a node test case, or a graph of ``tests/builder_probes.py``.
LIMITS: tuple[Limit, ...] = (
    Limit(
        "auto-pad-same", ("Conv", "AveragePool", "MaxPool", "LpPool"), WRONG,
        "auto_pad=SAME_UPPER or SAME_LOWER", _same, "test_conv_with_autopad_same", True,
    ),
    Limit(
        "average-pool-dilations", ("AveragePool",), WRONG, "dilations other than 1",
        _avg_dilations, "test_averagepool_2d_dilations",
    ),
    Limit(
        "average-pool-3d", ("AveragePool",), WRONG, "a 3-D window", _avg_3d,
        "test_averagepool_3d_default",
    ),
    Limit(
        "average-pool-dynamic", ("AveragePool",), FAILS,
        "a dynamic dimension and no Conv form (padding with count_include_pad=0, "
        "ceil_mode, auto_pad or an unknown channel count)", _avg_dynamic,
        "average_pool_excluding_pads_of_a_dynamic_size",
    ),
    Limit(
        "max-pool-indices", ("MaxPool",), WRONG, "an Indices output", _indices,
        "test_maxpool_with_argmax_2d_precomputed_strides",
    ),
    Limit(
        "scatter-reduction", ("ScatterND", "ScatterElements"), WRONG,
        "a reduction (add, mul, max, min)", _reduction, "scatter_elements_reduction_add",
    ),
    Limit(
        "dropout-mask", ("Dropout",), WRONG, "a mask output in inference mode",
        _eval_dropout_mask, "test_dropout_default_mask", True,
    ),
    Limit(
        "softmax-masked-rows", ("Softmax", "LogSoftmax"), WRONG,
        "its rows replaced afterwards (IsNaN or Where: fully masked rows)", _nan_rows,
        "test_attention_23_fullymasked_qk_matmul_output_mode3_zero_expanded",
    ),
    Limit(
        "loop", ("Loop",), FAILS, "a Loop (nn.EmbeddingBag exports one)", _always,
        "loop_of_weight",
    ),
    Limit("scan", ("Scan",), FAILS, "a Scan", _always, "test_scan9_sum"),
    Limit(
        "if-reads-computed", ("If",), CRASH,
        "a branch reading a float tensor computed outside it", _if_reads_computed,
        "if_reading_a_computed_tensor",
    ),
    Limit(
        "if-reads-input", ("If",), FAILS,
        "a branch reading a float graph input or weight (the builder looks for it by "
        "name and does not find it)", _if_reads_given, "if_reading_an_input",
    ),
    Limit(
        "conv-transpose", ("ConvTranspose",), NO_KERNEL, "any", _always, "test_convtranspose"
    ),
    Limit(
        "resize", ("Resize", "Upsample"), NO_KERNEL, "any", _always,
        "test_resize_upsample_scales_nearest",
    ),
    Limit("grid-sample", ("GridSample",), FAILS, "any", _always, "test_gridsample"),
    Limit(
        "bidirectional-lstm", ("LSTM",), NO_KERNEL, "direction=bidirectional", _bidirectional,
        "bidirectional_lstm",
    ),
    Limit(
        "recurrent-sequence-lens", ("LSTM", "GRU", "RNN"), FAILS, "a sequence_lens input",
        _sequence_lens, "test_lstm_with_peepholes",
    ),
    Limit(
        "split-to-sequence", ("SplitToSequence",), FAILS,
        "a sequence read at a computed position: the weight is called unreachable",
        _always, "split_to_sequence_of_weight",
    ),
    Limit(
        "split-unread-output", ("Split",), FAILS,
        "an output nothing reads (its gradient comes out the size of the parts read)",
        _unread_output, "split_with_unread_output",
    ),
    Limit(
        "concat-float64", ("Concat",), FAILS, "float64 (its gradient has no float64 kernel)",
        _concat64, "test_concat_1d_axis_0",
    ),
    Limit(
        "slice-steps", ("Slice",), FAILS, "a steps input", _negative_steps,
        "test_slice_neg_steps",
    ),
    Limit(
        "reshape-allowzero", ("Reshape",), FAILS, "allowzero=1 and a 0 in a constant shape",
        _allow_zero, "reshape_allowzero_beside_a_weight",
    ),
    Limit(
        "fake-quantize-per-axis", ("QuantizeLinear", "DequantizeLinear"), FAILS,
        "a scale per axis (the builder's FakeQuant takes one scale)", _per_axis,
        "per_axis_fake_quantization",
    ),
    Limit(
        "float16-pool", ("MaxPool", "AveragePool"), CRASH, "float16 input", _float16_input,
        "float16_max_pool",
    ),
    Limit(
        "fake-quantize-raw-zero-point", ("QuantizeLinear", "DequantizeLinear"), FAILS,
        "a zero point held as raw bytes (the builder's QDQ fusion reads the typed field only)",
        _raw_zero_point, "raw_zero_point_fake_quantization", True,
    ),
    Limit(
        "fake-quantize-trainable-scale", ("QuantizeLinear", "DequantizeLinear"), WRONG,
        "a trainable scale (the builder's FakeQuant gives the scale no gradient)",
        _trainable_scale, "trainable_scale_fake_quantization",
    ),
    Limit(
        "fake-quantize-shared-zero-point", ("QuantizeLinear", "DequantizeLinear"), FAILS,
        "a zero point another pair reads too (the builder's QDQ fusion removes it with the "
        "first pair)", _shared_zero_point, "shared_zero_point_fake_quantization",
    ),
    Limit(
        "fake-quantize-into-integer-product", ("QuantizeLinear",), FAILS,
        "an integer product (MatMulInteger, ConvInteger) reading it: dynamic quantization "
        "(the builder's QDQ fusion wants a DequantizeLinear after each QuantizeLinear)",
        _into_integer_product, "quantize_into_integer_product",
    ),
    Limit(
        "reduce-l2-opset17", ("ReduceL2",), FAILS, "an ai.onnx opset below 18",
        _reduce_l2_old, "reduce_l2_opset17", True,
    ),
)  # fmt: skip

_BY_OP: dict[str, list[Limit]] = {}
for _limit in LIMITS:
    for _op in _limit.op_types:
        _BY_OP.setdefault(_op, []).append(_limit)

_GUARDED = True


@contextlib.contextmanager
def unguarded():
    """The table switched off: the builder sees every graph as it is (for tests)."""
    global _GUARDED
    previous, _GUARDED = _GUARDED, False
    try:
        yield
    finally:
        _GUARDED = previous


def guarded() -> bool:
    return _GUARDED


def limits_of(node: onnx.NodeProto, facts: _Facts) -> list[Limit]:
    """The entries ``node`` falls under."""
    if node.domain not in ("", "ai.onnx"):
        return []
    return [lim for lim in _BY_OP.get(node.op_type, ()) if lim.applies(node, facts)]


def first_limit(
    model: onnx.ModelProto, nodes=None, targets=()
) -> tuple[onnx.NodeProto, Limit] | None:
    """The first node of ``nodes`` (default: all) under an entry, with the entry;
    ``targets``: the tensors to be trained (entries about training them)."""
    nodes = list(model.graph.node if nodes is None else nodes)
    if not _GUARDED or not any(node.op_type in _BY_OP for node in nodes):
        return None  # no shape inference for a graph the table cannot concern
    facts = _Facts(model, targets)
    for node in nodes:
        found = limits_of(node, facts)
        if found:
            return node, found[0]
    return None


def describe(node: onnx.NodeProto, limit: Limit) -> str:
    """Why the builder must not see ``node``, in words."""
    # "any": every configuration of the op, nothing to name.
    shown = "" if limit.configuration == "any" else f" with {limit.configuration}"
    return (
        f"node {node.name!r} (op type {node.op_type}){shown}: "
        f"onnxruntime-training 1.19.2's gradient builder {_VERBS[limit.kind]}"
    )


_VERBS = {
    WRONG: "computes a wrong gradient for it",
    CRASH: "kills the process on it",
    NO_KERNEL: "writes a gradient with no CPU kernel for it",
    FAILS: "fails on it",
}


def refuse_limits(model: onnx.ModelProto, targets) -> None:
    """Raise :class:`NotDifferentiableError` for an entry on a gradient path of ``model``."""
    from ortbridge.exceptions import NotDifferentiableError

    outputs = [o.name for o in model.graph.output]
    found = first_limit(model, gradient_path(model, targets, outputs), targets)
    if found is not None:
        node, limit = found
        raise NotDifferentiableError(
            f"the training-agent engine cannot train {describe(node, limit)}; "
            'backend="onnxruntime" (or "auto") trains it',
            node=node.name,
            op_type=node.op_type,
        )


def rewrite_for_builder(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (a copy when changed) with the table's rewrites applied where shapes allow."""
    if not _GUARDED:
        return model
    from ._rewrites import rewrite

    return rewrite(model)
