"""State shared by an :class:`~ortbridge.OnnxModule` and its autograd Function.

Holds the prepared graph, the engine that differentiates it and, per mode,
device and set of tensors needing a gradient, the gradient graph built for it
(built on first use, kept).
"""

from __future__ import annotations

import onnx
import torch

from . import _engines, _prepare
from ._prepare import _call_ranks
from ._prepare._onnx_utils import FLOAT_TYPES
from ._runtime._runs import InferenceGraph, draws
from ._runtime._sessions import current_stream
from .exceptions import (
    NotDifferentiableError,
    OnnxInputError,
    OnnxModelError,
)


class Bridge:
    """Prepared graph plus caches of gradient graphs and inference sessions."""

    def __init__(
        self,
        model: onnx.ModelProto,
        input_names: list[str],
        weight_names: list[str],
        *,
        frozen_batch_norm: bool,
        providers=None,
        session_options=None,
        backend: str = _engines.AUTO,
        as_is: bool = False,
        zero_gradient=(),
    ):
        self.model = model
        #: The graph is used as it is, without train/eval variants (a reverse
        #: model differentiated again for double backward).
        self.as_is = as_is
        self.backend = backend
        self.engine, self.engine_reason = _engines.resolve(backend, model)
        self.input_names = list(input_names)
        self.weight_names = list(weight_names)
        self.feed_names = self.input_names + self.weight_names
        #: Feeds the outputs depend on only through ops of zero derivative
        #: (Round, Floor, Ceil, Sign): no engine differentiates them, their
        #: gradient is zeros (:func:`._function._backward`), as in torch.
        self.zero_gradient = set(zero_gradient)
        self.zero_slots = [i for i, n in enumerate(self.feed_names) if n in self.zero_gradient]
        self.frozen_batch_norm = frozen_batch_norm
        self.providers = providers
        self.session_options = session_options
        position = {name: i for i, name in enumerate(self.feed_names)}
        self.batch_norms = [] if frozen_batch_norm else _prepare.batch_norm_nodes(model)
        self.stat_positions = [(position[b.mean], position[b.var]) for b in self.batch_norms]
        #: Feed positions of the running statistics, in the order a train-mode
        #: graph gives their new values after the user outputs.
        self.stat_order = [p for pair in self.stat_positions for p in pair]
        #: Feed positions of the running statistics updated in train mode.
        self.running_stat_positions = set(self.stat_order)
        self._stat_feeds = sorted(self.running_stat_positions)
        self._gradient_graphs: dict = {}
        self._inference_graphs: dict = {}
        #: Tensors whose rank only a call can tell (:mod:`._prepare._call_ranks`); the
        #: graphs are then built, and cached, per input ranks.
        self.unknown_ranks = [] if as_is else _call_ranks.unknown_ranks(model)
        self._ranked_models: dict = {}

    def _variant(self, mode: str, for_gradient: bool, tensors=None):
        if self.as_is:
            copy = onnx.ModelProto()
            copy.CopyFrom(self.model)
            return copy, []
        model = self._ranked_model(tensors) if self.unknown_ranks else self.model
        model, extra = _prepare.make_variant(
            model, mode, self.frozen_batch_norm, for_gradient=for_gradient
        )
        return _prepare.weights_as_inputs(model, self.weight_names), extra

    def _ranked_model(self, tensors):
        """The graph with the ranks of :attr:`unknown_ranks` declared, for these inputs."""
        inputs = None if tensors is None else tensors[: len(self.input_names)]
        if inputs is None or any(t is None for t in inputs):
            raise _call_ranks.CallShapesNeeded(
                f"the rank of {self.unknown_ranks[:3]} (input(s) of BatchNormalization) is "
                "declared nowhere in the graph: it is learnt from the inputs at the first call"
            )
        key = _input_ranks(tensors, len(self.input_names))
        model = self._ranked_models.get(key)
        if model is None:
            feeds = {n: t.detach().cpu().numpy() for n, t in zip(self.input_names, inputs)}
            ranks = _call_ranks.observed_ranks(self.model, self.unknown_ranks, feeds)
            model = onnx.ModelProto()
            model.CopyFrom(self.model)
            _call_ranks.declare_ranks(model, ranks)
            self._ranked_models[key] = model
        return model

    def gradient_graph(self, mode: str, needs_grad: tuple, device: torch.device, tensors=None):
        """The engine's gradient graph for ``mode``, ``device`` and the tensors needing grad.

        ``tensors`` (the feeds, inputs may be None) lets the onnxruntime engine
        build frozen settings such as Resize scales into the graph.
        """
        # Called on every forward: the key is built without extra calls.
        stream = current_stream(device) if device.type == "cuda" else None
        key = (mode, needs_grad if type(needs_grad) is tuple else tuple(needs_grad), device, stream)
        if tensors is not None and any(
            t is not None and not t.numel() for t in tensors[: len(self.input_names)]
        ):
            if self._outputs_empty(tensors):
                return _EmptyCallGraph(self, key, tensors)
        if self.unknown_ranks:
            key += (_input_ranks(tensors, len(self.input_names)),)
        graph = self._gradient_graphs.get(key)
        if graph is None:
            graph = self._build(mode, key[1], device, tensors)
            self._gradient_graphs[key] = graph
        return graph

    def _outputs_empty(self, tensors) -> bool:
        """Whether every output is empty for these (partly empty) inputs (cached per shapes)."""
        shapes = tuple(tuple(t.shape) for t in tensors[: len(self.input_names)])
        cache = self.__dict__.setdefault("_empty_outputs", {})
        if shapes not in cache:
            named = dict(zip(self.input_names, shapes))
            cache[shapes] = _call_ranks.outputs_empty(self.model, named)
        return cache[shapes]

    def _build(self, mode: str, needs_grad: tuple, device: torch.device, tensors=None):
        model, _ = self._variant(mode, for_gradient=True, tensors=tensors)
        n_in = len(self.input_names)
        inputs = [n for n, need in zip(self.input_names, needs_grad[:n_in]) if need]
        weights = [n for n, need in zip(self.weight_names, needs_grad[n_in:]) if need]
        # Tensors of zero gradient are left to the zeros of _function._backward,
        # unless nothing else needs one: then the engine's own graph gives them.
        zero = self.zero_gradient
        if any(n not in zero for n in inputs + weights):
            inputs = [n for n in inputs if n not in zero]
            weights = [n for n in weights if n not in zero]
        elif inputs or weights:  # every one of them: no engine has anything to do
            return _ZeroGraph(self, mode, device, tensors)
        batch_norms = self.batch_norms if mode == _prepare.TRAIN else ()
        while True:
            try:
                if self.engine == _engines.ONNXRUNTIME:
                    return _engines.gradient_graph(
                        self.engine,
                        model,
                        self.feed_names,
                        inputs + weights,
                        device,
                        self.session_options,
                        self.providers,
                        batch_norm_nodes=batch_norms,
                        n_inputs=n_in,
                        tensors=tensors,
                    )
                return _engines.graph_class(self.engine)(
                    model,
                    self.weight_names,
                    weights,
                    inputs,
                    device,
                    self.session_options,
                    self.providers,
                    batch_norm_nodes=batch_norms,
                    caller_order=self.feed_names,
                )
            except NotDifferentiableError as exc:
                # An input requiring grad that no gradient reaches gets
                # none, as in torch (its .grad stays None).
                if exc.unreachable in inputs:
                    inputs.remove(exc.unreachable)
                    continue
                if not self._fall_back(exc):
                    raise
            except OnnxModelError as exc:
                if not self._fall_back(exc):
                    raise
            return self._build(mode, needs_grad, device, tensors)

    def after_refusal(self, exc: NotDifferentiableError, mode: str, needs_grad, tensors):
        """The gradient graph to run after the engine refused to build one for a
        call's shapes (nothing ran): the other engine's under ``auto``, else ``exc``."""
        if not self._fall_back(exc):
            raise exc
        return self.gradient_graph(mode, needs_grad, tensors[0].device, tensors)

    @property
    def fell_back(self) -> bool:
        """Whether ``auto`` moved to the other engine after a build failed."""
        return bool(self.__dict__.get("_fell_back"))

    def _fall_back(self, exc: Exception) -> bool:
        """Under ``backend="auto"``, move once to the other engine after a build fails.

        Only a build fails over: a graph that ran is never run again on another
        engine, so no running statistic or random draw moves twice.
        """
        if self.backend != _engines.AUTO or getattr(exc, "unreachable", None):
            return False
        if self.fell_back:
            return False
        other = _engines.fallback(self.engine, self.model)
        if other is None:
            return False
        failed = self.engine
        self.engine = other
        self._fell_back = True
        self.engine_reason = f"the {failed} engine could not build a gradient graph: {exc}"
        self._gradient_graphs.clear()
        return True

    def reverse_bridge(self, graph, tensors):
        """A bridge over the whole reverse model of ``graph`` (for double backward).

        Its inputs are the forward's feeds, the Dropout masks, then the
        output gradients; its outputs the gradients the ``grad_slots`` of the
        graph built for these shapes list.
        Built once per gradient graph and input shape.
        """
        token = graph.static_built(tensors)
        cached = getattr(token, "reverse_bridge", None)
        if cached is None:
            model = onnx.ModelProto()
            model.CopyFrom(token.reverse)
            live = token.split.live_adjoints
            outputs = {o.name: o for o in model.graph.output}
            del model.graph.output[:]
            model.graph.output.extend(outputs[name] for name in live)
            names = [i.name for i in model.graph.input]
            bridge = Bridge(
                model,
                names,
                [],
                frozen_batch_norm=True,
                providers=self.providers,
                session_options=self.session_options,
                backend=_engines.ONNXRUNTIME,
                as_is=True,
            )
            cached = token.reverse_bridge = (bridge, names)
        return cached

    def function_apply(self, *tensors, mode: str = _prepare.EVAL):
        """Run this bridge's graph through a generated autograd Function."""
        function = self.__dict__.get("function")
        if function is None:
            from ._function import make_function

            function = self.function = make_function(self.model.graph.name or "reverse")
        return function.apply(self, mode, *tensors)

    def output_dims(self, mode: str, dims: tuple) -> list:
        """Each output's sizes and dtype for inputs of ``dims`` (ints or names of
        symbolic sizes), in ``mode`` (train mode: the new running statistics
        last), by shape inference: the traced operator's fake kernel
        (:mod:`._torch_op`). Cached per mode and ``dims``."""
        cache = self.__dict__.setdefault("_output_dims", {})
        key = (mode, dims)
        if key not in cache:
            from ._torch_op import output_dims

            model, _ = self._variant(mode, for_gradient=False)
            cache[key] = output_dims(model, dict(zip(self.input_names, dims)))
        return cache[key]

    def draws_in_train_mode(self) -> bool:
        """Whether a train-mode call draws random masks (Dropout). Cached."""
        found = self.__dict__.get("_draws")
        if found is None:
            model, _ = self._variant(_prepare.TRAIN, for_gradient=False)
            found = self._draws = draws(model)
        return found

    def inference_graph(self, mode: str, device: torch.device, tensors=None) -> InferenceGraph:
        key = (mode, device, current_stream(device))
        if self.unknown_ranks:
            key += (_input_ranks(tensors, len(self.input_names)),)
        graph = self._inference_graphs.get(key)
        if graph is None:
            model, _ = self._variant(mode, for_gradient=False, tensors=tensors)
            graph = InferenceGraph(
                model, device, self.session_options, self.providers, seeded=mode == _prepare.TRAIN
            )
            self._inference_graphs[key] = graph
        return graph

    def n_stat_outputs(self, mode: str) -> int:
        """How many outputs after the user's a ``mode`` graph gives (new running statistics)."""
        return len(self.stat_order) if mode == _prepare.TRAIN else 0

    def run_feeds(self, mode: str, tensors):
        """The tensors a call hands onnxruntime: ``tensors``, with copies of the
        running statistics in train mode.

        onnxruntime's train-mode BatchNormalization kernel (1.19.2 and 1.31.1
        alike) writes into its running-variance input (the biased batch
        variance blended in; NaN on an empty batch), and the training agent's
        graph into the running mean too. Those inputs are the module's
        buffers, which only :meth:`update_running_stats` may change: a refused
        batch must leave them as they were.
        """
        if mode != _prepare.TRAIN or not self._stat_feeds:
            return tensors
        tensors = list(tensors)
        for pos in self._stat_feeds:
            tensors[pos] = tensors[pos].clone()
        return tensors

    def update_running_stats(self, tensors, new_stats) -> None:
        """Copy the new running statistics (train mode) into their buffers.

        As torch's BatchNorm: a batch with one value per channel is refused
        and an empty batch leaves the statistics as they are. Nothing is
        written unless every node's statistics can be.
        """
        if not new_stats:
            return
        counts = self._values_per_channel(tensors)
        updates = []
        for k, (count, stats) in enumerate(zip(counts, self.batch_norms)):
            mean_pos, var_pos = self.stat_positions[k]
            mean, var = new_stats[2 * k], new_stats[2 * k + 1]
            if count == 0:
                continue
            if count == 1 or (
                count is None
                and not (bool(torch.isfinite(var).all()) and bool(torch.isfinite(mean).all()))
                and bool(torch.isfinite(tensors[var_pos]).all())
            ):
                got = (
                    f"got {count}"
                    if count is not None
                    else "its batch statistics are NaN or infinite (too few values, or "
                    "non-finite inputs)"
                )
                raise OnnxInputError(
                    f"BatchNormalization node {stats.node_name!r} in train mode: expected more "
                    f"than 1 value per channel, {got}; torch's BatchNorm refuses such a batch "
                    "too. The running statistics are left unchanged: use a larger batch, or "
                    "eval mode"
                )
            updates.append((mean_pos, mean, var_pos, var))
        with torch.no_grad():
            for mean_pos, mean, var_pos, var in updates:
                tensors[mean_pos].copy_(mean)
                tensors[var_pos].copy_(var)

    def _values_per_channel(self, tensors) -> list:
        """Values per channel of each BatchNormalization, per input shapes (cached)."""
        shapes = tuple(tuple(t.shape) for t in tensors[: len(self.input_names)])
        cache = self.__dict__.setdefault("_counts", {})
        counts = cache.get(shapes)
        if counts is None:
            if len(cache) > 64:  # a varying sequence length, say: keep the cache bounded
                cache.clear()
            named = dict(zip(self.input_names, shapes))
            counts = cache[shapes] = _prepare.values_per_channel(
                self.model, self.batch_norms, named
            )
        return counts

    def run_inference(self, mode: str, tensors, device: torch.device) -> list[torch.Tensor]:
        graph = self.inference_graph(mode, device, tensors)
        outputs = graph.run(dict(zip(self.feed_names, self.run_feeds(mode, tensors))))
        n_user = len(outputs) - self.n_stat_outputs(mode)
        self.update_running_stats(tensors, outputs[n_user:])
        return outputs[:n_user]


class _ZeroGraph:
    """The gradient graph of a step whose every tensor needing a gradient has a
    zero one (reached through Round and the like only): the forward is plain
    inference, the backward gives nothing (``_function._backward`` the zeros)."""

    saves_tensors = False
    draws = False
    save_outputs: list = []
    grad_slots: list = []
    full_shape: set = set()

    def __init__(self, bridge: Bridge, mode: str, device: torch.device, tensors=None):
        self._inference = bridge.inference_graph(mode, device, tensors)
        self._names = bridge.feed_names
        outputs = bridge.model.graph.output
        self.n_user_outputs = len(outputs)
        self.non_differentiable = {
            i for i, o in enumerate(outputs) if o.type.tensor_type.elem_type not in FLOAT_TYPES
        }

    def forward(self, tensors):
        return self._inference.run(dict(zip(self._names, tensors))), (), None

    def backward(self, *args, **kwargs):
        return []


class _EmptyCallGraph(_ZeroGraph):
    """A call with an empty input (a batch of zero rows) and, by shape
    inference, only empty outputs: no engine is asked for a gradient graph of
    zero-size shapes (onnxruntime's shape inference refuses some; the
    onnxruntime engine's refusal would move ``auto`` to the other engine for
    good). The forward is plain inference (running statistics left as they
    are, as torch's BatchNorm does) and every gradient needed is zeros
    (:func:`._function._backward` gives them for empty outputs)."""

    saves_tensors = True

    def __init__(self, bridge: Bridge, key: tuple, tensors):
        mode, needs_grad, device = key[:3]
        super().__init__(bridge, mode, device, tensors)
        self.grad_slots = [i for i, need in enumerate(needs_grad) if need]


def _input_ranks(tensors, n_inputs: int) -> tuple | None:
    if tensors is None or any(t is None for t in tensors[:n_inputs]):
        return None
    return tuple(t.dim() for t in tensors[:n_inputs])
