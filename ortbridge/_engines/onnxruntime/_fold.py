"""onnx-ad's constant folding to its fixed point, without the sweep that only confirms it.

onnx-ad's ``fold_constants`` repeats a sweep (one shape inference of the
whole model, then each node whose inputs are known evaluated) until a sweep
changes nothing, so its last sweep only confirms. After a sweep that folded
something, the next can fold more only through a ``Shape`` or ``Size`` node
whose input's shape has become known: a node whose inputs became constants is
folded within the same sweep, the nodes being in topological order. Where no
such node is left, the fixed point is reached one sweep early; where no node
could start a fold (none reads only constants, no ``Shape`` or ``Size``), no
sweep runs at all. The result is onnx-ad's own. A build runs about five
foldings (onnx-ad's function expansion, ortbridge's shape arithmetic, the
reverse graph's; for the construction check and again for the first call's
shapes), and their confirming sweeps took 8% of ConvNeXt's construction plus
first step, 7% of MobileViT's.

The same context skips three more of onnx-ad's steps where the graph holds
nothing for them, each of which infers the whole model's shapes first:
inlining ``If`` nodes of constant condition (none), expanding the spec's
function ops (none without a rule) and hinting the shapes of control-flow
outputs (no ``If``, ``Loop`` or ``Scan``). Their result is the model as it
was; ConvNeXt's reverse passes took half their time without them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import onnx
from onnx import helper, numpy_helper

#: The nodes a sweep folds from a shape, not from constant inputs.
_SHAPE_QUERIES = frozenset({"Shape", "Size"})
#: onnx-ad's own bound on the sweeps.
_SWEEPS = 16


def fold_constants(model: onnx.ModelProto, max_elements: int = 4096) -> onnx.ModelProto:
    """``onnx_ad.fold.fold_constants(model, max_elements)``, one sweep fewer where
    the last would only confirm."""
    from onnx_ad.fold import _fold_once

    if _nothing_to_fold(model):
        return model
    if not any(node.op_type in _SHAPE_QUERIES for node in model.graph.node):
        return _sweep_without_shapes(model, max_elements)
    for _ in range(_SWEEPS):
        folded = _fold_once(model, max_elements)
        if folded is model:
            return model
        model = folded
        if not any(node.op_type in _SHAPE_QUERIES for node in model.graph.node):
            return model
    return model


def _nothing_to_fold(model: onnx.ModelProto) -> bool:
    """No node a sweep could start from: none reads only constants (initializers
    and Constant nodes, in any scope: a node's reads include what its subgraphs
    capture), and no ``Shape`` or ``Size``. Then a sweep changes nothing."""
    from onnx_ad._graph import node_reads, walk
    from onnx_ad.fold import RANDOM

    known = set()
    for scope in walk(model.graph):
        known.update(t.name for t in scope.initializer)
        known.update(n.output[0] for n in scope.node if n.op_type == "Constant")
    for node in model.graph.node:
        if node.op_type in _SHAPE_QUERIES:
            return False
        if node.op_type not in RANDOM and node.op_type != "Constant":
            if all(name in known for name in node_reads(node)):
                return False
    return True


def _sweep_without_shapes(model: onnx.ModelProto, max_elements: int) -> onnx.ModelProto:
    """onnx-ad's sweep where no ``Shape`` or ``Size`` asks for a shape: the same
    nodes evaluated (those reading only constants, in order, so what they
    make folds on) into the same ``Constant`` nodes, without the shape
    inference of the whole model that only those queries read, and with each
    constant made an array only when a node evaluated reads it (onnx-ad
    converts every weight first). The fixed point in one sweep. On ConvNeXt's
    reverse graph: 7.4 -> 2.3 ms."""
    from onnx.reference import ReferenceEvaluator
    from onnx_ad._graph import node_reads
    from onnx_ad.fold import RANDOM, _evaluate

    values = _Constants(model.graph)
    opset = list(model.opset_import)
    nodes, changed = [], False
    for node in model.graph.node:
        result = None
        if node.op_type not in RANDOM and node.op_type != "Constant":
            if all(name in values for name in node_reads(node)) and not _too_large(
                node, values, max_elements
            ):
                result = _evaluate(ReferenceEvaluator, node, values, opset)
        if result is not None and all(v.size <= max_elements for v in result):
            for name, value in zip(node.output, result):
                values[name] = value
                tensor = numpy_helper.from_array(value, name)
                nodes.append(helper.make_node("Constant", [], [name], value=tensor))
            changed = True
        else:
            nodes.append(node)
    if not changed:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _too_large(node, values, max_elements) -> bool:
    """Whether ``node`` makes a tensor the sweep would not keep, known before
    evaluating it: a ``OneHot`` (the depthwise products' one-hot tensors, 200k
    values, evaluated and dropped twice a build)."""
    if node.op_type != "OneHot" or node.domain not in ("", "ai.onnx"):
        return False
    indices, depth = values[node.input[0]], values[node.input[1]]
    return indices.size * int(abs(depth.ravel()[0])) > max_elements


class _Constants(Mapping):
    """onnx-ad's constants of a graph (initializers and ``Constant`` values in any
    scope, the last of a name winning), each converted when first read."""

    def __init__(self, graph: onnx.GraphProto):
        from onnx_ad._graph import walk

        self._sources: dict = {}
        for scope in walk(graph):
            self._sources.update((t.name, t) for t in scope.initializer)
            self._sources.update((n.output[0], n) for n in scope.node if n.op_type == "Constant")
        self._values: dict = {}

    def __getitem__(self, name):
        if name not in self._values:
            from onnx_ad._graph import constant_value

            source = self._sources[name]
            if isinstance(source, onnx.TensorProto):
                value = numpy_helper.to_array(source)
            else:
                value = constant_value(source)
            if value is None:  # a form onnx-ad does not read: not a constant to it
                raise KeyError(name)
            self._values[name] = value
        return self._values[name]

    def __setitem__(self, name, value) -> None:
        self._values[name] = value

    def __contains__(self, name) -> bool:
        if name in self._values:
            return True
        source = self._sources.get(name)
        if source is None:
            return False
        if isinstance(source, onnx.TensorProto):
            return True  # an initializer: converted when read
        try:
            self[name]
        except KeyError:
            return False
        return True

    def __iter__(self):
        return iter({**self._sources, **self._values})

    def __len__(self) -> int:
        return len({**self._sources, **self._values})


@contextlib.contextmanager
def in_onnx_ad():
    """onnx-ad's function expansion (inside its reverse pass) folding with
    :func:`fold_constants`, and its function expansion, constant-``If``
    inlining and control-flow shape hints skipped where the graph holds
    nothing they would rewrite (:func:`_expand_functions`,
    :func:`_inline_constant_ifs`, :func:`_control_flow_hints`); restored on exit."""
    import importlib

    from onnx_ad import _build, expand

    # The module: the package's ``onnx_ad.reverse`` is the function it defines.
    reverse_module = importlib.import_module("onnx_ad.reverse")
    inline = _inline_constant_ifs(reverse_module.inline_constant_ifs)  # expand's too
    saved = [
        (_build, "_control_flow_hints", _control_flow_hints(_build._control_flow_hints)),
        (expand, "fold_constants", fold_constants),
        (expand, "inline_constant_ifs", inline),
        (reverse_module, "inline_constant_ifs", inline),
        (reverse_module, "expand_functions", _expand_functions(reverse_module.expand_functions)),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in saved]
    for module, name, patched in saved:
        setattr(module, name, patched)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def _control_flow_hints(original):
    """onnx-ad's ``_control_flow_hints``, which copies the model and walks every
    inferred shape to hint the outputs of ``If``, ``Loop`` and ``Scan`` nodes:
    None (no hint), as it returns then, where the model has none."""

    def hints(model, inferred):
        return original(model, inferred) if _holds(model, ("If", "Loop", "Scan")) else None

    return hints


def _inline_constant_ifs(original):
    """onnx-ad's ``inline_constant_ifs``, which infers the model's shapes before it
    looks for an ``If``: a model without one is returned as it is, as onnx-ad
    returns it (two whole shape inferences a reverse pass, on most graphs)."""

    def inline(model):
        return original(model) if _holds(model, ("If",)) else model

    return inline


def _expand_functions(original):
    """onnx-ad's ``expand_functions`` where some node may be expanded; elsewhere
    what it returns then (its first round: fold, no ``If`` to inline, nothing
    expanded, constants localized) without building its expander (a whole
    shape inference). A node may be expanded where it is in the default
    domain, has no forward rule and its schema defines a function body."""

    def expand_functions(model):
        from onnx_ad.fold import localize_constants

        if _expandable(model):  # a node with a body (an If) counts
            return original(model)
        from onnx_ad import expand

        return localize_constants(expand.fold_constants(model))

    return expand_functions


def _holds(model: onnx.ModelProto, ops) -> bool:
    """Whether a node of ``model``, in any scope, is one of ``ops``."""
    from onnx_ad._graph import walk

    return any(node.op_type in ops for scope in walk(model.graph) for node in scope.node)


def _expandable(model: onnx.ModelProto) -> bool:
    from onnx import defs
    from onnx_ad._graph import subgraphs, walk
    from onnx_ad.rules import FORWARD

    opset = max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [18])
    for scope in walk(model.graph):
        for node in scope.node:
            if subgraphs(node):
                return True  # bodies: onnx-ad's own walk decides
            if node.op_type in FORWARD or node.domain not in ("", "ai.onnx"):
                continue
            try:
                schema = defs.get_schema(node.op_type, max_inclusive_version=opset)
            except Exception:
                continue  # onnx-ad's expander skips it too
            if schema.has_function or schema.has_context_dependent_function:
                return True
    return False
