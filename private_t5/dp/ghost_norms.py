"""Per-example gradient norms of T5's parameter types without per-example gradients.

Every function takes what one layer sees during a batched forward/backward pass, with a
leading example axis `B`: its inputs (activations `a`, token ids) and the gradient `g` of the
summed per-example losses with respect to its output. Because example i's loss depends on
example i's activations only, `g[i]` is exactly `d loss_i / d output_i`, and the per-example
parameter gradient is a function of `(a[i], g[i])` alone.

Dense layers over a sequence (Li et al. 2022, Sec. 4.2, eq. 2): with `a_i [T, d_in]` and
`g_i [T, d_out]` the per-example kernel gradient is `a_i^T g_i`, and

    ||a_i^T g_i||_F^2 = <a_i a_i^T, g_i g_i^T>     (the Gram identity),

which costs O(T^2 (d_in + d_out)) and never holds a `[d_in, d_out]` matrix per example; the
direct ("instantiated") route costs O(T d_in d_out). `choose_linear_method` takes the cheaper
one per layer: Gram when the sequence is short compared with the layer width.

Embeddings are linear layers over one-hot inputs: the per-example gradient of a lookup is
`sum_t onehot(x_t) g_t^T`; positions holding the same token add up in one row, so the norm
is computed by summing `g` over equal tokens (never a `[T, V]` one-hot). A tied embedding
(T5 v1.0) is used three times: encoder lookup, decoder lookup and the output projection
`h E^T`; all three contribute to ONE parameter and the norm of the sum includes every cross
term (`tied_embedding_sq_norms`).

RMSNorm scales and the relative position bias table are tiny: their per-example gradients
are instantiated (the bias table's by summing the output gradient's diagonals by bucket).

Everything is computed and accumulated in float32, whatever the activation dtype and the
backend's default matrix precision (`contract`): bfloat16 inputs and output gradients enter the
norms' products as they are (exact in float32). The book-keeping sums (`*_weighted_sum`) scale
the float32 casts of the inputs by the clip factors; against bfloat16 output gradients that
float32 product is split into three bfloat16 parts that add up to it exactly (`bf16_parts`), so
that the sums too are bfloat16 products accumulated in float32 (a GPU's tensor cores, not its
float32 CUDA cores), equal to the float32 contraction up to the order of float32 additions.
Sums over the examples weighted by the clip factors are formed elementwise (`contract`).
"""
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from private_t5.dp import schedule

GRAM = "gram"
INSTANTIATE = "instantiate"
AUTO = "auto"
LINEAR_METHODS = (GRAM, INSTANTIATE, AUTO)
# Rows of the T x T Gram sums formed at a time (`gram_sq_norms`).
GRAM_BLOCK = 128


LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def contract(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """`einsum(spec, x, y)` in float32 arithmetic, whatever the backend's default.

  Two bfloat16 (or float16) operands are multiplied as they are, accumulating in float32
  (`preferred_element_type`): their products are exact in float32, and a GPU's or TPU's matrix
  unit computes them at full speed. Any other pair is cast to float32 and contracted at
  `Precision.HIGHEST`: a GPU's default for float32 products rounds the operands to TF32 (10
  mantissa bits) and a TPU's to bfloat16, which would make the norm that sets an example's clip
  factor and the term that is summed differ by up to ~1e-3 of themselves, and the sensitivity
  exceed C by as much.

  A sum over the first axis weighted by a vector (`"b,bd->d"`: per-example gradients of a norm's
  scale or of the position bias weighted by the clip factors) is formed as float32 products and
  a float32 sum over that axis, not as a (float32) matrix product.
  """
  operands, out = spec.split("->")
  left, right = operands.split(",")
  if len(left) == 1 and right == left + out:
    weights = x.astype(jnp.float32).reshape(x.shape + (1,) * (y.ndim - 1))
    return jnp.sum(weights * y.astype(jnp.float32), axis=0)
  if x.dtype == y.dtype and x.dtype in LOW_PRECISION:
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
  return jnp.einsum(spec, x.astype(jnp.float32), y.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)


# The sign, exponent and 7 explicit mantissa bits of a float32: the bits of a bfloat16.
_BF16_BITS = np.uint32(0xFFFF0000)


def _bf16_truncated(x: jax.Array) -> jax.Array:
  """float32 `x` with its mantissa cut to bfloat16's (toward zero), by masking its bits: exactly
  a bfloat16 value. Not a float32 -> bfloat16 -> float32 conversion, which XLA may remove as
  excess precision."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & _BF16_BITS
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def bf16_parts(x: jax.Array) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """Three bfloat16 arrays whose sum is the float32 `x` exactly.

  The first holds the leading 8 of x's 24 significant bits, the second the next 8 of the rest,
  the third what is left (at most 8 bits). Each subtraction removes the leading bits of a number
  of the same sign and exponent, so it is exact in float32 (Sterbenz), and each part converts to
  bfloat16 without rounding. (Parts below float32's smallest normal number, 2^-126, which only
  elements under ~2^-110 have, may be flushed to zero by a GPU: an error of at most 2^-126 per
  element.) A product of a part and a bfloat16 value is exact in float32, so a contraction of
  the parts with bfloat16 operands, accumulated in float32, is the float32 contraction of x.
  """
  x = x.astype(jnp.float32)
  high = _bf16_truncated(x)
  rest = x - high
  middle = _bf16_truncated(rest)
  return high.astype(jnp.bfloat16), middle.astype(jnp.bfloat16), (rest - middle).astype(jnp.bfloat16)


def as_sequence(x: jax.Array, dtype=jnp.float32) -> jax.Array:
  """[B, ..., d] -> [B, T, d] in `dtype` (None: its own), folding all middle axes into one."""
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"expected at least [B, d], got shape {x.shape}")
  batch, width = x.shape[0], x.shape[-1]
  x = x.reshape(batch, -1, width)
  return x if dtype is None else x.astype(dtype)


def linear_costs(seq_len: int, d_in: int, d_out: int) -> Tuple[int, int]:
  """Multiply-adds per example of (Gram identity, instantiated gradient) for one dense layer.

  Gram: `a a^T` (T^2 d_in) plus `g g^T` (T^2 d_out) plus their inner product (T^2).
  Instantiated: `a^T g` (T d_in d_out) plus its squared norm (d_in d_out).
  """
  gram = seq_len * seq_len * (d_in + d_out + 1)
  instantiate = seq_len * d_in * d_out + d_in * d_out
  return gram, instantiate


def choose_linear_method(seq_len: int, d_in: int, d_out: int) -> str:
  """The cheaper of GRAM and INSTANTIATE for a `[T, d_in] -> [T, d_out]` layer."""
  gram, instantiate = linear_costs(seq_len, d_in, d_out)
  return GRAM if gram <= instantiate else INSTANTIATE


def resolve_method(method: str, seq_len: int, d_in: int, d_out: int) -> str:
  """GRAM or INSTANTIATE: `method` itself, or the cheaper one when it is AUTO."""
  if method not in LINEAR_METHODS:
    raise ValueError(f"method must be one of {LINEAR_METHODS}, got {method!r}")
  return choose_linear_method(seq_len, d_in, d_out) if method == AUTO else method


def gram_inner(a1: jax.Array, g1: jax.Array, a2: jax.Array, g2: jax.Array) -> jax.Array:
  """Per-example `<a1_i^T g1_i, a2_i^T g2_i>_F = sum_{s,t} (a1_s . a2_t)(g1_s . g2_t)`: [B]."""
  aa = contract("bsi,bti->bst", a1, a2)
  gg = contract("bso,bto->bst", g1, g2)
  return jnp.sum(aa * gg, axis=(1, 2))


def linear_per_example_grads(a: jax.Array, g: jax.Array) -> jax.Array:
  """Instantiated per-example kernel gradients `a_i^T g_i`: [B, d_in, d_out] float32."""
  return contract("bti,bto->bio", as_sequence(a, None), as_sequence(g, None))


def linear_sq_norms(a: jax.Array, g: jax.Array, method: str = AUTO) -> jax.Array:
  """Per-example squared Frobenius norms of the kernel gradient of `y = a @ W`: [B].

  Args:
    a: the layer's inputs `[B, ..., d_in]`.
    g: gradient of the summed per-example losses w.r.t. the layer's outputs `[B, ..., d_out]`.
    method: GRAM, INSTANTIATE or AUTO (the cheaper one for these shapes).
  """
  a, g = as_sequence(a, None), as_sequence(g, None)
  if a.shape[:2] != g.shape[:2]:
    raise ValueError(f"inputs {a.shape} and output gradients {g.shape} disagree on [B, T]")
  method = resolve_method(method, a.shape[1], a.shape[2], g.shape[2])
  if method == GRAM:
    return gram_sq_norms(a, g)
  return jnp.sum(jnp.square(linear_per_example_grads(a, g)), axis=(1, 2))


def gram_sq_norms(a: jax.Array, g: jax.Array, block: int = GRAM_BLOCK) -> jax.Array:
  """`||a_i^T g_i||_F^2` by the Gram identity, `block` rows s of the T x T sums at a time: [B].

  The blocks of rows `[j block, (j + 1) block)` are computed one after the other: each forms
  `[B, block, T]` slices of `a a^T` and `g g^T` (in float32), reduces them at once, and the next
  block's slice of `a` waits for the running total (`schedule.after`), so only one block's
  slices are alive at a time. The two whole `[B, T, T]` Gram matrices of every layer were
  otherwise formed as soon as their operands existed (`a a^T` during the forward pass, `g g^T`
  as the backward pass produced g) and kept until the other one was ready. The chain is
  unrolled, not a device loop: a GPU reads a `while` loop's predicate back on the host every
  iteration. The blocks run over the sequence, not over the examples, so a batch sharded over
  the mesh's data axis stays sharded. A sequence of at most `block` positions is one block.

  Args:
    a: the layer's inputs `[B, T, d_in]` (any float dtype).
    g: the output gradients `[B, T, d_out]` (any float dtype).
    block: rows per block.
  """
  a, g = as_sequence(a, None), as_sequence(g, None)
  seq = a.shape[1]
  if seq <= block:
    return gram_inner(a, g, a, g)
  total = None
  for start in range(0, seq, block):
    rows_a, rows_g = a[:, start:start + block], g[:, start:start + block]
    if total is not None:  # the previous block first: one block's [B, block, T] slices at a time
      rows_a = schedule.after(rows_a, total)
    aa = contract("bsi,bti->bst", rows_a, a)
    gg = contract("bso,bto->bst", rows_g, g)
    part = jnp.sum(aa * gg, axis=(1, 2))
    total = part if total is None else total + part
  return total


def first_occurrence(tokens: jax.Array) -> jax.Array:
  """For each position t of each row, the first position s with tokens[s] == tokens[t]: [B, T]."""
  equal = tokens[:, :, None] == tokens[:, None, :]  # [B, T(t), T(s)]
  return jnp.argmax(equal, axis=-1).astype(jnp.int32)


def lookup_row_grads(tokens: jax.Array, g: jax.Array) -> jax.Array:
  """Per-example embedding-gradient rows of a lookup, one slot per distinct token: [B, T, d].

  Slot `s` holds `sum_{t: x_t = x_s} g_t` when s is the first occurrence of its token and 0
  otherwise, so the slots are exactly the non-zero rows of the `[V, d]` gradient (never
  materialized). Cost O(T^2) integer comparisons plus O(T d).
  """
  tokens = tokens.reshape(tokens.shape[0], -1)
  g = as_sequence(g)
  slots = first_occurrence(tokens)
  return jax.vmap(lambda gi, si: jax.ops.segment_sum(gi, si, num_segments=gi.shape[0]))(g, slots)


def lookup_sq_norms(tokens: jax.Array, g: jax.Array) -> jax.Array:
  """Per-example squared norms of the embedding gradient of the lookup `E[tokens]`: [B].

  Args:
    tokens: int `[B, T]` ids that were looked up.
    g: gradient w.r.t. the looked-up vectors `[B, T, d]`.
  """
  return jnp.sum(jnp.square(lookup_row_grads(tokens, g)), axis=(1, 2))


def tied_embedding_sq_norms(lookups: Sequence[Tuple[jax.Array, jax.Array]],
                            attends: Sequence[Tuple[jax.Array, jax.Array]] = (),
                            method: str = AUTO) -> jax.Array:
  """Per-example squared norm of the TOTAL gradient of an embedding used several times: [B].

  The parameter `E [V, d]` is used by lookups `y = E[x]` (gradient `sum_t e_{x_t} g_t^T`) and
  by output projections `z = h E^T` (gradient `sum_t G_t h_t^T` with `G_t = dL/dz_t [V]`).
  With A the sum of the lookup terms and C the sum of the projection terms,

    ||A + C||^2 = ||A||^2 + 2 <A, C> + ||C||^2,
    <A, C>  = sum_{s in lookups} sum_{t in projections} G_t[x_s] (g_s . h_t),
    ||C||^2 = sum_{s,t} (h_s . h_t)(G_s . G_t)          (Gram identity, or instantiated).

  Several lookups (encoder and decoder inputs) are concatenated along the sequence, which
  includes their cross terms in ||A||^2; likewise several projections.

  Args:
    lookups: `(tokens [B, T], g [B, T, d])` per lookup use.
    attends: `(h [B, T, d], G [B, T, V])` per projection use: the projection's inputs and the
      gradient w.r.t. its outputs `h E^T` (before any later rescaling of the logits).
    method: for ||C||^2: GRAM, INSTANTIATE or AUTO.
  """
  if not lookups and not attends:
    raise ValueError("an embedding needs at least one use")
  total = 0.0
  if lookups:
    tokens = jnp.concatenate([t.reshape(t.shape[0], -1).astype(jnp.int32) for t, _ in lookups], 1)
    g = jnp.concatenate([as_sequence(gl) for _, gl in lookups], axis=1)
    total = lookup_sq_norms(tokens, g)
  if attends:
    h = jnp.concatenate([as_sequence(ha) for ha, _ in attends], axis=1)
    big_g = jnp.concatenate([as_sequence(ga) for _, ga in attends], axis=1)
    total = total + linear_sq_norms(h, big_g, method)  # ||C||^2: C^T = h^T G
    if lookups:
      # G_t[x_s] for every (projection position t, lookup position s): a gather, no one-hot.
      picked = jnp.take_along_axis(big_g, jnp.broadcast_to(
          tokens[:, None, :], (tokens.shape[0], big_g.shape[1], tokens.shape[1])), axis=2)
      dots = contract("bsd,btd->bts", g, h)  # g_s . h_t
      total = total + 2.0 * jnp.sum(picked * dots, axis=(1, 2))
  return total


def scale_per_example_grads(normalized: jax.Array, g: jax.Array) -> jax.Array:
  """Per-example gradients of a scale vector in `y = x_hat * scale`: [B, d]."""
  return jnp.sum(as_sequence(normalized) * as_sequence(g), axis=1)


def scale_sq_norms(normalized: jax.Array, g: jax.Array) -> jax.Array:
  """Per-example squared gradient norms of an RMSNorm scale (instantiated, it is tiny): [B]."""
  return jnp.sum(jnp.square(scale_per_example_grads(normalized, g)), axis=-1)


def diagonal_sums(g: jax.Array) -> jax.Array:
  """`[..., Q, K] -> [..., Q + K - 1]` float32: entry j sums `g[..., q, k]` over `k - q = j - (Q - 1)`.

  The rows are flipped (row r holds query Q - 1 - r), padded with Q zeros and read back with a
  row stride one shorter, which moves element (r, k) to column r + k = k - q + Q - 1; a sum over
  the rows then adds each diagonal. Only a reshape of a padded copy and one reduction: no index
  array, no one-hot, and the additions are exact float32 (no matrix unit's rounding).
  """
  q, k = g.shape[-2:]
  lead = g.shape[:-2]
  padded = jnp.pad(jnp.flip(g, axis=-2), [(0, 0)] * len(lead) + [(0, 0), (0, q)])
  skewed = padded.reshape(lead + (q * (k + q),))[..., :q * (k + q - 1)].reshape(lead + (q, k + q - 1))
  return jnp.sum(skewed, axis=-2, dtype=jnp.float32)


def relpos_per_example_grads(g: jax.Array, buckets: np.ndarray, num_buckets: int) -> jax.Array:
  """Per-example gradients of a relative position table `[heads, buckets]`: [B, heads, buckets].

  The bias of pair (q, k) is `table[:, bucket(k - q)]`, so the gradient of column n is the sum of
  the output gradient over the pairs whose offset falls in bucket n: the diagonals of `g` are
  summed (`diagonal_sums`), then the diagonals of each bucket (a segment sum over Q + K - 1
  offsets).

  Args:
    g: gradient w.r.t. the per-example bias `[B, heads, q, k]` (summed over all layers that
      add the bias: they share one table).
    buckets: int `[q + k - 1]`, the bucket of each offset `k - q` (`layers.offset_buckets`).
    num_buckets: columns of the table.
  """
  per_offset = diagonal_sums(g)  # [B, heads, q + k - 1]
  summed = jax.ops.segment_sum(jnp.moveaxis(per_offset, -1, 0), jnp.asarray(buckets, jnp.int32),
                               num_segments=num_buckets)  # [buckets, B, heads]
  return jnp.moveaxis(summed, 0, -1)


def relpos_sq_norms(g: jax.Array, buckets: np.ndarray, num_buckets: int) -> jax.Array:
  """Per-example squared gradient norms of a relative position bias table: [B]."""
  return jnp.sum(jnp.square(relpos_per_example_grads(g, buckets, num_buckets)), axis=(1, 2))


def lookup_weighted_sum(tokens: jax.Array, g: jax.Array, weights: jax.Array,
                        num_embeddings: int) -> jax.Array:
  """`sum_i w_i sum_t e_{x_it} g_it^T`: the weighted embedding gradient of a lookup [V, d]."""
  tokens = tokens.reshape(-1).astype(jnp.int32)
  g = as_sequence(g) * weights.astype(jnp.float32)[:, None, None]
  g = g.reshape(-1, g.shape[-1])
  return jax.ops.segment_sum(g, tokens, num_segments=num_embeddings)


def linear_weighted_sum(a: jax.Array, g: jax.Array, weights: jax.Array,
                        per_example: Optional[jax.Array] = None) -> jax.Array:
  """`sum_i w_i a_i^T g_i` [d_in, d_out] (book-keeping), from instantiated grads when given."""
  weights = weights.astype(jnp.float32)
  if per_example is not None:
    # One float32 matrix-vector product at full precision: it reads the [B, d_in, d_out]
    # gradients once, as any other way would (bound by memory, not by arithmetic).
    return jnp.einsum("b,bio->io", weights, per_example.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  a, g = as_sequence(a, None), as_sequence(g, None)
  scaled = a.astype(jnp.float32) * weights[:, None, None]
  if g.dtype == jnp.bfloat16:
    # The float32 terms w_i a_it, split exactly into bfloat16 parts: bfloat16 products, float32
    # sums, the same contraction as in float32 (`bf16_parts`), on a GPU's tensor cores. Example
    # i's term is w_i a_i^T g_i from the very values its norm was computed from.
    high, middle, low = (contract("bti,bto->io", part, g) for part in bf16_parts(scaled))
    return high + middle + low
  return contract("bti,bto->io", scaled, g)


def stacked_linear_weighted_sums(a: Optional[jax.Array], g: Optional[jax.Array], weights: jax.Array,
                                 per_example: Optional[jax.Array] = None) -> jax.Array:
  """`linear_weighted_sum` of L layers at once: [L, d_in, d_out] float32 from `a` [L, B, T, d_in]
  and `g` [L, B, T, d_out], or from their instantiated per-example gradients `per_example`
  [L, B, d_in, d_out]: one batched product over the layer axis instead of one a layer."""
  weights = weights.astype(jnp.float32)
  if per_example is not None:
    return jnp.einsum("b,lbio->lio", weights, per_example.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  scaled = a.astype(jnp.float32) * weights[None, :, None, None]
  if g.dtype == jnp.bfloat16:
    # The float32 terms in three exact bfloat16 parts (`bf16_parts`), as `linear_weighted_sum`.
    high, middle, low = (contract("lbti,lbto->lio", part, g) for part in bf16_parts(scaled))
    return high + middle + low
  return contract("lbti,lbto->lio", scaled, g)
