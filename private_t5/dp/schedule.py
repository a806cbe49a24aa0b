"""Scheduling hints for XLA that change no value: `after(x, value)` is `x`, computed after `value`.

XLA schedules an operation as soon as its operands exist. Two DP computations depend on values
that exist long before they are needed, and computed early they stay alive across the
backward pass, raising the step's peak memory:

* the Gaussian noise draw depends only on the step's key (not on the gradients), so it was drawn
  during the forward pass, its random bits alive through the whole backward pass;
* what ghost norms compute from a layer's inputs alone (the Gram matrix `a a^T` of a dense
  layer, a float32 copy of bfloat16 inputs, a lookup's token-equality matrix) depends only on
  the forward pass: each `[B, T, T]` Gram matrix was formed in the forward pass and kept until
  the backward pass produced the layer's output gradient (`ghost.per_example_sq_norms` makes
  every input wait for its output gradient).

An `optimization_barrier` does not help: XLA's CPU pipeline removes it before scheduling.
`after` instead makes `x` data-dependent on `value` without changing a bit of it:
`min(k, k | f) = k` for unsigned integers `k` and any bits `f`, applied to the bits of `x` with
`f` the bits of a sum of `value`. XLA does not simplify it away, so every consumer of the
result waits for `value`.
"""
import jax
import jax.numpy as jnp

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def after(x: jax.Array, value: jax.Array) -> jax.Array:
  """`x` itself, bit for bit (also NaN, inf and -0), computed after `value`.

  Args:
    x: an array of any dtype: float, integer, or a typed PRNG key (`jax.random.key`).
    value: any numeric array or PRNG key; `x`'s consumers are scheduled after it is computed.
  """
  data = _raw(x)
  unsigned = _UNSIGNED[jnp.dtype(data.dtype).itemsize]
  bits = data if data.dtype == unsigned else jax.lax.bitcast_convert_type(data, unsigned)
  f = jax.lax.bitcast_convert_type(jnp.sum(_raw(value).astype(jnp.float32)), jnp.uint32).astype(unsigned)
  bits = jnp.minimum(bits, bits | f)
  data = bits if data.dtype == unsigned else jax.lax.bitcast_convert_type(bits, data.dtype)
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x)) if _is_key(x) else data


def _is_key(x: jax.Array) -> bool:
  return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _raw(x: jax.Array) -> jax.Array:
  """The array itself, or a typed PRNG key's raw uint32 data."""
  return jax.random.key_data(x) if _is_key(x) else x
