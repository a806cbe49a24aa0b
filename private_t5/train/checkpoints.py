"""Checkpoints with orbax: every N steps, keep the last K, atomic, resume from the latest.

Layout of a model directory:

  MODEL_DIR/checkpoints/<step>/state     params, optimizer state, step (orbax PyTree)
  MODEL_DIR/checkpoints/<step>/metadata  JSON: model config, fingerprint, run seeds, privacy
                                         ledger, vocabulary path, step
  MODEL_DIR/config.gin, privacy_report.json, summary.json, train/ validation/ (TensorBoard)

Atomicity: orbax writes a step into a temporary directory and renames it once every item is
complete, so a process killed at any moment (also during a save) leaves only complete steps
visible; `latest_step` ignores unfinished temporaries and they are removed on the next start.
The step of a checkpoint is also the data position (batches are a pure function of the
sampler seed and the step), so a resumed run neither skips nor repeats a batch.

A checkpoint directory holds the run's secret seeds (noise and sampling keys): keep it as
private as the training data; release parameters only (`restore_for_inference`).
"""
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from private_t5.errors import CheckpointError
from private_t5.io import json_default

PyTree = Any
CHECKPOINT_SUBDIR = "checkpoints"
STATE_ITEM = "state"
METADATA_ITEM = "metadata"
FORMAT_VERSION = 1


def _ocp():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp


def check_writable(model_dir: str) -> None:
  """Raises CheckpointError unless `model_dir` can be created and written."""
  try:
    os.makedirs(model_dir, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=model_dir, prefix=".write_probe_")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise CheckpointError(f"model_dir {model_dir!r} is not writable: {e.strerror or e}") from e


def _first_difference(a: Any, b: Any, prefix: str = "") -> Optional[str]:
  """Dotted path of the first value that differs between two JSON-like trees, or None."""
  if isinstance(a, dict) and isinstance(b, dict):
    for key in sorted(set(a) | set(b)):
      if key not in a or key not in b:
        return f"{prefix}{key}"
      diff = _first_difference(a[key], b[key], f"{prefix}{key}.")
      if diff:
        return diff
    return None
  return None if a == b else prefix.rstrip(".") or "(value)"


class CheckpointManager:
  """Saves and restores the train state of one run in `MODEL_DIR/checkpoints`.

  Args:
    model_dir: the run's directory.
    keep: number of most recent checkpoints kept (older ones are deleted).
    fingerprint: JSON-able description of what the checkpoints belong to (model config, data
      description, privacy mechanism); a directory holding checkpoints with another
      fingerprint is refused.
    async_save: write checkpoints in a background thread (the step loop continues).
  """

  def __init__(self, model_dir: str, *, keep: int = 3, fingerprint: Optional[Dict[str, Any]] = None,
               async_save: bool = True):
    if keep is not None and int(keep) < 1:
      raise CheckpointError(f"keep_checkpoints must be >= 1, got {keep}")
    check_writable(model_dir)
    ocp = _ocp()
    self.model_dir = model_dir
    self.directory = os.path.abspath(os.path.join(model_dir, CHECKPOINT_SUBDIR))
    self.fingerprint = fingerprint
    self._remove_unfinished()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)
    try:
      self._manager = ocp.CheckpointManager(
          self.directory, options=options, item_names=(STATE_ITEM, METADATA_ITEM))
    except OSError as e:
      raise CheckpointError(f"cannot open checkpoints in {self.directory}: {e}") from e
    if fingerprint is not None:
      self.check_compatible(fingerprint)

  def _remove_unfinished(self) -> None:
    """Deletes temporaries of saves interrupted by a crash (never complete steps)."""
    if not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if ".orbax-checkpoint-tmp" in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  # -- queries ----------------------------------------------------------------------------------

  def all_steps(self):
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def read_metadata(self, step: Optional[int] = None) -> Dict[str, Any]:
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.directory}")
    ocp = _ocp()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()}))
    except (FileNotFoundError, ValueError, KeyError) as e:
      raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable: {e}") from e
    return dict(restored[METADATA_ITEM])

  def check_compatible(self, fingerprint: Dict[str, Any]) -> None:
    """Raises CheckpointError if the latest checkpoint belongs to another model/config/data."""
    step = self.latest_step()
    if step is None:
      return
    saved = self.read_metadata(step).get("fingerprint")
    fingerprint = json.loads(json.dumps(fingerprint, default=json_default))
    if saved != fingerprint:
      where = _first_difference(saved, fingerprint) if isinstance(saved, dict) else "fingerprint"
      raise CheckpointError(
          f"{self.model_dir} holds checkpoints of another run (first difference: {where!r}: "
          f"checkpoint has {_lookup(saved, where)!r}, this run has {_lookup(fingerprint, where)!r}); "
          "use a new model_dir, or restore the original configuration to resume")

  # -- save / restore ---------------------------------------------------------------------------

  def save(self, step: int, state: PyTree, metadata: Dict[str, Any]) -> bool:
    """Starts saving `state` and `metadata` (with the fingerprint) as checkpoint `step`.

    Raises:
      CheckpointError: the directory is not writable or the disk is full; previously saved
        checkpoints stay intact (the failed step never becomes visible).
    """
    ocp = _ocp()
    metadata = dict(metadata, step=int(step), fingerprint=self.fingerprint, format_version=FORMAT_VERSION)
    metadata = json.loads(json.dumps(metadata, default=json_default))
    try:
      return self._manager.save(int(step), args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardSave(state), METADATA_ITEM: ocp.args.JsonSave(metadata)}),
          force=True)
    except OSError as e:
      raise CheckpointError(f"saving checkpoint {step} to {self.directory} failed: "
                            f"{e.strerror or e}; earlier checkpoints are intact") from e

  def wait(self) -> None:
    """Blocks until background saves are complete; surfaces their errors as CheckpointError."""
    try:
      self._manager.wait_until_finished()
    except OSError as e:
      raise CheckpointError(f"saving a checkpoint to {self.directory} failed: {e.strerror or e}; "
                            "earlier checkpoints are intact") from e

  def restore(self, abstract_state: PyTree, step: Optional[int] = None) -> Tuple[PyTree, Dict[str, Any]]:
    """(state, metadata) of checkpoint `step` (default: latest), placed as `abstract_state`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.directory}")
    ocp = _ocp()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardRestore(abstract_state), METADATA_ITEM: ocp.args.JsonRestore()}))
    except (FileNotFoundError, ValueError, KeyError) as e:
      raise CheckpointError(f"checkpoint {step} in {self.directory} does not match this model: {e}") from e
    return restored[STATE_ITEM], dict(restored[METADATA_ITEM])

  def close(self) -> None:
    self.wait()
    self._manager.close()


def _lookup(tree: Any, dotted: Optional[str]) -> Any:
  if not dotted or not isinstance(tree, dict):
    return tree
  node = tree
  for part in dotted.split("."):
    if not isinstance(node, dict) or part not in node:
      return None
    node = node[part]
  return node


def restore_for_inference(model_dir: str, step: Optional[int] = None):
  """Parameters of a trained model, for evaluation, memorization tests and fine-tuning.

  Args:
    model_dir: a training run's MODEL_DIR.
    step: checkpoint step; None for the latest.

  Returns:
    (params, model_config, info): params as a nested dict of jax arrays (no optimizer state,
    no seeds), the `models.T5Config`, and a dict with `vocab_path`, `step`, `privacy_report`
    (the ledger's report at that step, or None), `feature_lengths`, and the training data's
    `objective`, `vocab_sha256` and `privacy_unit`.

  Raises:
    CheckpointError: no checkpoint (or not that step) in `model_dir`, or an unreadable one.
  """
  from private_t5 import models  # pylint: disable=g-import-not-at-top
  ocp = _ocp()
  directory = os.path.abspath(os.path.join(model_dir, CHECKPOINT_SUBDIR))
  if not os.path.isdir(directory):
    raise CheckpointError(f"no checkpoints in {model_dir!r} (expected {directory})")
  manager = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
      item_names=(STATE_ITEM, METADATA_ITEM))
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise CheckpointError(f"no complete checkpoint in {directory}")
    if step is None:
      step = steps[-1]
    elif int(step) not in steps:
      raise CheckpointError(f"checkpoint step {step} not found in {directory} (have {steps})")
    metadata = manager.restore(step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()}))
    metadata = dict(metadata[METADATA_ITEM])
    step_dir = os.path.join(directory, str(step), STATE_ITEM)
    tree_meta = ocp.PyTreeCheckpointer().metadata(step_dir)
    tree_meta = getattr(tree_meta, "item_metadata", tree_meta)
    tree_meta = getattr(tree_meta, "tree", tree_meta)
    params_meta = tree_meta["params"]
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), params_meta)
    restored = ocp.PyTreeCheckpointer().restore(
        step_dir, args=ocp.args.PyTreeRestore(
            item={"params": params_meta}, restore_args={"params": restore_args},
            partial_restore=True))
  except (FileNotFoundError, ValueError, KeyError) as e:
    raise CheckpointError(f"cannot read checkpoint {step} in {directory}: {e}") from e
  finally:
    manager.close()
  params = jax.tree.map(np.asarray, restored["params"])
  model_config = models.T5Config(**metadata["model_config"])
  info = {
      "step": int(step),
      "vocab_path": metadata.get("vocab_path"),
      "privacy_report": metadata.get("privacy_report"),
      "feature_lengths": metadata.get("feature_lengths"),
      "model_dir": os.path.abspath(model_dir),
  }
  data = (metadata.get("fingerprint") or {}).get("data") or {}
  info.update(objective=data.get("objective"), vocab_sha256=data.get("vocab_sha256"),
              privacy_unit=data.get("privacy_unit"))
  return params, model_config, info


def saved_seeds(manager: CheckpointManager) -> Optional[Dict[str, Any]]:
  """The run seeds stored in the latest checkpoint (to continue its streams), or None."""
  step = manager.latest_step()
  if step is None:
    return None
  seeds = manager.read_metadata(step).get("seeds")
  if not isinstance(seeds, dict):
    raise CheckpointError(f"checkpoint {step} in {manager.directory} has no run seeds")
  return seeds
