"""Parameters of a trained model read back for inference: the one reader of a run's checkpoints
that evaluation, memorization, adaptive DP, fine-tuning and export share.

`restore_for_inference` reads a private_t5 MODEL_DIR (the latest checkpoint, read again when a
running training rotates it away, or the newest older one that reads); `read_model_dir` also takes
a Hugging Face T5 directory; a LoRA run's adapters are merged into its base, whose SHA-256 is
checked (`read_lora_base`). Parameters only: a checkpoint's optimizer and noise state stay in it,
and the run's secrets file (its root seed, MODEL_DIR/secrets/) is never read.
"""
import logging
import os
from typing import Any, Dict, Optional

import jax
import numpy as np

from private_t5.errors import CheckpointError, ConfigError
from private_t5.models import hf_convert, network, run_dir
from private_t5.models import config as config_lib
from private_t5.models import lora as lora_lib
from private_t5.models.checkpoint_orbax import METADATA_ITEM, STATE_ITEM, cause, ocp

# Its log lines carry the name of the checkpoints module, as they always have.
logger = logging.getLogger("private_t5.models.checkpoints")

# How often the latest checkpoint is read again when a running training rotates it away.
ROTATION_RETRIES = 5


def restore_for_inference(model_dir: str, step: Optional[int] = None, *, merge_adapters: bool = True,
                          lora_base: Optional[str] = None):
  """Parameters of a trained model, for evaluation, memorization tests, fine-tuning and export.

  A LoRA run's checkpoint holds only adapters: its base (the `lora` entry of the metadata: path
  and SHA-256 of the frozen weights) is read too, checked against the hash, and the adapters are
  merged into it (`lora.merge`), so every reader gets plain T5 parameters; `merge_adapters=False`
  returns the adapters themselves (for an adapter export). `lora_base` names the base's new
  place when it moved (`--initial_checkpoint` of evaluate and export, as of train): it must hold
  the recorded weights (same SHA-256), and `info["lora"]` then names it.

  Reading the latest checkpoint of a running training is safe: a checkpoint that its
  `keep_checkpoints` rotation deletes while it is read is read again from the new latest (up to
  `ROTATION_RETRIES` times). A given `step` is read once. When the latest is unreadable
  (damaged metadata or state), the newest older checkpoint that reads is used, with a warning, as
  a resumed training does.

  Args:
    model_dir: a training run's MODEL_DIR.
    step: checkpoint step; None for the latest.
    lora_base: a LoRA run's base, moved from the recorded path (None: the recorded path).

  Returns:
    (params, model_config, info): params as a nested dict of jax arrays (no optimizer state,
    no seeds), the `models.T5Config`, and a dict with `vocab_path`, `step`, `privacy_report`
    (the ledger's report at that step, or None), `feature_lengths`, the training data's
    `objective`, `vocab_sha256` and `privacy_unit`, and `lora` (a LoRA run's settings and base,
    else None).

  Raises:
    CheckpointError: no checkpoint (or not that step) in `model_dir`, or an unreadable one; a
      LoRA run whose base is missing or has changed.
  """
  attempt = 0
  while True:
    before = run_dir.checkpoint_step_names(model_dir)
    try:
      params, config, info = _read_newest_readable(model_dir, before) if step is None else _read_for_inference(
          model_dir, step)
      if lora_base and not info.get("lora"):
        raise ConfigError(f"--initial_checkpoint names a moved LoRA base, but {model_dir!r} is not a LoRA run")
      if info.get("lora") and lora_base:
        record = info["lora"]
        info = dict(info, lora=dict(record, base=dict(record["base"], path=os.path.abspath(lora_base))))
      if info.get("lora") and merge_adapters:
        params = lora_lib.merge(read_lora_base(info["lora"], model_dir), params, lora_lib.config_of(info["lora"]))
      return params, config, info
    except CheckpointError:
      attempt += 1
      if step is not None or attempt >= ROTATION_RETRIES or run_dir.checkpoint_step_names(model_dir) == before:
        raise
      logger.info("a checkpoint of %s was rotated away while it was read; reading the new latest", model_dir)


def _read_newest_readable(model_dir: str, step_names):
  """`_read_for_inference` of the latest checkpoint, else of the newest older one (of `step_names`) that reads."""
  try:
    return _read_for_inference(model_dir, None)
  except CheckpointError as error:
    for older in sorted((int(n) for n in step_names), reverse=True)[1:]:
      try:
        result = _read_for_inference(model_dir, older)
      except CheckpointError:
        continue
      logger.warning("%s; read checkpoint %d instead, the newest one that reads", error, older)
      return result
    raise


def _read_for_inference(model_dir: str, step: Optional[int]):
  """One reading of `restore_for_inference`."""
  directory = os.path.abspath(run_dir.checkpoints_dir(model_dir))
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
  except CheckpointError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"cannot read checkpoint {step} in {directory}: {cause(e)}") from e
  finally:
    manager.close()
  # Read as the unrolled network (the layout of `from_saved`'s config), whichever layout was trained.
  params = network.to_layout(jax.tree.map(np.asarray, restored["params"]), False)
  model_config = config_lib.from_saved(metadata["model_config"])
  info = {
      "step": int(step),
      "vocab_path": metadata.get("vocab_path"),
      "privacy_report": metadata.get("privacy_report"),
      "feature_lengths": metadata.get("feature_lengths"),
      "model_dir": os.path.abspath(model_dir),
      "lora": metadata.get("lora"),
  }
  data = (metadata.get("fingerprint") or {}).get("data") or {}
  info.update(objective=data.get("objective"), vocab_sha256=data.get("vocab_sha256"),
              privacy_unit=data.get("privacy_unit"))
  return params, model_config, info


def read_model_dir(path: str):
  """(params, T5Config, info) of a private_t5 MODEL_DIR (`restore_for_inference`, latest step) or
  of a Hugging Face T5 directory (info: `kind`, `path`, `step` None, `vocab_path`,
  `privacy_report` None)."""
  if hf_convert.is_hf_t5_dir(path):
    params, config = hf_convert.import_hf_t5(path)
    return params, config, {"kind": "huggingface", "path": os.path.abspath(path), "step": None,
                            "vocab_path": hf_convert.hf_vocabulary_path(path), "privacy_report": None}
  params, config, info = restore_for_inference(path)
  return params, config, dict(info, kind="private_t5", path=os.path.abspath(path))


def read_lora_base(record: Dict[str, Any], model_dir: str):
  """The frozen base parameters of a LoRA run (its metadata's `lora` record), hash checked.

  `record["base"]["path"]` is where the run recorded its base, or where `restore_for_inference`'s
  `lora_base` says it moved; either way its weights must have the recorded SHA-256.
  """
  path, sha256 = record["base"]["path"], record["base"]["sha256"]
  if os.path.exists(path) and not os.path.isdir(path):
    raise CheckpointError(f"the LoRA base {path!r} of the run {model_dir!r} is a file, not a checkpoint directory")
  if not os.path.isdir(path):
    raise CheckpointError(f"the LoRA run {model_dir!r} adapts the weights in {path!r}, which are missing; "
                          "if they moved, name their new place with --initial_checkpoint=DIR (train, evaluate, export; "
                          "checked by SHA-256)")
  params = read_model_dir(path)[0]
  if lora_lib.params_sha256(params) != sha256:
    raise CheckpointError(f"the base weights in {path!r} changed since the LoRA run {model_dir!r} was trained "
                          f"(SHA-256 {sha256[:12]}... expected)")
  return params
