"""Forward + backward in onnxruntime: the builder's graph against ortbridge's rewrite.

onnxruntime's CPU ``ReluGrad`` kernel is slow; ortbridge rewrites it into
``Greater`` + ``Cast`` + ``Mul``
(``ortbridge/_engines/training_agent/_gradient_rewrites.py``). This script
times, interleaved in one process, one forward + backward of each model's
gradient graph through the TrainingAgent, three ways: the graph as
onnxruntime's builder writes it, the graph ortbridge runs, and torch eager's
forward + backward on the original module. Then it profiles both graphs with
onnxruntime's profiler and prints the time per operator type.

Hypothesis: the rewrite makes a ReLU network's forward + backward faster
(ortbridge / builder < 1) and puts onnxruntime's forward + backward below
torch's on the MLP.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from unittest import mock

import onnxruntime
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _models  # noqa: E402

from ortbridge import OnnxModule
from ortbridge._engines.training_agent import _engine as agent_engine  # noqa: E402
from ortbridge._runtime._ort import capi  # noqa: E402
from ortbridge._runtime._runs import to_ortvalues  # noqa: E402
from ortbridge._runtime._sessions import default_session_options  # noqa: E402

CPU = torch.device("cpu")


def gradient_graph(proto, x, rewrite: bool, profile_prefix=None):
    """The TrainingAgent graph of every weight, with or without the rewrite."""
    options = default_session_options(CPU)
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    rewriter = agent_engine.rewrite_gradient if rewrite else (lambda model, device_type: {})
    # The agent's engine applies the rewrite where it builds the gradient graph.
    with mock.patch.object(agent_engine, "rewrite_gradient", rewriter):
        layer = OnnxModule(proto, session_options=options)
        needs = [False] * len(layer.input_names) + [True] * len(layer._weight_names)
        graph = layer._bridge.gradient_graph("train", needs, CPU)
    weights = [layer.onnx_weight(n).detach() for n in layer._weight_names]
    feeds = dict(zip(layer._bridge.feed_names, [x, *weights]))
    return graph, [feeds[n] for n in graph.feed_names]


def runner(graph, feeds, grad_output):
    C = capi()

    def run():
        outputs, state = C.OrtValueVector(), C.PartialGraphExecutionState()
        graph.agent.run_forward(to_ortvalues(feeds), outputs, state, None)
        grads = C.OrtValueVector()
        graph.agent.run_backward(to_ortvalues([grad_output]), grads, state)
        return grads

    return run


def per_op_type(graph, feeds, grad_output, calls: int) -> dict[str, float]:
    """Median microseconds per call of each operator type, from onnxruntime's profile."""
    run = runner(graph, feeds, grad_output)
    for _ in range(calls):
        run()
    path = graph.session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    per_node, op_of = collections.defaultdict(list), {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_node[event["name"]].append(event["dur"])
            op_of[event["name"]] = event["args"].get("op_name", "?")
    totals = collections.Counter()
    for node, durations in per_node.items():
        totals[op_of[node]] += statistics.median(durations[len(durations) // 4 :])
    return dict(totals.most_common())


def measure(name: str, rounds: int, calls: int) -> dict:
    factory = _models.MODELS[name][0]
    torch.manual_seed(0)
    model = factory()
    x, _ = _models.data(name, CPU)
    proto = _models.export(model, x)
    grad_output = torch.randn_like(model(x))

    def eager():
        for p in model.parameters():
            p.grad = None
        model(x).backward(grad_output)

    ways = {"eager": eager}
    for label, rewrite in (("builder", False), ("ortbridge", True)):
        graph, feeds = gradient_graph(proto, x, rewrite)
        ways[label] = runner(graph, feeds, grad_output)
    for run in ways.values():
        for _ in range(calls):
            run()
    times = {k: [] for k in ways}
    for _ in range(rounds):
        for label, run in ways.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[label].append((time.perf_counter() - start) / calls * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    profiles = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, rewrite in (("builder", False), ("ortbridge", True)):
            graph, feeds = gradient_graph(proto, x, rewrite, os.path.join(tmp, label))
            profiles[label] = per_op_type(graph, feeds, grad_output, calls * 4)
    return {
        "model": name,
        "ms": ms,
        "all_ms": times,
        "ortbridge/builder": ms["ortbridge"] / ms["builder"],
        "ortbridge/eager": ms["ortbridge"] / ms["eager"],
        "builder/eager": ms["builder"] / ms["eager"],
        "us_per_op_type": profiles,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(_models.MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="calls timed per round")
    parser.add_argument("--top", type=int, default=8, help="operator types shown")
    parser.add_argument("--output", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    results = []
    for name in args.models:
        print(f"measuring {name} ...", flush=True)
        results.append(measure(name, args.rounds, args.calls))
    print(f"\n{'model':12s} {'eager ms':>9s} {'builder':>9s} {'ortbridge':>9s} "
          f"{'ob/builder':>10s} {'ob/eager':>8s} {'builder/eager':>13s}")  # fmt: skip
    for r in results:
        ms = r["ms"]
        print(
            f"{r['model']:12s} {ms['eager']:9.3f} {ms['builder']:9.3f} {ms['ortbridge']:9.3f} "
            f"{r['ortbridge/builder']:10.3f} {r['ortbridge/eager']:8.3f} "
            f"{r['builder/eager']:13.3f}"
        )
    for r in results:
        print(f"\n{r['model']}: us per call by operator type (onnxruntime's profiler)")
        for label, ops in r["us_per_op_type"].items():
            top = list(ops.items())[: args.top]
            shown = ", ".join(f"{op} {us:.0f}" for op, us in top)
            print(f"  {label:9s} total {sum(ops.values()):7.0f}: {shown}")
    if args.output:
        meta = {
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
            "threads": torch.get_num_threads(),
        }
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
