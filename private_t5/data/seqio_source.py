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
import hashlib
import logging
import re
import threading
from typing import Dict, List, Mapping, Optional, Sequence, Set, Union

import numpy as np

from private_t5 import checks, quiet_tf, user_modules
from private_t5.data import source as source_lib
from private_t5.errors import ConfigError, DataError, PrivateT5Error
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
READ_BATCH = 1024  # examples TensorFlow pads per batch while a split is read
# seqio hands its preprocessors' seeds out from one counter per process (`utils.map_seed_manager`)
# while a dataset is built: two threads building at once (Beam's multi_threading workers) would
# draw each other's seeds. Built one at a time; read concurrently.
_GET_DATASET = threading.Lock()

logger = logging.getLogger(__name__)


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
  # The one importer of the user's modules (TASK_MODULE too), with TensorFlow's errors put in one line.
  user_modules.import_modules(module, "MIXTURE_OR_TASK_MODULE",
                              describe=lambda e: _first_line(e) if isinstance(e, ImportError) else _error_line(e))


def _first_line(e: BaseException) -> str:
  """The first non-empty line of `e`'s message, without TensorFlow's `{{function_node ...}}` prefix;
  of an error TensorFlow raised while tracing a function ("in user code:", then a stack), its last
  line: the error itself; of TensorFlow's wrapper of a Python error raised in a function it runs on
  each row, that error ("ValueError: ...")."""
  text = re.sub(r"^\s*\{\{[^}]*\}\}\s*", "", str(getattr(e, "message", None) or e))
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  line = (lines[-1] if lines[0] == "in user code:" else lines[0]) if lines else ""
  inner = re.match(r"Error in user-defined function passed to \S+ transformation with iterator: \S+: (\w+: .*)", line)
  if inner:
    line = inner.group(1)
  return line if len(line) <= 400 else line[:397] + "..."


def _error_line(e: BaseException) -> str:
  """`type: first line of message` of an error raised by the user's code, on one line (a
  SyntaxError with its file and line; a Python error TensorFlow wraps: that error's)."""
  if isinstance(e, SyntaxError):
    return f"{type(e).__name__}: {e.msg} ({e.filename}, line {e.lineno})"
  line = _first_line(e)
  if not line:
    return type(e).__name__
  if line.startswith(f"{type(e).__name__}: ") or (type(e).__module__.startswith("tensorflow")
                                                  and re.match(r"\w+(Error|Exception): ", line)):
    return line
  return f"{type(e).__name__}: {line}"


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


def _submixture(mixture, name: str):
  """The sub-mixture `mixture` mixes under `name`, None when `name` is one of its Tasks."""
  seqio = _seqio()
  sub = getattr(mixture, "_task_map", {}).get(name)
  if isinstance(sub, seqio.Mixture):
    return sub
  if sub is None and name in seqio.MixtureRegistry.names():
    return seqio.get_mixture_or_task(name)
  return None


def check_rates(mixture) -> None:
  """ConfigError (one line) when a rate of `mixture` or of a sub-mixture that is a number is not a
  finite number >= 0, or when every rate of one of them is 0 (seqio samples none of its tasks).
  Rates computed by a function are left to `fixed_rates`."""
  rates = mixture.rate_per_task_name
  for name, rate in rates.items():
    if not callable(rate):
      checks.number(rate, f"seqio Mixture {mixture.name!r}: the rate of {name!r}", minimum=0)
    sub = _submixture(mixture, name)
    if sub is not None:
      check_rates(sub)
  if rates and all(not callable(r) and float(r) == 0 for r in rates.values()):
    raise ConfigError(f"seqio Mixture {mixture.name!r}: every rate is 0 ({', '.join(map(repr, rates))}), so "
                      "seqio samples none of its tasks; give at least one task a rate > 0")


def zero_rate_tasks(mixture) -> Set[str]:
  """Names of the tasks of `mixture` that seqio never samples: every way the mixture reaches them
  (directly or through sub-mixtures) has a rate that is the number 0. A rate computed by a function
  is not evaluated (the task counts as sampled). Call `check_rates` first."""

  def sampled(mix) -> Set[str]:
    names = set()
    for name, rate in mix.rate_per_task_name.items():
      if not callable(rate) and float(rate) == 0:
        continue
      sub = _submixture(mix, name)
      names |= sampled(sub) if sub is not None else {name}
    return names

  return {task.name for task in mixture.tasks} - sampled(mixture)


def fixed_rates(mixture) -> Dict[str, float]:
  """Task name -> mixing rate of each task of `mixture`; ConfigError (one line) when a rate of it or
  of a sub-mixture is a function (computed from the data) rather than a number fixed in advance,
  or a number that is not finite and >= 0 (`check_rates`)."""
  check_rates(mixture)
  for name, rate in mixture.rate_per_task_name.items():
    if callable(rate):
      raise ConfigError(
          f"seqio Mixture {mixture.name!r}: the rate of {name!r} is computed by "
          f"{getattr(rate, '__name__', type(rate).__name__)} (from the data); a DP run needs every rate fixed "
          f"in advance as a number, e.g. ({name!r}, 1.0)")
    sub = _submixture(mixture, name)
    if sub is not None:
      fixed_rates(sub)
  return {task.name: float(mixture.get_rate(task)) for task in mixture.tasks}


def _sentencepiece_file(task, feature: str = "targets") -> Optional[str]:
  """The SentencePiece model file of the Task's `feature` vocabulary, None if it has none."""
  found = task.output_features.get(feature)
  return getattr(getattr(found, "vocabulary", None), "sentencepiece_model_file", None)


def check_vocabularies(tasks: Sequence, vocab_path: Optional[str] = None, what: str = "") -> str:
  """The vocabulary file a run on `tasks` trains with: `vocab_path`, else the first task's.

  Every task must tokenize 'inputs' and 'targets' with that vocabulary (the same file content,
  100 sentinels): the ids of every example then mean the pieces the model is trained on, and the
  one vocabulary whose privacy is composed is the one that made them. ConfigError (one line)
  naming the task and both files if not. `what` names the Task or Mixture in the messages.
  """
  what = what or f"seqio Task {tasks[0].name!r}"
  digests: Dict[str, str] = {}

  def digest(path: str) -> str:
    if path not in digests:
      digests[path] = file_sha256(path)
    return digests[path]

  def sentencepiece_file(task, feature: str) -> str:
    own = _sentencepiece_file(task, feature)
    if own is None:
      raise ConfigError(f"seqio Task {task.name!r} has no SentencePiece vocabulary on its {feature!r} feature; "
                        "private_t5 trains on SentencePiece vocabularies (T5 layout)")
    extra_ids = getattr(task.output_features[feature].vocabulary, "extra_ids", None)
    if extra_ids not in (None, 100):
      raise ConfigError(f"seqio Task {task.name!r}: its {feature!r} vocabulary has {extra_ids} extra ids; "
                        "private_t5 vocabularies have 100 sentinels (T5's layout)")
    return own

  reference = vocab_path
  for task in tasks:
    targets = sentencepiece_file(task, "targets")
    if "inputs" in task.output_features:  # a Task without 'inputs' is refused when its examples are read
      inputs = sentencepiece_file(task, "inputs")
      if digest(inputs) != digest(targets):
        raise ConfigError(f"seqio Task {task.name!r} tokenizes 'inputs' with {inputs} but 'targets' with {targets}; "
                          "both features must use the same SentencePiece vocabulary (the one training uses)")
    if reference is None:
      reference = targets
    if digest(targets) == digest(reference):
      continue
    if vocab_path is not None:
      raise ConfigError(f"VOCAB_PATH {vocab_path} is not the vocabulary seqio Task {task.name!r} tokenizes with "
                        f"({targets}); leave VOCAB_PATH unset to use the Task's")
    raise ConfigError(f"{what}: Task {task.name!r} tokenizes with {targets}, not with {reference}, the vocabulary "
                      f"training uses (that of Task {tasks[0].name!r}); every task must use the same SentencePiece "
                      "vocabulary")
  return reference


def seqio_vocab_path(mixture_or_task_name: str, module: Union[None, str, Sequence[str]] = None,
                     vocab_path: Optional[str] = None) -> str:
  """The vocabulary of a run on a seqio Task or Mixture: `vocab_path`, else the Task's own.

  The Task tokenizes its examples with the vocabulary of its output features: that is the
  vocabulary used (and recorded with the checkpoints). A `vocab_path` given must be the same
  file (by content), as the ids would otherwise mean other pieces; so must the 'inputs' and
  'targets' vocabularies of every task of a Mixture, sub-mixtures included (`check_vocabularies`).
  """
  found = get_mixture_or_task(mixture_or_task_name, module)
  return check_vocabularies(_tasks(found), vocab_path, _label(found))


# --- reading a split, source shard by source shard (the one read of every storage) -------------

@dataclasses.dataclass(frozen=True)
class Shard:
  """Source shard `index` of `num_shards` of one task's split (`name`: seqio's name for it)."""
  task: str
  index: int
  num_shards: int
  name: str


def shard_seed(seed: int, task_name: str, index: int, num_shards: int) -> int:
  """The preprocessors' seed of source shard `index` of `num_shards` of a task.

  `seed` itself for a source of one shard (a function source: the read of the whole split, as
  before sharding). Shards of a multi-shard source get seeds derived from (seed, task, shard),
  as seqio's `cache_tasks_main` does: seqio draws the noise of the i-th example of a dataset from
  its seed, so shards read with one seed would carry the same span masks at the same positions.
  """
  if num_shards == 1:
    return seed
  digest = hashlib.sha256(f"{task_name}/shard{index}/seed{seed}".encode()).digest()
  return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def check_task(task, split: str) -> None:
  """DataError when `task` has no `split`; ConfigError when it lacks 'inputs' or 'targets'."""
  if split not in task.splits:
    raise DataError(f"seqio Task {task.name!r} has no split {split!r} (splits: {sorted(task.splits)})")
  missing = [k for k in ("inputs", "targets") if k not in task.output_features]
  if missing:
    raise ConfigError(f"seqio Task {task.name!r} has no {missing} output feature(s); T5 (encoder-decoder) "
                      f"trains on 'inputs' and 'targets' (features: {sorted(task.output_features)})")


def task_shards(task, split: str, use_cached: bool = False) -> List[Shard]:
  """The source shards of one task's split in seqio's order (`list_shards`): one per file of a
  file or TFDS source, one (the split) for a function source."""
  check_task(task, split)
  try:  # the user's source lists its files here
    source = task._get_cached_source(split) if use_cached and task.supports_caching else task.source  # pylint: disable=protected-access
    names = [str(name) for name in source.list_shards(split)] or [split]
  except PrivateT5Error:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"seqio Task {task.name!r} split {split!r}: listing its source shards failed: "
                    f"{_error_line(e)}") from e
  return [Shard(task.name, k, len(names), name) for k, name in enumerate(names)]


def read_shard(task, shard: Shard, split: str, lengths: Mapping[str, int], seed: int = 0,
               use_cached: bool = False, limit: Optional[int] = None, batch_size: Optional[int] = None):
  """Yields the examples of one source shard in order, in batches of up to `batch_size` (READ_BATCH):
  {"inputs": int32[n, Li], "targets": int32[n, Lt]} zero-padded, and "inputs_length",
  "targets_length" (int32[n]), each example trimmed to the lengths. At most `limit` examples.

  `task.get_dataset(lengths, split=..., shuffle=False, seed=shard_seed(...), num_epochs=1)`, with
  `shard_info` when the source has several shards; never cached in memory by seqio. A failure of
  the Task's own code is a one-line DataError naming the task and split.
  """
  li, lt = int(lengths["inputs"]), int(lengths["targets"])
  tf = quiet_tf.import_tensorflow()

  def trimmed(ex):
    inputs, targets = ex["inputs"][:li], ex["targets"][:lt]
    return {"inputs": inputs, "targets": targets, "inputs_length": tf.size(inputs, out_type=tf.int32),
            "targets_length": tf.size(targets, out_type=tf.int32)}

  sharding = {} if shard.num_shards == 1 else {
      "shard_info": _seqio().ShardInfo(index=shard.index, num_shards=shard.num_shards)}
  try:  # the Task's own code runs here: its data source and preprocessors
    with _GET_DATASET:
      dataset = task.get_dataset(dict(lengths), split=split, shuffle=False, use_cached=use_cached, num_epochs=1,
                                 seed=shard_seed(seed, task.name, shard.index, shard.num_shards),
                                 try_in_mem_cache=False, **sharding)
    if limit is not None:
      dataset = dataset.take(limit)
    # Padded in batches by TensorFlow: 15% less CPU than one example at a time through NumPy.
    padded = {"inputs": [li], "targets": [lt], "inputs_length": [], "targets_length": []}
    yield from dataset.map(trimmed).padded_batch(batch_size or READ_BATCH, padded_shapes=padded).as_numpy_iterator()
  except PrivateT5Error:
    raise
  except Exception as e:  # pylint: disable=broad-except  # Ctrl-C (not an Exception) still stops the read
    raise DataError(f"seqio Task {task.name!r} split {split!r}: reading its examples failed (its data source or "
                    f"a preprocessor raised): {_error_line(e)}") from e


class _Counted:
  """An iterator of batches that counts the examples it has given."""

  def __init__(self, batches):
    self._batches, self.count = iter(batches), 0

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self._batches)
    self.count += len(batch["inputs"])
    return batch


def read_split(tasks: Sequence, split: str, lengths: Mapping[str, int], seed: int = 0, use_cached: bool = False,
               max_examples: Optional[int] = None):
  """Yields (task, shard, batches) for every source shard of every task, in the read order: the
  tasks in order, each task's shards in seqio's order, each shard's examples in order.

  This order is the index order of every storage (in memory, the local store, the Beam store).
  `max_examples` is per task: a task's later shards get what its earlier ones left (a shard past
  it is still yielded, with no batches). Iterate each shard's batches before the next shard.
  """
  for task in tasks:
    read = 0
    for shard in task_shards(task, split, use_cached):
      left = None if max_examples is None else max(0, max_examples - read)
      batches = _Counted(read_shard(task, shard, split, lengths, seed, use_cached, left) if left != 0 else ())
      yield task, shard, batches
      read += batches.count


def declared_examples(tasks: Sequence, split: str) -> Optional[int]:
  """The examples the tasks' sources declare for `split` (seqio's `num_input_examples`: the
  source's rows, before preprocessing); None when one of them declares none."""
  total = 0
  for task in tasks:
    try:
      n = task.source.num_input_examples(split)
    except Exception:  # pylint: disable=broad-except  # not declared, or not knowable without reading
      return None
    if n is None:
      return None
    total += int(n)
  return total


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
  seqio = _seqio()
  found = get_mixture_or_task(mixture_or_task_name, module)
  is_mixture = isinstance(found, seqio.Mixture)
  all_tasks = _tasks(found)
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
  vocab_path = check_vocabularies(all_tasks, None, _label(found))
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
  the population and the description. Subclasses hold the examples (`num_examples`,
  `task_sizes`, `get_batch`) and add their own entries to `describe` (`_storage`).

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

  task_sizes: List[int]

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

  @property
  def num_examples(self) -> int:
    """N: the examples of the split (of every task of a Mixture)."""
    return int(sum(self.task_sizes))

  def _check_not_empty(self) -> None:
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
    seqio = _seqio()
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
    self.task_sizes = [sizes.get(t.name, 0) for t in self.tasks]
    self._enc = np.concatenate(enc)
    self._tgt = np.concatenate(tgt)
    self._check_not_empty()

  def examples(self):
    """(inputs, targets): the padded int32 arrays of all N examples, in index order."""
    return self._enc, self._tgt

  def _fill_rows(self, indices: np.ndarray, enc: np.ndarray, tgt: np.ndarray) -> None:
    enc[:len(indices)] = self._enc[indices]
    tgt[:len(indices)] = self._tgt[indices]

  def _storage(self) -> Dict[str, object]:
    return {"storage": "memory"}


def _tasks(found) -> list:
  """The Tasks of a Task (itself) or of a Mixture (sub-mixtures' included)."""
  return list(found.tasks) if isinstance(found, _seqio().Mixture) else [found]


def _label(found) -> str:
  return f"seqio {'Mixture' if isinstance(found, _seqio().Mixture) else 'Task'} {found.name!r}"


def sampled_tasks(found) -> list:
  """The Tasks whose examples are read: a Mixture's without those of rate 0."""
  if not isinstance(found, _seqio().Mixture):
    return [found]
  check_rates(found)
  excluded = zero_rate_tasks(found)
  return [t for t in found.tasks if t.name not in excluded]
