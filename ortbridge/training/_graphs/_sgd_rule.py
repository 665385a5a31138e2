"""The update rule of the fused SGD optimizers, written as ONNX nodes.

Both conventions of the project (:class:`.._sgd.OrtSGD`, torch's, and
:class:`.._sgd.SklearnSGD`, scikit-learn's) are one family of graphs with
different scalar inputs. With ``g`` the gradient, a group's update is::

    g' = a g + d w + e sign(w)
    v  = mu v + c g'                       (with momentum)
    w  = w + s v            or, Nesterov:  w = w + s (mu v + c g')
    w  = w + s c g'                        (without momentum)

computed in torch.optim.SGD's order of operations (so that float32 rounds the
same way), leaving out the multiplications by a coefficient that is always 1.
:class:`_Flags` says which terms a group has, and so which scalar inputs its
nodes read (:func:`_scalar_names`). The nodes of one parameter
(:func:`_update_nodes`) serve both the optimizers' update graph
(:func:`build_update_graph`) and the estimators' epoch graph
(:mod:`._epoch`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from onnx import helper

from ortbridge._prepare._onnx_utils import make_model


class _Flags(NamedTuple):
    """What the update of a group computes (part of the graph's cache key)."""

    velocity: bool
    nesterov: bool
    l2: bool
    l1: bool
    #: The gradient's coefficient (``c a`` with a velocity, ``a`` without) is 1.
    unit_grad: bool
    #: ``s`` is 1.
    unit_step: bool


@functools.cache
def _scalar_names(flags: _Flags) -> tuple[str, ...]:
    """Names of the scalar inputs a group's update multiplies by."""
    if flags.velocity:
        names = [] if flags.unit_grad else ["ca"]
        names += ["cd"] if flags.l2 else []
        names += ["ce"] if flags.l1 else []
        names += ["mu"]
        return (*names, *([] if flags.unit_step else ["s"]))
    if flags.l2 or flags.l1:
        names = [] if flags.unit_grad else ["a"]
        names += ["d"] if flags.l2 else []
        names += ["e"] if flags.l1 else []
        return (*names, "sc")
    return () if flags.unit_grad and flags.unit_step else ("ka",)


def _scalar_values(flags: _Flags, a, d, e, c, s, mu) -> list[float]:
    """The scalars of :func:`_scalar_names` from the coefficients of the rule."""
    values = {"ca": c * a, "cd": c * d, "ce": c * e, "mu": mu, "s": s,
              "a": a, "d": d, "e": e, "sc": s * c, "ka": s * c * a}  # fmt: skip
    return [values[name] for name in _scalar_names(flags)]


def _update_nodes(i, k, flags, penalised=None):
    """Nodes updating parameter ``i`` with the scalars of set ``k``.

    The operations are torch.optim.SGD's, in its order, so that float32
    results round the same way; a multiplication by a coefficient that is
    always 1 is left out. The penalty terms read ``penalised`` (the
    parameter by default).
    """
    w, g, v = f"w{i}", f"g{i}", f"v{i}"
    pw = penalised or w

    def sc(name):
        return f"k{k}_{name}"

    def t(name):
        return f"t{i}_{name}"

    nodes = []
    add = nodes.append
    make = helper.make_node
    if not (flags.velocity or flags.l2 or flags.l1):
        if flags.unit_grad and flags.unit_step:
            add(make("Add", [w, g], [f"w{i}_new"]))
        else:
            add(make("Mul", [sc("ka"), g], [t("step")]))
            add(make("Add", [w, t("step")], [f"w{i}_new"]))
        return nodes
    # The gradient with its penalty terms, times c when there is a velocity.
    pre = "c" if flags.velocity else ""
    grad = g
    if not flags.unit_grad:
        add(make("Mul", [sc(f"{pre}a"), g], [t("ga")]))
        grad = t("ga")
    if flags.l2:
        add(make("Mul", [sc(f"{pre}d"), pw], [t("dw")]))
        add(make("Add", [grad, t("dw")], [t("g_l2")]))
        grad = t("g_l2")
    if flags.l1:
        add(make("Sign", [pw], [t("sign")]))
        add(make("Mul", [sc(f"{pre}e"), t("sign")], [t("ew")]))
        add(make("Add", [grad, t("ew")], [t("g_l1")]))
        grad = t("g_l1")
    if not flags.velocity:
        add(make("Mul", [sc("sc"), grad], [t("step")]))
        add(make("Add", [w, t("step")], [f"w{i}_new"]))
        return nodes
    # v is read (mu v) before v_new, written into v's memory, is computed.
    add(make("Mul", [sc("mu"), v], [t("mv")]))
    add(make("Add", [t("mv"), grad], [f"v{i}_new"]))
    step = f"v{i}_new"
    if flags.nesterov:
        add(make("Mul", [sc("mu"), f"v{i}_new"], [t("mvn")]))
        add(make("Add", [t("mvn"), grad], [t("nesterov")]))
        step = t("nesterov")
    if not flags.unit_step:
        add(make("Mul", [sc("s"), step], [t("step")]))
        step = t("step")
    add(make("Add", [w, step], [f"w{i}_new"]))
    return nodes


def build_update_graph(layout):
    """The ONNX model updating a layout of parameters.

    ``layout`` is a tuple ``(sets, params)``: ``sets`` lists ``(elem_type,
    flags)`` for each set of scalars (a parameter group and a dtype), ``params``
    ``(set index, rank)`` of each parameter (a 0-d parameter is bound as 1-D).
    Inputs are the scalars ``k<set>_<name>`` (shape ``(1,)``), then ``w<i>``,
    ``g<i>`` and, with momentum, ``v<i>`` for each parameter; outputs are
    ``w<i>_new`` and ``v<i>_new``.
    """
    sets, params = layout
    inputs, outputs, nodes = [], [], []
    for k, (elem, flags) in enumerate(sets):
        for name in _scalar_names(flags):
            inputs.append(helper.make_tensor_value_info(f"k{k}_{name}", elem, [1]))
    for i, (k, rank) in enumerate(params):
        elem, flags = sets[k]
        shape = [f"n{i}_{axis}" for axis in range(rank)]
        names = ["w", "g"] + (["v"] if flags.velocity else [])
        for name in names:
            inputs.append(helper.make_tensor_value_info(f"{name}{i}", elem, shape))
        outputs.append(helper.make_tensor_value_info(f"w{i}_new", elem, shape))
        if flags.velocity:
            outputs.append(helper.make_tensor_value_info(f"v{i}_new", elem, shape))
        nodes += _update_nodes(i, k, flags)
    graph = helper.make_graph(nodes, "ortbridge_sgd", inputs, outputs)
    return make_model(graph)
