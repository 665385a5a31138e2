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
#
# GPU_DRY_RUN=1 rehearses it here, on the CPU (tests/test_gpu_script.py does, in CI):
# no payload, this environment's Python (GPU_PYTHON), the benchmarks on the CPU with one
# model and one round, the suite's stage collecting only, the CUDA tests skipping. The
# stages, their limits, logs and the files left under OUT are the GPU run's.
set -u
out=${1:?usage: gpu_checks.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${GPU_PYTHON:-python3}
dry=${GPU_DRY_RUN:-}
device=cuda
site=${GPU_SITE:-/tmp/site}
if [ -n "$dry" ]; then
    export CUDA_VISIBLE_DEVICES=""
    device=cpu
elif [ ! -d "$site/onnxruntime" ]; then
    (cd /tmp && sha256sum -c "$OLDPWD/.gpu/payload.sha" && mkdir -p payload "$site" \
        && tar xf payload.tar -C payload && tar xJf payload/ort-gpu.tar.xz -C "$site" \
        && python3 -m pip install -q --no-index --no-deps --target "$site" payload/wheels/*.whl) \
        >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
fi
if [ -z "$dry" ]; then
    # No registry there: the tests' published files but the carried ones skip, named.
    export PYTHONPATH="$site:$PWD" ORTBRIDGE_MODEL_CACHE=/tmp/payload/models ORTBRIDGE_OFFLINE=1
fi
# onnxruntime's CUDA provider loads cuDNN and cuBLAS: those of torch's NVIDIA packages.
nvidia_libs=$("$py" - <<'EOF'
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
model=$("$py" -c "from ortbridge.examples import published_file as f
print(f('rapidocr', '3.10.0', 'rapidocr/models/PP-OCRv6_rec_small.onnx'))")
has environment && stage environment 45 bash -c \
    "nvidia-smi -L; echo overcommit \$(cat /proc/sys/vm/overcommit_memory); $py -m ortbridge inspect $model"
# The CUDA tests first and alone: the memory checks read the device's free memory,
# which another process's CUDA work would move.
has cuda_tests && stage cuda_tests 240 "$py" -m pytest -q -p no:cacheprovider -rs -s \
    tests/test_cuda.py tests/test_execution.py -k "cuda or CUDA"
# Then the whole suite, alone on most cores (the published models but the carried
# ones need the registry: left out; the CUDA tests ran above). -v: each test's result
# is written as it ends, so a suite cut off at its limit still names its failures.
if has suite; then
    # The rehearsal collects only, without the GPU image's xdist and timeout plugins.
    parallel=(-v -n 14 --timeout 150)
    [ -n "$dry" ] && parallel=(-q --collect-only)
    start=$SECONDS
    timeout 300 "$py" -m pytest -p no:cacheprovider -rf "${parallel[@]}" tests \
        --ignore=tests/test_published_models.py --ignore=tests/test_cuda.py \
        >"$out/suite.log" 2>&1
    echo "== suite: exit $? after $((SECONDS - start)) s"
    grep -E "(FAILED|ERROR) tests/" "$out/suite.log" | sort -u | head -n 40
    tail -n 3 "$out/suite.log"
fi
bench=${GPU_BENCH_OUT:-/tmp/bench}
step_args=(--rounds 5 --steps 10)
zoo_args=(--rounds 3)
if [ -n "$dry" ]; then
    step_args=(--rounds 1 --steps 1 --models mlp)
    zoo_args=(--rounds 1 --steps 1 --models resnet)
fi
has bench_step && stage bench_step 120 "$py" benchmarks/bench_step.py --device $device --compile \
    "${step_args[@]}" --out "$bench"
has bench_zoo && stage bench_zoo 120 "$py" benchmarks/bench_zoo.py --device $device \
    "${zoo_args[@]}" --out "$bench"
# GPU_EXTRA: a command of the session's own, run last in this environment.
[ -n "${GPU_EXTRA:-}" ] && stage extra 150 bash -c "$GPU_EXTRA"
cp "$bench"/bench_step*.json "$bench"/bench_zoo*.json "$out"/ 2>/dev/null
exit 0
