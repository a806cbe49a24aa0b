"""Each step's batch, built on the host and placed on the devices, ahead of the step that needs it.

The batch of step t is a pure function of (the run's seeds, t): its sample is
`mechanism.indices_for_step(t)` (the sampler's seed), its objective noise `seeds.data_seed(t)`,
its layout `layout.rows_for_step(len(sample))`. So a batch can be built at any time, by any
thread, and prefetching changes nothing the run computes: a resumed or restarted run reads the
same batches (DP rule "sampling matches accounting": the sample is drawn exactly as accounted,
whoever draws it).

`StepBatchBuilder(t)` makes a `StepBatch`: this process's rows of the step (`local_batch`: the
real rows spread round-robin over the `data` axis, each row carrying its position in the step's
sample, `dp.clipping.ROW_ID`), as one batch (a fixed or truncated batch) or as k microbatches of
m rows stacked to K = `trainer.microbatch_bucket(k)` for the one-dispatch step
(`Trainer.train_step_stacked`), already placed on the devices. The host rows are
`step_rows.HostStepBuilder`'s (NumPy only), built in this process or, with `train.data_workers`
= P > 0, by P worker processes (`worker_pool`), a whole step each. `Prefetcher` builds the
batches of the next `depth` steps ahead (as seqio's and grain's prefetching do) while the device
runs the current one, and the main thread only dispatches. A worker that fails or dies stops
the run with one line (`errors.DataError`, naming the step), never a hang.
"""
import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from scipy import stats

from private_t5.dp import clipping
from private_t5.errors import DataError, PrivateT5Error
from private_t5.train import step_rows, worker_pool
from private_t5.models import sharding
from private_t5.train.trainer import microbatch_bucket

DEFAULT_PREFETCH_DEPTH = 2
DEFAULT_DATA_WORKERS = 0  # worker processes (`train.worker_pool`); 0: a thread of this process


def local_batch(source, indices: np.ndarray, seed: int, batch_size: int, data_size: int,
                rows: range, row_offset: int = 0) -> Dict[str, np.ndarray]:
  """This process's `rows` of the global batch of `indices`, real rows spread over the data axis.

  Position p of the `data` axis holds indices p, p + D, p + 2D, ... then padding
  (`step_rows.spread_over_data`); only the examples of this process's positions are read.
  The `dp.clipping.ROW_ID` column holds each row's position in the step's sample
  (`step_rows.sample_positions`, plus `row_offset` when `indices` are the sample's rows from
  `row_offset` on: one microbatch of it), so the dropout keys do not depend on the layout.
  """
  return step_rows.spread_rows(source, indices, seed, batch_size, data_size, rows, clipping.ROW_ID, row_offset)


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
  """`builder(t)` -> the `StepBatch` of step t (a pure function of the seeds and t; thread-safe).

  The host rows come from `step_rows.HostStepBuilder`, in this process or (`processes` > 0) in
  that many data worker processes (`worker_pool.WorkerPool`; `prepare(t)` queues step t there);
  the placing on the devices is always done here. Call `close()` (the `Prefetcher` does).
  """

  def __init__(self, *, privacy, layout, source, seeds, trainer, processes: int = 0):
    self._layout, self._seeds, self._trainer = layout, seeds, trainer
    data_size = trainer.mesh.shape[sharding.DATA_AXIS]
    # This process's data-axis positions: its rows of a batch of one row a position.
    self._host = step_rows.HostStepBuilder(sampler=getattr(privacy, "sampler", privacy), layout=layout,
                                           source=source, data_size=data_size,
                                           positions=tuple(trainer.local_rows(data_size)), row_id_key=clipping.ROW_ID)
    self._sampler_lock = threading.Lock()  # a sampler may cache (a shuffled epoch's permutation)
    if layout.microbatch_size is not None:
      expected = privacy.sampler.expected_batch_size if layout.variable_rows else layout.batch_rows
      self._base = stack_base(layout.microbatch_size, expected, layout.variable_rows)
    self.processes = int(processes)
    self._pool = worker_pool.WorkerPool(self._host, self.processes) if self.processes > 0 else None

  def prepare(self, step: int) -> None:
    """Queues step `step` to the worker processes (nothing without them)."""
    if self._pool is not None:
      self._pool.submit(step, self._seeds.data_seed(step))

  def host_step(self, step: int) -> step_rows.HostStep:
    if self._pool is not None:
      self.prepare(step)
      return self._pool.result(step)
    with self._sampler_lock:
      return self._host(step, self._seeds.data_seed(step))

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()

  def __call__(self, step: int) -> StepBatch:
    built = self.host_step(step)
    trainer, host = self._trainer, built.host
    if built.count is None:  # one batch, rows spread over the data axis; each process reads its own
      return StepBatch(step, built.num_sampled, built.rows, None, host, trainer.place_batch(host[0]),
                       ("step", built.rows))
    bucket = microbatch_bucket(built.count, self._base)
    return StepBatch(step, built.num_sampled, built.rows, built.count, host,
                     trainer.place_stacked(host or [built.empty], bucket),
                     ("microbatches", bucket, self._layout.microbatch_size))


class Prefetcher:
  """The `StepBatch`es of steps [start, stop), built `depth` steps ahead by `workers` threads.

  `get(t)` returns step t's batch (built in line when it was not asked for ahead) and asks for
  step t + depth. `depth=0` builds every batch in line, in the caller's thread. With a builder's
  data worker processes (`StepBatchBuilder.processes` = P), the host rows of the next depth + P
  steps are queued to them, and the threads only place what they return. A worker's error
  is raised by `get` of its step: a `PrivateT5Error` as it is, anything else as one DataError line
  naming the step. `close()` drops what is still queued and stops the builder's processes (always
  call it: `with` does).
  """

  def __init__(self, build: Callable[[int], StepBatch], start: int, stop: int,
               depth: int = DEFAULT_PREFETCH_DEPTH, workers: int = 1):
    self._build, self._stop, self._depth = build, int(stop), int(depth)
    self._futures: Dict[int, concurrent.futures.Future] = {}
    self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=max(int(workers), 1),
                                                        thread_name_prefix="private_t5-data")
                  if self._depth > 0 else None)
    self._processes = int(getattr(build, "processes", 0) or 0)
    for step in range(int(start), min(int(start) + self._depth, self._stop)):
      self._submit(step)

  def _submit(self, step: int) -> None:
    for ahead in range(step, min(step + self._processes, self._stop)):
      self._build.prepare(ahead)
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
    if hasattr(self._build, "close"):
      self._build.close()

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
