"""Fit the same MLP with scikit-learn's MLPRegressor and ortbridge's OnnxSGDRegressor.

Compared, in one process, on the same data, the same starting weights and the
same hyperparameters (SGD, constant learning rate, Nesterov momentum, no
penalty):

- ``scikit-learn``: ``MLPRegressor(hidden_layer_sizes=(50, 10), solver="sgd")``,
  forward, backward and update in numpy;
- ``ortbridge``: :class:`ortbridge.training.OnnxSGDRegressor` on the ONNX
  conversion (skl2onnx) of that network: an epoch is one onnxruntime call
  (forward, loss, backward and update of every batch in a ``Loop``);
- ``full graph`` (reference, ``--no-full-graph`` to leave it out):
  :class:`ortbridge.training.OrtFullGraphTrainer`, forward, loss, backward and
  update in one onnxruntime call a batch, set up to take scikit-learn's steps;
- ``batch by batch`` (reference, ``--by-batch``): the estimator's path for
  models with BatchNormalization, ``OnnxModule`` forward and backward then one
  update call, three onnxruntime calls a batch.

All start from an ``MLPRegressor`` fitted for one epoch (then converted); by
default none shuffles, so all see the batches in the same order and must
end at the same loss (the estimator follows scikit-learn's update rule).
``ortbridge`` is timed in two parts: building the training graph and the first
epoch, then the remaining epochs; a last fit measures the share of its time
spent inside onnxruntime's calls.

Hypothesis: onnxruntime's kernels are not slower than numpy's, so the ratio is
set by the fixed costs of a batch: calls into onnxruntime, Python, and the
nodes of the graph, each a microsecond or so of dispatch. The target is
ortbridge <= 0.5x scikit-learn's time at an equal or better loss; onnxcustom's
original fallback training was about 0.95x.

    python benchmarks/bench_sklearn.py --rows 1000 --features 100 --batch 15 --epochs 100
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
import warnings

import numpy as np
import onnxruntime
import sklearn
import torch
from skl2onnx import to_onnx
from sklearn.datasets import make_regression
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPRegressor

import ortbridge
from ortbridge.training import OnnxSGDRegressor, OrtFullGraphTrainer, OrtSGD
from ortbridge.training._epoch_graph import EpochGraph


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--hidden", default="50,10", help="hidden layer sizes")
    parser.add_argument("--batch", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3, help="learning_rate_init")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--shuffle", action="store_true", help="shuffle every epoch")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, median kept")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave)")
    parser.add_argument(
        "--no-full-graph", action="store_true", help="leave out the OrtFullGraphTrainer reference"
    )
    parser.add_argument(
        "--by-batch", action="store_true", help="add the estimator's batch-by-batch path"
    )
    parser.add_argument("--output", help="write the figures as JSON to this file")
    return parser.parse_args()


def data(rows, features, seed=0):
    X, y = make_regression(rows, features, n_informative=10, noise=5.0, random_state=seed)
    X = (X / X.std(axis=0)).astype(np.float32)
    y = ((y - y.mean()) / y.std()).astype(np.float32)
    return X, y


def hyperparameters(args):
    return dict(
        learning_rate="constant",
        learning_rate_init=args.lr,
        momentum=args.momentum,
        nesterovs_momentum=True,
        alpha=0.0,
        batch_size=args.batch,
        shuffle=args.shuffle,
        random_state=0,
    )


def start(X, y, hidden, hyper):
    """An MLPRegressor after one epoch, and its ONNX conversion."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        mlp = MLPRegressor(hidden_layer_sizes=hidden, solver="sgd", max_iter=1, **hyper)
        mlp.fit(X, y)
    return mlp, to_onnx(mlp, X[:1], target_opset=18)


def time_sklearn(start_mlp, X, y, epochs):
    mlp = copy.deepcopy(start_mlp)
    del mlp._optimizer  # a new SGD optimizer with zero velocities, as ortbridge starts with
    mlp.set_params(warm_start=True, max_iter=epochs, tol=0.0, n_iter_no_change=epochs + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        begin = time.perf_counter()
        mlp.fit(X, y)
        elapsed = time.perf_counter() - begin
    return elapsed, float(mlp.loss_)


def time_ortbridge(onx, X, y, epochs, hyper, cls=OnnxSGDRegressor):
    reg = cls(onx, max_iter=1, **hyper)
    begin = time.perf_counter()
    reg.fit(X, y)
    first = time.perf_counter() - begin
    reg.set_params(warm_start=True, max_iter=epochs - 1)
    begin = time.perf_counter()
    if epochs > 1:
        reg.fit(X, y)
    rest = time.perf_counter() - begin
    return first, rest, float(reg.loss_), reg


def time_full_graph(onx, X, y, epochs, args):
    """The reference one-call-a-step path on the same trajectory.

    ``OrtFullGraphTrainer`` follows torch: its ``squared_error`` is the mean of
    ``r**2`` (twice scikit-learn's half), so half the learning rate gives
    scikit-learn's steps; with a constant rate torch's momentum and Nesterov
    updates are scikit-learn's. Its loss is halved to compare.
    """
    trainer = OrtFullGraphTrainer(
        onx,
        optimizer="sgd",
        learning_rate=args.lr / 2,
        batch_size=args.batch,
        max_iter=1,
        shuffle=args.shuffle,
        random_state=0,
        optimizer_params={"momentum": args.momentum, "nesterov": True},
    )
    begin = time.perf_counter()
    trainer.fit(X, y.reshape(-1, 1))
    first = time.perf_counter() - begin
    trainer.max_iter = epochs - 1
    begin = time.perf_counter()
    if epochs > 1:
        trainer.fit(X, y.reshape(-1, 1))
    rest = time.perf_counter() - begin
    return first, rest, float(trainer.train_losses_[-1]) / 2


class _ByBatch(OnnxSGDRegressor):
    """The estimator on its batch-by-batch path (models with BatchNormalization)."""

    def _epoch_engine(self):
        return None


def time_in_onnxruntime(onx, X, y, epochs, hyper):
    """Seconds a fit spends inside the epoch graphs' onnxruntime calls, and in all."""
    spent = []
    run = EpochGraph.run

    def timed(self, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - begin)

    reg = OnnxSGDRegressor(onx, max_iter=1, **hyper).fit(X, y)
    reg.set_params(warm_start=True, max_iter=epochs)
    EpochGraph.run = timed
    try:
        begin = time.perf_counter()
        reg.fit(X, y)
        total = time.perf_counter() - begin
    finally:
        EpochGraph.run = run
    return sum(spent), total


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden = tuple(int(h) for h in args.hidden.split(","))
    X, y = data(args.rows, args.features)
    hyper = hyperparameters(args)
    mlp, onx = start(X, y, hidden, hyper)
    # The first torch optimizer of a process imports torch._dynamo (about 1.5 s):
    # a cost of the process, not of a fit, paid here before any timing.
    OrtSGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    runs = {"sklearn": [], "first": [], "rest": [], "full_graph": [], "by_batch": []}
    losses = {}
    for _ in range(args.repeat):
        elapsed, losses["sklearn"] = time_sklearn(mlp, X, y, args.epochs)
        runs["sklearn"].append(elapsed)
        first, rest, losses["ortbridge"], reg = time_ortbridge(onx, X, y, args.epochs, hyper)
        runs["first"].append(first)
        runs["rest"].append(rest)
        if not args.no_full_graph:
            fg_first, fg_rest, losses["full_graph"] = time_full_graph(onx, X, y, args.epochs, args)
            runs["full_graph"].append(fg_first + fg_rest)
        if args.by_batch:
            first, rest, losses["by_batch"], _ = time_ortbridge(
                onx, X, y, args.epochs, hyper, _ByBatch
            )
            runs["by_batch"].append(first + rest)
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    sk, first, rest = med["sklearn"], med["first"], med["rest"]
    epoch = rest / max(args.epochs - 1, 1)
    sk_epoch = sk / args.epochs

    print(
        f"MLP {args.features}-{'-'.join(map(str, hidden))}-1, {args.rows} rows, "
        f"batch {args.batch}, {args.epochs} epochs, shuffle={args.shuffle}, "
        f"median of {args.repeat} runs"
    )
    print(f"{'':28s} {'time (s)':>10s} {'final loss':>12s} {'ratio':>7s}")
    print(f"{'scikit-learn MLPRegressor':28s} {sk:10.3f} {losses['sklearn']:12.6f} {1:7.2f}")
    total = first + rest
    print(
        f"{'ortbridge OnnxSGDRegressor':28s} {total:10.3f} {losses['ortbridge']:12.6f} "
        f"{total / sk:7.2f}"
    )
    print(f"{'  build + first epoch':28s} {first:10.3f}")
    print(f"{'  one epoch':28s} {epoch:10.4f} {'':12s} {epoch / sk_epoch:7.2f}")
    if "full_graph" in med:
        fg = med["full_graph"]
        print(
            f"{'full graph (reference)':28s} {fg:10.3f} {losses['full_graph']:12.6f} {fg / sk:7.2f}"
        )
    if "by_batch" in med:
        bb = med["by_batch"]
        print(
            f"{'batch by batch (reference)':28s} {bb:10.3f} {losses['by_batch']:12.6f} "
            f"{bb / sk:7.2f}"
        )
    n_batches = -(-args.rows // args.batch)
    in_ort, fit_s = time_in_onnxruntime(onx, X, y, args.epochs, hyper)
    per_batch = fit_s / (args.epochs * n_batches) * 1e6
    print(
        f"a batch (us): scikit-learn {sk_epoch / n_batches * 1e6:.0f}; ortbridge "
        f"{per_batch:.0f}, of which {in_ort / fit_s:.0%} in onnxruntime's calls"
    )
    figures = {
        "args": vars(args),
        "sklearn_s": sk,
        "ortbridge_s": total,
        "ortbridge_build_and_first_epoch_s": first,
        "ratio": total / sk,
        "ratio_per_epoch": epoch / sk_epoch,
        "ortbridge_batch_us": per_batch,
        "ortbridge_share_in_onnxruntime": in_ort / fit_s,
        "losses": losses,
        "runs": runs,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {
            "ortbridge": ortbridge.__version__,
            "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__,
            "scikit-learn": sklearn.__version__,
            "numpy": np.__version__,
        },
    }
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
