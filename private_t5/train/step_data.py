"""Each step's batch, built on the host and placed on the devices, ahead of the step that needs it.

The batch of step t is a pure function of (the run's seeds, t): its sample is
`mechanism.indices_for_step(t)` (the sampler's seed), its objective noise `seeds.data_seed(t)`,
its layout `layout.rows_for_step(len(sample))`. So a batch can be built at any time, by any
thread, and prefetching changes nothing the run computes: a resumed or restarted run reads the
same batches (DP rule "sampling matches accounting": the sample is drawn exactly as accounted,
whoever draws it).

`build_step_batch(t)` makes a `StepBatch`: this process's rows of the step (`local_batch`: the
real rows spread round-robin over the `data` axis, each row carrying its position in the step's
sample, `dp.clipping.ROW_ID`), as one batch (a fixed or truncated batch) or as k microbatches of
m rows stacked to K = `trainer.microbatch_bucket(k)` for the one-dispatch step
(`Trainer.train_step_stacked`), already placed on the devices. `Prefetcher` builds the batches
of the next `depth` steps in worker threads (as seqio's and grain's prefetching do) while the
device runs the current one, and the main thread only dispatches. The per-example work of an
objective holds Python's GIL, so one thread is the default: more add nothing
(docs/performance.md, "The training loop"). A worker that fails stops the run with one line
(`errors.DataError`, naming the step), never a hang.
"""
import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from scipy import stats

from private_t5.dp import clipping
from private_t5.errors import DataError, PrivateT5Error
from private_t5.train import partitioning
from private_t5.train.trainer import microbatch_bucket

DEFAULT_PREFETCH_DEPTH = 2
DEFAULT_DATA_WORKERS = 1


def sample_positions(num_sampled: int, batch_size: int, data_size: int, rows: range) -> np.ndarray:
  """int32 position in the step's sample of each of `rows` of the spread batch (`local_batch`).

  Real rows: the index into the step's `indices` (position p of the `data` axis holds p, p + D,
  ...); padding rows: num_sampled, num_sampled + 1, ... in row order. A row's dropout key folds
  in this position (`dp.clipping.ROW_ID`), as in a microbatched step where row r of the sample
  is row r of the batch, so both layouts give every example the same key.
  """
  per = batch_size // data_size
  positions = np.empty((batch_size,), np.int32)
  next_padding = num_sampled
  for p, block in enumerate(partitioning.spread_over_data(np.arange(num_sampled), data_size)):
    real = min(len(block), per)
    positions[p * per:p * per + real] = block[:real]
    positions[p * per + real:(p + 1) * per] = np.arange(next_padding, next_padding + per - real)
    next_padding += per - real
  return positions[rows.start:rows.stop]


def local_batch(source, indices: np.ndarray, seed: int, batch_size: int, data_size: int,
                rows: range, row_offset: int = 0) -> Dict[str, np.ndarray]:
  """This process's `rows` of the global batch of `indices`, real rows spread over the data axis.

  Position p of the `data` axis holds indices p, p + D, p + 2D, ... then padding
  (`partitioning.spread_over_data`); only the examples of this process's positions are read.
  The `dp.clipping.ROW_ID` column holds each row's position in the step's sample
  (`sample_positions`, plus `row_offset` when `indices` are the sample's rows from
  `row_offset` on: one microbatch of it), so the dropout keys do not depend on the layout.
  """
  per = batch_size // data_size
  blocks = partitioning.spread_over_data(indices, data_size)
  parts = [source.get_batch(blocks[p], seed, per) for p in range(rows.start // per, rows.stop // per)]
  batch = parts[0] if len(parts) == 1 else {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
  batch[clipping.ROW_ID] = row_offset + sample_positions(len(indices), batch_size, data_size, rows)
  return batch


@dataclasses.dataclass
class StepBatch:
  """One step's data, ready for the trainer.

  Attributes:
    step: the step t it belongs to.
    num_sampled: examples in the step's sample (its real rows).
    rows: rows the step computes (the sample padded to whole microbatches, or the fixed batch).
    count: microbatches computed (None: one fused batch, `Trainer.train_step`).
    host: this process's rows of each microbatch (or of the one batch), host arrays, for the
      accuracy of the logged steps.
    placed: the device arrays the compiled step reads (`Trainer.place_batch` / `place_stacked`).
    shape: the compiled shape it runs: ("step", rows) or ("microbatches", K, m).
  """
  step: int
  num_sampled: int
  rows: int
  count: Optional[int]
  host: List[Dict[str, np.ndarray]]
  placed: Dict[str, Any]
  shape: Tuple


def stack_base(microbatch_size: int, expected_rows: float, variable: bool) -> int:
  """The microbatches a step is stacked to (`trainer.microbatch_bucket`'s base): the fixed
  batch's, or for a Poisson sample of `expected_rows` expected examples enough for all but a
  1e-9 fraction of the steps (a public number: it depends on q·N only). The padding
  microbatches cost a host buffer and a transfer, never compute (the step's device loop stops
  at the real ones), and the run compiles one shape."""
  if not variable:
    return max(-(-int(expected_rows) // microbatch_size), 1)
  rows = int(stats.poisson.isf(1e-9, max(float(expected_rows), 1e-9)))
  return max(-(-rows // microbatch_size), 1)


class StepBatchBuilder:
  """`builder(t)` -> the `StepBatch` of step t (a pure function of the seeds and t; thread-safe)."""

  def __init__(self, *, privacy, layout, source, seeds, trainer):
    self._privacy, self._layout, self._source, self._seeds, self._trainer = privacy, layout, source, seeds, trainer
    self._data_size = trainer.mesh.shape[partitioning.DATA_AXIS]
    self._sampler_lock = threading.Lock()  # a sampler may cache (a shuffled epoch's permutation)
    if layout.microbatch_size is not None:
      expected = privacy.sampler.expected_batch_size if layout.variable_rows else layout.batch_rows
      self._base = stack_base(layout.microbatch_size, expected, layout.variable_rows)

  def __call__(self, step: int) -> StepBatch:
    with self._sampler_lock:
      indices = self._privacy.indices_for_step(step)
    layout, trainer, source = self._layout, self._trainer, self._source
    step_rows = layout.rows_for_step(len(indices))
    seed = self._seeds.data_seed(step)
    m = layout.microbatch_size
    if m is None:  # one batch, rows spread over the data axis; each process reads its own
      host = [local_batch(source, indices, seed, step_rows, self._data_size, range(*trainer.local_rows(step_rows)))]
      return StepBatch(step, len(indices), step_rows, None, host, trainer.place_batch(host[0]), ("step", step_rows))
    # Consecutive global microbatches of the sample, each spread over the data axis.
    micro_rows = range(*trainer.local_rows(m))
    host = [local_batch(source, indices[start:start + m], seed, m, self._data_size, micro_rows, row_offset=start)
            for start in range(0, step_rows, m)]
    count = len(host)
    stacked = host or [local_batch(source, indices[:0], seed, m, self._data_size, micro_rows)]  # (never computed)
    bucket = microbatch_bucket(count, self._base)
    return StepBatch(step, len(indices), step_rows, count, host, self._trainer.place_stacked(stacked, bucket),
                     ("microbatches", bucket, m))


class Prefetcher:
  """The `StepBatch`es of steps [start, stop), built `depth` steps ahead by `workers` threads.

  `get(t)` returns step t's batch (built in line when it was not asked for ahead) and asks for
  step t + depth. `depth=0` builds every batch in line, in the caller's thread. A worker's error
  is raised by `get` of its step: a `PrivateT5Error` as it is, anything else as one DataError line
  naming the step. `close()` drops what is still queued (always call it: `with` does).
  """

  def __init__(self, build: Callable[[int], StepBatch], start: int, stop: int,
               depth: int = DEFAULT_PREFETCH_DEPTH, workers: int = DEFAULT_DATA_WORKERS):
    self._build, self._stop, self._depth = build, int(stop), int(depth)
    self._futures: Dict[int, concurrent.futures.Future] = {}
    self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=max(int(workers), 1),
                                                        thread_name_prefix="private_t5-data")
                  if self._depth > 0 else None)
    for step in range(int(start), min(int(start) + self._depth, self._stop)):
      self._submit(step)

  def _submit(self, step: int) -> None:
    if self._pool is not None and step < self._stop and step not in self._futures:
      self._futures[step] = self._pool.submit(self._build, step)

  def get(self, step: int) -> StepBatch:
    future = self._futures.pop(step, None)
    self._submit(step + self._depth)
    try:
      return future.result() if future is not None else self._build(step)
    except PrivateT5Error:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f"building the batch of step {step} failed: {type(e).__name__}: {e}") from e

  def close(self) -> None:
    for future in self._futures.values():
      future.cancel()
    self._futures.clear()
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
