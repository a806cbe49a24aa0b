"""Clipped sums: the one place where per-example gradients become a batch gradient.

A DP step is two parts (jax-privacy's `DPExecutionPlan` has the same shape): a clipped-sum
function, here, that carries C and the public divisor q N, and the noise transform that adds
the Gaussian noise to its output (`noise.noise_transform`, an optax transform chained in front of
the optimizer). Every clipped sum runs a step's rows as one or several microbatches:

  acc = cs.zero_sum(params); acc = cs.accumulate(params, acc, micro, dropout_rng) ...
  grads, metrics = cs.finish(params, acc)          # or, for one batch: cs(params, batch, ...)

* `MeanAggregator` (non-private): sum_i w_i grad l_i / sum_i w_i over the real rows of the
  batch (`example_weight` w_i is 1 for a real row and 0 for a padding row), one batched
  backward pass per call; its noise transform is `noise.no_noise()`.
* `DPAggregator` (DP-SGD, Abadi et al. 2016, Alg. 1; Ponomareva et al. 2022, Sec. 3): each
  example's gradient is clipped to L2 norm <= C, the clipped gradients are summed and the sum
  is divided by the public expected batch size q N (sensitivity C / (q N)); the noise transform
  then adds N(0, (σ C / (q N))²) once per step, whatever the number of microbatches.
  `ghost.GhostDPAggregator` computes the same sum with ghost norms.

`loss_fn(params, batch, dropout_rng) -> loss[B]` returns one loss per example (the model's
`example_loss_fn` partially applied). Each example is evaluated as a batch of one under
`jax.vmap`, with its own dropout key `fold_in(dropout_rng, row)`, so that an example's
gradient depends on that example alone (no batch statistics) and results do not depend on how
the batch is cut into microbatches.

Why this module is written here rather than taken from a library:
* `optax.contrib.differentially_private_aggregate` takes the per-example gradients of the
  whole batch at once (memory B x |params|, no microbatching), draws its noise from a key
  kept in the optimizer state rather than the explicit per-step key that a resumed run
  continues (DP rule "noise keys are secret and never reused"), and divides by the realised
  batch size instead of the public q N (DP rule "noise on the sum, divide by a public
  constant"). `optax.per_example_global_norm_clip` returns only the clipped sum and count, not
  the per-example norms, and has no padding weights nor NaN guard, so the clip is written
  out (in `dp.clipping`, shared with ghost clipping) with the same formula and `optax.tree.norm`.
* jax-privacy's `clipping.clipped_grad` does the same vmap / clip / sum (with the same
  strided microbatch layout and `spmd_axis_name`), but it is not a dependency of this
  project and brings a large dependency tree for ~100 lines. The code here is small enough
  to audit line by line, accumulates microbatches one compiled call at a time so that memory
  is bounded by the microbatch size, and leaves the noise to one transform with its own key.
"""
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from private_t5 import tree_groups
from private_t5.dp import clipping
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.clipping import METRIC_BATCH_SIZE, METRIC_LOSS, Batch, LossFn, PyTree
from private_t5.errors import PrivacyError


# (float32 clipped sum, non-DP sums `clipping.SUM_NAMES`) of the microbatches of a step so far.
Accumulator = Tuple[PyTree, Dict[str, jax.Array]]


class MeanAggregator:
  """Non-private aggregation: the weighted mean gradient over the real rows of the batch.

  Attributes:
    per_example_dropout_keys: False (default, the fast baseline): each (micro)batch runs as
      one batched forward/backward pass with the key `fold_in(dropout_rng, its first row)`.
      True: every row runs as a batch of one with the per-row keys `DPAggregator` uses, so the
      two aggregators see the same dropout masks (for comparisons; about 15% slower on CPU
      for T5-small at 512/114).
  """

  def __init__(self, loss_fn: LossFn, per_example_dropout_keys: bool = False):
    self.loss_fn = loss_fn
    self.per_example_dropout_keys = bool(per_example_dropout_keys)

  def weighted_sum(self, params: PyTree, batch: Batch, dropout_rng: Optional[jax.Array] = None
                   ) -> Tuple[PyTree, jax.Array, jax.Array]:
    """(float32 sum_i w_i grad l_i, sum_i w_i l_i, sum_i w_i) over the rows of `batch`, in one
    batched backward pass."""
    batch, row_ids = clipping.split_row_ids(batch)

    def weighted_loss_sum(p):
      if self.per_example_dropout_keys:
        keys = clipping.example_keys(dropout_rng, row_ids)
        per_example = jax.vmap(lambda ex, k: clipping.single_example_loss(self.loss_fn, p, ex, k),
                               in_axes=(0, None if keys is None else 0))(batch, keys)
      else:
        key = None if dropout_rng is None else jax.random.fold_in(dropout_rng, row_ids[0])
        per_example = self.loss_fn(p, batch, key)
      return jnp.sum(per_example.astype(jnp.float32) * batch["example_weight"])

    loss, grads = jax.value_and_grad(weighted_loss_sum)(params)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return grads, loss, jnp.sum(batch["example_weight"].astype(jnp.float32))

  def __call__(self, params: PyTree, batch: Batch, *, dropout_rng: Optional[jax.Array] = None
               ) -> Tuple[PyTree, Dict[str, jax.Array]]:
    grad_sum, loss_sum, weight_sum = self.weighted_sum(params, batch, dropout_rng)
    return self.finish(params, (grad_sum, {"loss_sum": loss_sum, "weight_sum": weight_sum}))

  # -- a step's batch in several microbatches (`Trainer.train_step_stacked`) -------------------

  def zero_sum(self, params: PyTree) -> Accumulator:
    """The accumulator before a step's first microbatch: float32 zeros and zero sums."""
    return clipping.zeros_like_f32(params), {"loss_sum": jnp.float32(0), "weight_sum": jnp.float32(0)}

  def accumulate(self, params: PyTree, acc: Accumulator, micro: Batch,
                 dropout_rng: Optional[jax.Array]) -> Accumulator:
    """`acc` + the weighted gradient and loss sums of one microbatch (its `ROW_ID` column: the
    rows' positions in the step's batch)."""
    grad_sum, loss_sum, weight_sum = self.weighted_sum(params, micro, dropout_rng)
    acc_sum, acc_stats = acc
    return (jax.tree.map(jnp.add, acc_sum, grad_sum),
            {"loss_sum": acc_stats["loss_sum"] + loss_sum, "weight_sum": acc_stats["weight_sum"] + weight_sum})

  def finish(self, params: PyTree, acc: Accumulator) -> Tuple[PyTree, Dict[str, jax.Array]]:
    """(the weighted mean gradient in float32, its metrics) from the sums over all the step's rows."""
    del params
    grad_sum, sums = acc
    denominator = jnp.maximum(sums["weight_sum"], 1e-12)
    # One division a shape (`tree_groups`), not one kernel a parameter array.
    grads = tree_groups.unstacked([g / denominator for g in tree_groups.stacked(grad_sum)], grad_sum)
    metrics = {METRIC_LOSS: sums["loss_sum"] / denominator, METRIC_BATCH_SIZE: sums["weight_sum"]}
    return grads, metrics


class DPAggregator:
  """DP-SGD's clipped sum: clip each example to C, sum, divide by the public q N (the noise
  transform `noise.noise_transform` adds N(0, (σ C / (q N))²) to the result).

  Attributes:
    loss_fn: per-example loss, `loss_fn(params, batch, dropout_rng) -> loss[B]`.
    noisy_sum: the release's C (the L2 bound on each example's gradient, global norm over all
      params), σ (read by the noise transform only) and the public q·N the sum is divided by (DP rule "noise on the sum, divide by a public
      constant"): `accounting.NoisySum`, the same object as the run's ledger's.
    spmd_axis_name: mesh axis that the examples are sharded over (e.g. "data"), passed to
      `jax.vmap` so that per-example gradients stay on the device holding the example.
  """

  def __init__(self, loss_fn: LossFn, noisy_sum: NoisySum, spmd_axis_name: Optional[str] = None):
    if not isinstance(noisy_sum, NoisySum):
      raise PrivacyError(f"a DP aggregator needs an accounting.NoisySum, got {type(noisy_sum).__name__}")
    self.loss_fn = loss_fn
    self.noisy_sum = noisy_sum
    self.spmd_axis_name = spmd_axis_name

  @property
  def clip_norm(self) -> float:
    return self.noisy_sum.clip_norm

  @property
  def expected_batch_size(self) -> float:
    return self.noisy_sum.expected_batch_size

  @property
  def sensitivity(self) -> float:
    """L2 sensitivity of the output (the clipped sum divided by q N) to one example: C / (q N)."""
    return self.noisy_sum.clip_norm / self.noisy_sum.expected_batch_size

  def per_example_grads(self, params: PyTree, batch: Batch, rows: jax.Array,
                        dropout_rng: Optional[jax.Array]) -> Tuple[jax.Array, PyTree]:
    """(loss[b], grads with a leading [b] axis): one gradient per example of `batch`."""
    keys = clipping.example_keys(dropout_rng, rows)

    def one(ex, key):
      return jax.value_and_grad(lambda p: clipping.single_example_loss(self.loss_fn, p, ex, key))(params)

    return jax.vmap(one, in_axes=(0, None if keys is None else 0),
                    spmd_axis_name=self.spmd_axis_name)(batch, keys)

  def clipped_sum(self, params: PyTree, batch: Batch, dropout_rng: Optional[jax.Array] = None
                  ) -> Tuple[PyTree, Dict[str, jax.Array]]:
    """Noiseless sum_i w_i clip_C(grad l_i) in float32, and its (non-DP) statistics.

    Sensitivity: adding or removing one example changes this sum by at most C in L2 norm
    (each term has norm <= C because min(1, C/||g||) ||g|| <= C and w_i in {0, 1}), up to
    float32 rounding: the per-example gradients are cast to float32 once and both the norm
    and the sum read those values, also with bfloat16 activations.
    """

    batch, row_ids = clipping.split_row_ids(batch)
    losses, grads = self.per_example_grads(params, batch, row_ids, dropout_rng)
    # The norm and the sum read the same float32 values (whatever the activation dtype), so
    # the norm that sets each clip factor is the norm of what is summed (docs/model.md).
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    c = clipping.clip(jax.vmap(optax.tree.norm)(grads), batch["example_weight"], self.noisy_sum.clip_norm)
    # Rows not kept (padding, NaN/inf gradients) are zeroed before the sum: 0 * NaN = NaN.
    grads = clipping.zero_dropped(grads, c.keep)
    # Full float32 precision: a GPU's default would round the gradients to TF32 in this product.
    grad_sum = jax.tree.map(lambda g: jnp.tensordot(c.scale, g, axes=1, precision=jax.lax.Precision.HIGHEST),
                            grads)
    stats = clipping.add_stats(clipping.init_stats(), losses, batch["example_weight"], c)
    return grad_sum, clipping.clipping_metrics(batch, *stats)

  def finalize(self, params: PyTree, grad_sum: PyTree) -> PyTree:
    """The step's clipped sum (over all its microbatches) divided by the public q N, float32
    (DP rule "noise on the sum, divide by a public constant"; the noise transform adds
    N(0, (σ C / (q N))²) to it: `noise.noise_transform`)."""
    del params
    # Divide by the PUBLIC expected batch size q N, never by the realised (private) count.
    return jax.tree.map(lambda g: g / self.noisy_sum.expected_batch_size, grad_sum)

  def __call__(self, params: PyTree, batch: Batch, *, dropout_rng: Optional[jax.Array] = None
               ) -> Tuple[PyTree, Dict[str, jax.Array]]:
    """(the noiseless clipped sum of `batch` divided by q N, its non-DP metrics)."""
    grad_sum, metrics = self.clipped_sum(params, batch, dropout_rng)
    return self.finalize(params, grad_sum), metrics

  # -- a step's sample in several microbatches (`Trainer.train_step_stacked`) -----------------

  def zero_sum(self, params: PyTree) -> Accumulator:
    """The accumulator before a step's first microbatch: float32 zeros shaped like `params`
    (concrete arrays or ShapeDtypeStructs) and zero statistics."""
    return clipping.zeros_like_f32(params), {name: jnp.float32(0) for name in clipping.SUM_NAMES}

  def accumulate(self, params: PyTree, acc: Accumulator, micro: Batch,
                 dropout_rng: Optional[jax.Array]) -> Accumulator:
    """`acc` + the noiseless clipped sum of one microbatch. Its `ROW_ID` column holds the rows'
    positions in the step's sample (their dropout keys fold them in, so neither the microbatch
    size nor the rows' layout over the devices and processes changes the result)."""
    grad_sum, metrics = self.clipped_sum(params, micro, dropout_rng)
    acc_sum, acc_stats = acc
    sums = clipping.sums_from_metrics(metrics)
    return (jax.tree.map(jnp.add, acc_sum, grad_sum),
            {name: acc_stats[name] + sums[name] for name in clipping.SUM_NAMES})

  def finish(self, params: PyTree, acc: Accumulator) -> Tuple[PyTree, Dict[str, jax.Array]]:
    """(the step's noiseless clipped sum over all its microbatches divided by q N, its non-DP
    metrics); the noise transform adds the noise once, to this (`noise.noise_transform`)."""
    grad_sum, stats = acc
    return self.finalize(params, grad_sum), clipping.metrics_from_sums(**stats)
