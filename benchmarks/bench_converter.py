"""ortbridge against the converter route on published models: onnx2fx, then torch autograd.

What a user may pick instead of ortbridge: convert the file to a torch FX
module (``onnx2fx.convert`` and ``make_trainable``) and train that, eagerly
or under ``torch.compile`` (default mode). Side by side in one process, on
the published files the test suite fetches (``tests/_published.py``) at
realistic input sizes, at a small batch (1-2) and a fine-tuning batch
(4-64):

- ``ortbridge``: ``OnnxModule(path)`` with the defaults (``auto``);
- ``agent``: the training agent, where the training build is installed;
- ``onnx2fx``: the converted module, torch eager;
- ``onnx2fx compiled`` (``--compiled``): it under ``torch.compile``.

A step: gradients set to None, forward in eval mode, backward of
``sum(out * w)`` over the float outputs (``w`` fixed). Medians of
interleaved rounds. Reported beside each step: what building took (for
ortbridge the module and its first step; for onnx2fx the conversion and its
first step; compiled, the compilation and its first step), and the largest
difference of the outputs from ortbridge's (both routes run one file).

Hypothesis (issue 48): ortbridge's step is at most 1.0x onnx2fx eager's on
every model it converts. ``--profile`` prints, per model and batch, where a
step's time goes by op type: onnxruntime's node times for ortbridge (its
profiler, forward and backward sessions together) and torch's operator
times for onnx2fx (torch.profiler), each per step.

onnx2fx is not a dependency: ``pip install onnx2fx==0.0.1`` in the
benchmark's environment (maintained onnxruntime's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

from _profiles import engine_ms_by_op, profiling_options  # noqa: E402
from _published import CORPUS, HELD_OUT, fetch  # noqa: E402

import ortbridge  # noqa: E402
from ortbridge._runtime import _ort  # noqa: E402

#: model id -> (input name -> shape with "B" for the batch), small and fine-tuning batch.
SIZES = {
    "PP-OCRv6_rec_small": ({"x": ("B", 3, 48, 320)}, (1, 8)),
    "ch_PP-OCRv4_rec_infer": ({"x": ("B", 3, 48, 320)}, (1, 8)),
    "PP-OCRv6_det_small": ({"x": ("B", 3, 320, 320)}, (1, 4)),
    "320n": ({"images": ("B", 3, 320, 320)}, (1, 4)),
    "ch_ppocr_mobile_v2.0_cls_mobile": ({"x": ("B", 3, 48, 192)}, (2, 16)),
    "embedding_model": ({"input_1": ("B", 76, 32, 1)}, (2, 16)),
    "silero_vad_16k_sequence": (
        {"input": ("B", 576), "h": (1, 1, 128), "c": (1, 1, 128)},
        (2, 64),
    ),
    "model-magika": ({"bytes": ("B", 1536)}, (2, 16)),
}


def _published(model_id):
    for model in CORPUS + HELD_OUT:
        if model.id == model_id:
            return model
    raise SystemExit(f"no published model {model_id!r}; known: {sorted(SIZES)}")


def _feeds(model_id, names, batch):
    shapes, _ = SIZES[model_id]
    rng = np.random.default_rng(batch)
    out = []
    for name in names:
        shape = tuple(batch if d == "B" else d for d in shapes[name])
        if model_id == "model-magika":  # bytes of printable text
            value = rng.integers(32, 127, shape).astype(np.float32)
        else:
            value = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        out.append(torch.from_numpy(value))
    return out


def _step_fn(module, feeds, weights):
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        outs = module(*feeds)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        loss = sum((o * w).sum() for o, w in zip(outs, weights) if w is not None)
        loss.backward()
        return outs

    return step


def _weights(outs):
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None
        for o in outs
    ]


def _frozen_statistics(module):
    """make_trainable makes BatchNorm's running statistics parameters too, which
    F.batch_norm refuses to differentiate: the workaround a user needs. A
    statistic held as a weight is frozen; one computed from weights (tf2onnx's
    files) is detached, which drops the gradient ortbridge gives those weights."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node.target, "__name__", "") != "_batch_norm":
            continue
        args = list(node.args)
        for i in (3, 4):
            arg = args[i]
            if getattr(arg, "op", None) == "get_attr":
                try:
                    module.get_parameter(arg.target).requires_grad_(False)
                except AttributeError:  # a buffer still: nothing to freeze
                    pass
            elif isinstance(arg, torch.fx.Node):
                with graph.inserting_before(node):
                    args[i] = graph.call_method("detach", (arg,))
        node.args = tuple(args)
    module.recompile()
    return module


def _ways(path, model_id, batch, compiled: bool, agent: bool):
    """name -> (step, build + first step s, outputs of the first step)."""
    import onnx2fx

    found = {}
    start = time.perf_counter()
    layer = ortbridge.OnnxModule(path).eval()
    feeds = _feeds(model_id, layer.input_names, batch)
    with torch.no_grad():
        first = layer(*feeds)
    first = first if isinstance(first, tuple) else (first,)
    weights = _weights(first)
    step = _step_fn(layer, feeds, weights)
    outs = step()
    found["ortbridge"] = (step, time.perf_counter() - start, outs)
    if agent:
        start = time.perf_counter()
        try:
            held = ortbridge.OnnxModule(path, backend="training-agent").eval()
            step = _step_fn(held, feeds, weights)
            outs = step()
            found["agent"] = (step, time.perf_counter() - start, outs)
        except ortbridge.OrtBridgeError as exc:  # the agent's refusal is a result
            found["agent"] = (None, f"{type(exc).__name__}: {exc}"[:200], None)
    start = time.perf_counter()
    converted = None
    try:
        converted = _frozen_statistics(onnx2fx.make_trainable(onnx2fx.convert(str(path))))
        converted.eval()
        step = _step_fn(converted, feeds, weights)
        outs = step()
        found["onnx2fx"] = (step, time.perf_counter() - start, outs)
    except Exception as exc:  # noqa: BLE001 - a converter's refusal is a result
        found["onnx2fx"] = (None, f"{type(exc).__name__}: {exc}"[:200], None)
    if compiled and converted is not None:
        start = time.perf_counter()
        try:
            fast = torch.compile(converted)
            step = _step_fn(fast, feeds, weights)
            outs = step()
            found["onnx2fx compiled"] = (step, time.perf_counter() - start, outs)
        except Exception as exc:  # noqa: BLE001
            found["onnx2fx compiled"] = (None, f"{type(exc).__name__}: {exc}"[:200], None)
    return found


def _time(ways, rounds, budget_s):
    runnable = {n: w[0] for n, w in ways.items() if w[0] is not None}
    # Steps per round from one timed step of the slowest way: rounds of about budget_s.
    slowest = 0.0
    for step in runnable.values():
        start = time.perf_counter()
        step()
        slowest = max(slowest, time.perf_counter() - start)
    steps = max(1, min(50, int(budget_s / max(slowest, 1e-4))))
    times = {n: [] for n in runnable}
    for _ in range(rounds):
        for name, step in runnable.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def _difference(ways):
    ref = ways["ortbridge"][2]
    out = {}
    for name, (_, _, outs) in ways.items():
        if outs is None or name == "ortbridge":
            continue
        worst = 0.0
        for a, b in zip(ref, outs):
            if a.is_floating_point():
                scale = max(float(a.detach().abs().max()), 1e-6)
                worst = max(worst, float((a.detach() - b.detach()).abs().max()) / scale)
        out[name] = worst
    return out


def _profile(path, model_id, batch, steps=5, shown=8):
    """Milliseconds per step by op type: onnxruntime's nodes (ortbridge, each
    node's median over the steps after the first), torch's ops (onnx2fx)."""
    import tempfile

    import onnx2fx

    with tempfile.TemporaryDirectory() as tmp:
        layer = ortbridge.OnnxModule(path, session_options=profiling_options(tmp)).eval()
        feeds = _feeds(model_id, layer.input_names, batch)
        first = layer(*feeds)  # the gradient sessions' forward: the first step's
        first = first if isinstance(first, tuple) else (first,)
        weights = _weights(first)
        sum((o * w).sum() for o, w in zip(first, weights) if w is not None).backward()
        step = _step_fn(layer, feeds, weights)
        for _ in range(steps):
            step()
        ours = engine_ms_by_op(layer, tmp)
    converted = _frozen_statistics(onnx2fx.make_trainable(onnx2fx.convert(str(path)))).eval()
    step = _step_fn(converted, feeds, weights)
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    theirs = {}
    for item in prof.key_averages():
        if item.key.startswith("aten::") and item.self_cpu_time_total > 0:
            theirs[item.key] = item.self_cpu_time_total / 1e3 / steps
    for label, table in (("ortbridge (onnxruntime nodes)", ours), ("onnx2fx (torch ops)", theirs)):
        top = sorted(table.items(), key=lambda kv: -kv[1])[:shown]
        total = sum(table.values())
        print(f"    {label}: {total:.1f} ms, " + ", ".join(f"{k} {v:.1f}" for k, v in top))
    return {"ortbridge": ours, "onnx2fx": theirs}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES))
    parser.add_argument("--batch", choices=["small", "large", "both"], default="both")
    parser.add_argument("--compiled", action="store_true", help="add onnx2fx under torch.compile")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per way per round")
    parser.add_argument("--profile", action="store_true", help="time by op type, both routes")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_converter.json"))
    args = parser.parse_args()
    try:
        import onnx2fx  # noqa: F401
    except ImportError:
        raise SystemExit("onnx2fx is not installed: pip install onnx2fx==0.0.1") from None
    agent = _ort.has_training()
    picks = {"small": (0,), "large": (1,), "both": (0, 1)}[args.batch]
    rows = []
    for model_id in args.models:
        path = fetch(_published(model_id))
        for pick in picks:
            batch = SIZES[model_id][1][pick]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ways = _ways(path, model_id, batch, args.compiled, agent)
                ms = _time(ways, args.rounds, args.budget)
            row = {
                "model": model_id,
                "batch": batch,
                "ms": ms,
                "build_s": {n: w[1] for n, w in ways.items()},
                "difference": _difference(ways),
            }
            rows.append(row)
            ratios = ", ".join(
                f"/{n} {ms['ortbridge'] / ms[n]:.2f}" for n in ms if n != "ortbridge"
            )
            shown = ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items())
            built = ", ".join(
                f"{n} {v:.1f} s" if isinstance(v, float) else f"{n}: {v}"
                for n, v in row["build_s"].items()
            )
            print(f"{model_id} batch {batch}: {shown}; ortbridge {ratios}", flush=True)
            print(f"    build + first step: {built}; differences {row['difference']}", flush=True)
            if args.profile:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    row["profile_ms"] = _profile(path, model_id, batch)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "onnxruntime": _ort.build()[0],
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
