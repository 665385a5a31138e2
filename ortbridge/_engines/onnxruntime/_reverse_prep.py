"""A graph made ready for onnx-ad's reverse mode, and what is refused before it runs.

Shared by the onnxruntime engine (:mod:`._engine`) and the training
package's loss gradients (:mod:`ortbridge.training._graphs._reverse_gradient`), which
both hand onnx-ad a prepared graph: ortbridge's rewrites applied
(:func:`prepare`), output shapes declared (onnx-ad's seeds need them), nodes
onnx-ad would differentiate silently wrong refused by name, and onnx-ad's own
refusals turned into :class:`~ortbridge.exceptions.NotDifferentiableError`
naming the node; frozen settings given as weights baked in as constants.
"""

from __future__ import annotations

import importlib
import re

import onnx

from ortbridge._prepare._onnx_utils import attr, gradient_path
from ortbridge._runtime import _ort
from ortbridge.exceptions import MissingDependencyError, NotDifferentiableError

from ._ad_rewrites_fused import LEFT_FUSED

SEED_AXIS = "nadj"


def onnx_ad():
    """The ``onnx_ad`` module, imported on first use (only this engine needs it)."""
    try:
        return importlib.import_module("onnx_ad")
    except ImportError as exc:
        raise MissingDependencyError(
            "the onnxruntime engine needs onnx-ad: `pip install onnx-ad==0.3.0` "
            "(a dependency of ortbridge; reinstall it with `pip install ortbridge[ort]`)"
        ) from exc


def declare_outputs(model: onnx.ModelProto) -> None:
    """Give the graph outputs the shapes onnx infers: onnx-ad seeds need them."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        return
    known = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in model.graph.output:
        vi = known.get(out.name)
        if vi is not None and vi.type.tensor_type.HasField("shape"):
            if not out.type.tensor_type.HasField("shape") or not out.type.tensor_type.elem_type:
                out.type.CopyFrom(vi.type)


#: onnx-ad refusals that a graph built for static input shapes avoids: those
#: asking for declared shapes; ``auto_pad=SAME_*`` and the weights of a grouped
#: Conv and of a ConvTranspose, which :mod:`._ad_rewrites_conv` rewrites once
#: channels and sizes are known; and operands wanted constant (a Pad's widths,
#: a Slice's bounds), which shape arithmetic computes (Swin's window padding)
#: and which fold to constants once the shapes are static. Operands computed
#: from data are refused again, by name, by the graph built for a stand-in shape.
STATIC_HINT = re.compile(
    r"declared|static|auto_pad=SAME|only with a constant"
    r"|grouped Conv is not differentiated|ConvTranspose is not differentiated",
    re.IGNORECASE,
)


def not_differentiable(exc: Exception, model: onnx.ModelProto) -> NotDifferentiableError:
    text = str(exc)
    named = re.search(r"for (\w+) \(node '([^']*)'\)", text)
    if named:
        op_type, node = named.groups()
    else:
        found = _culprit(text, model)
        if found is None:
            return NotDifferentiableError(
                f"the onnxruntime engine cannot differentiate the graph: {text}"
            )
        op_type, node = found.op_type, found.name
        same = sum(1 for n in model.graph.node if n.op_type == op_type)
        if same > 1:  # the message does not say which one
            return NotDifferentiableError(
                f"the onnxruntime engine cannot differentiate a node of op type {op_type} "
                f"(the graph has {same}, the first is node {node!r}): {text}"
            )
    # A fused node left as it is says which of its forms it has.
    form = next((n.doc_string for n in model.graph.node if n.name == node), "")
    form = f" ({form})" if form.startswith(LEFT_FUSED) else ""
    return NotDifferentiableError(
        f"the onnxruntime engine cannot differentiate node {node!r} (op type {op_type})"
        f"{form}: {text}",
        node=node,
        op_type=op_type,
    )


def _culprit(text: str, model: onnx.ModelProto):
    """The node an onnx-ad refusal is about, from the op types its message names.

    A message may name an op onnx-ad wrote itself while expanding a function
    (a RotaryEmbedding's Slice): then the function's node is named.
    """
    from onnx_ad import rules

    words = set(re.findall(r"\w+", text))
    nodes = list(model.graph.node)
    for match in (
        lambda n: n.op_type in words,
        lambda n: n.op_type not in rules.REVERSE,
        lambda n: any(w[:7] == n.op_type[:7] for w in words if len(w) >= 7),
    ):
        found = next((n for n in nodes if match(n)), None)
        if found is not None:
            return found
    return None


def refuse_known_wrong(model: onnx.ModelProto, targets, seeded) -> None:
    """Refuse, by name, a node onnx-ad would differentiate silently wrong.

    Only nodes on a gradient path count: between a tensor needing a gradient
    and a differentiated output.
    """
    from ._ad_rewrites import known_wrong

    path = gradient_path(model, targets, seeded)
    # Tensors a gradient reaches: the targets and what the path's nodes write
    # (an input of a node on the path that a gradient reaches is one of these).
    reached = set(targets).union(*(node.output for node in path))
    for node in path:
        reason = known_wrong(node)
        if node.op_type == "OneHot" and len(node.input) > 2 and node.input[2] in reached:
            reason = "onnx-ad 0.3.0 gives OneHot's values a zero derivative"
        if node.op_type == "DequantizeLinear" and node.input[0] in reached:
            # What stays after :mod:`._ad_rewrites_quant` made the pairs fake quantization.
            reason = (
                "onnx-ad carries no gradient through the integers it dequantizes, and no "
                "QuantizeLinear or DynamicQuantizeLinear of the same scale and zero point "
                "writes them"
            )
        if node.op_type == "Resize" and _downsampling_align_corners(node, model):
            reason = (
                "onnx-ad 0.3.0's gradient is wrong for a linear or cubic Resize with "
                "align_corners that shrinks an axis by its scales; give sizes instead"
            )
        if reason:
            raise NotDifferentiableError(
                f"the onnxruntime engine cannot differentiate node {node.name!r} "
                f"(op type {node.op_type}) correctly: {reason}; freeze what lies before it",
                node=node.name,
                op_type=node.op_type,
            )


def refuse_old_ceil_pools(model: onnx.ModelProto) -> None:
    """onnxruntime < 1.20 sizes ceil-mode pools unlike the rewrite of :func:`prepare`."""
    for node in model.graph.node:
        if node.op_type != "AveragePool" or not attr(node, "ceil_mode", 0):
            continue
        if attr(node, "count_include_pad", 0) and _ort.version() < (1, 20):
            raise NotDifferentiableError(
                f"the onnxruntime engine cannot differentiate node {node.name!r} (op type "
                "AveragePool) correctly on onnxruntime before 1.20: with ceil_mode and "
                "count_include_pad its last window may start in the end padding and is "
                "counted there; use onnxruntime 1.20 or later",
                node=node.name,
                op_type=node.op_type,
            )


def _downsampling_align_corners(node, model) -> bool:
    if attr(node, "coordinate_transformation_mode", "half_pixel") != "align_corners":
        return False
    if attr(node, "mode", "nearest") not in ("linear", "cubic") or len(node.input) < 3:
        return False
    scales = next((i for i in model.graph.initializer if i.name == node.input[2]), None)
    return scales is not None and bool((onnx.numpy_helper.to_array(scales) < 1).any())


def prepare(model: onnx.ModelProto) -> None:
    """ortbridge's rewrites of what onnx-ad gets wrong or refuses (:mod:`._ad_rewrites`)."""
    from ._ad_rewrites import prepare_for_reverse

    prepared = prepare_for_reverse(model)
    if prepared is not model:
        model.CopyFrom(prepared)


def fix_seed_axis(model: onnx.ModelProto) -> None:
    """One seed direction: the seed axis is 1, so onnxruntime knows its size."""
    for vi in list(model.graph.input) + list(model.graph.output):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param == SEED_AXIS:
                dim.Clear()
                dim.dim_value = 1


def setting_positions(model, feed_names, targets, n_inputs) -> list[int]:
    """Feed positions of frozen weights read only at non-differentiable operands
    (axes, pads, scales, a Dropout ratio): onnx-ad needs those constant, so they
    are baked into the graph (:func:`bake`)."""
    from ortbridge._prepare._weights import NON_DIFFERENTIABLE_SLOTS

    readers: dict[str, list] = {}
    for node in model.graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, slot))
    outputs = {o.name for o in model.graph.output}
    found = []
    for pos in range(n_inputs, len(feed_names)):
        name = feed_names[pos]
        uses = readers.get(name, [])
        if name in targets or name in outputs or not uses:
            continue
        if all(
            op != "BatchNormalization" and slot in NON_DIFFERENTIABLE_SLOTS.get(op, ())
            for op, slot in uses
        ):
            found.append(pos)
    return found


def bake(model: onnx.ModelProto, values: dict) -> None:
    """Turn the graph inputs ``values`` names into initializers holding those values."""
    if not values:
        return
    kept = [i for i in model.graph.input if i.name not in values]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    for name, value in values.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
