"""Objects pickled by an earlier ortbridge load and keep training.

``tests/data/pickled_before_layout/`` holds pickles written at commit 0ca8f91,
before the package's modules moved into one folder per stage (the summary
types an ``OnnxModule`` pickles lived in ``ortbridge._prepare._load``): an
``OnnxModule`` of each engine with its torch SGD state, one trained by
``OrtSGD``, an ``OnnxSGDRegressor`` and an ``OrtFullGraphTrainer``, each
trained two steps on a 6-8-1 MLP. A loaded object must give what a fresh one
built from its weights gives, and train on the same way.
"""

from __future__ import annotations

import copy
import pathlib
import pickle

import numpy as np
import pytest
import torch

from ortbridge import OnnxModule
from ortbridge._engines import installed
from ortbridge.training import OnnxSGDRegressor, OrtSGD

DATA = pathlib.Path(__file__).parent / "data" / "pickled_before_layout"
X = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))


def _load(name):
    return pickle.loads((DATA / name).read_bytes())


def _steps(module, optimizer, n=2):
    losses = []
    for _ in range(n):
        optimizer.zero_grad()
        loss = module(X).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("engine", ["onnxruntime", "training-agent"])
def test_a_module_and_its_optimizer_state_train_on(engine):
    if engine not in installed():
        pytest.skip(f"the {engine} engine needs the other onnxruntime build")
    saved = _load(f"module_{engine.replace('-', '_')}.pkl")
    loaded = saved["module"]
    assert loaded.backend == engine
    fresh = OnnxModule(loaded.to_onnx(), backend=engine)
    torch.testing.assert_close(loaded(X), fresh(X), rtol=0, atol=0)
    optimizers = []
    for module in (loaded, fresh):
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        opt.load_state_dict(copy.deepcopy(saved["optimizer"]))  # no shared buffers
        optimizers.append(opt)
    losses = _steps(loaded, optimizers[0])
    assert losses == _steps(fresh, optimizers[1])
    assert losses[1] < losses[0]
    for a, b in zip(loaded.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert loaded._summary.inputs == fresh._summary.inputs


def test_a_module_trained_by_ort_sgd_keeps_its_velocities():
    saved = _load("module_ortsgd.pkl")
    module, sgd = saved["module"], saved["optimizer"]
    assert isinstance(sgd, OrtSGD)
    assert all("momentum_buffer" in sgd.state[p] for p in module.parameters())
    fresh = OnnxModule(module.to_onnx())
    fresh_sgd = OrtSGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh_sgd.load_state_dict(copy.deepcopy(sgd.state_dict()))
    assert _steps(module, sgd) == _steps(fresh, fresh_sgd)


def test_an_estimator_predicts_and_fits_on():
    reg = _load("regressor.pkl")
    assert isinstance(reg, OnnxSGDRegressor)
    X = np.random.RandomState(0).randn(32, 6).astype(np.float32)
    y = X.sum(1, keepdims=True)
    before = reg.predict(X)
    assert np.isfinite(before).all()
    error = np.mean((before - y) ** 2)
    reg.partial_fit(X, y)
    assert np.mean((reg.predict(X) - y) ** 2) < error


def test_a_full_graph_trainer_predicts_and_fits_on():
    trainer = _load("full_graph_trainer.pkl")
    X = np.random.RandomState(0).randn(32, 6).astype(np.float32)
    y = X.sum(1, keepdims=True)
    weights = {k: v.copy() for k, v in trainer.get_weights().items()}
    trainer.fit(X, y)
    assert trainer.predict(X).shape == (32, 1)
    assert any(not np.array_equal(weights[k], v) for k, v in trainer.get_weights().items())
