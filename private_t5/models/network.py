"""The T5 encoder-decoder (v1.0 and v1.1) as a Flax linen module, plus parameter helpers.

Pre-norm residual blocks, RMSNorm without bias, relative position bias shared across the
layers of each stack, attention without 1/sqrt(d) scaling, dropout (Raffel et al. 2020).
Parameter names follow T5X (`token_embedder`, `encoder/layers_0/attention/query/kernel`, ...).
"""
import functools
from typing import Any, Dict, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from private_t5.models import layers
from private_t5.models import lora as lora_lib
from private_t5.models.config import T5Config

Params = Dict[str, Any]


def _dropout(config: T5Config, x: jax.Array, enable_dropout: bool) -> jax.Array:
  if enable_dropout and config.dropout_rate > 0:
    return nn.Dropout(config.dropout_rate)(x, deterministic=False)
  return x


class EncoderLayer(nn.Module):
  """Self-attention then feed-forward, each as `x + dropout(f(norm(x)))`."""
  config: T5Config
  lora: Optional[lora_lib.LoraConfig] = None

  @nn.compact
  def __call__(self, x, mask, bias, enable_dropout=False):
    cfg, dtype = self.config, jnp.dtype(self.config.dtype)
    y = layers.RMSNorm(dtype=dtype, name="pre_attention_layer_norm")(x)
    y = layers.MultiHeadAttention(cfg.num_heads, cfg.d_kv, cfg.dropout_rate, dtype, lora=self.lora,
                                  implementation=cfg.attention, name="attention")(
        y, y, mask, bias, enable_dropout=enable_dropout)
    x = x + _dropout(cfg, y, enable_dropout)
    y = layers.RMSNorm(dtype=dtype, name="pre_mlp_layer_norm")(x)
    y = layers.MlpBlock(cfg.d_ff, cfg.feed_forward, cfg.dropout_rate, dtype, lora=self.lora, name="mlp")(
        y, enable_dropout=enable_dropout)
    return x + _dropout(cfg, y, enable_dropout)


class DecoderLayer(nn.Module):
  """Causal self-attention, attention over the encoder output, then feed-forward."""
  config: T5Config
  lora: Optional[lora_lib.LoraConfig] = None

  @nn.compact
  def __call__(self, x, encoded, self_mask, cross_mask, bias, enable_dropout=False, decode=False):
    cfg, dtype = self.config, jnp.dtype(self.config.dtype)
    attention = functools.partial(layers.MultiHeadAttention, cfg.num_heads, cfg.d_kv,
                                  cfg.dropout_rate, dtype, lora=self.lora, implementation=cfg.attention)
    y = layers.RMSNorm(dtype=dtype, name="pre_self_attention_layer_norm")(x)
    y = attention(name="self_attention")(y, y, self_mask, bias, enable_dropout=enable_dropout,
                                         decode=decode)
    x = x + _dropout(cfg, y, enable_dropout)
    y = layers.RMSNorm(dtype=dtype, name="pre_cross_attention_layer_norm")(x)
    y = attention(cross_attention=True, name="encoder_decoder_attention")(
        y, encoded, cross_mask, None, enable_dropout=enable_dropout, decode=decode)
    x = x + _dropout(cfg, y, enable_dropout)
    y = layers.RMSNorm(dtype=dtype, name="pre_mlp_layer_norm")(x)
    y = layers.MlpBlock(cfg.d_ff, cfg.feed_forward, cfg.dropout_rate, dtype, lora=self.lora, name="mlp")(
        y, enable_dropout=enable_dropout)
    return x + _dropout(cfg, y, enable_dropout)


class Encoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module
  lora: Optional[lora_lib.LoraConfig] = None

  @nn.compact
  def __call__(self, encoder_input_tokens, enable_dropout=False):
    cfg, dtype = self.config, jnp.dtype(self.config.dtype)
    length = encoder_input_tokens.shape[-1]
    bias = layers.RelativePositionBias(cfg.relative_attention_num_buckets,
                                       cfg.relative_attention_max_distance, cfg.num_heads, dtype,
                                       name="relpos_bias")(length, length, bidirectional=True)
    # Padding tokens (id 0) are never attended to.
    mask = (encoder_input_tokens > 0)[:, None, None, :]
    x = _dropout(cfg, self.shared_embedding(encoder_input_tokens.astype(jnp.int32)), enable_dropout)
    for i in range(cfg.num_encoder_layers):
      x = EncoderLayer(cfg, self.lora, name=f"layers_{i}")(x, mask, bias, enable_dropout)
    x = layers.RMSNorm(dtype=dtype, name="encoder_norm")(x)
    return _dropout(cfg, x, enable_dropout)


class Decoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module
  lora: Optional[lora_lib.LoraConfig] = None

  @nn.compact
  def __call__(self, encoded, encoder_input_tokens, decoder_input_tokens, enable_dropout=False,
               decode=False, max_decode_length: Optional[int] = None):
    cfg, dtype = self.config, jnp.dtype(self.config.dtype)
    length = decoder_input_tokens.shape[-1]
    if decode and not max_decode_length:
      raise ValueError("cached decoding needs max_decode_length")
    # Without a cache the positions are padded to a multiple of 8 (cuBLAS's tensor-core tile; XLA
    # would pad every attention product's operands instead): with causal self-attention the real
    # positions never see the padding, whose outputs are cut off before the logits.
    padded = length if decode else -(-length // 8) * 8
    if padded != length:
      decoder_input_tokens = jnp.pad(decoder_input_tokens, ((0, 0), (0, padded - length)))
    # With a cache the bias covers all positions and attention takes the current query's row.
    bias_length = max_decode_length if decode else padded
    bias = layers.RelativePositionBias(cfg.relative_attention_num_buckets,
                                       cfg.relative_attention_max_distance, cfg.num_heads, dtype,
                                       name="relpos_bias")(bias_length, bias_length, bidirectional=False)
    self_mask = jnp.tril(jnp.ones((padded, padded), jnp.bool_))[None, None]
    cross_mask = (encoder_input_tokens > 0)[:, None, None, :]
    x = _dropout(cfg, self.shared_embedding(decoder_input_tokens.astype(jnp.int32)), enable_dropout)
    for i in range(cfg.num_decoder_layers):
      x = DecoderLayer(cfg, self.lora, name=f"layers_{i}")(x, encoded, self_mask, cross_mask, bias,
                                                enable_dropout, decode)
    x = layers.RMSNorm(dtype=dtype, name="decoder_norm")(x[:, :length])
    x = _dropout(cfg, x, enable_dropout)
    if cfg.tie_embeddings:
      # T5 v1.0: tied output layer with logits scaled by d_model**-0.5 (Mesh TF T5).
      logits = self.shared_embedding.attend(x) / jnp.sqrt(jnp.asarray(cfg.d_model, jnp.float32)).astype(dtype)
    else:
      logits = layers.Dense(cfg.vocab_size, ("embed", "vocab"), dtype, name="logits_dense")(x)
    return logits.astype(jnp.float32)


class Transformer(nn.Module):
  """T5 encoder-decoder: `apply({"params": p}, enc_tokens, dec_tokens) -> logits [B, Lt, V]`.

  With `lora` (`models.lora.LoraConfig`) its targeted dense layers carry low-rank adapters.
  """
  config: T5Config
  lora: Optional[lora_lib.LoraConfig] = None

  def setup(self):
    cfg = self.config
    self.token_embedder = layers.Embed(cfg.vocab_size, cfg.d_model, jnp.dtype(cfg.dtype))
    self.encoder = Encoder(cfg, self.token_embedder, self.lora)
    self.decoder = Decoder(cfg, self.token_embedder, self.lora)

  def encode(self, encoder_input_tokens, enable_dropout: bool = False):
    """Encoder output `[B, Li, d_model]`."""
    return self.encoder(encoder_input_tokens, enable_dropout)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens, enable_dropout: bool = False,
             decode: bool = False, max_decode_length: Optional[int] = None):
    """Logits `[B, Lt, V]`; with `decode=True` (and `mutable=["cache"]`) uses the KV cache.

    The first `decode=True` call, on `[B, max_decode_length]` inputs, creates the cache;
    each later call feeds one token `[B, 1]` and returns its logits `[B, 1, V]`.
    """
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens, enable_dropout,
                        decode, max_decode_length)

  def __call__(self, encoder_input_tokens, decoder_input_tokens, enable_dropout: bool = False):
    encoded = self.encode(encoder_input_tokens, enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens, enable_dropout)


def _init_boxed(config: T5Config, rng: jax.Array, input_length: int = 4, target_length: int = 4,
                lora: Optional[lora_lib.LoraConfig] = None):
  model = Transformer(config, lora)
  enc = jnp.ones((1, input_length), jnp.int32)
  dec = jnp.ones((1, target_length), jnp.int32)
  return model.init({"params": rng}, enc, dec)["params"]


def init_params(config: T5Config, rng: jax.Array) -> Params:
  """Freshly initialised parameters as a plain (unboxed) nested dict of float32 arrays.

  Each parameter is drawn from its own initializer (the one the Flax module declares), but the
  parameters that share an initializer and a shape are drawn together, by one call of it
  vmapped over independent keys (`jax.random.split`), rather than one call per parameter as
  Flax's `init` does. The values have the same distribution; the program has one random-number
  kernel per group (about ten for T5 v1.1) instead of one per parameter (148), which is most
  of what compiling the initialisation cost (measured in docs/ghost_clipping.md). The result
  does not depend on the device mesh it is sharded over (partitionable threefry).
  """
  return jax.jit(functools.partial(_draw_grouped, _initializer_groups(config)))(rng)


@functools.lru_cache(maxsize=None)
def _initializer_groups(config: T5Config) -> Tuple[Tuple[Any, Tuple[int, ...], Tuple[Tuple[str, ...], ...]], ...]:
  """((initializer, shape, parameter paths), ...) of `config`'s network, in creation order (one
  trace of the Flax module per config)."""
  with layers.recording_initializers() as initializers:
    jax.eval_shape(functools.partial(_init_boxed, config), jax.random.PRNGKey(0))
  groups: Dict[Any, list] = {}
  for path, (init, shape) in initializers.items():
    groups.setdefault((init, shape), []).append(path)
  return tuple((init, shape, tuple(paths)) for (init, shape), paths in groups.items())


def _draw_grouped(groups, rng: jax.Array) -> Params:
  """The parameters of `_initializer_groups`, one vmapped draw per (initializer, shape)."""
  params = {}
  for key, (init, shape, paths) in zip(jax.random.split(rng, len(groups)), groups):
    draws = jax.vmap(lambda k, init=init, shape=shape: init(k, shape, jnp.float32))(
        jax.random.split(key, len(paths)))
    params.update({path: draws[row] for row, path in enumerate(paths)})
  return flax.traverse_util.unflatten_dict(params)


def param_shapes(config: T5Config) -> Params:
  """`jax.ShapeDtypeStruct` tree of the parameters, without allocating them."""
  boxed = jax.eval_shape(functools.partial(_init_boxed, config), jax.random.PRNGKey(0))
  return nn.unbox(boxed)


def param_logical_axes(config: T5Config) -> Params:
  """The parameter tree with each leaf replaced by its tuple of logical axis names."""
  boxed = jax.eval_shape(functools.partial(_init_boxed, config), jax.random.PRNGKey(0))
  return jax.tree_util.tree_map(lambda p: tuple(p.names), boxed,
                                is_leaf=lambda p: isinstance(p, nn.Partitioned))


def num_params(config: T5Config) -> int:
  """Total number of parameters (computed from shapes only)."""
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(param_shapes(config)))


def init_adapters(config: T5Config, lora: lora_lib.LoraConfig, rng: jax.Array) -> Params:
  """Fresh LoRA adapters (A random, B zero) of `config`'s network, as a plain nested dict."""
  init = lambda key: lora_lib.adapters_of(nn.unbox(_init_boxed(config, key, lora=lora)))
  return jax.jit(init)(rng)  # the base parameters' initialisation is dead code, dropped by XLA


def adapter_logical_axes(config: T5Config, lora: lora_lib.LoraConfig) -> Params:
  """The adapters' tree with each leaf replaced by its tuple of logical axis names."""
  boxed = jax.eval_shape(functools.partial(_init_boxed, config, lora=lora), jax.random.PRNGKey(0))
  axes = jax.tree_util.tree_map(lambda p: tuple(p.names), boxed,
                                is_leaf=lambda p: isinstance(p, nn.Partitioned))
  return lora_lib.adapters_of(axes)
