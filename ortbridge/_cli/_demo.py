"""The main job: train a torch model with an ONNX layer inside on scikit-learn's digits."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from .._prepare._onnx_utils import make_model


def onnx_head(n_in: int, hidden: int, n_out: int, seed: int = 0):
    """An ONNX MLP head (Gemm, Relu, Gemm) with random weights, as a user might receive."""
    rng = np.random.default_rng(seed)

    def init(shape, fan_in):
        return (rng.uniform(-1, 1, shape) / np.sqrt(fan_in)).astype(np.float32)

    inits = {
        "fc1.weight": init((hidden, n_in), n_in),
        "fc1.bias": init((hidden,), n_in),
        "fc2.weight": init((n_out, hidden), hidden),
        "fc2.bias": init((n_out,), hidden),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["features", "fc1.weight", "fc1.bias"], ["h"], transB=1),
            helper.make_node("Relu", ["h"], ["a"]),
            helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"], transB=1),
        ],
        "digits_head",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", n_out])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return make_model(graph)


def run_demo(
    epochs: int = 15, output: str = "ortbridge_demo.onnx", seed: int = 0, out=None
) -> dict:
    """Train, report, export and check; return the figures (also printed)."""
    out = out if out is not None else sys.stdout
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # the demo's data ships with scikit-learn
        raise SystemExit("the demo needs scikit-learn: pip install scikit-learn") from exc
    from .. import OnnxModule
    from .._runtime._ort import runtime as onnxruntime

    torch.manual_seed(seed)
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=0.25, random_state=seed, stratify=y
    )
    X_train, X_test = torch.from_numpy(X_train), torch.from_numpy(X_test)
    y_train, y_test = torch.from_numpy(y_train), torch.from_numpy(y_test)

    head = OnnxModule(onnx_head(32, 64, 10, seed))
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), head)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    print(f"digits: {len(X_train)} training and {len(X_test)} test images, 10 classes", file=out)
    print(f"model: {model}", file=out)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(len(X_train))
        total = 0.0
        for batch in order.split(32):
            optimizer.zero_grad()
            loss = loss_fn(model(X_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        accuracy = _accuracy(model, X_test, y_test)
        print(
            f"epoch {epoch:2d}/{epochs}  loss {total / len(X_train):.4f}  "
            f"test accuracy {accuracy:.3f}  ({time.perf_counter() - start:.1f} s)",
            file=out,
            flush=True,
        )
    head.save(output)
    # The trained ONNX file, run by plain onnxruntime inference, must give
    # the module's outputs.
    model.eval()
    with torch.no_grad():
        features = model[1](model[0](X_test))
        expected = head(features).numpy()
    session = onnxruntime().InferenceSession(output, providers=["CPUExecutionProvider"])
    got = session.run(None, {"features": features.numpy()})[0]
    max_diff = float(np.abs(got - expected).max())
    print(f"wrote {output}; onnxruntime inference vs module: max abs diff {max_diff:.2e}", file=out)
    print(f"final test accuracy {accuracy:.3f} (chance: 0.100)", file=out)
    return {"accuracy": accuracy, "max_diff": max_diff, "output": output}


def _accuracy(model, X, y) -> float:
    model.eval()
    with torch.no_grad():
        return (model(X).argmax(dim=1) == y).float().mean().item()
