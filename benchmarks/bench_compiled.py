"""A torch model holding an ONNX layer, eager and under ``torch.compile``.

The model: a torch Linear, the MLP of ``bench_step.py`` as an ONNX layer, a
torch head. Ways, side by side in one process (interleaved rounds, medians
of a training step: forward, backward of a cross-entropy loss, SGD step):

- ``torch``: the same model all in torch, eager; ``torch compiled``: it under
  ``torch.compile(fullgraph=True)``;
- ``eager``: the ONNX layer through ortbridge's autograd Function (today's
  eager path);
- ``op``: the layer through the traced path's torch operator, called eagerly
  (``ortbridge::onnx_layer`` and its backward operator): the operator's cost
  against the Function's;
- ``compiled``: the model under ``torch.compile(fullgraph=True)``, the layer
  a node of the compiled graph.

Hypothesis (issue 44): a compiled model with ONNX layers trains at about
eager's speed (the operator's backward runs the layer's forward again: one
forward more per step), and the operator adds little per call over the
Function. Printed per batch size: ms per step and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from torch import nn

import ortbridge
from ortbridge import _prepare, _torch_op

HERE = os.path.dirname(os.path.abspath(__file__))


def _models(device):
    import sys

    sys.path.insert(0, HERE)
    from _models import export, mlp

    torch.manual_seed(0)
    inner = mlp()
    proto = export(inner, torch.randn(2, 784))
    first, head = nn.Linear(64, 784), nn.Linear(10, 10)
    layer = ortbridge.OnnxModule(proto)
    ours = nn.Sequential(first, layer, head).to(device)
    reference = nn.Sequential(nn.Linear(64, 784), inner, nn.Linear(10, 10)).to(device)
    reference.load_state_dict(
        {k: v for k, v in zip(reference.state_dict(), ours.state_dict().values())}
    )
    return ours, reference, layer


class _OpPath(nn.Module):
    """The ONNX layer through the operator, eagerly (no compilation)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        layer = self.layer
        tensors = [x] + [layer.onnx_weight(n) for n in layer._weight_names]
        mode = _prepare.TRAIN if layer.training else _prepare.EVAL
        (out,) = _torch_op.call(layer._op_key, layer._bridge, mode, tensors)
        return out


def _step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ours, reference, layer = _models(device)
    op_model = nn.Sequential(ours[0], _OpPath(layer), ours[2])
    torch._dynamo.reset()
    ways = {
        "torch": reference,
        "torch compiled": torch.compile(reference, fullgraph=True),
        "eager": ours,
        "op": op_model,
        "compiled": torch.compile(ours, fullgraph=True),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in ways.items()}
    results = {}
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        for name, model in ways.items():  # warm-up: builds and compilations
            for _ in range(3):
                _step(model, optimizers[name], x, y)
        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, model in ways.items():
                sync()
                start = time.perf_counter()
                for _ in range(args.steps):
                    _step(model, optimizers[name], x, y)
                sync()
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        results[batch] = ms
        print(f"batch {batch}: " + ", ".join(f"{n} {v:.3f} ms" for n, v in ms.items()))
        print(
            f"  op/eager {ms['op'] / ms['eager']:.2f}, compiled/eager "
            f"{ms['compiled'] / ms['eager']:.2f}, compiled/torch compiled "
            f"{ms['compiled'] / ms['torch compiled']:.2f}, eager/torch "
            f"{ms['eager'] / ms['torch']:.2f}"
        )
    os.makedirs(args.out, exist_ok=True)
    suffix = "_cuda" if device.type == "cuda" else ""
    path = os.path.join(args.out, f"bench_compiled{suffix}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "machine": platform.processor() or platform.machine(),
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "ms": results,
            },
            f,
            indent=1,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
