"""Bad input gets a clear OrtBridgeError naming the input and what was expected."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ortbridge import OnnxModule, OrtBridgeError
from ortbridge._prepare._onnx_utils import make_model
from ortbridge._runtime import _ort
from ortbridge.examples import linear_model
from ortbridge.exceptions import (
    MissingDependencyError,
    NotDifferentiableError,
    OnnxInputError,
    OnnxModelError,
    OnnxTypeError,
)


@pytest.fixture
def layer():
    return OnnxModule(linear_model(3, 2))


def test_wrong_number_of_inputs(layer):
    with pytest.raises(OnnxInputError, match=r"takes 1 input\(s\) \['x'\], got 2"):
        layer(torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(OnnxInputError, match=r"missing input\(s\) \['x'\]"):
        layer()
    with pytest.raises(OnnxInputError, match="unknown input 'y'"):
        layer(y=torch.ones(2, 3))


def test_keyword_input(layer):
    x = torch.ones(2, 3)
    torch.testing.assert_close(layer(x=x), layer(x))


def test_wrong_dtype(layer):
    with pytest.raises(OnnxTypeError, match=r"input 'x' must be torch.float32, got torch.int64"):
        layer(torch.ones(2, 3, dtype=torch.int64))
    assert issubclass(OnnxTypeError, TypeError) and issubclass(OnnxTypeError, OrtBridgeError)
    with pytest.raises(OnnxTypeError, match="input 'x' must be a torch.Tensor, got ndarray"):
        layer(np.ones((2, 3), np.float32))


def test_wrong_rank_or_fixed_dimension(layer):
    with pytest.raises(OnnxInputError, match=r"input 'x' must have shape \(batch, 3\), got \(3,\)"):
        layer(torch.ones(3))
    with pytest.raises(OnnxInputError, match=r"must have shape \(batch, 3\), got \(2, 4\)"):
        layer(torch.ones(2, 4))
    assert issubclass(OnnxInputError, ValueError)


def test_unknown_trainable_name():
    with pytest.raises(OnnxInputError, match=r"unknown trainable initializer\(s\) \['wieght'\]"):
        OnnxModule(linear_model(3, 2), trainable=["wieght"])


def test_trainable_subset_and_callable():
    layer = OnnxModule(linear_model(3, 2), trainable=["bias"])
    assert [n for n, _ in layer.named_onnx_parameters()] == ["bias"]
    assert "weight" in dict(layer.named_buffers())
    layer = OnnxModule(linear_model(3, 2), trainable=lambda name, a: a.ndim == 2)
    assert [n for n, _ in layer.named_onnx_parameters()] == ["weight"]


def test_missing_and_corrupt_file(tmp_path):
    with pytest.raises(OnnxModelError, match="does not exist"):
        OnnxModule(tmp_path / "nope.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01 certainly not protobuf \xff\xfe" * 10)
    with pytest.raises(OnnxModelError, match="is not a valid ONNX model"):
        OnnxModule(bad)
    with pytest.raises(OnnxTypeError, match="model must be a path, bytes or onnx.ModelProto"):
        OnnxModule(42)


def _mod_model():
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["xw"], name="scale"),
            helper.make_node("Mod", ["xw", "m"], ["y"], name="wrap_around", fmod=1),
        ],
        "with_mod",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [
            numpy_helper.from_array(np.ones(3, np.float32), "w"),
            numpy_helper.from_array(np.full(3, 2.0, np.float32), "m"),
        ],
    )
    return make_model(graph)


@pytest.mark.engines("training-agent")
def test_operator_without_gradient_names_node_and_op(
    backend,
):
    with pytest.raises(NotDifferentiableError, match=r"node 'wrap_around' \(op type Mod\)"):
        OnnxModule(_mod_model(), trainable=["w"], backend=backend)
    # Nothing to train: inference still works.
    layer = OnnxModule(_mod_model(), trainable=[], backend=backend)
    out = layer(torch.full((1, 3), 3.0))
    torch.testing.assert_close(out, torch.ones(1, 3))


def test_weights_dtype_change_is_refused(layer):
    layer.double()
    with pytest.raises(OrtBridgeError, match=r"weight 'weight' is torch.float64 but the ONNX"):
        layer(torch.ones(2, 3, dtype=torch.float64))


def test_missing_onnxruntime_says_what_to_install():
    code = (
        "import sys; sys.modules['onnxruntime'] = None\n"
        "import ortbridge\n"
        "from ortbridge.examples import linear_model\n"
        "try:\n"
        "    ortbridge.OnnxModule(linear_model(3, 2))\n"
        "except ortbridge.OrtBridgeError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("MissingDependencyError")
    assert "ortbridge[ort]" in out.stdout and "ortbridge[cpu]" in out.stdout
    assert issubclass(MissingDependencyError, ImportError)


@pytest.mark.parametrize(
    ("cuda", "hip", "wanted"),
    [
        ("13.0", None, '`pip install "ortbridge[ort-gpu]"` (onnxruntime-gpu 1.31.1, built for'),
        ("12.8", None, "`pip install onnxruntime-gpu==1.26.0` (the last onnxruntime-gpu built"),
        ("12.1", None, "`pip install onnxruntime-gpu==1.26.0`"),
        ("11.8", None, '`pip install "ortbridge[cuda]"` (onnxruntime-training 1.19.2, built'),
        ("10.2", None, "no onnxruntime package matches: install a torch built for CUDA 13"),
        (None, None, "is a CPU build (torch.version.cuda is None): to run on a GPU, install"),
        (None, "6.4", "is a ROCm build (torch.version.cuda is None): to run on a GPU, install"),
    ],
    ids=["cuda13", "cuda12.8", "cuda12.1", "cuda11.8", "cuda10", "cpu-torch", "rocm-torch"],
)
def test_cuda_hint_names_the_package_for_torchs_cuda(monkeypatch, cuda, hip, wanted):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    hint = _ort.cuda_hint()
    assert hint.startswith(f"torch {torch.__version__} is ")
    assert wanted in hint
    if cuda:
        assert f"is built for CUDA {cuda}" in hint


def test_aten_node_is_refused_with_its_name():
    graph = helper.make_graph(
        [
            helper.make_node(
                "ATen",
                ["x"],
                ["y"],
                name="max_pool_aten",
                domain="org.pytorch.aten",
                operator="max_pool2d_with_indices",
            )
        ],
        "aten",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )
    model = make_model(graph, extra_opsets={"org.pytorch.aten": 1})
    with pytest.raises(OnnxModelError, match=r"node 'max_pool_aten' \(ATen of domain"):
        OnnxModule(model)
