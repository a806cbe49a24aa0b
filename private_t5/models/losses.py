"""Logits -> per-example losses (the unit that DP clips, Ponomareva et al. 2022, Sec. 3) and log likelihoods."""
from typing import Dict, Tuple

import jax
import jax.numpy as jnp


def _safe_mean(total: jax.Array, count: jax.Array) -> jax.Array:
  """`total / count`, and 0 where `count == 0` (never NaN, also in the gradient)."""
  return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """`(token cross-entropy [B, L], log Z [B, L])` of float32 `logits` `[B, L, V]`."""
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return log_z - target_logit, log_z


def sequence_log_likelihood(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """`sum_t w_t log p(y_t)` of each example `[B]` (nats): minus the weighted token cross-entropy."""
  token_ce, _ = token_cross_entropy(logits.astype(jnp.float32), targets)
  return -jnp.sum(token_ce * weights.astype(jnp.float32), axis=-1)


def per_example_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                     z_loss: float = 0.0) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """Weighted token cross-entropy averaged within each example.

  Args:
    logits: `[B, L, V]`.
    targets: int `[B, L]`.
    weights: `[B, L]` loss weights (0 on padding).
    z_loss: coefficient of the auxiliary `log(Z)**2` term (Mesh TF / T5X) that keeps the
      softmax normaliser near 1; 0 disables it.

  Returns:
    `(loss [B], aux)`: loss = sum_t w_t (CE_t + z_loss log(Z_t)^2) / sum_t w_t, 0 for an
    example without target weight; aux holds per-example `cross_entropy`, `z_loss`,
    `num_tokens` and `num_correct` (all `[B]`).
  """
  logits = logits.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  token_ce, log_z = token_cross_entropy(logits, targets)
  token_z = z_loss * jnp.square(log_z)
  num_tokens = jnp.sum(weights, axis=-1)
  cross_entropy = _safe_mean(jnp.sum(weights * token_ce, axis=-1), num_tokens)
  z_term = _safe_mean(jnp.sum(weights * token_z, axis=-1), num_tokens)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  aux = {
      "cross_entropy": cross_entropy,
      "z_loss": z_term,
      "num_tokens": num_tokens,
      "num_correct": jnp.sum(weights * correct, axis=-1),
  }
  return cross_entropy + z_term, aux


def token_accuracy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """Teacher-forced accuracy: weighted fraction of positions whose argmax is the target."""
  weights = weights.astype(jnp.float32)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return _safe_mean(jnp.sum(weights * correct), jnp.sum(weights))

