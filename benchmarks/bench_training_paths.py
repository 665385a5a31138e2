"""One training step of the same MLP, trained several ways, side by side.

Compared, on identical weights and batches (MSE loss, SGD, no momentum):

- ``full graph``: :class:`ortbridge.training.OrtFullGraphTrainer`, forward,
  loss, backward and update in one onnxruntime call a step;
- ``OnnxModule + torch SGD``: :class:`ortbridge.OnnxModule` (forward and
  backward in onnxruntime), loss and ``torch.optim.SGD`` in torch;
- ``OnnxModule + OrtSGD``: the same with :class:`ortbridge.training.OrtSGD`,
  the update run by onnxruntime;
- ``torch eager`` (reference): the MLP as ``torch.nn.Sequential``;
- ``ort training api`` (reference): onnxruntime's own on-device training
  API, ``generate_artifacts`` then ``Module(...)`` and ``Optimizer.step()``,
  two calls a step.

Hypothesis: when the whole model is ONNX the full graph is the fastest way,
because a step crosses from Python to onnxruntime once and no tensor moves
between torch and onnxruntime; the gap is widest on small models and batches
where fixed per-call costs dominate, and shrinks as the matrix products grow.

Every way is timed in the same process, round-robin (one block of steps of
each way per round), and the median of the rounds is kept; the ratios to the
full graph are printed as a table and written to ``--output`` (JSON) with the
machine and the versions.

    python benchmarks/bench_training_paths.py --sizes 784,256,256,10 --batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

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
    name = "full graph"

    def __init__(self, module, model, X, y, args):
        self.trainer = OrtFullGraphTrainer(
            model,
            optimizer="sgd",
            learning_rate=args.lr,
            batch_size=args.batch,
            max_iter=1,
            shuffle=False,
            session_options=session_options(args.threads),
        )
        self.X, self.y = X.numpy(), y.numpy()

    def run(self, steps):
        n = steps * self.trainer.batch_size
        self.trainer.fit(self.X[:n], self.y[:n])


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
WAYS = [FullGraph, OnnxModuleTorchSGD, OnnxModuleOrtSGD, TorchEager, TrainingApi]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="784,256,256,10", help="layer widths")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=7, help="timed blocks per way")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(args.threads)

    module, model = mlp(args.sizes, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    n = max(args.steps, WARMUP_STEPS) * args.batch
    X = torch.from_numpy(rng.standard_normal((n, args.sizes[0])).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((n, args.sizes[-1])).astype(np.float32))

    ways, skipped = [], {}
    for cls in WAYS:
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

    base = statistics.median(times[FullGraph.name]) if FullGraph.name in times else None
    rows = []
    print(f"MLP {args.sizes}, batch {args.batch}, {args.threads} thread(s), SGD, MSE")
    print(f"{'way':32s} {'ms/step':>9s} {'min':>7s} {'vs full graph':>14s}")
    for name, values in times.items():
        median = statistics.median(values)
        ratio = median / base if base else float("nan")
        rows.append(
            {
                "way": name,
                "ms_per_step": median * 1e3,
                "min_ms": min(values) * 1e3,
                "ratio_to_full_graph": ratio,
            }
        )
        print(f"{name:32s} {median * 1e3:9.3f} {min(values) * 1e3:7.3f} {ratio:13.2f}x")
    for name, why in skipped.items():
        print(f"{name:32s} not run: {why}")
    result = {
        "sizes": args.sizes,
        "batch": args.batch,
        "threads": args.threads,
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": rows,
        "skipped": skipped,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "load_average": os.getloadavg(),
        },
        "versions": {
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
            "onnx": onnx.__version__,
            "numpy": np.__version__,
            "ortbridge": ortbridge.__version__,
        },
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
