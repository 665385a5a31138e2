"""Where onnxruntime's worker threads run: pinned off the caller's core, or left to Linux.

Several ``OnnxModule`` copies of one model train side by side in one process,
each with its own onnxruntime session (and its own worker threads), in
shuffled interleaved rounds. Half of them keep ortbridge's pinning (workers
allowed every core but the calling thread's), half have it removed, which
leaves the placement to the system as onnxruntime does with explicit thread
counts. The spread of the per-copy medians shows how much a session's
placement decides; torch eager is timed alongside for scale.

Hypothesis: left to the system, copies of one session differ by 10-25% on a
2-core machine (a worker woken onto the caller's core takes turns with it),
and the pinned copies all run like the best of them.

    python benchmarks/bench_threads.py --model mlp
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models  # noqa: E402

from ortbridge import OnnxModule  # noqa: E402

LR = 0.01
VARIANTS = ("pinned", "system")


def _unpin(layer: OnnxModule) -> None:
    """Give a module's workers back every core and stop them following the caller."""
    for graph in layer._bridge._gradient_graphs.values():
        pinning, graph.pinning = graph.pinning, None
        if pinning is None:
            raise SystemExit("no pinned workers to compare with (not Linux, or one thread)")
        for tid in pinning.workers:
            os.sched_setaffinity(tid, pinning.allowed)


def measure(name: str, copies: int, rounds: int, steps: int, seed: int = 0) -> dict:
    factory, _, _ = _models.MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x, y = _models.data(name, torch.device("cpu"))
    proto = _models.export(model, x)
    loss_fn = _models.loss_fn(name)
    runs = {("eager", 0): (model, torch.optim.SGD(model.parameters(), lr=LR))}
    for k in range(copies):
        for variant in VARIANTS:
            layer = OnnxModule(proto)
            layer(x).sum().backward()  # builds the gradient graph
            if variant == "system":
                _unpin(layer)
            runs[(variant, k)] = (layer, torch.optim.SGD(layer.parameters(), lr=LR))
    times = {key: [] for key in runs}
    order = list(runs)
    shuffle = random.Random(seed).shuffle
    for round_ in range(rounds + 1):  # the first round warms up
        shuffle(order)
        for key in order:
            module, optimizer = runs[key]
            start = time.perf_counter()
            for _ in range(steps):
                _models.train_step(module, optimizer, loss_fn, x, y)
            if round_:
                times[key].append((time.perf_counter() - start) / steps * 1e3)
    per_copy = {v: [statistics.median(times[(v, k)]) for k in range(copies)] for v in VARIANTS}
    return {
        "model": name,
        "eager_ms": statistics.median(times[("eager", 0)]),
        "per_copy_ms": per_copy,
        "median_ms": {v: statistics.median(ms) for v, ms in per_copy.items()},
        "spread": {v: max(ms) / min(ms) for v, ms in per_copy.items()},
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, variant in enumerate(VARIANTS):
        ms = result["per_copy_ms"][variant]
        ax.scatter([i] * len(ms), ms, s=40, alpha=0.7, label=f"{variant} (one dot per copy)")
    ax.axhline(result["eager_ms"], color="grey", lw=0.8, ls="--", label="torch eager")
    ax.set_xticks(range(len(VARIANTS)), ["workers pinned (ortbridge)", "left to the system"])
    ax.set_xlim(-0.6, len(VARIANTS) - 0.4)
    ax.set_ylabel("ms per training step (median)")
    ax.set_title(f"{result['model']}: copies of one model, each its own session")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=list(_models.MODELS))
    parser.add_argument("--copies", type=int, default=6, help="copies of each variant")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5, help="steps timed per round and copy")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    print(f"{args.model}: {args.copies} copies per variant, {args.rounds} rounds ...", flush=True)
    result = measure(args.model, args.copies, args.rounds, args.steps)
    print(f"{'variant':8s} {'median ms':>9s} {'best':>7s} {'worst':>7s} {'worst/best':>10s}")
    for v in VARIANTS:
        ms = result["per_copy_ms"][v]
        print(
            f"{v:8s} {result['median_ms'][v]:9.3f} {min(ms):7.3f} {max(ms):7.3f} "
            f"{result['spread'][v]:10.2f}"
        )
    print(f"torch eager {result['eager_ms']:.3f} ms")
    print(
        "per copy, pinned: "
        + ", ".join(f"{m:.3f}" for m in result["per_copy_ms"]["pinned"])
        + "\nper copy, system: "
        + ", ".join(f"{m:.3f}" for m in result["per_copy_ms"]["system"])
    )
    os.makedirs(args.out, exist_ok=True)
    info = {
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": __import__("onnxruntime").__version__,
    }
    stem = os.path.join(args.out, f"bench_threads_{args.model}")
    with open(stem + ".json", "w") as f:
        json.dump({"info": info, "result": result}, f, indent=1)
    plot(result, stem + ".png")
    print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
