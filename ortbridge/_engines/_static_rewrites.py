"""The exact rewrites of a reverse model built for static shapes, in the order they run.

With every shape known, onnx-ad's general reverse model has cheaper equal
forms; each rewrite is its own module, this one says when each runs: on the
whole reverse model before :mod:`._split` cuts it, then on the backward
graph (some of them reading what the forward graph returns).
"""

from __future__ import annotations

import onnx

from .._onnx_utils import drop_unread_initializers
from ._conv_grad import conv_input_gradients, conv_weight_gradients
from ._norm_stats import forward_norm_statistics
from ._opset18 import raise_to_opset18
from ._optimize import facts
from ._pool_grad import maxpool_gradients
from ._reductions import fast_reductions
from ._scalar_operands import full_rank_scalars
from ._scan_hoist import hoisted_step_work
from ._scan_outputs import scan_outputs_without_copies
from ._scan_products import fused_scan_products
from ._scan_seed_axis import scan_bodies_without_seed_axis
from ._scan_sums import hoisted_scan_sums
from ._scatter_sums import concat_scatter_sums
from ._simplify import collapse_views, simplify
from ._weight_products import weight_products


def before_split(reverse: onnx.ModelProto) -> None:
    """Chains of views as one view (fewer nodes to dispatch); normalisations'
    backward reading their forward's statistics."""
    simplify(reverse)
    forward_norm_statistics(reverse)


def after_split(backward: onnx.ModelProto, forward: onnx.ModelProto) -> None:
    """The backward graph's products, pools and sums in their cheaper forms
    (a Scan's step sums taken once after it)."""
    conv_weight_gradients(backward)
    if any(n.op_type == "ConvTranspose" for n in backward.graph.node):
        raise_to_opset18(backward)  # Col2Im's opset
    conv_input_gradients(backward)
    maxpool_gradients(backward, forward)
    concat_scatter_sums(backward)
    weight_products(backward)
    hoisted_scan_sums(backward)
    scan_bodies_without_seed_axis(backward)
    hoisted_step_work(backward)
    scan_outputs_without_copies(backward)
    # The seed axis added and dropped: views that collapse (and what the
    # rewrites above left unread goes).
    collapse_views(backward)
    # Products in loop bodies, once their views have collapsed.
    fused_scan_products(backward)
    fused_scan_products(forward)
    # Both read the shapes of the graph as it now is (new tensors they add
    # are not rewritten again).
    found = facts(backward)
    if found is not None:
        fast_reductions(backward, found)
        full_rank_scalars(backward, found)
    drop_unread_initializers(backward.graph)
