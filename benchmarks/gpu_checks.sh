#!/usr/bin/env bash
# gpu_checks.sh OUT: the checks a lent GPU machine runs, from the project's root there.
#
# GPU_STAGES names the stages to run (default: all of environment suite cuda_tests
# bench_step bench_zoo). Expects /tmp/payload.tar, put together from the parts
# gpu_payload.sh cuts (the machine reaches no registry), and .gpu/payload.sha beside
# the project: onnxruntime-gpu's files (ort-gpu.tar.xz), wheels the machine's image
# lacks (onnx-ad, skl2onnx, docutils) and published models (models/, a model cache).
# Each stage has its own time limit and log under OUT, so a stage that runs over still
# leaves the others' results; OUT gets at most eight files (the device tool brings back
# no more).
set -u
out=${1:?usage: gpu_checks.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=${GPU_SITE:-/tmp/site}
if [ ! -d "$site/onnxruntime" ]; then
    (cd /tmp && sha256sum -c "$OLDPWD/.gpu/payload.sha" && mkdir -p payload "$site" \
        && tar xf payload.tar -C payload && tar xJf payload/ort-gpu.tar.xz -C "$site" \
        && python3 -m pip install -q --no-index --no-deps --target "$site" payload/wheels/*.whl) \
        >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
fi
export PYTHONPATH="$site:$PWD" ORTBRIDGE_MODEL_CACHE=/tmp/payload/models
# onnxruntime's CUDA provider loads cuDNN and cuBLAS: those of torch's NVIDIA packages.
nvidia_libs=$(python3 - <<'EOF'
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = spec.submodule_search_locations if spec else []
print(":".join(sorted({os.path.dirname(p) for r in roots
                       for p in glob.glob(os.path.join(r, "**", "lib*.so*"), recursive=True)})))
EOF
)
export LD_LIBRARY_PATH="$nvidia_libs:${LD_LIBRARY_PATH:-}"

stage() {  # stage NAME SECONDS COMMAND...: COMMAND's output in OUT/NAME.log, its end shown
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n 25 "$out/$name.log"
}

stages=${GPU_STAGES:-environment suite cuda_tests bench_step bench_zoo}
has() { [[ " $stages " == *" $1 "* ]]; }
model=$ORTBRIDGE_MODEL_CACHE/rapidocr-3.10.0/rapidocr/models/PP-OCRv6_rec_small.onnx
has environment && stage environment 45 bash -c \
    "nvidia-smi -L; echo overcommit \$(cat /proc/sys/vm/overcommit_memory); python3 -m ortbridge inspect $model"
# The CUDA tests first and alone: the memory checks read the device's free memory,
# which another process's CUDA work would move.
has cuda_tests && stage cuda_tests 240 python3 -m pytest -q -p no:cacheprovider -rs -s \
    tests/test_cuda.py tests/test_execution.py -k "cuda or CUDA"
# Then the whole suite (published models but the carried ones need the registry: left
# out; the CUDA tests ran above) in the background on most cores.
if has suite; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 10 --timeout 150 tests \
        --ignore=tests/test_published_models.py --ignore=tests/test_cuda.py \
        >"$out/suite.log" 2>&1 &
    suite=$!
fi
if has suite; then
    wait $suite
    echo "== suite: exit $?"
    tail -n 30 "$out/suite.log"
fi
has bench_step && stage bench_step 120 python3 benchmarks/bench_step.py --device cuda --compile \
    --rounds 5 --steps 10 --out /tmp/bench
has bench_zoo && stage bench_zoo 120 python3 benchmarks/bench_zoo.py --device cuda --rounds 3 \
    --out /tmp/bench
# GPU_EXTRA: a command of the session's own, run last in this environment.
[ -n "${GPU_EXTRA:-}" ] && stage extra 150 bash -c "$GPU_EXTRA"
cp /tmp/bench/bench_step_cuda.json /tmp/bench/bench_zoo_cuda.json "$out"/ 2>/dev/null
exit 0
