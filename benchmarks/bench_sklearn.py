"""Fit the same MLP with scikit-learn's MLPRegressor and ortbridge's OnnxSGDRegressor,
on both onnxruntimes, with both gradient sources.

Compared, in one process, on the same data, the same starting weights and the
same hyperparameters (SGD, constant learning rate, Nesterov momentum, no
penalty):

- ``scikit-learn``: ``MLPRegressor(hidden_layer_sizes=(50, 10), solver="sgd")``,
  forward, backward and update in numpy;
- ``OnnxSGDRegressor``: :class:`ortbridge.training.OnnxSGDRegressor` on the
  ONNX conversion (skl2onnx) of that network: an epoch is one onnxruntime call
  (forward, loss, backward and update of every batch in a ``Loop``), once per
  gradient source installed: ``builder`` (onnxruntime-training's gradient
  builder, training build only) and ``onnx-ad`` (onnx-ad's standard-op
  reverse graph, any onnxruntime);
- ``full graph`` (reference, ``--no-full-graph`` to leave it out):
  :class:`ortbridge.training.OrtFullGraphTrainer`, forward, loss, backward and
  update in one onnxruntime call a batch, set up to take scikit-learn's steps,
  on each gradient source;
- ``batch by batch`` (reference, ``--by-batch``): the estimator's path for
  models with BatchNormalization, ``OnnxModule`` forward and backward then one
  update call, three onnxruntime calls a batch.

The runtime axis: all of it is measured in the environment the script runs
in, then in the other one (the training build's against maintained
onnxruntime's, run with that environment's python: :mod:`_runtime_axis`),
each against its own scikit-learn time, and printed side by side.

All start from an ``MLPRegressor`` fitted for one epoch (then converted); by
default none shuffles, so all see the batches in the same order and must
end at the same loss (the estimator follows scikit-learn's update rule).
A last fit of the estimator as ``backend="auto"`` sets it up measures the
share of its time spent inside onnxruntime's calls.

Hypothesis: onnxruntime's kernels are not slower than numpy's, so the ratio is
set by the fixed costs of a batch: calls into onnxruntime, Python, and the
nodes of the graph, each a microsecond or so of dispatch. The target is
ortbridge <= 0.5x scikit-learn's time at an equal or better loss, in both
environments; onnxcustom's original fallback training was about 0.95x.

    python benchmarks/bench_sklearn.py --rows 1000 --features 100 --batch 15 --epochs 100
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import _runtime_axis
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
from ortbridge.training._graphs._epoch import EpochGraph


def parse_args(argv=None):
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
    _runtime_axis.add_arguments(parser)
    return parser.parse_args(argv)


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


def time_ortbridge(onx, X, y, epochs, hyper, backend, cls=OnnxSGDRegressor):
    reg = cls(onx, max_iter=1, backend=backend, **hyper)
    begin = time.perf_counter()
    reg.fit(X, y)
    first = time.perf_counter() - begin
    reg.set_params(warm_start=True, max_iter=epochs - 1)
    begin = time.perf_counter()
    if epochs > 1:
        reg.fit(X, y)
    rest = time.perf_counter() - begin
    return first, rest, float(reg.loss_), reg


def time_full_graph(onx, X, y, epochs, args, backend):
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
        backend=backend,
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


def time_in_onnxruntime(onx, X, y, epochs, hyper, backend):
    """Seconds a fit spends inside the epoch graphs' onnxruntime calls, and in all."""
    spent = []
    run = EpochGraph.run

    def timed(self, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - begin)

    reg = OnnxSGDRegressor(onx, max_iter=1, backend=backend, **hyper).fit(X, y)
    reg.set_params(warm_start=True, max_iter=epochs)
    EpochGraph.run = timed
    try:
        begin = time.perf_counter()
        reg.fit(X, y)
        total = time.perf_counter() - begin
    finally:
        EpochGraph.run = run
    return sum(spent), total


#: Gradient sources (``backend``) and how the tables name them.
SOURCES = {"training-agent": "builder", "onnxruntime": "onnx-ad"}


def measure(args) -> dict:
    """This environment's part: every way on every gradient source installed here."""
    if args.threads:
        torch.set_num_threads(args.threads)
    here = _runtime_axis.runtime()
    sources = [s for s in SOURCES if here["training_build"] or s == "onnxruntime"]
    hidden = tuple(int(h) for h in args.hidden.split(","))
    X, y = data(args.rows, args.features)
    hyper = hyperparameters(args)
    mlp, onx = start(X, y, hidden, hyper)
    # The first torch optimizer of a process imports torch._dynamo (about 1.5 s):
    # a cost of the process, not of a fit, paid here before any timing.
    OrtSGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    runs, losses, firsts = {}, {}, {}
    for _ in range(args.repeat):
        elapsed, losses["sklearn"] = time_sklearn(mlp, X, y, args.epochs)
        runs.setdefault("sklearn", []).append(elapsed)
        for source in sources:
            way = f"estimator/{source}"
            first, rest, losses[way], _ = time_ortbridge(onx, X, y, args.epochs, hyper, source)
            runs.setdefault(way, []).append(first + rest)
            firsts.setdefault(way, []).append(first)
            if not args.no_full_graph:
                way = f"full_graph/{source}"
                first, rest, losses[way] = time_full_graph(onx, X, y, args.epochs, args, source)
                runs.setdefault(way, []).append(first + rest)
        if args.by_batch:
            first, rest, losses["by_batch"], _ = time_ortbridge(
                onx, X, y, args.epochs, hyper, "auto", _ByBatch
            )
            runs.setdefault("by_batch", []).append(first + rest)
    part = {
        "runtime": here,
        "raw": {"runs": runs, "firsts": firsts},
        "losses": losses,
        "versions": {
            "ortbridge": ortbridge.__version__,
            "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__,
            "scikit-learn": sklearn.__version__,
            "numpy": np.__version__,
        },
    }
    if not args.later_share:
        # What backend="auto" trains with here, and where its fit spends its time.
        auto = OnnxSGDRegressor(onx, max_iter=1, **hyper).fit(X[:30], y[:30])
        part["auto"] = next(iter(auto._epoch_graphs.values())).source
        in_ort, fit_s = time_in_onnxruntime(onx, X, y, args.epochs, hyper, part["auto"])
        n_batches = -(-args.rows // args.batch)
        part["auto_batch_us"] = fit_s / (args.epochs * n_batches) * 1e6
        part["auto_share_in_onnxruntime"] = in_ort / fit_s
    return part


def summarize(args, part: dict) -> dict:
    """Medians of the raw timings, and their ratios to scikit-learn's."""
    med = {k: statistics.median(v) for k, v in part["raw"]["runs"].items()}
    n_batches = -(-args.rows // args.batch)
    return {
        **part,
        "seconds": med,
        "ratios": {k: v / med["sklearn"] for k, v in med.items()},
        "build_and_first_epoch_s": {
            k: statistics.median(v) for k, v in part["raw"]["firsts"].items()
        },
        "sklearn_batch_us": med["sklearn"] / args.epochs / n_batches * 1e6,
    }


def way_names(args) -> dict:
    names = {"sklearn": "scikit-learn MLPRegressor"}
    for source, short in SOURCES.items():
        names[f"estimator/{source}"] = f"OnnxSGDRegressor, {short}"
    for source, short in SOURCES.items():
        names[f"full_graph/{source}"] = f"full graph (ref.), {short}"
    names["by_batch"] = "batch by batch (ref.), auto"
    return names


def report(args, parts: list[dict]) -> None:
    hidden = args.hidden.replace(",", "-")
    print(
        f"MLP {args.features}-{hidden}-1, {args.rows} rows, batch {args.batch}, "
        f"{args.epochs} epochs, shuffle={args.shuffle}, median of {args.repeat} runs"
    )
    print(f"{'':30s}" + "".join(f"{_runtime_axis.label(p):>34s}" for p in parts))
    print(f"{'':30s}" + f"{'time (s)':>12s}{'final loss':>12s}{'ratio':>10s}" * len(parts))
    for way, name in way_names(args).items():
        if not any(way in p["seconds"] for p in parts):
            continue
        cells = []
        for p in parts:
            if way in p["seconds"]:
                t, loss = p["seconds"][way], p["losses"][way]
                cells.append(f"{t:12.3f}{loss:12.6f}{p['ratios'][way]:10.2f}")
            else:
                cells.append(f"{'-':>12s}{'':22s}")
        print(f"{name:30s}" + "".join(cells))
    for p in parts:
        ratio = p["ratios"][f"estimator/{p['auto']}"]
        print(
            f"{_runtime_axis.label(p)}: backend='auto' uses {SOURCES[p['auto']]}; a batch "
            f"{p['auto_batch_us']:.0f} us ({p['auto_share_in_onnxruntime']:.0%} in "
            f"onnxruntime's calls) against scikit-learn's {p['sklearn_batch_us']:.0f} us; "
            f"target estimator <= 0.5x scikit-learn: {'met' if ratio <= 0.5 else 'missed'}"
        )


def settings(args) -> dict:
    """The options the saved figures record."""
    return {"args": {k: v for k, v in vars(args).items() if k not in ("output", "other_python")}}


def main(argv=None):
    return _runtime_axis.main(
        __file__, argv, parse_args, measure, summarize, report, settings, "repeat"
    )


if __name__ == "__main__":
    main()
