"""onnxruntime's side of the bridge: sessions, the TrainingAgent, DLPack.

Plain code over onnxruntime-training's private bindings
(``onnxruntime.capi._pybind_state``); the autograd function and the module
are thin layers over :class:`GradientGraph` and :class:`InferenceGraph`.
"""

from __future__ import annotations

import re

import onnx
import torch
from torch.utils.dlpack import to_dlpack

from . import _ort
from ._gradient_rewrites import rewrite_gradient
from ._graph import batch_var_from_inv_std, unbiased_running_var
from ._threads import start_pinned
from .exceptions import NotDifferentiableError, OnnxModelError, OrtBridgeError

_NOT_REGISTERED = re.compile(r"has not been registered: (\S+) for node (\S*)")
_MISSING_GRAD = re.compile(
    r"failed to find NodeArg by name: (\S+)_grad|\) (\S+) couldn't find the consumer node"
)


_CAPI = None


def _capi():
    """``onnxruntime.capi._pybind_state``, cached: it is needed on every call."""
    global _CAPI
    if _CAPI is None:
        _CAPI = _ort.capi()
    return _CAPI


def default_session_options(device: torch.device):
    """Session options that share the machine with torch.

    onnxruntime's intra-op threads spin while waiting for work by default;
    between two ORT calls torch runs, and spinning threads then steal its
    cores (a training step measured 2-6x slower). Spinning is turned off and
    the pool sized like torch's.
    """
    ort = _ort.onnxruntime()
    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, torch.get_num_threads())
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


def current_stream(device: torch.device) -> int | None:
    """Handle of torch's current CUDA stream on ``device`` (None on CPU).

    onnxruntime queues its kernels on this stream (``user_compute_stream``),
    so they are ordered with torch's work without any synchronisation;
    sessions are cached per stream, a non-default stream gets its own.
    """
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


def providers_for(device: torch.device, providers=None) -> list:
    """Execution providers for ``device``; on CUDA, bound to torch's current stream."""
    if device.type != "cuda":
        return list(providers) if providers is not None else ["CPUExecutionProvider"]
    cuda_options = {
        "device_id": str(device.index or 0),
        "user_compute_stream": str(current_stream(device)),
    }
    if providers is None:
        return [("CUDAExecutionProvider", cuda_options), "CPUExecutionProvider"]
    chosen = []
    for provider in providers:
        name, options = provider if isinstance(provider, tuple) else (provider, {})
        if name == "CUDAExecutionProvider":
            options = {**cuda_options, **options}
        chosen.append((name, options) if options else name)
    return chosen


def ort_device(device: torch.device):
    C = _capi()
    if device.type == "cuda":
        return C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), device.index or 0)
    if device.type == "cpu":
        return C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    raise OrtBridgeError(f"onnxruntime cannot run on torch device {device}: use cpu or cuda")


def to_ortvalues(tensors) -> object:
    """An ``OrtValueVector`` sharing the memory of ``tensors`` (contiguous)."""
    C = _capi()
    vector = C.OrtValueVector()
    vector.reserve(len(tensors))
    for t in tensors:
        if t.dtype == torch.bool:
            # torch exports bool as DLPack's kDLBool, which onnxruntime 1.19
            # refuses: hand it the same bytes as uint8, flagged bool.
            vector.push_back(to_dlpack(t.view(torch.uint8)), True)
        else:
            vector.push_back(to_dlpack(t), False)
    return vector


def from_ortvalues(vector) -> list[torch.Tensor]:
    """Tensors taking ownership of an ``OrtValueVector``'s values (no copy)."""
    tensors = vector.to_dlpacks(torch._C._from_dlpack)
    # DLPack has no bool: onnxruntime hands bool tensors over as uint8.
    for i in vector.bool_tensor_indices():
        tensors[i] = tensors[i].to(torch.bool)
    return tensors


def _session(model_bytes: bytes, device, session_options, providers):
    """A session, and the pinning of its workers (None: left to the system).

    Only sessions with ortbridge's own options on the CPU are pinned: options
    given by the user are theirs to tune.
    """
    ort = _ort.onnxruntime()

    def create(options):
        try:
            return ort.InferenceSession(
                model_bytes, options, providers=providers_for(device, providers)
            )
        except Exception as exc:
            raise OnnxModelError(f"onnxruntime cannot load the graph: {exc}") from exc

    if session_options is not None:
        return create(session_options), None
    so = default_session_options(device)
    if device.type != "cpu":
        return create(so), None
    try:
        return start_pinned(create, so, so.intra_op_num_threads - 1)
    except OnnxModelError:
        # The model, or thread affinities this onnxruntime refuses: once
        # more without them, so that only the model's own error comes out.
        return create(default_session_options(device)), None


class InferenceGraph:
    """A plain inference session over a graph whose weights are inputs."""

    def __init__(self, model: onnx.ModelProto, device, session_options=None, providers=None):
        self.session, self.pinning = _session(
            model.SerializeToString(), device, session_options, providers
        )
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._devices = [ort_device(device)] * len(self.output_names)
        self._run_options = _ort.onnxruntime().RunOptions()

    def run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        C = _capi()
        if self.pinning is not None:
            self.pinning.follow()
        inputs = to_ortvalues([feeds[name] for name in self.input_names])
        outputs = C.OrtValueVector()
        try:
            self.session._sess.run_with_ortvaluevector(
                self._run_options,
                self.input_names,
                inputs,
                self.output_names,
                outputs,
                self._devices,
            )
        except Exception as exc:
            raise OrtBridgeError(f"onnxruntime failed to run the graph: {exc}") from exc
        return from_ortvalues(outputs)


class GradientGraph:
    """The gradient graph of a forward graph for one set of tensors needing a gradient.

    Built by onnxruntime's ``OrtModuleGraphBuilder`` and run by a
    ``TrainingAgent``: ``forward`` returns the outputs and an execution state
    that ``backward`` consumes once.
    """

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
            raise _builder_error(exc) from exc
        info = builder.get_graph_info()
        gradient = onnx.load_from_string(builder.get_gradient_model())
        self.n_user_outputs = len(info.user_output_names)
        self.batch_norm_outputs = _expose_running_stats(gradient, batch_norm_nodes)
        rewrite_gradient(gradient, device.type)
        self.non_differentiable = set(info.output_grad_indices_non_differentiable)
        self.full_shape = set(info.output_grad_indices_require_full_shape)
        self.save_for_backward = list(info.module_output_indices_requires_save_for_backward)
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
        self.session, self.pinning = _session(
            gradient.SerializeToString(), device, session_options, providers
        )
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

        Returns the outputs (user outputs, then new running statistics) and
        the execution state :meth:`backward` consumes.
        """
        C = _capi()
        if self.pinning is not None:
            self.pinning.follow()
        if self.feed_order is not None:
            tensors = [tensors[i] for i in self.feed_order]
        inputs = to_ortvalues(tensors)
        outputs = C.OrtValueVector()
        state = C.PartialGraphExecutionState()
        try:
            self.agent.run_forward(inputs, outputs, state, None)
        except Exception as exc:
            raise OrtBridgeError(f"onnxruntime failed in the forward pass: {exc}") from exc
        # The forward outputs live in the execution state's planned memory
        # (memory patterns), which backward reuses and then frees: torch gets
        # its own copy. Copying an output is far cheaper than running without
        # memory patterns (measured: a whole MLP step 25% slower).
        return [t.clone() for t in from_ortvalues(outputs)], state

    def backward(self, grad_outputs: list[torch.Tensor], state) -> list[torch.Tensor]:
        """Resume ``state``; the gradients, one per ``grad_targets``/``grad_slots``."""
        C = _capi()
        if self.pinning is not None:
            self.pinning.follow()
        inputs = to_ortvalues(grad_outputs)
        outputs = C.OrtValueVector()
        try:
            self.agent.run_backward(inputs, outputs, state)
        except Exception as exc:
            raise OrtBridgeError(f"onnxruntime failed in the backward pass: {exc}") from exc
        return from_ortvalues(outputs)


def _builder_error(exc: Exception) -> Exception:
    text = str(exc)
    match = _NOT_REGISTERED.search(text)
    if match:
        op_type, node = match.groups()
        return NotDifferentiableError(
            f"onnxruntime cannot differentiate node {node!r} (op type {op_type}): it has no "
            "registered gradient. Freeze the weights before it, or rewrite the node with "
            "differentiable ops"
        )
    match = _MISSING_GRAD.search(text)
    if match:
        name = match.group(1) or match.group(2)
        return NotDifferentiableError(
            f"no gradient reaches {name!r}: it cannot be trained or require grad",
            unreachable=name,
        )
    return OnnxModelError(f"onnxruntime could not build the gradient graph: {text}")


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
