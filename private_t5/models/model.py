"""The encoder-decoder model object: one place for logits -> loss, metrics, scores and decodes.

`EncoderDecoderModel(config, z_loss)` wraps the Flax `Transformer` the way T5X's
`EncoderDecoderModel` wraps its module: training (`per_example_loss`, the unit the DP
aggregators clip), teacher-forced evaluation (`eval_metrics`), scoring (`score_batch`, the log
likelihood used by the exposure test), perplexity (`per_example_perplexity`) and decoding
(`predict_batch`: greedy, beam search or sampling, from models/decoding.py) all read the same
batch columns and go through the same `compute_logits` and the functions of models/losses.py.

Batch columns: `encoder_input_tokens` `[B, Li]`, `decoder_input_tokens` `[B, Lt]` (optional
for scoring: the targets shifted right behind the pad id 0), `decoder_target_tokens` `[B, Lt]`,
`decoder_loss_weights` `[B, Lt]` and, where present, `example_weight` `[B]`.
"""
import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from private_t5.errors import ConfigError
from private_t5.models import decoding, losses
from private_t5.models.config import T5Config
from private_t5.models.lora import LoraConfig
from private_t5.models.network import Params, Transformer

Batch = Mapping[str, Any]
GREEDY = "greedy"
BEAM = "beam"
SAMPLE = "sample"
DECODE_METHODS = (GREEDY, BEAM, SAMPLE)


def shift_right(targets: jax.Array) -> jax.Array:
  """Teacher-forcing decoder inputs `[0, y_0, ..., y_{L-2}]` of targets `[B, L]`."""
  return jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))


@dataclasses.dataclass(frozen=True)
class EncoderDecoderModel:
  """T5 encoder-decoder with its loss, metrics, scores and decoding.

  Hashable (frozen), so it can be closed over or passed as a static argument under `jax.jit`.

  Attributes:
    config: the T5Config.
    z_loss: coefficient of the auxiliary `log(Z)**2` term of the training loss (0 disables it).
    lora: `models.lora.LoraConfig` of a network with low-rank adapters (its params then hold
      the base weights and the adapters, `lora.combine`), or None.
  """
  config: T5Config
  z_loss: float = 0.0
  lora: Optional[LoraConfig] = None

  @property
  def module(self) -> Transformer:
    return Transformer(self.config, self.lora)

  # -- logits ---------------------------------------------------------------------------------

  def compute_logits(self, params: Params, batch: Batch,
                     dropout_rng: Optional[jax.Array] = None) -> jax.Array:
    """Teacher-forced logits `[B, Lt, V]`; dropout is on iff `dropout_rng` is given."""
    decoder_inputs = batch.get("decoder_input_tokens")
    if decoder_inputs is None:
      decoder_inputs = shift_right(batch["decoder_target_tokens"])
    enable_dropout = dropout_rng is not None
    return self.module.apply({"params": params}, batch["encoder_input_tokens"], decoder_inputs,
                             enable_dropout=enable_dropout,
                             rngs={"dropout": dropout_rng} if enable_dropout else None)

  def loss_with_aux(self, params: Params, batch: Batch, dropout_rng: Optional[jax.Array] = None
                    ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """`(loss [B], aux)` of `losses.per_example_loss` (no `example_weight` applied)."""
    logits = self.compute_logits(params, batch, dropout_rng)
    return losses.per_example_loss(logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"],
                                   self.z_loss)

  # -- training and evaluation -----------------------------------------------------------------

  def per_example_loss(self, params: Params, batch: Batch,
                       dropout_rng: Optional[jax.Array] = None) -> jax.Array:
    """Per-example training loss `[B]` as a pure function of `params` (for `jax.grad` / `jax.vmap`).

    Token cross-entropy (+ z-loss) averaged within each example, times `example_weight` when
    the batch has it (0 zeroes a padding row). Under `jax.vmap` over examples each call sees a
    batch of one (`[1, L]` arrays).
    """
    loss, _ = self.loss_with_aux(params, batch, dropout_rng)
    if "example_weight" in batch:
      loss = loss * jnp.asarray(batch["example_weight"], jnp.float32)
    return loss

  def eval_metrics(self, params: Params, batch: Batch) -> Dict[str, jax.Array]:
    """Teacher-forced sums over the real rows (weighted by `example_weight`), no dropout.

    Keys: `loss_sum` (per-example mean token cross-entropy, without the z-loss term),
    `examples`, `correct_tokens` and `target_tokens`.
    """
    _, aux = self.loss_with_aux(params, batch)
    weight = jnp.asarray(batch["example_weight"], jnp.float32)
    return {"loss_sum": jnp.sum(aux["cross_entropy"] * weight), "examples": jnp.sum(weight),
            "correct_tokens": jnp.sum(aux["num_correct"] * weight),
            "target_tokens": jnp.sum(aux["num_tokens"] * weight)}

  def per_example_perplexity(self, params: Params, batch: Batch) -> jax.Array:
    """`exp(mean token cross-entropy)` of each example `[B]` (no dropout, no z-loss)."""
    _, aux = self.loss_with_aux(params, batch)
    return jnp.exp(aux["cross_entropy"])

  def score_batch(self, params: Params, batch: Batch) -> jax.Array:
    """Log likelihood `[B]`: weighted sum of the targets' token log-probabilities (nats).

    The negative log-perplexity of Carlini et al., "The Secret Sharer", 2019, under teacher
    forcing; `decoder_input_tokens` default to the shifted targets.
    """
    logits = self.compute_logits(params, batch)
    return losses.sequence_log_likelihood(logits, batch["decoder_target_tokens"],
                                          batch["decoder_loss_weights"])

  # -- decoding --------------------------------------------------------------------------------

  def predict_batch_with_aux(self, params: Params, encoder_input_tokens: jax.Array, *,
                             max_decode_length: int, method: str = GREEDY, beam_size: int = 4,
                             alpha: float = 0.6, rng: Optional[jax.Array] = None,
                             temperature: float = 1.0, top_k: int = 0, eos_id: int = decoding.EOS_ID,
                             use_cache: bool = True, active: Optional[jax.Array] = None
                             ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """`(sequences int32 [B, max_decode_length], aux)`: zeros after the first EOS.

    `method` is "greedy", "beam" (the best beam; aux holds every beam in `all_sequences`
    `[B, K, L]` and their `scores` `[B, K]`) or "sample" (needs `rng`; `temperature`,
    `top_k`). `active` ([B] bool): greedy decoding leaves the rows marked False (a padded
    batch's filler) at zeros, so they do not keep the loop running; the other methods decode
    every row.
    """
    if method == GREEDY:
      return decoding.greedy_decode(params, self.config, encoder_input_tokens,
                                    max_decode_length=max_decode_length, eos_id=eos_id,
                                    use_cache=use_cache, active=active), {}
    if method == BEAM:
      seqs, scores = decoding.beam_search(params, self.config, encoder_input_tokens,
                                          max_decode_length=max_decode_length, beam_size=beam_size,
                                          alpha=alpha, eos_id=eos_id, use_cache=use_cache)
      return seqs[:, 0], {"all_sequences": seqs, "scores": scores}
    if method == SAMPLE:
      if rng is None:
        raise ConfigError("sampling needs an rng")
      return decoding.sample_decode(params, self.config, encoder_input_tokens, rng,
                                    max_decode_length=max_decode_length, temperature=temperature,
                                    top_k=top_k, eos_id=eos_id, use_cache=use_cache), {}
    raise ConfigError(f"decoding method must be one of {DECODE_METHODS}, got {method!r}")

  def predict_batch(self, params: Params, encoder_input_tokens: jax.Array, **kwargs) -> jax.Array:
    """Decoded sequences `[B, max_decode_length]` (see `predict_batch_with_aux`)."""
    return self.predict_batch_with_aux(params, encoder_input_tokens, **kwargs)[0]


def example_loss_fn(params: Params, batch: Batch, config: T5Config,
                    dropout_rng: Optional[jax.Array] = None, z_loss: float = 0.0) -> jax.Array:
  """`EncoderDecoderModel(config, z_loss).per_example_loss(params, batch, dropout_rng)`."""
  return EncoderDecoderModel(config, z_loss).per_example_loss(params, batch, dropout_rng)
