"""Resident memory over many training steps: ortbridge vs torch eager.

Each variant trains the MLP (784-256-256-10, batch 64, SGD) for ``--steps``
steps in its own process, sampling the resident set size. Hypothesis: after a
short warm-up, ortbridge's memory stays flat (no growth beyond noise: every
execution state is freed by its backward, nothing accumulates), like torch's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(variant: str, model_name: str, steps: int, every: int) -> None:
    import torch

    sys.path.insert(0, HERE)
    import _models

    from ortbridge import OnnxModule

    torch.manual_seed(0)
    factory = _models.MODELS[model_name][0]
    model = factory()
    x, y = _models.data(model_name, torch.device("cpu"))
    if variant == "ortbridge":
        model = OnnxModule(_models.export(model, x))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = _models.loss_fn(model_name)
    samples = []
    for step in range(steps + 1):
        _models.train_step(model, optimizer, loss_fn, x, y)
        if step % every == 0:
            samples.append((step, rss_mb()))
    print(json.dumps(samples))


def summarize(samples, warmup: int) -> dict:
    after = [mb for step, mb in samples if step >= warmup]
    return {
        "start_mb": after[0],
        "peak_mb": max(after),
        "end_mb": after[-1],
        "growth_mb": after[-1] - after[0],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=100, help="steps before the baseline")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model, args.steps, args.every)
        return 0
    curves, table = {}, {}
    for variant in ("eager", "ortbridge"):
        print(f"training {args.model} with {variant} for {args.steps} steps ...", flush=True)
        out = subprocess.run(
            [sys.executable, __file__, "--worker", variant, "--model", args.model,
             "--steps", str(args.steps), "--every", str(args.every)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        curves[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        table[variant] = summarize(curves[variant], args.warmup)
    print(f"{'variant':10s} {'start MB':>9s} {'peak MB':>9s} {'end MB':>9s} {'growth MB':>10s}")
    for variant, row in table.items():
        print(
            f"{variant:10s} {row['start_mb']:9.1f} {row['peak_mb']:9.1f} {row['end_mb']:9.1f} "
            f"{row['growth_mb']:10.1f}"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_memory.json"), "w") as f:
        json.dump({"summary": table, "curves": curves}, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for variant, samples in curves.items():
        ax.plot([s for s, _ in samples], [mb for _, mb in samples], label=variant)
    ax.set_xlabel("training step")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title(f"{args.model}: resident memory over {args.steps} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_memory.png"), dpi=110)
    print(f"wrote {args.out}/bench_memory.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
