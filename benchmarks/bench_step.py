"""Time of one training step: both ortbridge engines vs the raw TrainingAgent vs torch eager.

A step is forward, loss, backward and a torch SGD step. Up to four ways, on
the same weights and batch:

- ``eager``: the torch model itself;
- ``raw``: the TrainingAgent loop on the very gradient graph ortbridge builds,
  driven by hand (DLPack in and out, loss gradient from torch, SGD in torch):
  the floor any bridge over the training build can reach;
- ``ortbridge``: ``OnnxModule(backend="training-agent")`` + ``torch.optim.SGD``;
- ``ob-ort``: ``OnnxModule(backend="onnxruntime")``, the same step;
- ``compiled`` (with ``--compile``): the torch model under ``torch.compile``
  (its compilation is done in the warm-up, not timed).

The training-agent variants run only where the training build is installed
and can train the model (not the LSTM or the UNet decoder). Also measured:
the bytes each step keeps for backward (tensors saved in torch's autograd
graph, weights and inputs not counted) for torch eager and the onnxruntime
engine.

Hypotheses: the bridge adds almost nothing to the raw loop (ortbridge / raw
<= 1.05); the onnxruntime engine is no slower than the training agent
(ob-ort / ortbridge <= 1.0) and, on the MLP, than torch eager (<= 1.0); it
keeps at most 1.2x the bytes torch keeps.

Repetitions are interleaved (each round times every variant), the medians
are compared; results go to a JSON file and a PNG plot.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models  # noqa: E402

from ortbridge import OnnxModule
from ortbridge._runtime import _ort  # noqa: E402
from ortbridge._runtime._runs import from_ortvalues, to_ortvalues  # noqa: E402
from ortbridge._runtime._threads import UNPINNED  # noqa: E402

LR = 0.01
#: Environment variables that set how long torch's OpenMP workers spin.
_OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")


def _cpu_model() -> str:
    """The processor's name: the ratios to torch depend on it (torch's BLAS
    and onnxruntime's do not rank the same on every CPU)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
        from ortbridge._runtime._ort import capi

        C = capi()
        mark = mark or _no_mark
        # onnxruntime's workers kept off this core, torch's resting, as ortbridge does
        pinning = self.graph.pinning
        mark("start")
        optimizer.zero_grad(set_to_none=True)
        mark("zero_grad")
        feeds = dict(zip(self.names, [x, *(w.detach() for w in self.weights)]))
        inputs = to_ortvalues([feeds[n] for n in self.graph.feed_names])
        outputs, state = C.OrtValueVector(), C.PartialGraphExecutionState()
        with pinning or UNPINNED:
            self.graph.agent.run_forward(inputs, outputs, state, None)
        out = from_ortvalues(outputs)[0].requires_grad_()
        mark("forward")
        loss = loss_fn(out, y)
        mark("loss")
        loss.backward()
        mark("loss_backward")
        grads = C.OrtValueVector()
        with pinning or UNPINNED:
            self.graph.agent.run_backward(to_ortvalues([out.grad]), grads, state)
        for name, grad in zip(self.graph.grad_targets, from_ortvalues(grads)):
            self.param_of[name].grad = grad
        mark("backward")
        optimizer.step()
        mark("step")
        return loss


def saved_bytes(module, loss_fn, x, y) -> int:
    """Bytes of the tensors a step keeps for backward, weights and inputs excluded."""
    own = {p.untyped_storage().data_ptr() for p in module.parameters()}
    own |= {b.untyped_storage().data_ptr() for b in module.buffers()}
    own.add(x.untyped_storage().data_ptr())
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(module(x), y)
    loss.backward()
    module.zero_grad(set_to_none=True)
    return sum(kept.values())


def measure(name: str, device: torch.device, rounds: int, steps: int, compile_=False) -> dict:
    factory, _, _ = _models.MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x, y = _models.data(name, device)
    proto = _models.export(model, x.cpu())
    model.to(device)
    loss_fn = _models.loss_fn(name)
    variants = {"eager": (model, torch.optim.SGD(model.parameters(), lr=LR))}
    if _ort.has_training() and name not in _models.ONNXRUNTIME_ONLY:
        raw = RawAgentLoop(OnnxModule(proto, backend="training-agent").to(device), x)
        layer = OnnxModule(proto, backend="training-agent").to(device)
        variants["raw"] = (raw, torch.optim.SGD(raw.params, lr=LR))
        variants["ortbridge"] = (layer, torch.optim.SGD(layer.parameters(), lr=LR))
    ort_layer = OnnxModule(proto, backend="onnxruntime").to(device)
    variants["ob-ort"] = (ort_layer, torch.optim.SGD(ort_layer.parameters(), lr=LR))
    if compile_:
        twin = copy.deepcopy(model)
        variants["compiled"] = (torch.compile(twin), torch.optim.SGD(twin.parameters(), lr=LR))

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
    saved = {v: saved_bytes(variants[v][0], loss_fn, x, y) for v in ("eager", "ob-ort")}

    def ratio(a, b):
        return medians[a] / medians[b] if a in medians and b in medians else None

    return {
        "model": name,
        "first_loss": first,
        "ms": medians,
        "all_ms": times,
        "saved_bytes": saved,
        "ortbridge/raw": ratio("ortbridge", "raw"),
        "ortbridge/eager": ratio("ortbridge", "eager"),
        "raw/eager": ratio("raw", "eager"),
        "ob-ort/ortbridge": ratio("ob-ort", "ortbridge"),
        "ob-ort/eager": ratio("ob-ort", "eager"),
        "ob-ort/compiled": ratio("ob-ort", "compiled"),
        "saved ob-ort/eager": saved["ob-ort"] / saved["eager"],
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = ["eager", "raw", "ortbridge", "ob-ort", "compiled"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.16
    for i, v in enumerate(variants):
        xs = [k + (i - 2) * width for k, r in enumerate(results) if v in r["ms"]]
        heights = [r["ms"][v] / r["ms"]["eager"] for r in results if v in r["ms"]]
        if xs:
            ax.bar(xs, heights, width, label=v)
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
    parser.add_argument("--compile", action="store_true", help="also torch.compile's step")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    spin = {k: os.environ[k] for k in _OPENMP_ENV if k in os.environ}
    print(f"OpenMP settings: {spin or 'defaults (workers spin after each parallel op)'}")
    results = []
    for name in args.models:
        print(f"measuring {name} ...", flush=True)
        results.append(measure(name, device, args.rounds, args.steps, args.compile))
        print(f"    ms: {results[-1]['ms']}", flush=True)
    columns = ["ortbridge/raw", "ortbridge/eager", "raw/eager", "ob-ort/ortbridge"]
    columns += ["ob-ort/eager", "saved ob-ort/eager"]
    columns += ["ob-ort/compiled"] if args.compile else []
    header = f"{'model':12s} {'eager ms':>9s} {'raw ms':>9s} {'agent ms':>9s} {'ort ms':>9s} "
    print(header + " ".join(f"{c:>18s}" for c in columns))

    def cell(value, width=9):
        return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}s}"

    for r in results:
        ms = r["ms"]
        line = f"{r['model']:12s} " + " ".join(
            cell(ms.get(v)) for v in ("eager", "raw", "ortbridge", "ob-ort")
        )
        print(line + " " + " ".join(cell(r[c], 18) for c in columns))
    for r in results:
        kib = {k: v / 1024 for k, v in r["saved_bytes"].items()}
        print(
            f"saved for backward {r['model']}: eager {kib['eager']:.0f} KiB, "
            f"onnxruntime engine {kib['ob-ort']:.0f} KiB"
        )
    for r in results:
        losses = ", ".join(f"{k} {v:.5f}" for k, v in r["first_loss"].items())
        print(f"first-step loss {r['model']}: {losses}")
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    info = {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": __import__("onnxruntime").__version__,
        "device": str(device),
        # torch's OpenMP workers spin after each parallel op unless told
        # otherwise; onnxruntime's worker then shares their core.
        "openmp_env": {k: os.environ[k] for k in _OPENMP_ENV if k in os.environ},
    }
    with open(os.path.join(args.out, f"bench_step{suffix}.json"), "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, f"bench_step{suffix}.png"))
    print(f"wrote {args.out}/bench_step{suffix}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
