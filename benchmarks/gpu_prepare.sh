#!/usr/bin/env bash
# Everything the GPU check (benchmarks/gpu_check.sh) needs, made on a CPU machine before a
# GPU machine is used, so that no GPU time goes to it (both outputs are git-ignored):
#   .gpu/m/ckpt, .gpu/m/model  the default model (two networks) trained on the default synthetic
#                              data (about an hour on one CPU thread; CKPT=DIR reuses a
#                              checkpoint) and exported with --fp16 by this checkout's exporter;
#   .gpu/test_visits.parquet   its test split's visits, for the float16 bars (SCORE_VISITS; the
#                              Jaccard is computed afterwards, on the CPU, against DATA);
#   .whl/ortxz.part-*          onnxruntime-gpu for the GPU machine's Python (cp312), its files
#                              without the TensorRT provider library (not on those machines),
#                              as one `tar | xz -9e` split into parts that each fit one call's
#                              64 MiB with the working tree.
# Then, on the device: one call per part but the last, at once (the machine keeps ignored
# files while it stays warm), and a last call that carries the last part and .gpu and runs
#   WHEELS=.whl MODEL=.gpu/m SCORE_VISITS=.gpu/test_visits.parquet OUT=$OUT bash benchmarks/gpu_check.sh
# Usage (from the repository root, after `make install`):  bash benchmarks/gpu_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
ORT_GPU=${ORT_GPU:-onnxruntime-gpu==1.31.1}  # >= 1.27 for the machines' CUDA 13
PART_BYTES=64705344                           # 61.7 MiB: a part and the working tree fit a call
log() { echo "[gpu_prepare $(date +%T)] $*"; }

# 1. the model (CKPT: a checkpoint to use, DATA: its dataset)
DATA=${DATA:-.gpu/data}
mkdir -p .gpu/m
if [ -n "${CKPT:-}" ]; then
    rm -rf .gpu/m/ckpt && cp -r "$CKPT" .gpu/m/ckpt
elif [ ! -f .gpu/m/ckpt/config.json ]; then
    log "training the default model on the default synthetic data (about an hour)"
    [ -d "$DATA" ] || "$bin/cognet" data synth --out "$DATA" --patients 6350 --seed 0
    "$bin/cognet" train --data "$DATA" --out .gpu/m/ckpt --seed 0 --threads 1 --quiet
fi
rm -rf .gpu/m/model
"$bin/cognet-export" --checkpoint .gpu/m/ckpt --out .gpu/m/model --fp16
if [ -d "$DATA" ]; then  # scored with --all: every test visit, its earlier visits as history
    "$bin/python" -m cognet.demo input "$DATA" .gpu/test_visits.parquet
fi

# 2. onnxruntime-gpu, packed
if ! ls .whl/ortxz.part-* >/dev/null 2>&1; then
    tmp=$(mktemp -d)
    log "downloading $ORT_GPU (cp312, manylinux x86_64)"
    "$bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --dest "$tmp" "$ORT_GPU"
    mkdir -p "$tmp/files" .whl
    "$bin/python" -m zipfile -e "$tmp"/onnxruntime_gpu-*.whl "$tmp/files"
    rm -f "$tmp"/files/onnxruntime/capi/libonnxruntime_providers_tensorrt.so
    log "xz -9e of $(du -sh "$tmp/files" | cut -f1) (a few minutes)"
    tar -C "$tmp/files" -cf - . | xz -9e -T1 | split -b $PART_BYTES - .whl/ortxz.part-
    rm -rf "$tmp"
fi
log "ready: $(ls .whl/ortxz.part-* | wc -l) parts in .whl/, the model in .gpu/m/"
