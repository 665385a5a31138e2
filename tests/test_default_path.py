"""The default engine choice (``backend="auto"``) never differs from torch, and no
call moves a running statistic it should not.

Each check runs under ``auto`` and under each engine named, since the defaults
are what users run and what an engine-by-engine suite once missed: under
``auto`` the training build's environment updated a BatchNorm's statistics
twice on the first call (a trial run of the agent's graph before using it),
and an empty batch set the running variance to NaN (onnxruntime's train-mode
BatchNormalization writes into its running-variance input).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ENGINES, export, export_torchscript
from torch import nn

from ortbridge import OnnxModule, _engines
from ortbridge._runtime import _ort
from ortbridge.exceptions import NotDifferentiableError, OnnxInputError

ORT = _engines.ONNXRUNTIME
WAYS = ["auto", *ENGINES]


def _cnn():
    torch.manual_seed(5)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)
    )
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2)
    return net


@pytest.fixture(scope="module")
def cnn():
    """A Conv-BatchNorm CNN, TorchScript export in training mode (the form of the report)."""
    net = _cnn().train()
    # Exporting in training mode runs the model once: its statistics are then the file's.
    proto = export_torchscript(
        net,
        (torch.randn(5, 3, 8, 8),),
        train=True,
        input_names=["x"],
        dynamic_axes={"x": {0: "n"}},
    )
    return net, proto


def _stats(module):
    return {k: v.clone() for k, v in module.state_dict().items() if "running" in k}


def _close(ours, theirs):
    # Relative to the magnitude compared: kernels round differently per processor.
    scale = max(float(theirs.abs().max()), 1.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("way", WAYS)
def test_first_train_calls_update_running_statistics_once(cnn, way):
    net, proto = cnn
    ref = copy.deepcopy(net).train()
    layer = OnnxModule(proto, backend=way).train()
    ours_opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((layer, ours_opt), (ref, ref_opt)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
        for name in ("1.running_mean", "1.running_var"):
            _close(layer.get_buffer(name), ref.get_buffer(name))
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        _close(layer.eval()(x), ref.eval()(x))


@pytest.mark.parametrize("way", WAYS)
def test_empty_train_batch_leaves_statistics_and_gives_zero_gradients(cnn, way):
    net, proto = cnn
    ref = copy.deepcopy(net).train()
    layer = OnnxModule(proto, backend=way).train()
    before = _stats(layer)
    x = torch.zeros(0, 3, 8, 8, requires_grad=True)
    out = layer(x)
    assert out.shape == ref(x).shape == (0, 2)
    out.sum().backward()
    ref(x).sum().backward()
    for name, value in _stats(layer).items():
        assert torch.equal(value, before[name]), name
    for name, param in layer.named_onnx_parameters():
        assert torch.equal(param.grad, ref.get_parameter(name).grad), name
    assert x.grad is not None and x.grad.shape == x.shape
    # Still a working module: a real batch afterwards matches torch.
    y = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        _close(layer(y), ref(y))
    for name in ("1.running_mean", "1.running_var"):
        _close(layer.get_buffer(name), ref.get_buffer(name))


@pytest.mark.parametrize("way", WAYS)
def test_refused_batch_leaves_running_statistics_as_they_were(way):
    """One value per channel: refused as torch refuses it, and the error's
    promise (statistics unchanged) holds bit for bit."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh())
    layer = OnnxModule(export(model.eval(), (torch.randn(4, 6),)), backend=way).train()
    before = _stats(layer)
    with pytest.raises(OnnxInputError, match="expected more than 1 value per channel"):
        layer(torch.randn(1, 6))
    for name, value in _stats(layer).items():
        assert torch.equal(value, before[name]), name


@pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")
def test_auto_runs_the_onnxruntime_engine():
    layer = OnnxModule(export(nn.Linear(3, 2), (torch.randn(2, 3),)))
    assert layer.backend == ORT
    layer(torch.randn(2, 3)).sum().backward()
    assert layer.backend == ORT


@pytest.mark.skipif(not _ort.has_training(), reason="needs onnxruntime-training")
@pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")
@pytest.mark.parametrize("at_construction", [True, False])
def test_auto_falls_back_to_the_agent_before_running_anything(cnn, monkeypatch, at_construction):
    """Where the onnxruntime engine refuses a graph, ``auto`` builds the agent's
    instead, before any run: the statistics move once, as torch's."""
    from ortbridge._engines.onnxruntime import _engine

    net, proto = cnn
    calls = {"builds": 0}

    def refuse(*args, **kwargs):
        calls["builds"] += 1
        raise NotDifferentiableError("the onnxruntime engine refuses it (a test's stand-in)")

    if at_construction:  # the construction's check (stand-in shapes)
        real = _engines.gradient_graph
        monkeypatch.setattr(
            _engines,
            "gradient_graph",
            lambda engine, *a, **k: refuse() if engine == ORT else real(engine, *a, **k),
        )
    else:  # the graphs built for the first call's shapes
        monkeypatch.setattr(_engine.OrtGradientGraph, "_static_or_generic", refuse)
    layer = OnnxModule(proto).train()
    ref = copy.deepcopy(net).train()
    x = torch.randn(6, 3, 8, 8)
    layer(x).sum().backward()
    ref(x).sum().backward()
    assert calls["builds"] == 1
    assert layer.backend == _engines.TRAINING_AGENT
    assert "onnxruntime engine could not build" in layer.backend_reason
    for name in ("1.running_mean", "1.running_var"):
        _close(layer.get_buffer(name), ref.get_buffer(name))
    for name, param in layer.named_onnx_parameters():
        _close(param.grad, ref.get_parameter(name).grad)
