"""This process's host rows of each step: NumPy only, so that data worker processes build them
without importing JAX (`train.worker_pool`).

`HostStepBuilder(step, seed)` draws the step's sample (`sampler.indices_for_step`), lays it out
(`BatchLayout.rows_for_step`) and reads this process's rows of it from the source, spread
round-robin over the `data` axis, as one batch or as consecutive microbatches: a `HostStep`.
A pure function of (the sampler's seed, step, seed), so the batch of step t is the same whoever
builds it, in whichever process and order. `train.step_data` places it on the devices.
"""
import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np


def spread_over_data(indices: np.ndarray, data_size: int) -> List[np.ndarray]:
  """The example indices of each `data`-axis position: the k-th index goes to position k mod D.

  A Poisson-sampled batch has fewer real rows than its padded size; spread round-robin, the
  real rows (and the corpus reads) are balanced over the data axis and so over the processes,
  instead of filling the first positions and leaving the padding to the last ones. Each
  position's rows are its real rows, then its padding.
  """
  indices = np.asarray(indices)
  return [indices[p::data_size] for p in range(data_size)]


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
  for p, block in enumerate(spread_over_data(np.arange(num_sampled), data_size)):
    real = min(len(block), per)
    positions[p * per:p * per + real] = block[:real]
    positions[p * per + real:(p + 1) * per] = np.arange(next_padding, next_padding + per - real)
    next_padding += per - real
  return positions[rows.start:rows.stop]


def spread_rows(source, indices: np.ndarray, seed: int, batch_size: int, data_size: int, rows: range,
                row_id_key: str, row_offset: int = 0) -> Dict[str, np.ndarray]:
  """This process's `rows` of the global batch of `indices`, real rows spread over the data axis
  (`train.step_data.local_batch`, whose `row_id_key` is `dp.clipping.ROW_ID`)."""
  per = batch_size // data_size
  blocks = spread_over_data(indices, data_size)
  parts = [source.get_batch(blocks[p], seed, per) for p in range(rows.start // per, rows.stop // per)]
  batch = parts[0] if len(parts) == 1 else {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
  batch[row_id_key] = row_offset + sample_positions(len(indices), batch_size, data_size, rows)
  return batch


@dataclasses.dataclass
class HostStep:
  """One step's host rows (`HostStepBuilder`).

  Attributes:
    step: the step t.
    num_sampled: examples in the step's sample (its real rows).
    rows: rows the step computes (the sample padded to whole microbatches, or the fixed batch).
    count: microbatches (None: one batch).
    host: this process's rows of each microbatch (or of the one batch).
    empty: for a microbatched step with no rows, one empty microbatch (what the stack is built
      from; never computed); else None.
  """
  step: int
  num_sampled: int
  rows: int
  count: Optional[int]
  host: List[Dict[str, np.ndarray]]
  empty: Optional[Dict[str, np.ndarray]] = None


@dataclasses.dataclass
class HostStepBuilder:
  """`builder(step, seed)` -> the `HostStep` of step t (NumPy only; picklable when its source
  and sampler are).

  Attributes:
    sampler: `indices_for_step(t)` (a `dp.sampling` sampler).
    layout: the run's `dp.config.BatchLayout`.
    source: the example source (`get_batch(indices, seed, batch_size)`).
    data_size: devices on the mesh's `data` axis.
    positions: [first, last) of the `data`-axis positions this process's devices hold.
    row_id_key: the batch key of each row's position in the sample (`dp.clipping.ROW_ID`).
  """
  sampler: object
  layout: object
  source: object
  data_size: int
  positions: Tuple[int, int]
  row_id_key: str

  def local_rows(self, batch_size: int) -> range:
    per = batch_size // self.data_size
    return range(self.positions[0] * per, self.positions[1] * per)

  def __call__(self, step: int, seed: int) -> HostStep:
    indices = self.sampler.indices_for_step(step)
    step_rows = self.layout.rows_for_step(len(indices))
    m = self.layout.microbatch_size
    if m is None:
      host = [spread_rows(self.source, indices, seed, step_rows, self.data_size, self.local_rows(step_rows),
                          self.row_id_key)]
      return HostStep(step, len(indices), step_rows, None, host)
    rows = self.local_rows(m)
    host = [spread_rows(self.source, indices[start:start + m], seed, m, self.data_size, rows, self.row_id_key,
                        row_offset=start) for start in range(0, step_rows, m)]
    empty = None if host else spread_rows(self.source, indices[:0], seed, m, self.data_size, rows,
                                          self.row_id_key)
    return HostStep(step, len(indices), step_rows, len(host), host, empty)

