"""The T5 encoder-decoder (v1.0 and v1.1) as a Flax linen module, plus parameter helpers.

Pre-norm residual blocks, RMSNorm without bias, relative position bias shared across the
layers of each stack, attention without 1/sqrt(d) scaling, dropout (Raffel et al. 2020).
Parameter names follow T5X (`token_embedder`, `encoder/layers_0/attention/query/kernel`, ...).
With `T5Config.scan_layers` the layers of a stack are one `nn.scan` and their parameters one
stacked array each (`encoder/layers/attention/query/kernel` `[layers, d_model, joined_kv]`);
`to_layout` converts any tree of the parameters' structure between the two layouts.
`T5Config.remat_policy` wraps each layer in `nn.remat` (`jax.checkpoint`).
"""
import functools
from typing import Any, Dict, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from private_t5.models import layers
from private_t5.models import lora as lora_lib
from private_t5.models.config import T5Config

Params = Dict[str, Any]
# The scanned stack's name in `encoder/` and `decoder/`, and its parameters' leading logical axis
# (never sharded: no rule of `models.sharding` names it).
STACK, LAYERS_AXIS = "layers", "layers"
_REMAT_POLICIES = {"minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                   "full": jax.checkpoint_policies.nothing_saveable}


def _dropout(config: T5Config, x: jax.Array, enable_dropout: bool) -> jax.Array:
  if enable_dropout and config.dropout_rate > 0:
    return nn.Dropout(config.dropout_rate)(x, deterministic=False)
  return x


class EncoderLayer(nn.Module):
  """Self-attention then feed-forward, each as `x + dropout(f(norm(x)))`."""
  config: T5Config
  lora: Optional[lora_lib.LoraConfig] = None

  @nn.compact
  def __call__(self, x, mask, bias, enable_dropout=False, per_layer=None):
    """`per_layer`: a scanned stack's per-layer inputs (`layers.stack_inputs`), unused here."""
    cfg, dtype = self.config, jnp.dtype(self.config.dtype)
    y = layers.RMSNorm(dtype=dtype, name="pre_attention_layer_norm")(x)
    y = layers.MultiHeadAttention(cfg.num_heads, cfg.d_kv, cfg.dropout_rate, dtype, lora=self.lora,
                                  implementation=cfg.attention, name="attention")(
        y, y, mask, bias, enable_dropout=enable_dropout)
    x = x + _dropout(cfg, y, enable_dropout)
    y = layers.RMSNorm(dtype=dtype, name="pre_mlp_layer_norm")(x)
    y = layers.MlpBlock(cfg.d_ff, cfg.feed_forward, cfg.dropout_rate, dtype, lora=self.lora, name="mlp")(
        y, enable_dropout=enable_dropout)
    return _layer_output(cfg, x + _dropout(cfg, y, enable_dropout))


def _layer_output(cfg: T5Config, x):
  """A layer's output; `(x, None)` (the carry and no per-layer output) for `nn.scan`."""
  return (x, None) if cfg.scan_layers else x


def _run_stack(parent: nn.Module, layer_cls, count: int, static_argnums: Tuple[int, ...], x, *args):
  """`x` through `count` layers of `layer_cls`, each called with `(x, *args)`: unrolled (`layers_i`)
  or one `nn.scan` (`layers`, `scan_layers`), each layer under `nn.remat` if `remat_policy` says.
  `static_argnums` (counting the module as 0) are the Python arguments (dropout, decode). A scanned
  stack also scans over the per-layer inputs of `layers.stack_inputs` (a last argument of each
  layer) and hands what its layers return beside the residual stream to `layers.stack_outputs`."""
  cfg, lora = parent.config, parent.lora
  if cfg.remat_policy != "none":
    layer_cls = nn.remat(layer_cls, policy=_REMAT_POLICIES[cfg.remat_policy], static_argnums=static_argnums,
                         prevent_cse=not cfg.scan_layers)  # scan already keeps XLA from merging
  if not cfg.scan_layers:
    for i in range(count):
      x = layer_cls(cfg, lora, name=f"layers_{i}")(x, *args)
    return x
  stack = nn.scan(layer_cls, variable_axes={"params": 0, "cache": 0},
                  split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * len(args) + (0,),
                  length=count, metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})
  path = tuple(parent.path) + (STACK,)
  x, outputs = stack(cfg, lora, name=STACK)(x, *args, layers.stack_inputs(path))
  layers.stack_outputs(path, outputs)
  return x


class DecoderLayer(nn.Module):
  """Causal self-attention, attention over the encoder output, then feed-forward."""
  config: T5Config
  lora: Optional[lora_lib.LoraConfig] = None

  @nn.compact
  def __call__(self, x, encoded, self_mask, cross_mask, bias, enable_dropout=False, decode=False,
               per_layer=None):
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
    return _layer_output(cfg, x + _dropout(cfg, y, enable_dropout))


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
    x = _run_stack(self, EncoderLayer, cfg.num_encoder_layers, (4,), x, mask, bias, enable_dropout)
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
    x = _run_stack(self, DecoderLayer, cfg.num_decoder_layers, (6, 7), x, encoded, self_mask, cross_mask, bias,
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
  does not depend on the device mesh it is sharded over (partitionable threefry). A scanned
  network (`scan_layers`) gets the same values, stacked (`to_layout`).
  """
  unrolled = config.replace(scan_layers=False, remat_policy="none")
  draw = functools.partial(_draw_grouped, _initializer_groups(unrolled))
  return jax.jit(lambda key: to_layout(draw(key), config.scan_layers))(rng)


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


def is_scanned(tree: Params) -> bool:
  """Whether a tree of the parameters' structure is in the scanned layout (`encoder/layers`)."""
  return isinstance(tree, dict) and STACK in tree.get("encoder", {})


def to_layout(tree: Any, scanned: bool) -> Any:
  """`tree` (the parameters, or any tree holding trees of their structure: optimizer state, logical
  axes, `jax.ShapeDtypeStruct`s) with the layers of `encoder/` and `decoder/` in the scanned
  layout (`layers/...`, each leaf the stack of the `layers_i` leaves on a new axis 0) or the
  unrolled one (`layers_0/...`, `layers_1/...`). A tree already in that layout is returned as it
  is; the conversion moves no value (stacking and slicing), so a round trip is bit-identical.
  Logical-axis tuples gain (lose) the leading `layers` axis."""
  if isinstance(tree, dict):
    # (`layers` is a stack's subtree, a dict of layer modules, never a leaf of that name.)
    if ("layers_0" in tree and scanned) or (not scanned and isinstance(tree.get(STACK), dict)):
      return _stacked(tree) if scanned else _unstacked(tree)
    return {k: to_layout(v, scanned) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)) and not _is_axes(tree):
    converted = [to_layout(v, scanned) for v in tree]
    return type(tree)(*converted) if hasattr(tree, "_fields") else type(tree)(converted)
  return tree


def _is_axes(node) -> bool:
  return isinstance(node, tuple) and all(isinstance(a, (str, type(None))) for a in node) and len(node) > 0


def _stacked(stack_parent: dict) -> dict:
  count = sum(1 for k in stack_parent if k.startswith("layers_"))
  names = [f"layers_{i}" for i in range(count)]
  if set(names) != {k for k in stack_parent if k.startswith("layers_")}:
    raise ValueError(f"layers are not numbered 0..{count - 1}: {sorted(stack_parent)}")
  out = {k: v for k, v in stack_parent.items() if not k.startswith("layers_")}
  out[STACK] = jax.tree.map(lambda *xs: _stack_leaves(xs), *[stack_parent[n] for n in names], is_leaf=_is_axes)
  return out


def _unstacked(stack_parent: dict) -> dict:
  out = {k: v for k, v in stack_parent.items() if k != STACK}
  stack = stack_parent[STACK]
  first = jax.tree.leaves(stack, is_leaf=_is_axes)[0]
  count = None if _is_axes(first) else first.shape[0]
  if count is None:
    raise ValueError("the number of layers of logical axes alone is unknown; convert shapes instead")
  for i in range(count):
    out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: _layer_of(x, i), stack, is_leaf=_is_axes)
  return out


def _stack_leaves(leaves):
  first = leaves[0]
  if _is_axes(first):
    return (LAYERS_AXIS,) + first
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(leaves),) + tuple(first.shape), first.dtype,
                                sharding=_moved_sharding(first.sharding, +1))
  if isinstance(first, np.ndarray):
    return np.stack(leaves)
  return jnp.stack(leaves)


def _layer_of(leaf, i: int):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype, sharding=_moved_sharding(leaf.sharding, -1))
  return leaf[i]


def _moved_sharding(sharding, change: int):
  """A `NamedSharding` with an unsharded leading layer axis added (+1) or removed (-1)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  spec = tuple(sharding.spec)
  spec = (None,) + spec if change > 0 else spec[1:]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
