"""Making onnxruntime sessions: the one factory the engines and training use.

:func:`make_session` makes each ``InferenceSession`` ortbridge runs, on the
device asked for (a CUDA device without a working CUDA provider is an error,
never a silent CPU session), its failures in plain words. Around it, the
options and optimiser choices of each kind of session: the engines' (sized
like torch's pool, workers pinned, :func:`_session`) and those of the graphs
training writes (:func:`training_session`).
"""

from __future__ import annotations

import contextlib

import onnx
import torch

from ..exceptions import MissingDependencyError, OnnxModelError
from . import _ort
from ._errors import load_error
from ._threads import start_pinned


def default_session_options(
    device: torch.device, spin_within_runs: bool = False, threads: int | None = None
):
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

    ``threads``: the intra-op pool's size where not torch's thread count.
    """
    ort = _ort.runtime()
    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, threads or torch.get_num_threads())
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


def allow_tf32() -> str:
    """``use_tf32`` for onnxruntime's CUDA provider: as torch computes float32 products.

    onnxruntime uses TF32 (10-bit mantissas) for float32 matrix products and
    convolutions unless told otherwise; torch does not for products, by
    default (``torch.get_float32_matmul_precision() == "highest"``). Seen on
    an H200: a float32 MLP on onnxruntime's defaults differed from the CPU by
    2e-2 relative, element-wise. The setting is read when sessions are made.
    """
    return "0" if torch.get_float32_matmul_precision() == "highest" else "1"


def conv_algo_search() -> str:
    """``cudnn_conv_algo_search`` for onnxruntime's CUDA provider: as torch picks
    cuDNN's convolution algorithms.

    onnxruntime times every algorithm of each convolution at its first run
    (``EXHAUSTIVE``); torch does that only with ``torch.backends.cudnn.benchmark``
    and otherwise takes cuDNN's heuristic choice. (On an H200 with the
    exhaustive search, PP-OCRv6's recogniser took 6.0 s to build and take its
    first step, 2.0 s on a 2-core CPU; how much of it the search took is not
    yet measured apart.)
    """
    return "EXHAUSTIVE" if torch.backends.cudnn.benchmark else "HEURISTIC"


def providers_for(device: torch.device, providers=None) -> list:
    """Execution providers for ``device``; on CUDA, bound to torch's current stream,
    computing float32 and choosing convolution algorithms as torch does
    (:func:`allow_tf32`, :func:`conv_algo_search`)."""
    if device.type != "cuda":
        return list(providers) if providers is not None else ["CPUExecutionProvider"]
    cuda_options = {
        "device_id": str(device.index or 0),
        "user_compute_stream": str(current_stream(device)),
        "use_tf32": allow_tf32(),
        "cudnn_conv_algo_search": conv_algo_search(),
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
            for a in node.attribute:  # bodies only: a.g of another attribute is made empty
                if a.type == onnx.AttributeProto.GRAPH and quantized(a.g.node):
                    return True
                graphs = a.graphs if a.type == onnx.AttributeProto.GRAPHS else ()
                if any(quantized(g.node) for g in graphs):
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

#: onnxruntime optimisers that fail to load some valid graphs, by their
#: error: the session is made again without them. MatMulAddFusion on the
#: transformer optimizer's file of a dynamo-exported BERT (onnxruntime 1.31:
#: "Attempt to replace the existing tensor"; the file loads with it off).
_FAILING_OPTIMIZERS = {"Attempt to replace the existing tensor": "MatMulAddFusion"}


def _no_cuda_provider(device: torch.device, problem: str) -> MissingDependencyError:
    """The error for a session on a CUDA device that onnxruntime would run on the CPU."""
    found, built_for = _ort.build()
    if built_for:
        found += f" (built for CUDA {built_for})"
    return MissingDependencyError(
        f"onnxruntime cannot run on {device}: {found} {problem}; {_ort.cuda_hint()}"
    )


_CPU = torch.device("cpu")


def make_session(
    model,
    options=None,
    *,
    device: torch.device = _CPU,
    providers=None,
    disabled: list[str] | None = None,
    what: str = "the graph",
    graph: onnx.ModelProto | None = None,
):
    """An ``InferenceSession`` of ``model`` (a ModelProto or its bytes) on ``device``.

    Every session the engines, the bridge and the training helpers run
    comes from here (the op-coverage harness's reference sessions and the
    demo's inference are plain onnxruntime on purpose). ``providers`` defaults to
    the device's (:func:`providers_for`); ``disabled`` names onnxruntime
    optimisers kept off; ``what`` names the graph in errors, and ``graph``
    (when ``model`` is bytes) is the graph they cite. A CUDA device whose
    provider is missing or does not start raises
    :class:`~ortbridge.exceptions.MissingDependencyError` naming the package
    to install: onnxruntime would otherwise run the graph on the CPU.
    """
    ort = _ort.runtime()
    if isinstance(model, onnx.ModelProto):
        graph, model = model, model.SerializeToString()
    chosen = providers_for(device, providers)
    cuda = _CUDA in (p if isinstance(p, str) else p[0] for p in chosen)
    if cuda and _CUDA not in ort.get_available_providers():
        raise _no_cuda_provider(device, f"has no {_CUDA}")
    try:
        session = ort.InferenceSession(
            model, options, providers=chosen, disabled_optimizers=disabled or None
        )
    except Exception as exc:
        failing = next((o for m, o in _FAILING_OPTIMIZERS.items() if m in str(exc)), None)
        if failing is None or failing in (disabled or ()):
            raise load_error(exc, graph, what) from exc
        return make_session(
            model, options, device=device, providers=providers,
            disabled=[*(disabled or ()), failing], what=what, graph=graph,
        )  # fmt: skip
    # Where the provider's CUDA libraries do not load, onnxruntime logs it
    # and builds the session for the CPU alone: said here, with the fix.
    if cuda and _CUDA not in session.get_providers():
        raise _no_cuda_provider(
            device, f"could not start its {_CUDA} (its CUDA or cuDNN libraries did not load)"
        )
    return session


def _session(
    model, device, session_options, providers, spin_within_runs=False, threads=None, off=()
):
    """An engine's session, and the pinning of its workers (None: left to the system).

    ``model`` is a ModelProto or its bytes. Only sessions with ortbridge's own
    options on the CPU are pinned: options given by the user are theirs to tune.
    ``spin_within_runs``, ``threads``: see :func:`default_session_options`
    (``threads`` applies to ortbridge's own options only). ``off``: more of
    onnxruntime's optimisers kept off, by name (a layout the caller knows
    its graph runs slower in).
    """
    ort = _ort.runtime()
    graph = model if isinstance(model, onnx.ModelProto) else None
    if graph is not None:
        disabled = guarded_optimizers(graph) + idle_optimizers(graph) + list(off)
        basic = _needs_basic_level(graph)
        model = graph.SerializeToString()  # once, for every try below
    else:
        disabled, basic = list(off), False

    def create(options, own=True):
        if basic and own:  # a user's options are theirs: never changed
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        return make_session(
            model, options, device=device, providers=providers, disabled=disabled, graph=graph
        )

    if session_options is not None:
        return create(session_options, own=False), None
    so = default_session_options(device, spin_within_runs, threads)
    if device.type != "cpu":
        return create(so), None
    try:
        session, pinning = start_pinned(create, so, so.intra_op_num_threads - 1, spin_within_runs)
    except OnnxModelError:
        # The model, or thread affinities this onnxruntime refuses: once
        # more without them, so that only the model's own error comes out.
        session, pinning = create(default_session_options(device, spin_within_runs, threads)), None
    if spin_within_runs:
        stop_spinning(session)
    return session, pinning


#: onnxruntime's optimisers that write ``com.microsoft.FusedMatMul`` (Transpose +
#: MatMul, Mul + MatMul), which has no float64 kernel before onnxruntime 1.30.
_FUSED_MATMUL = ["MatmulTransposeFusion", "MatMulScaleFusion"]


def quiet_session_options():
    """Options of the graphs training writes: quiet, idle threads not spinning
    (the machine may be shared)."""
    so = _ort.runtime().SessionOptions()
    so.log_severity_level = 4  # failures are raised in plain words, not logged
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def training_session(model: onnx.ModelProto, options, what: str, reverse: bool = False):
    """A CPU session of a graph training writes; ``what`` names it in errors.

    ``reverse``: the graph holds onnx-ad's reverse graph, whose Transpose +
    MatMul pairs onnxruntime before 1.30 fuses into a kernel it lacks in
    float64: those fusions stay off there (the options, maybe a user's, are
    not changed).
    """
    disabled = _FUSED_MATMUL if reverse and _needs_basic_level(model) else None
    return make_session(model, options, disabled=disabled, what=what)


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
