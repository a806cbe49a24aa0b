#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and runs the whole test suite, slow tests included.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # quick subset; extra args go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
INSTALL_TEST_DEPS=1 bash "$ROOT/scripts/install.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2
export KERAS_HOME="${KERAS_HOME:-$(mktemp -d)}"
# One JAX persistent compilation cache for the run, shared by pytest's workers and every process
# they start: the tests compile the same tiny models many times (the whole suite on 2 cores:
# 1,574 s without, 1,304 s with). A test that sets its own cache keeps it; the folder goes at the end.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d)"
  export JAX_COMPILATION_CACHE_DIR
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.2}"
"$VENV/bin/python" -m pytest -n 2 --dist loadfile -q "$@" tests
