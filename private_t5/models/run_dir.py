"""The layout of a run directory (MODEL_DIR): the one place its names are defined.

  MODEL_DIR/.lock                          the run's exclusive lock (`run_lock`)
  MODEL_DIR/checkpoints/<step>/state       params, optimizer state, step (orbax PyTree)
  MODEL_DIR/checkpoints/<step>/metadata    JSON: model config, fingerprint, run seeds, privacy
                                           ledger, vocabulary path, step (`checkpoints`)
  MODEL_DIR/config.gin                     the run's operative Gin config
  MODEL_DIR/tensorboard/<split>/           TensorBoard event files (train, validation)

The privacy report and the run summary beside them are named and written by the privacy layer
(`dp/ledger.py`). Checkpoints are written and read through `checkpoints` only; the other files
are found with the functions below.
"""
import os
from typing import List

LOCK_FILENAME = ".lock"
CHECKPOINT_SUBDIR = "checkpoints"
CONFIG_FILENAME = "config.gin"
TENSORBOARD_SUBDIR = "tensorboard"


def lock_path(model_dir: str) -> str:
  return os.path.join(model_dir, LOCK_FILENAME)


def checkpoints_dir(model_dir: str) -> str:
  return os.path.join(model_dir, CHECKPOINT_SUBDIR)


def config_path(model_dir: str) -> str:
  return os.path.join(model_dir, CONFIG_FILENAME)


def tensorboard_dir(model_dir: str) -> str:
  return os.path.join(model_dir, TENSORBOARD_SUBDIR)


def has_checkpoints(model_dir: str) -> bool:
  """Whether `model_dir` has a checkpoints folder (complete steps or not)."""
  return os.path.isdir(checkpoints_dir(model_dir))


def checkpoint_step_names(model_dir: str) -> List[str]:
  """The names of the complete checkpoint steps in `model_dir` (orbax renames a step into place);
  [] when there is no checkpoints folder."""
  try:
    return sorted(n for n in os.listdir(checkpoints_dir(model_dir)) if n.isdigit())
  except OSError:
    return []
