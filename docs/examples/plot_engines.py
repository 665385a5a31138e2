"""
Which engine runs what, and how fast
====================================

:class:`ortbridge.OnnxModule` computes gradients with one of two engines
(:doc:`../engines`): the training agent of onnxruntime-training 1.19.2, or
the onnxruntime engine, whose standard-op gradient graphs any onnxruntime
runs; ``backend="auto"`` picks one per graph.

The repository's benchmarks record what each engine does on ONNX's own node
test suite (``benchmarks/op_coverage.py``: every case's gradients against
finite differences) and how long training takes
(``benchmarks/bench_*.py``). This example reads those records,
``benchmarks/results/*.json``, and draws them; it runs nothing itself, so the
figures are those of the machine that ran the benchmarks (2 CPU cores; its
versions are printed with each record).
"""

# %%
# Reading the records
# -------------------
#
# One coverage file per engine: ``op_coverage.json`` for the onnxruntime
# engine, ``op_coverage_<engine>.json`` for the others.

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np


def results_folder():
    """``benchmarks/results`` of the repository this script runs in."""
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / "benchmarks" / "results").is_dir():
            return folder / "benchmarks" / "results"
    raise FileNotFoundError("run this script inside the ortbridge repository")


RESULTS = results_folder()
ORDER = ["training-agent", "onnxruntime", "auto"]
coverage = {}
for path in sorted(RESULTS.glob("op_coverage*.json")):
    record = json.loads(path.read_text())
    engine = record["info"].get("backend", "onnxruntime")
    coverage[engine] = record
coverage = dict(
    sorted(coverage.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else 9)
)
for engine, record in coverage.items():
    info = record["info"]
    print(
        f"{engine:15s} onnxruntime {info['onnxruntime']}, onnx {info['onnx']}, "
        f"onnx-ad {info['onnx_ad']}, {info['cores']} cores, {info['seconds']} s"
    )

# %%
# Op types per engine
# -------------------
#
# Each ONNX op type gets one status per engine: ``trains`` (every case
# correct), ``partial`` (some cases correct, the others refused with an
# error naming the node), ``refused``, ``wrong`` (a case whose gradient
# disagrees with finite differences), ``zero-gradient`` (correct, but the
# derivative is zero everywhere), ``no-gradient-path`` (no float input or
# output to differentiate) and ``skipped`` (cases the installed onnxruntime
# cannot load).

STATUSES = [
    "trains",
    "partial",
    "zero-gradient",
    "wrong",
    "refused",
    "error",
    "no-gradient-path",
    "skipped",
]
engines = list(coverage)
counts = {
    engine: {s: sum(1 for op in record["op_types"].values() if op["status"] == s) for s in STATUSES}
    for engine, record in coverage.items()
}
print(f"{'status':18s}" + "".join(f"{engine:>16s}" for engine in engines))
for status in STATUSES:
    print(f"{status:18s}" + "".join(f"{counts[engine][status]:16d}" for engine in engines))
totals = {engine: record["summary"]["cases"] for engine, record in coverage.items()}
print(f"{'correct cases':18s}" + "".join(f"{totals[e]['correct']:16d}" for e in engines))
print(f"{'wrong cases':18s}" + "".join(f"{totals[e]['wrong']:16d}" for e in engines))

fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(engines)))
left = np.zeros(len(engines))
colors = plt.get_cmap("tab10").colors
for i, status in enumerate(STATUSES):
    widths = np.array([counts[engine][status] for engine in engines])
    if widths.any():
        ax.barh(engines, widths, left=left, color=colors[i], label=status)
    left += widths
ax.set_xlabel("ONNX op types")
ax.invert_yaxis()
ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
ax.set_title("Gradients on ONNX's node test suite, per engine")
fig.tight_layout()

# %%
# Where the engines differ
# ------------------------
#
# The op types that at least one engine trains (fully or partly) and whose
# status is not the same for every engine: this is where the choice of
# ``backend`` matters.

useful = {"trains", "partial"}
differ = sorted(
    op
    for op in coverage[engines[0]]["op_types"]
    if len({coverage[e]["op_types"].get(op, {}).get("status") for e in engines}) > 1
    and any(coverage[e]["op_types"].get(op, {}).get("status") in useful for e in engines)
)
print(f"{len(differ)} op types:")
print(f"{'op type':28s}" + "".join(f"{engine:>17s}" for engine in engines))
for op in differ:
    row = [coverage[e]["op_types"].get(op, {}).get("status", "-") for e in engines]
    print(f"{op:28s}" + "".join(f"{status:>17s}" for status in row))

# %%
# Training speed
# --------------
#
# Three benchmarks, each time as a ratio to a reference measured in the same
# run (below 1: faster than the reference).
#
# * ``bench_step.py``: one training step of a torch model whose ONNX layer
#   runs on each engine, against the same model in torch eager. The LSTM and
#   the UNet decoder only run on the onnxruntime engine.
# * ``bench_training_paths.py``: a step of a 784-256-256-10 MLP (batch 64)
#   trained in several ways, against torch eager, in the training build's
#   environment and in maintained onnxruntime's.
# * ``bench_sklearn.py``: fitting an ``MLPRegressor``-shaped network
#   (1000x100 rows, batches of 15, 100 epochs) with ``OnnxSGDRegressor`` and
#   ``OrtFullGraphTrainer``, against scikit-learn's ``MLPRegressor``.


def load(name):
    return json.loads((RESULTS / name).read_text())


step = load("bench_step.json")
paths = load("bench_training_paths_784.json")
sklearn = load("bench_sklearn.json")
# The ratios to torch eager depend on the processor (torch's matrix products
# are MKL's): the figures say which one they come from.
print("bench_step:", {k: step["info"].get(k) for k in ("cpu", "cores", "torch", "onnxruntime")})

fig, (ax_step, ax_paths, ax_sk) = plt.subplots(
    3, 1, figsize=(8, 12), gridspec_kw={"height_ratios": [5, 5, 4]}
)

# One step of a torch model with an ONNX layer, per engine.
models = [r["model"] for r in step["results"]]
series = {"training agent": "ortbridge/eager", "onnxruntime engine": "ob-ort/eager"}
pos = np.arange(len(models))
for i, (label, key) in enumerate(series.items()):
    values = [r.get(key) for r in step["results"]]
    widths = [np.nan if v is None else v for v in values]
    ax_step.barh(pos + (i - 0.5) * 0.4, widths, 0.4, label=label)
ax_step.axvline(1.0, color="k", lw=0.8)
ax_step.set_yticks(pos, models)
ax_step.invert_yaxis()
ax_step.set_xlabel("step time / torch eager's")
ax_step.set_title("One training step, OnnxModule in a torch model (bench_step.py)")
ax_step.legend(fontsize="small", loc="upper right")

# Ways to train one MLP, per onnxruntime.
print(f"\n{'784-256-256-10 MLP, ms a step':36s}", end="")
parts = paths["parts"]
for part in parts:
    print(f"{part['runtime']['kind'] + ' ' + part['runtime']['onnxruntime']:>24s}", end="")
print()
ways = [row["way"] for row in parts[0]["rows"] if "eager" not in row["way"]]
for part in parts[1:]:
    ways += [r["way"] for r in part["rows"] if r["way"] not in ways and "eager" not in r["way"]]
for way in ways + ["torch eager (reference)"]:
    print(f"{way:36s}", end="")
    for part in parts:
        ms = {r["way"]: r["ms_per_step"] for r in part["rows"]}.get(way)
        print(f"{'-' if ms is None else f'{ms:.3f}':>24s}", end="")
    print()
pos = np.arange(len(ways))
for i, part in enumerate(parts):
    ms = {r["way"]: r["ms_per_step"] for r in part["rows"]}
    eager = ms["torch eager (reference)"]
    heights = [ms[w] / eager if w in ms else np.nan for w in ways]
    label = f"{part['runtime']['kind']} {part['runtime']['onnxruntime']}"
    ax_paths.barh(pos + (i - 0.5) * 0.4, heights, 0.4, label=label)
ax_paths.axvline(1.0, color="k", lw=0.8)
ax_paths.set_yticks(pos, ways, fontsize="small")
ax_paths.invert_yaxis()
ax_paths.set_xlabel("step time / torch eager's")
ax_paths.set_title("Ways to train a 784-256-256-10 MLP (bench_training_paths.py)")
ax_paths.legend(fontsize="small", loc="upper right")

# Fitting an MLP: ortbridge's estimators against scikit-learn.
labels = {
    "estimator/training-agent": "OnnxSGDRegressor, builder",
    "estimator/onnxruntime": "OnnxSGDRegressor, onnx-ad",
    "full_graph/training-agent": "OrtFullGraphTrainer, builder",
    "full_graph/onnxruntime": "OrtFullGraphTrainer, onnx-ad",
}
pos = np.arange(len(labels))
for i, part in enumerate(sklearn["parts"]):
    ratios = part["ratios"]
    widths = [ratios.get(key, np.nan) for key in labels]
    label = f"{part['runtime']['kind']} {part['runtime']['onnxruntime']}"
    ax_sk.barh(pos + (i - 0.5) * 0.4, widths, 0.4, label=label)
ax_sk.axvline(1.0, color="k", lw=0.8)
ax_sk.set_yticks(pos, list(labels.values()), fontsize="small")
ax_sk.invert_yaxis()
ax_sk.set_xlabel("fit time / scikit-learn's")
ax_sk.set_title("Fitting an MLPRegressor-shaped network (bench_sklearn.py)")
ax_sk.legend(fontsize="small", loc="lower right")
fig.tight_layout()
plt.show()
