"""Time of one training step: ortbridge vs the raw TrainingAgent vs torch eager.

A step is forward, loss, backward and a torch SGD step. Three ways, on the
same weights and batch:

- ``eager``: the torch model itself;
- ``raw``: the TrainingAgent loop on the very gradient graph ortbridge builds,
  driven by hand (DLPack in and out, loss gradient from torch, SGD in torch):
  the floor any bridge can reach;
- ``ortbridge``: ``OnnxModule`` + ``torch.optim.SGD``.

Hypothesis: the bridge adds almost nothing to the raw loop (ortbridge / raw
<= 1.05) and, with onnxruntime's threads set not to fight torch's, a step on
the MLP is no slower than torch eager (ortbridge / eager <= 1.0).

Repetitions are interleaved (each round times every variant), the medians
are compared; results go to a JSON file and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models  # noqa: E402

from ortbridge import OnnxModule  # noqa: E402
from ortbridge._runtime import from_ortvalues, to_ortvalues  # noqa: E402

LR = 0.01


def _no_mark(name):
    pass


class RawAgentLoop:
    """The TrainingAgent driven by hand on the gradient graph of ``layer``."""

    def __init__(self, layer: OnnxModule, x: torch.Tensor):
        self.layer = layer
        self.params = [p for _, p in layer.named_onnx_parameters()]
        needs = [False] * len(layer.input_names) + [
            isinstance(layer.onnx_weight(n), torch.nn.Parameter) for n in layer._weight_names
        ]
        self.graph = layer._bridge.gradient_graph("train", needs, x.device)
        self.weights = [layer.onnx_weight(n) for n in layer._weight_names]
        self.names = layer._bridge.feed_names
        self.param_of = {n: layer.onnx_weight(n) for n, _ in layer.named_onnx_parameters()}

    def step(self, optimizer, loss_fn, x, y, mark=None):
        """One step; ``mark(name)``, if given, is called at each hand-over (bench_step_parts)."""
        from ortbridge._ort import capi

        C = capi()
        mark = mark or _no_mark
        pinning = self.graph.pinning  # onnxruntime's workers kept off this core, as ortbridge does
        mark("start")
        optimizer.zero_grad(set_to_none=True)
        mark("zero_grad")
        feeds = dict(zip(self.names, [x, *(w.detach() for w in self.weights)]))
        inputs = to_ortvalues([feeds[n] for n in self.graph.feed_names])
        outputs, state = C.OrtValueVector(), C.PartialGraphExecutionState()
        if pinning is not None:
            pinning.follow()
        self.graph.agent.run_forward(inputs, outputs, state, None)
        out = from_ortvalues(outputs)[0].requires_grad_()
        mark("forward")
        loss = loss_fn(out, y)
        mark("loss")
        loss.backward()
        mark("loss_backward")
        grads = C.OrtValueVector()
        if pinning is not None:
            pinning.follow()
        self.graph.agent.run_backward(to_ortvalues([out.grad]), grads, state)
        for name, grad in zip(self.graph.grad_targets, from_ortvalues(grads)):
            self.param_of[name].grad = grad
        mark("backward")
        optimizer.step()
        mark("step")
        return loss


def measure(name: str, device: torch.device, rounds: int, steps: int) -> dict:
    factory, _, _ = _models.MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x, y = _models.data(name, device)
    proto = _models.export(model, x.cpu())
    model.to(device)
    layer = OnnxModule(proto).to(device)
    raw = RawAgentLoop(OnnxModule(proto).to(device), x)
    loss_fn = _models.loss_fn(name)
    variants = {
        "eager": (model, torch.optim.SGD(model.parameters(), lr=LR)),
        "raw": (raw, torch.optim.SGD(raw.params, lr=LR)),
        "ortbridge": (layer, torch.optim.SGD(layer.parameters(), lr=LR)),
    }

    def run(variant):
        module, optimizer = variants[variant]
        if variant == "raw":
            return module.step(optimizer, loss_fn, x, y)
        return _models.train_step(module, optimizer, loss_fn, x, y)

    first = {v: run(v).item() for v in variants}  # same weights: same first loss
    for v in variants:  # warm-up
        for _ in range(steps):
            run(v)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                run(v)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[v].append((time.perf_counter() - start) / steps * 1e3)
    medians = {v: statistics.median(t) for v, t in times.items()}
    return {
        "model": name,
        "first_loss": first,
        "ms": medians,
        "all_ms": times,
        "ortbridge/raw": medians["ortbridge"] / medians["raw"],
        "ortbridge/eager": medians["ortbridge"] / medians["eager"],
        "raw/eager": medians["raw"] / medians["eager"],
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = ["eager", "raw", "ortbridge"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.26
    for i, v in enumerate(variants):
        xs = [k + (i - 1) * width for k in range(len(results))]
        ax.bar(xs, [r["ms"][v] / r["ms"]["eager"] for r in results], width, label=v)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(results)), [r["model"] for r in results])
    ax.set_ylabel("step time / torch eager")
    ax.set_title("One training step (median), lower is better")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=list(_models.MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps timed per round")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results = []
    for name in args.models:
        print(f"measuring {name} ...", flush=True)
        results.append(measure(name, device, args.rounds, args.steps))
    header = f"{'model':12s} {'eager ms':>9s} {'raw ms':>9s} {'ortbridge':>9s} "
    header += f"{'ob/raw':>7s} {'ob/eager':>8s} {'raw/eager':>9s}"
    print(header)
    for r in results:
        ms = r["ms"]
        print(
            f"{r['model']:12s} {ms['eager']:9.3f} {ms['raw']:9.3f} {ms['ortbridge']:9.3f} "
            f"{r['ortbridge/raw']:7.3f} {r['ortbridge/eager']:8.3f} {r['raw/eager']:9.3f}"
        )
    for r in results:
        losses = ", ".join(f"{k} {v:.5f}" for k, v in r["first_loss"].items())
        print(f"first-step loss {r['model']}: {losses}")
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    info = {
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": __import__("onnxruntime").__version__,
        "device": str(device),
    }
    with open(os.path.join(args.out, f"bench_step{suffix}.json"), "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, f"bench_step{suffix}.png"))
    print(f"wrote {args.out}/bench_step{suffix}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
