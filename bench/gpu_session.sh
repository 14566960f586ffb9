#!/usr/bin/env bash
# One GPU session in one command: the GPU tests, PD on one GPU, the KV transfer and decode benchmarks.
# Run from the repo root on the GPU machine, with the kit staged into .gpu/ (docs/gpu.md) and, where the
# machine lacks the serving packages (fastapi, uvicorn, pydantic, xgrammar, ...), their wheels in .whl/:
#
#     OUT=/tmp/gpu-out bash bench/gpu_session.sh
#
# Knobs (environment): SKIP_KV, SKIP_TESTS, SKIP_BENCH, PD_K (a -k filter), BATCHES, STEPS, DECODE_VARIANTS
# (below), and a time limit per step (*_LIMIT). One call may run for at most 10 minutes: split a session
# into a tests call (SKIP_BENCH=1) and a benchmarks call (SKIP_KV=1 SKIP_TESTS=1).
#
# Every step has its own time limit and log ($OUT/<step>.log); $OUT/summary lists each step's exit
# status and seconds, so one slow or failing step costs its own limit, never the rest of the run.
# The Llama-1B-shape model (random weights, 2.4 GB) builds in the background while the tests run.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
. .gpu/setup.sh > "$OUT/setup.log" 2>&1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >> "$OUT/setup.log" 2>&1 || echo "WHEELS FAILED" >> "$OUT/setup.log"
fi
export PYTHONPATH=/tmp/fi:/tmp/site:/tmp/nx
# FlashInfer's norm from its CUDA sources (not the CuTe DSL, which the kit lacks): one module to cache.
export FLASHINFER_USE_CUDA_NORM=1
# Modules compiled in an earlier session (the jit-warm step below sends them back as $OUT/jit/; kept
# here in the ignored .gpu-jit/ and carried) load as AOT ones, skipping their 20-80 s compile each.
[ -d .gpu-jit ] && mkdir -p /tmp/fi/flashinfer/data/aot && cp -r .gpu-jit/. /tmp/fi/flashinfer/data/aot/
nvidia-smi -L >> "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"

step() {  # step NAME SECONDS COMMAND...: run with a limit, record exit status and time
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${SECONDS}s-total $((SECONDS - t0))s" | tee -a "$OUT/summary"
    tail -4 "$OUT/$name.log"
}

[ -z "${SKIP_BENCH:-}" ] && (cd /tmp && python3 -c "from tandem.engine.modelgen.resolve import resolve_model as r; print(r('llama-1b-shape'))") \
    > "$OUT/model-build.log" 2>&1 &
BUILD=$!
PYTEST=(python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors)
# The layer ops' kernels (engine/models/flashinfer_ops.py) before any timed step; what compiled here
# goes back in $OUT/jit/<module>/<module>.so for the next session's .gpu-jit/.
step jit-warm "${JIT_LIMIT:-300}" python3 -c "
import flashinfer.activation as a, flashinfer.norm as n, flashinfer.rope as r
n.get_norm_module(); r.get_rope_module(); a.get_act_and_mul_module('silu'); print('layer-op kernels ready')"
find /tmp/fiws -path '*cached_ops*' -name '*.so' 2>/dev/null | while read -r so; do
    d="$OUT/jit/$(basename "$(dirname "$so")")"; mkdir -p "$d" && cp "$so" "$d/"
done
if [ -z "${SKIP_KV:-}" ]; then
    step kv-transfer-tests "${KV_LIMIT:-60}" "${PYTEST[@]}" tests/pd/test_kv_transfer.py
    step kv-transfer-bench "${KVB_LIMIT:-60}" python3 bench/kv_transfer.py --device cuda --rounds 5
    # Head slices between TP sizes, staged into whole pages either way (docs/tp.md), against the slices.
    step kv-heads-staged "${KVB_LIMIT:-60}" python3 bench/kv_transfer.py --device cuda --rounds 3 \
        --decode-heads 0:2 --staged
    step kv-wider-staged "${KVB_LIMIT:-60}" python3 bench/kv_transfer.py --device cuda --rounds 3 \
        --prefill-heads 0:2 --staged
    cp docs/results/kv_transfer_cuda.json docs/results/kv_transfer_*staged_cuda.json "$OUT/" 2>/dev/null
fi
# PD on one GPU: the workers' device is `auto`, so on this machine prefill, decode and colocated
# all run on the GPU (fp32, SDPA) and their KV moves VRAM to VRAM.
if [ -z "${SKIP_TESTS:-}" ]; then
    step pd-exactness "${PD_LIMIT:-130}" "${PYTEST[@]}" tests/pd/test_pd_exactness.py -x -k "${PD_K:-not nothing}"
    step gpu-tests "${GPU_LIMIT:-130}" "${PYTEST[@]}" -m gpu tests --ignore=tests/operator
fi
if [ -n "${SKIP_BENCH:-}" ]; then echo "done ${SECONDS}s" | tee -a "$OUT/summary"; exit 0; fi
wait $BUILD
echo "model-build rc=$? ${SECONDS}s-total" | tee -a "$OUT/summary"
step decode-bench "${BENCH_LIMIT:-180}" python3 bench/gpu_decode.py --model llama-1b-shape --batches "${BATCHES:-1,64}" \
    --steps "${STEPS:-64}" --repeats 2 --out "$OUT/gpu_decode_cuda.json"
# Where a step's time goes (bench/step_profile.py): host functions per thread, the graph's kernels.
(cd /tmp && step step-profile "${PROFILE_LIMIT:-90}" python3 "$OLDPWD/bench/step_profile.py" --model llama-1b-shape \
    --batches "${BATCHES:-1,64}" --loops overlap --kernels --out "$OUT/step_profile.json")
# Where the prefill's time goes, ours beside HF's (bench/prefill_profile.py).
(cd /tmp && step prefill-profile "${PREFILL_LIMIT:-120}" python3 "$OLDPWD/bench/prefill_profile.py" \
    --model llama-1b-shape --prefill 8x2048 --out "$OUT/prefill_profile.json")
# Decode again per engine setting in DECODE_VARIANTS, same shapes, e.g.
# DECODE_VARIANTS="decode_tensor_cores=false page_size=16 layer_ops=torch" (one run each).
for v in ${DECODE_VARIANTS:-}; do
    step "decode-bench-${v//[^a-z0-9]/-}" "${BENCH_LIMIT:-180}" python3 bench/gpu_decode.py --model llama-1b-shape \
        --batches "${BATCHES:-1,64}" --steps "${STEPS:-64}" --repeats 2 --prefill 8x2048 --engine-arg "$v" \
        --out "$OUT/gpu_decode_${v//[^a-z0-9]/-}.json"
done
echo "done ${SECONDS}s" | tee -a "$OUT/summary"
