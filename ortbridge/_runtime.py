"""onnxruntime's side of the bridge, shared by both engines: sessions, DLPack.

Plain code over onnxruntime's private bindings (``onnxruntime.capi._pybind_state``,
present in the training build and in maintained onnxruntime alike). The
engines (:mod:`._engines`) build their gradient graphs over these helpers.
"""

from __future__ import annotations

import contextlib

import onnx
import torch
from torch.utils.dlpack import to_dlpack

from . import _ort
from ._ort_errors import load_error, translate
from ._threads import UNPINNED, start_pinned
from .exceptions import MissingDependencyError, OnnxModelError, OrtBridgeError

_CAPI = None

# Ops drawing from onnxruntime's global generator at every run (Dropout's
# masks): a run reseeds it from torch's generator, so that torch's state
# (``torch.manual_seed``) decides the masks, in a new process too.
DRAWING_OPS = frozenset({"Dropout", "BitmaskDropout", "BiasDropout", "BitmaskBiasDropout"})


def draws(model: onnx.ModelProto) -> bool:
    """Whether a run of ``model`` draws from onnxruntime's generator."""
    return any(node.op_type in DRAWING_OPS for node in model.graph.node)


def torch_seed() -> torch.Tensor:
    """A seed for onnxruntime's generator from torch's (a CPU draw: no device sync)."""
    return torch.randint(2**31 - 1, ())


def _capi():
    """``onnxruntime.capi._pybind_state``, cached: it is needed on every call."""
    global _CAPI
    if _CAPI is None:
        _CAPI = _ort.capi()
    return _CAPI


def default_session_options(device: torch.device, spin_within_runs: bool = False):
    """Session options that share the machine with torch.

    onnxruntime's intra-op threads spin while waiting for work by default;
    between two ORT calls torch runs, and spinning threads then steal its
    cores (a training step measured 2-6x slower). Spinning is turned off and
    the pool sized like torch's.

    ``spin_within_runs``: the workers spin between the nodes of one run and
    stop when it returns (``session.force_spinning_stop``), so that a run of
    many short nodes does not wait for a sleeping worker at each one (on 2
    cores, a 64x784x256 Gemm: 128 us with sleeping workers, 91 us spinning),
    and torch still has the cores between runs. For sessions run through
    ``InferenceSession.run`` only: the TrainingAgent's calls do not stop the
    spinning.
    """
    ort = _ort.runtime()
    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, torch.get_num_threads())
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    spin = "1" if spin_within_runs else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if spin_within_runs:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    # Failures come back as exceptions in plain words: onnxruntime's own log
    # line for them would only repeat its C++ text on stderr.
    so.log_severity_level = 4
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
        if t.numel() == 0 or not t.is_contiguous():
            # onnxruntime reads only row-major strides, an empty tensor's included.
            t = t.contiguous() if t.numel() else t.new_empty(t.shape)
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


def guarded_optimizers(model: onnx.ModelProto) -> list[str]:
    """onnxruntime graph optimisers that must stay off for ``model``.

    Maintained onnxruntime's ConstantFolding kills the process on the ``Loop``
    torch's exporters write for ``nn.EmbeddingBag``: any graph with a Loop
    runs without it. onnxruntime 1.19's GatherSliceToSplitFusion gives two
    nodes one name on the reverse graphs of LSTMs, and the session then fails
    to load.
    """
    disabled = []
    if any(node.op_type == "Loop" for node in model.graph.node):
        disabled.append("ConstantFolding")
    if _ort.version() < (1, 20):
        disabled.append("GatherSliceToSplitFusion")
    return disabled


#: onnxruntime's transformers of quantized graphs (onnxruntime 1.31's names;
#: names a version lacks are ignored). Each walks every node, about 1.3 s on
#: the 42,000-node reverse graph of a published OCR model, 18 s of the 116 s
#: its session took to create, and changed nothing there.
QUANTIZATION_OPTIMIZERS = (
    "DoubleQDQPairsRemover", "QDQPropagationTransformer", "WeightBiasQuantization",
    "EnsureUniqueDQForNodeUnit", "WhereDummyDq", "QDQS8ToU8Transformer",
    "QDQSelectorActionTransformer", "QDQFinalCleanupTransformer",
    "MatMulIntegerToFloatFusion", "DynamicQuantizeMatMulFusion", "MatMulNBitsFusion",
)  # fmt: skip


def _quantized(model: onnx.ModelProto) -> bool:
    """Whether a node of ``model`` (subgraphs included) is a quantization op."""

    def quantized(nodes) -> bool:
        for node in nodes:
            op = node.op_type.lower()  # (De)QuantizeLinear, QLinear*, *Integer, MatMulNBits
            if "quant" in op or "integer" in op or op.startswith("qlinear") or "nbits" in op:
                return True
            for a in node.attribute:
                if quantized(a.g.node) or any(quantized(g.node) for g in a.graphs):
                    return True
        return False

    return quantized(model.graph.node)


def idle_optimizers(model: onnx.ModelProto) -> list[str]:
    """onnxruntime graph optimisers with nothing to do on ``model``: its
    quantization transformers, where no node is quantized (ortbridge's
    gradient graphs never are). Leaving them out changes no result."""
    return [] if _quantized(model) else list(QUANTIZATION_OPTIMIZERS)


def _needs_basic_level(model: onnx.ModelProto) -> bool:
    # Through onnxruntime 1.29 the extended optimiser fuses Transpose + MatMul
    # into com.microsoft.FusedMatMul, which has no float64 kernel there.
    if _ort.version() >= (1, 30):
        return False
    doubles = {i.name for i in model.graph.input if i.type.tensor_type.elem_type == 11}
    return bool(doubles) or any(init.data_type == 11 for init in model.graph.initializer)


_CUDA = "CUDAExecutionProvider"


def _no_cuda_provider(device: torch.device, problem: str) -> MissingDependencyError:
    """The error for a session on a CUDA device that onnxruntime would run on the CPU."""
    found, built_for = _ort.build()
    if built_for:
        found += f" (built for CUDA {built_for})"
    return MissingDependencyError(
        f"onnxruntime cannot run on {device}: {found} {problem}; {_ort.cuda_hint()}"
    )


def _session(model, device, session_options, providers, spin_within_runs=False):
    """A session, and the pinning of its workers (None: left to the system).

    ``model`` is a ModelProto or its bytes. Only sessions with ortbridge's own
    options on the CPU are pinned: options given by the user are theirs to tune.
    ``spin_within_runs``: see :func:`default_session_options`.
    """
    ort = _ort.runtime()
    if isinstance(model, onnx.ModelProto):
        disabled = guarded_optimizers(model) + idle_optimizers(model)
        basic = _needs_basic_level(model)
        model_bytes = model.SerializeToString()
    else:
        disabled, basic, model_bytes = [], False, model

    def create(options, own=True):
        if basic and own:  # a user's options are theirs: never changed
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        chosen = providers_for(device, providers)
        cuda = _CUDA in (p if isinstance(p, str) else p[0] for p in chosen)
        if cuda and _CUDA not in ort.get_available_providers():
            raise _no_cuda_provider(device, f"has no {_CUDA}")
        try:
            session = ort.InferenceSession(
                model_bytes, options, providers=chosen, disabled_optimizers=disabled or None
            )
        except Exception as exc:
            graph = model if isinstance(model, onnx.ModelProto) else None
            raise load_error(exc, graph, "the graph") from exc
        # Where the provider's CUDA libraries do not load, onnxruntime logs it
        # and builds the session for the CPU alone: said here, with the fix.
        if cuda and _CUDA not in session.get_providers():
            raise _no_cuda_provider(
                device, f"could not start its {_CUDA} (its CUDA or cuDNN libraries did not load)"
            )
        return session

    if session_options is not None:
        return create(session_options, own=False), None
    so = default_session_options(device, spin_within_runs)
    if device.type != "cpu":
        return create(so), None
    try:
        session, pinning = start_pinned(create, so, so.intra_op_num_threads - 1, spin_within_runs)
    except OnnxModelError:
        # The model, or thread affinities this onnxruntime refuses: once
        # more without them, so that only the model's own error comes out.
        session, pinning = create(default_session_options(device, spin_within_runs)), None
    if spin_within_runs:
        stop_spinning(session)
    return session, pinning


#: An output name no graph ortbridge runs has (see :func:`stop_spinning`).
_NO_OUTPUT = "ortbridge::no-such-output"


def stop_spinning(session) -> None:
    """Stop the spinning a new session's workers start in.

    A pool created with spinning allowed spins (about 30 ms of a core per
    worker on a 2-core machine) until a run with ``session.force_spinning_stop``
    ends, so each session created and not yet run took that from torch, and
    a layer's first shapes create several. A run asking for an output the
    graph lacks enters the runtime's run, which stops the spinning on its
    way out, and fails before any node runs (onnxruntime 1.19.2 and 1.31.1).
    """
    if any(o.name == _NO_OUTPUT for o in session.get_outputs()):
        return
    with contextlib.suppress(Exception):
        session._sess.run([_NO_OUTPUT], {}, None)


class SessionHolder:
    """A graph run by one session: :attr:`sessions` and :attr:`pinnings` as the engines have."""

    session = None
    pinning = None

    @property
    def sessions(self) -> list:
        """The onnxruntime sessions this graph runs."""
        return [self.session]

    @property
    def pinnings(self) -> list:
        """The pinning of each session's workers (None: left to the system)."""
        return [self.pinning]


class InferenceGraph(SessionHolder):
    """A plain inference session over a graph whose weights are inputs."""

    def __init__(
        self, model: onnx.ModelProto, device, session_options=None, providers=None, seeded=False
    ):
        self.session, self.pinning = _session(model, device, session_options, providers)
        self._model = model  # names the node of a run-time failure
        # A train-mode graph with Dropout: masks from a seed torch's generator draws.
        self.seeded = seeded and draws(model)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._devices = [ort_device(device)] * len(self.output_names)
        self._run_options = _ort.runtime().RunOptions()

    def run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        C = _capi()
        inputs = to_ortvalues([feeds[name] for name in self.input_names])
        outputs = C.OrtValueVector()
        if self.seeded:
            C.set_seed(int(torch_seed()))
        try:
            with self.pinning or UNPINNED:
                self.session._sess.run_with_ortvaluevector(
                    self._run_options,
                    self.input_names,
                    inputs,
                    self.output_names,
                    outputs,
                    self._devices,
                )
        except Exception as exc:
            raise translate(exc, "run the graph", self._model) from exc
        return from_ortvalues(outputs)
