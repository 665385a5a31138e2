"""Shared fixtures: seeding, engines, torch -> ONNX export, and comparison helpers.

A test (or a module, through ``pytestmark = pytest.mark.usefixtures("backend")``)
that uses the ``backend`` fixture runs once per engine installed here, with
``OnnxModule``'s default ``backend`` set to it; ``@pytest.mark.engines(...)``
restricts it to the engines named. ``requires_training_build`` marks what
needs onnxruntime-training itself (its gradient builder's graphs and kernels).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings

import numpy as np
import pytest
import torch

from ortbridge import OnnxModule, _engines, examples
from ortbridge._runtime import _ort

#: Engines this environment runs: the training agent only with the training build.
ENGINES = _engines.installed()

requires_training_build = pytest.mark.skipif(
    not _ort.has_training(), reason="needs onnxruntime-training (the training build)"
)


def pytest_configure(config):
    config.addinivalue_line("markers", "engines(*names): run only on the engines named")
    if os.environ.get("ORTBRIDGE_OFFLINE"):
        examples.published_file = _carried_only


def _carried_only(package: str, version: str, member: str):
    """``published_file`` where no registry is reached (``gpu_checks.sh`` on a lent GPU
    machine sets ``ORTBRIDGE_OFFLINE``): a file not carried there skips, named, rather
    than failing on a download that cannot happen (pip would retry for minutes)."""
    target = examples._cache_dir() / f"{package}-{version}" / member
    if not target.is_file():
        pytest.skip(
            f"{package}=={version} is not carried to this machine, which reaches no registry"
        )
    return target


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("engines")
        names = [e for e in ENGINES if marker is None or e in marker.args]
        metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request):
    """The engine under test, made ``OnnxModule``'s default for the test's duration."""
    defaults = OnnxModule.__init__.__kwdefaults__
    previous = defaults["backend"]
    defaults["backend"] = request.param
    yield request.param
    defaults["backend"] = previous


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


def make_mlp(seed=0):
    """A small MLP (6 -> 8 -> 3) several test modules train."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.fixture(scope="module")
def mlp_proto():
    """The exported MLP (export is slow: done once for the module)."""
    torch.manual_seed(0)
    return export(make_mlp(), (torch.randn(4, 6),))


def export(model: torch.nn.Module, args: tuple, dynamic_batch: bool = True, **kwargs):
    """Export with torch's current (dynamo) exporter, as a user would.

    ``optimize=False``: the exporter's optimizer folds BatchNorm into Conv and
    drops all-zero biases, which removes trainable weights.
    """
    if dynamic_batch and "dynamic_shapes" not in kwargs:
        kwargs["dynamic_shapes"] = tuple({0: torch.export.Dim("batch", min=1)} for _ in args)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, args, dynamo=True, optimize=False, verbose=False, **kwargs
        )
    return program.model_proto


def export_torchscript(
    model, args: tuple, train: bool = False, constant_folding: bool = False, **kwargs
):
    """Export with torch's TorchScript exporter (``dynamo=False``), opset 17.

    Constant folding off keeps the parameters' names (no folded transposes);
    ``constant_folding=True`` folds (an LSTM's weights reordered to onnx's
    gates become initializers, as published files hold them).
    """
    import onnx

    mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            args,
            buffer,
            dynamo=False,
            opset_version=17,
            training=mode,
            do_constant_folding=constant_folding,
            **kwargs,
        )
    return onnx.load_from_string(buffer.getvalue())


def benchmark_models():
    """The benchmarks' models (``benchmarks/_models.py``: the zoo's MLP, CNN,
    LSTM ...), imported from there."""
    import importlib
    import pathlib
    import sys

    here = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("_models")


def scaled_atol(atol: float, *expected) -> float:
    """``atol`` for values of magnitude 1, times the largest magnitude in ``expected`` above 1.

    A float result's rounding error grows with the values it is computed
    from, not with itself: an element near zero of an output that reaches 25
    differs by 1e-5 between two CPUs (Intel's and AMD's kernels round
    differently). Against a fixed ``atol`` such a comparison passes or fails
    by CPU; scaled with the largest magnitude compared, it holds on any.
    """
    return atol * max([1.0, *map(_largest, expected)])


def _largest(values) -> float:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    values = np.abs(np.asarray(values, dtype=np.float64))
    values = values[np.isfinite(values)]
    return float(values.max()) if values.size else 0.0


def assert_eval_runs_as_file(layer, args, path, feeds, rtol=1e-6, atol=1e-6) -> None:
    """``layer``'s eval outputs on ``args`` equal plain onnxruntime's of the file ``path``."""
    import onnxruntime

    layer.eval()
    with torch.no_grad():
        mine = layer(*args)
    mine = mine if isinstance(mine, (tuple, list)) else (mine,)
    theirs = onnxruntime.InferenceSession(str(path)).run(None, feeds)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(a.numpy(), b, rtol=rtol, atol=atol)


def assert_adam_lowers(params, loss_fn, steps: int = 5, lr: float = 1e-2) -> list[float]:
    """A few Adam steps on ``params`` lower ``loss_fn()``; the losses."""
    return assert_steps_lower(torch.optim.Adam(params, lr=lr), loss_fn, steps)


def assert_steps_lower(optimizer, loss_fn, steps: int = 5) -> list[float]:
    """A few steps of ``optimizer`` lower ``loss_fn()``; the losses."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    return losses


def grads_of(tensors):
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def compare_with_torch(
    torch_model, onnx_module: OnnxModule, inputs, loss_fn=None, rtol=1e-4, atol=1e-5
):
    """Outputs, parameter gradients and input gradients of both models agree
    (``atol`` scaled with the largest magnitude compared: :func:`scaled_atol`)."""
    loss_fn = loss_fn or (
        lambda out: sum((o.float() ** 2).sum() for o in _as_tuple(out) if o.is_floating_point())
    )
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    ours_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    ref_out = torch_model(*ref_inputs)
    out = onnx_module(*ours_inputs)
    for r, o in zip(_as_tuple(ref_out), _as_tuple(out)):
        torch.testing.assert_close(o, r, rtol=rtol, atol=scaled_atol(atol, r))
    loss_fn(ref_out).backward()
    loss_fn(out).backward()
    params = dict(torch_model.named_parameters())
    # A weight's gradient carries the rounding of the whole backward: atol
    # scaled with the largest of the model's (an attention key bias's true
    # gradient is 0, torch's a rounding of the others).
    grad_atol = scaled_atol(atol, *(p.grad for p in params.values() if p.grad is not None))
    n = 0
    for name, param in onnx_module.named_onnx_parameters():
        torch.testing.assert_close(
            param.grad,
            params[name].grad,
            rtol=rtol,
            atol=grad_atol,
            msg=lambda m, name=name: f"gradient of {name}: {m}",
        )
        n += 1
    assert n == len(params), (n, sorted(params))
    for r, o in zip(ref_inputs, ours_inputs):
        if r.requires_grad:
            torch.testing.assert_close(o.grad, r.grad, rtol=rtol, atol=scaled_atol(atol, r.grad))
    return out


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)
