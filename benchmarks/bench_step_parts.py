"""Where the time of one training step goes: ortbridge, the raw TrainingAgent loop, torch eager.

The step of ``bench_step.py`` (forward, loss, backward, ``torch.optim.SGD``)
on one model, stamped at every hand-over: torch's own phases for eager; for
the raw loop (``bench_step.py``'s) and ortbridge also onnxruntime's
``TrainingAgent`` calls (wrapped here), and for ortbridge the entry and exit
of ``Function.apply`` and of the generated Function's forward and backward,
so that what runs inside torch's autograd shows apart from ortbridge's own
Python (the module is not changed). Medians over the timed steps,
interleaved blocks; then onnxruntime's forward + backward alone in a tight
loop, and torch's, to compare the kernels without anything around them;
then torch's loss alone, right after an onnxruntime forward and right after
torch's, to show what switching runtimes costs the code that runs next.

    python benchmarks/bench_step_parts.py --model mlp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models  # noqa: E402
import bench_step  # noqa: E402

from ortbridge import OnnxModule  # noqa: E402
from ortbridge._runtime._ort import capi  # noqa: E402
from ortbridge._runtime._runs import to_ortvalues  # noqa: E402

LR = 0.01
EAGER = [
    ("zero_grad", "start", "zero_grad"),
    ("forward", "zero_grad", "forward"),
    ("loss", "forward", "loss"),
    ("backward", "loss", "backward"),
    ("SGD step", "backward", "step"),
]
ORTBRIDGE = [
    ("zero_grad", "start", "zero_grad"),
    ("module checks", "zero_grad", "apply_call"),
    ("torch: Function.apply to forward", "apply_call", "fn_forward_in"),
    ("graph lookup, inputs to onnxruntime", "fn_forward_in", "ort_forward_call"),
    ("onnxruntime forward", "ort_forward_call", "ort_forward_return"),
    ("outputs copied to torch, ctx", "ort_forward_return", "fn_forward_out"),
    ("torch: outputs wrapped, saved", "fn_forward_out", "apply_return"),
    ("module returns", "apply_return", "forward"),
    ("loss", "forward", "loss"),
    ("torch: autograd down to the Function", "loss", "fn_backward_in"),
    ("gradients to onnxruntime", "fn_backward_in", "ort_backward_call"),
    ("onnxruntime backward", "ort_backward_call", "ort_backward_return"),
    ("gradients back to torch", "ort_backward_return", "fn_backward_out"),
    ("torch: gradients checked, accumulated", "fn_backward_out", "backward"),
    ("SGD step", "backward", "step"),
]
RAW = [
    ("zero_grad", "start", "zero_grad"),
    ("inputs to onnxruntime", "zero_grad", "ort_forward_call"),
    ("onnxruntime forward", "ort_forward_call", "ort_forward_return"),
    ("outputs to torch", "ort_forward_return", "forward"),
    ("loss", "forward", "loss"),
    ("torch: autograd of the loss", "loss", "loss_backward"),
    ("gradient to onnxruntime", "loss_backward", "ort_backward_call"),
    ("onnxruntime backward", "ort_backward_call", "ort_backward_return"),
    ("gradients set as .grad", "ort_backward_return", "backward"),
    ("SGD step", "backward", "step"),
]
# Phases that are neither onnxruntime's kernels nor the loss, the update or
# zero_grad: what a bridge adds around onnxruntime (the raw loop's own glue
# is the floor).
_NOT_GLUE = {"zero_grad", "onnxruntime forward", "onnxruntime backward", "loss", "SGD step"}


class _Stamps(list):
    def mark(self, name):
        self.append((name, time.perf_counter()))


class _TimedAgent:
    """A TrainingAgent whose calls are stamped."""

    def __init__(self, agent, stamps):
        self.agent, self.stamps = agent, stamps

    def run_forward(self, *args):
        self.stamps.mark("ort_forward_call")
        result = self.agent.run_forward(*args)
        self.stamps.mark("ort_forward_return")
        return result

    def run_backward(self, *args):
        self.stamps.mark("ort_backward_call")
        result = self.agent.run_backward(*args)
        self.stamps.mark("ort_backward_return")
        return result


def _train_graph(layer, x):
    """The layer's gradient graph for training its weights, and its feeds in order."""
    graph = layer._bridge.gradient_graph(
        "train", (False,) * len(layer.input_names) + (True,) * len(layer._weight_names), x.device
    )
    feeds = dict(zip(layer._bridge.feed_names, [x, *(w.detach() for w in layer._weights())]))
    return graph, [feeds[k] for k in graph.feed_names]


def _stamped_layer(layer, x, stamps):
    graph, _ = _train_graph(layer, x)
    graph.agent = _TimedAgent(graph.agent, stamps)
    function = layer.function
    forward, backward, apply = function.forward, function.backward, function.apply

    def stamped_forward(*args):
        stamps.mark("fn_forward_in")
        result = forward(*args)
        stamps.mark("fn_forward_out")
        return result

    def stamped_backward(*args):
        stamps.mark("fn_backward_in")
        result = backward(*args)
        stamps.mark("fn_backward_out")
        return result

    def stamped_apply(*args):
        stamps.mark("apply_call")
        result = apply(*args)
        stamps.mark("apply_return")
        return result

    function.forward = staticmethod(stamped_forward)
    function.backward = staticmethod(stamped_backward)
    function.apply = stamped_apply


def _step(module, optimizer, loss_fn, x, y, stamps):
    stamps.mark("start")
    optimizer.zero_grad(set_to_none=True)
    stamps.mark("zero_grad")
    out = module(x)
    stamps.mark("forward")
    loss = loss_fn(out, y)
    stamps.mark("loss")
    loss.backward()
    stamps.mark("backward")
    optimizer.step()
    stamps.mark("step")


def _phases(stamps, spans):
    times = dict(stamps)
    return {label: (times[b] - times[a]) * 1e6 for label, a, b in spans}


def measure(name: str, rounds: int, steps: int) -> dict:
    factory, _, _ = _models.MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x, y = _models.data(name, torch.device("cpu"))
    proto = _models.export(model, x)
    layer = OnnxModule(proto)
    loss_fn = _models.loss_fn(name)
    stamps = _Stamps()
    _stamped_layer(layer, x, stamps)
    raw = bench_step.RawAgentLoop(OnnxModule(proto), x)
    raw.graph.agent = _TimedAgent(raw.graph.agent, stamps)
    variants = {
        "eager": (model, torch.optim.SGD(model.parameters(), lr=LR), EAGER),
        "raw": (raw, torch.optim.SGD(raw.params, lr=LR), RAW),
        "ortbridge": (layer, torch.optim.SGD(layer.parameters(), lr=LR), ORTBRIDGE),
    }
    parts = {v: {label: [] for label, _, _ in spans} for v, (_, _, spans) in variants.items()}
    totals = {v: [] for v in variants}
    glue = {v: [] for v in variants if v != "eager"}
    for round_ in range(rounds + 1):
        for v, (module, optimizer, spans) in variants.items():
            for _ in range(steps):
                stamps.clear()
                if v == "raw":
                    module.step(optimizer, loss_fn, x, y, stamps.mark)
                else:
                    _step(module, optimizer, loss_fn, x, y, stamps)
                if round_:  # the first round warms up
                    phases = _phases(stamps, spans)
                    for label, value in phases.items():
                        parts[v][label].append(value)
                    totals[v].append((stamps[-1][1] - stamps[0][1]) * 1e6)
                    if v in glue:
                        glue[v].append(sum(t for k, t in phases.items() if k not in _NOT_GLUE))
    result = {
        v: {label: statistics.median(values) for label, values in p.items()}
        for v, p in parts.items()
    }
    result["total"] = {v: statistics.median(t) for v, t in totals.items()}
    result["glue"] = {v: statistics.median(t) for v, t in glue.items()}
    result["alone"] = _alone(model, layer, x, y, loss_fn, steps * rounds)
    result["loss_after"] = _loss_after(model, layer, x, y, loss_fn, steps * rounds)
    return result


def _alone(model, layer, x, y, loss_fn, n):
    """Forward + backward without anything around: onnxruntime's, then torch's."""
    C = capi()
    graph, inputs = _train_graph(layer, x)
    agent = graph.agent.agent  # the unstamped one
    out_grad = torch.randn_like(model(x)) / x.shape[0]

    def ort():
        outputs, state = C.OrtValueVector(), C.PartialGraphExecutionState()
        agent.run_forward(to_ortvalues(inputs), outputs, state, None)
        agent.run_backward(to_ortvalues([out_grad]), C.OrtValueVector(), state)

    def eager():
        model.zero_grad(set_to_none=True)
        model(x).backward(out_grad)

    times = {"onnxruntime": [], "torch": []}
    for i in range(n // 10 + 1):
        for label, fn in (("onnxruntime", ort), ("torch", eager)):
            begin = time.perf_counter()
            for _ in range(10):
                fn()
            if i:
                times[label].append((time.perf_counter() - begin) / 10 * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def _loss_after(model, layer, x, y, loss_fn, n):
    """torch's loss alone, timed right after onnxruntime's forward and right after torch's.

    The same call on the same tensors: a difference is what switching from
    one runtime to the other costs the torch code that runs next.
    """
    C = capi()
    graph, inputs = _train_graph(layer, x)
    agent = graph.agent.agent  # the unstamped one
    out = model(x).detach()

    def ort_forward():
        agent.run_forward(
            to_ortvalues(inputs), C.OrtValueVector(), C.PartialGraphExecutionState(), None
        )

    def torch_forward():
        with torch.no_grad():
            model(x)

    times = {"after onnxruntime": [], "after torch": []}
    for i in range(n + 20):
        for label, before in (("after onnxruntime", ort_forward), ("after torch", torch_forward)):
            before()
            begin = time.perf_counter()
            loss_fn(out, y)
            if i >= 20:
                times[label].append((time.perf_counter() - begin) * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=list(_models.MODELS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    r = measure(args.model, args.rounds, args.steps)
    print(f"{args.model}: median us of each phase of a step")
    for variant in ("eager", "raw", "ortbridge"):
        print(f"  {variant}")
        for label, value in r[variant].items():
            print(f"    {label:36s} {value:8.1f}")
        print(f"    {'whole step':36s} {r['total'][variant]:8.1f}")
    ort = r["ortbridge"]["onnxruntime forward"] + r["ortbridge"]["onnxruntime backward"]
    print(
        f"  onnxruntime's two calls: {ort:.1f} us of ortbridge's {r['total']['ortbridge']:.1f} "
        f"({ort / r['total']['ortbridge']:.0%}); ortbridge / eager "
        f"{r['total']['ortbridge'] / r['total']['eager']:.3f}"
    )
    glue, ob = r["glue"], r["ortbridge"]
    in_torch = sum(t for k, t in ob.items() if k.startswith("torch:"))
    print(
        f"  around onnxruntime (not its kernels, the loss, the update or zero_grad): raw loop "
        f"{glue['raw']:.1f} us, ortbridge {glue['ortbridge']:.1f} us; of ortbridge's phases, "
        f"{in_torch:.1f} us run in torch's autograd (the 'torch:' lines)"
    )
    alone = r["alone"]
    print(
        f"  forward + backward alone: onnxruntime {alone['onnxruntime']:.1f} us, torch "
        f"{alone['torch']:.1f} us ({alone['onnxruntime'] / alone['torch']:.3f})"
    )
    after = r["loss_after"]
    print(
        f"  torch's loss alone: {after['after onnxruntime']:.1f} us right after onnxruntime's "
        f"forward, {after['after torch']:.1f} us right after torch's "
        f"({after['after onnxruntime'] / after['after torch']:.2f}x)"
    )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "torch": torch.__version__, **r}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
