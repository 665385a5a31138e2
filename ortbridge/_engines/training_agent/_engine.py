"""The training-agent engine: onnxruntime-training 1.19.2's gradient builder and TrainingAgent.

The reference design, kept: the builder writes one gradient graph (forward,
a ``YieldOp``, backward) with training-only kernels, and a ``TrainingAgent``
runs it in two halves. ``forward`` returns an execution state that
``backward`` resumes once; a second backward (``retain_graph=True``) runs the
forward again from the saved inputs. Needs the training build.

Dropout masks come from onnxruntime's global generator, not torch's: a
graph that draws them reseeds it before each forward with a seed drawn from
torch's generator, so that torch's state decides the masks
(``torch.manual_seed``, ``torch.set_rng_state``), in a new process too. The
seed is a residual: a forward run again from it draws the same masks.
"""

from __future__ import annotations

import re

import onnx
import torch

from ortbridge._prepare._batch_norm import batch_var_from_inv_std, unbiased_running_var
from ortbridge._runtime import _ort
from ortbridge._runtime._errors import translate
from ortbridge._runtime._runs import (
    SessionHolder,
    draws,
    from_ortvalues,
    ort_device,
    to_ortvalues,
    torch_seed,
)
from ortbridge._runtime._sessions import _session
from ortbridge._runtime._threads import UNPINNED
from ortbridge.exceptions import NotDifferentiableError, OnnxModelError, OrtBridgeError

from . import _limits
from ._gradient_rewrites import rewrite_gradient

NAME = "training-agent"

_NOT_REGISTERED = re.compile(r"has not been registered: (\S+) for node (\S*)")
_MISSING_GRAD = re.compile(
    r"failed to find NodeArg by name: (\S+)_grad|\) (\S+) couldn't find the consumer node"
)


#: Kernels that draw from onnxruntime's global generator at every run (the
#: training build may turn a Dropout into one of the com.microsoft ones).
_CAPI = None


def _capi():
    """The training build's bindings, cached: needed on every call."""
    global _CAPI
    if _CAPI is None:
        _CAPI = _ort.onnxruntime().capi._pybind_state
    return _CAPI


class GradientGraph(SessionHolder):
    """The gradient graph of a forward graph for one set of tensors needing a gradient.

    Built by onnxruntime's ``OrtModuleGraphBuilder`` and run by a
    ``TrainingAgent``: ``forward`` returns the outputs and an execution state
    that ``backward`` consumes once.
    """

    engine = NAME
    #: What the backward resumes is an execution state, not tensors torch can save.
    saves_tensors = False

    def __init__(
        self,
        model: onnx.ModelProto,
        weight_names: list[str],
        weights_to_train: list[str],
        inputs_requiring_grad: list[str],
        device: torch.device,
        session_options=None,
        providers=None,
        batch_norm_nodes=(),
        caller_order: list[str] | None = None,
    ):
        # What the builder gets wrong or crashes on is rewritten or refused first.
        model = _limits.rewrite_for_builder(model)
        _limits.refuse_limits(model, [*weights_to_train, *inputs_requiring_grad])
        C = _capi()
        cfg = C.OrtModuleGraphBuilderConfiguration()
        cfg.initializer_names = list(weight_names)
        cfg.initializer_names_to_train = list(weights_to_train)
        cfg.input_names_require_grad = list(inputs_requiring_grad)
        cfg.build_gradient_graph = True
        cfg.enable_caching = False
        cfg.loglevel = C.Severity.ERROR
        builder = C.OrtModuleGraphBuilder()
        try:
            builder.initialize(model.SerializeToString(), cfg)
            builder.build(C.TrainingGraphTransformerConfiguration())
        except Exception as exc:
            raise _builder_error(exc, model) from exc
        info = builder.get_graph_info()
        gradient = onnx.load_from_string(builder.get_gradient_model())
        self.n_user_outputs = len(info.user_output_names)
        self.batch_norm_outputs = _expose_running_stats(gradient, batch_norm_nodes)
        rewrite_gradient(gradient, device.type)
        self.non_differentiable = set(info.output_grad_indices_non_differentiable)
        self.full_shape = set(info.output_grad_indices_require_full_shape)
        self.save_outputs = list(info.module_output_indices_requires_save_for_backward)
        self.feed_names = [i.name for i in gradient.graph.input]
        grad_to_name = {g: n for n, g in info.user_input_grad_names.items()}
        grad_to_name.update(
            zip(info.initializer_grad_names_to_train, info.initializer_names_to_train)
        )
        # Which tensor each gradient output belongs to.
        self.grad_targets = [grad_to_name[o.name] for o in gradient.graph.output]
        # The caller hands tensors over in its own order (``caller_order``):
        # where each feed comes from (None: the same order), and where each
        # gradient goes back, worked out once rather than by name every call.
        position = {n: i for i, n in enumerate(caller_order or self.feed_names)}
        order = [position[n] for n in self.feed_names]
        self.feed_order = None if order == list(range(len(position))) else order
        self.grad_slots = [position[n] for n in self.grad_targets]
        self.gradient_model = gradient
        self.draws = draws(gradient)
        try:
            self.session, self.pinning = _session(gradient, device, session_options, providers)
        except OnnxModelError as exc:
            raise translate(
                exc.__cause__ or exc, "load the gradient graph", model, refuse=NAME
            ) from exc
        self._forward_model = model  # names the node of a failure at run time
        # The user outputs' declared float types: the builder's cast around a
        # float16 kernel the CPU lacks can leave a yielded output float32.
        self._declared = [_FLOATS.get(o.type.tensor_type.elem_type) for o in model.graph.output]
        self._yielded: list | None = None  # the types onnxruntime yields, seen at the first run
        dev = ort_device(device)
        n_fw = self.n_user_outputs + len(self.batch_norm_outputs)
        self.agent = C.TrainingAgent(
            self.session._sess,
            self.feed_names,
            [dev] * n_fw,
            [o.name for o in gradient.graph.output],
            [dev] * len(gradient.graph.output),
            0,
        )

    def forward(self, tensors: list[torch.Tensor]):
        """Run up to the YieldOp on ``tensors`` (in the caller's order).

        Returns the outputs (user outputs, then new running statistics), the
        residuals (the generator's seed where the graph draws masks) and the
        execution state :meth:`backward` consumes.
        """
        seed = torch_seed() if self.draws else None
        return self._forward(tensors, seed)

    def _forward(self, tensors, seed):
        C = _capi()
        if self.feed_order is not None:
            tensors = [tensors[i] for i in self.feed_order]
        if seed is not None:
            C.set_seed(int(seed))
        inputs, held = to_ortvalues(tensors)
        outputs = C.OrtValueVector()
        state = C.PartialGraphExecutionState()
        try:
            with self.pinning or UNPINNED:
                self.agent.run_forward(inputs, outputs, state, None)
        except Exception as exc:
            raise translate(exc, "run the forward pass", self._forward_model) from exc
        # The forward outputs live in the execution state's planned memory
        # (memory patterns), which backward reuses and then frees: torch gets
        # its own copy. Copying an output is far cheaper than running without
        # memory patterns (measured: a whole MLP step 25% slower).
        outputs = from_ortvalues(outputs)
        if self._yielded is None:
            self._yielded = [t.dtype for t in outputs]
        declared = self._declared
        outputs = [
            t.to(declared[i]) if i < len(declared) and declared[i] not in (None, t.dtype)
            else t.clone()
            for i, t in enumerate(outputs)
        ]  # fmt: skip
        return outputs, () if seed is None else (seed,), _Paused(state, held)

    def backward(self, grad_outputs, state, residuals=(), tensors=None, saved_outputs=None):
        """Resume ``state``; the gradients, one per ``grad_targets``/``grad_slots``.

        ``grad_outputs``: one per differentiable output. ``state`` None
        (consumed by an earlier backward): the forward runs again on
        ``tensors`` first, from the seed in ``residuals`` where given (the
        same masks), else from where onnxruntime's generator stands.
        """
        C = _capi()
        paused = state  # held to the end: the run reads the forward's feeds
        if paused is None:
            _, _, paused = self._forward(tensors, residuals[0] if residuals else None)
        # The gradients of outputs cast to their declared type go back as yielded.
        yielded = [
            t for i, t in enumerate(self._yielded[: self.n_user_outputs])
            if i not in self.non_differentiable
        ]  # fmt: skip
        grad_outputs = [g.to(t) if g.dtype != t else g for g, t in zip(grad_outputs, yielded)]
        inputs, held = to_ortvalues(grad_outputs)
        outputs = C.OrtValueVector()
        try:
            with self.pinning or UNPINNED:
                self.agent.run_backward(inputs, outputs, paused.state)
        except Exception as exc:
            raise translate(exc, "run the backward pass", self._forward_model) from exc
        return from_ortvalues(outputs)


_FLOATS = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
}


class _Paused:
    """A forward's execution state and the tensors its feeds wrap: the state
    reads those feeds again in the backward, and the values do not own them."""

    __slots__ = ("state", "fed")

    def __init__(self, state, fed):
        self.state, self.fed = state, fed


def _builder_error(exc: Exception, model: onnx.ModelProto) -> Exception:
    text = str(exc)
    match = _NOT_REGISTERED.search(text)
    if match:
        op_type, node = match.groups()
        return NotDifferentiableError(
            f"the training-agent engine cannot train node {node!r} (op type {op_type}): "
            "onnxruntime-training 1.19.2 has no gradient for it",
            node=node,
            op_type=op_type,
            hint='. backend="onnxruntime" (or "auto") may train it, or freeze what lies before it',
        )
    match = _MISSING_GRAD.search(text)
    if match:
        name = match.group(1) or match.group(2)
        return NotDifferentiableError(
            f"no gradient reaches {name!r}: it cannot be trained or require grad",
            unreachable=name,
        )
    return translate(exc, "build the gradient graph", model, refuse=NAME)


def _expose_running_stats(gradient: onnx.ModelProto, batch_norm_nodes) -> list[str]:
    """Make the forward pass return the new running statistics of BatchNorm nodes.

    The builder turns each BatchNormalization into a training-mode
    ``BatchNormInternal`` whose running-statistics outputs nobody reads. They
    are appended to the ``YieldOp`` (where the forward pass stops) as outputs
    without gradient, so the TrainingAgent returns them after the user outputs.
    """
    if not batch_norm_nodes:
        return []
    # The builder renames the nodes it replaces: match them by output.
    found = {}
    for node in gradient.graph.node:
        if node.op_type == "BatchNormInternal":
            found[node.output[0]] = node
    yield_op = next(n for n in gradient.graph.node if n.op_type == "YieldOp")
    extra = []
    for bn in batch_norm_nodes:
        if bn.output not in found:
            raise OrtBridgeError(
                f"BatchNormalization node {bn.node_name!r} vanished from the gradient graph: "
                "its running statistics cannot be updated (use batch_norm='frozen')"
            )
        node = found[bn.output]
        elem = next(
            (i.type.tensor_type.elem_type for i in gradient.graph.input if i.name == bn.var),
            onnx.TensorProto.FLOAT,
        )
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        batch_var = batch_var_from_inv_std(
            gradient.graph, node.output[4], float(attrs.get("epsilon", 1e-5)), elem
        )
        var = unbiased_running_var(
            gradient.graph, node.input[0], node.output[2], batch_var, bn.momentum, elem
        )
        extra.extend([node.output[1], var])
    start = len(yield_op.input)
    yield_op.input.extend(extra)
    for attr in yield_op.attribute:
        if attr.name == "non_differentiable_outputs":
            attr.ints.extend(range(start, start + len(extra)))
            break
    else:
        yield_op.attribute.append(
            onnx.helper.make_attribute(
                "non_differentiable_outputs", list(range(start, start + len(extra)))
            )
        )
    return extra
