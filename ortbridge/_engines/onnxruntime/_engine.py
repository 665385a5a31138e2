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
shapes (Conv, Slice, the RNN lowering, ...), refuses what ortbridge's rewrites
lift once shapes are known (a ConvTranspose's or grouped Conv's weight,
``auto_pad=SAME_*``, a Pad's widths computed from shapes) or a Dropout mask's shape cannot
be read from the inputs'; otherwise for the first :data:`SPECIALISED_SHAPES`
shapes seen (with static shapes onnx-ad knows which axes a broadcast sums
over; the shape-generic graph computes them at run time, measured 1.2x
slower on a transformer layer), the shape-generic graph beyond.

Nothing runs onnx-ad's reverse pass twice for a call: before any call (the
construction's check) only the reverse pass runs, to refuse what cannot be
differentiated; the graphs that run are built at the first call, for its
shapes.

The module stays one: the graph pair, its per-shape cache and the stand-in
shapes of the construction check are one mechanism, read together.
"""

from __future__ import annotations

import onnx
import torch

from ortbridge._prepare._onnx_utils import set_input_shapes
from ortbridge._runtime import _ort
from ortbridge._runtime._errors import translate
from ortbridge._runtime._runs import (
    _with_fed,
    fed_outputs,
    from_ortvalues,
    ort_device,
    to_ortvalues,
)
from ortbridge._runtime._sessions import _session
from ortbridge._runtime._threads import UNPINNED
from ortbridge.exceptions import OnnxModelError, OrtBridgeError

from . import _split, _train_ops, passes
from ._ad_rewrites_quant import quantize_pairs_restored
from ._reverse_prep import (
    STATIC_HINT,
    bake,
    declare_outputs,
    fix_seed_axis,
    not_differentiable,
    onnx_ad,
    prepare,
    refuse_known_wrong,
    refuse_old_ceil_pools,
    setting_positions,
)
from ._rules import own_rules
from ._work import session_threads
from .passes._fused_activations import declare_fused_outputs

NAME = "onnxruntime"

#: How many input shapes get graphs of their own before the shape-generic one runs.
SPECIALISED_SHAPES = 8

#: The dynamic dimensions of the second stand-in shape (see ``OrtGradientGraph._stand_in``).
STAND_IN_LARGE = 32


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
            for pos in setting_positions(model, feed_names, targets, self.n_inputs):
                t = tensors[pos]
                baked[feed_names[pos]] = t.detach().cpu().numpy()
                self._settings.append((pos, t._version, t.data_ptr()))
        self._args = (model, feed_names, targets, device, session_options, providers, baked)
        self._by_shape: dict = {}
        self._generic_used = False
        #: The shape-generic graphs: built when first needed (None: not yet,
        #: False: the graph needs static shapes).
        self._built = None
        n = self.n_inputs
        if tensors is not None and all(t is not None for t in tensors[:n]):
            # A call: the graphs for its shapes are the ones that run first.
            first = self._static_or_generic(tuple(tuple(t.shape) for t in tensors[:n]))
        else:
            # Before any call (the construction's check): only that the graph
            # can be differentiated, on a stand-in shape or the shape-generic
            # graph; the graphs that run are built for the first call's shapes.
            first = self._checked()
        self.n_user_outputs = first.n_user_outputs
        self.non_differentiable = first.non_differentiable
        self.full_shape = set(range(self.n_user_outputs))

    def _checked(self):
        """A check that the graph can be differentiated: the reverse pass alone,
        on a stand-in shape (:meth:`_on_stand_in`), else shape-generic.

        The stand-in first: the first call builds static graphs anyway, and
        most graphs need them (a Conv's input gradient does), where a
        shape-generic reverse pass would run until it fails. A graph the
        stand-in cannot build is checked shape-generic; if that needs static
        shapes too, the stand-in's error is the one raised.
        """
        try:
            return self._on_stand_in(
                lambda shapes: _Built(
                    *self._args, self._batch_norms, static=shapes, check_only=True
                )
            )
        except Exception as on_stand_in:
            try:
                return _Built(*self._args, self._batch_norms, check_only=True)
            except _NeedsStaticShapes:
                self._built = False
                raise on_stand_in from None

    def _on_stand_in(self, build):
        """``build(shapes)`` for dynamic dimensions of 2, or of
        :data:`STAND_IN_LARGE` where 2 fails (a patch-embedding Conv's kernel
        and stride of 4 leave nothing of 2 pixels); the error of the larger
        size if both fail."""
        for size in (2, STAND_IN_LARGE):
            shapes = _stand_in_shapes(self._args[0], self.n_inputs, size)
            try:
                return build(shapes)
            except OrtBridgeError:
                if size == STAND_IN_LARGE:
                    raise

    def _static_or_generic(self, key: tuple) -> _Built:
        """The graphs for input shapes ``key``, or the shape-generic ones (then
        kept for ``key``) where those cannot be built; the static error where
        the graph has no shape-generic form."""
        try:
            return self._for_shapes(key)
        except OrtBridgeError:
            generic = self._generic()
            if generic is None:
                raise
            self._by_shape[key] = generic
            return generic

    def _generic(self):
        """The shape-generic graphs, built on first use; None where the graph
        needs static shapes."""
        if self._built is None:
            try:
                self._built = _Built(*self._args, self._batch_norms)
            except _NeedsStaticShapes:
                self._built = False
        return self._built or None

    def _reference(self):
        """Graphs whose bookkeeping (gradient slots, outputs saved) the graph
        reports: the first built, or the shape-generic (a stand-in's where the
        graph needs static shapes) when none ran yet."""
        if self._by_shape:
            return next(iter(self._by_shape.values()))
        generic = self._generic()
        return generic if generic is not None else self._on_stand_in(self._for_shapes)

    @property
    def save_outputs(self) -> list:
        """User outputs the backward reads (those of the first graphs built)."""
        return self._reference().save_outputs

    @property
    def grad_slots(self) -> list:
        """Feed positions that get a gradient (those of the first graphs built)."""
        return self._reference().grad_slots

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
        """The graphs that ran (or, before any forward, the shape-generic one if built)."""
        used = list(dict.fromkeys(self._by_shape.values()))
        if self._built and (self._generic_used or not used):
            used.append(self._built)
        return used

    def forward(self, tensors):
        """Outputs (user outputs, then new running statistics), residuals, and a token."""
        if self._settings and any(
            tensors[p]._version != v or tensors[p].data_ptr() != ptr for p, v, ptr in self._settings
        ):
            self._setup(*self._args[:-1], tensors)
        key = tuple(tuple(t.shape) for t in tensors[: self.n_inputs])
        built = self._by_shape.get(key)
        if built is None:
            # Graphs specialised on the first few shapes seen: with static
            # shapes onnx-ad knows which axes a broadcast sums over, where
            # the shape-generic graph computes and reduces them at run time.
            if self._built is False or len(self._by_shape) < SPECIALISED_SHAPES:
                built = self._static_or_generic(key)
            else:
                built = self._generic() or self._for_shapes(key)
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
        return self._for_shapes(tuple(tuple(t.shape) for t in tensors[: self.n_inputs]))

    def _for_shapes(self, key: tuple) -> _Built:
        built = self._by_shape.get(key)
        if built is None:
            built = _Built(*self._args, self._batch_norms, static=key)
            self._by_shape[key] = built
        return built


class _NeedsStaticShapes(Exception):
    pass


def _stand_in_shapes(model, n_inputs, size):
    shapes = []
    for vi in list(model.graph.input)[:n_inputs]:
        dims = vi.type.tensor_type.shape.dim
        shapes.append(tuple(d.dim_value if d.HasField("dim_value") else size for d in dims))
    return tuple(shapes)


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
        check_only=False,
    ):
        ad = onnx_ad()
        m = onnx.ModelProto()
        m.CopyFrom(model)
        bake(m, baked)
        if static is not None:
            set_input_shapes(m, {vi.name: shape for vi, shape in zip(m.graph.input, static)})
        n_user = len(m.graph.output)
        stat_outputs, self.masks = _train_ops.lower_training_nodes(m, batch_norms)
        refuse_old_ceil_pools(m)  # before prepare rewrites the pools
        prepare(m)
        if not check_only:  # the primal passes make it faster to run, not differentiable
            passes.run(passes.PRIMAL, passes.Graphs(primal=m), static is not None)
        declare_outputs(m)
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
        refuse_known_wrong(m, targets, seeded)
        try:
            with own_rules(m):
                reverse = ad.reverse(m, inputs=list(targets), outputs=seeded, layout="onnx")
        except ad.UnsupportedOperator as exc:
            if static is None and STATIC_HINT.search(str(exc)):
                raise _NeedsStaticShapes from exc
            raise not_differentiable(exc, m) from exc
        except Exception as exc:
            raise not_differentiable(exc, m) from exc
        if check_only:  # differentiable: what remains only makes it cheaper to run
            return
        declare_fused_outputs(m, reverse)
        seeds = [i.name for i in reverse.graph.input][n_graph_inputs:]
        adjoints = [o.name for o in reverse.graph.output][len(m.graph.output) :]
        fix_seed_axis(reverse)
        quantize_pairs_restored(reverse, m)
        passes.run(passes.REVERSE, passes.Graphs(reverse=reverse), static is not None)
        self.reverse = reverse
        primal_outputs = user_outputs + stat_outputs
        parts = _split.split(reverse, primal_outputs, seeds, adjoints)
        cut = passes.Graphs(forward=parts.forward, backward=parts.backward)
        passes.run(passes.BACKWARD, cut, static is not None)
        # ortbridge's own CPU options size both pools by the forward's work.
        own_cpu = session_options is None and device.type == "cpu" and static is not None
        threads = session_threads(parts.forward, cut.forward_shapes) if own_cpu else None
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
        self._fw_fed = fed_outputs(self.fw_inputs, self.fw_outputs)
        self._bw_fed = fed_outputs(self.bw_inputs, self.bw_outputs)
        self._loading = (device, session_options, providers, threads)
        # Sessions are made on the first run: a graph for other shapes (or
        # the shape-generic one) may be what runs.
        self.fw_session = self.fw_pinning = self.bw_session = self.bw_pinning = None
        self.split = parts
        dev = self._ort_device = ort_device(device)
        self._fw_devices = [dev] * len(self.fw_outputs)
        self._bw_devices = [dev] * len(self.bw_outputs)
        self._run_options = _ort.runtime().RunOptions()
        self._capi = _ort.capi()

    @property
    def loaded(self) -> bool:
        """Whether the sessions exist (made on the first forward)."""
        return self.fw_session is not None

    @torch.compiler.disable
    def load(self) -> None:
        """Make the forward and backward sessions, if not yet made."""
        if self.fw_session is not None:
            return
        parts = self.split
        fw_session, self.fw_pinning = _load(parts.forward, "forward", *self._loading)
        if self.bw_outputs:
            self.bw_session, self.bw_pinning = _load(parts.backward, "backward", *self._loading)
        # else no gradient reaches anything: nothing to run backward
        self.fw_session = fw_session  # last: a failed load is tried again

    def _run(self, session, pinning, names, tensors, out_names, devices, where):
        outputs = self._capi.OrtValueVector()
        try:
            # Outside the run the pinning times; ``held`` lives until the run ends.
            feeds, held = to_ortvalues(tensors, self._ort_device)
            with pinning or UNPINNED:
                session._sess.run_with_ortvaluevector(
                    self._run_options, names, feeds, out_names, outputs, devices
                )
        except Exception as exc:
            graph = self.split.forward if where == "forward" else self.split.backward
            raise translate(exc, f"run the {where} pass", graph) from exc
        fed = self._fw_fed if where == "forward" else self._bw_fed
        return _with_fed(from_ortvalues(outputs), fed, held)

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
        if self.fw_session is None:
            self.load()
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


def _load(model, part, device, session_options, providers, threads):
    # onnx-ad leaves its nodes unnamed: named, a failure can say which one.
    for node in model.graph.node:
        if not node.name and node.output:
            node.name = f"{node.op_type}_{node.output[0]}"
    # A backward's only Convs of constant weights are the one-hot gathers of
    # its im2col weight gradients; onnxruntime's NCHWc layout pads a depthwise
    # one's 9 taps to 16 channels and reorders them back: 24 of PP-OCRv6's
    # recogniser's 330 ms a step at batch 8 (its step 0.92x without).
    off = ("NchwcTransformer",) if part == "backward" else ()
    try:
        # Runs go through InferenceSession::Run, which stops the spinning on return.
        return _session(
            model,
            device,
            session_options,
            providers,
            spin_within_runs=True,
            threads=threads,
            off=off,
        )
    except OnnxModelError as exc:
        raise translate(
            exc.__cause__ or exc, f"load the {part} graph", model, refuse="onnxruntime"
        ) from exc


def _dim_sources(model: onnx.ModelProto, n_feeds: int) -> dict[str, tuple[int, int]]:
    """Where each symbolic input dimension can be read: (feed position, axis)."""
    found = {}
    for pos, vi in enumerate(list(model.graph.input)[:n_feeds]):
        for axis, dim in enumerate(vi.type.tensor_type.shape.dim):
            if dim.dim_param and dim.dim_param not in found:
                found[dim.dim_param] = (pos, axis)
    return found
