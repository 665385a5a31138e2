"""The main job (``python -m ortbridge demo``), ``python -m ortbridge inspect`` (text and
JSON), ``--version`` and ``--help``."""

from __future__ import annotations

import io
import json

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper
from test_errors import _mod_model

from ortbridge import OnnxModule
from ortbridge.__main__ import main
from ortbridge._cli._demo import run_demo
from ortbridge._runtime import _ort
from ortbridge._runtime._limits import limits
from ortbridge.examples import linear_model


def test_demo_learns_and_exports(tmp_path):
    out = io.StringIO()
    path = tmp_path / "demo.onnx"
    result = run_demo(epochs=6, output=str(path), out=out)
    text = out.getvalue()
    assert "epoch  6/6" in text and "test accuracy" in text  # progress shown
    assert result["accuracy"] > 0.85  # chance is 0.1
    assert result["max_diff"] < 1e-5
    exported = onnx.load(str(path))
    reloaded = OnnxModule(exported)
    assert len(list(reloaded.named_onnx_parameters())) == 4


def test_demo_command_exit_code(tmp_path):
    assert main(["demo", "--epochs", "4", "--output", str(tmp_path / "d.onnx")]) == 0


def test_inspect_trainable_model(tmp_path, capsys):
    path = tmp_path / "linear.onnx"
    onnx.save(linear_model(3, 2), str(path))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "x: float32 (batch, 3)" in text
    assert "weight: trainable float32 (2, 3) (6 values)" in text
    assert "a gradient graph can be built" in text


@pytest.mark.engines("training-agent")
def test_inspect_names_blocking_node(tmp_path, capsys, backend):
    path = tmp_path / "mod.onnx"
    onnx.save(_mod_model(), str(path))
    assert main(["inspect", str(path), "--backend", backend]) == 1
    text = capsys.readouterr().out
    assert "no gradient graph" in text and "'wrap_around' (op type Mod)" in text


@pytest.mark.engines("onnxruntime")
def test_inspect_says_which_engine_trains_and_why(tmp_path, capsys, backend):
    # The training build has no gradient for Mod; the onnxruntime engine has one,
    # so "auto" trains it there, in either environment.
    path = tmp_path / "mod.onnx"
    onnx.save(_mod_model(), str(path))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "engine: onnxruntime (" in text
    assert "training: a gradient graph can be built" in text


def test_inspect_names_declared_shapes_the_graph_contradicts(tmp_path, capsys):
    """A graph output declared (batch, 2) where the graph computes (batch, 3, 2),
    and an intermediate declared (4) where it computes (batch, 3, 2): each named,
    with both shapes, in text and JSON; the model trains as it computes."""
    weight = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "weight"], ["h"]),
            helper.make_node("Tanh", ["h"], ["y"]),
        ],
        "rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [onnx.numpy_helper.from_array(weight, "weight")],
        value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "declared.onnx"
    onnx.save(model, str(path))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "declared shapes the graph contradicts" in text
    assert "graph output 'y': declared (batch, 2), computed (batch, 3, 2)" in text
    assert "value_info 'h': declared (4), computed (batch, 3, 2)" in text
    assert "outputs:\n  y: float32 (batch, 3, 2)" in text
    assert "a gradient graph can be built" in text
    assert main(["inspect", str(path), "--json"]) == 0
    wrong = {w["name"]: w for w in json.loads(capsys.readouterr().out)["wrong_shapes"]}
    assert wrong["y"] == {
        "name": "y",
        "where": "graph output",
        "declared": ["batch", 2],
        "computed": ["batch", 3, 2],
    }


def test_inspect_missing_file(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "none.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_save_roundtrip(tmp_path):
    layer = OnnxModule(linear_model(3, 2))
    with torch.no_grad():
        layer.weight.add_(1.0)
    layer.save(tmp_path / "w.onnx")
    again = OnnxModule(tmp_path / "w.onnx")
    torch.testing.assert_close(again.weight, layer.weight)


def test_inspect_check_compares_gradients_with_finite_differences(tmp_path, capsys):
    path = tmp_path / "linear.onnx"
    onnx.save(linear_model(3, 2), str(path))
    assert main(["inspect", str(path), "--check"]) == 0
    text = capsys.readouterr().out
    assert "gradcheck (" in text and "): passed" in text
    assert "weight  weight" in text and "x       input" in text


def test_inspect_check_fails_on_a_wrong_gradient(tmp_path, capsys, monkeypatch):
    from ortbridge import _gradcheck

    real = _gradcheck._module_gradients

    def wrong(*args):
        return [g * 1.5 for g in real(*args)]

    monkeypatch.setattr(_gradcheck, "_module_gradients", wrong)
    path = tmp_path / "linear.onnx"
    onnx.save(linear_model(3, 2), str(path))
    assert main(["inspect", str(path), "--check"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_version(capsys):
    import ortbridge

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ortbridge {ortbridge.__version__}"


@pytest.mark.parametrize("argv", [[], ["inspect"], ["demo"]], ids=["main", "inspect", "demo"])
def test_help_is_plain_text(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: python -m ortbridge" in text
    assert "``" not in text and ":func:" not in text


def test_inspect_lists_op_types_engine_and_providers(tmp_path, capsys):
    path = tmp_path / "linear.onnx"
    onnx.save(linear_model(3, 2), str(path))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    layer = OnnxModule(linear_model(3, 2))
    assert "op types: Gemm x1\n" in text
    assert f"engine: {layer.backend} ({layer.backend_reason})\n" in text
    assert "providers: CPUExecutionProvider on the CPU (onnxruntime " in text
    # Its one node has no name: the only rewrite, so that errors can name it.
    assert "rewrites before onnxruntime sees the graph:\n  unnamed nodes named: 1\nfloat" in text
    named = linear_model(3, 2)
    named.graph.node[0].name = "fc"
    onnx.save(named, str(path))
    assert main(["inspect", str(path)]) == 0
    assert "rewrites before onnxruntime sees the graph: none\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("torch_cuda", "provider", "built_for", "says"),
    [
        (None, False, None, "onnxruntime 1.31.1 has no CUDAExecutionProvider; torch {torch} is a "
         "CPU build (torch.version.cuda is None): to run on a GPU, install a CUDA build"),
        ("12.8", False, None, "onnxruntime 1.31.1 has no CUDAExecutionProvider; torch {torch} is "
         "built for CUDA 12.8: `pip install onnxruntime-gpu==1.26.0`"),
        ("12.8", True, "13.0", "onnxruntime-gpu 1.31.1 is built for CUDA 13.0; torch {torch} is "
         "built for CUDA 12.8: `pip install onnxruntime-gpu==1.26.0`"),
        ("11.8", True, "13.0", "onnxruntime-gpu 1.31.1 is built for CUDA 13.0; torch {torch} is "
         'built for CUDA 11.8: `pip install "ortbridge[cuda]"`'),
        ("13.0", True, "13.0", "onnxruntime-gpu 1.31.1 is built for CUDA 13.0, torch {torch} for "
         "CUDA 13.0: they match"),
    ],
    ids=["cpu-torch", "cpu-onnxruntime", "cuda12-torch", "cuda11.8-torch", "matching"],
)  # fmt: skip
def test_inspect_says_which_onnxruntime_suits_torchs_cuda(
    tmp_path, capsys, monkeypatch, torch_cuda, provider, built_for, says
):
    """Found (torch's CUDA version, onnxruntime's package, provider and CUDA build)
    and wanted (the package for torch's CUDA), without a GPU: both substituted."""
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    package = "onnxruntime-gpu 1.31.1" if provider else "onnxruntime 1.31.1"
    monkeypatch.setattr(_ort, "build", lambda: (package, built_for))
    available = ["CUDAExecutionProvider"] * provider + ["CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: available)
    path = tmp_path / "linear.onnx"
    onnx.save(linear_model(3, 2), str(path))
    assert main(["inspect", str(path)]) == 0
    says = says.format(torch=torch.__version__)
    assert f"\ncuda: {says}" in capsys.readouterr().out
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["cuda"]
    assert info["text"].startswith(says)
    assert (info["torch"], info["provider"], info["onnxruntime"]) == (
        torch_cuda,
        provider,
        built_for,
    )
    assert info["install"] == (None if says.endswith("they match") else _ort.cuda_hint())


def _rewritten_model(opset: int):
    """An unnamed Gemm, a Dropout without its mask output and (opset >= 15) a CastLike."""
    weight = onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "fc.weight")
    nodes = [
        helper.make_node("Gemm", ["x", "fc.weight"], ["h"], transB=1),
        helper.make_node("Dropout", ["h"], ["d" if opset >= 15 else "y"]),
    ]
    if opset >= 15:
        nodes.append(helper.make_node("CastLike", ["d", "x"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "rewritten",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_inspect_names_the_rewrites_ortbridge_applies(tmp_path, capsys):
    model = _rewritten_model(15)
    model.ir_version = 99  # newer than any onnxruntime reads: lowered
    path = tmp_path / "new.onnx"
    onnx.save(model, str(path))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    max_ir, _ = limits()
    assert "op types: Gemm x1, Dropout x1, CastLike x1\n" in text
    assert f"  IR version 99 -> {max_ir}\n" in text
    assert "  nodes replaced: CastLike x1; added: Cast x1\n" in text
    assert "  optional outputs named: Dropout x1\n" in text
    assert "  unnamed nodes named: 3\n" in text

    old = _rewritten_model(11)
    old.ir_version = 6
    path = tmp_path / "old.onnx"
    onnx.save(old, str(path))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "  ai.onnx opset 11 -> 13 (onnx's version converter)\n" in text
    assert "  IR version 6 -> 7\n" in text


def test_inspect_json_says_the_same(tmp_path, capsys):
    path = tmp_path / "new.onnx"
    onnx.save(_rewritten_model(15), str(path))
    assert main(["inspect", str(path), "--json", "--check"]) == 0
    info = json.loads(capsys.readouterr().out)
    layer = OnnxModule(_rewritten_model(15))
    assert info["graph"] == "rewritten" and info["nodes"] == 3
    assert info["op_types"] == {"Gemm": 1, "Dropout": 1, "CastLike": 1}
    assert info["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["n", 3]}]
    assert info["rewrites"]["nodes_removed"] == {"CastLike": 1}
    assert info["rewrites"]["nodes_added"] == {"Cast": 1}
    assert info["rewrites"]["outputs_named"] == {"Dropout": 1}
    assert info["engine"] == {
        "backend": layer.backend,
        "reason": layer.backend_reason,
        "requested": "auto",
    }
    assert info["providers"]["used"] == ["CPUExecutionProvider"]
    assert "CPUExecutionProvider" in info["providers"]["available"]
    assert info["initializers"] == [
        {
            "name": "fc.weight",
            "trainable": True,
            "from_constant": False,
            "dtype": "float32",
            "shape": [2, 3],
            "size": 6,
        }
    ]
    assert info["training"] == {"ok": True, "error": None}
    assert info["check"]["passed"] is True
    assert [(e["name"], e["kind"]) for e in info["check"]["entries"]] == [
        ("x", "input"),
        ("fc.weight", "weight"),
    ]


@pytest.mark.engines("training-agent")
def test_inspect_json_of_a_model_that_does_not_train(tmp_path, capsys, backend):
    path = tmp_path / "mod.onnx"
    onnx.save(_mod_model(), str(path))
    assert main(["inspect", str(path), "--backend", backend, "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["engine"]["backend"] is None
    assert info["training"]["ok"] is False and "(op type Mod)" in info["training"]["error"]


def test_inspect_json_of_a_missing_file(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "none.onnx"), "--json"]) == 2
    captured = capsys.readouterr()
    assert "does not exist" in json.loads(captured.out)["error"]
    assert "does not exist" in captured.err


def test_inspect_says_a_bfloat16_file_computes_in_float32(tmp_path, capsys):
    """The file's bfloat16 inputs, outputs and weights shown as such, and the
    float32 computation listed among the rewrites."""
    weight = helper.make_tensor("fc.weight", TensorProto.BFLOAT16, [3, 2], [0.5] * 6)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "fc.weight"], ["y"])],
        "bf16",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["n", 2])],
        [weight],
    )
    path = tmp_path / "bf16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "  x: bfloat16 (n, 3)\n" in text and "  y: bfloat16 (n, 2)\n" in text
    assert "  bfloat16 computed in float32 (1 weight;" in text
    assert "  fc.weight: trainable bfloat16 (3, 2)" in text
    assert "training: a gradient graph can be built" in text
