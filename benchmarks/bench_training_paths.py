"""One training step of the same MLP, trained several ways, on both onnxruntimes, side by side.

Compared, on identical weights and batches (MSE loss, SGD, no momentum):

- ``full graph, builder`` / ``full graph, onnx-ad``:
  :class:`ortbridge.training.OrtFullGraphTrainer`, forward, loss, backward and
  update in one onnxruntime call a step, its gradients from the training
  build's gradient builder (that build only) or from onnx-ad's standard-op
  reverse graph (any onnxruntime);
- ``OnnxModule + torch SGD``: :class:`ortbridge.OnnxModule` (forward and
  backward in onnxruntime, ``backend="auto"``), loss and ``torch.optim.SGD``
  in torch;
- ``OnnxModule + OrtSGD``: the same with :class:`ortbridge.training.OrtSGD`,
  the update run by onnxruntime;
- ``torch eager`` (reference): the MLP as ``torch.nn.Sequential``;
- ``ort training api`` (reference, training build only): onnxruntime's own
  on-device training API, ``generate_artifacts`` then ``Module(...)`` and
  ``Optimizer.step()``, two calls a step.

The runtime axis: the script measures the ways in its own environment, then
runs itself with the other environment's python (training build against
maintained onnxruntime, :mod:`_runtime_axis`) and prints both columns.

Hypotheses: when the whole model is ONNX the full graph is the fastest way,
because a step crosses from Python to onnxruntime once and no tensor moves
between torch and onnxruntime; the gap is widest on small models and batches
where fixed per-call costs dominate, and shrinks as the matrix products grow.
On maintained onnxruntime the full graph's step takes no longer than the
training build's (target <= 1.0x): onnx-ad's graph, built for the batch's
shape, has no more nodes than the builder's.

Within an environment every way is timed in the same process, round-robin
(one block of steps of each way per round), and the median of the rounds is
kept; the table gives each way's ms/step in each environment and its ratio
to the training build's full graph, and ``--output`` (JSON) keeps them with
the machine and the versions.

    python benchmarks/bench_training_paths.py --sizes 784,256,256,10 --batch 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import _runtime_axis
import numpy as np
import onnx
import onnxruntime
import torch
from onnx import TensorProto, helper, numpy_helper

import ortbridge
from ortbridge.training import OrtFullGraphTrainer


def mlp(sizes, seed=0):
    """``nn.Sequential(Linear, ReLU, ..., Linear)`` and the same MLP as ONNX.

    The ONNX initializers are named like the torch state dict (``0.weight``).
    """
    torch.manual_seed(seed)
    layers = []
    for k, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(n_in, n_out))
        if k < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    module = torch.nn.Sequential(*layers)
    nodes, inits, x = [], [], "x"
    for name, layer in module.named_children():
        if isinstance(layer, torch.nn.Linear):
            w, b = f"{name}.weight", f"{name}.bias"
            inits.append(numpy_helper.from_array(layer.weight.detach().numpy().copy(), w))
            inits.append(numpy_helper.from_array(layer.bias.detach().numpy().copy(), b))
            nodes.append(helper.make_node("Gemm", [x, w, b], [f"h{name}"], transB=1))
        else:
            nodes.append(helper.make_node("Relu", [x], [f"h{name}"]))
        x = f"h{name}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", sizes[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return module, model


def session_options(threads):
    so = onnxruntime.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


class FullGraph:
    """The trainer on one gradient source (``backend``)."""

    backend = "auto"

    def __init__(self, module, model, X, y, args):
        self.trainer = OrtFullGraphTrainer(
            model,
            optimizer="sgd",
            learning_rate=args.lr,
            batch_size=args.batch,
            max_iter=1,
            shuffle=False,
            session_options=session_options(args.threads),
            backend=self.backend,
        )
        self.X, self.y = X.numpy(), y.numpy()

    def run(self, steps):
        n = steps * self.trainer.batch_size
        self.trainer.fit(self.X[:n], self.y[:n])


class FullGraphBuilder(FullGraph):
    name = "full graph, builder"
    backend = "training-agent"


class FullGraphOnnxAd(FullGraph):
    name = "full graph, onnx-ad"
    backend = "onnxruntime"


class TorchLoop:
    """A plain torch training loop over a module and an optimizer."""

    def __init__(self, module, optimizer, X, y, batch):
        self.module, self.optimizer = module, optimizer
        self.X, self.y, self.batch = X, y, batch
        self.loss = torch.nn.MSELoss()

    def run(self, steps):
        b = self.batch
        for k in range(steps):
            xb, yb = self.X[k * b : (k + 1) * b], self.y[k * b : (k + 1) * b]
            self.optimizer.zero_grad()
            loss = self.loss(self.module(xb), yb)
            loss.backward()
            self.optimizer.step()
            loss.item()  # the full graph reads its loss every step too


class OnnxModuleTorchSGD(TorchLoop):
    name = "OnnxModule + torch SGD"

    def __init__(self, module, model, X, y, args):
        layer = ortbridge.OnnxModule(model, session_options=session_options(args.threads))
        super().__init__(layer, torch.optim.SGD(layer.parameters(), lr=args.lr), X, y, args.batch)


class OnnxModuleOrtSGD(TorchLoop):
    name = "OnnxModule + OrtSGD"

    def __init__(self, module, model, X, y, args):
        layer = ortbridge.OnnxModule(model, session_options=session_options(args.threads))
        optimizer = ortbridge.training.OrtSGD(layer.parameters(), lr=args.lr)
        super().__init__(layer, optimizer, X, y, args.batch)


class TorchEager(TorchLoop):
    name = "torch eager (reference)"

    def __init__(self, module, model, X, y, args):
        copy = mlp(args.sizes, seed=args.seed)[0]
        super().__init__(copy, torch.optim.SGD(copy.parameters(), lr=args.lr), X, y, args.batch)


class TrainingApi:
    """onnxruntime.training.api: Module(...) then Optimizer.step(), two calls a step."""

    name = "ort training api (reference)"

    def __init__(self, module, model, X, y, args):
        from onnxruntime.training import api, artifacts

        self.tmp = tempfile.TemporaryDirectory()
        with_loss = ortbridge.add_loss_output(model, "squared_error")
        del with_loss.graph.output[1:]
        weights = list(ortbridge.get_train_initializer(model))
        artifacts.generate_artifacts(
            with_loss,
            requires_grad=weights,
            loss=None,  # the first output already is the loss
            optimizer=artifacts.OptimType.SGD,
            artifact_directory=self.tmp.name,
        )
        path = self.tmp.name
        optimizer_path = os.path.join(path, "optimizer_model.onnx")
        optimizer_model = onnx.load(optimizer_path)
        optimizer_model.ir_version = min(optimizer_model.ir_version, 10)  # written as IR 14
        onnx.save(optimizer_model, optimizer_path)
        state = api.CheckpointState.load_checkpoint(os.path.join(path, "checkpoint"))
        so = session_options(args.threads)
        self.module = api.Module(
            os.path.join(path, "training_model.onnx"), state, session_options=so
        )
        self.optimizer = api.Optimizer(optimizer_path, self.module)
        self.optimizer.set_learning_rate(args.lr)
        self.X, self.y, self.batch = X.numpy(), y.numpy(), args.batch

    def run(self, steps):
        b = self.batch
        for k in range(steps):
            self.module.lazy_reset_grad()
            loss = self.module(self.X[k * b : (k + 1) * b], self.y[k * b : (k + 1) * b])
            self.optimizer.step()
            float(loss)


WARMUP_STEPS = 3
WAYS = [
    FullGraphBuilder,
    FullGraphOnnxAd,
    OnnxModuleTorchSGD,
    OnnxModuleOrtSGD,
    TorchEager,
    TrainingApi,
]
#: What the maintained runtime's full graph is compared with (the issue's target).
REFERENCE = FullGraphBuilder.name
NEEDS_TRAINING_BUILD = {FullGraphBuilder.name, TrainingApi.name}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="784,256,256,10", help="layer widths")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=7, help="timed blocks per way")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the results as JSON here")
    _runtime_axis.add_arguments(parser)
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    return args


def measure(args) -> dict:
    """This environment's part: every way that runs here, round-robin."""
    torch.set_num_threads(args.threads)
    here = _runtime_axis.runtime()
    module, model = mlp(args.sizes, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    n = max(args.steps, WARMUP_STEPS) * args.batch
    X = torch.from_numpy(rng.standard_normal((n, args.sizes[0])).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((n, args.sizes[-1])).astype(np.float32))

    ways, skipped = [], {}
    for cls in WAYS:
        if cls.name in NEEDS_TRAINING_BUILD and not here["training_build"]:
            continue  # not a failure: this way exists in the training build only
        try:
            way = cls(module, model, X, y, args)
            way.run(WARMUP_STEPS)  # sessions, allocators, first-call paths
        except Exception as exc:  # a way that cannot run here is reported, not fatal
            skipped[cls.name] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        ways.append(way)
    times = {way.name: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            start = time.perf_counter()
            way.run(args.steps)
            times[way.name].append((time.perf_counter() - start) / args.steps)
    return {
        "runtime": here,
        "raw": {"seconds_per_step": times},
        "skipped": skipped,
        "versions": {
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
            "onnx": onnx.__version__,
            "numpy": np.__version__,
            "ortbridge": ortbridge.__version__,
        },
    }


def summarize(args, part: dict) -> dict:
    """Median and min ms/step of each way, and the median's ratio to the full graph's."""
    times = part["raw"]["seconds_per_step"]
    rows = [
        {"way": name, "ms_per_step": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3}
        for name, v in times.items()
    ]
    base = {r["way"]: r["ms_per_step"] for r in rows}.get(FullGraphOnnxAd.name)
    for row in rows:
        row["ratio_to_full_graph"] = row["ms_per_step"] / base if base else float("nan")
    return {**part, "rows": rows}


def report(args, parts: list[dict]) -> None:
    """ms/step (median and min of the rounds) per environment, and each over the training
    build's full graph (median over median, min over min)."""
    print(f"MLP {args.sizes}, batch {args.batch}, {args.threads} thread(s), SGD, MSE")
    reference = None
    for p in parts:
        found = {r["way"]: r for r in p["rows"]}
        if p["runtime"]["training_build"] and REFERENCE in found:
            reference = found[REFERENCE]
    print(f"{'':32s}" + "".join(f"{_runtime_axis.label(p):>34s}" for p in parts))
    header = f"{'median':>9s}{'min':>8s}{'x med':>8s}{'x min':>8s}" if reference else ""
    print(f"{'way (ms/step)':32s}" + f"{header:>34s}" * len(parts))
    names = list(dict.fromkeys(r["way"] for p in parts for r in p["rows"]))
    for name in names:
        cells = []
        for p in parts:
            row = next((r for r in p["rows"] if r["way"] == name), None)
            if row is None:
                cells.append(f"{'-':>34s}")
                continue
            cell = f"{row['ms_per_step']:9.3f}{row['min_ms']:8.3f}"
            if reference:
                cell += f"{row['ms_per_step'] / reference['ms_per_step']:8.2f}"
                cell += f"{row['min_ms'] / reference['min_ms']:8.2f}"
            cells.append(f"{cell:>34s}")
        print(f"{name:32s}" + "".join(cells))
    for p in parts:
        for name, why in p["skipped"].items():
            print(f"{_runtime_axis.label(p)}: {name} not run: {why}")
    maintained = next((p for p in parts if not p["runtime"]["training_build"]), None)
    if reference and maintained:
        print("maintained onnxruntime's full graph / the training build's:", target_ratios(parts))


def target_ratios(parts: list[dict]) -> str:
    """The issue's target, three ways: medians, minima, and medians over each
    environment's torch eager (the same code in both: it cancels the machine's
    load drifting between the two parts, which run one after the other)."""
    rows = [{r["way"]: r for r in p["rows"]} for p in parts]
    training, maintained = (
        (rows[0], rows[1]) if parts[0]["runtime"]["training_build"] else rows[::-1]
    )
    ours, ref = maintained[FullGraphOnnxAd.name], training[REFERENCE]
    eager = TorchEager.name
    drift = maintained[eager]["ms_per_step"] / training[eager]["ms_per_step"]
    return (
        f"{ours['ms_per_step'] / ref['ms_per_step']:.2f}x (medians), "
        f"{ours['min_ms'] / ref['min_ms']:.2f}x (minima), "
        f"{ours['ms_per_step'] / ref['ms_per_step'] / drift:.2f}x (over torch eager's)"
    )


def settings(args) -> dict:
    """The options the saved results record."""
    return {k: getattr(args, k) for k in ("sizes", "batch", "threads", "steps", "rounds")}


def main(argv=None):
    return _runtime_axis.main(
        __file__, argv, parse_args, measure, summarize, report, settings, "rounds"
    )


if __name__ == "__main__":
    main()
