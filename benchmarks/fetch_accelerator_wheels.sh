#!/usr/bin/env bash
# Downloads the wheels an accelerator image lacks into .whl/ (or ACCEL_WHEELS), for its Python:
# a current CUDA image has jax, flax, optax, orbax, sentencepiece, numpy, scipy, torch,
# transformers and peft, but not gin-config, dp-accounting (and its dm-tree), editdistance or
# jax-privacy (and its pydantic)
# (safetensors and tqdm come with transformers; their wheels are fetched too, for an image without it).
# Run it on a machine with network; the accelerator machine then needs none
# (benchmarks/accelerator_check.sh installs them with --no-deps).
#
#   bash benchmarks/fetch_accelerator_wheels.sh                 # Python 3.12, x86-64 Linux
#   ACCEL_PYTHON_VERSION=3.11 bash benchmarks/fetch_accelerator_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${ACCEL_WHEELS:-$ROOT/.whl}"
PYVER="${ACCEL_PYTHON_VERSION:-3.12}"
PLATFORM="${ACCEL_PLATFORM:-manylinux2014_x86_64}"
PIP="${PIP:-python3 -m pip}"
mkdir -p "$DEST"
# Pure-Python and binary wheels, without their dependencies (the image has numpy, scipy, absl, ...);
# dm-tree's and dp-accounting's own small dependencies are listed too.
$PIP download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --platform "$PLATFORM" \
  --dest "$DEST" "gin-config>=0.5,<0.6" "dp-accounting>=0.6,<0.7" "dm-tree" "editdistance>=0.8,<1" \
  "attrs" "wrapt" "mpmath" "safetensors" "tqdm" \
  "jax-privacy==2.0.0" "pydantic>=2,<3" "pydantic-core" "annotated-types" "typing-inspection"
ls -1 "$DEST"
