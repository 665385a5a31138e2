#!/usr/bin/env bash
# Builds the separate virtual environment that benchmarks/bench_ortmodule.py
# runs in: ORTModule (onnxruntime-training 1.19.2) does not work with
# torch >= 2.9, so this environment holds an older torch that it supports,
# onnxruntime-training-cpu 1.19.2 with ORTModule's C++ extensions compiled,
# ortbridge's other dependencies (onnx, numpy, onnx-ad: both engines run) and
# ortbridge itself (installed without its dependencies so that pip keeps the
# old torch). It stays out of CI and never touches the main .venv.
#
# Usage: bash benchmarks/ortmodule_env.sh [VENV_DIR]   (default: .venv-ortmodule)
# Environment: PYTHON (default python3.11), TORCH_VERSION (default 2.3.1).
#
# PyPI's Linux torch wheel depends on the CUDA runtime packages (nvidia-*,
# about 3 GB in all): PyPI has no CPU-only build of an old torch. The CPU is
# used all the same.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-"$root/.venv-ortmodule"}
python=${PYTHON:-python3.11}
torch_version=${TORCH_VERSION:-2.3.1}

"$python" -m venv "$venv"
py="$venv/bin/python"
# setuptools < 70: torch < 2.4 builds extensions with "from pkg_resources import
# packaging", which setuptools 70 removed.
"$py" -m pip install --upgrade pip "setuptools<70" wheel
# torch first and alone, with the numpy it was built against (torch < 2.4
# predates numpy 2).
"$py" -m pip install "torch==$torch_version" "numpy<2"
# onnx 1.16 writes IR 10 at most, what onnxruntime 1.19.2 loads. onnx-ad (the
# onnxruntime engine's reverse mode, pinned as in setup.cfg) needs onnx >= 1.14
# and numpy >= 1.21: these versions suit it. matplotlib draws the benchmark's plot.
"$py" -m pip install "onnxruntime-training-cpu==1.19.2" "onnx==1.16.2" "numpy<2" \
    "onnx-ad==0.3.0" matplotlib ninja "torch==$torch_version"
"$py" -m pip install --no-deps -e "$root"

# ORTModule's C++ extensions (aten op executor, torch interop utils), built
# against this torch.
"$py" -m onnxruntime.training.ortmodule.torch_cpp_extensions.install

"$py" - <<'EOF'
import onnxruntime
import torch
from onnxruntime.training.ortmodule import ORTModule

import ortbridge

model = ORTModule(torch.nn.Linear(4, 2))
loss = model(torch.randn(3, 4)).sum()
loss.backward()
print(
    f"ok: torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
    f"ORTModule and ortbridge {ortbridge.__version__} import and run"
)
EOF
