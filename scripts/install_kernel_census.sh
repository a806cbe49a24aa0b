#!/usr/bin/env bash
# A virtual environment for benchmarks/kernel_census.py: the project's own .venv packages (a .pth
# file points at .venv's site-packages, nothing is copied) plus the CUDA plugin of the pinned
# jaxlib (jax-cuda12-plugin, jax-cuda12-pjrt) and cuDNN, so that JAX compiles for a
# compile-only H100/H200 on a machine without a GPU.
#   bash scripts/install_kernel_census.sh [VENV]
# VENV defaults to $HOME/.cache/private_t5/venv-census (outside the checkout: .gitignore
# ignores .venv/ only). Run scripts/install.sh first; the census is then
#   VENV/bin/python benchmarks/kernel_census.py --list
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$HOME/.cache/private_t5/venv-census}"
BASE="$ROOT/.venv"
[[ -x "$BASE/bin/python" ]] || { echo "[install_kernel_census] no $BASE: run scripts/install.sh first" >&2; exit 2; }
JAXLIB="$(sed -n 's/^jaxlib==\([^ ;#]*\).*/\1/p' "$ROOT/requirements.txt" | head -1)"
[[ -n "$JAXLIB" ]] || { echo "[install_kernel_census] no jaxlib==VERSION pin in requirements.txt" >&2; exit 2; }
PY="$("$BASE/bin/python" -c 'import sys; print(sys.executable)')"
SITE="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

echo "[install_kernel_census] $VENV: the packages of $BASE + jax-cuda12-plugin==$JAXLIB"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
VSITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$SITE" > "$VSITE/project_venv.pth"
"$VENV/bin/python" -m pip install --quiet "jax-cuda12-plugin==$JAXLIB" "jax-cuda12-pjrt==$JAXLIB" \
  nvidia-cudnn-cu12
"$VENV/bin/python" -c "import importlib.metadata as m, jax; print('[install_kernel_census] jax', jax.__version__, 'plugin', m.version('jax-cuda12-plugin'))"
