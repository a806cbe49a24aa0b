"""Per-example losses: one scalar per example, the unit that DP clips (seed 001, Sec. 3)."""
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from private_t5.models.config import T5Config
from private_t5.models.network import Params, Transformer


def _safe_mean(total: jax.Array, count: jax.Array) -> jax.Array:
  """`total / count`, and 0 where `count == 0` (never NaN, also in the gradient)."""
  return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)


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
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  token_ce = log_z - target_logit
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


def example_loss_fn(params: Params, batch: Mapping[str, Any], config: T5Config,
                    dropout_rng: Optional[jax.Array] = None, z_loss: float = 0.0) -> jax.Array:
  """Per-example loss `[B]` as a pure function of `params` (for `jax.grad` / `jax.vmap`).

  Reads `encoder_input_tokens`, `decoder_input_tokens`, `decoder_target_tokens`,
  `decoder_loss_weights` and, when present, `example_weight` (0 zeroes a padding row). Under
  `jax.vmap` over examples each call sees a batch of one (`[1, L]` arrays). Dropout is on
  iff `dropout_rng` is given.
  """
  model = Transformer(config)
  enable_dropout = dropout_rng is not None
  logits = model.apply({"params": params}, batch["encoder_input_tokens"],
                       batch["decoder_input_tokens"], enable_dropout=enable_dropout,
                       rngs={"dropout": dropout_rng} if enable_dropout else None)
  loss, _ = per_example_loss(logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"],
                             z_loss)
  if "example_weight" in batch:
    loss = loss * jnp.asarray(batch["example_weight"], jnp.float32)
  return loss
