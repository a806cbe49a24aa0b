"""Arrays of a tree grouped by shape, so that work done once per array is done once per shape.

A step touches every parameter array: T5 v1.1 small has ~190 of them but only 9 shapes (12 in
the decoder's self- and cross-attention are the same four). On a GPU each per-array reduction
is its own kernel launch (often two: XLA reduces a large array in two passes); stacked by
shape, the arrays of one shape are reduced by one batched kernel. `shape_groups` is the
grouping (used by `train.optimizers.same_shape_batched` and the norms below); `norm` is
`optax.tree.norm` computed that way.
"""
from typing import Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp


def shape_groups(leaves: Sequence, *others: Sequence) -> List[List[int]]:
  """Positions of `leaves` grouped by (shape, dtype), groups and members in first-seen order;
  with `others` (trees flattened alike), positions whose arrays in those differ in shape or
  dtype are apart too."""
  groups: Dict[Tuple, List[int]] = {}
  for i, leaf in enumerate(leaves):
    key = tuple((tuple(jnp.shape(x[i])), jnp.result_type(x[i]).name) for x in (leaves,) + others)
    groups.setdefault(key, []).append(i)
  return list(groups.values())


def sum_of_squares(tree) -> jax.Array:
  """sum over the arrays of `tree` of sum(x**2), in float32, one reduction per shape."""
  leaves = jax.tree.leaves(tree)
  total = jnp.float32(0)
  for members in shape_groups(leaves):
    stacked = jnp.stack([leaves[m] for m in members]).astype(jnp.float32)
    total = total + jnp.sum(jnp.square(stacked))
  return total


def norm(tree) -> jax.Array:
  """The L2 norm of all of `tree`'s arrays together (`optax.tree.norm`), one reduction per shape."""
  return jnp.sqrt(sum_of_squares(tree))


def stacked(tree) -> List[jax.Array]:
  """The arrays of `tree` stacked by shape: one `[n, ...]` array a group of `shape_groups`."""
  leaves = jax.tree.leaves(tree)
  return [jnp.stack([leaves[m] for m in members]) for members in shape_groups(leaves)]


def unstacked(stacks: Sequence[jax.Array], like):
  """The tree `stacked(like)` came from, its arrays read back from `stacks`."""
  leaves, treedef = jax.tree.flatten(like)
  out = [None] * len(leaves)
  for members, stack in zip(shape_groups(leaves), stacks):
    for row, m in enumerate(members):
      out[m] = stack[row]
  return jax.tree.unflatten(treedef, out)
