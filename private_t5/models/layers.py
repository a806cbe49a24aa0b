"""Building blocks of the T5 network (Flax linen).

Every dense layer is a plain `x @ kernel` on a 2-D kernel, so that per-example gradient
norms can later be computed layer by layer from activations and output gradients. Every
parameter carries logical axis names (`nn.with_logical_partitioning`) for mesh sharding.
"""
import contextlib
import contextvars
import functools
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from private_t5.models.lora import A_NAME, B_NAME, LoraConfig

Initializer = Callable[..., jax.Array]
# A large negative logit for masked attention positions (not -inf, so that a row whose keys
# are all masked, such as a padding row, gives uniform weights instead of NaN).
NEG_INF = -1e10

default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
relative_bias_init = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")


@functools.lru_cache(maxsize=None)
def query_kernel_init(head_dim: int) -> Initializer:
  """`default_kernel_init / sqrt(head_dim)` (T5's unscaled attention moves the 1/sqrt(d) into the
  query's initialisation). One object per head_dim, so `network.init_params` draws every query
  kernel of a network in one group."""
  scale = np.float32(1.0 / np.sqrt(head_dim))
  return lambda *a: default_kernel_init(*a) * scale


InitializerRecord = Dict[Tuple[str, ...], Tuple[Initializer, Tuple[int, ...]]]
# Set by `recording_initializers`: where `_param` notes each parameter's initializer and shape.
_INITIALIZERS: contextvars.ContextVar = contextvars.ContextVar("initializers", default=None)


@contextlib.contextmanager
def recording_initializers() -> Iterator[InitializerRecord]:
  """Collects `{parameter path: (initializer, shape)}` of the parameters created inside (for
  `network.init_params`, which draws them grouped)."""
  record: InitializerRecord = {}
  token = _INITIALIZERS.set(record)
  try:
    yield record
  finally:
    _INITIALIZERS.reset(token)


def _param(module: nn.Module, name: str, init: Initializer, shape: Sequence[int],
           axes: Tuple[str, ...]) -> jax.Array:
  """Every parameter of the network is made here (float32, with logical axis names)."""
  record = _INITIALIZERS.get()
  if record is not None:
    record[tuple(module.path) + (name,)] = (init, tuple(shape))
  return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), jnp.float32)


# Set by `scan_hook`: an object with `stack_inputs(path) -> pytree` (per-layer inputs of the scanned
# stack at `path`, each leaf with a leading layer axis) and `stack_outputs(path, outputs)` (what the
# stack's layers returned beside the residual stream, stacked), e.g. ghost clipping's recorder.
_SCAN_HOOK: contextvars.ContextVar = contextvars.ContextVar("scan_hook", default=None)


@contextlib.contextmanager
def scan_hook(hook) -> Iterator[None]:
  """Lets `hook` feed each scanned stack (`T5Config.scan_layers`) per-layer inputs and read its
  per-layer outputs while the network is traced inside (see `_SCAN_HOOK`)."""
  token = _SCAN_HOOK.set(hook)
  try:
    yield
  finally:
    _SCAN_HOOK.reset(token)


def stack_inputs(path: Tuple[str, ...]):
  """The hook's per-layer inputs of the stack at `path` ({} without a hook)."""
  hook = _SCAN_HOOK.get()
  return {} if hook is None else hook.stack_inputs(path)


def stack_outputs(path: Tuple[str, ...], outputs) -> None:
  """Hands the stack's stacked per-layer outputs to the hook (dropped without one)."""
  hook = _SCAN_HOOK.get()
  if hook is not None:
    hook.stack_outputs(path, outputs)


# Parameters every layer casts to its compute dtype where it reads them (Dense, Embed,
# RelativePositionBias); RMSNorm's `scale` multiplies in float32 and is not one of them.
CAST_AT_USE = ("kernel", "embedding", "rel_embedding")


def cast_at_use(params, dtype):
  """`params` with the `CAST_AT_USE` leaves cast to `dtype` once: the model computes the same
  values from them (each layer's cast becomes a no-op), without a cast on every use, e.g. on
  every step of a decode loop, where XLA does not hoist the casts out of the loop."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return params

  def cast(path, leaf):
    name = getattr(path[-1], "key", None) if path else None
    return leaf.astype(dtype) if name in CAST_AT_USE and jnp.issubdtype(leaf.dtype, jnp.floating) else leaf
  return jax.tree_util.tree_map_with_path(cast, params)


class Dense(nn.Module):
  """`y = x @ kernel` without bias; kernel `[in, out]` named by `kernel_axes`.

  With `lora` set (`models.lora`), `y = x @ kernel + (alpha / r) dropout(x) @ A @ B`: two inner
  `Dense` layers `lora_a` (`[in, r]`, random init) and `lora_b` (`[r, out]`, zeros).
  """
  features: int
  kernel_axes: Tuple[str, str]
  dtype: jnp.dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  lora: Optional[LoraConfig] = None

  @nn.compact
  def __call__(self, x: jax.Array, enable_dropout: bool = False) -> jax.Array:
    kernel = _param(self, "kernel", self.kernel_init, (x.shape[-1], self.features), self.kernel_axes)
    y = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
    if self.lora is None:
      return y
    h = x
    if enable_dropout and self.lora.dropout > 0:
      h = nn.Dropout(self.lora.dropout)(h, deterministic=False)
    h = Dense(self.lora.rank, (self.kernel_axes[0], "lora_rank"), self.dtype, name=A_NAME)(h)
    h = Dense(self.features, ("lora_rank", self.kernel_axes[1]), self.dtype, kernel_init=nn.initializers.zeros,
              name=B_NAME)(h)
    return y + jnp.asarray(self.lora.scaling, self.dtype) * h


def _adapted(lora: Optional[LoraConfig], name: str) -> Optional[LoraConfig]:
  """`lora` if the dense layer `name` is one of its targets, else None."""
  return lora if lora is not None and lora.adapts(name) else None


class Embed(nn.Module):
  """Token embedding `[vocab, embed]`; `attend` is the tied output projection."""
  num_embeddings: int
  features: int
  dtype: jnp.dtype = jnp.float32
  # T5 initialises embeddings with unit variance (logits are rescaled when tied).
  embedding_init: Initializer = nn.initializers.normal(stddev=1.0)

  def setup(self):
    self.embedding = _param(self, "embedding", self.embedding_init,
                            (self.num_embeddings, self.features), ("vocab", "embed"))

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

  def attend(self, query: jax.Array) -> jax.Array:
    return jnp.dot(query.astype(self.dtype), self.embedding.T.astype(self.dtype))


class RMSNorm(nn.Module):
  """T5 layer norm: scale only, no bias and no mean subtraction (eps 1e-6)."""
  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("embed",))
    x = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(variance + self.epsilon) * scale).astype(self.dtype)


def relative_position_bucket(relative_position: np.ndarray, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> np.ndarray:
  """T5's bucketing of `memory_position - query_position` (Raffel et al. 2020, Sec. 2.1).

  Half of the buckets hold exact small offsets; the rest grow logarithmically up to
  `max_distance`, beyond which all offsets share the last bucket. Bidirectional (encoder)
  buckets split first by the sign of the offset; causal (decoder) buckets only see the past.
  """
  ret = np.zeros_like(relative_position)
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0).astype(np.int32) * num_buckets
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  val_if_large = max_exact + (
      np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
      / np.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(np.int32)
  val_if_large = np.minimum(val_if_large, num_buckets - 1)
  return ret + np.where(is_small, n, val_if_large)


def offset_buckets(q_len: int, k_len: int, bidirectional: bool, num_buckets: int,
                   max_distance: int) -> np.ndarray:
  """The bucket of every offset `k - q` of a `[q_len, k_len]` attention: int32 `[q_len + k_len - 1]`.

  Entry `j` is the bucket of offset `j - (q_len - 1)`; the bucket of pair (q, k) is entry
  `k - q + q_len - 1`. A bucket depends on the offset alone, so this vector (not a
  `[q_len, k_len]` matrix) is all a program needs to hold.
  """
  offsets = np.arange(-(q_len - 1), k_len, dtype=np.int32)
  return relative_position_bucket(offsets, bidirectional, num_buckets, max_distance).astype(np.int32)


def offset_index(q_len: int, k_len: int) -> jax.Array:
  """`k - q + q_len - 1` for every (q, k): int32 `[q_len, k_len]`, computed in the program (iota)."""
  return (jax.lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
          - jax.lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0) + (q_len - 1))


class RelativePositionBias(nn.Module):
  """One learned bias per (head, bucket), shared by all layers of a stack."""
  num_buckets: int
  max_distance: int
  num_heads: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, q_len: int, k_len: int, bidirectional: bool) -> jax.Array:
    """Returns the additive bias `[1, heads, q_len, k_len]`."""
    buckets = offset_buckets(q_len, k_len, bidirectional, self.num_buckets, self.max_distance)
    table = _param(self, "rel_embedding", relative_bias_init, (self.num_heads, self.num_buckets),
                   ("heads", "relpos_buckets"))
    per_offset = jnp.take(table, jnp.asarray(buckets), axis=1)  # [heads, q + k - 1]
    bias = jnp.take(per_offset, offset_index(q_len, k_len), axis=1)  # [heads, q, k]
    return bias[None].astype(self.dtype)


def cudnn_attention_inputs(mask: Optional[jax.Array], bias: Optional[jax.Array], batch: int,
                           q_len: int, k_len: int, dtype) -> Dict[str, jax.Array]:
  """The keyword arguments of `jax.nn.dot_product_attention(implementation="cudnn")` that mask
  and bias T5 attention as `mask` (boolean `[B|1, 1, q|1, k]`) and `bias` (`[1, heads, q, k]`) do.

  cuDNN's fused kernel takes one additive bias (jax folds a boolean mask into it) whose last two
  dimensions are exactly `[q, k]`, and it computes the gradient of that bias only when its batch
  dimension is 1: a bias broadcast over the batch gets a zero gradient, silently. So

  * without a bias (cross-attention: T5 has no position bias there), the padding mask is
    broadcast to `[B, 1, q, k]` (any padding pattern; nothing to differentiate);
  * with the relative position bias (self-attention), the bias stays `[1, heads, q, k]` in the
    activations' dtype; a key padding mask (the encoder's) becomes `key_value_seq_lengths`, the
    number of non-padding keys of each example: cuDNN's padding mask, which masks the keys from
    that length on; it equals the boolean mask for inputs padded at the end, as T5's are. A mask
    over (query, key) shared by the batch (the decoder's causal mask) is folded into the bias.
  """
  inputs: Dict[str, jax.Array] = {}
  if bias is not None:
    if bias.shape[0] != 1:
      raise ValueError(f"cuDNN attention computes the gradient of a bias of batch 1 only, got a bias of "
                       f"shape {bias.shape}")
    inputs["bias"] = bias.astype(dtype)
  if mask is None:
    return inputs
  if bias is None:
    inputs["mask"] = jnp.broadcast_to(mask, (mask.shape[0], 1, q_len, k_len))
  elif mask.shape[2] == 1:
    # At least one key: an input of padding only (a filler row) attends to its first position
    # rather than asking the kernel for a softmax over no keys.
    lengths = jnp.maximum(jnp.sum(mask[:, 0, 0, :], axis=-1, dtype=jnp.int32), 1)
    inputs["key_value_seq_lengths"] = jnp.broadcast_to(lengths, (batch,))
  elif mask.shape[0] == 1:
    inputs["mask"] = jnp.broadcast_to(mask, (1, 1, q_len, k_len))
  else:
    raise ValueError(f"cuDNN attention with a bias takes a per-example mask over keys only "
                     f"([B, 1, 1, k]), got a mask of shape {mask.shape}")
  return inputs


def _attention(implementation: str, query, key, value, bias, mask, lengths) -> jax.Array:
  """T5 attention (scale 1) by one `jax.nn.dot_product_attention` call."""
  return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, key_value_seq_lengths=lengths,
                                      scale=1.0, implementation=implementation)


def _attention_vjp(implementation: str, query, key, value, bias, mask, lengths, g):
  """The cotangents of (query, key, value, bias) of `_attention` for the output cotangent `g`."""
  attend = lambda q, k, v, b: _attention(implementation, q, k, v, b, mask, lengths)
  return jax.vjp(attend, query, key, value, bias)[1](g)


# A masked logit in cuDNN's additive bias: large but finite in the activations' dtype (jax's value
# for its own folded masks; cuDNN mishandles the difference of two infinities).
_CUDNN_MASKED = {jnp.dtype(jnp.bfloat16): -2.0 ** 41, jnp.dtype(jnp.float16): -2.0 ** 15}


def _batched(axis_size: int, in_batched, args):
  """`args` with the vmapped axis made explicit on every array (None stays None)."""
  return [None if x is None else (x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape))
          for x, batched in zip(args, in_batched)]


def _as_heads(x: jax.Array) -> jax.Array:
  """[V, b, T, N, H] -> [1, T, V b N, H]: every (example, row, head) one head of a batch of one."""
  v, b, t, n, h = x.shape
  return jnp.moveaxis(x, 2, 0).reshape(1, t, v * b * n, h)


def _from_heads(x: jax.Array, v: int, b: int) -> jax.Array:
  """The inverse of `_as_heads`."""
  _, t, _, h = x.shape
  return jnp.moveaxis(x.reshape(t, v, b, -1, h), 0, 2)


def _folded(query, key, value, bias, mask, lengths):
  """Batched attention inputs (leading vmapped axis V on each) as the inputs of one unbatched
  cuDNN call computing the same attention for each example, bias gradient included.

  cuDNN differentiates only a bias of batch 1, summing over the batch. With a bias, the examples
  therefore become heads: queries, keys and values `[1, T, V b N, H]` and the bias, its masked
  positions set to a large negative logit (the key lengths and the shared mask folded in),
  `[1, V b N, T, S]`; the bias gradient cuDNN returns is then each example's own. Without a
  bias (nothing to differentiate but queries, keys and values) the examples join the batch.
  """
  v, b, t, n, h = query.shape
  s = key.shape[2]
  if bias is None:
    merge = lambda x: None if x is None else x.reshape((v * x.shape[1],) + x.shape[2:])
    mask = None if mask is None else merge(jnp.broadcast_to(mask, (v, b) + mask.shape[2:]))
    lengths = None if lengths is None else merge(jnp.broadcast_to(lengths, (v, b)))
    return merge(query), merge(key), merge(value), None, mask, lengths
  valid = jnp.ones((v, b, 1, t, s), jnp.bool_)
  if mask is not None:
    valid = valid & mask  # [V, 1, 1, T, S]: a mask over (query, key) shared by the rows
  if lengths is not None:
    valid = valid & (jnp.arange(s) < jnp.broadcast_to(lengths, (v, b))[:, :, None, None, None])
  masked = jnp.asarray(_CUDNN_MASKED.get(jnp.dtype(bias.dtype), NEG_INF), bias.dtype)
  bias = jnp.where(valid, jnp.broadcast_to(bias, (v, b, n, t, s)), masked).reshape(1, v * b * n, t, s)
  return _as_heads(query), _as_heads(key), _as_heads(value), bias, None, None


def _unfolded(out: jax.Array, query: jax.Array, bias) -> jax.Array:
  """The attention output of `_folded`'s call, back in the batched layout of `query`."""
  v, b = query.shape[:2]
  return out.reshape(query.shape) if bias is None else _from_heads(out, v, b)


def _forward_folded(axis_size, in_batched, query, key, value, bias, mask, lengths):
  """`custom_vmap` rule of the forward call: one cuDNN call for all the examples."""
  args = _batched(axis_size, in_batched, (query, key, value, bias, mask, lengths))
  out = _unfolded(_cudnn_forward(*_folded(*args)), args[0], args[3])
  return out, True


def _backward_folded(axis_size, in_batched, query, key, value, bias, mask, lengths, g):
  """`custom_vmap` rule of the backward call: one cuDNN call, each example's own cotangents
  (the transpose of `_folded`, a reshape, moves them back)."""
  q, k, v, bias, mask, lengths, g = _batched(axis_size, in_batched,
                                             (query, key, value, bias, mask, lengths, g))
  fold = lambda *x: _folded(*x, mask, lengths)[:4]
  folded, transpose = jax.vjp(fold, q, k, v, bias)
  g_folded = g.reshape(folded[0].shape) if bias is None else _as_heads(g)
  cotangents = _cudnn_backward(*folded, None, None, g_folded) if bias is not None else \
      _cudnn_backward(*_folded(q, k, v, None, mask, lengths), g_folded)
  grads = transpose(tuple(cotangents[:3]) + (None if bias is None else cotangents[3],))
  return tuple(grads), jax.tree.map(lambda _: True, tuple(grads))


_cudnn_forward = jax.custom_batching.custom_vmap(functools.partial(_attention, "cudnn"))
_cudnn_forward.def_vmap(_forward_folded)
_cudnn_backward = jax.custom_batching.custom_vmap(functools.partial(_attention_vjp, "cudnn"))
_cudnn_backward.def_vmap(_backward_folded)


@jax.custom_vjp
def cudnn_attention(query, key, value, bias, mask, lengths) -> jax.Array:
  """`_attention` on cuDNN's fused kernel, with inputs from `cudnn_attention_inputs`; under
  `jax.vmap` (per-example gradients, the DP paths) too, forward and backward.

  cuDNN differentiates the bias of the whole batch it is given: under `jax.vmap` jax's own
  batching rule would hand it the examples as one batch, and the bias gradient would come back
  zero (a bias that differs by example) or summed over the examples and shared by all of them
  (one bias for all), not per example. Batched calls therefore fold the examples into the heads
  of one call of batch 1 (`_folded`), whose bias gradient is each example's own; unbatched ones
  are the plain call. The backward pass recomputes the forward one (cuDNN's softmax statistics
  are not kept across the two).
  """
  return _cudnn_forward(query, key, value, bias, mask, lengths)


def _cudnn_attention_fwd(query, key, value, bias, mask, lengths):
  return _cudnn_forward(query, key, value, bias, mask, lengths), (query, key, value, bias, mask, lengths)


def _cudnn_attention_bwd(residuals, g):
  return tuple(_cudnn_backward(*residuals, g)) + (None, None)


cudnn_attention.defvjp(_cudnn_attention_fwd, _cudnn_attention_bwd)


class MultiHeadAttention(nn.Module):
  """T5 attention: no 1/sqrt(d) logit scaling (it is folded into the query init).

  With `decode=True` the projected keys and values live in the `cache` collection
  (`cached_key`, `cached_value` `[B, kv_len, heads, d_kv]`, `cache_index`). A first call on
  the full-length inputs creates the cache. Later self-attention calls take one position at
  a time and append it; cross-attention (`cross_attention=True`) projects the encoder output
  once, in that first call, and reuses it at every step.
  """
  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32
  cross_attention: bool = False
  lora: Optional[LoraConfig] = None
  implementation: str = "einsum"  # or "xla", "cudnn": `jax.nn.dot_product_attention` (T5Config.attention)

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array, mask: Optional[jax.Array] = None,
               bias: Optional[jax.Array] = None, *, enable_dropout: bool = False,
               decode: bool = False) -> jax.Array:
    """`mask` is boolean `[B|1, 1, q, k]` (True = attend), `bias` `[1, heads, q, k]`."""
    joined = self.num_heads * self.head_dim
    query_init = query_kernel_init(self.head_dim)
    dense = functools.partial(Dense, features=joined, kernel_axes=("embed", "joined_kv"),
                              dtype=self.dtype)
    split = lambda x: x.reshape(x.shape[:-1] + (self.num_heads, self.head_dim))
    project = lambda name, x, **kw: split(dense(name=name, lora=_adapted(self.lora, name), **kw)(
        x, enable_dropout=enable_dropout))
    query = project("query", inputs_q, kernel_init=query_init)
    project_kv = lambda: (project("key", inputs_kv), project("value", inputs_kv))

    if not decode:
      key, value = project_kv()
    elif self.cross_attention:
      initialized = self.has_variable("cache", "cached_key")
      if initialized:
        key = self.get_variable("cache", "cached_key")
        value = self.get_variable("cache", "cached_value")
      else:
        key, value = project_kv()
        self.put_variable("cache", "cached_key", key)
        self.put_variable("cache", "cached_value", value)
    else:
      key, value = project_kv()
      initialized = self.has_variable("cache", "cached_key")
      cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
      cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
      if initialized:
        if query.shape[1] != 1:
          raise ValueError(f"cached decoding takes one position at a time, got {query.shape[1]}")
        index = cache_index.value
        key = jax.lax.dynamic_update_slice(cached_key.value, key.astype(cached_key.value.dtype),
                                           (0, index, 0, 0))
        value = jax.lax.dynamic_update_slice(cached_value.value,
                                             value.astype(cached_value.value.dtype), (0, index, 0, 0))
        cached_key.value, cached_value.value = key, value
        cache_index.value = index + 1
        max_len = key.shape[1]
        # The new query sees the cached positions 0..index (causal).
        mask = (jnp.arange(max_len) <= index)[None, None, None, :]
        if bias is not None:
          bias = jax.lax.dynamic_slice_in_dim(bias, index, 1, axis=2)

    if self.implementation == "einsum" or decode:
      out = self._einsum_attention(query, key, value, mask, bias, enable_dropout)
    else:  # (T5Config.validate refuses these implementations with dropout)
      # The same product as `_einsum_attention`: logits in float32, scale 1 (T5), the bias added,
      # masked positions at a large negative value, a float32 softmax, weights @ values.
      if self.implementation == "cudnn":
        inputs = cudnn_attention_inputs(mask, bias, query.shape[0], query.shape[1], key.shape[1],
                                        query.dtype)
        out = cudnn_attention(query, key, value, inputs.get("bias"), inputs.get("mask"),
                              inputs.get("key_value_seq_lengths"))
      else:
        out = _attention(self.implementation, query, key, value, bias, mask, None)
    out = out.reshape(out.shape[:-2] + (joined,))
    return Dense(features=inputs_q.shape[-1], kernel_axes=("joined_kv", "embed"), dtype=self.dtype,
                 lora=_adapted(self.lora, "out"), name="out")(out, enable_dropout=enable_dropout)

  def _einsum_attention(self, query, key, value, mask, bias, enable_dropout):
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key).astype(jnp.float32)
    if bias is not None:
      logits = logits + bias.astype(jnp.float32)
    if mask is not None:
      logits = jnp.where(mask, logits, NEG_INF)
    weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
    if enable_dropout and self.dropout_rate > 0:
      weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


class MlpBlock(nn.Module):
  """Feed-forward block: ReLU (`wi`, v1.0) or gated GELU (`wi_0` * `wi_1`, v1.1), then `wo`."""
  d_ff: int
  feed_forward: str = "relu"
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32
  lora: Optional[LoraConfig] = None

  @nn.compact
  def __call__(self, x: jax.Array, *, enable_dropout: bool = False) -> jax.Array:
    dense = lambda name, h, **kw: Dense(dtype=self.dtype, lora=_adapted(self.lora, name), name=name, **kw)(
        h, enable_dropout=enable_dropout)
    wi = functools.partial(dense, h=x, features=self.d_ff, kernel_axes=("embed", "mlp"))
    if self.feed_forward == "relu":
      hidden = nn.relu(wi("wi"))
    elif self.feed_forward == "gated-gelu":
      # T5 v1.1 (Shazeer 2020, GEGLU): gelu(x W0) * (x W1), tanh approximation as in T5.
      hidden = nn.gelu(wi("wi_0"), approximate=True) * wi("wi_1")
    else:
      raise ValueError(f"unknown feed_forward {self.feed_forward!r}")
    if enable_dropout and self.dropout_rate > 0:
      hidden = nn.Dropout(self.dropout_rate)(hidden, deterministic=False)
    return dense("wo", hidden, features=x.shape[-1], kernel_axes=("mlp", "embed"))
