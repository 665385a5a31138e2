"""The onnxruntime engine: gradient graphs ortbridge owns, run by maintained onnxruntime.

ortbridge's prepared graph (weights as inputs, train/eval variant) goes
through onnx-ad's standard-op reverse mode, and :mod:`._split` cuts the
result in two graphs, each a plain ``InferenceSession``: the forward returns
the outputs and the residuals the backward reads; the backward takes those,
the inputs it reads and the output gradients. The residuals live in torch's
autograd context, so several forwards in flight, ``retain_graph=True`` and
freeing after backward behave as in torch. Nothing here needs the training
build: any onnxruntime runs these graphs.

Graphs are built per input shape: always where onnx-ad needs declared
shapes (Conv, Slice, the RNN lowering, ...) or a Dropout mask's shape cannot
be read from the inputs'; otherwise for the first :data:`SPECIALISED_SHAPES`
shapes seen (with static shapes onnx-ad knows which axes a broadcast sums
over; the shape-generic graph computes them at run time, measured 1.2x
slower on a transformer layer), the shape-generic graph beyond.
"""

from __future__ import annotations

import importlib
import re

import onnx
import torch

from .. import _ort
from .._onnx_utils import attr, gradient_path, set_input_shapes
from .._ort_errors import translate
from .._runtime import _session, from_ortvalues, ort_device, to_ortvalues
from ..exceptions import (
    MissingDependencyError,
    NotDifferentiableError,
    OnnxModelError,
    OrtBridgeError,
)
from . import _split, _train_ops
from ._optimize import optimize_reverse
from ._rules import own_rules
from ._simplify import collapse_views, simplify

NAME = "onnxruntime"

_SEED_AXIS = "nadj"
#: How many input shapes get graphs of their own before the shape-generic one runs.
SPECIALISED_SHAPES = 8


def onnx_ad():
    """The ``onnx_ad`` module, imported on first use (only this engine needs it)."""
    try:
        return importlib.import_module("onnx_ad")
    except ImportError as exc:
        raise MissingDependencyError(
            "the onnxruntime engine needs onnx-ad: `pip install onnx-ad==0.3.0` "
            "(a dependency of ortbridge; reinstall it with `pip install ortbridge[ort]`)"
        ) from exc


class OrtGradientGraph:
    """Forward and backward sessions for one mode, device and set of gradients.

    Dispatches to one :class:`_Built` pair of graphs, or one per input shape
    where the graph needs static shapes to be differentiated.
    """

    engine = NAME
    saves_tensors = True

    def __init__(
        self,
        model: onnx.ModelProto,
        feed_names: list[str],
        targets: list[str],
        device: torch.device,
        session_options=None,
        providers=None,
        batch_norm_nodes=(),
        n_inputs: int | None = None,
        tensors=None,
    ):
        self._batch_norms = list(batch_norm_nodes)
        self.n_inputs = len(feed_names) if n_inputs is None else n_inputs
        self._setup(model, feed_names, targets, device, session_options, providers, tensors)

    def _setup(self, model, feed_names, targets, device, session_options, providers, tensors):
        # Frozen weights read only where no gradient flows (Resize scales, a
        # Dropout ratio, Clip bounds): onnx-ad needs them constant, so their
        # current values are built into the graphs, which are rebuilt if the
        # tensors change (torch's version counter says when).
        self._settings = []
        baked = {}
        if tensors is not None:
            for pos in _setting_positions(model, feed_names, targets, self.n_inputs):
                t = tensors[pos]
                baked[feed_names[pos]] = t.detach().cpu().numpy()
                self._settings.append((pos, t._version, t.data_ptr()))
        self._args = (model, feed_names, targets, device, session_options, providers, baked)
        self._by_shape: dict = {}
        self._generic_used = False
        try:
            self._built = first = _Built(*self._args, self._batch_norms)
        except _NeedsStaticShapes:
            self._built = None
            # Checks now that the graph can be differentiated at all, on a
            # stand-in shape (dynamic dimensions as 2); real shapes are built on use.
            shapes = _stand_in_shapes(model, self.n_inputs)
            first = _Built(*self._args, self._batch_norms, static=shapes)
            self._by_shape[shapes] = first
        self.n_user_outputs = first.n_user_outputs
        self.non_differentiable = first.non_differentiable
        self.full_shape = set(range(self.n_user_outputs))
        self.save_outputs = first.save_outputs
        self.grad_slots = first.grad_slots

    @property
    def sessions(self) -> list:
        """The onnxruntime sessions built so far (forward and backward, per shape)."""
        built = self._in_use()
        return [s for b in built for s in (b.fw_session, b.bw_session) if s is not None]

    @property
    def pinnings(self) -> list:
        """The pinning of each session's workers (None: left to the system)."""
        built = self._in_use()
        pairs = [(b.fw_session, b.fw_pinning) for b in built]
        pairs += [(b.bw_session, b.bw_pinning) for b in built]
        return [pinning for session, pinning in pairs if session is not None]

    def _in_use(self) -> list:
        """The graphs that ran (or, before any forward, the one built first)."""
        used = list(dict.fromkeys(self._by_shape.values()))
        if self._built is not None and (self._generic_used or not used):
            used.append(self._built)
        return used

    def forward(self, tensors):
        """Outputs (user outputs, then new running statistics), residuals, and a token."""
        if self._settings and any(
            tensors[p]._version != v or tensors[p].data_ptr() != ptr for p, v, ptr in self._settings
        ):
            self._setup(*self._args[:-1], tensors)
        if self._built is None:
            built = self.static_built(tensors)
        else:
            # Graphs specialised on the first few shapes seen: with static
            # shapes onnx-ad knows which axes a broadcast sums over, where
            # the shape-generic graph computes and reduces them at run time.
            key = tuple(tuple(t.shape) for t in tensors[: self.n_inputs])
            built = self._by_shape.get(key)
            if built is None:
                built = self._built
                if len(self._by_shape) < SPECIALISED_SHAPES:
                    try:
                        built = self.static_built(tensors)
                    except OrtBridgeError:  # the shape-generic graph still runs it
                        self._by_shape[key] = built
                if built is self._built:
                    self._generic_used = True
        outputs, residuals = built.forward(tensors)
        return outputs, residuals, built

    def backward(self, grad_outputs, token, residuals, tensors, saved_outputs):
        """Gradients, one per :attr:`grad_slots` (None where no gradient reaches)."""
        return token.backward(grad_outputs, residuals, tensors, saved_outputs)

    def static_built(self, tensors) -> _Built:
        """The graphs built for the shapes of ``tensors`` (double backward needs them).

        A reverse model built for dynamic shapes computes its broadcasting axes
        at run time, and onnx-ad differentiates reductions over constant axes
        only: the reverse model that is differentiated again is built for
        static shapes.
        """
        key = tuple(tuple(t.shape) for t in tensors[: self.n_inputs])
        built = self._by_shape.get(key)
        if built is None:
            built = _Built(*self._args, self._batch_norms, static=key)
            self._by_shape[key] = built
        return built


class _NeedsStaticShapes(Exception):
    pass


def _stand_in_shapes(model, n_inputs):
    shapes = []
    for vi in list(model.graph.input)[:n_inputs]:
        dims = vi.type.tensor_type.shape.dim
        shapes.append(tuple(d.dim_value if d.HasField("dim_value") else 2 for d in dims))
    return tuple(shapes)


def _declare_outputs(model: onnx.ModelProto) -> None:
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


_STATIC_HINT = re.compile(r"declared|static", re.IGNORECASE)


def _not_differentiable(exc: Exception, model: onnx.ModelProto) -> NotDifferentiableError:
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
    return NotDifferentiableError(
        f"the onnxruntime engine cannot differentiate node {node!r} (op type {op_type}): {text}"
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


class _Built:
    """One forward graph and one backward graph, with their sessions."""

    # Built during a forward (a new input shape): graph code that
    # torch.compile must not trace into.
    @torch.compiler.disable
    def __init__(
        self,
        model,
        feed_names,
        targets,
        device,
        session_options,
        providers,
        baked,
        batch_norms,
        static=None,
    ):
        ad = onnx_ad()
        m = onnx.ModelProto()
        m.CopyFrom(model)
        _bake(m, baked)
        if static is not None:
            set_input_shapes(m, {vi.name: shape for vi, shape in zip(m.graph.input, static)})
        n_user = len(m.graph.output)
        stat_outputs, self.masks = _train_ops.lower_training_nodes(m, batch_norms)
        _refuse_old_ceil_pools(m)  # before _prepare rewrites the pools
        _prepare(m)
        _declare_outputs(m)
        if static is None and any(
            mask.shape is None or any(d is None for d in mask.shape) for mask in self.masks
        ):
            raise _NeedsStaticShapes
        user_outputs = [o.name for o in m.graph.output][:n_user]
        float_types = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}
        out_types = {o.name: o.type.tensor_type.elem_type for o in m.graph.output}
        seeded = [n for n in user_outputs if out_types.get(n) in float_types]
        self.n_user_outputs = n_user
        self.non_differentiable = {i for i, n in enumerate(user_outputs) if n not in seeded}
        n_graph_inputs = len(m.graph.input)
        _refuse_known_wrong(m, targets, seeded)
        try:
            with own_rules():
                reverse = ad.reverse(m, inputs=list(targets), outputs=seeded, layout="onnx")
        except ad.UnsupportedOperator as exc:
            if static is None and _STATIC_HINT.search(str(exc)):
                raise _NeedsStaticShapes from exc
            raise _not_differentiable(exc, m) from exc
        except Exception as exc:
            raise _not_differentiable(exc, m) from exc
        seeds = [i.name for i in reverse.graph.input][n_graph_inputs:]
        adjoints = [o.name for o in reverse.graph.output][len(m.graph.output) :]
        _fix_seed_axis(reverse)
        optimize_reverse(reverse)
        if static is not None:  # chains of views as one view: fewer nodes to dispatch
            simplify(reverse)
        self.reverse = reverse
        primal_outputs = user_outputs + stat_outputs
        parts = _split.split(reverse, primal_outputs, seeds, adjoints)
        if static is not None:  # the seed axis added and dropped: views that collapse
            collapse_views(parts.backward)
        live = set(adjoints) - set(parts.zero_adjoints)
        position = {n: i for i, n in enumerate(feed_names)}
        self.grad_slots = [position[t] for t, a in zip(targets, adjoints) if a in live]
        # Forward feeds: the caller's tensors, then the masks drawn here.
        self.mask_names = [mask.name for mask in self.masks]
        self.dim_sources = _dim_sources(m, len(feed_names))
        fw_outputs = [o.name for o in parts.forward.graph.output]
        self.n_primal = len(primal_outputs)
        # Where each backward feed comes from: ("in", caller position),
        # ("mask", k), ("out", user output index) or ("res", residual index).
        sources = {n: ("in", i) for i, n in enumerate(feed_names)}
        sources.update({n: ("mask", k) for k, n in enumerate(self.mask_names)})
        sources.update({n: ("out", i) for i, n in enumerate(primal_outputs)})
        extra = fw_outputs[self.n_primal :]
        sources.update({n: ("res", k) for k, n in enumerate(extra)})
        self.save_outputs = sorted(
            {sources[n][1] for n in parts.residuals if sources[n][0] == "out"}
        )
        self.bw_sources = [sources[n] for n in parts.backward_inputs + parts.residuals]
        self.seed_index = [user_outputs.index(n) for n in seeded]
        self.device = device
        self.fed = [i for i, n in enumerate(feed_names) if n not in baked]
        if len(self.fed) == len(feed_names):
            self.fed = None  # every tensor is fed, in order
        self.fw_inputs = [n for n in feed_names if n not in baked] + self.mask_names
        self.fw_outputs = fw_outputs
        self.bw_inputs = [i.name for i in parts.backward.graph.input]
        self.bw_outputs = [o.name for o in parts.backward.graph.output]
        loading = (device, session_options, providers)
        self.fw_session, self.fw_pinning = _load(parts.forward, "forward", *loading)
        if self.bw_outputs:
            self.bw_session, self.bw_pinning = _load(parts.backward, "backward", *loading)
        else:  # no gradient reaches anything: nothing to run backward
            self.bw_session = self.bw_pinning = None
        self.split = parts
        dev = ort_device(device)
        self._fw_devices = [dev] * len(self.fw_outputs)
        self._bw_devices = [dev] * len(self.bw_outputs)
        self._run_options = _ort.runtime().RunOptions()
        self._capi = _ort.capi()

    def _run(self, session, pinning, names, tensors, out_names, devices, where):
        if pinning is not None:
            pinning.follow()
        outputs = self._capi.OrtValueVector()
        try:
            session._sess.run_with_ortvaluevector(
                self._run_options, names, to_ortvalues(tensors), out_names, outputs, devices
            )
        except Exception as exc:
            graph = self.split.forward if where == "forward" else self.split.backward
            raise translate(exc, f"run the {where} pass", graph) from exc
        return from_ortvalues(outputs)

    def _draw_masks(self, tensors):
        masks = []
        for mask in self.masks:
            shape = [d if isinstance(d, int) else self._dim(d, tensors) for d in mask.shape]
            dtype = _TORCH_FLOATS.get(mask.elem, torch.float32)
            keep = 1.0 - mask.ratio
            drawn = torch.empty(shape, dtype=dtype, device=self.device).bernoulli_(keep)
            masks.append(drawn.div_(keep))
        return masks

    def _dim(self, name, tensors):
        try:
            pos, axis = self.dim_sources[name]
        except KeyError:
            raise OrtBridgeError(f"dimension {name!r} of a Dropout mask is unknown") from None
        return tensors[pos].shape[axis]

    def forward(self, tensors):
        masks = self._draw_masks(tensors) if self.masks else []
        fed = list(tensors) if self.fed is None else [tensors[i] for i in self.fed]
        outs = self._run(
            self.fw_session,
            self.fw_pinning,
            self.fw_inputs,
            fed + masks,
            self.fw_outputs,
            self._fw_devices,
            "forward",
        )
        return outs[: self.n_primal], masks + outs[self.n_primal :]

    def backward(self, grad_outputs, residuals, tensors, saved_outputs):
        if self.bw_session is None:
            return []
        n_masks = len(self.masks)
        feeds = []
        for kind, k in self.bw_sources:
            if kind == "in":
                feeds.append(tensors[k])
            elif kind == "mask":
                feeds.append(residuals[k])
            elif kind == "out":
                feeds.append(saved_outputs[k])
            else:
                feeds.append(residuals[n_masks + k])
        for idx in self.seed_index:
            feeds.append(grad_outputs[idx])
        grads = self._run(
            self.bw_session,
            self.bw_pinning,
            self.bw_inputs,
            feeds,
            self.bw_outputs,
            self._bw_devices,
            "backward",
        )
        return grads


_TORCH_FLOATS = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
}


def _setting_positions(model, feed_names, targets, n_inputs) -> list[int]:
    """Feed positions of frozen weights read only at non-differentiable operands."""
    from .._graph import _NON_DIFFERENTIABLE_SLOTS

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
            op != "BatchNormalization" and slot in _NON_DIFFERENTIABLE_SLOTS.get(op, ())
            for op, slot in uses
        ):
            found.append(pos)
    return found


def _bake(model: onnx.ModelProto, values: dict) -> None:
    """Turn the graph inputs ``values`` names into initializers holding those values."""
    if not values:
        return
    kept = [i for i in model.graph.input if i.name not in values]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    for name, value in values.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(value, name))


def _load(model, part, device, session_options, providers):
    # onnx-ad leaves its nodes unnamed: named, a failure can say which one.
    for node in model.graph.node:
        if not node.name and node.output:
            node.name = f"{node.op_type}_{node.output[0]}"
    try:
        return _session(model, device, session_options, providers)
    except OnnxModelError as exc:
        raise translate(
            exc.__cause__ or exc, f"load the {part} graph", model, refuse="onnxruntime"
        ) from exc


def _refuse_known_wrong(model: onnx.ModelProto, targets, seeded) -> None:
    """Refuse, by name, a node onnx-ad would differentiate silently wrong.

    Only nodes on a gradient path count: between a tensor needing a gradient
    and a differentiated output.
    """
    from .._ad_rewrites import known_wrong

    path = gradient_path(model, targets, seeded)
    # Tensors a gradient reaches: the targets and what the path's nodes write
    # (an input of a node on the path that a gradient reaches is one of these).
    reached = set(targets).union(*(node.output for node in path))
    for node in path:
        reason = known_wrong(node)
        if node.op_type == "OneHot" and len(node.input) > 2 and node.input[2] in reached:
            reason = "onnx-ad 0.3.0 gives OneHot's values a zero derivative"
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


def _refuse_old_ceil_pools(model: onnx.ModelProto) -> None:
    """onnxruntime < 1.20 sizes ceil-mode pools unlike the rewrite of :func:`_prepare`."""
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


def _prepare(model: onnx.ModelProto) -> None:
    """ortbridge's rewrites of what onnx-ad gets wrong or refuses (:mod:`.._ad_rewrites`)."""
    from .._ad_rewrites import prepare_for_reverse

    prepared = prepare_for_reverse(model)
    if prepared is not model:
        model.CopyFrom(prepared)


def _fix_seed_axis(model: onnx.ModelProto) -> None:
    """One seed direction: the seed axis is 1, so onnxruntime knows its size."""
    for vi in list(model.graph.input) + list(model.graph.output):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param == _SEED_AXIS:
                dim.Clear()
                dim.dim_value = 1


def _dim_sources(model: onnx.ModelProto, n_feeds: int) -> dict[str, tuple[int, int]]:
    """Where each symbolic input dimension can be read: (feed position, axis)."""
    found = {}
    for pos, vi in enumerate(list(model.graph.input)[:n_feeds]):
        for axis, dim in enumerate(vi.type.tensor_type.shape.dim):
            if dim.dim_param and dim.dim_param not in found:
                found[dim.dim_param] = (pos, axis)
    return found
