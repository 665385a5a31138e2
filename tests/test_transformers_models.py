"""transformers' architectures, exported by both torch exporters, train with torch's gradients.

The small configurations and exports of ``_transformers_zoo`` (random
weights, eval mode; TorchScript with a dynamic batch, dynamo with static
shapes and eager attention). Each loads with the defaults
(``backend="auto"``) and, where onnx-ad is installed, on the onnxruntime
engine too; outputs and every parameter's gradient are compared with torch
autograd on the same weights, matched by name.

The architectures are those whose exports no engine trained before: Swin
(strided slices in its patch merging, window padding computed from shapes),
SegFormer (depthwise convolutions), wav2vec2 (grouped positional
convolution, a ``ConvTranspose`` in its gradient that onnx's shape inference
got wrong) and a T5 encoder with an attention mask (the training agent's
backward fails at run time: ``auto`` must notice before the first step).
"""

from __future__ import annotations

import pytest
from conftest import ENGINES

from ortbridge import OnnxModule
from ortbridge._runtime import _ort

pytest.importorskip("transformers")

from _transformers_zoo import EXPORTERS, exported, gradient_errors  # noqa: E402

ORT = "onnxruntime"

#: The architectures no engine trained before, and Phi (a partial rotary
#: embedding, added to the zoo after the held-out survey,
#: ``benchmarks/survey_transformers.py``, last checked the other fifteen).
_NAMES = ["swin", "segformer", "wav2vec2", "t5-encoder", "phi"]

_CACHE: dict = {}


def _cached(name, exporter):
    key = (name, exporter)
    if key not in _CACHE:
        _CACHE[key] = exported(name, exporter)
    return _CACHE[key]


@pytest.mark.parametrize("engine", ["auto", ORT])
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", _NAMES)
def test_transformers_model_trains_with_torch_gradients(name, exporter, engine):
    if engine == ORT and ORT not in ENGINES:
        pytest.skip("onnx-ad is not installed")
    model, inputs, proto = _cached(name, exporter)
    layer = OnnxModule(proto, backend=engine)
    found = gradient_errors(model, layer, inputs)
    assert not found["missing"], f"weights the output depends on, not parameters: {found}"
    assert found["output"] < 1e-4 and not found["frozen"]
    wrong = {k: e for k, e in found["errors"].items() if e > 1e-3}
    assert not wrong, f"gradients unlike torch's (relative error): {wrong}"


@pytest.mark.skipif(not _ort.has_training(), reason="needs onnxruntime-training")
@pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")
@pytest.mark.parametrize("train", [False, True])
def test_auto_trains_what_the_agent_fails_on_at_run_time(train):
    """The training agent builds a T5 encoder's gradient graph with a mask input,
    and its backward then fails at run time (a broadcast gradient left
    unreduced). ``auto`` runs the onnxruntime engine first, so the agent is
    never tried on it (nothing to detect by running a step twice)."""
    from ortbridge.exceptions import OrtBridgeError

    _, inputs, proto = _cached("t5-encoder", "torchscript")
    agent = OnnxModule(proto, backend="training-agent").train(train)
    with pytest.raises(OrtBridgeError, match="backward pass"):
        agent(*inputs).sum().backward()
    layer = OnnxModule(proto).train(train)
    layer(*inputs).sum().backward()
    assert layer.backend == ORT
    assert all(p.grad is not None for p in layer.parameters())


def test_zoo_gradients_are_normal_numbers():
    """The zoo's random MobileViT at its BatchNorms' initial statistics has
    first-block gradients of about 1e-40 (denormal): relative to the largest
    gradient, such a check passes any value. ``exported`` sets the running
    statistics to those of a batch of random images (as a trained model's
    come from its data), and every nonzero gradient is then far from
    float32's denormal range."""
    import torch

    model, inputs, _ = _cached("mobilevit", "torchscript")
    model.zero_grad()
    x = [t.clone().requires_grad_(True) for t in inputs]
    (model(*x) ** 2).sum().backward()
    floor = 1e3 * torch.finfo(torch.float32).tiny
    tops = {n: float(p.grad.abs().max()) for n, p in model.named_parameters() if p.grad is not None}
    tops["input"] = float(x[0].grad.abs().max())
    small = {n: v for n, v in tops.items() if 0 < v < floor}
    assert not small, f"gradients near the denormal range: {small}"


@pytest.mark.skipif(ORT not in ENGINES, reason="onnx-ad is not installed")
@pytest.mark.parametrize("name", ["convnext", "mobilevit"])
def test_small_depthwise_convs_as_products_at_the_benchmark_batch(name):
    """At the benchmark's batch of 16 the depthwise Convs of ConvNeXt's 8x8 and
    4x4 stages (7x7 kernels) and MobileViT's small stages become products by a
    matrix per channel (``passes._dense_depthwise``; at the zoo's own two rows
    they stay Convs): torch's gradients, and the forward graphs built so."""
    model, inputs, proto = _cached(name, "torchscript")
    batch = [t.repeat(8, *[1] * (t.dim() - 1)) for t in inputs]
    layer = OnnxModule(proto, backend=ORT)
    found = gradient_errors(model, layer, batch)
    assert found["output"] < 1e-4
    wrong = {k: e for k, e in found["errors"].items() if e > 1e-3}
    assert not wrong, f"gradients unlike torch's (relative error): {wrong}"
    built = [b for g in layer._bridge._gradient_graphs.values() for b in g._in_use()]
    assert any(n.op_type == "OneHot" for b in built for n in b.split.forward.graph.node)
