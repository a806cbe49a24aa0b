#!/usr/bin/env bash
# The one install recipe, shared by the README, scripts/quickstart.sh, scripts/test.sh and CI.
# Creates (or reuses) a virtual environment and installs the pinned stack plus this package.
#   VENV=path            where the environment lives (default: .venv in the project root)
#   INSTALL_TEST_DEPS=1  also install requirements-test.txt (scripts/test.sh sets it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.private_t5_installed"
REQ_FILES=("$ROOT/requirements.txt" "$ROOT/setup.py")
[[ "${INSTALL_TEST_DEPS:-0}" == "1" ]] && REQ_FILES+=("$ROOT/requirements-test.txt")
REQ_HASH="$(cat "${REQ_FILES[@]}" | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$REQ_HASH" ]]; then
  echo "[install] environment up to date: $VENV"
  exit 0
fi
echo "[install] creating/updating environment in $VENV (about 3 minutes on a fresh machine)"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -r "$ROOT/requirements.txt"
# t5's declared dependencies pull duplicate nightlies (seqio-nightly, tfds-nightly),
# mesh-tensorflow and transformers; its real runtime needs are in requirements.txt.
"$VENV/bin/python" -m pip install --quiet --no-deps t5==0.9.4
# Apache Beam (corpus-scale stages) declares protobuf<7, which sentencepiece 0.2.3's generated
# code cannot import with; Beam runs on protobuf 7, so it goes in without its declared
# dependencies, which requirements.txt lists.
"$VENV/bin/python" -m pip install --quiet --no-deps apache-beam==2.77.0
"$VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT"
if [[ "${INSTALL_TEST_DEPS:-0}" == "1" ]]; then
  "$VENV/bin/python" -m pip install --quiet -r "$ROOT/requirements-test.txt"
fi
echo "$REQ_HASH" > "$STAMP"
echo "[install] done: $VENV"
