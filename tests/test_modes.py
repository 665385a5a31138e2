"""train()/eval() change what the graph computes as they do for torch layers."""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys

import onnx
import pytest
import torch
from conftest import ENGINES, compare_with_torch, export
from torch import nn

from ortbridge import OnnxModule
from ortbridge.examples import linear_model

# Every test here runs on each engine installed (see conftest).
pytestmark = pytest.mark.usefixtures("backend")

P = 0.4


@pytest.fixture(scope="module")
def dropout_net():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(P), nn.Identity())
    # Exported in train mode: the graph holds a Dropout node (training_mode=True).
    proto = export(model.train(), (torch.randn(4, 32),))
    assert any(n.op_type == "Dropout" for n in proto.graph.node)
    return model, proto


def test_dropout_active_in_train_mode(dropout_net):
    model, proto = dropout_net
    layer = OnnxModule(proto).train()
    x = torch.randn(256, 32)
    y = layer(x)
    clean = model.eval()(x)
    zeros = (y == 0).float().mean().item()
    assert abs(zeros - P) < 0.03, zeros  # same rate as torch's Dropout
    kept = y != 0
    torch.testing.assert_close(y[kept], clean[kept] / (1 - P), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        layer(x).ne(0).float().mean(), torch.tensor(1 - P), atol=0.03, rtol=0
    )
    assert not torch.equal(layer(x), layer(x))  # random, like torch's
    with torch.no_grad():
        assert (layer(x) == 0).float().mean().item() == pytest.approx(P, abs=0.03)


def test_dropout_gradient_follows_mask(dropout_net):
    _, proto = dropout_net
    layer = OnnxModule(proto).train()
    x = torch.randn(64, 32, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    bias_grad = layer.get_parameter("0.bias").grad
    torch.testing.assert_close(bias_grad, (y != 0).float().sum(0) / (1 - P))


def test_dropout_off_in_eval_mode(dropout_net):
    model, proto = dropout_net
    model = copy.deepcopy(model).eval()
    layer = OnnxModule(proto).eval()
    x = torch.randn(16, 32)
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)
    compare_with_torch(model, layer, [x.requires_grad_()])


def test_dropout_masks_follow_torchs_generator_state(dropout_net):
    """Restoring torch's generator state draws the same masks again, on every engine."""
    _, proto = dropout_net
    layer = OnnxModule(proto).train()
    x = torch.randn(8, 32)
    state = torch.get_rng_state()
    runs = []
    for _ in range(3):
        torch.set_rng_state(state)
        layer.zero_grad()
        y = layer(x)
        y.sum().backward()
        runs.append((y.detach(), layer.get_parameter("0.weight").grad.clone()))
    for first, *again in zip(*runs):
        for value in again:
            torch.testing.assert_close(value, first, rtol=0, atol=0)
    assert not torch.equal(layer(x), runs[0][0])  # the generator moved on: new masks


def test_forwards_that_draw_nothing_leave_torchs_generator_alone(dropout_net):
    """Eval mode (Dropout off) and graphs without Dropout do not advance torch's generator."""
    _, proto = dropout_net
    layer = OnnxModule(proto).eval()
    plain = OnnxModule(linear_model(3, 2)).train()
    x, x_plain = torch.randn(4, 32), torch.randn(4, 3)
    state = torch.get_rng_state()
    layer(x).sum().backward()
    plain(x_plain).sum().backward()
    with torch.no_grad():
        layer(x), plain(x_plain)
    assert torch.equal(torch.get_rng_state(), state)


def seeded_run(layer, seed: int) -> list:
    """Outputs and a weight gradient of two train-mode steps after ``torch.manual_seed``,
    then a train-mode forward under ``no_grad`` (the inference session draws).

    Self-contained: its source also runs in a new process.
    """
    torch.manual_seed(seed)
    layer.zero_grad()
    x = torch.randn(6, 32)
    outputs = []
    for _ in range(2):
        y = layer(x)
        y.sum().backward()
        outputs.append(y.detach().tolist())
    with torch.no_grad():
        outputs.append(layer(x).tolist())
    return [*outputs, layer.get_parameter("0.weight").grad.tolist()]


@pytest.mark.engines(ENGINES[0])  # one new process checks every engine installed
def test_seeded_dropout_reproduces_in_a_new_process(dropout_net, tmp_path):
    """Masks come from torch's generator (the training agent seeds onnxruntime's from
    it): a fresh process with the same seed gives the same outputs and gradients."""
    _, proto = dropout_net
    path = tmp_path / "dropout.onnx"
    onnx.save(proto, path)
    code = "\n".join(
        [
            "import json, sys, torch",
            "from ortbridge import OnnxModule",
            inspect.getsource(seeded_run),
            "layers = [OnnxModule(sys.argv[1], backend=b).train() for b in sys.argv[2:]]",
            "print(json.dumps([seeded_run(layer, 0) for layer in layers]))",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), *ENGINES],
        capture_output=True,
        text=True,
        check=True,
    )
    theirs = json.loads(done.stdout.splitlines()[-1])
    for engine, their_run in zip(ENGINES, theirs, strict=True):
        layer = OnnxModule(proto, backend=engine).train()
        ours = seeded_run(layer, 0)
        for step, (mine, theirs_step) in enumerate(zip(ours, their_run, strict=True)):
            assert mine == theirs_step, (engine, step)
        other = seeded_run(layer, 1)
        assert all(a != b for a, b in zip(other[:3], their_run[:3])), engine


@pytest.fixture(scope="module")
def bn_net():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model.eval(), export(model.eval(), (torch.randn(4, 6),))


def test_batchnorm_eval_uses_running_statistics_and_trains(bn_net):
    model, proto = bn_net
    model = copy.deepcopy(model).eval()
    layer = OnnxModule(proto).eval()
    before = layer.get_buffer("1.running_mean").clone()
    compare_with_torch(model, layer, [torch.randn(7, 6, requires_grad=True)])
    assert torch.equal(layer.get_buffer("1.running_mean"), before)
    assert layer.get_parameter("1.weight").grad is not None


def test_batchnorm_train_updates_running_statistics(bn_net):
    model, proto = bn_net
    model = copy.deepcopy(model).train()
    layer = OnnxModule(proto).train()
    for _ in range(3):
        x = torch.randn(8, 6, requires_grad=True)
        compare_with_torch(model, layer, [x])
        model.zero_grad()
        layer.zero_grad()
    for name in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(layer.get_buffer(name), model.get_buffer(name))
    with torch.no_grad():  # torch's BatchNorm also updates them without grad
        x = torch.randn(8, 6)
        torch.testing.assert_close(layer(x), model(x))
    torch.testing.assert_close(layer.get_buffer("1.running_var"), model.get_buffer("1.running_var"))


def test_batchnorm_frozen_keeps_running_statistics_in_train_mode(bn_net):
    model, proto = bn_net
    model = copy.deepcopy(model).eval()  # torch's reference: BatchNorm in eval mode
    layer = OnnxModule(proto, batch_norm="frozen").train()
    before = layer.get_buffer("1.running_var").clone()
    compare_with_torch(model, layer, [torch.randn(8, 6, requires_grad=True)])
    assert torch.equal(layer.get_buffer("1.running_var"), before)
    assert layer.get_parameter("1.weight").grad is not None


def test_no_grad_runs_plain_inference_session(bn_net):
    _, proto = bn_net
    layer = OnnxModule(proto).eval()
    built = len(layer._bridge._gradient_graphs)
    with torch.no_grad():
        y = layer(torch.randn(3, 6))
    assert y.grad_fn is None
    assert len(layer._bridge._gradient_graphs) == built
    assert list(layer._bridge._inference_graphs) == [("eval", torch.device("cpu"), None)]
    layer.requires_grad_(False)  # nothing requires grad: inference too
    y = layer(torch.randn(3, 6))
    assert y.grad_fn is None and not y.requires_grad
    assert len(layer._bridge._gradient_graphs) == built
