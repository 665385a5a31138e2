"""The optimiser's contract and its ordered list of passes.

A pass rewrites graphs in place into equal, cheaper ones (or, one of them,
into ones the CPU provider has kernels for). It is a function of
:class:`Graphs` (the models of the stage it runs at) and declares when it
runs: on the user's graph before onnx-ad differentiates it (``PRIMAL``), on
the whole reverse model before :mod:`.._split` cuts it (``REVERSE``), or on
the backward graph after the cut, reading the forward graph where it needs
to (``BACKWARD``). Most need every shape known (``static``: graphs built for
one input shape); the others run on the shape-generic graphs too. :data:`PASSES`
is the order they run in; :func:`run` runs one stage's and names the pass an
error came from.

A pass keeps every tensor's name and shape (it may add tensors and leave
others unread). Most read every shape, from one shape inference of the
whole graph (:func:`._optimize.facts`); where a pass reads the shapes the
one before it read, it takes them from :class:`Graphs` and infers only the
nodes added since (:func:`._optimize.extended`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx

from ortbridge._prepare._lookup import _all_names
from ortbridge._prepare._onnx_utils import drop_unread_initializers

from ._conv_grad import conv_input_gradients, conv_weight_gradients
from ._dense_depthwise import dense_depthwise
from ._fused_activations import fused_activations
from ._norm_stats import forward_norm_statistics
from ._opset18 import raise_to_opset18
from ._optimize import Facts, _shapes, extended, facts, optimize_reverse
from ._pool_grad import maxpool_gradients
from ._reductions import fast_reductions, reductions_dropping_axes
from ._scalar_operands import full_rank_scalars
from ._scatter_sums import concat_scatter_sums, half_scatters_in_float
from ._short_broadcasts import spread_short_broadcasts
from ._simplify import collapse_views, merge_reshapes, simplify
from ._softmax_axes import softmax_reductions
from ._weight_products import weight_products
from .scan._hoist import hoisted_step_work
from .scan._outputs import scan_outputs_without_copies
from .scan._products import fused_scan_products
from .scan._seed_axis import scan_bodies_without_seed_axis
from .scan._sums import hoisted_scan_sums
from .unit_axes._identity_views import drop_identity_views
from .unit_axes._seed import without_seed_axis
from .unit_axes._transposes import composed_transposes, squeezed_transposes

PRIMAL, REVERSE, BACKWARD = "primal", "reverse", "backward"


@dataclasses.dataclass
class Graphs:
    """The models a stage's passes read and rewrite."""

    primal: onnx.ModelProto | None = None
    reverse: onnx.ModelProto | None = None
    forward: onnx.ModelProto | None = None
    backward: onnx.ModelProto | None = None
    #: The forward graph's shapes as the last pass to infer them left them
    #: (the engine sizes its sessions' thread pools by them): None if none did.
    forward_shapes: dict | None = None
    #: The reverse graph's shapes and types as the view simplification left
    #: them, for the pass after it (None: not simplified).
    reverse_shapes: tuple | None = None
    #: The backward's facts as the view collapse read them (the pass after it
    #: extends them by the nodes added since).
    backward_facts: Facts | None = None


@dataclasses.dataclass(frozen=True)
class Pass:
    """One rewrite: its name, the stage it runs at, whether it needs static shapes."""

    name: str
    stage: str
    static: bool
    call: Callable[[Graphs], None]


def _views_simplified(g: Graphs) -> None:
    g.reverse_shapes = simplify(g.reverse)


def _conv_gradients(g: Graphs) -> None:
    # One shape inference for both: the weight gradients' rewrite leaves the
    # input gradients' ConvTransposes, and what they read, as they were.
    found = conv_weight_gradients(g.backward)
    if any(n.op_type == "ConvTranspose" for n in g.backward.graph.node):
        raise_to_opset18(g.backward)  # Col2Im's opset
    conv_input_gradients(g.backward, found)


def _views_collapsed(g: Graphs) -> None:
    # One shape inference for each graph: the transposes record the shapes
    # they add; the backward's facts go on to the known-shape forms; the
    # forward's shapes are kept for the thread choice (the one later pass on
    # the forward, Scan products, adds tensors without shapes, and the choice
    # then keeps torch's count).
    found = facts(g.backward)
    if found is not None:
        squeezed_transposes(g.backward, found.shapes)
        collapse_views(g.backward, found.shapes)
        g.backward_facts = found
    shapes = _shapes(g.forward)
    if shapes is not None:
        squeezed_transposes(g.forward, shapes)
        g.forward_shapes = shapes


def _scan_products(g: Graphs) -> None:
    if any(n.op_type == "Scan" for n in g.backward.graph.node):
        # Its fresh names may be ones the view collapse freed: the next pass
        # then infers the whole graph rather than read the collapse's facts.
        g.backward_facts = None
    fused_scan_products(g.backward)
    fused_scan_products(g.forward)


def _current_facts(g: Graphs):
    """The backward's facts: those the view collapse read, extended by the nodes
    written since under new names (every other tensor keeps its name and
    shape: the passes' contract; the collapse frees names only once it has
    taken its own), producers, readers and names taken read from the graph
    as it is; inferred anew where there are none."""
    found, g.backward_facts = g.backward_facts, None
    if found is None:
        return facts(g.backward)
    graph = g.backward.graph
    added = [n for n in graph.node if any(o and o not in found.producer for o in n.output)]
    grown = extended(found, g.backward, added)
    if grown is None:  # the partial inference failed: the whole graph's
        return facts(g.backward)
    return dataclasses.replace(grown, taken=_all_names(graph))


def _unseeded(g: Graphs) -> None:
    # The facts go on to the known-shape forms, extended by the nodes added.
    found = _current_facts(g)
    if found is not None:
        without_seed_axis(g.backward, found)
        composed_transposes(g.backward, found.shapes)
    g.backward_facts = found


def _known_shape_forms(g: Graphs) -> None:
    # All three read the shapes of the graph as it now is (new tensors they
    # add are not rewritten again). The views the reductions end with often
    # feed another view: each node costs onnxruntime a dispatch, so chains
    # become one (no shapes needed).
    found = _current_facts(g)
    if found is not None:
        fast_reductions(g.backward, found)
        full_rank_scalars(g.backward, found)
        spread_short_broadcasts(g.backward, found)
        merge_reshapes(g.backward.graph)
        reductions_dropping_axes(g.backward, found)
    g.backward_facts = found


def _identity_views(g: Graphs) -> None:
    found = _current_facts(g)
    if found is not None:
        drop_identity_views(g.backward, found.shapes)


PASSES: tuple[Pass, ...] = (
    Pass("GELU and SiLU as one kernel", PRIMAL, False, lambda g: fused_activations(g.primal)),
    Pass("small depthwise Convs as products", PRIMAL, True, lambda g: dense_depthwise(g.primal)),
    Pass("folding, unit-axis transposes, ReLU masks", REVERSE, False,
         lambda g: optimize_reverse(g.reverse)),
    Pass("chains of views as one view", REVERSE, True, _views_simplified),
    Pass("norms' backward reads forward statistics", REVERSE, True,
         lambda g: forward_norm_statistics(g.reverse, g.reverse_shapes)),
    Pass("Conv gradients: weights as im2col, inputs as Col2Im (opset 18)", BACKWARD, True,
         _conv_gradients),
    Pass("MaxPool gradients without indices", BACKWARD, True,
         lambda g: maxpool_gradients(g.backward, g.forward)),
    Pass("scatters that tile an axis as a Concat", BACKWARD, True,
         lambda g: concat_scatter_sums(g.backward)),
    Pass("batched weight gradients as one product", BACKWARD, True,
         lambda g: weight_products(g.backward)),
    Pass("Scan step sums after the loop", BACKWARD, True,
         lambda g: hoisted_scan_sums(g.backward)),
    Pass("Scan bodies without the seed axis", BACKWARD, True,
         lambda g: scan_bodies_without_seed_axis(g.backward)),
    Pass("Scan step work before the loop", BACKWARD, True,
         lambda g: hoisted_step_work(g.backward)),
    Pass("Scan outputs without copies", BACKWARD, True,
         lambda g: scan_outputs_without_copies(g.backward)),
    # The seed axis added and dropped: views that collapse (and what the
    # passes above left unread goes); transposes that move a unit axis first,
    # after the passes above that read onnx-ad's Transposes.
    Pass("unit axes out of transposes, views collapsed", BACKWARD, True, _views_collapsed),
    # The forward's thread choice reads the shapes of the nodes this adds.
    Pass("a softmax over an inner axis as its reductions", BACKWARD, True,
         lambda g: softmax_reductions(g.forward, g.forward_shapes)),
    # Products in loop bodies, once their views have collapsed.
    Pass("Scan products with outside weights", BACKWARD, True, _scan_products),
    Pass("adjoints without the seed axis", BACKWARD, True, _unseeded),
    Pass("reductions, scalar operands and short broadcasts at known shapes", BACKWARD, True,
         _known_shape_forms),
    # Last of the rewrites: the views the passes above leave keeping a shape.
    Pass("views that keep their input's shape dropped", BACKWARD, True, _identity_views),
    # Not a speed-up: a kernel the CPU provider lacks (every shape; after the
    # passes above, which read the scatters as onnx-ad wrote them).
    Pass("float16 scatters that add, in float32", BACKWARD, False,
         lambda g: half_scatters_in_float(g.backward)),
    Pass("unread initializers dropped", BACKWARD, True,
         lambda g: drop_unread_initializers(g.backward.graph)),
)  # fmt: skip


def run(stage: str, graphs: Graphs, static: bool) -> None:
    """Run ``stage``'s passes in order (only those not needing static shapes
    unless ``static``)."""
    for one in PASSES:
        if one.stage == stage and (static or not one.static):
            try:
                one.call(graphs)
            except Exception as exc:
                exc.add_note(f"in the onnxruntime engine's optimiser pass {one.name!r}")
                raise
