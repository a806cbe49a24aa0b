"""Initial parameters of a fine-tuning run: our checkpoint directory or imported HF T5 weights.

`load_initial_params(path, model_config)` accepts

* a private_t5 run directory (`MODEL_DIR` with `checkpoints/<step>/`), read with
  `checkpoint_read.restore_for_inference` (parameters only: optimizer state, seeds and the
  pretraining ledger stay behind; the pretraining privacy report is returned by
  `describe_initial_checkpoint`), or a checkpoint written by `scripts/convert_hf_t5.py`;
* a Hugging Face T5 directory (`config.json` + `model.safetensors`), converted on the fly.

The parameters must have exactly the shapes of `model_config` (dropout may differ: it is
not a parameter); anything else is a `CheckpointError` naming the first difference.

A fine-tuning start asks about the same directory several times (its vocabulary for each
data source, its description for the run's metadata, then its parameters): the last read is
kept, keyed by the directory's path and the size and mtime of every file in it, so the weights
are read once; `load_initial_params` hands them over and drops the copy.
"""
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

from private_t5.errors import CheckpointError, ConfigError
from private_t5.models import checkpoint_read, hf_convert
from private_t5.models.config import T5Config

Params = Dict[str, Any]
# Fields that change parameter shapes or their meaning (compared for a clear error message).
_STRUCTURAL_FIELDS = ("vocab_size", "d_model", "num_heads", "d_kv", "d_ff", "num_encoder_layers",
                      "num_decoder_layers", "feed_forward", "tie_embeddings",
                      "relative_attention_num_buckets")


def _check_config(found: T5Config, wanted: T5Config, path: str) -> None:
  for name in _STRUCTURAL_FIELDS:
    a, b = getattr(found, name), getattr(wanted, name)
    if a != b:
      raise CheckpointError(f"initial checkpoint {path!r} has {name}={a!r} but the model config has "
                            f"{name}={b!r}; use the matching model gin file or override it")


# The last directory read: {"key": (abspath, file stats), "value": (params, config, info)}.
_LAST_READ: Dict[str, Any] = {}


def _dir_signature(path: str) -> Tuple:
  """(abspath, sorted (relative path, size, mtime_ns) of every file below `path`)."""
  root = os.path.abspath(path)
  stats = []
  for dirpath, _, filenames in os.walk(root):
    for name in filenames:
      full = os.path.join(dirpath, name)
      try:
        st = os.stat(full)
      except OSError:
        continue
      stats.append((os.path.relpath(full, root), st.st_size, st.st_mtime_ns))
  return root, tuple(sorted(stats))


def _read(path: str, keep: bool = True):
  """(params, config, info) from either kind of directory, from the cache when unchanged.

  `keep=False` drops the cached copy (the caller takes over the parameters).
  """
  if not path:
    raise CheckpointError("initial checkpoint path is empty")
  if os.path.exists(path) and not os.path.isdir(path):
    raise CheckpointError(f"initial checkpoint {path!r} is a file, not a checkpoint directory (give the run "
                          "directory, a `private-t5 import` output or a Hugging Face T5 directory)")
  if not os.path.isdir(path):
    raise CheckpointError(f"initial checkpoint {path!r} does not exist")
  key = _dir_signature(path)
  if _LAST_READ.get("key") == key:
    value = _LAST_READ["value"]
  else:
    _LAST_READ.clear()
    value = checkpoint_read.read_model_dir(path)
  if keep:
    _LAST_READ.update(key=key, value=value)
  else:
    _LAST_READ.clear()
  return value


def load_initial_params(path: str, model_config: T5Config) -> Params:
  """Parameters (numpy float32 tree) to start fine-tuning `model_config` from `path`.

  Raises:
    CheckpointError: `path` is missing, unreadable, or its parameters do not match
      `model_config` (the message names the differing field or parameter).
  """
  params, found_config, _ = _read(path, keep=False)
  _check_config(found_config, model_config, path)
  hf_convert.check_param_shapes(params, model_config, source=f"initial checkpoint {path!r}")
  return _as_float32(params)


def describe_initial_checkpoint(path: str) -> Dict[str, Any]:
  """Public facts about an initial checkpoint, for the fine-tuning run's records.

  Keys: `kind` ("private_t5" | "huggingface"), `path`, `step`, `vocab_path` and
  `privacy_report` (the pretraining ledger's report, or None for public weights).
  """
  _, config, info = _read(path)
  return dict(info, model_config=config.__dict__.copy())


def _as_float32(tree):
  if isinstance(tree, dict):
    return {k: _as_float32(v) for k, v in tree.items()}
  return np.asarray(tree, dtype=np.float32)


def vocabulary_of(path: str) -> Optional[str]:
  """The vocabulary recorded with an initial checkpoint (None when it has none)."""
  return describe_initial_checkpoint(path).get("vocab_path")


def finetune_vocab_path(vocab_path: Optional[str] = None,
                        initial_checkpoint: Optional[str] = None, lora: Any = None) -> str:
  """`vocab_path` if given, else the vocabulary recorded with `initial_checkpoint`.

  `lora` (configs/runs/finetune_lora.gin binds the run's `LoraConfig`): a LoRA run needs its
  base, so a missing INITIAL_CHECKPOINT is named as that, whatever VOCAB_PATH is.
  """
  if lora is not None and not initial_checkpoint:
    raise ConfigError("LoRA adapts pretrained weights: set INITIAL_CHECKPOINT (--initial_checkpoint), the LoRA "
                      "base checkpoint")
  if vocab_path:
    return vocab_path
  if not initial_checkpoint:
    raise ConfigError("set VOCAB_PATH (or INITIAL_CHECKPOINT, whose vocabulary is then used)")
  found = vocabulary_of(initial_checkpoint)
  if not found:
    raise ConfigError(f"initial checkpoint {initial_checkpoint!r} records no vocabulary; set VOCAB_PATH")
  return found
