#!/usr/bin/env bash
# The GPU check of the runtime, in one call on a machine with an NVIDIA GPU (about 6 minutes):
#   1. installs onnxruntime-gpu into /tmp/site from the xz parts (ortxz.part-*: the wheel's
#      files) or a wheel (or its split parts) under $WHEELS, and the project itself (editable,
#      no dependencies: the machine has them);
#   2. prints onnxruntime's providers and opens CUDA sessions (get_providers() read back);
#   3. the first run: the default decoding of the day (DEFAULT_DECODING: the set head's one
#      pass, `marginal`, for a model trained by `cognet train`) and beam 4, batch 16,384 over
#      16,384 visits, ort-cuda float32 and float16 (FIRST_ENGINES) checked against torch-cuda
#      (the correctness reference, untimed), with the profile; then the one-pass decoding
#      alone at batch 65,536 (it has no decoding loop);
#   4. runs `pytest -m gpu` (ort-cuda on both selections, TopK ties on CUDA, set decoding and
#      torch-cuda against the torch reference, the one pass against the CPU runtime, the CLI);
#   5. with LEVERS=1, the levers: beam 4 over 65,536 visits, batch sizes 4,096 / 16,384 /
#      65,536: ort-cuda, ort-cuda-streams (4 host threads feeding the GPU), ort-cuda-fp16 and
#      ort-cuda-fp16-streams (BENCH_ENGINES), and set decoding on 16,384 visits;
#   6. with SCORE_VISITS, scores that file with the default decoding and beam 4, float32 and
#      float16 (the float16 bars);
#   7. writes results-<gpu>-first.* and results-<gpu>-onepass.* (step 3, with where ort-cuda's
#      time goes for beam 4 and the one pass: per graph, the host's µs a visit, the copies
#      between host and device a visit), results-<gpu>.* and results-<gpu>-set.* (step 5),
#      gpu-mem.csv (the GPU's memory in use, each second) and
#      the logs under $OUT (default gpu-check/). Each step has a time limit (FIRST_S, BENCH_S,
#      BENCH2_S, SCORE_S, PYTEST_S seconds) and each run of a bench one (RUN_S, RUN2_S).
#
# Usage (from the repository root):  WHEELS=.whl MODEL=bench/demo bash benchmarks/gpu_check.sh
# MODEL holds model/ (cognet-export --fp16 of this version: older exports lack graphs the GPU
# path uses) and ckpt/ (its checkpoint); without it the demo model is built on the GPU first.
# The wheel must match the machine's CUDA (onnxruntime-gpu >= 1.27 for CUDA 13); see
# docs/guide/gpu.md "Running the GPU check" for how it is carried there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
WHEELS=${WHEELS:-.whl}
MODEL=${MODEL:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
log() { echo "[gpu_check $(date +%T)] $*"; }

# 1. onnxruntime-gpu and the project
if [ ! -d /tmp/site/onnxruntime ] && ls "$WHEELS"/ortxz.part-* >/dev/null 2>&1; then
    # the wheel's onnxruntime/ and dist-info, xz-compressed (benchmarks/gpu_prepare.sh)
    mkdir -p /tmp/site
    cat "$WHEELS"/ortxz.part-* | $PY -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')" \
        || { log "cannot unpack $WHEELS/ortxz.part-*"; rm -rf /tmp/site; exit 2; }
fi
if [ ! -d /tmp/site/onnxruntime ]; then
    wheel=$(ls "$WHEELS"/onnxruntime_gpu-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ] && ls "$WHEELS"/ort.part-* >/dev/null 2>&1; then
        wheel=/tmp/onnxruntime_gpu-1.30.0-cp312-cp312-manylinux_2_28_x86_64.whl
        cat "$WHEELS"/ort.part-* >"$wheel"
    fi
    [ -n "$wheel" ] || { log "no onnxruntime-gpu wheel under $WHEELS"; exit 2; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        "$wheel" || exit 2
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# onnxruntime-gpu finds the CUDA 13 libraries of the nvidia-* wheels (torch's) this way too
nv=$($PY -c "import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]) + '/nvidia')" 2>/dev/null)
if [ -n "$nv" ]; then
    export LD_LIBRARY_PATH=$(find "$nv" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { log "project install failed"; tail -5 "$OUT/install.log"; exit 2; }
bin=$(dirname "$(command -v $PY)")
[ -x "$bin/cognet-bench" ] || bin=$($PY -c "import sys, os; print(os.path.dirname(sys.executable))")

# 2. providers, read back from a real session
if [ -z "$MODEL" ]; then
    MODEL=$OUT/demo
    log "no MODEL: building the demo model on the GPU"
    "$bin/cognet" data synth --out "$MODEL/data" --patients 2000 --seed 0 \
        && "$bin/cognet" train --data "$MODEL/data" --out "$MODEL/ckpt" --epochs 8 --device cuda --quiet \
        && "$bin/cognet-export" --checkpoint "$MODEL/ckpt" --out "$MODEL/model" --fp16 || exit 1
fi
$PY - "$MODEL/model" <<'EOF' 2>&1 | tee "$OUT/providers.txt"
import sys, torch, onnxruntime as ort
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("onnxruntime", ort.__version__, ort.__file__)
print("available providers:", ort.get_available_providers())
from cognet.runtime.session import OrtModel
from cognet.core.manifest import load_manifest
model = OrtModel(load_manifest(sys.argv[1]), device="cuda")
sessions = {**model.sessions, **(model.decoder.search.sessions if model.decoder.search else {})}
if model.head is not None:  # the one pass's graph, the default decoding's
    sessions["head"] = model.head.session
for name, sess in sessions.items():
    print(f"session {name}: get_providers() = {sess.get_providers()}")
print("decoder:", type(model.decoder).__name__, "selection:", model.selection,
      "encodings on the device:", model.encoder.search is not None)
EOF
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())" 2>/dev/null || echo gpu)

# the GPU's memory in use, once a second, through every step below (gpu-mem.csv)
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 1 >"$OUT/gpu-mem.csv" 2>/dev/null &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT

# 3. the first run: the default decoding and beam 4 at 16,384, then the one pass at 65,536
DEFAULT_DECODING=${DEFAULT_DECODING:-marginal}
FIRST_ENGINES=${FIRST_ENGINES:-ort-cuda,ort-cuda-fp16}
log "first run: $DEFAULT_DECODING and beam 4 at batch 16,384: $FIRST_ENGINES"
timeout ${FIRST_S:-240} "$bin/cognet-bench" --model "$MODEL/model" --checkpoint "$MODEL/ckpt" \
    --out "$OUT/first" --engines "$FIRST_ENGINES" --reference torch-cuda \
    --beams "$DEFAULT_DECODING,4" --batch-sizes 16384 --visits 16384 --repeats ${REPEATS:-1} \
    --past-visits '' --input-sizes '' --no-ddi-tradeoff --max-run-seconds ${RUN_S:-60} 2>&1 \
    | tee "$OUT/first.log" | grep -v "^\s*$" | grep -v "plugin EP" | tail -20
for ext in json md; do cp "$OUT/first/results.$ext" "$OUT/results-$gpu-first.$ext" 2>/dev/null; done
if [ "$DEFAULT_DECODING" = marginal ]; then
    log "the one pass alone at batch 65,536: ort-cuda"
    timeout ${ONEPASS_S:-90} "$bin/cognet-bench" --model "$MODEL/model" --checkpoint "$MODEL/ckpt" \
        --out "$OUT/onepass" --engines ort-cuda --reference torch-cuda --beams marginal \
        --batch-sizes 65536 --visits 65536 --repeats ${REPEATS:-1} --past-visits '' \
        --input-sizes '' --no-ddi-tradeoff --max-run-seconds ${RUN_S:-60} 2>&1 \
        | tee "$OUT/onepass.log" | grep -v "^\s*$" | grep -v "plugin EP" | tail -12
    for ext in json md; do cp "$OUT/onepass/results.$ext" "$OUT/results-$gpu-onepass.$ext" 2>/dev/null; done
fi

# 4. the GPU tests
log "pytest -m gpu"
timeout ${PYTEST_S:-200} $PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest-gpu.log" | tail -15

# 5. the levers (LEVERS=1): beam 4 over 65,536 visits by engine, and set decoding
if [ "${LEVERS:-0}" = 1 ]; then
    BENCH_ENGINES=${BENCH_ENGINES:-ort-cuda,ort-cuda-streams,ort-cuda-fp16,ort-cuda-fp16-streams}
    log "cognet-bench beam 4: $BENCH_ENGINES"
    timeout ${BENCH_S:-240} "$bin/cognet-bench" --model "$MODEL/model" --checkpoint "$MODEL/ckpt" \
        --out "$OUT/bench" --engines "$BENCH_ENGINES" --reference torch-cuda --beams 4 \
        --batch-sizes 4096,16384,65536 --visits 65536 --repeats ${REPEATS:-1} --past-visits '' \
        --input-sizes '' --no-ddi-tradeoff --max-run-seconds ${RUN_S:-60} 2>&1 \
        | tee "$OUT/bench.log" | grep -v "^\s*$" | grep -v "plugin EP" | tail -20
    log "cognet-bench set: ${BENCH2_ENGINES:-ort-cuda}"
    timeout ${BENCH2_S:-100} "$bin/cognet-bench" --model "$MODEL/model" --checkpoint "$MODEL/ckpt" \
        --out "$OUT/bench2" --engines ${BENCH2_ENGINES:-ort-cuda} --reference torch-cuda \
        --beams set --batch-sizes ${BENCH2_SIZES:-4096,16384} --visits ${BENCH2_VISITS:-16384} \
        --repeats 1 --past-visits '' --input-sizes '' --no-ddi-tradeoff --no-profile \
        --max-run-seconds ${RUN2_S:-40} 2>&1 \
        | tee "$OUT/bench2.log" | grep -v "^\s*$" | grep -v "plugin EP" | tail -12
    for ext in json md; do cp "$OUT/bench2/results.$ext" "$OUT/results-$gpu-set.$ext" 2>/dev/null; done
    for ext in json md; do cp "$OUT/bench/results.$ext" "$OUT/results-$gpu.$ext" 2>/dev/null; done
    cp "$OUT/bench/throughput.png" "$OUT/throughput-$gpu.png" 2>/dev/null
fi

# 6. optional: the float16 graphs' own bars on real visits. SCORE_VISITS (a Parquet file of
#    visits, the test split's say) is scored on the GPU with the default decoding and beam 4,
#    float32 and float16; the Jaccard and the list agreement are computed afterwards.
if [ -n "${SCORE_VISITS:-}" ]; then
    for dec in ${SCORE_DECODINGS:-$DEFAULT_DECODING beam}; do for variant in fp32 fp16; do
        log "cognet-batch score $SCORE_VISITS: $dec, $variant"
        extra=(); [ "$variant" = fp16 ] && extra=(--variant fp16)
        timeout ${SCORE_S:-40} "$bin/cognet-batch" score "$SCORE_VISITS" --model "$MODEL/model" \
            --out "$OUT/score-$dec-$variant.parquet" --device cuda --decoding $dec --all --quiet \
            --summary-json "$OUT/score-$dec-$variant.json" "${extra[@]}" 2>&1 | tail -2
    done; done
fi

rm -rf "$OUT/first" "$OUT/onepass" "$OUT/bench" "$OUT/bench2" "$OUT/demo"
log "done: $(ls "$OUT" | tr '\n' ' ')"
