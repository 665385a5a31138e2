"""How the bridge runs: gradient graphs, execution states, memory, tensors, threads."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import onnxruntime
import pytest
import torch
from conftest import scaled_atol
from onnx import TensorProto, helper, numpy_helper

from ortbridge import OnnxModule
from ortbridge._engines.onnxruntime import _engine as _onnxruntime
from ortbridge._prepare._onnx_utils import make_model
from ortbridge._runtime import _ort
from ortbridge._runtime._sessions import _session, current_stream, providers_for
from ortbridge.examples import linear_model
from ortbridge.exceptions import MissingDependencyError

# Every test here runs on each engine installed (see conftest).
pytestmark = pytest.mark.usefixtures("backend")

CPU = torch.device("cpu")


def _mlp_model(n_in=8, hidden=16, n_out=3, seed=0):
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((n_in, hidden)) / np.sqrt(n_in)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, n_out)) / np.sqrt(hidden)).astype(np.float32)
    b1 = np.zeros(hidden, np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Add", ["h", "b1"], ["hb"]),
            helper.make_node("Tanh", ["hb"], ["t"]),
            helper.make_node("MatMul", ["t", "w2"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))],
    )
    return make_model(graph)


def _torch_mlp(layer):
    w1, b1, w2 = (
        layer.onnx_weight(n).detach().clone().requires_grad_() for n in ("w1", "b1", "w2")
    )

    def run(x):
        return torch.tanh(x @ w1 + b1) @ w2

    return run, {"w1": w1, "b1": b1, "w2": w2}


@pytest.mark.engines("training-agent")  # its execution state; see test_engine_onnxruntime
def test_input_without_grad_gets_no_input_gradient():
    layer = OnnxModule(_mlp_model())
    layer(torch.randn(4, 8)).sum().backward()
    graphs = list(layer._bridge._gradient_graphs.values())
    assert len(graphs) == 1
    (graph,) = graphs
    assert "x" not in graph.grad_targets
    assert all(o.name != "x_grad" for o in graph.gradient_model.graph.output)
    assert not any(
        n.op_type == "MatMul" and "x_grad" in n.output for n in graph.gradient_model.graph.node
    )
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).sum().backward()
    with_input = [g for g in layer._bridge._gradient_graphs.values() if "x" in g.grad_targets]
    assert len(with_input) == 1 and x.grad is not None
    assert len(with_input[0].gradient_model.graph.node) > len(graph.gradient_model.graph.node)


@pytest.mark.engines("training-agent")  # its execution state; see test_engine_onnxruntime
def test_interleaved_forwards_and_backwards():
    layer = OnnxModule(_mlp_model())
    ref, params = _torch_mlp(layer)
    x1, x2 = torch.randn(5, 8), torch.randn(3, 8)
    y1, y2 = layer(x1), layer(x2)
    assert y1.grad_fn.token is not None and y2.grad_fn.token is not None
    (y2**2).sum().backward()
    assert y2.grad_fn.token is None  # freed as soon as its backward ends
    assert y1.grad_fn.token is not None
    g2 = {n: p.grad.clone() for n, p in layer.named_onnx_parameters()}
    layer.zero_grad()
    (y1**3).sum().backward()
    assert y1.grad_fn.token is None
    g1 = {n: p.grad.clone() for n, p in layer.named_onnx_parameters()}
    (ref(x2) ** 2).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(g2[name], p.grad, rtol=1e-4, atol=1e-5)
        p.grad = None
    (ref(x1) ** 3).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(g1[name], p.grad, rtol=1e-4, atol=1e-5)


def _dropout_model():
    """x -> Tanh(x @ w) -> Dropout(0.5): each train-mode forward draws a mask."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((6, 16)) / 2).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("Dropout", ["t", "ratio"], ["y"]),
        ],
        "dropout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
        ],
    )
    return make_model(graph)


def _grad_of_output_mask(layer, x, y, upstream):
    """The weight gradient of the mask ``y`` shows, in torch: y = mask * t / keep."""
    t = torch.tanh(x @ layer.onnx_weight("w").detach())
    return x.T @ (upstream * (y.detach() / t) * (1 - t * t))


class _CountingAgent:
    """A TrainingAgent that records its forward runs."""

    def __init__(self, agent, runs):
        self._agent, self._runs = agent, runs

    def run_forward(self, *args):
        self._runs.append("forward")
        return self._agent.run_forward(*args)

    def run_backward(self, *args):
        return self._agent.run_backward(*args)


def _forward_runs(layer, monkeypatch) -> list:
    """Records each forward run in onnxruntime of ``layer``'s built gradient graphs."""
    runs = []
    if layer.backend == "training-agent":
        for graph in layer._bridge._gradient_graphs.values():
            monkeypatch.setattr(graph, "agent", _CountingAgent(graph.agent, runs))
    else:
        run = _onnxruntime._Built._run

        def counted(self, *args):
            if args[-1] == "forward":
                runs.append("forward")
            return run(self, *args)

        monkeypatch.setattr(_onnxruntime._Built, "_run", counted)
    return runs


def test_retain_graph_runs_the_forward_once_where_it_can(backend, monkeypatch):
    """The onnxruntime engine keeps the residuals; the training agent's state is
    consumed by its backward, so it runs the forward again (README, Behaviour)."""
    layer = OnnxModule(_dropout_model()).train()
    x = torch.randn(5, 6)
    layer(x).sum().backward()  # builds the gradient graph
    layer.zero_grad()
    runs = _forward_runs(layer, monkeypatch)
    y = layer(x)
    upstream = torch.randn(y.shape)
    y.backward(upstream, retain_graph=True)
    expected = _grad_of_output_mask(layer, x, y, upstream)
    torch.testing.assert_close(
        layer.onnx_weight("w").grad, expected, rtol=1.3e-6, atol=scaled_atol(1e-5, expected)
    )
    y.backward(upstream)
    assert len(runs) == (2 if backend == "training-agent" else 1)


def test_retain_graph_second_backward_keeps_the_masks(backend):
    """A recomputed forward would draw new Dropout masks: both backwards must agree."""
    layer = OnnxModule(_dropout_model()).train()
    x = torch.randn(5, 6)
    y = layer(x)
    upstream = torch.randn(y.shape)
    y.backward(upstream, retain_graph=True)
    first = layer.onnx_weight("w").grad.clone()
    expected = _grad_of_output_mask(layer, x, y, upstream)
    torch.testing.assert_close(first, expected, rtol=1.3e-6, atol=scaled_atol(1e-5, expected))
    layer.zero_grad()
    y.backward(upstream)
    torch.testing.assert_close(layer.onnx_weight("w").grad, first, rtol=0, atol=0)


def test_optimizer_step_between_retained_backwards_is_refused():
    """Weights changed in place after the forward: the second backward would mix
    old activations and new weights, so torch's version check refuses it."""
    layer = OnnxModule(_mlp_model())
    y = layer(torch.randn(4, 8))
    y.sum().backward(retain_graph=True)
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def test_dropped_forwards_leave_memory_flat():
    layer = OnnxModule(_mlp_model(n_in=256, hidden=512, n_out=256))
    x = torch.randn(64, 256)
    for _ in range(200):  # warm up allocators and caches
        layer(x)
    gc.collect()
    before = _rss_mb()
    for _ in range(2000):
        out = layer(x)  # a training forward (weights require grad), never backpropagated
        del out
    gc.collect()
    growth = _rss_mb() - before
    # Each forward keeps about 0.5 MB of activations: a leak would be ~1 GB.
    assert growth < 40, f"resident memory grew by {growth:.1f} MB over 2,000 forwards"


def test_outputs_survive_backward_and_later_steps():
    layer = OnnxModule(_mlp_model())
    kept = []
    for batch in (4, 4, 9):
        y = layer(torch.randn(batch, 8))
        kept.append((y, y.detach().clone()))
        (y**2).sum().backward()
    for y, copy in kept:
        torch.testing.assert_close(y.detach(), copy, rtol=0, atol=0)
    grads = {n: p.grad for n, p in layer.named_onnx_parameters()}
    copies = {n: g.clone() for n, g in grads.items()}
    for _ in range(3):  # later steps do not write into earlier gradients
        layer.zero_grad(set_to_none=True)
        layer(torch.randn(9, 8)).sum().backward()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, copies[name], rtol=0, atol=0)
    with torch.no_grad():
        first = layer(torch.randn(4, 8))
        copy = first.clone()
        layer(torch.randn(4, 8))
    torch.testing.assert_close(first, copy, rtol=0, atol=0)


def test_non_contiguous_input_and_output_gradient():
    layer = OnnxModule(_mlp_model())
    ref, params = _torch_mlp(layer)
    x = torch.randn(9, 12).t()[:, 1:].requires_grad_()  # strided, with an offset
    assert not x.is_contiguous() and x.storage_offset() > 0
    x_ref = x.detach().clone().requires_grad_()
    out, want = layer(x), ref(x_ref)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(3, 12).t()  # a transposed output gradient
    assert not upstream.is_contiguous()
    out.backward(upstream)
    want.backward(upstream)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for name, p in params.items():
        torch.testing.assert_close(layer.onnx_weight(name).grad, p.grad, rtol=1e-5, atol=1e-6)


def _mixed_types_model():
    w = np.full((3,), 2.0, np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["xw"]),
            helper.make_node("Where", ["mask", "xw", "zero"], ["y"]),
            helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["y", "kf"], ["z"]),
            helper.make_node("Greater", ["z", "zero"], ["positive"]),
            helper.make_node("Add", ["k", "k"], ["k2"]),
        ],
        "mixed",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["n", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, ["n", 3]),
        ],
        [
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("positive", TensorProto.BOOL, ["n", 3]),
            helper.make_tensor_value_info("k2", TensorProto.INT64, ["n", 3]),
        ],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0, np.float32), "zero")],
    )
    return make_model(graph)


def test_bool_and_integer_inputs_and_outputs():
    layer = OnnxModule(_mixed_types_model())
    x = torch.randn(4, 3, requires_grad=True)
    mask = torch.rand(4, 3) > 0.5
    k = torch.randint(-2, 3, (4, 3))
    z, positive, k2 = layer(x, mask, k)
    expected = torch.where(mask, 2 * x, 0.0) + k
    torch.testing.assert_close(z, expected)
    assert positive.dtype == torch.bool and torch.equal(positive, expected > 0)
    assert k2.dtype == torch.int64 and torch.equal(k2, 2 * k)
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.where(mask, 2.0, 0.0))
    torch.testing.assert_close(layer.onnx_weight("w").grad, (x * mask).sum(0).detach())


def test_dynamic_batch_without_rebuilding():
    layer = OnnxModule(_mlp_model())
    for batch in (1, 7, 64):
        x = torch.randn(batch, 8)
        y = layer(x)
        assert y.shape == (batch, 3)
        y.sum().backward()
        with torch.no_grad():
            torch.testing.assert_close(layer(x), y.detach())
    assert len(layer._bridge._gradient_graphs) == 1
    assert len(layer._bridge._inference_graphs) == 1


@pytest.mark.engines("training-agent")  # its execution state; see test_engine_onnxruntime
def test_in_place_change_of_saved_output_raises():
    layer = OnnxModule(_mlp_model())
    x = torch.randn(4, 8)
    graph = layer._bridge.gradient_graph("train", [False, True, True, True], CPU)
    # Tanh's gradient reads its output; y = t @ w2 needs t, not y, so use a
    # graph ending in Tanh.
    tanh = OnnxModule(_tanh_model())
    y = tanh(torch.randn(4, 3, requires_grad=True))
    assert tanh._bridge.gradient_graph("train", [True, True], CPU).save_outputs == [0]
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    assert graph.save_outputs == []
    out = layer(x)
    out.mul_(2)  # not needed by backward: allowed, as in torch
    out.sum().backward()


def _tanh_model():
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Tanh", ["xw"], ["y"])],
        "tanh",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w")],
    )
    return make_model(graph)


def test_default_session_options_share_cores_with_torch(backend):
    """Workers never spin between runs (torch runs there); the onnxruntime
    engine's may spin within one run, stopped when it returns."""
    layer = OnnxModule(linear_model(3, 2), backend=backend)
    layer(torch.randn(2, 3)).sum().backward()
    with torch.no_grad():
        layer(torch.randn(2, 3))
    graphs = [*layer._bridge._gradient_graphs.values(), *layer._bridge._inference_graphs.values()]
    assert len(graphs) == 2
    for graph in graphs:
        within_runs = getattr(graph, "engine", None) == "onnxruntime"
        for session in graph.sessions:
            options = session.get_session_options()
            spin = options.get_session_config_entry("session.intra_op.allow_spinning")
            assert spin == ("1" if within_runs else "0"), (graph, spin)
            if within_runs:
                assert options.get_session_config_entry("session.force_spinning_stop") == "1"
            # The engine's graphs of small products run on one thread (test_threads.py).
            threads = 1 if within_runs else torch.get_num_threads()
            assert options.intra_op_num_threads == threads


def test_session_options_can_be_overridden():
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    layer = OnnxModule(linear_model(3, 2), session_options=options)
    layer(torch.randn(2, 3)).sum().backward()
    (graph,) = layer._bridge._gradient_graphs.values()
    for session in graph.sessions:
        used = session.get_session_options()
        assert used.intra_op_num_threads == 1
        assert used.get_session_config_entry("session.intra_op.allow_spinning") == "1"


# -- providers and CUDA streams, checked without a GPU ------------------------

# torch's current CUDA stream is substituted: a real one would be handed to a
# real CUDA provider, which these tests must not do.
no_cuda_provider = pytest.mark.skipif(
    "CUDAExecutionProvider" in onnxruntime.get_available_providers(),
    reason="substitutes CUDA streams; with a CUDA provider test_cuda runs real ones",
)


@pytest.fixture
def cuda_streams(monkeypatch):
    """torch's current CUDA stream made settable (``streams["now"]``, a handle per
    device index), and the providers every new onnxruntime session is asked for.

    onnxruntime claims a CUDA provider (``streams["available"]``) and a session
    reports the providers it was asked for as started (``streams["started"]``,
    when None): ortbridge's refusal of a session on the CPU for a CUDA device
    is tested by setting these; the sessions still run on the CPU.
    """
    streams = {"now": 0x1000, "asked": [], "started": None}
    streams["available"] = ["CUDAExecutionProvider", *onnxruntime.get_available_providers()]

    def current_stream(device=None):
        streams["asked"].append(device)
        return SimpleNamespace(cuda_stream=streams["now"] + (device.index or 0))

    class Recording(onnxruntime.InferenceSession):
        def __init__(self, *args, providers=None, **kwargs):
            streams.setdefault("providers", []).append(providers)
            self._asked = [p if isinstance(p, str) else p[0] for p in providers]
            super().__init__(*args, providers=providers, **kwargs)

        def get_providers(self):
            return streams["started"] or self._asked

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(onnxruntime, "InferenceSession", Recording)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: streams["available"])
    return streams


@no_cuda_provider
def test_current_stream_is_torchs_on_the_device(cuda_streams):
    assert current_stream(torch.device("cuda", 1)) == 0x1001
    assert cuda_streams["asked"] == [torch.device("cuda", 1)]
    assert current_stream(CPU) is None and len(cuda_streams["asked"]) == 1


@no_cuda_provider
def test_cuda_provider_options_name_the_device_and_stream(cuda_streams):
    cuda = {
        "device_id": "1",
        "user_compute_stream": str(0x1001),
        "use_tf32": "0",
        "cudnn_conv_algo_search": "HEURISTIC",
    }
    assert providers_for(torch.device("cuda", 1)) == [
        ("CUDAExecutionProvider", cuda),
        "CPUExecutionProvider",
    ]
    assert providers_for(torch.device("cuda"))[0][1]["device_id"] == "0"
    # A user's list keeps its order and its own options; the CUDA provider gets
    # the device and stream unless the user set them.
    mine = [
        ("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC", "device_id": "2"}),
        "CPUExecutionProvider",
    ]
    assert providers_for(torch.device("cuda", 1), mine) == [
        (
            "CUDAExecutionProvider",
            {**cuda, "cudnn_conv_algo_search": "HEURISTIC", "device_id": "2"},
        ),
        "CPUExecutionProvider",
    ]
    assert providers_for(torch.device("cuda", 1), ["CUDAExecutionProvider"]) == [
        ("CUDAExecutionProvider", cuda)
    ]
    assert providers_for(CPU) == ["CPUExecutionProvider"]
    assert providers_for(CPU, mine) == mine


@no_cuda_provider
def test_cuda_provider_computes_float32_as_torch_does(cuda_streams):
    """onnxruntime's CUDA provider takes TF32 only where torch's float32 products
    do; a user's own ``use_tf32`` wins."""
    device = torch.device("cuda", 1)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert providers_for(device)[0][1]["use_tf32"] == "0"
        torch.set_float32_matmul_precision("high")
        assert providers_for(device)[0][1]["use_tf32"] == "1"
        mine = [("CUDAExecutionProvider", {"use_tf32": "0"})]
        assert providers_for(device, mine)[0][1]["use_tf32"] == "0"
    finally:
        torch.set_float32_matmul_precision(previous)


@no_cuda_provider
def test_cuda_provider_picks_convolution_algorithms_as_torch_does(cuda_streams, monkeypatch):
    """cuDNN's algorithms timed at the first run only under torch's
    ``cudnn.benchmark``; its heuristic choice otherwise (torch's default)."""
    device = torch.device("cuda", 1)
    assert providers_for(device)[0][1]["cudnn_conv_algo_search"] == "HEURISTIC"
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert providers_for(device)[0][1]["cudnn_conv_algo_search"] == "EXHAUSTIVE"
    mine = [("CUDAExecutionProvider", {"cudnn_conv_algo_search": "DEFAULT"})]
    assert providers_for(device, mine)[0][1]["cudnn_conv_algo_search"] == "DEFAULT"


@no_cuda_provider
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_each_cuda_stream_gets_its_own_sessions(cuda_streams):
    """Sessions are built for torch's current stream and cached per stream: a second
    stream builds its own, the first one's are found again. (No GPU: onnxruntime
    falls back to the CPU after being asked for the CUDA provider.)"""
    bridge = OnnxModule(linear_model(3, 2))._bridge
    device = torch.device("cuda", 1)
    built = {}
    for handle in (0x1000, 0x2000, 0x1000):
        cuda_streams["now"], cuda_streams["providers"] = handle, []
        graphs = (
            bridge.gradient_graph("train", (False, True, True), device),
            bridge.inference_graph("eval", device),
        )
        if handle in built:
            assert all(g is b for g, b in zip(graphs, built[handle]))
            assert cuda_streams["providers"] == []  # nothing built again
            continue
        built[handle] = graphs
        asked = cuda_streams["providers"]
        assert len(asked) == sum(len(g.sessions) for g in graphs)
        for providers in asked:
            name, options = providers[0]
            assert name == "CUDAExecutionProvider"
            stream = str(handle + 1)
            assert options == {
                "device_id": "1",
                "user_compute_stream": stream,
                "use_tf32": "0",
                "cudnn_conv_algo_search": "HEURISTIC",
            }
    assert all(g is not h for g, h in zip(built[0x1000], built[0x2000]))


@no_cuda_provider
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
@pytest.mark.parametrize("cause", ["not-in-build", "libraries-not-loaded"])
def test_cuda_session_without_cuda_provider_names_the_package(cuda_streams, monkeypatch, cause):
    """A session for a CUDA device that onnxruntime would run on the CPU is refused,
    naming the onnxruntime found and the package for torch's CUDA version: one
    without the CUDA provider (the CPU package), or one whose provider did not
    start (onnxruntime-gpu beside a torch of another CUDA major version)."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    found, _ = _ort.build()
    if cause == "not-in-build":
        cuda_streams["available"] = ["CPUExecutionProvider"]
        problem = "has no CUDAExecutionProvider"
    else:
        cuda_streams["started"] = ["CPUExecutionProvider"]
        problem = (
            "could not start its CUDAExecutionProvider (its CUDA or cuDNN libraries did not load)"
        )
    with pytest.raises(MissingDependencyError) as info:
        _session(linear_model(3, 2), torch.device("cuda", 1), None, None)
    message = str(info.value)
    assert message.startswith(f"onnxruntime cannot run on cuda:1: {found}")
    assert f"{problem}; torch {torch.__version__} is built for CUDA 12.8: " in message
    assert "`pip install onnxruntime-gpu==1.26.0`" in message
    # The provider not in the build is refused before a session is made.
    assert len(cuda_streams.get("providers", [])) == (cause != "not-in-build")
    # A CPU session asks for no CUDA provider: nothing to refuse.
    cuda_streams["available"] = ["CPUExecutionProvider"]
    assert _session(linear_model(3, 2), CPU, None, None)[0] is not None


def test_providers_given_reach_every_session(cuda_streams):
    mine = [("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})]
    reference = OnnxModule(linear_model(3, 2))
    cuda_streams["providers"] = []
    layer = OnnxModule(linear_model(3, 2), providers=mine)
    x = torch.randn(4, 3)
    layer(x).sum().backward()
    with torch.no_grad():
        out = layer(x)
    graphs = [*layer._bridge._gradient_graphs.values(), *layer._bridge._inference_graphs.values()]
    asked = cuda_streams["providers"]  # the engine may build spare graphs: at least these
    assert len(asked) >= sum(len(g.sessions) for g in graphs) >= 2
    assert all(providers == mine for providers in asked)
    reference(x).sum().backward()
    torch.testing.assert_close(out, reference(x).detach(), rtol=0, atol=0)
    for (name, p), q in zip(layer.named_onnx_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_input_requiring_grad_that_no_gradient_reaches():
    # y = x * w + Cast(Shape(z)): z only contributes its shape.
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["xw"]),
            helper.make_node("Shape", ["z"], ["s"], start=1),
            helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["xw", "sf"], ["y"]),
        ],
        "shape_only",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])],
        [numpy_helper.from_array(np.full(1, 3.0, np.float32), "w")],
    )
    layer = OnnxModule(make_model(graph))
    x = torch.ones(2, 1, requires_grad=True)
    z = torch.ones(2, 1, requires_grad=True)
    y = layer(x, z)
    torch.testing.assert_close(y, torch.full((2, 1), 4.0))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 1), 3.0))
    assert z.grad is None  # as torch gives for an input that does not reach the loss
