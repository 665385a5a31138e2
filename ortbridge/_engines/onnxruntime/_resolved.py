"""Gradient graphs per resolved control flow (onnxruntime engine).

A graph whose main-graph ``If`` conditions (or ``Loop`` trip counts) follow
from the input shapes, a one-value int input (a sample rate) and constants
is differentiated through the branch each call takes, loops unrolled
(:mod:`ortbridge._prepare._control_flow`): one :class:`~._engine.OrtGradientGraph` per
set of decisions, each specialised per input shape as usual. A call's key
(input shapes, deciding values) is mapped to its decisions once; weights in
a branch not taken get no gradient (None), as torch leaves an unused
parameter's.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch

from ortbridge._prepare import _control_flow
from ortbridge._prepare._lookup import _infer
from ortbridge._prepare._onnx_utils import FLOAT_TYPES, ancestors
from ortbridge._runtime._sessions import make_session

from ._engine import OrtGradientGraph

#: Keys (input shapes, deciding values) remembered before the memo is cleared.
_KEYS = 64


class ResolvedGradientGraph:
    """Dispatches each call to the gradient graph of the branches it takes."""

    engine = OrtGradientGraph.engine
    saves_tensors = True

    def __init__(
        self,
        model,
        feed_names,
        targets,
        device,
        session_options=None,
        providers=None,
        batch_norm_nodes=(),
        n_inputs=None,
        tensors=None,
    ):
        self._model = model
        self._feed_names = list(feed_names)
        self.n_inputs = len(feed_names) if n_inputs is None else n_inputs
        self._build_args = (targets, device, session_options, providers, batch_norm_nodes)
        self._deciding = _control_flow.deciding_inputs(model, self.n_inputs)
        self._decisions: dict = {}
        #: One gradient graph per set of decisions (the branches taken).
        self.graphs: dict[tuple, OrtGradientGraph] = {}
        outputs = list(model.graph.output)
        types = _infer(model)[0]
        self.n_user_outputs = len(outputs)
        self.non_differentiable = {
            i for i, o in enumerate(outputs) if types.get(o.name) not in FLOAT_TYPES
        }
        self.full_shape = set(range(self.n_user_outputs))
        self.save_outputs, self.grad_slots = [], []
        if tensors is not None and all(t is not None for t in tensors[: self.n_inputs]):
            self._graph_for(tensors)
        else:
            # Built now (as other graphs are, so that a graph that cannot train
            # fails at construction) when the declared shapes and constants
            # decide every If and Loop; else at the first call, which decides them.
            resolved, decisions = _control_flow.resolve(model, None, {})
            names = [self._feed_names[p] for p in self._deciding]
            if not _control_flow.call_decides(resolved, names):
                self._build(resolved, decisions, tensors)

    def _build(self, model, decisions, tensors):
        targets, device, options, providers, batch_norms = self._build_args
        graph = OrtGradientGraph(
            model,
            self._feed_names,
            targets,
            device,
            options,
            providers,
            batch_norm_nodes=batch_norms,
            n_inputs=self.n_inputs,
            tensors=tensors,
        )
        self.graphs[decisions] = graph
        if not self.save_outputs and not self.grad_slots:
            self.save_outputs, self.grad_slots = graph.save_outputs, graph.grad_slots
        return graph

    def _graph_for(self, tensors) -> OrtGradientGraph:
        inputs = tensors[: self.n_inputs]
        key = (
            tuple(tuple(t.shape) for t in inputs),
            tuple(tuple(inputs[p].reshape(-1).tolist()) for p in self._deciding),
        )
        decisions = self._decisions.get(key)
        if decisions is not None:
            return self.graphs[decisions]
        values = {self._feed_names[p]: inputs[p].detach().cpu().numpy() for p in self._deciding}
        shapes = {n: tuple(t.shape) for n, t in zip(self._feed_names, inputs)}
        resolved, decisions = _control_flow.resolve(
            self._model, shapes, values, _Evaluator(self._feed_names, tensors)
        )
        graph = self.graphs.get(decisions)
        if graph is None:
            graph = self._build(resolved, decisions, tensors)
        if len(self._decisions) >= _KEYS:
            self._decisions.clear()
        self._decisions[key] = decisions
        return graph

    # The gradient-graph interface (see ortbridge._engines), for the graph a call takes.

    def forward(self, tensors):
        return self._graph_for(tensors).forward(tensors)

    def backward(self, grad_outputs, token, residuals, tensors, saved_outputs):
        return token.backward(grad_outputs, residuals, tensors, saved_outputs)

    def static_built(self, tensors):
        return self._graph_for(tensors).static_built(tensors)

    @property
    def sessions(self) -> list:
        return [s for g in self.graphs.values() for s in g.sessions]

    @property
    def pinnings(self) -> list:
        return [p for g in self.graphs.values() for p in g.pinnings]


class _Evaluator:
    """Values of ``If`` conditions (bool tensors) of a graph on one call's tensors, by onnxruntime.

    Runs only the nodes they depend on (a condition on the length of a
    convolution's output runs the convolutions once per new input shape).
    """

    def __init__(self, feed_names, tensors):
        self.feeds = dict(zip(feed_names, tensors))

    def __call__(self, model: onnx.ModelProto, name: str) -> np.ndarray | None:
        graph = model.graph
        producer = {out: node for node in graph.node for out in node.output}
        seen, nodes = ancestors(producer, [name])
        needed = {id(n) for n in nodes}
        inputs = [i for i in graph.input if i.name in seen]
        sub = onnx.helper.make_graph(
            [n for n in graph.node if id(n) in needed],
            "condition",
            inputs,
            [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.BOOL, None)],
            [t for t in graph.initializer if t.name in seen],
        )
        probe = onnx.helper.make_model(sub, opset_imports=model.opset_import)
        probe.ir_version = model.ir_version
        feeds = {}
        for vi in inputs:
            tensor = self.feeds[vi.name]
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.detach().cpu().numpy()
            feeds[vi.name] = tensor
        try:
            session = make_session(probe)
            return np.asarray(session.run([name], feeds)[0])
        except Exception:  # undecided: the If is left to onnx-ad, which names what fails
            return None
