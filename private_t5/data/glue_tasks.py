"""GLUE (and GLUE-layout) tasks in T5's text-to-text form, as random-access example sources.

`GlueSource` exposes one split of a task or mixture as a `train.main.ExampleSource`
(`num_examples`, `privacy_unit == "example"`: one labelled example is the privacy unit,
`feature_lengths`, `vocab_size`, `get_batch`, `describe`; also `user_ids`), so fine-tuning
runs through the same trainer as pretraining, DP or not. A mixture concatenates its tasks'
examples: uniform (or Poisson) sampling over the concatenation is T5's examples-proportional
mixing (Raffel et al. 2020, Sec. 3.5.2) without a cap, and keeps the DP population explicit.

The tasks and mixtures are registered in `data.glue_registry` (GLUE's, the shipped `glue_like`
ones, `register_local_tsv_task`), and a split's rows are read into text-to-text examples in
`data.glue_rows`; the names of both are also read from here.
"""
import logging
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from private_t5 import vocabulary as vocab_lib
from private_t5.data import source as source_lib
from private_t5.errors import ConfigError
from private_t5.io import file_sha256
# The registry and the reading of rows have their own modules; their names are also read from here.
from private_t5.data.glue_registry import resolve
from private_t5.data.glue_rows import load_examples
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.data.glue_registry': ('register_local_tsv_task',),
})

logger = logging.getLogger(__name__)

EOS_ID = 1
UNK_ID = 2


def tokenize(texts: Sequence[str], vocab_path: str, length: int, vocab_size: Optional[int] = None):
  """int32 `[n, length]` token ids with EOS, trimmed to `length` (EOS kept, as T5's
  `append_eos_after_trim`) and zero-padded, plus the untrimmed lengths (with EOS)."""
  vocab = vocab_lib.load_vocabulary(vocab_path)
  proc = vocab_lib.sentencepiece_processor(vocab)
  if vocab_size is not None and vocab.vocab_size > vocab_size:
    raise ConfigError(f"vocabulary {vocab_path} has {vocab.vocab_size} ids (with sentinels) but the "
                      f"model's vocab_size is {vocab_size}")
  ids = proc.EncodeAsIds(list(texts))
  out = np.zeros((len(ids), length), np.int32)
  full = np.zeros((len(ids),), np.int64)
  for row, seq in enumerate(ids):
    seq = seq[:length - 1] + [EOS_ID]
    out[row, :len(seq)] = seq
    full[row] = len(ids[row]) + 1
  return out, full


class GlueSource:
  """One split of a task or mixture as a `train.main.ExampleSource` (privacy unit: one example).

  Args:
    task_or_mixture: registered task or mixture name.
    split: "train", "validation" or "test".
    vocab_path: SentencePiece model of the model being fine-tuned.
    feature_lengths: {"inputs": Li, "targets": Lt}.
    glue_dir: local copy of the official GLUE directories (else TFDS `glue/*`).
    tfds_data_dir: TFDS data directory (default TFDS's own).
    vocab_size: the model's vocabulary size, to refuse a vocabulary that does not fit.
    progress: print loading progress to stderr.
  """

  def __init__(self, task_or_mixture: str, split: str, vocab_path: str,
               feature_lengths: Optional[Mapping[str, int]] = None, glue_dir: Optional[str] = None,
               tfds_data_dir: Optional[str] = None, vocab_size: Optional[int] = None,
               progress: bool = False):
    lengths = dict(feature_lengths or {"inputs": 512, "targets": 8})
    for key in ("inputs", "targets"):
      if not isinstance(lengths.get(key), int) or lengths[key] < 2:
        raise ConfigError(f"feature_lengths[{key!r}] must be an integer >= 2, got {lengths.get(key)!r}")
    if not vocab_path:
      raise ConfigError("vocab_path is required (the vocabulary of the model being fine-tuned)")
    self.name = task_or_mixture
    self.split = split
    self.vocab_path = vocab_path
    self._lengths = {"inputs": lengths["inputs"], "targets": lengths["targets"]}
    tasks = resolve(task_or_mixture)
    if split == "train":
      tasks = tuple(t for t in tasks if t.train_weight)
    self.tasks = tasks
    enc, tgt, task_ids, inputs, targets, labels, sources = [], [], [], [], [], [], []
    self.truncated = {}
    for i, task in enumerate(tasks):
      ex = load_examples(task.name, split, glue_dir, tfds_data_dir)
      e, e_len = tokenize(ex["inputs"], vocab_path, lengths["inputs"], vocab_size)
      t, t_len = tokenize(ex["targets"], vocab_path, lengths["targets"], vocab_size)
      if np.any(t_len > lengths["targets"]):
        raise ConfigError(f"task {task.name!r}: targets need up to {int(t_len.max())} tokens but "
                          f"feature_lengths['targets'] is {lengths['targets']}")
      if np.any(t == UNK_ID):
        bad = sorted({ex["targets"][r] for r in np.nonzero(np.any(t == UNK_ID, axis=1))[0]})
        raise ConfigError(f"task {task.name!r}: target(s) {bad[:3]} contain pieces unknown to the "
                          f"vocabulary {vocab_path}, so the model could never generate them")
      self.truncated[task.name] = float(np.mean(e_len > lengths["inputs"]))
      enc.append(e)
      tgt.append(t)
      task_ids.append(np.full(len(e), i, np.int32))
      inputs.extend(ex["inputs"])
      targets.extend(ex["targets"])
      labels.append(ex["labels"])
      sources.append(ex["source"])
      if progress:
        logger.info("[glue] %s/%s: %d examples from %s", task.name, split, len(e), ex["source"])
    self._enc = np.concatenate(enc)
    self._tgt = np.concatenate(tgt)
    self.task_ids = np.concatenate(task_ids)
    self.inputs_text = inputs
    self.targets_text = targets
    self.labels = labels  # per task
    self.sources = sources
    self.task_sizes = [len(e) for e in enc]

  @property
  def num_examples(self) -> int:
    return int(len(self._enc))

  @property
  def privacy_unit(self) -> str:
    return "example"

  @property
  def feature_lengths(self) -> Dict[str, int]:
    return dict(self._lengths)

  @property
  def vocab_size(self) -> int:
    """0: no id bound is recorded here; the vocabulary was checked against the model's
    `vocab_size` (when given) as the examples were tokenized."""
    return 0

  def user_ids(self) -> np.ndarray:
    return np.arange(self.num_examples, dtype=np.int64)

  def task_slice(self, task_name: str) -> slice:
    """Positions of one task's examples in this source."""
    i = [t.name for t in self.tasks].index(task_name)
    start = sum(self.task_sizes[:i])
    return slice(start, start + self.task_sizes[i])

  def get_batch(self, indices: Sequence[int], seed: int, batch_size: int) -> Dict[str, np.ndarray]:
    """The trainer's batch dict for `indices`, padded to `batch_size` rows (seed unused:
    classification examples have no objective noise)."""
    del seed
    return source_lib.gather_batch(self._enc, self._tgt, indices, batch_size)

  def describe(self) -> Dict[str, object]:
    return {
        "corpus": f"glue:{self.name}",
        "tasks": [t.name for t in self.tasks],
        "task_sizes": dict(zip([t.name for t in self.tasks], self.task_sizes)),
        "data_sources": self.sources,
        "split": self.split,
        "vocab_path": self.vocab_path,
        "vocab_sha256": file_sha256(self.vocab_path),
        "objective": "text_to_text",
        "feature_lengths": self.feature_lengths,
        "privacy_unit": "example",
        "num_examples": self.num_examples,
        "fraction_inputs_truncated": self.truncated,
        "mixing": "examples_proportional" if len(self.tasks) > 1 else "single_task",
    }


def make_glue_source(task_or_mixture: str, split: str = "train", vocab_path: Optional[str] = None,
                     feature_lengths: Optional[Mapping[str, int]] = None, glue_dir: Optional[str] = None,
                     tfds_data_dir: Optional[str] = None, vocab_size: Optional[int] = None,
                     progress: bool = True) -> GlueSource:
  """The Gin-facing factory of `GlueSource`.

  `vocab_path` is the fine-tuned model's vocabulary; the fine-tuning config resolves it
  (from `VOCAB_PATH`, or the vocabulary recorded with `INITIAL_CHECKPOINT`) with
  `train.initial_checkpoint.finetune_vocab_path` before it reaches here.
  """
  return GlueSource(task_or_mixture, split, vocab_path, feature_lengths, glue_dir=glue_dir,
                    tfds_data_dir=tfds_data_dir, vocab_size=vocab_size, progress=progress)
