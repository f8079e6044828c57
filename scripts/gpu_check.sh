#!/usr/bin/env bash
# One GPU, under 8 minutes (BUDGET_S, default 450 s, caps every step): writes 8 files to $OUT
#   env.json         versions and the device
#   plans.jsonl      the step's planned memory on this device, one line per batch tried
#   train.json       bench train (atom_1b: bfloat16, remat) at the largest batch whose plan fits
#   profile.json     bench profile of that step: op time by component, pass and kind
#   attention.json   bench attention at the 1B shapes
#   dispatch.json    bench train --dispatch at DISPATCH_CONFIG (bench_small): every MoE
#                    dispatch choice (dropless, capacity paths), round robin
#   log.txt, raw.tgz what ran, and every command's full output
# Usage: OUT=/some/dir scripts/gpu_check.sh
#   Where JAX already sees a GPU (an image with jax and its CUDA plugin) nothing is
#   installed: the package runs from this checkout. Elsewhere it installs ".[cuda]"
#   (WHEELS=DIR: offline, from wheels). CONFIG, BATCHES, STEPS, ATTN_BATCH, ATTN_IMPLS,
#   DISPATCH_CONFIG change what runs (the tests run this script on a CPU with the tiny config);
#   LIMIT_SCALE multiplies each step's own limit (a slower machine), BUDGET_S still caps all.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
CONFIG=${CONFIG:-atom_1b}
BATCHES=${BATCHES:-"256 128 64 32 16"}
STEPS=${STEPS:-10}
ATTN_BATCH=${ATTN_BATCH:-8}
ATTN_IMPLS=${ATTN_IMPLS:-}
DISPATCH_CONFIG=${DISPATCH_CONFIG:-bench_small}
RAW="$OUT/raw"
mkdir -p "$RAW"
# The three compilations of the same step (plan, train, profile) share one cache.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/fractus_gpu_check_cache}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }
# Every step's timeout is cut to what is left of BUDGET_S, and a step with no time left does
# not start, so the whole script ends in time and keeps what it has measured (a GPU rented
# for a fixed slot still returns results). LIMIT_SCALE (default 1) multiplies every step's
# own limit, for a slower machine.
end_at=$((SECONDS + ${BUDGET_S:-450}))
within() {  # within LIMIT_S COMMAND...: the command under min(LIMIT_S * LIMIT_SCALE, time left)
  local left=$((end_at - SECONDS)) want=$(($1 * ${LIMIT_SCALE:-1}))
  shift
  if [ "$left" -le 0 ]; then echo "not started: BUDGET_S (${BUDGET_S:-450} s) is spent"; return 124; fi
  timeout $(( left < want ? left : want )) "$@"
}

if python3 -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null \
    || [ "${GPU_CHECK_INSTALL:-1}" = 0 ]; then
  log "using the installed jax ($(python3 -c 'import jax; print(jax.__version__, jax.default_backend())' 2>&1))"
elif [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" -e ".[cuda]" >>"$OUT/log.txt" 2>&1 \
    || log "install failed (see log.txt); trying with what is installed"
else
  python3 -m pip install -q -e ".[cuda]" >>"$OUT/log.txt" 2>&1 \
    || log "install failed (see log.txt); trying with what is installed"
fi

python3 - >"$OUT/env.json" <<'PY'
import json, jax, jaxlib
print(json.dumps({"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
                  "devices": [d.device_kind for d in jax.devices()],
                  "memory_bytes": (jax.devices()[0].memory_stats() or {}).get("bytes_limit")}))
PY
log "env: $(cat "$OUT/env.json")"

last_json() { tail -n 1 "$1"; }
limit=$(python3 -c "import json; print(json.load(open('$OUT/env.json'))['memory_bytes'] or 0)")
best=""
for batch in $BATCHES; do
  within 100 python3 -m fractus_jax.plan --config "$CONFIG" --devices 1 --json --set batch_size=$batch \
      >"$RAW/plan_b$batch.txt" 2>&1 || { log "plan at batch $batch failed: $(tail -n 2 "$RAW/plan_b$batch.txt")"; continue; }
  last_json "$RAW/plan_b$batch.txt" >>"$OUT/plans.jsonl"
  total=$(last_json "$RAW/plan_b$batch.txt" | python3 -c "import json, sys; print(json.load(sys.stdin)['per_device']['total_bytes'])")
  log "batch $batch plans $total bytes of $limit"
  # A CPU reports no memory limit: the first batch that plans is taken.
  if [ "$limit" -eq 0 ] || [ "$total" -lt $((limit * 9 / 10)) ]; then best=$batch; break; fi
done
best=${best:-${BATCHES##* }}
# execution.kernels is left at "auto": the plain forms on a GPU (the CPU-tuned ones only run on a
# CPU backend, docs/engine.md); train.json's "kernels" says which ran.
log "bench train $CONFIG at batch $best"
within 200 python3 -m fractus_jax.bench train --config "$CONFIG" --set batch_size=$best --steps "$STEPS" --json \
  >"$RAW/train_b$best.txt" 2>&1 && last_json "$RAW/train_b$best.txt" >"$OUT/train.json"
log "train: $(tail -n 4 "$RAW/train_b$best.txt" | head -n 3 | tr '\n' ' ')"

within 150 python3 -m fractus_jax.bench profile --config "$CONFIG" --set batch_size=$best --steps 2 --json \
  >"$RAW/profile_b$best.txt" 2>&1 && last_json "$RAW/profile_b$best.txt" >"$OUT/profile.json"
log "profile: $(grep -m 1 '^op time' "$RAW/profile_b$best.txt")"

impl_flags=""
for impl in $ATTN_IMPLS; do impl_flags="$impl_flags --impl $impl"; done
# shellcheck disable=SC2086  # one flag per word
within 90 python3 -m fractus_jax.bench attention --batch "$ATTN_BATCH" $impl_flags --json >"$RAW/attention.txt" 2>&1 \
  && last_json "$RAW/attention.txt" >"$OUT/attention.json"
log "attention: $(last_json "$RAW/attention.txt")"

within 120 python3 -m fractus_jax.bench train --config "$DISPATCH_CONFIG" --set execution.row_streams=1 \
    --steps 3 --dispatch --json >"$RAW/dispatch.txt" 2>&1 \
  && last_json "$RAW/dispatch.txt" | python3 -c "import json, sys; print(json.dumps(json.load(sys.stdin)['dispatch']))" \
    >"$OUT/dispatch.json"
log "dispatch: $(grep -A 6 'MoE dispatch' "$RAW/dispatch.txt" | tr -s ' ' | tr '\n' ';')"
tar -czf "$OUT/raw.tgz" -C "$OUT" raw && rm -rf "$RAW"
ls -la "$OUT" | tee -a "$OUT/log.txt"
