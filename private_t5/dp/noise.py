"""The noise of a DP step: the one function that draws and adds it, and the one noise transform.

A DP step releases `(Σ_i clip_C(g_i) + N(0, σ²C² I)) / (q N)` (Abadi et al. 2016, "Deep
Learning with Differential Privacy", Alg. 1; DP rule "noise on the sum, divide by a public
constant"). The clipped-sum function (`aggregator.DPAggregator`, `ghost.GhostDPAggregator`)
returns the clipped sum already divided by the public q·N, so its sensitivity is C / (q N)
and the noise transform adds N(0, (σ C / (q N))² I) to it: the same release, the division
moved in front of the addition of an independent Gaussian.

Correlated noise (a matrix factorization mechanism, `strategies`) generalises it: step t releases
x_t + (C⁻¹ Z)_t / (q N / b), Z_t ~ N(0, (σ·C_clip·sens)² I), the clipped sum of the step's cyclic
Poisson sample plus a linear combination of this and earlier steps' Gaussian draws
(Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization: A unified approach to
private training"; McKenna et al. 2024, "Scaling up the Banded Matrix Factorization Mechanism for
Differentially Private ML"; Dvijotham et al. 2024, "Efficient and Near-Optimal Noise Generation
for Streaming Differential Privacy", for BLT). Independent Gaussian noise (DP-SGD) is its one-band
identity strategy C = I (b = 1, sens = 1, `strategies.identity`).

* `add_gaussian_noise(tree, key, std)` is THE function that draws and adds independent noise:
  DP training, adaptive DP (std scaled by γ_B), JFT's phases and the benchmark all reach it
  through `noise_transform`; correlated noise draws its normals here too (`step_normals`).
* `noise_transform(noisy_sum, strategy=None)` is THE noise transform, an optax
  `GradientTransformationExtraArgs` chained in front of the optimizer
  (`optax.chain(noise_transform(ns), optax.adafactor(...))` works): its `update` takes the
  step's secret key as the extra argument `noise_rng` (derived from the run's secret seed and the
  step number, so a resumed run continues the key sequence: DP rule "noise keys are secret and
  never reused"; a key kept in the optimizer state would be written into every checkpoint).
  Without a strategy it is Gaussian noise, the identity strategy kept without a state
  (`optax.EmptyState()`), which takes an optional `noise_scale` (adaptive DP's γ_B). With a
  strategy it applies C⁻¹ in streaming form by jax-privacy (`StreamingMatrix.multiply_next`): its
  state (`CorrelatedNoiseState`) is a few float32 buffers shaped like the parameters, b - 1 for a
  b-banded strategy, one per buffer for a BLT, and a step count. Unlike jax-privacy's
  `matrix_factorization_privatizer`, the draws come from the run's secret step key; no key lives
  in the state, so the state is a pure function of the keys of the steps taken and a resumed run
  that restores it continues exactly (DP rule "correlated noise is a state"). With b = 1 and the
  identity strategy the update is bit for bit Gaussian noise's. The caller threads the state
  (`apply_with_state`); `apply`, which starts a transform afresh each step, refuses it.
  `gaussian_noise(noisy_sum)` and `correlated_noise(noisy_sum, strategy)` are its two former names.
* `no_noise()` is the transform of a non-private run: the identity, accepting the same
  arguments.

Like jax-privacy's `noise_addition_transform`, the transform is the only place that knows σ;
unlike optax's `differentially_private_aggregate`, the key is an explicit argument.
"""
import functools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import optax

from private_t5.dp import schedule
from private_t5.dp import strategies
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.strategies import Strategy
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
  sum) is computed. The draw of Gaussian and correlated noise alike (`noise_transform`)."""
  if key is None:
    raise PrivacyError("the Gaussian noise needs a noise_rng (the step's secret noise key)")
  key = schedule.after(key, leaves[-1])
  return gaussian_like(key, leaves)


class CorrelatedNoiseState(NamedTuple):
  """The state of C⁻¹'s streaming product (the noise state of a transform with a strategy).

  Attributes:
    buffers: `strategy.state_depth` pytrees of float32 arrays shaped like the parameters: row r
      of jax-privacy's stacked state (`init_multiply`) for every parameter.
    count: int32 scalar, the steps noised so far.
  """
  buffers: Tuple[PyTree, ...]
  count: jax.Array


def noise_transform(noisy_sum: NoisySum, strategy: Optional[Strategy] = None) -> optax.GradientTransformationExtraArgs:
  """The noise transform of a DP step whose updates are the clipped sum divided by q·N
  (`noisy_sum.expected_batch_size`; q·N/b with b cyclic Poisson groups).

  `update(updates, state, params=None, *, noise_rng, noise_scale=None)` adds
  (C⁻¹ Z)_t / (q N), Z_t ~ N(0, (s σ C sens)² I) drawn from `noise_rng`, and casts the result to
  the parameters' dtypes.

  * `strategy=None`: Gaussian noise (DP-SGD), the one-band identity strategy C = I (sens = 1)
    kept without a state (`optax.EmptyState()`): N(0, (s σ C / (q N))² I), s = `noise_scale`
    (1 when None; adaptive DP's γ_B). σ = 0 adds nothing (tests and compile benchmarks only).
  * a `strategies.Strategy` (`strategies.identity()` included): correlated noise, its state a
    `CorrelatedNoiseState` from `init(params)` that the caller keeps across steps. A per-step
    `noise_scale` (adaptive DP) is refused: the strategy's accounting assumes one σ.
  """
  if not isinstance(noisy_sum, NoisySum):
    raise PrivacyError(f"the noise transform needs an accounting.NoisySum, got {type(noisy_sum).__name__}")
  if strategy is not None and not isinstance(strategy, Strategy):
    raise PrivacyError(f"correlated noise needs a strategies.Strategy, got {type(strategy).__name__}")
  stateless = strategy is None  # C = I, no state to keep: independent Gaussian noise
  strategy = strategies.identity() if stateless else strategy
  std = noisy_sum.noise_std * strategy.sensitivity / noisy_sum.expected_batch_size
  cinv = None if stateless else strategy.noising_matrix()  # (jax-privacy: never imported by a Gaussian run)
  depth = strategy.state_depth

  def init(params):
    if stateless:
      return optax.EmptyState()
    like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32), params)
    layout = jax.eval_shape(cinv.init_multiply, like)  # jax-privacy's state: [depth, *shape] float32 leaves
    for leaf, param in zip(jax.tree.leaves(layout), jax.tree.leaves(like)):
      if leaf.shape != (depth,) + tuple(param.shape) or leaf.dtype != jnp.float32:
        raise PrivacyError(f"unexpected streaming state {leaf.shape} {leaf.dtype} for a parameter {param.shape}")
    zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), like)
    return CorrelatedNoiseState(tuple(zeros() for _ in range(depth)), jnp.zeros((), jnp.int32))

  def update(updates, state, params=None, *, noise_rng=None, noise_scale=None, **extra):
    del extra
    if stateless:
      if noisy_sum.noise_multiplier > 0:
        scale = 1.0 if noise_scale is None else jnp.asarray(noise_scale, jnp.float32)
        updates = add_gaussian_noise(updates, noise_rng, std * scale)
      return _cast_like(updates, params), state
    if noise_scale is not None:
      raise PrivacyError("correlated noise has one noise multiplier for the whole run: a per-step noise "
                         "scale (adaptive DP) is not offered with it")
    if not isinstance(state, CorrelatedNoiseState) or len(state.buffers) != depth:
      raise PrivacyError(f"correlated noise needs its state from init ({depth} buffers), got {type(state).__name__}")
    leaves, treedef = jax.tree.flatten(updates)
    draws = jax.tree.unflatten(treedef, [std * z for z in step_normals(leaves, noise_rng)])
    noise, stacked = cinv.multiply_next(draws, _stack(state.buffers, draws))
    noisy = jax.tree.map(lambda g, n: g.astype(jnp.float32) + n, updates, noise)
    return _cast_like(noisy, params), CorrelatedNoiseState(_unstack(stacked, depth), state.count + 1)

  return optax.GradientTransformationExtraArgs(init, update)


def gaussian_noise(noisy_sum: NoisySum) -> optax.GradientTransformationExtraArgs:
  """The former name of `noise_transform(noisy_sum)`: Gaussian noise."""
  return noise_transform(noisy_sum)


def correlated_noise(noisy_sum: NoisySum, strategy: Strategy) -> optax.GradientTransformationExtraArgs:
  """The former name of `noise_transform(noisy_sum, strategy)`: correlated noise by `strategy`."""
  if not isinstance(strategy, Strategy):
    raise PrivacyError(f"correlated noise needs a strategies.Strategy, got {type(strategy).__name__}")
  return noise_transform(noisy_sum, strategy)


def _stack(buffers: Tuple[PyTree, ...], like: PyTree) -> PyTree:
  """jax-privacy's state layout: each leaf [depth, *shape] (depth 0: empty leaves)."""
  if not buffers:
    return jax.tree.map(lambda x: jnp.zeros((0,) + tuple(x.shape), jnp.float32), like)
  return jax.tree.map(lambda *rows: jnp.stack(rows), *buffers)


def _unstack(stacked: PyTree, depth: int) -> Tuple[PyTree, ...]:
  return tuple(jax.tree.map(lambda x, r=r: x[r], stacked) for r in range(depth))


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
  return no_noise() if noisy_sum is None else noise_transform(noisy_sum)


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
