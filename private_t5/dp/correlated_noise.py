"""Correlated noise: the noise transform of a matrix factorization mechanism (`strategies`).

Step t releases x_t + (C⁻¹ Z)_t / (q N / b), Z_t ~ N(0, (σ·C_clip·sens)² I): the clipped sum of
the step's cyclic Poisson sample plus a linear combination of this and earlier steps' Gaussian
draws (Choquette-Choo et al. 2023; McKenna et al. 2024; Dvijotham et al. 2024 for BLT). C⁻¹ is
applied in streaming form by jax-privacy (`StreamingMatrix.multiply_next`): its state is a few
float32 buffers shaped like the parameters, b - 1 for a b-banded strategy, one per buffer for a
BLT. Unlike jax-privacy's `matrix_factorization_privatizer`, the draws come from the run's secret
step key (`noise.step_normals`, the same draw as Gaussian noise: DP rule "noise keys are secret
and never reused"); no key lives in the state, so the state is a pure function of the keys of the
steps taken and a resumed run that restores it continues exactly (DP rule "correlated noise is a
state"). With b = 1 and the identity strategy the update is bit for bit Gaussian noise's.

`correlated_noise(noisy_sum, strategy)` is an optax `GradientTransformationExtraArgs`:
`init(params)` gives a `CorrelatedNoiseState`, `update(updates, state, params, *, noise_rng)`
returns (noisy updates cast to the parameters' dtypes, the next state). The caller keeps the
state across steps (`noise.apply_with_state`); `noise.apply` refuses it.
"""
from typing import Any, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import optax

from private_t5.dp import noise as noise_lib
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.strategies import Strategy
from private_t5.errors import PrivacyError

PyTree = Any


class CorrelatedNoiseState(NamedTuple):
  """The state of C⁻¹'s streaming product.

  Attributes:
    buffers: `strategy.state_depth` pytrees of float32 arrays shaped like the parameters: row r
      of jax-privacy's stacked state (`init_multiply`) for every parameter.
    count: int32 scalar, the steps noised so far.
  """
  buffers: Tuple[PyTree, ...]
  count: jax.Array


def _stack(buffers: Tuple[PyTree, ...], like: PyTree) -> PyTree:
  """jax-privacy's state layout: each leaf [depth, *shape] (depth 0: empty leaves)."""
  if not buffers:
    return jax.tree.map(lambda x: jnp.zeros((0,) + tuple(x.shape), jnp.float32), like)
  return jax.tree.map(lambda *rows: jnp.stack(rows), *buffers)


def _unstack(stacked: PyTree, depth: int) -> Tuple[PyTree, ...]:
  return tuple(jax.tree.map(lambda x, r=r: x[r], stacked) for r in range(depth))


def correlated_noise(noisy_sum: NoisySum, strategy: Strategy) -> optax.GradientTransformationExtraArgs:
  """The noise transform of correlated noise by `strategy`, for updates that are the clipped sum
  divided by q·N/b (`noisy_sum.expected_batch_size`).

  `update(updates, state, params=None, *, noise_rng, noise_scale=None)` adds
  (C⁻¹ Z)_t / (q N / b), Z_t ~ N(0, (σ C sens)² I) drawn from `noise_rng`, and casts to the
  parameters' dtypes. A per-step `noise_scale` (adaptive DP) is refused: the strategy's accounting
  assumes one σ.
  """
  if not isinstance(noisy_sum, NoisySum):
    raise PrivacyError(f"the noise transform needs an accounting.NoisySum, got {type(noisy_sum).__name__}")
  if not isinstance(strategy, Strategy):
    raise PrivacyError(f"correlated noise needs a strategies.Strategy, got {type(strategy).__name__}")
  cinv = strategy.noising_matrix()
  depth = strategy.state_depth
  std = noisy_sum.noise_std * strategy.sensitivity / noisy_sum.expected_batch_size

  def init(params):
    like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32), params)
    layout = jax.eval_shape(cinv.init_multiply, like)  # jax-privacy's state: [depth, *shape] float32 leaves
    for leaf, param in zip(jax.tree.leaves(layout), jax.tree.leaves(like)):
      if leaf.shape != (depth,) + tuple(param.shape) or leaf.dtype != jnp.float32:
        raise PrivacyError(f"unexpected streaming state {leaf.shape} {leaf.dtype} for a parameter {param.shape}")
    zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), like)
    return CorrelatedNoiseState(tuple(zeros() for _ in range(depth)), jnp.zeros((), jnp.int32))

  def update(updates, state, params=None, *, noise_rng=None, noise_scale=None, **extra):
    del extra
    if noise_scale is not None:
      raise PrivacyError("correlated noise has one noise multiplier for the whole run: a per-step noise "
                         "scale (adaptive DP) is not offered with it")
    if not isinstance(state, CorrelatedNoiseState) or len(state.buffers) != depth:
      raise PrivacyError(f"correlated noise needs its state from init ({depth} buffers), got {type(state).__name__}")
    leaves, treedef = jax.tree.flatten(updates)
    draws = jax.tree.unflatten(treedef, [std * z for z in noise_lib.step_normals(leaves, noise_rng)])
    noise, stacked = cinv.multiply_next(draws, _stack(state.buffers, draws))
    noisy = jax.tree.map(lambda g, n: g.astype(jnp.float32) + n, updates, noise)
    if params is not None:
      noisy = jax.tree.map(lambda g, p: g.astype(p.dtype), noisy, params)
    return noisy, CorrelatedNoiseState(_unstack(stacked, depth), state.count + 1)

  return optax.GradientTransformationExtraArgs(init, update)
