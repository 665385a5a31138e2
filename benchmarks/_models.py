"""The models the benchmarks train, their data, and their ONNX export."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import torch
from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(400, 10),
    )  # fmt: skip


def transformer() -> nn.Module:
    return nn.TransformerEncoderLayer(d_model=256, nhead=4, batch_first=True, dropout=0.0)


# name -> (factory, input shape, classification?)
MODELS = {
    "mlp": (mlp, (64, 784), True),
    "cnn": (cnn, (64, 1, 28, 28), True),
    "transformer": (transformer, (16, 64, 256), False),
}


def data(name: str, device: torch.device, seed: int = 0):
    """A fixed batch and its targets."""
    _, shape, classify = MODELS[name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    if classify:
        y = torch.randint(0, 10, (shape[0],), generator=gen)
    else:
        y = torch.randn(*shape, generator=gen)
    return x.to(device), y.to(device)


def loss_fn(name: str):
    return nn.CrossEntropyLoss() if MODELS[name][2] else nn.MSELoss()


def train_step(model, optimizer, loss_fn, x, y):
    """One training step of a module: forward, loss, backward, optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def export(model: nn.Module, x: torch.Tensor):
    """torch's current exporter, ``optimize=False`` so that every weight stays."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    dims = ({0: torch.export.Dim("batch", min=1)},)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (x,), dynamo=True, optimize=False, verbose=False, dynamic_shapes=dims
        )
    return program.model_proto
