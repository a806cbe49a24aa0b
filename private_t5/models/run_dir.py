"""The layout of a run directory (MODEL_DIR): the one place its names are defined.

  MODEL_DIR/.lock                          the run's exclusive lock (`run_lock`)
  MODEL_DIR/secrets/run_seeds.json         the run's secret root seed (folder 0700, file 0600):
                                           PRIVATE, never published (`checkpoints.write_run_seeds`)
  MODEL_DIR/checkpoints/<step>/state       params, optimizer state, noise state, step (orbax PyTree)
  MODEL_DIR/checkpoints/<step>/metadata    JSON: model config, fingerprint, privacy ledger,
                                           vocabulary path, step, and where the seeds are
                                           (`checkpoints`)
  MODEL_DIR/config.gin                     the run's operative Gin config
  MODEL_DIR/tensorboard/<split>/           TensorBoard event files (train, validation)

The privacy report and the run summary beside them are named and written by the privacy layer
(`dp/ledger.py`). Checkpoints and the secrets file are written and read through `checkpoints`
only; the other files are found with the functions below.

What may be published: not the run directory. With the root seed anyone regenerates every step's
noise and subtracts it; a correlated-noise run's checkpoints hold recent steps' noise (the noise
state); checkpoints written before the secrets file existed hold the root seed in their metadata;
a config.gin with `insecure_deterministic_seed` holds a (fixed) root seed. The release is the
output of `private-t5 export` (docs/privacy.md, "Which files of a run are private").
"""
import os
from typing import List

LOCK_FILENAME = ".lock"
CHECKPOINT_SUBDIR = "checkpoints"
CONFIG_FILENAME = "config.gin"
TENSORBOARD_SUBDIR = "tensorboard"
SECRETS_SUBDIR = "secrets"
RUN_SEEDS_FILENAME = "run_seeds.json"
# The secrets file relative to MODEL_DIR: what a checkpoint's metadata names instead of the seed.
RUN_SEEDS_RELPATH = f"{SECRETS_SUBDIR}/{RUN_SEEDS_FILENAME}"


def lock_path(model_dir: str) -> str:
  return os.path.join(model_dir, LOCK_FILENAME)


def checkpoints_dir(model_dir: str) -> str:
  return os.path.join(model_dir, CHECKPOINT_SUBDIR)


def config_path(model_dir: str) -> str:
  return os.path.join(model_dir, CONFIG_FILENAME)


def tensorboard_dir(model_dir: str) -> str:
  return os.path.join(model_dir, TENSORBOARD_SUBDIR)


def secrets_dir(model_dir: str) -> str:
  """The folder of the run's private files (mode 0700): never part of a release."""
  return os.path.join(model_dir, SECRETS_SUBDIR)


def run_seeds_path(model_dir: str) -> str:
  """The file of the run's secret root seed (mode 0600)."""
  return os.path.join(secrets_dir(model_dir), RUN_SEEDS_FILENAME)


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
