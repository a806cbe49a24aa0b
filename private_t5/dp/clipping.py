"""Pieces shared by every clipped sum: per-example evaluation, row ids, the clip.

Both DP aggregators (`aggregator.DPAggregator`, per-example gradients under `jax.vmap`, and
`ghost.GhostDPAggregator`, ghost norms) build on these, so that they evaluate each example
the same way (a batch of one with dropout key `fold_in(dropout_rng, row)`), clip with the same
factor and drop the same rows.

The clip (Abadi et al. 2016, "Deep Learning with Differential Privacy", Alg. 1): example i
enters the sum with scale `min(1, C / ||g_i||) w_i`, where `w_i` is its `example_weight`
(1 for a real row, 0 for a padding row). Rows kept in the sum are real rows with a finite
gradient norm; every other row (padding, NaN or inf gradient) contributes exactly 0, never
`0 * NaN = NaN`, so one bad example cannot break the sensitivity bound of C.
"""
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp


PyTree = Any
Batch = Dict[str, jax.Array]
LossFn = Callable[[PyTree, Batch, Optional[jax.Array]], jax.Array]

# Metric names. Everything computed from the private batch is labelled "nondp/": it is not
# covered by the privacy guarantee (DP rule "nothing else leaks") and must not be used to make training choices.
METRIC_LOSS = "nondp/loss"
METRIC_BATCH_SIZE = "nondp/batch_size"
METRIC_GRAD_NORM = "nondp/grad_norm_mean"
METRIC_FRACTION_CLIPPED = "nondp/fraction_clipped"
# Optional int32[B] batch column: each row's position in the step's whole sample, when the
# batch is one microbatch of a larger Poisson sample (dropout keys fold it in). Without it a
# row's id is its position in the batch.
ROW_ID = "row_id"


def num_rows(batch: Batch) -> int:
  """Rows of a batch (real and padding)."""
  return batch["example_weight"].shape[0]


def example_keys(dropout_rng: Optional[jax.Array], rows: jax.Array) -> Optional[jax.Array]:
  """One dropout key per row: fold_in(dropout_rng, row); None when dropout is off."""
  if dropout_rng is None:
    return None
  return jax.vmap(lambda r: jax.random.fold_in(dropout_rng, r))(rows)


def single_example_loss(loss_fn: LossFn, params: PyTree, example: Batch,
                        key: Optional[jax.Array]) -> jax.Array:
  """Loss of one example, evaluated as a batch of one (shapes [1, ...])."""
  as_batch = jax.tree.map(lambda x: x[None], example)
  return loss_fn(params, as_batch, key)[0]


def split_row_ids(batch: Batch) -> Tuple[Batch, jax.Array]:
  """(the batch without its `ROW_ID` column, int32 row ids [B]).

  Row ids index the step's sample when the batch carries a `ROW_ID` column (one microbatch of
  a larger sample; dropout keys fold them in, so the result does not depend on how the sample
  is cut into microbatches), else the batch itself.
  """
  if ROW_ID in batch:
    batch = dict(batch)
    return batch, batch.pop(ROW_ID).astype(jnp.int32)
  return batch, jnp.arange(num_rows(batch), dtype=jnp.int32)


class Clip(NamedTuple):
  """The clip of one (micro)batch: per-row norms [B], factors [B], kept rows [B], scales [B]."""
  norms: jax.Array
  factors: jax.Array
  keep: jax.Array
  scale: jax.Array


def clip(norms: jax.Array, weights: jax.Array, clip_norm: float) -> Clip:
  """Clip factors min(1, C / ||g_i||) and the scales of the rows kept in the sum.

  A zero gradient has factor 1. `scale_i = factor_i w_i` for kept rows (real, finite norm)
  and exactly 0 for every other row.
  """
  norms = norms.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  factors = jnp.minimum(1.0, clip_norm / jnp.maximum(norms, 1e-30))
  keep = (weights > 0) & jnp.isfinite(norms)
  return Clip(norms, factors, keep, jnp.where(keep, factors * weights, 0.0))


def _rows_mask(keep: jax.Array, x: jax.Array) -> jax.Array:
  return keep.reshape((-1,) + (1,) * (x.ndim - 1))


def zero_dropped(tree: PyTree, keep: jax.Array) -> PyTree:
  """Sets the rows (leading axis) of the rows not kept to exactly 0 (a NaN row becomes 0)."""
  return jax.tree.map(lambda x: jnp.where(_rows_mask(keep, x), x, jnp.zeros_like(x)), tree)


def replace_dropped(tree: PyTree, keep: jax.Array) -> PyTree:
  """Replaces the rows not kept by a copy of the first kept row (row 0 if none is kept).

  For a pass that multiplies each row by its (zero) scale inside a backward pass: a copy of
  a finite row times 0 is exactly 0, where the dropped row itself could give 0 * NaN.
  """
  first_kept = jnp.argmax(keep)
  index = jnp.where(keep, jnp.arange(keep.shape[0]), first_kept)
  return jax.tree.map(lambda x: jnp.take(x, index, axis=0), tree)


def init_stats() -> Tuple[jax.Array, jax.Array, jax.Array]:
  """(loss_sum, norm_sum, clipped_count) before the first microbatch."""
  return jnp.float32(0), jnp.float32(0), jnp.int32(0)


def add_stats(stats: Tuple[jax.Array, jax.Array, jax.Array], losses: jax.Array,
              weights: jax.Array, c: Clip) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """Adds one microbatch to (loss_sum, norm_sum, clipped_count) (non-private statistics)."""
  loss_sum, norm_sum, clipped_count = stats
  weights = weights.astype(jnp.float32)
  is_real = weights > 0
  return (loss_sum + jnp.sum(losses.astype(jnp.float32) * weights),
          norm_sum + jnp.sum(jnp.where(c.keep, c.norms, 0.0)),
          clipped_count + jnp.sum(jnp.where(is_real, c.factors < 1.0, False)))


def clipping_metrics(batch: Batch, loss_sum: jax.Array, norm_sum: jax.Array,
                     clipped_count: jax.Array) -> Dict[str, jax.Array]:
  """The clipped-sum metrics, averaged over the batch's real rows (non-private, DP rule "nothing else leaks")."""
  return metrics_from_sums(jnp.sum(batch["example_weight"].astype(jnp.float32)), loss_sum, norm_sum,
                           clipped_count)


def metrics_from_sums(realised: jax.Array, loss_sum: jax.Array, norm_sum: jax.Array,
                      clipped_count: jax.Array) -> Dict[str, jax.Array]:
  """`clipping_metrics` from the sums over `realised` real rows (e.g. of several microbatches)."""
  denominator = jnp.maximum(realised, 1.0)
  return {
      METRIC_LOSS: loss_sum / denominator,
      METRIC_BATCH_SIZE: realised,
      METRIC_GRAD_NORM: norm_sum / denominator,
      METRIC_FRACTION_CLIPPED: clipped_count.astype(jnp.float32) / denominator,
  }


# The sums `sums_from_metrics` returns (the keyword arguments of `metrics_from_sums`).
SUM_NAMES = ("realised", "loss_sum", "norm_sum", "clipped_count")


def sums_from_metrics(metrics: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
  """The inverse of `metrics_from_sums`: (realised, loss_sum, norm_sum, clipped_count) as floats,
  to be added over the microbatches of one step."""
  realised = metrics[METRIC_BATCH_SIZE]
  denominator = jnp.maximum(realised, 1.0)
  return {"realised": realised, "loss_sum": metrics[METRIC_LOSS] * denominator,
          "norm_sum": metrics[METRIC_GRAD_NORM] * denominator,
          "clipped_count": metrics[METRIC_FRACTION_CLIPPED] * denominator}


def zeros_like_f32(params: PyTree) -> PyTree:
  """Float32 zeros shaped like `params` (the accumulator of a gradient sum)."""
  return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
