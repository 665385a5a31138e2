"""On a GPU: forward and gradients against torch's, DLPack without copies, torch's
streams, autocast, two layers, memory over many steps.

Each check that has a CPU form runs on ``cpu`` too (every machine) and on
``cuda`` where torch sees a GPU and onnxruntime has its CUDA provider; the
CUDA-only ones skip cleanly elsewhere. On a GPU both torch and onnxruntime
may use TF32 for float32 matrix products and convolutions, so gradients are
compared by their relative error over the whole tensor (``rel_error``), which
element-wise tolerances would mistake for cancellation noise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import export
from torch import nn

from ortbridge import OnnxModule
from ortbridge._runtime import _ort
from ortbridge._runtime._runs import from_ortvalues, to_ortvalues

HAS_CUDA = torch.cuda.is_available() and "CUDAExecutionProvider" in (
    _ort.runtime().get_available_providers()
)
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device and onnxruntime's CUDA provider"
)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
pytestmark = pytest.mark.usefixtures("backend")


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in float64 (0 where both are zero)."""
    ours, ref = ours.detach().double().cpu(), ref.detach().double().cpu()
    scale = ref.norm().item()
    return (ours - ref).norm().item() / scale if scale else ours.norm().item()


def tolerance(device: str) -> float:
    """float32 on CPU agrees to rounding; on CUDA torch's convolutions use TF32
    (10-bit mantissas) by default, and its products where the user allows it."""
    return 1e-5 if device == "cpu" else 5e-3


class _Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 5),
        )

    def forward(self, x):
        return self.net(x)


class _Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out)


MODELS = {
    "cnn": (_Cnn, (4, 3, 16, 16)),
    "transformer-layer": (
        lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        (4, 10, 32),
    ),
    "lstm": (_Lstm, (4, 7, 6)),
}


def _errors(ref_model, layer, x) -> dict:
    """Relative errors of the outputs, the input's gradient and each weight's."""
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = ref_model(xr), layer(xo)
    # Not sum(out**2): after a LayerNorm that is nearly constant, its gradient rounding noise.
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    ((ref - target) ** 2).sum().backward()
    ((out - target) ** 2).sum().backward()
    errors = {"output": rel_error(out, ref), "input grad": rel_error(xo.grad, xr.grad)}
    params = dict(ref_model.named_parameters())
    for name, p in layer.named_onnx_parameters():
        errors[f"grad {name}"] = rel_error(p.grad, params[name].grad)
    assert len(errors) == 2 + len(params)
    return errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_and_gradients_match_torch_on_the_device(name, device):
    make, shape = MODELS[name]
    # cuDNN's LSTM has no backward in eval mode; this one has no dropout to turn off.
    ref = make().train(name == "lstm")
    x = torch.randn(*shape)
    layer = OnnxModule(export(ref, (x,), dynamic_batch=False)).eval()
    ref, layer, x = ref.to(device), layer.to(device), x.to(device)
    assert all(p.device.type == device for p in layer.parameters())
    errors = _errors(ref, layer, x)
    print(f"{name} on {device}: worst relative error {max(errors.values()):.2e}")
    assert max(errors.values()) < tolerance(device), errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["cnn", "transformer-layer"])
def test_float16_gradients_are_as_close_to_float32_as_torch_s_own(name, device, backend):
    """A model exported in float16 trains in float16: its outputs and gradients
    are as far from the float32 model's as torch's own float16 run is (at most
    twice, or 1e-3), the outputs float16 on every engine. The training agent
    refuses the transformer layer's float16 graph by name (its
    LayerNormalization function does not type-check)."""
    from ortbridge.exceptions import NotDifferentiableError

    make, shape = MODELS[name]
    torch.manual_seed(0)
    ref = make().eval().to(device)
    x = torch.randn(*shape).to(device)
    half = copy.deepcopy(ref).half()
    # Exported from a copy on the CPU: Module.cpu() moves the module itself.
    proto = export(copy.deepcopy(half).cpu(), (x.half().cpu(),), dynamic_batch=False)
    if backend == "training-agent" and name == "transformer-layer":
        with pytest.raises(NotDifferentiableError, match="training-agent engine cannot train"):
            OnnxModule(proto)(x.half().cpu())
        return
    layer = OnnxModule(proto).eval().to(device)
    target = torch.randn(*ref(x).shape, generator=torch.Generator().manual_seed(1)).to(device)

    def run(model, dtype):
        xi = x.detach().to(dtype).clone().requires_grad_()
        out = model(xi)
        ((out.float() - target) ** 2).sum().backward()
        named = layer.named_onnx_parameters() if model is layer else model.named_parameters()
        return {"output": out, "input grad": xi.grad, **{n: p.grad for n, p in named}}

    want = run(ref, torch.float32)
    theirs, ours = run(half, torch.float16), run(layer, torch.float16)
    assert set(ours) == set(want)
    # float16 as the file declares (the training agent's yielded output was
    # float32 where its builder cast around a kernel the CPU lacks)
    assert ours["output"].dtype == torch.float16
    for key, value in want.items():
        bound = max(2 * rel_error(theirs[key], value), 1e-3)
        assert rel_error(ours[key], value) <= bound, (key, rel_error(ours[key], value), bound)


@needs_cuda
def test_published_model_on_the_gpu_matches_the_cpu():
    """PP-OCRv6's text recogniser (paddle2onnx; convolutions and attention, no
    torch source): the GPU's forward and weight gradients against the CPU
    engine's (itself checked against finite differences by the published-model
    tests)."""
    from _published import CORPUS, fetch

    model = next(m for m in CORPUS if m.id == "PP-OCRv6_rec_small")
    cpu = OnnxModule(str(fetch(model))).eval()
    gpu = copy.deepcopy(cpu).cuda()
    (x,) = model.feeds(cpu.input_names)
    outs = {}
    for layer, dev in ((cpu, "cpu"), (gpu, "cuda")):
        out = layer(x.to(dev))
        (out**2).sum().backward()
        outs[dev] = out
    assert rel_error(outs["cuda"], outs["cpu"]) < 1e-4
    worst = max(rel_error(q.grad, p.grad) for p, q in zip(cpu.parameters(), gpu.parameters()))
    print(f"PP-OCRv6 rec, GPU against CPU: worst weight-gradient relative error {worst:.2e}")
    assert worst < 1e-3


@needs_cuda
def test_cuda_forward_backward_matches_cpu(mlp_proto):
    """The same module's copy on the GPU gives the CPU's outputs and gradients
    (at 1e-4: onnxruntime's TF32 default failed this, ``_runtime._sessions.allow_tf32``)."""
    cpu = OnnxModule(mlp_proto)
    gpu = copy.deepcopy(cpu).cuda()
    assert all(p.is_cuda for p in gpu.parameters())
    x = torch.randn(8, 6)
    out_cpu, out_gpu = cpu(x), gpu(x.cuda())
    assert out_gpu.is_cuda
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-5)
    (out_cpu**2).sum().backward()
    (out_gpu**2).sum().backward()
    for p, q in zip(cpu.parameters(), gpu.parameters()):
        assert q.grad.is_cuda
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-5)


@needs_cuda
def test_cuda_non_default_stream(mlp_proto):
    cpu = OnnxModule(mlp_proto)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(64, 6)
    out_cpu = cpu(x)
    (out_cpu**2).sum().backward()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        xg = x.cuda(non_blocking=True)
        out_gpu = gpu(xg)
        (out_gpu**2).sum().backward()
        grads = [p.grad.clone() for p in gpu.parameters()]
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-5)
    for p, g in zip(cpu.parameters(), grads):
        torch.testing.assert_close(g.cpu(), p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack_hands_memory_over_without_copies(device):
    x = torch.randn(5, 7, device=device)
    vector, held = to_ortvalues([x])
    assert vector[0].data_ptr() == x.data_ptr()
    (back,) = from_ortvalues(vector)
    assert back.data_ptr() == x.data_ptr() and back.device == x.device


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("device", DEVICES)
def test_two_layers_on_one_device_train_as_torch(device, compiled):
    """Two ONNX layers with a torch layer between them, five SGD steps: the
    weights follow torch's model's, eager and under torch.compile(fullgraph=True)."""
    torch.manual_seed(0)
    first, second = nn.Linear(6, 16), nn.Linear(16, 3)
    ref = nn.Sequential(first, nn.Tanh(), second)
    x = torch.randn(8, 6)
    ours = nn.Sequential(
        OnnxModule(export(first, (x,))),
        nn.Tanh(),
        OnnxModule(export(second, (torch.tanh(first(x)),))),
    )
    ref, ours, x = ref.to(device), ours.to(device), x.to(device)
    if compiled:
        torch._dynamo.reset()
    for net in (ref, ours):
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        run = torch.compile(net, fullgraph=True) if compiled and net is ours else net
        for _ in range(5):
            opt.zero_grad()
            (run(x) ** 2).mean().backward()
            opt.step()
    for (_, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert q.device.type == device
        assert rel_error(q, p) < tolerance(device)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_feeds_the_graph_its_own_dtype(device):
    """Under ``torch.autocast`` a float32 graph takes the half-precision output of
    the torch layer before it; its gradient flows back in that precision."""
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    torch.manual_seed(0)
    head, body = nn.Linear(6, 16), nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(8, 6)
    layer = OnnxModule(export(body, (head(x),)))
    head, body, layer, x = head.to(device), body.to(device), layer.to(device), x.to(device)
    with torch.autocast(device, dtype=dtype):
        hidden = head(x)
        assert hidden.dtype == dtype
        out = layer(hidden)
    assert out.dtype == torch.float32
    out.square().sum().backward()
    grad = head.weight.grad.clone()
    head.weight.grad = None
    body(head(x)).square().sum().backward()  # float32 throughout
    assert rel_error(grad, head.weight.grad) < 3e-2


@needs_cuda
def test_a_non_default_stream_orders_the_graph_after_torchs_work():
    """onnxruntime's kernels queue on torch's current stream: an input written by
    a kernel still running on that stream is read after it, with no
    synchronisation in between (a session on another stream would read zeros)."""
    ref = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    layer = OnnxModule(export(ref, (torch.randn(4, 64),))).cuda()
    ref.cuda()
    source = torch.randn(256, 64, device="cuda")
    expected = ref(source)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x = torch.zeros(256, 64, device="cuda", requires_grad=True)
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the copy lands
        with torch.no_grad():
            x.copy_(source)
        out = layer(x)
        out.square().sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert rel_error(out, expected) < tolerance("cuda")
    xr = source.clone().requires_grad_()
    ref(xr).square().sum().backward()
    assert rel_error(x.grad, xr.grad) < tolerance("cuda")


@needs_cuda
def test_memory_is_flat_over_500_steps():
    """torch's allocator (outputs and gradients handed over by DLPack) and the
    device's free memory (onnxruntime's arena too) do not grow with steps."""
    ref = _Cnn().eval()
    x = torch.randn(16, 3, 16, 16)
    layer = OnnxModule(export(ref, (x,), dynamic_batch=False)).cuda().eval()
    x = x.cuda()
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)

    def steps(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=False)
            layer(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()

    steps(50)  # arenas and caches settle
    torch.cuda.reset_peak_memory_stats()
    base_alloc, base_free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    steps(100)
    peak_100 = torch.cuda.max_memory_allocated()
    steps(400)
    assert torch.cuda.memory_allocated() == base_alloc
    assert torch.cuda.max_memory_allocated() == peak_100
    grown = base_free - torch.cuda.mem_get_info()[0]
    print(f"500 steps: torch's peak {peak_100} bytes, device memory grown {grown} bytes")
    assert grown <= 4 << 20
