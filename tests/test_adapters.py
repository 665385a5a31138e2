"""Parametrizations on ONNX weights (LoRA, weight normalisation), against torch.

The same parametrization, with the same values, goes on the exported
module's weights and on the torch model's; outputs and the gradients of the
parametrization's own parameters must agree, on each engine. ``to_onnx()``
and ``save()`` write the merged weights, ``state_dict`` round-trips, the
optimizer holds the adapters only.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import export
from torch import nn
from torch.nn.utils import parametrize

import ortbridge
from ortbridge.adapters import LowRank

pytestmark = pytest.mark.usefixtures("backend")


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(x))


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


_MODELS = {
    "transformer": (_Encoder, lambda: torch.randn(2, 5, 8)),
    "cnn": (_ConvNet, lambda: torch.randn(2, 3, 6, 6)),
}


def _pair(name):
    factory, make_input = _MODELS[name]
    torch.manual_seed(0)
    model = factory().eval()
    x = make_input()
    layer = ortbridge.OnnxModule(export(model, (x,))).eval()
    return model, layer, x


def _same_update_on_torch(model, layer):
    """The adapters of ``layer`` copied onto the torch parameters of the same names,
    with B moved off zero so that A gets a gradient too."""
    params = dict(model.named_parameters())
    pairs = []
    for name, path in layer._onnx_names.items():
        owner = layer._owner(path)
        if not parametrize.is_parametrized(owner, path[-1]):
            continue
        ours = getattr(owner.parametrizations, path[-1])[0]
        with torch.no_grad():
            ours.B.normal_(0, 0.1)
        theirs = copy.deepcopy(ours)
        module_name, _, attr = name.rpartition(".")
        target = model.get_submodule(module_name)
        assert params[name] is getattr(target, attr)
        parametrize.register_parametrization(target, attr, theirs)
        pairs.append((name, ours, theirs))
    return pairs


@pytest.mark.parametrize("name", list(_MODELS))
def test_lora_on_onnx_weights_matches_the_same_lora_in_torch(name):
    model, layer, x = _pair(name)
    adapters = ortbridge.lora(layer, rank=2, alpha=4)
    assert all(not p.requires_grad for _, p in layer.named_onnx_parameters())
    assert {id(p) for p in layer.parameters() if p.requires_grad} == {id(p) for p in adapters}
    pairs = _same_update_on_torch(model, layer)
    expected = {"transformer": 5, "cnn": 2}[name]  # q/k/v, out, 2 MLP, head; conv, fc
    assert len(pairs) == expected and len(adapters) == 2 * expected
    out, ref = layer(x), model(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    for weight, ours, theirs in pairs:
        for part in ("A", "B"):
            torch.testing.assert_close(
                getattr(ours, part).grad,
                getattr(theirs, part).grad,
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m, w=weight, p=part: f"{p} of {w}: {m}",
            )


def test_lora_trains_only_the_adapters_and_exports_the_merged_weights(tmp_path):
    model, layer, x = _pair("transformer")
    before = {n: p.detach().clone() for n, p in layer.named_onnx_parameters()}
    adapters = ortbridge.lora(layer, rank=2, names="*linear*")
    assert len(adapters) == 4  # linear1, linear2
    optimizer = torch.optim.Adam(adapters, lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        layer(x).square().mean().backward()
        optimizer.step()
    assert len(optimizer.state) == len(adapters)
    for name, original in before.items():  # the ONNX weights themselves stay
        path = layer._onnx_names[name]
        owner = layer._owner(path)
        held = (
            getattr(owner.parametrizations, path[-1]).original
            if parametrize.is_parametrized(owner, path[-1])
            else getattr(owner, path[-1])
        )
        torch.testing.assert_close(held, original, rtol=0, atol=0)
    with torch.no_grad():
        out = layer(x).numpy()
    merged = layer.to_onnx()
    session = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {layer.input_names[0]: x.numpy()})[0], out,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    layer.save(tmp_path / "merged.onnx")
    again = ortbridge.OnnxModule(tmp_path / "merged.onnx").eval()
    with torch.no_grad():
        np.testing.assert_allclose(again(x).numpy(), out, rtol=1e-5, atol=1e-6)
    # state_dict holds the originals and the adapters, as torch's does.
    state = layer.state_dict()
    assert any(k.endswith("parametrizations.weight.original") for k in state)
    fresh = _pair("transformer")[1]
    ortbridge.lora(fresh, rank=2, names="*linear*")
    fresh.load_state_dict(state)
    with torch.no_grad():
        np.testing.assert_allclose(fresh(x).numpy(), out, rtol=1e-5, atol=1e-6)


def test_weight_norm_parametrization_matches_torch():
    """torch's own parametrizations apply too: weight normalisation of a Conv."""
    model, layer, x = _pair("cnn")
    nn.utils.parametrizations.weight_norm(layer.get_submodule("conv"), "weight")
    nn.utils.parametrizations.weight_norm(model.conv, "weight")
    out, ref = layer(x), model(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    ours = layer.get_submodule("conv").parametrizations.weight
    theirs = model.conv.parametrizations.weight
    torch.testing.assert_close(ours.original0.grad, theirs.original0.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.original1.grad, theirs.original1.grad, rtol=1e-4, atol=1e-5)


def test_lora_names_what_it_cannot_adapt():
    _, layer, _ = _pair("cnn")
    with pytest.raises(ValueError, match="no product weight matched"):
        ortbridge.lora(layer, names="*nothing*")
    with pytest.raises(TypeError, match="holds none"):
        ortbridge.lora(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="rank >= 1"):
        LowRank((3, 3), rank=0)


def _lora_trained(name, rank, alpha, seed):
    _, layer, x = _pair(name)
    before = layer(x).detach()
    torch.manual_seed(seed)
    adapters = ortbridge.lora(layer, rank=rank, alpha=alpha)
    optimizer = torch.optim.SGD(adapters, lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        layer(x).square().mean().backward()
        optimizer.step()
    return layer, x, before


def _run(path, x, adapter=None):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    options = ort.RunOptions()
    if adapter is not None:
        loaded = ort.LoraAdapter()
        loaded.Load(str(adapter))
        options.add_active_adapter(loaded)
    return session.run(None, {session.get_inputs()[0].name: x.numpy()}, options)[0]


@pytest.mark.parametrize("name", list(_MODELS))
def test_adapters_in_onnxruntime_s_format_beside_a_base_file(tmp_path, name):
    """One base file; without an adapter it is the model before fine-tuning,
    with one (of any rank and alpha) it is that fine-tuned model."""
    from ortbridge.adapters import save_adapters

    if not hasattr(ort, "AdapterFormat"):  # the training build (1.19.2)
        layer, _, _ = _lora_trained(name, 2, 4, 1)
        with pytest.raises(ortbridge.exceptions.MissingDependencyError, match="onnxruntime 1.20"):
            save_adapters(layer, tmp_path / "base.onnx", tmp_path / "a.onnx_adapter")
        assert not list(tmp_path.iterdir())  # nothing half-written
        return
    layer, x, before = _lora_trained(name, 2, 4, 1)
    other, _, _ = _lora_trained(name, 3, 1, 2)  # another task's adapter: rank 3
    save_adapters(layer, tmp_path / "base.onnx", tmp_path / "a.onnx_adapter")
    save_adapters(other, tmp_path / "base_b.onnx", tmp_path / "b.onnx_adapter")
    with torch.no_grad():
        want_a, want_b = layer(x).numpy(), other(x).numpy()
    assert np.abs(want_a - before.numpy()).max() > 1e-3  # the adapters changed something
    scale = float(np.abs(want_a).max())
    np.testing.assert_allclose(_run(tmp_path / "base.onnx", x), before.numpy(), rtol=1e-5,
                               atol=1e-5 * scale)  # fmt: skip
    for adapter, want in (("a.onnx_adapter", want_a), ("b.onnx_adapter", want_b)):
        got = _run(tmp_path / "base.onnx", x, tmp_path / adapter)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)
    # The merged file (layer.save) is still the fine-tuned model.
    merged = ort.InferenceSession(
        layer.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    got = merged.run(None, {merged.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, want_a, rtol=1e-4, atol=1e-5 * scale)
    params = ort.AdapterFormat.read_adapter(str(tmp_path / "a.onnx_adapter")).get_parameters()
    assert len(params) == 2 * {"transformer": 5, "cnn": 2}[name]


def test_save_adapters_names_what_it_cannot_write(tmp_path):
    from ortbridge.adapters import save_adapters

    _, layer, _ = _pair("cnn")
    with pytest.raises(ortbridge.exceptions.OnnxInputError, match="no LowRank update"):
        save_adapters(layer, tmp_path / "base.onnx", tmp_path / "a.onnx_adapter")
    assert not list(tmp_path.iterdir())


def test_adapter_of_a_weight_held_in_a_constant_node(tmp_path):
    """A weight the file holds in a Constant node (some exporters write them so),
    under a LowRank update, becomes the base file's initializer, read through
    the adapter inputs."""
    from onnx import TensorProto, helper, numpy_helper

    from ortbridge.adapters import save_adapters

    if not hasattr(ort, "AdapterFormat"):
        pytest.skip("onnxruntime 1.19.2 writes no adapter files (checked above by name)")
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32))
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["fc.weight"], value=weight),
            helper.make_node("MatMul", ["x", "fc.weight"], ["y"]),
        ],
        "constant_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    layer = ortbridge.OnnxModule(model)
    x = torch.randn(5, 4)
    before = layer(x).detach()
    # lora() picks the weights of initializers; a LowRank put on by hand reaches this one.
    update = LowRank((4, 3), rank=2)
    parametrize.register_parametrization(layer.get_submodule("fc"), "weight", update)
    adapters = [update.A, update.B]
    optimizer = torch.optim.SGD(adapters, lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        layer(x).square().mean().backward()
        optimizer.step()
    with torch.no_grad():
        want = layer(x).numpy()
    assert np.abs(want - before.numpy()).max() > 1e-3
    save_adapters(layer, tmp_path / "base.onnx", tmp_path / "a.onnx_adapter")
    base = onnx.load(str(tmp_path / "base.onnx"))
    assert not [n for n in base.graph.node if n.op_type == "Constant"]
    np.testing.assert_allclose(
        _run(tmp_path / "base.onnx", x), before.numpy(), rtol=1e-5, atol=1e-6
    )
    got = _run(tmp_path / "base.onnx", x, tmp_path / "a.onnx_adapter")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
