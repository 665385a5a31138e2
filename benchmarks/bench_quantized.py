"""A quantized file's training step against its float twin's.

The twin: a CNN and an MLP exported from torch; the quantized file: the same
file through onnxruntime's ``quantize_static`` (QDQ, per channel, uint8
activations; ``--per-tensor`` for one scale a tensor, which the training
agent also trains). Ways, side by side in one process (interleaved rounds,
medians of one step: forward, backward of ``sum(out * w)``, gradients set to
None first), per engine installed:

- ``float``: the float file, ``OnnxModule(path, backend=engine)``;
- ``int8``: the quantized file, its weights trained under fake quantization.

Hypothesis (issue 45): fake quantization costs a pair of elementwise nodes
per quantized tensor forward and a mask product backward: at most 1.5x the
float step where the convolutions dominate, more where the tensors are
small and the pairs many. Printed: ms per step and int8 / float, per model
and batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

import ortbridge
from ortbridge import _engines


class _Cnn(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(width, 2 * width, 3, padding=1), torch.nn.ReLU(),
        )  # fmt: skip
        self.head = torch.nn.Linear(2 * width, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
            torch.nn.ReLU(), torch.nn.Linear(512, 10),
        )  # fmt: skip

    def forward(self, x):
        return self.net(x)


_MODELS = {"cnn": (_Cnn, (3, 32, 32)), "mlp": (_Mlp, (256,))}


def _files(root, per_channel):
    from onnxruntime.quantization import (
        QuantFormat,
        QuantType,
        quantize_static,
    )

    out = {}
    for name, (net, shape) in _MODELS.items():
        torch.manual_seed(0)
        source = os.path.join(root, f"{name}.onnx")
        torch.onnx.export(
            net().eval(), (torch.randn(2, *shape),), source, dynamo=False, opset_version=17,
            input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}},
        )  # fmt: skip
        batches = [
            {"x": np.random.default_rng(i).standard_normal((8, *shape)).astype("f")}
            for i in range(4)
        ]
        target = os.path.join(root, f"{name}-int8.onnx")
        quantize_static(
            source, target, _Reader(batches), quant_format=QuantFormat.QDQ, per_channel=per_channel,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
        )  # fmt: skip
        out[name] = (source, target, shape)
    return out


class _Reader:
    """Calibration batches for the quantizer (its CalibrationDataReader's protocol)."""

    def __init__(self, batches):
        self._left = iter(batches)

    def get_next(self):
        return next(self._left, None)


def _step(layer, x, w):
    for p in layer.parameters():
        p.grad = None
    start = time.perf_counter()
    (layer(x) * w).sum().backward()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-tensor", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as root:
        files = _files(root, per_channel=not args.per_tensor)
        print(f"{'model':5s} {'batch':>5s} {'engine':15s} {'float ms':>9s} {'int8 ms':>9s} ratio")
        for name, (source, target, shape) in files.items():
            for batch in args.batches:
                x = torch.randn(batch, *shape)
                for engine in _engines.installed():
                    try:
                        layers = {k: ortbridge.OnnxModule(p, backend=engine)
                                  for k, p in (("float", source), ("int8", target))}  # fmt: skip
                        w = torch.randn(layers["float"](x).shape)
                        for layer in layers.values():
                            for _ in range(3):
                                _step(layer, x, w)
                    except ortbridge.OrtBridgeError as exc:
                        print(f"{name:5s} {batch:5d} {engine:15s} refused: {str(exc)[:90]}")
                        continue
                    times = {k: [] for k in layers}
                    for _ in range(args.rounds):  # interleaved
                        for key, layer in layers.items():
                            times[key].append(_step(layer, x, w))
                    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
                    ratio = ms["int8"] / ms["float"]
                    print(f"{name:5s} {batch:5d} {engine:15s} {ms['float']:9.2f} "
                          f"{ms['int8']:9.2f} {ratio:5.2f}")  # fmt: skip
                    results.append(dict(model=name, batch=batch, engine=engine, **ms, ratio=ratio))
    if args.json:
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_step import _cpu_model

        machine = {"cpu": _cpu_model(), "cores": os.cpu_count()}
        import onnxruntime

        machine.update(torch=torch.__version__, onnxruntime=onnxruntime.__version__)
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
