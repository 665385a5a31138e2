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


class LSTMRegressor(nn.Module):
    """A two-layer bidirectional LSTM and a linear head on its outputs."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(128, 32)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def lstm() -> nn.Module:
    return LSTMRegressor()


def unet_decoder() -> nn.Module:
    """A small UNet decoder: ConvTranspose, GroupNorm, Upsample, Conv."""
    return nn.Sequential(
        nn.ConvTranspose2d(32, 16, 2, stride=2), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(16, 8, 3, padding=1),
    )  # fmt: skip


# name -> (factory, input shape, classification?, output shape for regression)
MODELS = {
    "mlp": (mlp, (64, 784), True),
    "cnn": (cnn, (64, 1, 28, 28), True),
    "transformer": (transformer, (16, 64, 256), False),
    "lstm": (lstm, (16, 20, 32), False),
    "unet": (unet_decoder, (8, 32, 8, 8), False),
}
#: Models the training build cannot train (only the onnxruntime engine does).
ONNXRUNTIME_ONLY = {"lstm", "unet"}
#: Regression targets' shapes where they differ from the input's.
TARGET_SHAPES = {"unet": (8, 8, 32, 32)}


def data(name: str, device: torch.device, seed: int = 0):
    """A fixed batch and its targets."""
    _, shape, classify = MODELS[name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    if classify:
        y = torch.randint(0, 10, (shape[0],), generator=gen)
    else:
        y = torch.randn(*TARGET_SHAPES.get(name, shape), generator=gen)
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
