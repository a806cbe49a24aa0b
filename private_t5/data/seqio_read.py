"""Reading one split of seqio Tasks, source shard by source shard: the one read of every storage.

The tasks in order, each task's shards in seqio's order (`task_shards`), each shard read with its
own seed (`shard_seed`) and padded in batches (`read_shard`); `read_split` chains them. The order is
the index order of every storage (`seqio_source.SeqioSource` in memory, `seqio_store` on disk).
"""
import dataclasses
import hashlib
import threading
from typing import List, Mapping, Optional, Sequence

from private_t5 import quiet_tf
from private_t5.data.seqio_lookup import error_line, seqio
from private_t5.errors import ConfigError, DataError, PrivateT5Error

READ_BATCH = 1024  # examples TensorFlow pads per batch while a split is read
# seqio hands its preprocessors' seeds out from one counter per process (`utils.map_seed_manager`)
# while a dataset is built: two threads building at once (Beam's multi_threading workers) would
# draw each other's seeds. Built one at a time; read concurrently.
_GET_DATASET = threading.Lock()


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
                    f"{error_line(e)}") from e
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
      "shard_info": seqio.ShardInfo(index=shard.index, num_shards=shard.num_shards)}
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
                    f"a preprocessor raised): {error_line(e)}") from e


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

