#!/usr/bin/env bash
# One GPU, under 8 minutes: install the CUDA extra, then write JSON results to $OUT:
#   plan_bN.json     the atom_1b step's planned memory on this GPU at batch N
#   train_bN.json    bench train atom_1b (bfloat16) at the largest batch whose plan fits
#   attention.json   bench attention at the 1B shapes, batch 8
#   env.json         versions and the device
# Usage: OUT=/some/dir scripts/gpu_check.sh     (WHEELS=DIR installs offline from wheels)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" -e ".[cuda]" >>"$OUT/log.txt" 2>&1
else
  python3 -m pip install -q -e ".[cuda]" >>"$OUT/log.txt" 2>&1
fi || log "install failed (see log.txt); trying with what is installed"

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
for batch in 64 32 16; do
  timeout 100 python3 -m fractus_jax.plan --config atom_1b --devices 1 --json --set batch_size=$batch \
      >"$OUT/plan_b$batch.txt" 2>&1 || continue
  total=$(last_json "$OUT/plan_b$batch.txt" | python3 -c "import json,sys; print(json.load(sys.stdin)['per_device']['total_bytes'])")
  last_json "$OUT/plan_b$batch.txt" >"$OUT/plan_b$batch.json"
  log "batch $batch plans $total bytes of $limit"
  if [ "$limit" -gt 0 ] && [ "$total" -lt $((limit * 9 / 10)) ]; then best=$batch; break; fi
done
best=${best:-16}
log "bench train atom_1b at batch $best"
timeout 200 python3 -m fractus_jax.bench train --config atom_1b --set batch_size=$best --steps 10 --json \
  >"$OUT/train_b$best.txt" 2>&1 && last_json "$OUT/train_b$best.txt" >"$OUT/train_b$best.json"
log "train: $(tail -n 4 "$OUT/train_b$best.txt" | head -n 3 | tr '\n' ' ')"

timeout 60 python3 -m fractus_jax.bench attention --batch 8 --json >"$OUT/attention.txt" 2>&1 \
  && last_json "$OUT/attention.txt" >"$OUT/attention.json"
log "attention: $(last_json "$OUT/attention.txt")"
ls -la "$OUT" | tee -a "$OUT/log.txt"
