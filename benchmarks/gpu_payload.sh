#!/usr/bin/env bash
# gpu_payload.sh: what gpu_checks.sh needs on a lent GPU machine, cut into parts that each
# fit one device call's carry (64 MiB with the project). Run in the project's root, on a
# machine that reaches the package registry, with the tests' model cache filled (a test
# run here fills it). Writes .gpu/part-00 .. part-03 and .gpu/payload.sha (.gpu/ is kept
# out of git through .git/info/exclude).
#
# The payload: onnxruntime-gpu 1.31.1's files for CPython 3.12 without its TensorRT
# provider, xz-compressed (the wheel's 256 MB become about 200), the wheels the machine's
# image lacks (onnx-ad, skl2onnx, docutils) and three published models (PP-OCRv6's
# recogniser, PP-OCRv4's detector, Silero VAD) in the cache's layout.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
work=.gpu/payload
rm -rf "$work" .gpu/part-* && mkdir -p "$work/wheels" "$work/models" .gpu/dl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .gpu/dl onnxruntime-gpu==1.31.1
python3 -m pip download -q --no-deps -d "$work/wheels" onnx-ad==0.3.0 skl2onnx==1.20.0 \
    docutils==0.22.4
unpacked=$(mktemp -d)
python3 -m zipfile -e .gpu/dl/onnxruntime_gpu-1.31.1-*.whl "$unpacked"
rm -f "$unpacked"/onnxruntime/capi/libonnxruntime_providers_tensorrt.so
tar cf - -C "$unpacked" . | xz -9 -T0 > "$work/ort-gpu.tar.xz"
rm -rf "$unpacked"
cache=${ORTBRIDGE_MODEL_CACHE:-$HOME/.cache/ortbridge/published}
for member in \
    rapidocr-3.10.0/rapidocr/models/PP-OCRv6_rec_small.onnx \
    rapidocr_onnxruntime-1.3.24/rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx \
    silero-vad-6.2.3/silero_vad/data/silero_vad.onnx; do
    mkdir -p "$work/models/$(dirname "$member")"
    cp "$cache/$member" "$work/models/$member"
done
tar cf .gpu/payload.tar -C "$work" .
(cd .gpu && sha256sum payload.tar > payload.sha && split -n 4 -d payload.tar part- && rm payload.tar)
ls -l .gpu/part-*
