"""A registered seqio Task or Mixture as training data: T5X's data, trained on privately.

A T5X user names a seqio Task or Mixture (`MIXTURE_OR_TASK_NAME`), registered by a module that
is imported first (`MIXTURE_OR_TASK_MODULE`), as `t5x/train.py` does. One split of it is read
once, with `get_dataset(sequence_length, split=..., shuffle=False)`: the Task's own preprocessors
run (t5's span corruption included) with a fixed seed, nothing is packed, and the examples are
kept in memory as padded arrays (`SeqioSource`) or written to an on-disk example store
(`seqio_store.SeqioStoreSource`; see the end of this docstring). A run then draws them as it draws from any
`train.main.ExampleSource`: shuffled batches in a non-private run, Poisson sampling over the N
examples in a DP run (untruncated, in microbatches), never the Task's own shuffled batches.
N is counted by that one read, once per process.

Privacy unit: one seqio example (`example`). A document may feed several examples (a long text
cut into pieces; t5's span corruption also joins documents before cutting), so the guarantee is
per example, not per document. A user who knows that the Task yields at most one example per
document declares it (`one_example_per_document=True`, Gin `ONE_EXAMPLE_PER_DOCUMENT`): the unit
is then `document`, and every report says it rests on the user's declaration (not checked here).
At the `example` unit, a document-level DP vocabulary composes into training's guarantee only by
group privacy over the documents one example can change: the user declares that bound
(`documents_per_example=k`, Gin `DOCUMENTS_PER_EXAMPLE`; the group is then 2k documents). Without
it the number is unbounded (span corruption joins documents), and such a vocabulary counts as not
private (`population()["documents_per_example"]` is None).

A Mixture: its tasks' examples together are the population, every example sampled at the same
rate (examples-proportional mixing, as `glue_tasks.GlueSource` mixes; the Mixture's own rates are
recorded, not applied: one rate for all keeps the sampling one Poisson draw). In a DP run every rate
must be a number fixed in advance: a rate computed by a function (e.g. from the number of
examples) is a choice made from the data, refused in one line. A rate given as a number must be
finite and >= 0 (DP or not). A task of rate 0 (directly, or through sub-mixtures of rate 0) is one
seqio never samples: its examples are not read and not in the population
(`population()["excluded_tasks"]`); a Mixture whose every rate is 0 is refused. The report names
each task, its examples and its declared rate.

Every task (of a Mixture too, sub-mixtures included) must tokenize 'inputs' and 'targets' with the
vocabulary training uses (the same file content): the ids then mean the pieces the model learns,
and that one vocabulary is the one whose privacy the report composes. Another one is refused in
one line naming the task and both files.

An error raised by the user's code (the module registering the Tasks, a Task's data source or
preprocessors) is a one-line ConfigError or DataError naming the module or the task and split.

Unlike a token store (`source.CorpusSource`), whose span-corruption noise is drawn afresh at
every draw, an example here keeps the noise of the one read: the same seed gives the same
examples at the same indices, so a resumed run sees the data it started with.

The one read (`read_split`) goes source shard by source shard: the tasks in order, each task's
shards in seqio's order (`list_shards`: one per file of a file or TFDS source, one for a function
source), each read with `shard_info` and a seed of its own (`shard_seed`; a one-shard source is
read whole with `seed`, as `get_dataset` reads it). That order is the index order of every
storage: in memory (`SeqioSource`, 4 bytes a token of the padded lengths) or on disk
(`seqio_store.SeqioStoreSource`, the example store, built locally or on Apache Beam with one
source shard per worker), so all of them hold the same example at the same index.
`make_seqio_source(storage="auto")` holds in memory only a split known to be small
(`choose_storage`), any other through the store.

seqio and TensorFlow are imported only when a source is built or a Task looked up, so the rest
of the package runs without them.
"""
import dataclasses
import logging
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from private_t5 import checks
from private_t5.data import source as source_lib
from private_t5.data.seqio_lookup import (
    check_rates,
    check_vocabularies,
    fixed_rates,
    get_mixture_or_task,
    label,
    seqio,
    tasks_of,
    zero_rate_tasks,
)
from private_t5.data.seqio_read import declared_examples, read_split
from private_t5.errors import ConfigError, DataError
from private_t5.io import file_sha256

SEQIO_PREFIX = "seqio:"
EXAMPLE_UNIT_BASIS = ("one seqio example: a document may feed several examples (cut into pieces, or "
                      "joined with other documents), so the guarantee is per example")
DOCUMENT_UNIT_BASIS = ("declared by the user (one_example_per_document=True): the Task yields at most one "
                       "example per document; private_t5 does not check this declaration")
DOCUMENTS_PER_EXAMPLE_BASIS = ("declared by the user (documents_per_example={k}): one example holds pieces of "
                               "at most {k} document(s); private_t5 does not check this declaration")
UNBOUNDED_DOCUMENTS_BASIS = ("not declared (documents_per_example=None): an example may join pieces of any "
                             "number of documents, so a document-level DP release (e.g. the vocabulary) cannot "
                             "be composed by group privacy")
ZERO_RATE = "rate 0"  # why a task of a Mixture is left out (population()["excluded_tasks"])
STORAGES = ("auto", "memory", "store")
# "auto" holds a split in memory only when it is known to have at most this many examples: seqio's
# own bound for caching a dataset in memory (`dataset_providers._MAX_EXAMPLES_TO_MEM_CACHE`).
AUTO_MEMORY_EXAMPLES = 10_000

logger = logging.getLogger(__name__)


def choose_storage(storage: str, tasks: Sequence, split: str, max_examples: Optional[int]) -> str:
  """"memory" or "store" for `storage` ("auto", "memory" or "store"; ConfigError otherwise).

  "auto" reads into memory only a split known to be small: at most AUTO_MEMORY_EXAMPLES examples
  in all, by `max_examples` per task or by the sizes the sources declare (`declared_examples`);
  anything else (an undeclared size, a large Task) goes through the on-disk store.
  """
  if storage not in STORAGES:
    raise ConfigError(f"storage must be one of {', '.join(map(repr, STORAGES))}, got {storage!r}")
  if storage != "auto":
    return storage
  if max_examples is not None and max_examples * len(tasks) <= AUTO_MEMORY_EXAMPLES:
    return "memory"
  declared = declared_examples(tasks, split)
  return "memory" if declared is not None and declared <= AUTO_MEMORY_EXAMPLES else "store"


# --- the Task or Mixture a run trains on --------------------------------------------------------

@dataclasses.dataclass
class Resolved:
  """A registered Task or Mixture, checked: the tasks whose examples are read (rate 0 left out),
  their rates, the vocabulary they all tokenize with."""
  name: str
  is_mixture: bool
  tasks: List
  excluded_tasks: Dict[str, str]
  rates: Optional[Dict[str, float]]
  vocab_path: str
  vocab_size: int


def resolve(mixture_or_task_name: str, module: Union[None, str, Sequence[str]] = None, dp=None) -> Resolved:
  """Looks up and checks a Task or Mixture (see the module docstring): rates that are numbers
  finite and >= 0, fixed in advance in a DP run (`dp` set); rate-0 tasks left out (one warning);
  one vocabulary for every task. One-line ConfigError otherwise."""
  found = get_mixture_or_task(mixture_or_task_name, module)
  is_mixture = isinstance(found, seqio.Mixture)
  all_tasks = tasks_of(found)
  rates = None  # a Task's; or a non-private run's Mixture with rates computed from the data
  excluded: Dict[str, str] = {}
  if is_mixture:
    check_rates(found)  # numbers: finite and >= 0, DP or not
    try:
      rates = fixed_rates(found)
    except ConfigError:
      if dp is not None:
        raise
    excluded = {name: ZERO_RATE for name in sorted(zero_rate_tasks(found))}
    if excluded:
      logger.warning("seqio Mixture %r: %s left out of the examples read (rate 0: seqio never samples it)",
                     mixture_or_task_name, ", ".join(map(repr, excluded)))
    if rates is not None:
      rates = {name: rate for name, rate in rates.items() if name not in excluded}
  tasks = [t for t in all_tasks if t.name not in excluded]
  # Every task, the excluded ones too, tokenizes with the one vocabulary training uses.
  vocab_path = check_vocabularies(all_tasks, None, label(found))
  return Resolved(mixture_or_task_name, is_mixture, tasks, excluded, rates, vocab_path,
                  int(tasks[0].output_features["targets"].vocabulary.vocab_size))


def check_feature_lengths(feature_lengths: Mapping[str, int]) -> Dict[str, int]:
  """{"inputs": Li, "targets": Lt}; ConfigError unless both are integers >= 2."""
  if feature_lengths is not None and not isinstance(feature_lengths, Mapping):
    raise ConfigError("feature_lengths must be a dict such as {'inputs': 512, 'targets': 114}, got "
                      f"{feature_lengths!r}")
  lengths = dict(feature_lengths or {})
  for key in ("inputs", "targets"):
    if not isinstance(lengths.get(key), int) or isinstance(lengths.get(key), bool) or lengths[key] < 2:
      raise ConfigError(f"feature_lengths[{key!r}] must be an integer >= 2, got {lengths.get(key)!r}")
  return {"inputs": lengths["inputs"], "targets": lengths["targets"]}


class SeqioExamples:
  """What every storage of a seqio split shares: the checked Task or Mixture, the privacy unit,
  the population and the description. Subclasses hold the examples: they read them, count them
  (`_count_examples`: `task_sizes`, `num_examples`), fill a batch's rows (`_fill_rows`, for
  `get_batch`) and add their own entries to `describe` (`_storage`).

  Args:
    mixture_or_task_name: registered Task or Mixture name.
    split: the split of every task ("train", "validation", ...).
    feature_lengths: {"inputs": Li, "targets": Lt}: the sequence length given to the Task
      (its examples are trimmed to it) and the padded width of every batch.
    module: module(s) imported first, which register the Task (MIXTURE_OR_TASK_MODULE).
    one_example_per_document: the user declares that the Task yields at most one example per
      document: privacy unit `document` instead of `example` (see the module docstring).
    documents_per_example: the user declares that one example holds pieces of at most this many
      documents (None: not bounded); used to compose a document-level vocabulary with
      example-level training (see the module docstring).
    dp: the run's DPConfig or None; only whether it is set matters: a DP run refuses a Mixture
      whose rates are not fixed numbers.
  """

  def __init__(self, mixture_or_task_name: str, split: str, feature_lengths: Mapping[str, int],
               module: Union[None, str, Sequence[str]] = None, one_example_per_document: bool = False,
               dp=None, documents_per_example: Optional[int] = None):
    self._lengths = check_feature_lengths(feature_lengths)
    self.name = mixture_or_task_name
    self.module = module
    self.split = split
    self.one_example_per_document = checks.boolean(one_example_per_document, "one_example_per_document")
    self.documents_per_example = checks.integer(documents_per_example, "documents_per_example", minimum=1,
                                                optional=True)
    self.resolved = resolve(mixture_or_task_name, module, dp)
    self.is_mixture = self.resolved.is_mixture
    self.rates = self.resolved.rates
    # Tasks of the Mixture that seqio never samples (rate 0): not read, not in the population.
    self.excluded_tasks: Dict[str, str] = self.resolved.excluded_tasks
    self.tasks: List = self.resolved.tasks
    self.vocab_path = self.resolved.vocab_path
    self._vocab_size = self.resolved.vocab_size
    self.task_sizes: List[int] = []  # the examples of each task, once read (`_count_examples`)

  @property
  def num_examples(self) -> int:
    """N: the examples of the split (of every task of a Mixture)."""
    return int(sum(self.task_sizes))

  def _count_examples(self, sizes: Mapping[str, int]) -> None:
    """Records the examples read of each task (`sizes`: {task name: count}); DataError when none."""
    self.task_sizes = [int(sizes.get(t.name, 0)) for t in self.tasks]
    if not self.num_examples:
      raise DataError(f"seqio {self.name!r} split {self.split!r} has no examples")

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

  def get_batch(self, indices: Sequence[int], seed: int, batch_size: int) -> Dict[str, np.ndarray]:
    """The trainer's batch of `indices`, padded to `batch_size` rows (`seed` unused: each example
    keeps the noise of the Task's one read)."""
    del seed
    indices = source_lib.batch_indices(indices, batch_size, self.num_examples)
    enc = np.zeros((batch_size, self._lengths["inputs"]), np.int32)
    tgt = np.zeros((batch_size, self._lengths["targets"]), np.int32)
    self._fill_rows(indices, enc, tgt)
    return source_lib.assemble_batch(enc, tgt, indices)

  def _fill_rows(self, indices: np.ndarray, enc: np.ndarray, tgt: np.ndarray) -> None:
    """Writes examples `indices` (zero-padded) into the first rows of `enc` and `tgt`."""
    raise NotImplementedError

  def population(self) -> Dict[str, object]:
    """What the N units are, for the privacy report (public facts only)."""
    return {
        "source": f"{SEQIO_PREFIX}{self.name}",
        "module": self.module,
        "split": self.split,
        "num_examples": self.num_examples,
        "tasks": dict(zip([t.name for t in self.tasks], self.task_sizes)),
        "rates": self.rates,
        **({"excluded_tasks": dict(self.excluded_tasks)} if self.is_mixture else {}),
        "mixing": ("examples_proportional: every example of every task is sampled at the same rate; the "
                   "declared rates are recorded, not applied") if self.is_mixture else "single_task",
        "privacy_unit": self.privacy_unit,
        "privacy_unit_basis": DOCUMENT_UNIT_BASIS if self.one_example_per_document else EXAMPLE_UNIT_BASIS,
        **({} if self.one_example_per_document else self._documents_per_example()),
    }

  def _documents_per_example(self) -> Dict[str, object]:
    """The bound on documents per example, for a report at the `example` unit (`population`)."""
    k = self.documents_per_example
    return {"documents_per_example": k,
            "documents_per_example_basis": (UNBOUNDED_DOCUMENTS_BASIS if k is None
                                            else DOCUMENTS_PER_EXAMPLE_BASIS.format(k=k))}

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
        **self._data_files(),
        **self._storage(),
    }

  def _storage(self) -> Dict[str, object]:
    """Where the examples are held, for `describe` (not part of a checkpoint's fingerprint)."""
    raise NotImplementedError

  def _data_files(self) -> Dict[str, object]:
    """The files the tasks read ("data_files"), and why some are not known ("data_files_unknown"):
    what a vocabulary declared public is checked against (`dp.public_vocabulary`)."""
    files, unknown = [], []
    for task in self.tasks:
      source = task.source
      if isinstance(source, seqio.FileDataSource):
        files += [f for f in source.list_shards(self.split) if isinstance(f, str)]
      else:
        unknown.append(f"{task.name!r} ({type(source).__name__})")
    return {"data_files": sorted(set(files)),
            "data_files_unknown": (f"the files of seqio task(s) {', '.join(unknown)} are not known" if unknown
                                   else None)}


class SeqioSource(SeqioExamples):
  """One split of a seqio Task or Mixture as a `train.main.ExampleSource`, read once into memory
  (4 bytes a token of the padded lengths: for small splits; `seqio_store.SeqioStoreSource` holds
  any size on disk, with the same examples at the same indices).

  Args: those of `SeqioExamples`, and
    seed: seed of the Task's preprocessors (span-corruption noise) for the one read.
    use_cached: read the Task's offline cache (seqio's `use_cached`).
    max_examples: read at most this many examples of each task (tests, quick runs).
  """

  def __init__(self, mixture_or_task_name: str, split: str, feature_lengths: Mapping[str, int],
               module: Union[None, str, Sequence[str]] = None, one_example_per_document: bool = False,
               dp=None, seed: int = 0, use_cached: bool = False, max_examples: Optional[int] = None,
               documents_per_example: Optional[int] = None):
    super().__init__(mixture_or_task_name, split, feature_lengths, module, one_example_per_document, dp,
                     documents_per_example)
    li, lt = self._lengths["inputs"], self._lengths["targets"]
    enc, tgt, sizes = [np.zeros((0, li), np.int32)], [np.zeros((0, lt), np.int32)], {}
    for task, _, batches in read_split(self.tasks, split, self._lengths, seed, use_cached, max_examples):
      for batch in batches:
        enc.append(batch["inputs"].astype(np.int32))
        tgt.append(batch["targets"].astype(np.int32))
      sizes[task.name] = sizes.get(task.name, 0) + batches.count
    self._enc = np.concatenate(enc)
    self._tgt = np.concatenate(tgt)
    self._count_examples(sizes)

  def examples(self):
    """(inputs, targets): the padded int32 arrays of all N examples, in index order."""
    return self._enc, self._tgt

  def _fill_rows(self, indices: np.ndarray, enc: np.ndarray, tgt: np.ndarray) -> None:
    enc[:len(indices)] = self._enc[indices]
    tgt[:len(indices)] = self._tgt[indices]

  def _storage(self) -> Dict[str, object]:
    return {"storage": "memory"}
