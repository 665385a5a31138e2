"""torch's own layers, exported by both torch exporters, train with torch's gradients.

Each layer is exported with the dynamo exporter (``conftest.export``) and the
TorchScript one (``torch.onnx.export(..., dynamo=False)``), loaded with the
default backend, and compared with torch autograd on the same weights: the
outputs, the gradient of every float input, and the gradient of every torch
parameter, matched by name (TorchScript export with constant folding off keeps
the names). Parameters are perturbed before export: an exporter merges
initializers of equal values (zero biases, unit norm scales) into one, whose
gradient is then the sum of theirs.

Where the training build is installed, ``backend="auto"`` must route what its
gradient builder crashes on, refuses or gets wrong to the onnxruntime engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import ENGINES, export, export_torchscript, scaled_atol
from torch import nn

from ortbridge import OnnxModule
from ortbridge._runtime import _ort
from ortbridge.exceptions import NotDifferentiableError

ORT = "onnxruntime"
pytestmark = pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")


# -- layers -------------------------------------------------------------------


class _Attention(nn.Module):
    """Self-attention, optionally with a key padding mask (an input) and a causal mask."""

    def __init__(self, masked: bool):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.masked = masked

    def forward(self, x, key_padding_mask=None):
        causal = None
        if self.masked:
            causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        out, _ = self.attn(
            x, x, x, key_padding_mask=key_padding_mask, attn_mask=causal, need_weights=False
        )
        return out


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(
            8, 2, dim_feedforward=16, dropout=0.0, batch_first=True
        )

    def forward(self, tgt, memory):
        return self.layer(tgt, memory)


class _Bag(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode=mode)

    def forward(self, indices, offsets):
        return self.bag(indices, offsets)


class _GridSample(nn.Module):
    """Samples a learnable image at the grid given, or the image given at a learnable grid."""

    def __init__(self, learn: str, modes=("bilinear", "nearest")):
        super().__init__()
        self.learn, self.modes = learn, modes
        if learn == "grid":
            self.grid = nn.Parameter(torch.rand(2, 3, 4, 2) * 1.8 - 0.9)
        else:
            self.image = nn.Parameter(torch.randn(2, 3, 5, 5))

    def forward(self, x):
        image, grid = (x, self.grid) if self.learn == "grid" else (self.image, x)
        return tuple(
            F.grid_sample(image, grid, mode=mode, align_corners=mode == "nearest")
            for mode in self.modes
        )


class _Resize(nn.Module):
    """A 1x1 Conv (a weight before the resizes), then one output per resize.

    ``resizes``: ``(mode, align_corners, size)``, size None for a scale of 2;
    ``module``: through ``nn.Upsample`` rather than ``F.interpolate``.
    """

    def __init__(self, resizes, module=False):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.resizes = resizes
        self.module = module

    def forward(self, x):
        x = self.conv(x)
        outs = []
        for mode, align_corners, size in self.resizes:
            scale = None if size else 2
            if self.module:
                outs.append(nn.Upsample(size, scale, mode, align_corners)(x))
            else:
                outs.append(F.interpolate(x, size, scale, mode, align_corners))
        return tuple(outs)


class _UNet(nn.Module):
    """A UNet down step and up step: Conv, BatchNorm, MaxPool, ConvTranspose, skip Concat."""

    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.out = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        skip = self.down(x)
        return self.out(torch.cat([self.up(self.mid(self.pool(skip))), skip], 1))


class _ConvSame(nn.Module):
    """An even kernel with padding="same": TorchScript writes auto_pad=SAME_UPPER."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 4, padding="same")

    def forward(self, x):
        return torch.tanh(self.conv(x))


class _SplitWeight(nn.Module):
    """torch.split of a weight (dynamo: SplitToSequence + SequenceAt)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 4))

    def forward(self, x):
        a, b = torch.split(self.w, [3, 4])
        return x @ a.T, torch.tanh(x @ b.T)


def _padding_mask(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -2:] = True  # the first sequence's last two positions are padding
    return mask


#: name -> (model factory, inputs factory)
_LAYERS = {
    "mha": (lambda: _Attention(False), lambda: (torch.randn(2, 5, 8),)),
    "mha-key-padding-and-causal-masks": (
        lambda: _Attention(True),
        lambda: (torch.randn(2, 5, 8), _padding_mask(2, 5)),
    ),
    "transformer-decoder-layer": (_Decoder, lambda: (torch.randn(2, 5, 8), torch.randn(2, 4, 8))),
    "embedding-bag-sum": (
        lambda: _Bag("sum"),
        lambda: (torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5])),
    ),
    "embedding-bag-mean": (
        lambda: _Bag("mean"),
        lambda: (torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5])),
    ),
    "grid-sample-learnable-grid": (lambda: _GridSample("grid"), lambda: (torch.randn(2, 3, 5, 5),)),
    "grid-sample-nearest-learnable-grid": (  # no gradient reaches the grid
        lambda: _GridSample("grid", ["nearest"]),
        lambda: (torch.randn(2, 3, 5, 5),),
    ),
    "grid-sample-learnable-input": (
        lambda: _GridSample("input"),
        lambda: (torch.rand(2, 3, 4, 2) * 1.8 - 0.9,),
    ),
    # one export per exporter for several resizes (each compared as its own output)
    "interpolate-nearest-bilinear-bicubic": (
        lambda: _Resize(
            [
                ("nearest", None, None),
                ("bilinear", False, None),
                ("bicubic", False, None),
                ("bicubic", True, (5, 7)),
            ]
        ),
        lambda: (torch.randn(2, 2, 3, 4),),
    ),
    "upsample-nearest-bilinear-bicubic": (
        lambda: _Resize(
            [("nearest", None, (5, 7)), ("bilinear", True, None), ("bicubic", False, (4, 6))],
            module=True,
        ),
        lambda: (torch.randn(2, 2, 3, 4),),
    ),
    "unet-block-train-mode": (_UNet, lambda: (torch.randn(2, 2, 8, 8),)),
    "conv2d-padding-same": (_ConvSame, lambda: (torch.randn(2, 2, 7, 7),)),
    "split-of-a-weight": (_SplitWeight, lambda: (torch.randn(3, 4),)),
}

#: Layers run in train mode (BatchNorm on batch statistics, running statistics updated).
_TRAIN_MODE = {"unet-block-train-mode"}

#: What the training build's gradient builder crashes on (Loop), has no gradient for
#: (GridSample) or no CPU kernel for (Resize, ConvTranspose): "auto" must run the
#: onnxruntime engine.
_ONNXRUNTIME_ENGINE = (
    "embedding-bag",
    "grid-sample",
    "interpolate",
    "upsample",
    "unet",
)


def _export(model, inputs, exporter, train):
    if exporter == "dynamo":
        return export(model, inputs, dynamic_batch=False)
    return export_torchscript(model, inputs, train=train)


def _exported(name, exporter):
    factory, make_inputs = _LAYERS[name]
    torch.manual_seed(0)
    model = factory()
    with torch.no_grad():  # no two parameters equal: exporters would merge them
        for param in model.parameters():
            param.add_(torch.rand_like(param) * 0.2 - 0.1)
    train = name in _TRAIN_MODE
    model.train(train)
    inputs = make_inputs()
    return model, inputs, _export(model, inputs, exporter, train), train


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(_LAYERS))
def test_torch_layer_trains_with_torch_gradients(name, exporter):
    model, inputs, proto, train = _exported(name, exporter)
    layer = OnnxModule(proto).train(train)
    if _ort.has_training() and name.startswith(_ONNXRUNTIME_ENGINE):
        assert layer.backend == ORT, layer.backend_reason
    _compare(model, layer, inputs)


#: Layers the training agent itself trains (after its rewrites); it refuses the others by name.
_TRAINING_AGENT_TRAINS = (
    "mha",
    "transformer-decoder-layer",
    "conv2d-padding-same",
    "split-of-a-weight",
)


@pytest.mark.skipif(not _ort.has_training(), reason="needs onnxruntime-training")
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(_LAYERS))
def test_torch_layer_on_the_training_agent_trains_or_is_refused_by_name(name, exporter):
    model, inputs, proto, train = _exported(name, exporter)
    try:
        layer = OnnxModule(proto, backend="training-agent").train(train)
        _compare(model, layer, inputs)
    except NotDifferentiableError as exc:
        assert not name.startswith(_TRAINING_AGENT_TRAINS), str(exc)
        assert exc.node and exc.op_type, str(exc)
        assert f"(op type {exc.op_type})" in str(exc) and ".cc:" not in str(exc)
        return
    assert name.startswith(_TRAINING_AGENT_TRAINS) or name.startswith("mha"), name


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_embedding_bag_weight_is_trainable_by_default(exporter, mode):
    # Its weight is read inside the Loop body only, a capture the reachability
    # analysis follows.
    model = _Bag(mode)
    inputs = _LAYERS[f"embedding-bag-{mode}"][1]()
    proto = _export(model, inputs, exporter, train=False)
    assert [name for name, _ in OnnxModule(proto).named_onnx_parameters()] == ["bag.weight"]


def _compare(model, layer, inputs):
    """Outputs, float inputs' gradients, every parameter's gradient and running statistics."""
    runs = []
    for net in (model, layer):
        xs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = net(*xs)
        out = out if isinstance(out, tuple) else (out,)
        sum((o**2).sum() for o in out).backward()
        runs.append((out, xs))
    (ref, ref_xs), (ours, our_xs) = runs
    assert len(ours) == len(ref)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=scaled_atol(1e-5, r))
    for o, r in zip(our_xs, ref_xs):
        if r.requires_grad:
            _assert_grad(o.grad, r.grad, "input", scaled_atol(1e-5, r.grad))
    params = dict(model.named_parameters())
    ours_by_name = dict(layer.named_onnx_parameters())
    assert set(ours_by_name) == set(params), "parameters not matched by name"
    # Scaled with the model's largest weight gradient: each carries the whole backward's rounding.
    atol = scaled_atol(1e-5, *(p.grad for p in params.values() if p.grad is not None))
    for name, param in params.items():
        _assert_grad(ours_by_name[name].grad, param.grad, name, atol)
    for name, buffer in model.named_buffers():  # BatchNorm's running statistics (train mode)
        if buffer.is_floating_point():
            torch.testing.assert_close(layer.onnx_weight(name), buffer, rtol=1e-4, atol=1e-5)


def _assert_grad(ours, ref, what, atol):
    # A gradient that no path reaches stays None here; torch writes zeros for some
    # (grid_sample's nearest mode: its grid gradient is zero by definition).
    if ours is None:
        assert ref is None or not ref.any(), f"no gradient for {what}, torch has one"
        return
    torch.testing.assert_close(
        ours, ref, rtol=1e-4, atol=atol, msg=lambda m: f"gradient of {what}: {m}"
    )


class _Rounded(torch.nn.Module):
    """A weight reaching the output only through Round, Floor, Ceil and Sign."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.step = nn.Parameter(torch.tensor([0.7, -1.6, 2.2]))

    def forward(self, x, offset):
        s = self.step
        snapped = torch.round(s * 3) + torch.floor(s) + torch.ceil(s) + torch.sign(s)
        return self.linear(x) * snapped + torch.sign(offset)


class _RoundedOnly(torch.nn.Module):
    """The only weight rounded: no engine has a gradient to compute."""

    def __init__(self):
        super().__init__()
        self.step = nn.Parameter(torch.tensor([0.7, -1.6, 2.2]))

    def forward(self, x):
        return x * torch.round(self.step)


@pytest.mark.parametrize("engine", ["auto", ORT])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("train", [False, True])
def test_a_step_whose_every_gradient_is_zero_trains_as_in_torch(exporter, engine, train):
    model, x = _RoundedOnly(), torch.randn(2, 3)
    layer = OnnxModule(_export(model, (x,), exporter, False), backend=engine).train(train)
    assert isinstance(dict(layer.named_onnx_parameters()).get("step"), nn.Parameter)
    out = layer(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    torch.testing.assert_close(layer.onnx_weight("step").grad, torch.zeros(3))


@pytest.mark.parametrize("engine", ["auto", ORT])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_weight_behind_a_zero_derivative_gets_zeros_as_in_torch(exporter, engine):
    """torch gives what reaches the output only through round() and the like a
    zero gradient, not None: AdamW decays the one and skips the other."""
    model = _Rounded()
    inputs = (torch.randn(2, 3), torch.randn(2, 3))
    layer = OnnxModule(_export(model, inputs, exporter, False), backend=engine)
    assert isinstance(dict(layer.named_onnx_parameters()).get("step"), nn.Parameter)
    offset = inputs[1].clone().requires_grad_()
    layer(inputs[0], offset).sum().backward()
    ref_offset = inputs[1].clone().requires_grad_()
    model(inputs[0], ref_offset).sum().backward()
    step = layer.onnx_weight("step")
    assert step.grad is not None and offset.grad is not None
    torch.testing.assert_close(step.grad, model.step.grad)  # zeros
    torch.testing.assert_close(offset.grad, ref_offset.grad)
    torch.testing.assert_close(
        layer.onnx_weight("linear.weight").grad, model.linear.weight.grad, rtol=1e-4, atol=1e-5
    )
