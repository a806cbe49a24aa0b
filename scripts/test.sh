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
exec "$VENV/bin/python" -m pytest -n 2 --dist loadfile -q "$@" tests
