#!/usr/bin/env bash
# The accelerator check on a bare accelerator image, from a cold start, in one command:
#
#   bash benchmarks/fetch_accelerator_wheels.sh          # once, on a machine with network: fills .whl/
#   bash benchmarks/accelerator_check.sh [OUT_DIR] [--budget_s=450 ...]
#
# Installs the wheels of .whl/ (or ACCEL_WHEELS) that the image lacks (gin-config, dp-accounting,
# dm-tree, editdistance, jax-privacy, pydantic) into a temporary folder with --no-deps, then runs
# benchmarks/accelerator_check.py in ONE process: T5 v1.1 small non-DP and DP-ghost at batch 32 and
# 256, base at batch 32, a short DP training, then (time permitting) the largest batch that fits.
# Every phase (trace, lower, compile, first step, steady steps) is appended to
# OUT_DIR/phases.jsonl as it ends and OUT_DIR/accelerator_check.md is rewritten after every case;
# at the budget (default 450 s) the check stops and keeps what it measured. JAX's persistent
# compilation cache lives in OUT_DIR/jax_cache: a second run skips the compilations.
#
# Needs a Python with JAX for the accelerator plus flax, optax, orbax-checkpoint, sentencepiece,
# numpy and scipy (a current CUDA image has them). No TensorFlow: training reads the embedded
# corpus. CPU smoke run: `bash benchmarks/accelerator_check.sh /tmp/smoke --smoke`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/accelerator_check}"
shift || true
PY="${PYTHON:-python3}"
WHEELS="${ACCEL_WHEELS:-$ROOT/.whl}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE="$(mktemp -d)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}" PYTHONUNBUFFERED=1
exec "$PY" "$ROOT/benchmarks/accelerator_check.py" --out="$OUT" "$@"
