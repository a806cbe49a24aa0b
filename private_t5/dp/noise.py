"""The noise of a DP step: the one function that draws and adds it, and its optax transform.

A DP step releases `(Σ_i clip_C(g_i) + N(0, σ²C² I)) / (q N)` (Abadi et al. 2016, "Deep
Learning with Differential Privacy", Alg. 1; DP rule "noise on the sum, divide by a public
constant"). The clipped-sum function (`aggregator.DPAggregator`, `ghost.GhostDPAggregator`)
returns the clipped sum already divided by the public q·N, so its sensitivity is C / (q N)
and the noise transform adds N(0, (σ C / (q N))² I) to it: the same release, the division
moved in front of the addition of an independent Gaussian.

* `add_gaussian_noise(tree, key, std)` is THE function that draws and adds noise: DP training,
  adaptive DP (std scaled by γ_B), JFT's phases and the benchmark all reach it through
  `gaussian_noise`.
* `gaussian_noise(noisy_sum)` is an optax `GradientTransformationExtraArgs`, chained in front of
  the optimizer (`optax.chain(gaussian_noise(ns), optax.adafactor(...))` works): its `update`
  takes the step's secret key as the extra argument `noise_rng` (derived from the run's secret
  seed and the step number, so a resumed run continues the key sequence: DP rule "noise keys
  are secret and never reused"; a key kept in the optimizer state would be written into every
  checkpoint) and an optional `noise_scale` (adaptive DP's γ_B). It is stateless.
* `no_noise()` is the transform of a non-private run: the identity, accepting the same
  arguments.
* Correlated noise (`correlated_noise.correlated_noise`) draws its normals here too
  (`step_normals`) and keeps a state across steps: the caller threads it (`apply_with_state`);
  `apply`, which starts a transform afresh each step, refuses it.

Like jax-privacy's `noise_addition_transform`, the transform is the only place that knows σ;
unlike optax's `differentially_private_aggregate`, the key is an explicit argument.
"""
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import optax

from private_t5.dp import schedule
from private_t5.dp.privacy_params import NoisySum
from private_t5.errors import PrivacyError

PyTree = Any
# The metric a clipped sum may return to scale the step's noise std (adaptive DP's γ_B).
NOISE_SCALE_METRIC = "nondp/privacy_weight"


def gaussian_like(key: jax.Array, leaves: Sequence[jax.Array]) -> List[jax.Array]:
  """Independent float32 N(0, 1) arrays shaped like `leaves`, from one key.

  The leaves are grouped by shape; the r-th leaf of group g is
  `normal(fold_in(fold_in(key, g), r), its shape)`: every coordinate gets its own independent
  normal and no key is used twice (the bug of reusing one key per leaf cannot happen). How it
  compiles, which is why it is written so:

  * sharded: each draw has its leaf's shape, so on a mesh XLA shards it like the gradient it
    is added to and (JAX's partitionable threefry) each device makes only its shard of the
    random bits, the same bits whatever the mesh; a single flat draw of all P normals cut
    into the leaves is instead made whole on every device;
  * one random-number kernel per distinct shape (eight for T5 v1.1), not per leaf: a group
    is drawn at once and materialised once (`normal_rows`). XLA otherwise copies the
    random-bits code into every fusion that reads a leaf of the noise (the noisy sum, then each
    Adafactor statistic of it), and compiling the copies took longer than the rest of the DP
    step on a mesh;
  * after the clipped sum: the draw waits for the key, which waits for the clipped sum
    (`step_normals`); drawn early, the noise would be alive through the backward pass.
  """
  groups: Dict[Tuple[int, ...], List[int]] = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault(tuple(leaf.shape), []).append(i)
  out: List[Optional[jax.Array]] = [None] * len(leaves)
  for g, (shape, members) in enumerate(groups.items()):
    draw = jax.lax.platform_dependent(
        jax.random.fold_in(key, g),
        cpu=functools.partial(normal_rows, count=len(members), shape=shape, loop=True),
        default=functools.partial(normal_rows, count=len(members), shape=shape, loop=False))
    for row, i in enumerate(members):
      out[i] = draw[row]
  return out


def normal_rows(key: jax.Array, count: int, shape: Tuple[int, ...], *, loop: bool) -> jax.Array:
  """`[count, *shape]` float32 normals whose row r is `normal(fold_in(key, r), shape)`, the same
  bits drawn in either of two ways (`gaussian_like` takes the first on a CPU, the second on an
  accelerator):

  * `loop=True`: one row per iteration of a device loop writing into one buffer (allocated once
    the key exists). On a CPU, where JAX's threefry is a rolled loop anyway, this compiles in
    5 CPU s less than the batched draw for T5 v1.1 small's DP step (25 against 31): the normal
    transform stays in one kernel per shape instead of being copied into each leaf's consumers.
  * `loop=False`: the rows' keys vmapped into one draw, behind an `optimization_barrier`. No
    device loop (a GPU reads a `while` loop's predicate back on the host every iteration); the
    barrier, which XLA:GPU removes only after fusion and scheduling, keeps the draw one
    materialised buffer that every consumer reads.
  """
  if loop:
    return jax.lax.fori_loop(
        0, count, lambda r, buf: buf.at[r].set(jax.random.normal(jax.random.fold_in(key, r), shape, jnp.float32)),
        schedule.after(jnp.zeros((count,) + tuple(shape), jnp.float32), key))
  rows = jnp.arange(count, dtype=jnp.uint32)
  draw = jax.vmap(lambda r: jax.random.normal(jax.random.fold_in(key, r), shape, jnp.float32))(rows)
  return jax.lax.optimization_barrier(draw)


def add_gaussian_noise(tree: PyTree, key: jax.Array, std) -> PyTree:
  """`tree` + std · N(0, I) in float32: one independent normal per coordinate (`gaussian_like`).

  The only function that draws and adds a DP step's noise. `key` must be fresh for every step
  (DP rule "noise keys are secret and never reused"); the draw waits for `tree` (drawn early,
  it would be alive through the backward pass). `std` is a float or a float32 scalar array.
  """
  leaves, treedef = jax.tree.flatten(tree)
  noise = step_normals(leaves, key)
  return jax.tree.unflatten(treedef, [g.astype(jnp.float32) + std * n for g, n in zip(leaves, noise)])


def step_normals(leaves: Sequence[jax.Array], key: jax.Array) -> List[jax.Array]:
  """A step's standard normals: `gaussian_like(key, leaves)`, drawn once `leaves` (the clipped
  sum) is computed. The draw of Gaussian and correlated noise alike (`correlated_noise`)."""
  if key is None:
    raise PrivacyError("the Gaussian noise needs a noise_rng (the step's secret noise key)")
  key = schedule.after(key, leaves[-1])
  return gaussian_like(key, leaves)


def gaussian_noise(noisy_sum: NoisySum) -> optax.GradientTransformationExtraArgs:
  """The noise transform of a DP step whose updates are the clipped sum divided by q·N.

  `update(updates, state, params=None, *, noise_rng, noise_scale=None)` adds
  N(0, (s σ C / (q N))² I), s = `noise_scale` (1 when None; adaptive DP's γ_B), and casts the
  result to the parameters' dtypes. σ = 0 adds nothing (tests and compile benchmarks only).
  """
  if not isinstance(noisy_sum, NoisySum):
    raise PrivacyError(f"the noise transform needs an accounting.NoisySum, got {type(noisy_sum).__name__}")
  std = noisy_sum.noise_std / noisy_sum.expected_batch_size

  def update(updates, state, params=None, *, noise_rng=None, noise_scale=None, **extra):
    del extra
    if noisy_sum.noise_multiplier > 0:
      scale = 1.0 if noise_scale is None else jnp.asarray(noise_scale, jnp.float32)
      updates = add_gaussian_noise(updates, noise_rng, std * scale)
    return _cast_like(updates, params), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def no_noise() -> optax.GradientTransformationExtraArgs:
  """The noise transform of a non-private run: the identity (casts to the parameters' dtypes)."""

  def update(updates, state, params=None, **extra):
    del extra
    return _cast_like(updates, params), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def transform_for(clipped_sum) -> optax.GradientTransformationExtraArgs:
  """The noise transform that matches a clipped-sum object: Gaussian from its `noisy_sum`, none
  for the non-private mean (`aggregator.MeanAggregator`)."""
  noisy_sum = getattr(clipped_sum, "noisy_sum", None)
  return no_noise() if noisy_sum is None else gaussian_noise(noisy_sum)


def apply(noise: optax.GradientTransformationExtraArgs, grads: PyTree, metrics: Dict[str, jax.Array],
          params: PyTree, noise_rng: Optional[jax.Array]) -> PyTree:
  """`grads` (a finished clipped sum) through the stateless noise transform `noise` (Gaussian or
  none), with the step's key and the noise scale its metrics may carry (`NOISE_SCALE_METRIC`).

  Raises:
    PrivacyError: `noise` keeps a state across steps (correlated noise): starting it afresh
      every step is not the mechanism accounted; use `apply_with_state` and keep the state.
  """
  state = noise.init(params)
  if jax.tree.leaves(state):
    raise PrivacyError("this noise transform keeps a state across steps (correlated noise): the caller must "
                       "keep it (noise.apply_with_state), not start it afresh every step")
  noisy, _ = noise.update(grads, state, params, noise_rng=noise_rng, noise_scale=metrics.get(NOISE_SCALE_METRIC))
  return noisy


def apply_with_state(noise: optax.GradientTransformationExtraArgs, grads: PyTree, metrics: Dict[str, jax.Array],
                     params: PyTree, state: Any, noise_rng: Optional[jax.Array]) -> Tuple[PyTree, Any]:
  """(noisy `grads`, the next noise state): `apply` for any noise transform, its state (from
  `noise.init(params)`, then each step's result) kept by the caller across steps."""
  return noise.update(grads, state, params, noise_rng=noise_rng, noise_scale=metrics.get(NOISE_SCALE_METRIC))


def privatize(clipped_sum, params: PyTree, batch, *, dropout_rng: Optional[jax.Array] = None,
              noise_rng: Optional[jax.Array] = None,
              noise: Optional[optax.GradientTransformationExtraArgs] = None) -> Tuple[PyTree, Dict[str, jax.Array]]:
  """(the step's released gradient, its metrics) for one batch: the clipped sum of `batch`, then
  the noise transform (`noise`, default `transform_for(clipped_sum)`) once."""
  noise = transform_for(clipped_sum) if noise is None else noise
  grads, metrics = clipped_sum(params, batch, dropout_rng=dropout_rng)
  return apply(noise, grads, metrics, params, noise_rng), metrics


def _cast_like(tree: PyTree, params: Optional[PyTree]) -> PyTree:
  if params is None:
    return tree
  return jax.tree.map(lambda g, p: g.astype(p.dtype), tree, params)
