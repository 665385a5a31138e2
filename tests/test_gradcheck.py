"""``ortbridge.gradcheck``: gradients against finite differences of onnxruntime inference."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINES, export, requires_training_build

import ortbridge
from ortbridge import OnnxModule
from ortbridge.exceptions import OnnxInputError, OnnxTypeError


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    x = torch.randn(3, 4)
    return export(model, (x,)), x


@pytest.mark.parametrize("engine", ENGINES)
def test_passes_on_a_correct_module_with_a_float64_reference(engine):
    proto, x = _mlp()
    report = ortbridge.gradcheck(OnnxModule(proto, backend=engine), x)
    assert report and report.passed
    assert report.dtype == "float64" and report.engine == engine
    assert [(e.name, e.kind) for e in report.entries] == [
        ("input", "input"),
        ("0.weight", "weight"),
        ("0.bias", "weight"),
        ("2.weight", "weight"),
        ("2.bias", "weight"),
    ]
    assert all(e.checked > 0 and e.max_rel_error < 1e-4 for e in report.entries)
    assert "passed" in str(report) and "0.weight" in str(report)


@pytest.mark.parametrize("engine", ENGINES)
def test_catches_a_wrong_gradient_and_names_the_tensor(engine, monkeypatch):
    proto, x = _mlp()
    layer = OnnxModule(proto, backend=engine)
    graph_class = type(layer._bridge.gradient_graph("train", (True,) * 5, torch.device("cpu")))
    backward = graph_class.backward

    def off_by_a_tenth(self, *args, **kwargs):  # a wrong engine
        grads = list(backward(self, *args, **kwargs))
        grads[-1] = grads[-1] * 1.1
        return grads

    monkeypatch.setattr(graph_class, "backward", off_by_a_tenth)
    report = ortbridge.gradcheck(layer, x)
    assert not report
    failed = [e.name for e in report.entries if not e.passed]
    assert len(failed) == 1 and failed[0] in {"2.bias", "x"}, str(report)
    assert "FAIL" in str(report) and "finite differences" in str(report)


@requires_training_build
def test_catches_the_builders_wrong_gradient_with_the_table_switched_off():
    from onnx import TensorProto, helper

    from ortbridge._engines.training_agent import _limits as _builder_limits

    # A dilated AveragePool after a weight: the builder's gradient is wrong.
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["t"]),
        helper.make_node("AveragePool", ["t"], ["y"], kernel_shape=[2, 2], dilations=[2, 2]),
    ]
    w = helper.make_tensor(
        "w", TensorProto.FLOAT, [1, 1, 5, 5], [0.5 + 0.01 * i for i in range(25)]
    )
    graph = helper.make_graph(
        nodes,
        "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    proto.ir_version = 9
    x = torch.randn(1, 1, 5, 5)
    with _builder_limits.unguarded():
        wrong = ortbridge.gradcheck(OnnxModule(proto, backend="training-agent"), x)
    assert not wrong, str(wrong)
    assert {e.name for e in wrong.entries if not e.passed} <= {"x", "w"}
    assert ortbridge.gradcheck(OnnxModule(proto), x)  # auto: the onnxruntime engine


def test_leaves_running_statistics_and_gradients_untouched():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    x = torch.randn(6, 4)
    layer = OnnxModule(export(model.train(), (x,), training=torch.onnx.TrainingMode.TRAINING))
    layer.train()
    before = {k: b.clone() for k, b in layer.named_buffers()}
    report = ortbridge.gradcheck(layer, x)
    assert report, str(report)
    for k, b in layer.named_buffers():
        torch.testing.assert_close(b, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in layer.parameters())


def test_refuses_what_it_cannot_check():
    proto, x = _mlp()
    with pytest.raises(OnnxTypeError, match="takes an OnnxModule"):
        ortbridge.gradcheck(torch.nn.Linear(2, 2), x)
    with pytest.raises(OnnxInputError, match="takes 1 input"):
        ortbridge.gradcheck(OnnxModule(proto), x, x)
    drop = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    layer = OnnxModule(export(drop.train(), (x,), training=torch.onnx.TrainingMode.TRAINING))
    with pytest.raises(OnnxInputError, match="module.eval"):
        ortbridge.gradcheck(layer.train(), x)
    assert ortbridge.gradcheck(layer.eval(), x)
