"""A torch model holding an ONNX layer, eager and under ``torch.compile``.

The model: a torch Linear, the MLP of ``bench_step.py`` as an ONNX layer, a
torch head. Ways, side by side in one process (interleaved rounds, medians
of a training step: forward, backward of a cross-entropy loss, SGD step):

- ``torch``: the same model all in torch, eager; ``torch compiled``: it under
  ``torch.compile(fullgraph=True)``;
- ``eager``: the ONNX layer through ortbridge's autograd Function (today's
  eager path);
- ``compiled``: the model under ``torch.compile(fullgraph=True)``, the layer
  a node of the compiled graph.

And the layer alone, forward and backward for a given output gradient:

- ``function``: through the autograd Function (eager);
- ``operator``: through the operators as a compiled graph calls them
  (``ortbridge::onnx_layer_saving``, then ``onnx_layer_saved_backward`` with
  its handle): the operator's cost against the Function's.

Hypothesis (issue 44): the operator costs no more per call than the
Function, and a compiled model with ONNX layers trains at about eager's
speed, apart from what ``torch.compile`` itself costs per step at small
batches (``torch compiled`` against ``torch``). Printed per batch size: ms
per step and the ratios.
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
from ortbridge import _prepare

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


def _layer_ways(layer, batch, device):
    """Forward and backward of the layer alone: through the Function, and
    through the operators as a compiled graph calls them (no autograd)."""
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 784, generator=gen).to(device).requires_grad_()
    grad = torch.randn(batch, 10, generator=gen).to(device)
    tensors = [x] + [layer.onnx_weight(n) for n in layer._weight_names]
    needs = [t.requires_grad for t in tensors]
    key, mode = layer._op_key, _prepare.EVAL
    forward = torch.ops.ortbridge.onnx_layer_saving.default
    backward = torch.ops.ortbridge.onnx_layer_saved_backward.default

    def function():
        layer(x).backward(grad)

    def operator():
        with torch.no_grad():
            *outputs, handle = forward(key, mode, tensors, needs)
            backward(key, mode, handle, tensors, outputs, [grad], needs)

    return {"function": function, "operator": operator}


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
    torch._dynamo.reset()
    models = {
        "torch": reference,
        "torch compiled": torch.compile(reference, fullgraph=True),
        "eager": ours,
        "compiled": torch.compile(ours, fullgraph=True),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    results = {}
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        ways = {
            name: (lambda m=model, o=optimizers[name], x=x, y=y: _step(m, o, x, y))
            for name, model in models.items()
        }
        ways.update(_layer_ways(layer, batch, device))
        for way in ways.values():  # warm-up: builds and compilations
            for _ in range(3):
                way()
        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                sync()
                start = time.perf_counter()
                for _ in range(args.steps):
                    way()
                sync()
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        results[batch] = ms
        print(f"batch {batch}: " + ", ".join(f"{n} {v:.3f} ms" for n, v in ms.items()))
        print(
            f"  operator/function {ms['operator'] / ms['function']:.2f}, compiled/eager "
            f"{ms['compiled'] / ms['eager']:.2f}, compiled/torch compiled "
            f"{ms['compiled'] / ms['torch compiled']:.2f}, eager/torch "
            f"{ms['eager'] / ms['torch']:.2f}, torch compiled/torch "
            f"{ms['torch compiled'] / ms['torch']:.2f}"
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
