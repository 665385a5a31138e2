"""The main job (``python -m ortbridge demo``) and ``python -m ortbridge inspect``."""

from __future__ import annotations

import io

import onnx
import pytest
import torch
from test_errors import _mod_model

from ortbridge import OnnxModule
from ortbridge.__main__ import main
from ortbridge._demo import run_demo
from ortbridge._examples import linear_model


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
