"""Ghost clipping layer by layer, inside the backward pass: nothing of a layer kept for the end.

Book-keeping (`ghost`) keeps every recorded layer's input `a_i` and output gradient `g_i` of every
example until the whole backward pass is done, since an example's clip factor needs the norms of
all of its layers. Layer by layer ("layerwise", after Li et al. 2022, "Large language models can
be strong differentially private learners", Sec. 4: ghost clipping is two backward passes) the
dense kernels and norm scales, each used once, are handled by probes on their outputs instead:

1. The norm pass: the forward and the backward pass of `sum_i loss_i`, differentiated only with
   respect to a zero scalar `t` of each probed layer and example. The probe is the identity on the
   layer's output `y` (`norm_probe(y, a, t) = y`); its custom VJP passes the output gradient
   through and gives as `t`'s cotangent the example's squared kernel-gradient norm
   `||a_i^T g_i||^2`, formed when the backward pass reaches the layer and then dropped. Inside a
   scanned, rematerialised stack `a_i` is the input the remat recomputes.
2. The sum pass: the same forward and backward pass again, differentiated only with respect to a
   zero float32 array `acc` shaped like each probed kernel, with the clip scales `s_i` as data:
   `sum_probe(y, a, s, acc) = y`, whose custom VJP gives as `acc`'s cotangent
   `sum_i s_i a_i^T g_i` in float32 (`ghost_norms.linear_weighted_sum`, the book-keeping sum).

The probes run under the per-example `jax.vmap` of the ghost forward, where a custom VJP's rule
sees one example: the sum's rule is a `jax.custom_batching.custom_vmap` whose batched rule forms
the weighted sum over the examples at once and returns it unbatched. That is the cotangent of an
unbatched `acc` that `jax.vmap` would otherwise form per example (`[B, d_in, d_out]`) and sum.

Both passes differentiate the same loss `sum_i loss_i` (cotangent one for every example): the
output gradients `g_i` of the sum pass are those the norms were computed from (the same
program, recomputed); the scales enter only the float32 sum. An example whose scale is 0 (dropped
as non-finite, or of weight 0) has its rows set to exactly 0 before the sum.
"""
import functools

import jax
import jax.numpy as jnp

from private_t5.dp import ghost_norms as gn


def _per_example_sq_norm(scale: bool, method: str, a: jax.Array, g: jax.Array) -> jax.Array:
  """One example's squared norm (a scalar) from its recorded `a`, `g` (leading batch of one)."""
  if scale:
    return jnp.sum(gn.scale_sq_norms(a, g))
  return jnp.sum(gn.linear_sq_norms(a, g, method))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def norm_probe(scale: bool, method: str, y: jax.Array, a: jax.Array, t: jax.Array) -> jax.Array:
  """`y`; the cotangent of `t` (a float32 scalar) is the layer's squared gradient norm of the example
  (`scale`: an RMSNorm scale with normalised input `a`, else a dense kernel by `method`)."""
  del scale, method, a, t
  return y


def _norm_probe_fwd(scale, method, y, a, t):
  del scale, method, t
  return y, a


def _norm_probe_bwd(scale, method, a, g):
  return g, None, _per_example_sq_norm(scale, method, a, g)


norm_probe.defvjp(_norm_probe_fwd, _norm_probe_bwd)


def _weighted_sum(scale: bool, a: jax.Array, g: jax.Array, weights: jax.Array) -> jax.Array:
  """`sum_i weights_i a_i^T g_i` [d_in, d_out] (a scale: `sum_i weights_i sum_t a_it * g_it` [d]),
  float32, over the leading axis; rows of weight 0 are set to exactly 0 first."""
  keep = weights != 0
  a = jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.zeros((), a.dtype))
  g = jnp.where(keep.reshape((-1,) + (1,) * (g.ndim - 1)), g, jnp.zeros((), g.dtype))
  if scale:
    return gn.contract("b,bd->d", weights, gn.scale_per_example_grads(a, g))
  return gn.linear_weighted_sum(a, g, weights)


def _example_rows(x: jax.Array, batched: bool, size: int) -> jax.Array:
  """`x` of one example `[n, ...]` (its batch of one) or of `size` examples `[size, n, ...]` as
  rows `[size * n, ...]`."""
  if not batched:
    x = jnp.broadcast_to(x, (size,) + x.shape)
  return x.reshape((-1,) + x.shape[2:])


@functools.lru_cache(maxsize=None)
def _scaled_sum(scale: bool):
  """`(a, g, s) -> s * a^T g` of one example, whose `jax.vmap` is the sum over the examples (one
  contraction, never the per-example products), returned unbatched (see the module docstring)."""

  @jax.custom_batching.custom_vmap
  def scaled_sum(a, g, s):
    return _weighted_sum(scale, a, g, jnp.broadcast_to(s, (a.shape[0],)))

  @scaled_sum.def_vmap
  def _rule(axis_size, in_batched, a, g, s):
    a_batched, g_batched, s_batched = in_batched
    rows = (a if a_batched else a[None]).shape[1]
    weights = jnp.repeat(s if s_batched else jnp.broadcast_to(s, (axis_size,)), rows)
    total = _weighted_sum(scale, _example_rows(a, a_batched, axis_size), _example_rows(g, g_batched, axis_size),
                          weights)
    return total, False

  return scaled_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sum_probe(scale: bool, y: jax.Array, a: jax.Array, s: jax.Array, acc: jax.Array) -> jax.Array:
  """`y`; the cotangent of `acc` (float32, the kernel's `[d_in, d_out]` or the scale's `[d]`) is
  `s · a^T g` of the example, summed over the examples of a `jax.vmap` in one contraction."""
  del scale, a, s, acc
  return y


def _sum_probe_fwd(scale, y, a, s, acc):
  del scale, acc
  return y, (a, s)


def _sum_probe_bwd(scale, residuals, g):
  a, s = residuals
  return g, None, None, _scaled_sum(scale)(a, g, s)


sum_probe.defvjp(_sum_probe_fwd, _sum_probe_bwd)
