#!/usr/bin/env bash
# One command on an accelerator machine: list the devices, benchmark non-DP against DP-ghost
# (bfloat16 activations) for T5 v1.1 small and base at 512/114 at an equal batch plus the largest
# batch that fits the device, run a short DP training end to end, and write one table.
#
#   bash scripts/accelerator_check.sh [OUT_DIR]          # default OUT_DIR: runs/accelerator_check
#
# Needs a Python with JAX for the accelerator plus flax, optax, orbax-checkpoint, sentencepiece
# and numpy (an accelerator image usually has them). The pure-Python rest (gin-config,
# dp-accounting, tqdm, ...) comes from pip, or, on a machine without network, from wheels in
# ACCEL_WHEELS (default: the folder .whl at the top of the checkout), installed into a temporary
# folder with --no-deps. No TensorFlow is needed: training reads the embedded corpus.
#
# Environment: PYTHON (python3), ACCEL_PRESETS ("t5_1_1_small t5_1_1_base"), ACCEL_BATCH (32),
# ACCEL_BENCH_STEPS (10), ACCEL_TRAIN_STEPS (100), ACCEL_MEMORY_GB (the device's memory limit).
# CPU works too (for a smoke run: ACCEL_PRESETS=t5_1_1_tiny ACCEL_BATCH=4 ACCEL_TRAIN_STEPS=3),
# but the numbers that matter come from a GPU or TPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/runs/accelerator_check}" && cd "${1:-$ROOT/runs/accelerator_check}" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${ACCEL_WHEELS:-$ROOT/.whl}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE="$(mktemp -d)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}" PYTHONUNBUFFERED=1
PT5=("$PY" -m private_t5.stages.cli)
cd "$ROOT"

echo "[accelerator] devices"
"$PY" - "$OUT/devices.json" <<'PYEOF'
import json, sys
import jax
devices = jax.devices()
stats = devices[0].memory_stats() or {}
info = {"backend": jax.default_backend(), "jax": jax.__version__, "count": len(devices),
        "kind": devices[0].device_kind, "bytes_limit": stats.get("bytes_limit")}
print(json.dumps(info))
json.dump(info, open(sys.argv[1], "w"))
PYEOF
BUDGET="${ACCEL_MEMORY_GB:-$("$PY" -c "import json,sys; b=json.load(open(sys.argv[1]))['bytes_limit']; print(round(0.95 * b / 2**30, 1) if b else 16)" "$OUT/devices.json")}"
PRESETS="$("$PY" -c "import sys; print(repr(sys.argv[1].split()))" "${ACCEL_PRESETS:-t5_1_1_small t5_1_1_base}")"
BATCH="${ACCEL_BATCH:-32}"

echo "[accelerator] bench: $PRESETS at 512/114, batch $BATCH, bfloat16, max batch within $BUDGET GiB"
"${PT5[@]}" bench --gin_file=configs/bench/accelerator.gin --gin.benchmark.output_dir="$OUT/bench" \
  --gin.benchmark.presets="$PRESETS" --gin.benchmark.shapes="[(512, 114, $BATCH)]" \
  --gin.benchmark.steps="${ACCEL_BENCH_STEPS:-10}" --gin.benchmark.memory_budget_gb="$BUDGET"

echo "[accelerator] a short DP training (DP-SentencePiece vocabulary, then DP-Adafactor)"
VOCAB="$OUT/train/vocab/dp_spm.model"
if [[ ! -f "$VOCAB" ]]; then
  "${PT5[@]}" dp-spm --gin_file=configs/runs/dp_spm.gin --corpus=builtin:python_docs --vocab_size=2000 \
    --output="$VOCAB" --target_epsilon=8 --sensitivity=capped --max_words=64 > /dev/null
fi
"${PT5[@]}" train --gin_file=configs/experiments/quickstart.gin --gin.MODEL_DIR="$OUT/train/model" \
  --gin.CORPUS=builtin:python_docs --gin.VOCAB_PATH="$VOCAB" --gin.TRAIN_STEPS="${ACCEL_TRAIN_STEPS:-100}" \
  --gin.ACTIVATION_DTYPE="'bfloat16'" --gin.train.mesh_shape="(-1, 1)" --gin.train.eval_every=0 \
  --gin.train.checkpoint_every=1000000 | tee "$OUT/train.log"

"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
dev = json.load(open(os.path.join(out, "devices.json")))
bench = json.load(open(os.path.join(out, "bench", "bench.json")))
summary = json.load(open(os.path.join(out, "train", "model", "summary.json")))
gib = 2 ** 30
lines = [f"# Accelerator check: {dev['count']} × {dev['kind']} ({dev['backend']}, jax {dev['jax']})", "",
         "| model | in/out | batch | method | dtype | s/step | sequences/s | DP ÷ non-DP throughput "
         "| compiled peak GiB | max batch | DP ÷ non-DP max batch | compile s |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
ratios = {(r["preset"], r["method"], r.get("activation_dtype")): r for r in bench.get("ratios", [])}
for r in bench["results"]:
  ratio = ratios.get((r["preset"], r["method"], r.get("activation_dtype")), {})
  mb = (r.get("max_batch") or {}).get("max_batch")
  fmt = lambda v: "–" if v is None else f"{v:.2f}"
  lines.append(f"| {r['preset']} | {r['inputs']}/{r['targets']} | {r['batch_size']} | {r['method']} "
               f"| {r.get('activation_dtype', '?')} | {r['step_s']:.3f} | {r['examples_per_s']:.1f} "
               f"| {fmt(ratio.get('throughput'))} | {r['memory'].get('peak_bytes', 0) / gib:.2f} "
               f"| {mb if mb is not None else '–'} | {fmt(ratio.get('max_batch'))} | {r['compile_s']:.1f} |")
eps = summary.get("epsilon")
lines += ["", f"Short DP training (tiny T5, 128/32, bfloat16, {summary['final_step']} steps): "
          f"{summary.get('steps_per_second') or 0:.2f} steps/s after compilation, ε = "
          f"{'∞' if eps is None else f'{eps:.3g}'} (DP-Adafactor's own ε {summary.get('training_epsilon') or 0:.3g}, "
          f"δ {summary.get('delta') or 0:.3g}); summary: {os.path.join(out, 'train', 'model', 'summary.json')}", ""]
text = "\n".join(lines)
open(os.path.join(out, "accelerator_check.md"), "w").write(text)
print(text)
PYEOF
echo "[accelerator] wrote $OUT/accelerator_check.md"
