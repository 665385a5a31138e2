"""What a user sees around the layer: ``print(module)``, the autograd Function's
name, torch.compile without warnings, type annotations, and the full-graph
trainer's progress lines."""

from __future__ import annotations

import copy
import importlib.resources
import inspect
import logging
import pickle
import re
import warnings

import numpy as np
import onnx
import pytest
import torch
from conftest import export
from onnx import TensorProto, helper
from torch import nn

import ortbridge
from ortbridge import OnnxModule
from ortbridge._prepare._onnx_utils import make_model
from ortbridge.examples import linear_model
from ortbridge.training import (
    OnnxSGDClassifier,
    OnnxSGDRegressor,
    OrtFullGraphTrainer,
    OrtSGD,
)


class TinyNet(nn.Module):
    """Two layers, one of them a BatchNorm (a frozen buffer beside parameters)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x):
        return self.head(self.bn(self.fc(x)))


@pytest.fixture(scope="module")
def tiny():
    """TinyNet and its dynamo export (export is slow: done once for the module)."""
    torch.manual_seed(0)
    net = TinyNet().eval()
    return net, export(net, (torch.randn(3, 5),))


# -- print(module) -------------------------------------------------------------


def test_print_shows_graph_engine_nodes_and_weights_by_holder(tiny):
    net, proto = tiny
    layer = OnnxModule(proto)
    text = str(layer)
    assert text.startswith("OnnxModule(\n  graph: 'main_graph', engine: " + layer.backend + "\n")
    assert "  inputs: x float32 (batch, 5)\n" in text
    assert re.search(r"  outputs: \w+ float32 \(batch, 2\)\n", text)
    assert "Gemm x2" in text and "BatchNormalization x1" in text and "Relu x1" in text
    assert "  trainable: 6 of 8 float initializers\n" in text
    # The holders print like torch's layers: their weights with shapes.
    assert "  (fc): OnnxWeights(weight: (4, 5), bias: (4,))\n" in text
    assert (
        "  (bn): OnnxWeights(weight: (4,), bias: (4,), running_mean: (4,) frozen, "
        "running_var: (4,) frozen)\n" in text
    )
    assert "  (head): OnnxWeights(\n    (1): OnnxWeights(weight: (2, 4), bias: (2,))\n  )" in text
    assert "Module()" not in text


def test_print_lists_weights_the_module_holds_itself():
    text = str(OnnxModule(linear_model(3, 2)))
    assert "  nodes: Gemm x1\n" in text
    assert "  weight: (2, 3), bias: (2,)\n)" in text


def test_holders_keep_torch_state_dict_names_and_loading(tiny):
    net, proto = tiny
    layer = OnnxModule(proto)
    torch_keys = [k for k in net.state_dict() if not k.endswith("num_batches_tracked")]
    assert list(layer.state_dict()) == torch_keys
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in net.named_parameters()]
    changed = {k: v + 1.0 for k, v in net.state_dict().items()}
    layer.load_state_dict(changed)
    torch.testing.assert_close(layer.fc.weight, changed["fc.weight"])
    torch.testing.assert_close(layer.bn.running_var, changed["bn.running_var"])
    for copied in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert str(copied) == str(layer)
        assert list(copied.state_dict()) == torch_keys


# -- the autograd Function's name ----------------------------------------------


def test_function_of_a_dynamo_export_is_named_after_the_torch_class(tiny):
    _, proto = tiny
    assert proto.graph.name == "main_graph"
    layer = OnnxModule(proto)
    assert layer.function.__name__ == "TinyNetFunction"
    y = layer(torch.randn(3, 5, requires_grad=True))
    assert type(y.grad_fn).__name__ == "TinyNetFunctionBackward"


def _generic(name: str) -> onnx.ModelProto:
    model = linear_model(3, 2)
    model.graph.name = name
    return model


@pytest.mark.parametrize("generic", ["main_graph", "torch_jit", ""])
def test_function_of_a_generic_graph_gets_a_stable_hashed_name(generic):
    names = {OnnxModule(_generic(generic)).function.__name__ for _ in range(2)}
    (name,) = names  # the same from one load to the next
    assert re.fullmatch(r"OnnxModule_[0-9a-f]{8}Function", name), name
    other = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        generic,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
    )
    assert OnnxModule(make_model(other)).function.__name__ != name


@pytest.mark.parametrize(
    "graph_name,expected",
    [("small_double", "Small_doubleFunction"), ("9 layers-v2", "Onnx_9_layers_v2Function")],
)
def test_function_name_is_an_identifier(graph_name, expected):
    name = OnnxModule(_generic(graph_name)).function.__name__
    assert name == expected and name.isidentifier()


# -- torch.compile ---------------------------------------------------------------


def test_torch_compile_takes_the_layer_without_warnings():
    """The layer is one torch operator in the compiled graph: outputs and
    gradients equal eager's, and Dynamo emits no warning (it used to emit three)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 3), OnnxModule(linear_model(3, 2)), nn.Tanh())
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    x = torch.randn(5, 4)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # the second call runs the compiled code
                out = compiled(x)
                out.sum().backward()
    finally:
        root.removeHandler(handler)
    # torch's notice about the interpreter itself (CPython 3.13.0's slower
    # guards) says nothing about the layer.
    about_python = "Guards may run slower on Python 3.13.0"
    assert [str(w.message) for w in caught if about_python not in str(w.message)] == []
    assert [r.getMessage() for r in records if about_python not in r.getMessage()] == []
    out_eager = eager(x)
    out_eager.sum().backward()
    torch.testing.assert_close(out, out_eager)
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        # Two backward passes through the compiled model, one through eager.
        torch.testing.assert_close(q.grad, 2 * p.grad, msg=name)


# -- type annotations ---------------------------------------------------------------


def test_package_ships_py_typed():
    assert importlib.resources.files("ortbridge").joinpath("py.typed").is_file()


@pytest.mark.parametrize(
    "function",
    [
        OnnxModule.__init__,
        OnnxModule.forward,
        OnnxModule.to_onnx,
        OnnxModule.save,
        ortbridge.gradcheck,
        OnnxSGDRegressor.__init__,
        OnnxSGDClassifier.__init__,
        OnnxSGDRegressor.fit,
        OnnxSGDRegressor.partial_fit,
        OnnxSGDRegressor.predict,
        OnnxSGDClassifier.partial_fit,
        OnnxSGDClassifier.predict,
        OrtFullGraphTrainer.__init__,
        OrtFullGraphTrainer.fit,
        OrtFullGraphTrainer.predict,
        OrtSGD.__init__,
    ],
    ids=lambda f: f.__qualname__,
)
def test_public_signatures_are_annotated(function):
    signature = inspect.signature(function)
    missing = [
        name
        for name, p in signature.parameters.items()
        if name != "self" and p.annotation is inspect.Parameter.empty
    ]
    assert not missing, f"{function.__qualname__}: {missing} not annotated"
    assert signature.return_annotation is not inspect.Signature.empty


# -- OrtFullGraphTrainer(verbose=...) -----------------------------------------------


def _regression(n=40):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, 3)).astype(np.float32)
    return X, X @ np.array([[1.0], [-2.0], [0.5]], np.float32)


def test_full_graph_trainer_prints_one_line_per_epoch_when_verbose(capsys):
    X, y = _regression()
    trainer = OrtFullGraphTrainer(
        linear_model(3, 1), optimizer="sgd", learning_rate=0.1, max_iter=3, verbose=True
    )
    trainer.fit(X, y)
    trainer.fit(X, y)  # continues: the count goes on
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"Iteration {i + 1}, loss = {v:.8f}" for i, v in enumerate(trainer.train_losses_)
    ]
    assert len(lines) == 6


def test_full_graph_trainer_is_quiet_by_default_and_unpickles_without_verbose(capsys):
    X, y = _regression()
    trainer = OrtFullGraphTrainer(linear_model(3, 1), optimizer="sgd", max_iter=2).fit(X, y)
    assert capsys.readouterr().out == ""
    # A trainer pickled before ``verbose`` existed.
    state = trainer.__getstate__()
    del state["verbose"]
    old = OrtFullGraphTrainer.__new__(OrtFullGraphTrainer)
    old.__setstate__(state)
    assert old.verbose is False
    np.testing.assert_array_equal(old.predict(X), trainer.predict(X))
