"""Quantized files (onnxruntime's quantizer, QDQ form) fine-tune as torch's fake quantization.

The files are written by ``onnxruntime.quantization.quantize_static`` from
torch models exported here: per tensor and per channel, uint8 and int8
activations. The reference is :class:`_quantized.FakeQuantized`, torch's
``fake_quantize_*`` on the same file's weights.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from _quantized import FakeQuantized, quantized_file
from conftest import export_torchscript, scaled_atol

from ortbridge import OnnxModule
from ortbridge._runtime import _ort
from ortbridge.exceptions import NotDifferentiableError


class _Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.nn.functional.max_pool2d(torch.relu(self.c2(x)), 2)
        return self.fc(x.mean((2, 3)))


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.sigmoid(self.a(x)))


_SHAPES = {"cnn": (2, 3, 8, 8), "mlp": (3, 12)}
_FORMS = {
    "per-tensor-uint8": dict(per_channel=False, activations="QUInt8"),
    "per-channel-uint8": dict(per_channel=True, activations="QUInt8"),
    "per-channel-int8": dict(per_channel=True, activations="QInt8"),
    "qoperator-per-tensor-uint8": dict(fmt="QOperator", per_channel=False, activations="QUInt8"),
    "qoperator-per-channel-int8": dict(fmt="QOperator", per_channel=True, activations="QInt8"),
}


def _qdq_twin(form: str) -> str:
    """The QDQ form quantized alike (same calibration, same scales): the reference's file."""
    return form.replace("qoperator-", "")


def _batches(shape, n=4):
    return [
        {"x": np.random.default_rng(i).standard_normal(shape).astype(np.float32)} for i in range(n)
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model, form) -> path of the quantized file."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for kind, net in (("cnn", _Cnn), ("mlp", _Mlp)):
        torch.manual_seed(0)
        source = root / f"{kind}.onnx"
        x = torch.randn(*_SHAPES[kind])
        exported = export_torchscript(
            net().eval(), (x,), input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "n"}, "y": {0: "n"}},
        )  # fmt: skip
        onnx.save(exported, source)
        for form, options in _FORMS.items():
            target = str(root / f"{kind}-{form}.onnx")
            out[kind, form] = quantized_file(str(source), target, _batches(x.shape), **options)
    return out


_CASES = [(kind, form) for kind in _SHAPES for form in _FORMS]
_IDS = [f"{kind}-{form}" for kind, form in _CASES]


def _input(kind, seed=7):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(_SHAPES[kind]).astype(np.float32)


def _ops(model):
    return collections.Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_outputs_at_the_start_equal_the_quantized_file(files, case):
    path = files[case]
    x = _input(case[0])
    expected = onnxruntime.InferenceSession(path).run(None, {"x": x})[0]
    layer = OnnxModule(path, backend="onnxruntime")
    layer.eval()
    with torch.no_grad():
        np.testing.assert_array_equal(layer(torch.from_numpy(x)).numpy(), expected)
    layer.train()
    trained = layer(torch.from_numpy(x)).detach().numpy()
    # The gradient graph's forward computes the same quantized values; a
    # product summed in another order may move one output by a quantization step.
    step = onnx.numpy_helper.to_array(
        next(i for i in onnx.load(path).graph.initializer if i.name == "y_scale")
    )
    assert np.abs(trained - expected).max() <= float(step) * 1.001


@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_weights_and_biases_train_scales_stay_fixed(files, case):
    layer = OnnxModule(files[case])
    trained = {name for name, _ in layer.named_onnx_parameters()}
    quantized = {
        i.name
        for i in onnx.load(files[case]).graph.initializer
        if i.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT32)
        and i.name.endswith("_quantized")
    }
    assert trained == quantized and len(trained) == (6 if case[0] == "cnn" else 4)
    for name in layer._weight_names:
        if name.endswith("_scale"):
            assert not layer.onnx_weight(name).requires_grad, name


@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_gradients_equal_torch_fake_quantization(files, case):
    path = files[case]
    x = torch.from_numpy(_input(case[0]))
    layer = OnnxModule(path, backend="onnxruntime")
    reference = FakeQuantized(files[case[0], _qdq_twin(case[1])])
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = layer(x1), reference(x2)[0]
    torch.testing.assert_close(y1, y2, rtol=0, atol=scaled_atol(1e-5, y2))
    cotangent = torch.randn(y1.shape, generator=torch.Generator().manual_seed(3))
    (y1 * cotangent).sum().backward()
    (y2 * cotangent).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=scaled_atol(1e-5, x2.grad))
    for name, p in layer.named_onnx_parameters():
        want = reference.parameter(name).grad
        assert p.grad is not None and float(want.abs().max()) > 0, name
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=scaled_atol(1e-5, want))


@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_a_few_steps_lower_a_loss_and_the_file_comes_back_quantized(files, case, tmp_path):
    path = files[case]
    layer = OnnxModule(path)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((16, *_SHAPES[case[0]][1:])).astype(np.float32))
    with torch.no_grad():  # within the output's quantization range
        start = layer(x)
        target = start + 0.3 * start.std()
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(x), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    saved = tmp_path / "fine-tuned.onnx"
    layer.save(saved)
    before, after = onnx.load(path), onnx.load(saved)
    assert _ops(after) == _ops(before)
    old = {i.name: i for i in before.graph.initializer}
    changed = 0
    for init in after.graph.initializer:
        assert init.data_type == old[init.name].data_type, init.name
        a, b = (onnx.numpy_helper.to_array(t) for t in (init, old[init.name]))
        if init.name.endswith(("_scale", "_zero_point")):
            np.testing.assert_array_equal(a, b)
        changed += not np.array_equal(a, b)
    assert changed >= 2
    layer.eval()
    with torch.no_grad():
        mine = layer(x).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x.numpy()})[0]
    # The int32 biases are rounded to their step (input scale x weight scale)
    # on saving, as torch's conversion after quantization-aware training
    # rounds them: an output at a rounding boundary may move by one step.
    step = float(onnx.numpy_helper.to_array(old["y_scale"]))
    assert np.abs(mine - theirs).max() <= step * 1.001
    assert (mine == theirs).mean() >= 0.95


def test_saved_weights_are_the_trained_ones_rounded_to_their_integers(files):
    path = files["cnn", "per-channel-int8"]
    layer = OnnxModule(path)
    w = layer.onnx_weight("c1.weight_quantized")
    with torch.no_grad():
        w.add_(0.01 * torch.randn(w.shape))
        w[0, 0, 0, 0] = 1e6  # far outside the range: saturates at 127
    saved = {i.name: i for i in layer.to_onnx().graph.initializer}
    q = onnx.numpy_helper.to_array(saved["c1.weight_quantized"])
    scale = onnx.numpy_helper.to_array(saved["c1.weight_scale"]).reshape(-1, 1, 1, 1)
    assert q.dtype == np.int8 and q[0, 0, 0, 0] == 127
    expected = np.clip(np.rint(w.detach().numpy() / scale), -128, 127)
    np.testing.assert_array_equal(q, expected.astype(np.int8))


@pytest.mark.skipif(not _ort.has_training(), reason="the training agent needs the training build")
def test_training_agent_trains_one_scale_a_tensor_and_refuses_the_rest_by_name(files):
    x = torch.from_numpy(_input("mlp"))
    grads = {}
    for backend in ("training-agent", "onnxruntime"):
        layer = OnnxModule(files["mlp", "per-tensor-uint8"], backend=backend)
        layer(x).square().sum().backward()
        grads[backend] = {n: p.grad for n, p in layer.named_onnx_parameters()}
    for name, want in grads["onnxruntime"].items():
        got = grads["training-agent"][name]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=scaled_atol(1e-6, want))
    x = torch.from_numpy(_input("cnn"))
    words = r"op type (De)?QuantizeLinear\) with a (scale per axis|zero point another pair)"
    for form in ("per-channel-uint8", "per-tensor-uint8"):
        with pytest.raises(NotDifferentiableError, match=words):
            OnnxModule(files["cnn", form], backend="training-agent")(x)
        auto = OnnxModule(files["cnn", form])
        auto(x).sum().backward()
        assert auto.backend == "onnxruntime"


def test_inspect_says_what_is_quantized_and_how_it_trains(files):
    import io

    from ortbridge._cli._inspect import inspect_model

    out = io.StringIO()
    assert inspect_model(files["cnn", "per-channel-int8"], out=out)
    text = out.getvalue()
    assert "quantized: 6 integer weights train as float" in text, text
    assert "c1.weight_quantized: int8 per axis 0, trains under fake quantization" in text
    assert "c1.bias_quantized: int32 per axis 0, trains unquantized" in text
    assert "c1.weight_quantized: trainable float32 (8, 3, 3, 3)" in text


#: A published int8 file: pipecat's smart-turn v3.2 (a Whisper-style audio
#: encoder, onnxruntime's quantizer in QDQ form: int8 weights per channel,
#: uint8 activations, 78 activation pairs).
_SMART_TURN = (
    "pipecat-ai",
    "1.14.0",
    "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx",
)


def test_a_published_qdq_file_fine_tunes_and_comes_back_int8(tmp_path):
    from ortbridge.examples import published_file

    path = str(published_file(*_SMART_TURN))
    x = np.random.default_rng(0).standard_normal((1, 80, 800)).astype(np.float32)
    layer = OnnxModule(path)
    assert len(list(layer.named_onnx_parameters())) == 78
    # The file's QDQ arithmetic exactly; onnxruntime's extended optimisations
    # fuse the pairs into integer kernels, which round otherwise.
    basic = onnxruntime.SessionOptions()
    basic.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    exact = onnxruntime.InferenceSession(path, basic).run(None, {"input_features": x})[0]
    fused = onnxruntime.InferenceSession(path).run(None, {"input_features": x})[0]
    layer.eval()
    with torch.no_grad():
        start = layer(torch.from_numpy(x)).numpy()
    if _ort.has_training():  # 1.19.2's basic level rounds a few otherwise
        np.testing.assert_allclose(start, exact, atol=2e-3)
    else:
        np.testing.assert_array_equal(start, exact)
    np.testing.assert_allclose(start, fused, atol=5e-3)
    layer.train()
    y = layer(torch.from_numpy(x))
    # The gradient graph's forward sums some products in another order: an
    # activation at a rounding boundary moves by one step, here 1e-3 at the end.
    np.testing.assert_allclose(y.detach().numpy(), exact, atol=2e-3)
    y.sum().backward()
    grads = dict(layer.named_onnx_parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in grads.values())
    reached = sum(float(p.grad.abs().max()) > 0 for p in grads.values())
    assert reached == len(grads), f"{len(grads) - reached} weights got a zero gradient"
    # Fine-tune towards "not the end of a turn" on one clip.
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-4)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = layer(torch.from_numpy(x)).square().sum()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    saved = tmp_path / "smart-turn-fine-tuned.onnx"
    layer.save(saved)
    before, after = onnx.load(path), onnx.load(saved)
    assert _ops(after) == _ops(before)
    kinds = {i.name: i.data_type for i in before.graph.initializer}
    assert {i.name: i.data_type for i in after.graph.initializer} == kinds
    layer.eval()
    with torch.no_grad():
        mine = layer(torch.from_numpy(x)).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"input_features": x})[0]
    # The biases train unquantized and are rounded to their int32 step on
    # saving (about 1e-5 here), as torch's conversion after quantization-aware
    # training rounds them: in a network of 78 quantized activations that
    # moves some across a rounding boundary (here up to 0.03 on the output,
    # which moved 0.9 in training). The saved file read again is the file.
    assert np.abs(mine - start).max() > 0.1  # it moved
    np.testing.assert_allclose(mine, theirs, atol=0.05)
    reloaded = OnnxModule(str(saved)).eval()
    with torch.no_grad():
        again = reloaded(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(again, theirs, atol=5e-3)
