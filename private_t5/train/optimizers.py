"""Adafactor (T5's optimizer) through optax, and the learning-rate schedules it runs with.

Schedules map the optimizer step t (0-based, counted by optax inside the optimizer state, so a
resumed run continues it) to a learning rate:

* `rsqrt_schedule(peak | base, warmup_steps)`: T5 / T5X's "constant * rsqrt_decay",
  lr(t) = base / sqrt(max(t, warmup)); given as the peak it starts at, base = peak *
  sqrt(warmup), so lr(t) = peak * min(1, sqrt(warmup / t)). The "warm-up" of T5's rsqrt
  schedule is a constant plateau of `warmup_steps`, not a linear ramp. Ponomareva et al. 2022 (Sec. 4)
  uses "learning rate 0.5, warm-up 1000", which in T5X's terms is base 0.5: peak 0.0158.
* `constant_schedule(lr)`.
* `linear_warmup_schedule(peak, warmup_steps, decay)`: linear ramp from 0 to peak over
  `warmup_steps`, then constant, rsqrt decay or linear decay to 0 at `total_steps`.
"""
import math
from typing import Any, Callable, List, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import optax

from private_t5 import tree_groups
from private_t5.errors import ConfigError
from private_t5.models import network

Schedule = Callable[[jnp.ndarray], jnp.ndarray]
DECAYS = ("constant", "rsqrt", "linear")


def _positive(name: str, value, allow_zero: bool = False) -> float:
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ConfigError(f"{name} must be a number, got {value!r}") from None
  if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
    raise ConfigError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
  return v


def rsqrt_schedule(peak_learning_rate: Optional[float] = None, warmup_steps: int = 1000,
                   base_learning_rate: Optional[float] = None) -> Schedule:
  """lr(t) = base * rsqrt(max(t, warmup)) = peak * min(1, sqrt(warmup / t)).

  Give the plateau value `peak_learning_rate`, or T5X's `base_learning_rate` (then
  peak = base / sqrt(warmup)); exactly one of the two. Ponomareva et al.'s (2022) "learning rate 0.5,
  warm-up 1000, rsqrt decay" is T5X's `base_learning_rate=0.5`, i.e. a peak of
  0.5 / sqrt(1000) = 0.0158 (the order of T5's 0.01).
  """
  warmup = _positive("warmup_steps", warmup_steps)
  if (peak_learning_rate is None) == (base_learning_rate is None):
    raise ConfigError("rsqrt_schedule needs exactly one of peak_learning_rate and base_learning_rate, "
                      f"got {peak_learning_rate!r} and {base_learning_rate!r}")
  if peak_learning_rate is not None:
    peak = _positive("peak_learning_rate", peak_learning_rate)
  else:
    peak = _positive("base_learning_rate", base_learning_rate) / math.sqrt(warmup)

  def schedule(count):
    t = jnp.maximum(jnp.asarray(count, jnp.float32), warmup)
    return peak * jnp.sqrt(warmup) / jnp.sqrt(t)

  return schedule


def constant_schedule(learning_rate: float = 1e-3) -> Schedule:
  """lr(t) = learning_rate."""
  return optax.constant_schedule(_positive("learning_rate", learning_rate))


def linear_warmup_schedule(peak_learning_rate: float = 1e-3, warmup_steps: int = 1000,
                           decay: str = "constant", total_steps: Optional[int] = None) -> Schedule:
  """Linear ramp 0 -> peak over `warmup_steps`, then `decay` ("constant", "rsqrt", "linear").

  "rsqrt" continues as peak * sqrt(warmup / t); "linear" decays to 0 at `total_steps`.
  """
  peak = _positive("peak_learning_rate", peak_learning_rate)
  warmup = int(_positive("warmup_steps", warmup_steps, allow_zero=True))
  if decay not in DECAYS:
    raise ConfigError(f"decay must be one of {DECAYS}, got {decay!r}")
  if decay == "constant":
    after = optax.constant_schedule(peak)
  elif decay == "rsqrt":
    after = lambda t: peak * jnp.sqrt(max(warmup, 1)) / jnp.sqrt(jnp.maximum(t + warmup, max(warmup, 1)))
  else:
    if total_steps is None or total_steps <= warmup:
      raise ConfigError(f"linear decay needs total_steps > warmup_steps={warmup}, got {total_steps!r}")
    after = optax.linear_schedule(peak, 0.0, int(total_steps) - warmup)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def adafactor(learning_rate: Union[float, Schedule, None] = None, decay_rate: float = 0.8,
              clipping_threshold: Optional[float] = 1.0, factored: bool = True,
              momentum: Optional[float] = None, multiply_by_parameter_scale: bool = True,
              min_dim_size_to_factor: int = 128,
              weight_decay_rate: Optional[float] = None,
              batched_over_shapes: bool = False) -> optax.GradientTransformation:
  """`optax.adafactor` with T5's settings (Ponomareva et al. 2022, Sec. 4: decay rate 0.8, factored second
  moments, no momentum, update clipping threshold 1.0, relative step size scaled by the
  parameter RMS). `learning_rate` defaults to the paper's rsqrt schedule (base 0.5, 1000 steps).
  `batched_over_shapes`: computed once per parameter shape (`same_shape_batched`: the same
  update and state, a fraction of the kernel launches on a GPU). Off by default: on a
  model-parallel mesh the stacked copies raise the peak memory of the noise draw.
  """
  if learning_rate is None:
    learning_rate = rsqrt_schedule(base_learning_rate=0.5, warmup_steps=1000)
  elif not callable(learning_rate):
    learning_rate = _positive("learning_rate", learning_rate)
  if not 0.0 < float(decay_rate) <= 1.0:
    raise ConfigError(f"decay_rate must be in (0, 1], got {decay_rate!r}")
  tx = optax.adafactor(
      learning_rate=learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
      decay_rate=decay_rate, multiply_by_parameter_scale=multiply_by_parameter_scale,
      clipping_threshold=clipping_threshold, momentum=momentum,
      weight_decay_rate=weight_decay_rate, factored=factored)
  return same_shape_batched(tx) if batched_over_shapes else tx


# --- one update for every parameter of a shape ---------------------------------------------------

def _slot_runs(inner: optax.GradientTransformation, state, n: int) -> List[Tuple[int, int]]:
  """[(start, end)] of the per-parameter runs of `state`'s flat leaves: optax keeps each
  per-parameter field (Adafactor's v_row, v_col, v) as one tree like the parameters, whose
  `n` leaves are consecutive in the flat state and in the parameters' order."""
  marks = jax.tree.leaves(optax.tree_map_params(inner, lambda _: True, state,
                                                transform_non_params=lambda _: False))
  runs, i = [], 0
  while i < len(marks):
    if marks[i]:
      if len(marks) < i + n or not all(marks[i:i + n]):
        raise ValueError("same_shape_batched: the optimizer state is not one entry per parameter")
      runs.append((i, i + n))
      i += n
    else:
      i += 1
  return runs


def same_shape_batched(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` applied to every parameter as before, computed once per (shape, dtype) group:
  the group's gradients, parameters and per-parameter state are stacked and `inner.update` runs
  under `jax.vmap` over them, so that each of its per-parameter reductions (Adafactor's row and
  column moments, its update clipping and parameter-scale RMS) is one batched reduction for
  the group instead of one per parameter: T5 v1.1 small's ~190 parameter arrays have 9 shapes.

  The state is `inner`'s own (same structure and values: checkpoints read back unchanged); the
  result equals `inner`'s up to the order of floating-point summation, since `inner` (a chain of
  per-parameter optax transforms, as Adafactor is) treats every parameter on its own. A
  transform that mixes parameters (a global norm clip) must not be wrapped.
  """

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("same_shape_batched needs the parameters")
    leaves, treedef = jax.tree.flatten(updates)
    n = len(leaves)
    param_leaves = treedef.flatten_up_to(params)
    state_leaves, state_def = jax.tree.flatten(state)
    runs = _slot_runs(inner, state, n)
    groups = tree_groups.shape_groups(leaves, param_leaves)
    new_updates: List[Any] = [None] * n
    new_state = list(state_leaves)
    for members in groups:
      one = (param_leaves[members[0]],)
      one_def = jax.tree.structure(jax.eval_shape(inner.init, one))
      # The flat state of `inner` over the one-parameter tree `one`: each run becomes one leaf,
      # the group's entries stacked; the other leaves (step counts) are shared.
      flat, axes = _member_state(state_leaves, runs, members, 0, stacked=True)
      if one_def.num_leaves != len(flat):
        raise ValueError("same_shape_batched: the optimizer state is not one entry per parameter")

      def member_update(u, p, s):
        out_u, out_s = inner.update((u,), one_def.unflatten(s), (p,))
        return out_u[0], jax.tree.leaves(out_s)

      u_g, s_g = jax.vmap(member_update, in_axes=(0, 0, axes), out_axes=(0, axes))(
          jnp.stack([leaves[m] for m in members]), jnp.stack([param_leaves[m] for m in members]), flat)
      for pos, m in enumerate(members):
        new_updates[m] = u_g[pos]
      # The group's new state back: shared leaves from the group's result, runs unstacked.
      _write_member_state(new_state, s_g, runs, members, shared=True, stacked=True)
    return treedef.unflatten(new_updates), state_def.unflatten(new_state)

  return optax.GradientTransformation(inner.init, update)


def per_layer(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`inner` (a chain of per-parameter transforms: Adafactor) for a scanned network's parameters
  (`T5Config.scan_layers`), as for the unrolled network's: each layer's slice of a stacked leaf
  (`encoder/layers/...`) is its own parameter, so Adafactor's update clipping and parameter-scale
  RMS are per layer, not over the stack, and a scanned run takes the unrolled run's steps. Each
  stacked leaf is one update vmapped over its layer axis (the program does not grow with depth);
  the other leaves go through `inner` together. The state is `inner`'s state of the unrolled
  network in the scanned layout (`network.to_layout` converts it, as checkpoints of the other
  layout are)."""

  def stacked_leaves(tree) -> List[int]:
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [i for i, path in enumerate(paths) if any(getattr(k, "key", None) == network.STACK for k in path)]

  def init(params):
    leaves, treedef = jax.tree.flatten(params)
    stacked = stacked_leaves(params)
    state = inner.init(treedef.unflatten([x[0] if i in stacked else x for i, x in enumerate(leaves)]))
    state_leaves, state_def = jax.tree.flatten(state)
    runs = _slot_runs(inner, state, len(leaves))
    for m in stacked:
      one = jax.vmap(lambda p: [jax.tree.leaves(inner.init((p,)))[i] for i in _one_runs(inner, p)])(leaves[m])
      for (start, _), entry in zip(runs, one):
        state_leaves[start + m] = entry
    return state_def.unflatten(state_leaves)

  def update(updates, state, params=None, **extra):
    if params is None:
      raise ValueError("per_layer needs the parameters")
    leaves, treedef = jax.tree.flatten(updates)
    param_leaves = treedef.flatten_up_to(params)
    state_leaves, state_def = jax.tree.flatten(state)
    runs = _slot_runs(inner, state, len(leaves))
    stacked = stacked_leaves(updates)
    new_updates, new_state = list(leaves), list(state_leaves)
    rest = [i for i in range(len(leaves)) if i not in stacked]
    groups = [(rest, False)] + [([m], True) for m in stacked]
    for members, vmapped in groups:
      if not members:
        continue
      sub, axes = _member_state(state_leaves, runs, members, 0 if vmapped else None)
      one_def = jax.tree.structure(jax.eval_shape(inner.init, tuple(param_leaves[m][0] if vmapped else param_leaves[m]
                                                                      for m in members)))

      def member_update(u, p, s, one_def=one_def):
        out_u, out_s = inner.update(tuple(u), one_def.unflatten(s), tuple(p), **extra)
        return list(out_u), jax.tree.leaves(out_s)

      u_in, p_in = [leaves[m] for m in members], [param_leaves[m] for m in members]
      if vmapped:
        u_out, s_out = jax.vmap(member_update, in_axes=(0, 0, axes), out_axes=(0, axes))(u_in, p_in, sub)
      else:
        u_out, s_out = member_update(u_in, p_in, sub)
      for m, u in zip(members, u_out):
        new_updates[m] = u
      _write_member_state(new_state, s_out, runs, members, shared=not vmapped or not rest)
    return treedef.unflatten(new_updates), state_def.unflatten(new_state)

  return optax.GradientTransformationExtraArgs(init, update)


def _one_runs(inner: optax.GradientTransformation, param) -> List[int]:
  """Positions of the per-parameter entries in the flat state of `inner` over `(param,)`."""
  state = jax.eval_shape(inner.init, (param,))
  return [start for start, _ in _slot_runs(inner, state, 1)]


def _member_state(state_leaves, runs, members: List[int], axis, stacked: bool = False
                  ) -> Tuple[List[Any], List[Any]]:
  """The flat state of `inner` over the parameters `members` (its shared leaves, then each run's
  entries of the members; `stacked`: the entries of a run stacked into one leaf, as for one
  parameter), and the vmap axes of its leaves (`axis` for the entries)."""
  flat, axes, cut = [], [], 0
  for start, end in runs:
    flat += state_leaves[cut:start]
    axes += [None] * (start - cut)
    entries = [state_leaves[start + m] for m in members]
    added = [jnp.stack(entries)] if stacked else entries
    flat += added
    axes += [axis] * len(added)
    cut = end
  flat += state_leaves[cut:]
  axes += [None] * (len(state_leaves) - cut)
  return flat, axes


def _write_member_state(new_state: List[Any], member_flat: List[Any], runs, members: List[int], shared: bool,
                        stacked: bool = False):
  """Writes `_member_state`'s layout back into the full flat state (`shared`: its shared leaves too;
  `stacked`: each run one stacked leaf)."""
  cut, out = 0, 0
  for start, end in runs:
    for j in range(cut, start):
      if shared:
        new_state[j] = member_flat[out]
      out += 1
    for pos, m in enumerate(members):
      new_state[start + m] = member_flat[out][pos] if stacked else member_flat[out + pos]
    out += 1 if stacked else len(members)
    cut = end
  for j in range(cut, len(new_state)):
    if shared:
      new_state[j] = member_flat[out]
    out += 1


def unrolled(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`inner` run on the unrolled layout of a scanned network's tree (`network.to_layout`: slicing in,
  stacking out), its state kept in the scanned layout: for a transform whose values depend on the
  tree's leaves as such, as the DP noise does (each leaf's normals from its place in the tree), so
  a scanned run draws the unrolled run's noise."""

  def init(params):
    return network.to_layout(inner.init(network.to_layout(params, False)), True)

  def update(updates, state, params=None, **extra):
    out = None if params is None else network.to_layout(params, False)
    new_updates, new_state = inner.update(network.to_layout(updates, False), network.to_layout(state, False), out,
                                          **extra)
    return network.to_layout(new_updates, True), network.to_layout(new_state, True)

  return optax.GradientTransformationExtraArgs(init, update)
