#!/usr/bin/env bash
# A GPU session in three device calls of at most 10 minutes each, or the same on CPU with no kit (DRY=1).
# Run from the repo root on the GPU machine, carrying .gpu (the kit, docs/gpu.md), .whl (bench/stage_wheels.sh)
# and, once a session has sent compiled modules back, .gpu-jit:
#
#     PHASE=1 OUT=$OUT bash bench/gpu_session.sh   # setup, JIT warm, decode on the 1B shape: the fused layer ops
#                                                   # (layer_ops=auto, never measured yet) first, then layer_ops=torch
#     PHASE=2 OUT=$OUT bash bench/gpu_session.sh   # GPU tests, PD on one GPU, KV transfer; head_dim-128 kernels
#     PHASE=3 OUT=$OUT bash bench/gpu_session.sh   # the 8B shape (HF's static-cache compiled peer beside it),
#                                                   # prefill and step profiles, engine variants
#     DRY=1 PHASE=1 OUT=/tmp/x bash bench/gpu_session.sh   # CPU, tiny model, few steps: what the tests run
#
# What comes back: $OUT/gpu-session-p<N>.tar.gz, every log, JSON, the summary and the FlashInfer modules
# compiled here (jit/<module>/<module>.so, for .gpu-jit/), and $OUT/summary-p<N>.txt beside it: two files of
# the eight a call returns. The archive is rewritten after every step, so a call cut short (a step past its
# limit, the device tool's own kill) still returns all that finished. Should it pass 15 MiB (16 come back),
# the compiled modules move to gpu-session-p<N>-jit.tar.gz, split in 15 MiB parts if need be.
# `bash bench/gpu_unpack.sh FILES_AT` unpacks the archives and puts the modules into .gpu-jit/.
#
# Time: the call has BUDGET seconds (default 540 of the tool's 600); each step's own limit is cut to what is
# left of it less MARGIN, and a step with under 15 s of it left is skipped and says so: the call ends in time.
# Steps run most valuable first. Knobs (environment): BUDGET, MARGIN, SKIP (step names), MODEL, MODEL_8B,
# BATCHES, STEPS, CONTEXT, PREFILL, REPEATS, PD_K (a -k filter), DECODE_VARIANTS (phase 3: engine settings,
# one decode run each, e.g. "decode_tensor_cores=false page_size=16"), HF_STATIC (the 8B run's HF static peer),
# TANDEM_COMMIT (the commit, for the results' meta: the machine's copy has no .git), and *_LIMIT per step.
set -u
PHASE=${PHASE:-1}
case "$PHASE" in 1 | 2 | 3) ;; *) echo "PHASE must be 1, 2 or 3, not $PHASE" >&2; exit 2 ;; esac
DRY=${DRY:-}
OUT=${OUT:-/tmp/gpu-out}
BUDGET=${BUDGET:-540}
MARGIN=${MARGIN:-20}
ROOT=$PWD
NAME=gpu-session-p$PHASE
STAGE=$(mktemp -d /tmp/gpu-session.XXXXXX)
R=$STAGE/$NAME
MAX_FILE=$((15 * 1024 * 1024))
mkdir -p "$OUT" "$R"
: > "$R/summary"

note() { echo "$*" | tee -a "$R/summary"; }

collect_jit() {  # FlashInfer modules compiled on this machine, as the AOT layout wants them: <module>/<module>.so
    [ -n "$DRY" ] && return 0
    find /tmp/fiws -path '*cached_ops*' -name '*.so' 2>/dev/null | while read -r so; do
        d="$R/jit/$(basename "$(dirname "$so")")"
        mkdir -p "$d" && cp -u "$so" "$d/"
    done
}

archive() {  # everything so far into $OUT, each file written beside its name and renamed: never half a file
    collect_jit
    cp "$R/summary" "$OUT/summary-p$PHASE.txt"
    tar -czf "$OUT/.$NAME.part" -C "$STAGE" "$NAME" && mv -f "$OUT/.$NAME.part" "$OUT/$NAME.tar.gz"
    if [ "$(stat -c %s "$OUT/$NAME.tar.gz")" -le "$MAX_FILE" ]; then
        rm -f "$OUT/$NAME"-jit.tar.gz*
        return 0
    fi
    # Too big to come back as one file: the compiled modules go apart, in parts under the limit.
    tar -czf "$OUT/.$NAME.part" --exclude="$NAME/jit" -C "$STAGE" "$NAME" && mv -f "$OUT/.$NAME.part" "$OUT/$NAME.tar.gz"
    rm -f "$OUT/$NAME"-jit.tar.gz*
    tar -czf "$STAGE/jit.tar.gz" -C "$STAGE" "$NAME/jit"
    if [ "$(stat -c %s "$STAGE/jit.tar.gz")" -le "$MAX_FILE" ]; then
        mv -f "$STAGE/jit.tar.gz" "$OUT/$NAME-jit.tar.gz"
    else
        split -b "$MAX_FILE" -d -a 1 "$STAGE/jit.tar.gz" "$OUT/$NAME-jit.tar.gz." && rm -f "$STAGE/jit.tar.gz"
        if [ "$(ls "$OUT/$NAME"-jit.tar.gz.* | wc -l)" -gt 6 ]; then  # 8 files come back: keep the results
            rm -f "$OUT/$NAME"-jit.tar.gz.*
            grep -q "modules too large" "$R/summary" || note "compiled modules too large to send back; left out"
        fi
    fi
}
trap 'archive; rm -rf "$STAGE"' EXIT
trap 'note "stopped by a signal at ${SECONDS}s"; exit 143' TERM INT

step() {  # step NAME SECONDS COMMAND...: run under a limit cut to the budget; record rc and time; archive
    local name=$1 want=$2 t0=$SECONDS
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        note "$name skipped (SKIP)"
        return 0
    fi
    local left=$((BUDGET - MARGIN - SECONDS))
    local limit=$((want < left ? want : left))
    if ((left < 15)); then
        note "$name skipped: ${left}s of the budget left"
        return 0
    fi
    timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1
    local rc=$?
    note "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s, ${SECONDS}s into the call)"
    tail -n "${TAIL:-6}" "$R/$name.log"
    archive
    return 0
}

if [ -z "$DRY" ]; then
    . .gpu/setup.sh > "$R/setup.log" 2>&1
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >> "$R/setup.log" 2>&1 || note "WHEELS FAILED (setup.log)"
    fi
    export PYTHONPATH=/tmp/fi:/tmp/site:/tmp/nx
    # FlashInfer's norm from its CUDA sources (not the CuTe DSL, which the kit lacks): one module to cache.
    export FLASHINFER_USE_CUDA_NORM=1
    # Modules compiled in an earlier session (gpu_unpack.sh keeps them in .gpu-jit/modules.tar.xz) load as AOT
    # ones, skipping their 20-80 s compile each.
    mkdir -p /tmp/fi/flashinfer/data/aot
    for t in .gpu-jit/*.tar.xz; do
        [ -f "$t" ] && tar -xJf "$t" -C /tmp/fi/flashinfer/data/aot/
    done
    nvidia-smi -q > "$R/nvidia-smi.txt" 2>&1
    PY=python3 DEV=cuda
    MODEL=${MODEL:-llama-1b-shape} MODEL_8B=${MODEL_8B:-llama-8b-shape}
    BATCHES=${BATCHES:-1,64} STEPS=${STEPS:-64} CONTEXT=${CONTEXT:-512} PREFILL=${PREFILL:-8x2048}
    HF_STATIC=${HF_STATIC:-compiled} KV=(--tokens 4096) KV_ROUNDS=5
    DECODE_VARIANTS=${DECODE_VARIANTS-fused_rope_kv=false decode_split_kv=true decode_tensor_cores=false page_size=16}
else
    # CPU, no kit: the same steps and files on the tiny model; what needs CUDA or the kit is skipped.
    PY=${PYTHON:-python3} DEV=cpu
    MODEL=${MODEL:-tiny} MODEL_8B=${MODEL_8B:-tiny}
    BATCHES=${BATCHES:-1,2} STEPS=${STEPS:-4} CONTEXT=${CONTEXT:-16} PREFILL=${PREFILL:-2x32}
    HF_STATIC=${HF_STATIC:-eager} KV=(--tokens 64 --sends 2) KV_ROUNDS=1
    DECODE_VARIANTS=${DECODE_VARIANTS-page_size=16}
fi
REPEATS=${REPEATS:-3}
note "phase $PHASE on $DEV${DRY:+ (dry run)}, budget ${BUDGET}s, setup took ${SECONDS}s"
tail -3 "$R/setup.log" 2>/dev/null
TAIL=0 step env 60 "$PY" bench/run_meta.py --device "$DEV" --out "$R/env.json"

decode() {  # decode STEP_NAME LIMIT JSON_NAME MODEL [gpu_decode.py options...]
    local name=$1 limit=$2 json=$3 model=$4
    shift 4
    TAIL=14 step "$name" "$limit" "$PY" bench/gpu_decode.py --model "$model" --device "$DEV" --batches "$BATCHES" \
        --steps "$STEPS" --context "$CONTEXT" --repeats "$REPEATS" --out "$R/$json" "$@"
    # A silent fallback made loud: run_meta.py warns when layer_ops=auto kept the torch ops.
    if grep -q "layer ops fell back" "$R/$name.log" 2>/dev/null; then
        note "$name: $(grep -m1 "layer ops fell back" "$R/$name.log")"
    fi
}

# Presets' weights, each built once (TANDEM_HOME). -P: the repo root (cwd) off sys.path, where operator/ would
# shadow the standard library's.
BUILD=("$PY" -P -c "import sys; from tandem.engine.modelgen.resolve import resolve_model as r
for name in sys.argv[1:]: print(r(name), flush=True)")

case "$PHASE" in
1)
    # The model builds while FlashInfer's layer-op kernels compile (both before anything is timed).
    timeout "${BUILD_LIMIT:-240}" "${BUILD[@]}" "$MODEL" > "$R/model-build.log" 2>&1 &
    building=$!
    [ -z "$DRY" ] && step jit-warm "${JIT_LIMIT:-300}" "$PY" bench/jit_warm.py --layer-ops
    wait $building
    note "model-build rc=$? (${SECONDS}s into the call)"
    # The fused layer ops first (never measured on a GPU): with only this one, the call has its figures.
    decode decode-1b-auto "${BENCH_LIMIT:-200}" gpu_decode_1b_auto.json "$MODEL" --prefill "$PREFILL" --hf-static off
    decode decode-1b-torch-ops "${BENCH_LIMIT:-200}" gpu_decode_1b_torch-ops.json "$MODEL" --prefill "$PREFILL" \
        --hf-static off --engine-arg layer_ops=torch
    ;;
2)
    PYTEST=("$PY" -m pytest -q -p no:cacheprovider --continue-on-collection-errors)
    if [ -z "$DRY" ]; then
        step kv-transfer-tests "${KV_LIMIT:-60}" "${PYTEST[@]}" tests/pd/test_kv_transfer.py --junitxml="$R/kv-tests.xml"
        # PD on one GPU: the workers' device is `auto`, so prefill, decode and colocated all run on the GPU.
        step pd-exactness "${PD_LIMIT:-130}" "${PYTEST[@]}" tests/pd/test_pd_exactness.py -x -k "${PD_K:-not nothing}" \
            --junitxml="$R/pd-tests.xml"
        step gpu-tests "${GPU_LIMIT:-130}" "${PYTEST[@]}" -m gpu tests --ignore=tests/operator --junitxml="$R/gpu-tests.xml"
        # llama-8b-shape's attention kernels (head_dim 128), so that phase 3 loads them from .gpu-jit/ (before the
        # KV benchmarks, whose figure the first run has: the budget cuts from the end).
        step jit-warm-hd128 "${JIT_LIMIT:-240}" "$PY" bench/jit_warm.py --head-dims 128
    fi
    step kv-transfer-bench "${KVB_LIMIT:-60}" "$PY" bench/kv_transfer.py --device "$DEV" --rounds "$KV_ROUNDS" "${KV[@]}" \
        --out "$R/kv_transfer_$DEV.json"
    # Head slices between TP sizes, staged into whole pages either way (docs/tp.md), against the slices.
    step kv-heads-staged "${KVB_LIMIT:-60}" "$PY" bench/kv_transfer.py --device "$DEV" --rounds "$KV_ROUNDS" "${KV[@]}" \
        --decode-heads 0:2 --staged --out "$R/kv_transfer_heads_staged_$DEV.json"
    step kv-wider-staged "${KVB_LIMIT:-60}" "$PY" bench/kv_transfer.py --device "$DEV" --rounds "$KV_ROUNDS" "${KV[@]}" \
        --prefill-heads 0:2 --staged --out "$R/kv_transfer_to_wider_staged_$DEV.json"
    ;;
3)
    # Both models before anything is timed (the 8B's 16 GB drawn on the GPU and written once).
    step model-build "${BUILD_LIMIT:-240}" "${BUILD[@]}" "$MODEL_8B" "$MODEL"
    decode decode-8b "${BENCH_8B_LIMIT:-330}" gpu_decode_8b.json "$MODEL_8B" --prefill "$PREFILL" --hf-static "$HF_STATIC"
    # Where the prefill's time goes, ours beside HF's; then the host's share of a decode step.
    step prefill-profile "${PREFILL_LIMIT:-120}" "$PY" bench/prefill_profile.py --model "$MODEL" --device "$DEV" \
        --prefill "$PREFILL" --out "$R/prefill_profile.json"
    kernels=()
    [ -z "$DRY" ] && kernels=(--kernels)
    step step-profile "${PROFILE_LIMIT:-90}" "$PY" bench/step_profile.py --model "$MODEL" --device "$DEV" \
        --batches "$BATCHES" --context "$CONTEXT" --steps "$STEPS" --loops overlap "${kernels[@]}" \
        --out "$R/step_profile.json"
    for v in $DECODE_VARIANTS; do
        decode "decode-1b-${v//[^a-z0-9]/-}" "${BENCH_LIMIT:-200}" "gpu_decode_1b_${v//[^a-z0-9]/-}.json" "$MODEL" \
            --prefill "$PREFILL" --hf-static off --engine-arg "$v"
    done
    ;;
esac
note "done ${SECONDS}s"
