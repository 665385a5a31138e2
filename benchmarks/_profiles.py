"""The onnxruntime engine's time by op type, from onnxruntime's profiler.

Shared by the benchmarks that print where a step's time goes inside
onnxruntime (``bench_zoo.py --profile``, ``bench_converter.py --profile``).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import statistics

from ortbridge._runtime import _ort


def profiling_options(folder: str):
    """Session options whose sessions write their profiles into ``folder``."""
    options = _ort.runtime().SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(folder, "ort")
    return options


def engine_ms_by_op(module, folder: str, shown: int | None = None) -> dict[str, float]:
    """Milliseconds per step by op type in ``module``'s gradient sessions (built
    with :func:`profiling_options`): each node's median over the runs after the
    first (which allocates), summed by op type; the ``shown`` largest."""
    for graph in module._bridge._gradient_graphs.values():
        for session in graph.sessions:
            session.end_profiling()
    runs: dict = collections.defaultdict(list)
    for path in glob.glob(os.path.join(folder, "*.json")):
        with open(path) as f:
            for event in json.load(f):
                if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                    key = (path, event["args"].get("op_name", "?"), event["name"])
                    runs[key].append(event["dur"] / 1e3)
    by_op: dict = collections.Counter()
    for (_, op, _), ms in runs.items():
        by_op[op] += statistics.median(ms[1:] or ms)
    return dict(by_op.most_common(shown))
