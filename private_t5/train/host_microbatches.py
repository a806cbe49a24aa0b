"""A trainer's step with its microbatches dispatched from the host, one compiled call each.

`train_step_microbatched(trainer, state, batch, microbatch_size, ...)` and
`train_step_on_microbatches(trainer, state, microbatches, ...)` run a `train.trainer.Trainer`'s
step as k host-dispatched calls of a compiled accumulate program, then one finalize call (the
trainer's finish, noise once with the step's key, Adafactor): the same functions, in the same
order of summation, that `Trainer.train_step_stacked` runs in one compiled call. The tests check
the one-dispatch step against it, and the benchmarks time a step microbatch by microbatch with
it; the training loop does not use it.

The three programs are compiled once per trainer and held beside it (weakly: they do not keep
it alive), from its parts: the clipped sum, the frozen LoRA base, the shardings and the
finalize function of its compiled steps.
"""
# This module is the trainer's companion: it reads the trainer's parts that are not its API.
# pylint: disable=protected-access
import weakref
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Tuple

import jax
import numpy as np

from private_t5.dp import clipping
from private_t5.models import sharding
from private_t5.train.state import TrainState

PyTree = Any
# (float32 gradient sum, non-DP sums) of the microbatches of one step so far.
Accumulator = Tuple[PyTree, Dict[str, jax.Array]]


class _Programs(NamedTuple):
  zero_sum: Callable
  accumulate: Callable
  finalize: Callable


_PROGRAMS: "weakref.WeakKeyDictionary[Any, _Programs]" = weakref.WeakKeyDictionary()


def _programs(trainer) -> _Programs:
  """The trainer's compiled host-path programs (made at the first call)."""
  programs = _PROGRAMS.get(trainer)
  if programs is None:
    programs = _PROGRAMS[trainer] = _compile(weakref.proxy(trainer))
  return programs


def _compile(trainer) -> _Programs:
  """The jitted programs of `trainer` (a weak proxy, so that they do not keep it alive)."""
  replicated = sharding.replicated(trainer.mesh)
  base, acc = trainer._base_shardings, (trainer.param_shardings, replicated)

  def zero_sum():
    return trainer.aggregator.zero_sum(trainer._abstract.params)

  def accumulate(params, base, acc, micro, dropout_base_key, step):
    """acc + the (clipped) sum of one microbatch (its `ROW_ID` column: the rows' positions in
    the step's sample)."""
    dropout_rng = jax.random.fold_in(dropout_base_key, step)  # = step_keys(...)[0]
    return trainer._bound(base).accumulate(params, acc, micro, trainer._dropout(dropout_rng))

  def finalize(state, base, acc, noise_base_key):
    return trainer._apply_fn(state, base, acc, noise_base_key)

  return _Programs(
      zero_sum=jax.jit(zero_sum, out_shardings=acc),
      accumulate=jax.jit(
          accumulate,
          in_shardings=(trainer.param_shardings, base, acc, sharding.batch_sharding(trainer.mesh),
                        replicated, replicated),
          out_shardings=acc, donate_argnums=(2,)),
      # Only the state is donated: the outputs of the accumulator's shapes already reuse the donated
      # state's buffers, so none is left for the accumulator's (JAX would warn they were not usable).
      finalize=jax.jit(
          finalize, in_shardings=(trainer.state_shardings, base, acc, replicated),
          out_shardings=(trainer.state_shardings, replicated), donate_argnums=(0,)))


def split_microbatches(batch: Dict[str, np.ndarray], microbatch_size: int) -> List[Dict[str, np.ndarray]]:
  """The consecutive microbatches of `microbatch_size` rows of a whole host batch (a multiple of
  it, possibly 0 rows); each carries its rows' positions in `batch` as `dp.clipping.ROW_ID`."""
  rows = len(batch["example_weight"])
  if rows % microbatch_size:
    raise ValueError(f"a batch of {rows} rows is not a multiple of microbatch_size={microbatch_size}")
  return [dict({k: v[start:start + microbatch_size] for k, v in batch.items()},
               **{clipping.ROW_ID: np.arange(start, start + microbatch_size, dtype=np.int32)})
          for start in range(0, rows, microbatch_size)]


def accumulate(trainer, params: PyTree, microbatches: Iterable[Dict[str, np.ndarray]],
               dropout_base_key: jax.Array, step) -> Accumulator:
  """(noiseless float32 (clipped) sum over every row of `microbatches`, its non-DP sums),
  computed microbatch by microbatch; a row's dropout key is
  `fold_in(fold_in(dropout_base_key, step), its ROW_ID)`, whatever the microbatch size."""
  programs = _programs(trainer)
  with trainer._mesh_context():
    acc = programs.zero_sum()
    for micro in microbatches:
      acc = programs.accumulate(params, trainer._base, acc, trainer.place_batch(micro), dropout_base_key, step)
    return acc


def accumulate_microbatches(trainer, params: PyTree, batch: Dict[str, np.ndarray], microbatch_size: int,
                            dropout_base_key: jax.Array, step) -> Accumulator:
  """`accumulate` over `split_microbatches(batch, microbatch_size)`: row r of `batch` is row r
  of the step's sample."""
  return accumulate(trainer, params, split_microbatches(batch, microbatch_size), dropout_base_key, step)


def train_step_on_microbatches(trainer, state: TrainState, microbatches: Iterable[Dict[str, np.ndarray]],
                               dropout_base_key: jax.Array, noise_base_key: jax.Array
                               ) -> Tuple[TrainState, Dict[str, jax.Array]]:
  """One optimizer step of `trainer` on a step's microbatches (host arrays of one shape, each
  with its `dp.clipping.ROW_ID` column; with several processes each process's own rows of every
  global microbatch, `train.step_data.local_batch`): accumulated one compiled call at a time,
  then (for DP) the noise is added once and the update applied. `state` is donated."""
  acc = accumulate(trainer, state.params, microbatches, dropout_base_key, state.step)
  with trainer._mesh_context():
    return _programs(trainer).finalize(state, trainer._base, acc, noise_base_key)


def train_step_microbatched(trainer, state: TrainState, batch: Dict[str, np.ndarray], microbatch_size: int,
                            dropout_base_key: jax.Array, noise_base_key: jax.Array
                            ) -> Tuple[TrainState, Dict[str, jax.Array]]:
  """One optimizer step of `trainer` on all of a step's rows: `batch` (host arrays, a multiple of
  `microbatch_size` rows, possibly 0) runs as consecutive microbatches (`split_microbatches`)
  through the compiled accumulate program, then (for DP) the noise is added once and the update
  applied. `state` is donated."""
  return train_step_on_microbatches(trainer, state, split_microbatches(batch, microbatch_size),
                                    dropout_base_key, noise_base_key)
