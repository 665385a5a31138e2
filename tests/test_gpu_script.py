"""``benchmarks/gpu_checks.sh``, what a lent GPU machine runs, rehearsed on the CPU.

``GPU_DRY_RUN=1`` runs every stage of the script here (the benchmarks on the
CPU with one model and one round, the suite's stage collecting only, the CUDA
tests skipping): its stages, limits, logs and the files it leaves for the
device tool to bring back are the GPU run's, so that only the GPU itself is
untried when a session is lent one.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from ortbridge._runtime import _ort

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAGES = ("environment", "cuda_tests", "bench_step", "bench_zoo")


@pytest.mark.skipif(
    _ort.has_training(),
    reason="the GPU machine runs maintained onnxruntime-gpu: rehearsed in that environment",
)
def test_gpu_checks_rehearsal_runs_every_stage_and_leaves_its_logs(tmp_path):
    out = tmp_path / "out"
    env = dict(
        os.environ,
        GPU_DRY_RUN="1",
        GPU_PYTHON=sys.executable,
        GPU_BENCH_OUT=str(tmp_path / "bench"),
    )
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_checks.sh"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    for stage in STAGES:
        assert f"== {stage}: exit 0 " in said, said
    assert "== suite: exit 0" in said, said
    files = {p.name for p in out.iterdir()}
    # The device tool brings back at most eight files.
    assert len(files) <= 8, files
    assert {f"{s}.log" for s in STAGES} | {"suite.log"} <= files, files
    assert any(name.startswith("bench_step") and name.endswith(".json") for name in files)
    assert any(name.startswith("bench_zoo") and name.endswith(".json") for name in files)
    # Without a GPU the CUDA tests are collected and skip; the suite's stage collects.
    assert "skipped" in (out / "cuda_tests.log").read_text()
    assert "tests collected" in (out / "suite.log").read_text()
