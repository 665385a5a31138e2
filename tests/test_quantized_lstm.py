"""Dynamically quantized LSTMs (com.microsoft ``DynamicQuantizeLSTM``) fine-tune and come back int8.

onnxruntime's ``quantize_dynamic`` writes a torch LSTM as ``DynamicQuantizeLSTM``:
int8 weights, transposed to ``(directions, in, 4 * hidden)``, scaled per
direction or (``per_channel``) per gate channel. ortbridge trains each weight
as a float under fake quantization and differentiates the node as ONNX's
LSTM of the dequantized weights (the kernel quantizes each step's input and
state on their own range: straight through). The reference is torch's
``nn.LSTM`` holding the dequantized weights: what torch's dynamic-quantization
training computes (weights fake-quantized, activations float).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from conftest import assert_adam_lowers, assert_eval_runs_as_file, export_torchscript, scaled_atol

from ortbridge import OnnxModule
from ortbridge.exceptions import NotDifferentiableError

_HIDDEN = 5
#: onnx's gate blocks (i, o, f, c) in torch's order (i, f, g, o), and back.
_TORCH_FROM_ONNX = [0, 2, 3, 1]
_ONNX_FROM_TORCH = [0, 3, 1, 2]


class _Recurrent(torch.nn.Module):
    """A Linear (left float), then an LSTM whose states are inputs."""

    def __init__(self, bidirectional: bool):
        super().__init__()
        self.proj = torch.nn.Linear(4, 6)
        self.lstm = torch.nn.LSTM(6, _HIDDEN, bidirectional=bidirectional)

    def forward(self, x, h0, c0):
        y, (h, c) = self.lstm(torch.tanh(self.proj(x)), (h0, c0))
        return y, h, c


def _inputs(directions: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((7, 2, 4)).astype(np.float32),
        "h0": 0.5 * rng.standard_normal((directions, 2, _HIDDEN)).astype(np.float32),
        "c0": 0.5 * rng.standard_normal((directions, 2, _HIDDEN)).astype(np.float32),
    }


_CASES = {
    "forward": (False, False),
    "forward-per-channel": (False, True),
    "bidirectional": (True, False),
    "bidirectional-per-channel": (True, True),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """case -> (the quantized file, the torch model it came from)."""
    from onnxruntime.quantization import quantize_dynamic

    root = tmp_path_factory.mktemp("quantized_lstm")
    out = {}
    for case, (bidirectional, per_channel) in _CASES.items():
        torch.manual_seed(0)
        net = _Recurrent(bidirectional).eval()
        feeds = _inputs(2 if bidirectional else 1)
        exported = export_torchscript(
            net, tuple(torch.from_numpy(v) for v in feeds.values()), constant_folding=True,
            input_names=list(feeds), output_names=["y", "h", "c"],
            dynamic_axes={"x": {0: "t", 1: "n"}, "h0": {1: "n"}, "c0": {1: "n"}},
        )  # fmt: skip
        source = root / f"{case}-float.onnx"
        onnx.save(exported, source)
        target = root / f"{case}.onnx"
        quantize_dynamic(
            str(source), str(target), per_channel=per_channel, op_types_to_quantize=["LSTM"]
        )
        out[case] = (str(target), net)
    return out


def _lstm_node(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == "DynamicQuantizeLSTM")


def _dequantized(model: onnx.ModelProto, slot: int) -> tuple[str, np.ndarray]:
    """The int8 weight at ``slot`` and its float value, ``(directions, in, 4H)``."""
    node = _lstm_node(model)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    q, scale, zero = (inits[node.input[i]] for i in (slot, 6 + 2 * slot, 7 + 2 * slot))
    shape = (q.shape[0], 1, -1)  # per direction (d,) or per gate channel (d, 4H)
    scale, zero = (
        np.broadcast_to(v.reshape(q.shape[0], -1), (q.shape[0], q.shape[2])) for v in (scale, zero)
    )
    value = (q.astype(np.int64) - zero.reshape(shape)).astype(np.float32) * scale.reshape(shape)
    return node.input[slot], value.astype(np.float32)


def _to_torch(value: np.ndarray, direction: int) -> torch.Tensor:
    """A ``(directions, in, 4H)`` weight as torch's ``(4H, in)`` of one direction."""
    gates = value[direction].T.reshape(4, _HIDDEN, -1)[_TORCH_FROM_ONNX]
    return torch.from_numpy(np.ascontiguousarray(gates.reshape(4 * _HIDDEN, -1)))


def _from_torch(grad: torch.Tensor) -> np.ndarray:
    """torch's ``(4H, in)`` gradient in the file's ``(in, 4H)`` layout."""
    gates = grad.numpy().reshape(4, _HIDDEN, -1)[_ONNX_FROM_TORCH]
    return gates.reshape(4 * _HIDDEN, -1).T


def _reference(net: _Recurrent, model: onnx.ModelProto) -> _Recurrent:
    """The torch model holding the file's dequantized LSTM weights."""
    twin = _Recurrent(net.lstm.bidirectional)
    twin.load_state_dict(net.state_dict())
    with torch.no_grad():
        for slot, kind in ((1, "ih"), (2, "hh")):
            _, value = _dequantized(model, slot)
            for d, suffix in enumerate(("", "_reverse")[: value.shape[0]]):
                getattr(twin.lstm, f"weight_{kind}_l0{suffix}").copy_(_to_torch(value, d))
    return twin


_TRAINED = list(_CASES)


@pytest.mark.parametrize("case", _TRAINED)
def test_outputs_equal_the_file_and_gradients_equal_torch(files, case):
    path, net = files[case]
    model = onnx.load(path)
    feeds = _inputs(2 if net.lstm.bidirectional else 1)
    layer = OnnxModule(path)
    trained = dict(layer.named_onnx_parameters())
    weights = [_lstm_node(model).input[slot] for slot in (1, 2)]
    assert set(weights) <= set(trained), sorted(trained)
    args = [torch.from_numpy(feeds[k]) for k in layer.input_names]
    expected = onnxruntime.InferenceSession(path).run(None, feeds)
    layer.eval()
    with torch.no_grad():
        start = layer(*args)
    for mine, theirs in zip(start, expected):  # the file's kernel, its integers unchanged
        np.testing.assert_allclose(mine.numpy(), theirs, rtol=1e-6, atol=1e-6)
    layer.train()
    twin = _reference(net, model)
    x1, x2 = (torch.from_numpy(feeds["x"]).requires_grad_() for _ in range(2))
    ours = layer(x1, *args[1:])
    theirs = twin(x2, *args[1:])
    cotangents = [
        torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
        for i, t in enumerate(theirs)
    ]
    for mine, want in zip(ours, theirs):  # train mode: the float LSTM of the weights
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=scaled_atol(1e-5, want))
    sum((t * c).sum() for t, c in zip(ours, cotangents)).backward()
    sum((t * c).sum() for t, c in zip(theirs, cotangents)).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=scaled_atol(1e-5, x2.grad))
    product = next(n for n in model.graph.node if n.op_type == "MatMul")  # x @ proj.weight.T
    want = twin.proj.weight.grad.T
    got = layer.onnx_weight(product.input[1]).grad
    torch.testing.assert_close(got, want, rtol=1e-4, atol=scaled_atol(1e-5, want))
    for slot, kind in ((1, "ih"), (2, "hh")):
        name, value = _dequantized(model, slot)
        got = trained[name].grad.numpy()
        for d, suffix in enumerate(("", "_reverse")[: value.shape[0]]):
            grad = getattr(twin.lstm, f"weight_{kind}_l0{suffix}").grad
            want = _from_torch(grad)
            np.testing.assert_allclose(got[d], want, rtol=1e-4, atol=scaled_atol(1e-5, want))
    assert trained[weights[0]].grad.abs().max() > 0


@pytest.mark.parametrize("case", _TRAINED)
def test_a_few_steps_lower_a_loss_and_the_file_comes_back_int8(files, case, tmp_path):
    path, net = files[case]
    original = onnx.load(path)
    feeds = _inputs(2 if net.lstm.bidirectional else 1)
    layer = OnnxModule(path)
    args = [torch.from_numpy(feeds[k]) for k in layer.input_names]

    def loss():
        return (layer(*args)[0] - 0.3).pow(2).mean()

    assert_adam_lowers(layer.parameters(), loss, steps=6, lr=0.02)
    saved = tmp_path / "fine-tuned.onnx"
    layer.save(saved)
    after = onnx.load(saved)
    ops = collections.Counter(n.op_type for n in after.graph.node)
    assert ops == collections.Counter(n.op_type for n in original.graph.node)
    kinds = {i.name: i.data_type for i in original.graph.initializer}
    assert {i.name: i.data_type for i in after.graph.initializer} == kinds
    before = {i.name: onnx.numpy_helper.to_array(i) for i in original.graph.initializer}
    node = _lstm_node(original)
    for slot in (1, 2, 8, 10):  # new integers; the scales as they were
        value = onnx.numpy_helper.to_array(
            next(i for i in after.graph.initializer if i.name == node.input[slot])
        )
        assert np.array_equal(value, before[node.input[slot]]) == (slot > 2), slot
    assert_eval_runs_as_file(layer, args, saved, feeds)


@pytest.mark.parametrize(
    "case, per", [("forward-per-channel", "axis 2"), ("bidirectional-per-channel", "axes 0 and 2")]
)
def test_inspect_says_how_the_lstm_trains(files, capsys, case, per):
    from ortbridge.__main__ import main

    path, _ = files[case]
    main(["inspect", path])
    text = capsys.readouterr().out
    weights = [_lstm_node(onnx.load(path)).input[s] for s in (1, 2)]
    for name in weights:
        line = next(x for x in text.splitlines() if x.strip().startswith(f"{name}: int8"))
        assert f"per {per}," in line, line
        assert "as ONNX's LSTM of the dequantized weights" in line, line


def test_the_float_model_goes_out_as_onnx_lstm(files, tmp_path):
    path, net = files["forward-per-channel"]
    feeds = _inputs(1)
    layer = OnnxModule(path)
    args = [torch.from_numpy(feeds[k]) for k in layer.input_names]
    layer.train()
    mine = [t.detach() for t in layer(*args)]  # the gradient graph's float LSTM
    saved = tmp_path / "float.onnx"
    layer.save(saved, quantized=False)
    ops = {n.op_type for n in onnx.load(saved).graph.node}
    assert "LSTM" in ops and "DynamicQuantizeLSTM" not in ops and "QuantizeLinear" not in ops
    theirs = onnxruntime.InferenceSession(str(saved)).run(None, feeds)
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=scaled_atol(1e-6, b))


def test_a_weight_whose_scale_is_computed_is_frozen_by_name(files, tmp_path):
    """A scale the graph computes (not an initializer) gives no fake
    quantization to train under: the weights stay the file's integers, and
    the node is named (what trains before it is frozen with it)."""
    path, _ = files["bidirectional-per-channel"]
    model = onnx.load(path)
    node = _lstm_node(model)
    scale = node.input[8]
    node.input[8] = f"{scale}_computed"
    model.graph.node.insert(0, onnx.helper.make_node("Identity", [scale], [node.input[8]]))
    path = str(tmp_path / "computed-scale.onnx")
    onnx.save(model, path)
    feeds = _inputs(2)
    with pytest.warns(UserWarning, match=r"DynamicQuantizeLSTM\) has no gradient here"):
        layer = OnnxModule(path)
    assert not dict(layer.named_onnx_parameters())
    assert_eval_runs_as_file(
        layer, [torch.from_numpy(feeds[k]) for k in layer.input_names], path, feeds
    )
    # Asked for by name, a weight before it is refused naming the node.
    with pytest.raises(NotDifferentiableError, match="DynamicQuantizeLSTM"):
        OnnxModule(path, trainable=["proj.bias"])


def _zoo_lstm():
    """The benchmarks' LSTM model: two bidirectional layers and a linear head."""
    from conftest import benchmark_models

    return benchmark_models().LSTMRegressor


def _weight_value(model: onnx.ModelProto, node: onnx.NodeProto, slot: int) -> np.ndarray:
    """A DynamicQuantizeLSTM's int8 weight at ``slot``, dequantized: (dirs, in, 4H)."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    q, scale, zero = (inits[node.input[i]] for i in (slot, 6 + 2 * slot, 7 + 2 * slot))
    shape = (q.shape[0], 1, -1)
    scale, zero = (
        np.broadcast_to(v.reshape(q.shape[0], -1), (q.shape[0], q.shape[2])) for v in (scale, zero)
    )
    value = (q.astype(np.int64) - zero.reshape(shape)).astype(np.float32) * scale.reshape(shape)
    return value.astype(np.float32)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-direction", "per-channel"])
def test_the_zoo_s_two_layer_bidirectional_lstm_quantized_dynamically_trains_as_torch(
    per_channel, tmp_path
):
    """quantize_dynamic on the benchmarks' LSTM model (two bidirectional
    layers of 64, batch first, a Linear head; TorchScript's export): eval
    equals the file, and in train mode the outputs and the gradients of the
    input, the head and all eight LSTM matrices equal torch's LSTMRegressor
    holding the dequantized weights."""
    from onnxruntime.quantization import quantize_dynamic

    torch.manual_seed(0)
    net = _zoo_lstm()().eval()
    x = torch.randn(2, 20, 32)
    exported = export_torchscript(
        net, (x,), constant_folding=True, input_names=["x"], output_names=["y"],
        dynamic_axes={"x": {0: "n"}},
    )  # fmt: skip
    source, target = tmp_path / "lstm.onnx", tmp_path / "lstm-int8.onnx"
    onnx.save(exported, source)
    quantize_dynamic(
        str(source), str(target), per_channel=per_channel, op_types_to_quantize=["LSTM"]
    )
    model = onnx.load(target)
    nodes = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLSTM"]
    assert len(nodes) == 2
    layer = OnnxModule(str(target))
    trained = dict(layer.named_onnx_parameters())
    assert {n.input[s] for n in nodes for s in (1, 2)} <= set(trained)
    expected = onnxruntime.InferenceSession(str(target)).run(None, {"x": x.numpy()})[0]
    layer.eval()
    with torch.no_grad():
        start = layer(x).numpy()
    np.testing.assert_allclose(start, expected, rtol=1e-6, atol=1e-6)
    layer.train()
    twin = _zoo_lstm()()
    twin.load_state_dict(net.state_dict())
    hidden = twin.lstm.hidden_size
    with torch.no_grad():
        for k, node in enumerate(nodes):
            for slot, kind in ((1, "ih"), (2, "hh")):
                value = _weight_value(model, node, slot)
                for d, suffix in enumerate(("", "_reverse")):
                    gates = value[d].T.reshape(4, hidden, -1)[_TORCH_FROM_ONNX]
                    weight = torch.from_numpy(np.ascontiguousarray(gates.reshape(4 * hidden, -1)))
                    getattr(twin.lstm, f"weight_{kind}_l{k}{suffix}").copy_(weight)
    x1, x2 = (x.clone().requires_grad_() for _ in range(2))
    ours, theirs = layer(x1), twin(x2)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=scaled_atol(1e-5, theirs))
    cotangent = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(1))
    (ours * cotangent).sum().backward()
    (theirs * cotangent).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=scaled_atol(1e-5, x2.grad))
    want = twin.head.bias.grad
    torch.testing.assert_close(
        trained["head.bias"].grad, want, rtol=1e-4, atol=scaled_atol(1e-5, want)
    )
    for k, node in enumerate(nodes):
        for slot, kind in ((1, "ih"), (2, "hh")):
            got = trained[node.input[slot]].grad.numpy()
            for d, suffix in enumerate(("", "_reverse")):
                grad = getattr(twin.lstm, f"weight_{kind}_l{k}{suffix}").grad.numpy()
                gates = grad.reshape(4, hidden, -1)[_ONNX_FROM_TORCH]
                want = gates.reshape(4 * hidden, -1).T
                np.testing.assert_allclose(got[d], want, rtol=1e-4, atol=scaled_atol(1e-5, want))
