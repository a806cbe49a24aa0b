"""Autoregressive decoding: greedy, temperature/top-k sampling and beam search.

All three are jit compiled (the config and lengths are static), batched, and stop at EOS:
each output row holds the generated tokens up to and including the first EOS, then zeros.
By default the decoder runs one position per step on a key/value cache (the Flax `cache`
collection); `use_cache=False` is the reference path that re-runs the decoder on the whole
prefix at every step. Both paths compute the same logits, so they pick the same tokens.

The decoder input at step t is `[0, y_0, ..., y_{t-1}]` (T5 starts decoding from the pad id).
"""
import functools
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from private_t5.models.config import T5Config
from private_t5.models.network import Params, Transformer

EOS_ID = 1
# Finite "minus infinity" for beam scores (finite keeps arithmetic NaN-free).
NEG_INF = -1.0e7

StepFn = Callable[[jax.Array, jax.Array, object], Tuple[jax.Array, object]]


def _make_step(params: Params, config: T5Config, encoded: jax.Array, encoder_input_tokens: jax.Array,
               max_decode_length: int, use_cache: bool) -> Tuple[StepFn, object]:
  """Returns `(step, cache)`: `step(sequences, t, cache) -> (logits [B, V] at position t, cache)`.

  `sequences` is `[B, max_decode_length + 1]` with the decoder inputs in its first
  `max_decode_length` columns.
  """
  model = Transformer(config)
  batch = encoded.shape[0]

  if not use_cache:
    def full_step(sequences, t, cache):
      logits = model.apply({"params": params}, encoded, encoder_input_tokens,
                           sequences[:, :max_decode_length], method=Transformer.decode)
      return jax.lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False), cache
    return full_step, ()

  # One full pass over `max_decode_length` dummy positions creates the cache: zeros for the
  # self-attention keys/values, the projected encoder output for cross-attention.
  _, variables = model.apply({"params": params}, encoded, encoder_input_tokens,
                             jnp.zeros((batch, max_decode_length), jnp.int32), decode=True,
                             max_decode_length=max_decode_length, mutable=["cache"],
                             method=Transformer.decode)
  cache = variables["cache"]

  def cached_step(sequences, t, cache):
    token = jax.lax.dynamic_slice_in_dim(sequences, t, 1, axis=1)
    logits, variables = model.apply({"params": params, "cache": cache}, encoded, encoder_input_tokens,
                                    token, decode=True, max_decode_length=max_decode_length,
                                    mutable=["cache"], method=Transformer.decode)
    return logits[:, 0], variables["cache"]

  return cached_step, cache


def _encode(params: Params, config: T5Config, encoder_input_tokens: jax.Array) -> jax.Array:
  return Transformer(config).apply({"params": params}, encoder_input_tokens, method=Transformer.encode)


def _decode_loop(step: StepFn, cache, batch: int, max_decode_length: int, eos_id: int,
                 choose: Callable[[jax.Array, jax.Array], jax.Array],
                 active: Optional[jax.Array] = None) -> jax.Array:
  """One token per row per step until every row has emitted EOS or the length is reached.

  Rows where `active` ([B] bool) is False (a padded batch's filler) count as ended from the
  start: they emit zeros and do not keep the loop running.
  """
  sequences = jnp.zeros((batch, max_decode_length + 1), jnp.int32)
  ended = jnp.zeros((batch,), jnp.bool_) if active is None else ~jnp.asarray(active, jnp.bool_)

  def cond(state):
    t, _, ended, _ = state
    return (t < max_decode_length) & ~jnp.all(ended)

  def body(state):
    t, sequences, ended, cache = state
    logits, cache = step(sequences, t, cache)
    token = jnp.where(ended, 0, choose(logits, t).astype(jnp.int32))
    sequences = jax.lax.dynamic_update_slice_in_dim(sequences, token[:, None], t + 1, axis=1)
    return t + 1, sequences, ended | (token == eos_id), cache

  _, sequences, _, _ = jax.lax.while_loop(cond, body, (jnp.array(0, jnp.int32), sequences, ended, cache))
  return sequences[:, 1:]


@functools.partial(jax.jit, static_argnames=("config", "max_decode_length", "eos_id", "use_cache"))
def greedy_decode(params: Params, config: T5Config, encoder_input_tokens: jax.Array, *,
                  max_decode_length: int, eos_id: int = EOS_ID, use_cache: bool = True,
                  active: Optional[jax.Array] = None) -> jax.Array:
  """Greedy (argmax) decoding: int32 `[B, max_decode_length]`, zeros after the first EOS.

  `active` ([B] bool, optional): False marks padding rows, which decode to zeros (see
  `_decode_loop`); the other rows' tokens do not depend on it.
  """
  encoded = _encode(params, config, encoder_input_tokens)
  step, cache = _make_step(params, config, encoded, encoder_input_tokens, max_decode_length, use_cache)
  choose = lambda logits, t: jnp.argmax(logits, axis=-1)
  return _decode_loop(step, cache, encoder_input_tokens.shape[0], max_decode_length, eos_id, choose, active)


@functools.partial(jax.jit, static_argnames=("config", "max_decode_length", "top_k", "eos_id",
                                             "use_cache"))
def sample_decode(params: Params, config: T5Config, encoder_input_tokens: jax.Array, rng: jax.Array, *,
                  max_decode_length: int, temperature: float = 1.0, top_k: int = 0,
                  eos_id: int = EOS_ID, use_cache: bool = True) -> jax.Array:
  """Ancestral sampling from `softmax(logits / temperature)`, restricted to the `top_k` best
  tokens when `top_k > 0`; `temperature == 0` is greedy. Step t uses `fold_in(rng, t)`."""
  encoded = _encode(params, config, encoder_input_tokens)
  step, cache = _make_step(params, config, encoded, encoder_input_tokens, max_decode_length, use_cache)
  temperature = jnp.asarray(temperature, jnp.float32)

  def choose(logits, t):
    if top_k > 0:
      kth_best = jax.lax.top_k(logits, top_k)[0][:, -1:]
      logits = jnp.where(logits < kth_best, -jnp.inf, logits)
    safe_temperature = jnp.where(temperature > 0, temperature, 1.0)
    sampled = jax.random.categorical(jax.random.fold_in(rng, t), logits / safe_temperature, axis=-1)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1))

  return _decode_loop(step, cache, encoder_input_tokens.shape[0], max_decode_length, eos_id, choose)


def brevity_penalty(alpha: float, length: jax.Array) -> jax.Array:
  """GNMT length penalty `((5 + length) / 6) ** alpha` (Wu et al. 2016), as in T5X."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


@functools.partial(jax.jit, static_argnames=("config", "max_decode_length", "beam_size", "alpha",
                                             "eos_id", "use_cache"))
def beam_search(params: Params, config: T5Config, encoder_input_tokens: jax.Array, *,
                max_decode_length: int, beam_size: int = 4, alpha: float = 0.6, eos_id: int = EOS_ID,
                use_cache: bool = True) -> Tuple[jax.Array, jax.Array]:
  """Beam search with T5X's length normalisation `log p / brevity_penalty(alpha, length)`.

  Returns `(sequences int32 [B, beam_size, max_decode_length], scores [B, beam_size])`, best
  first. Beams still alive at `max_decode_length` are complete hypotheses of that length (a
  fixed-length decode, such as extraction's continuation of T tokens, has no EOS to reach):
  scored with the penalty at `max_decode_length`, they compete with the beams that ended in
  EOS, and the best `beam_size` of both are returned.
  """
  batch, k, length = encoder_input_tokens.shape[0], beam_size, max_decode_length
  encoded = _encode(params, config, encoder_input_tokens)
  # Beams live in the batch dimension, batch-major: row b*K + j is beam j of example b.
  flat_encoded = jnp.repeat(encoded, k, axis=0)
  flat_inputs = jnp.repeat(encoder_input_tokens, k, axis=0)
  step, cache = _make_step(params, config, flat_encoded, flat_inputs, length, use_cache)

  def gather(x, indices):  # x [B, K_in, ...], indices [B, K_out]
    index = indices.reshape(indices.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)

  # A scanned network's cache entries are stacked on a leading layer axis (`scan_layers`).
  rows_axis = 1 if config.scan_layers else 0

  def gather_cache(cache, indices):
    def pick(x):
      if x.ndim <= rows_axis:  # the cache index
        return x
      shaped = jnp.moveaxis(x, rows_axis, 0)
      shaped = shaped.reshape((batch, k) + shaped.shape[1:])
      return jnp.moveaxis(gather(shaped, indices).reshape((batch * k,) + shaped.shape[2:]), 0, rows_axis)
    return jax.tree_util.tree_map(pick, cache)

  state = dict(
      t=jnp.array(0, jnp.int32),
      live_seqs=jnp.zeros((batch, k, length + 1), jnp.int32),
      # Only beam 0 is alive at the start, so the first step does not pick k copies.
      live_logprobs=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (batch, 1)),
      finished_seqs=jnp.zeros((batch, k, length + 1), jnp.int32),
      finished_scores=jnp.full((batch, k), NEG_INF, jnp.float32),
      finished_flags=jnp.zeros((batch, k), jnp.bool_),
      cache=cache,
  )

  def cond(s):
    # Stop early once no live beam can still beat the worst finished one: live log-probs
    # only fall, and the largest penalty divisor is the one at the maximal length.
    best_live = s["live_logprobs"][:, :1] / brevity_penalty(alpha, length)
    worst_finished = jnp.min(s["finished_scores"], axis=1, keepdims=True)
    worst_finished = jnp.where(s["finished_flags"], worst_finished, NEG_INF)
    terminated = jnp.all(worst_finished > best_live)
    return (s["t"] < length) & ~terminated

  def body(s):
    t = s["t"]
    logits, cache = step(s["live_seqs"].reshape(batch * k, length + 1), t, s["cache"])
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(batch, k, vocab)
    candidates = (s["live_logprobs"][:, :, None] + log_probs).reshape(batch, k * vocab)
    # 2K candidates guarantee K that do not end in EOS.
    top_logprobs, top_ids = jax.lax.top_k(candidates, 2 * k)
    origin, tokens = top_ids // vocab, (top_ids % vocab).astype(jnp.int32)
    top_seqs = gather(s["live_seqs"], origin)
    top_seqs = jax.lax.dynamic_update_slice_in_dim(top_seqs, tokens[:, :, None], t + 1, axis=2)
    ended = tokens == eos_id

    live_logprobs, pick = jax.lax.top_k(jnp.where(ended, NEG_INF, top_logprobs), k)
    live_seqs = gather(top_seqs, pick)
    cache = gather_cache(cache, gather(origin, pick))

    new_scores = jnp.where(ended, top_logprobs / brevity_penalty(alpha, t + 1), NEG_INF)
    all_scores = jnp.concatenate([s["finished_scores"], new_scores], axis=1)
    all_seqs = jnp.concatenate([s["finished_seqs"], top_seqs], axis=1)
    all_flags = jnp.concatenate([s["finished_flags"], ended], axis=1)
    finished_scores, pick = jax.lax.top_k(all_scores, k)
    return dict(t=t + 1, live_seqs=live_seqs, live_logprobs=live_logprobs,
                finished_seqs=gather(all_seqs, pick), finished_scores=finished_scores,
                finished_flags=gather(all_flags, pick), cache=cache)

  final = jax.lax.while_loop(cond, body, state)
  # After an early stop no live beam can beat the worst finished one (`cond`), so merging them
  # changes nothing then; at max_decode_length the live beams are finished hypotheses too.
  finished_scores = jnp.where(final["finished_flags"], final["finished_scores"], NEG_INF)
  live_scores = final["live_logprobs"] / brevity_penalty(alpha, length)
  all_scores = jnp.concatenate([finished_scores, live_scores], axis=1)
  scores, pick = jax.lax.top_k(all_scores, k)
  sequences = gather(jnp.concatenate([final["finished_seqs"], final["live_seqs"]], axis=1), pick)
  return sequences[:, :, 1:], scores
