"""A registered seqio Task or Mixture as training data: T5X's data, trained on privately.

A T5X user names a seqio Task or Mixture (`MIXTURE_OR_TASK_NAME`), registered by a module that
is imported first (`MIXTURE_OR_TASK_MODULE`), as `t5x/train.py` does. `SeqioSource` reads one
split of it once, with `get_dataset(sequence_length, split=..., shuffle=False)`: the Task's own
preprocessors run (t5's span corruption included) with a fixed seed, nothing is packed, and the
examples are kept in memory as padded arrays. A run then draws them as it draws from any
`train.main.ExampleSource`: shuffled batches in a non-private run, Poisson sampling over the N
examples in a DP run (untruncated, in microbatches), never the Task's own shuffled batches.
N is counted by that one read, once per process.

Privacy unit: one seqio example (`example`). A document may feed several examples (a long text
cut into pieces; t5's span corruption also joins documents before cutting), so the guarantee is
per example, not per document. A user who knows that the Task yields at most one example per
document declares it (`one_example_per_document=True`, Gin `ONE_EXAMPLE_PER_DOCUMENT`): the unit
is then `document`, and every report says it rests on the user's declaration (not checked here).

A Mixture: its tasks' examples together are the population, every example sampled at the same
rate (examples-proportional mixing, as `glue_tasks.GlueSource` mixes; the Mixture's own rates are
recorded, not applied: one rate for all keeps the sampling one Poisson draw). In a DP run every rate
must be a number fixed in advance: a rate computed by a function (e.g. from the number of
examples) is a choice made from the data, refused in one line. The report names each task, its
examples and its declared rate.

Unlike a token store (`source.CorpusSource`), whose span-corruption noise is drawn afresh at
every draw, an example here keeps the noise of the one read: the same seed gives the same
examples at the same indices, so a resumed run sees the data it started with.

seqio and TensorFlow are imported only when a source is built or a Task looked up, so the rest
of the package runs without them.
"""
import importlib
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from private_t5 import quiet_tf
from private_t5.data import source as source_lib
from private_t5.errors import ConfigError, DataError
from private_t5.io import file_sha256

SEQIO_PREFIX = "seqio:"
EXAMPLE_UNIT_BASIS = ("one seqio example: a document may feed several examples (cut into pieces, or "
                      "joined with other documents), so the guarantee is per example")
DOCUMENT_UNIT_BASIS = ("declared by the user (one_example_per_document=True): the Task yields at most one "
                       "example per document; private_t5 does not check this declaration")


def _seqio():
  """The seqio module, imported on first use (with TensorFlow's start-up lines silenced)."""
  quiet_tf.import_tensorflow()
  try:
    import seqio  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f"a seqio Task needs seqio (pip install 'private_t5[seqio]'): {e}") from e
  return seqio


def import_task_modules(module: Union[None, str, Sequence[str]]) -> None:
  """Imports the module(s) that register the Tasks (T5X's MIXTURE_OR_TASK_MODULE)."""
  names = [module] if isinstance(module, str) else list(module or ())
  for name in names:
    try:
      importlib.import_module(name)
    except ImportError as e:
      raise ConfigError(f"cannot import MIXTURE_OR_TASK_MODULE {name!r}: {e}") from e


def get_mixture_or_task(name: str, module: Union[None, str, Sequence[str]] = None):
  """The registered seqio Task or Mixture `name`, after importing `module`; ConfigError if none."""
  if not isinstance(name, str) or not name:
    raise ConfigError(f"MIXTURE_OR_TASK_NAME must be a non-empty string, got {name!r}")
  seqio = _seqio()
  import_task_modules(module)
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError as e:
    where = f" (after importing {module})" if module else " (set MIXTURE_OR_TASK_MODULE to the module registering it)"
    raise ConfigError(f"no seqio Task or Mixture named {name!r} is registered{where}: "
                      f"{str(e).splitlines()[0]}") from e


def fixed_rates(mixture) -> Dict[str, float]:
  """Task name -> mixing rate of each task of `mixture`; ConfigError (one line) when a rate of it or
  of a sub-mixture is a function (computed from the data) rather than a number fixed in advance."""
  seqio = _seqio()
  for name, rate in mixture.rate_per_task_name.items():
    if callable(rate):
      raise ConfigError(
          f"seqio Mixture {mixture.name!r}: the rate of {name!r} is computed by "
          f"{getattr(rate, '__name__', type(rate).__name__)} (from the data); a DP run needs every rate fixed "
          f"in advance as a number, e.g. ({name!r}, 1.0)")
    if name in seqio.MixtureRegistry.names():
      fixed_rates(seqio.get_mixture_or_task(name))
  return {task.name: float(mixture.get_rate(task)) for task in mixture.tasks}


def _sentencepiece_file(task) -> Optional[str]:
  """The SentencePiece model file of the Task's targets vocabulary, None if it has none."""
  feature = task.output_features.get("targets")
  return getattr(getattr(feature, "vocabulary", None), "sentencepiece_model_file", None)


def seqio_vocab_path(mixture_or_task_name: str, module: Union[None, str, Sequence[str]] = None,
                     vocab_path: Optional[str] = None) -> str:
  """The vocabulary of a run on a seqio Task: `vocab_path`, else the Task's own.

  The Task tokenizes its examples with the vocabulary of its output features: that is the
  vocabulary used (and recorded with the checkpoints). A `vocab_path` given must be the same
  file (by content), as the ids would otherwise mean other pieces.
  """
  task = _tasks_of(mixture_or_task_name, module)[0]
  own = _sentencepiece_file(task)
  if own is None:
    raise ConfigError(f"seqio Task {task.name!r} has no SentencePiece vocabulary on its 'targets' feature; "
                      "private_t5 trains on SentencePiece vocabularies (T5 layout)")
  extra_ids = getattr(task.output_features["targets"].vocabulary, "extra_ids", None)
  if extra_ids not in (None, 100):
    raise ConfigError(f"seqio Task {task.name!r}: its vocabulary has {extra_ids} extra ids; private_t5 "
                      "vocabularies have 100 sentinels (T5's layout)")
  if vocab_path and file_sha256(vocab_path) != file_sha256(own):
    raise ConfigError(f"VOCAB_PATH {vocab_path} is not the vocabulary seqio Task {task.name!r} tokenizes "
                      f"with ({own}); leave VOCAB_PATH unset to use the Task's")
  return vocab_path or own


class SeqioSource:
  """One split of a seqio Task or Mixture as a `train.main.ExampleSource`, read once into memory.

  Args:
    mixture_or_task_name: registered Task or Mixture name.
    split: the split of every task ("train", "validation", ...).
    feature_lengths: {"inputs": Li, "targets": Lt}: the sequence length given to the Task
      (its examples are trimmed to it) and the padded width of every batch.
    module: module(s) imported first, which register the Task (MIXTURE_OR_TASK_MODULE).
    one_example_per_document: the user declares that the Task yields at most one example per
      document: privacy unit `document` instead of `example` (see the module docstring).
    dp: the run's DPConfig or None; only whether it is set matters: a DP run refuses a Mixture
      whose rates are not fixed numbers.
    seed: seed of the Task's preprocessors (span-corruption noise) for the one read.
    use_cached: read the Task's offline cache (seqio's `use_cached`).
    max_examples: read at most this many examples of each task (tests, quick runs).
  """

  def __init__(self, mixture_or_task_name: str, split: str, feature_lengths: Mapping[str, int],
               module: Union[None, str, Sequence[str]] = None, one_example_per_document: bool = False,
               dp=None, seed: int = 0, use_cached: bool = False, max_examples: Optional[int] = None):
    lengths = dict(feature_lengths or {})
    for key in ("inputs", "targets"):
      if not isinstance(lengths.get(key), int) or lengths[key] < 2:
        raise ConfigError(f"feature_lengths[{key!r}] must be an integer >= 2, got {lengths.get(key)!r}")
    self._lengths = {"inputs": lengths["inputs"], "targets": lengths["targets"]}
    self.name = mixture_or_task_name
    self.module = module
    self.split = split
    self.one_example_per_document = bool(one_example_per_document)
    seqio = _seqio()
    found = get_mixture_or_task(mixture_or_task_name, module)
    self.is_mixture = isinstance(found, seqio.Mixture)
    self.tasks: List = list(found.tasks) if self.is_mixture else [found]
    self.rates = None  # a Task's; or a non-private run's Mixture with rates computed from the data
    if self.is_mixture:
      try:
        self.rates = fixed_rates(found)
      except ConfigError:
        if dp is not None:
          raise
    self.vocab_path = seqio_vocab_path(mixture_or_task_name, module)
    self._vocab_size = int(self.tasks[0].output_features["targets"].vocabulary.vocab_size)
    enc, tgt = [], []
    for task in self.tasks:
      e, t = self._read(task, split, seed, use_cached, max_examples)
      enc.append(e)
      tgt.append(t)
    self.task_sizes = [len(e) for e in enc]
    self._enc = np.concatenate(enc)
    self._tgt = np.concatenate(tgt)
    if not len(self._enc):
      raise DataError(f"seqio {mixture_or_task_name!r} split {split!r} has no examples")

  def _read(self, task, split: str, seed: int, use_cached: bool, max_examples: Optional[int]):
    """(inputs [n, Li], targets [n, Lt]) int32, zero-padded: every example of one task's split."""
    if split not in task.splits:
      raise DataError(f"seqio Task {task.name!r} has no split {split!r} (splits: {sorted(task.splits)})")
    missing = [k for k in ("inputs", "targets") if k not in task.output_features]
    if missing:
      raise ConfigError(f"seqio Task {task.name!r} has no {missing} output feature(s); T5 (encoder-decoder) "
                        f"trains on 'inputs' and 'targets' (features: {sorted(task.output_features)})")
    dataset = task.get_dataset(self._lengths, split=split, shuffle=False, use_cached=use_cached, seed=seed,
                               num_epochs=1)
    if max_examples is not None:
      dataset = dataset.take(max_examples)
    li, lt = self._lengths["inputs"], self._lengths["targets"]
    # Padded in batches by TensorFlow: 15% less CPU than one example at a time through NumPy.
    dataset = dataset.map(lambda ex: {"inputs": ex["inputs"][:li], "targets": ex["targets"][:lt]})
    parts = list(dataset.padded_batch(1024, padded_shapes={"inputs": [li], "targets": [lt]}).as_numpy_iterator())
    if not parts:
      return np.zeros((0, li), np.int32), np.zeros((0, lt), np.int32)
    return (np.concatenate([p["inputs"] for p in parts]).astype(np.int32),
            np.concatenate([p["targets"] for p in parts]).astype(np.int32))

  @property
  def num_examples(self) -> int:
    """N: the examples of the split (of every task of a Mixture), counted by the one read."""
    return int(len(self._enc))

  @property
  def privacy_unit(self) -> str:
    return "document" if self.one_example_per_document else "example"

  @property
  def feature_lengths(self) -> Dict[str, int]:
    return dict(self._lengths)

  @property
  def vocab_size(self) -> int:
    """Ids of the Task's vocabulary, sentinels included."""
    return self._vocab_size

  def user_ids(self) -> np.ndarray:
    return np.arange(self.num_examples, dtype=np.int64)

  def examples(self):
    """(inputs, targets): the padded int32 arrays of all N examples, in index order."""
    return self._enc, self._tgt

  def get_batch(self, indices: Sequence[int], seed: int, batch_size: int) -> Dict[str, np.ndarray]:
    """The trainer's batch of `indices`, padded to `batch_size` rows (`seed` unused: each example
    keeps the noise of the Task's one read)."""
    del seed
    return source_lib.gather_batch(self._enc, self._tgt, indices, batch_size)

  def population(self) -> Dict[str, object]:
    """What the N units are, for the privacy report (public facts only)."""
    return {
        "source": f"{SEQIO_PREFIX}{self.name}",
        "module": self.module,
        "split": self.split,
        "num_examples": self.num_examples,
        "tasks": dict(zip([t.name for t in self.tasks], self.task_sizes)),
        "rates": self.rates,
        "mixing": ("examples_proportional: every example of every task is sampled at the same rate; the "
                   "declared rates are recorded, not applied") if self.is_mixture else "single_task",
        "privacy_unit": self.privacy_unit,
        "privacy_unit_basis": DOCUMENT_UNIT_BASIS if self.one_example_per_document else EXAMPLE_UNIT_BASIS,
    }

  def describe(self) -> Dict[str, object]:
    return {
        "corpus": f"{SEQIO_PREFIX}{self.name}",
        "tasks": [t.name for t in self.tasks],
        "task_sizes": dict(zip([t.name for t in self.tasks], self.task_sizes)),
        "split": self.split,
        "vocab_path": self.vocab_path,
        "vocab_sha256": file_sha256(self.vocab_path),
        "objective": "seqio",
        "feature_lengths": self.feature_lengths,
        "privacy_unit": self.privacy_unit,
        "num_examples": self.num_examples,
        "population": self.population(),
    }


def _tasks_of(name: str, module) -> list:
  found = get_mixture_or_task(name, module)
  return list(found.tasks) if isinstance(found, _seqio().Mixture) else [found]


def make_seqio_source(mixture_or_task_name: str, split: str = "train",
                      feature_lengths: Optional[Mapping[str, int]] = None,
                      module: Union[None, str, Sequence[str]] = None, one_example_per_document: bool = False,
                      dp=None, seed: int = 0, use_cached: bool = False, max_examples: Optional[int] = None,
                      required: bool = True) -> Optional[SeqioSource]:
  """The Gin-facing factory of `SeqioSource` (configs/runs/seqio.gin binds it).

  `required=False` (the validation data): None when no task of it has `split`.
  """
  if not required and not any(split in task.splits for task in _tasks_of(mixture_or_task_name, module)):
    return None
  return SeqioSource(mixture_or_task_name, split, feature_lengths or {"inputs": 512, "targets": 114}, module=module,
                     one_example_per_document=one_example_per_document, dp=dp, seed=seed, use_cached=use_cached,
                     max_examples=max_examples)
