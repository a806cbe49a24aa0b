"""Device meshes and logical-axis sharding rules (T5X-style partitioning).

A run uses a 2-D `jax.sharding.Mesh` with axes `data` (examples of a batch are split across
it) and `model` (large parameter dimensions are split across it). Each parameter carries
logical axis names (`models.param_logical_axes`: `vocab`, `embed`, `mlp`, `heads`,
`joined_kv`, ...); `LOGICAL_AXIS_RULES` maps each logical name to a mesh axis or to None
(replicated), T5X's default 1-D model-parallel rules.

Multi-host (TPU pods, GPU clusters): every host runs the same command; `initialize_distributed`
calls `jax.distributed.initialize()` (which reads the coordinator address, process count and
process id from the cluster environment, e.g. TPU metadata or SLURM) before any other JAX call,
and the mesh then spans the devices of all hosts (`jax.devices()`). Each host feeds its own
slice of the global batch. Here (one process) it is a no-op.
"""
import math
import os
from typing import Any, Dict, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from private_t5.errors import ConfigError

PyTree = Any
DATA_AXIS = "data"
MODEL_AXIS = "model"

# logical axis name -> mesh axis (None: replicated).
LOGICAL_AXIS_RULES: Tuple[Tuple[str, Optional[str]], ...] = (
    ("batch", DATA_AXIS),
    ("vocab", MODEL_AXIS),
    ("mlp", MODEL_AXIS),
    ("heads", MODEL_AXIS),
    ("joined_kv", MODEL_AXIS),
    ("kv", None),
    ("embed", None),
    ("relpos_buckets", None),
    ("length", None),
)


def initialize_distributed() -> bool:
  """Starts multi-host JAX when launched as one of several processes; returns True if so.

  Triggered by `JAX_COORDINATOR_ADDRESS` (or a cluster environment that jax auto-detects
  when `PRIVATE_T5_MULTIHOST=1`); must run before any other JAX computation.
  """
  if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("PRIVATE_T5_MULTIHOST") == "1":
    jax.distributed.initialize()
    return True
  return False


def create_mesh(mesh_shape: Sequence[int] = (-1, 1), devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A (data, model) mesh over `devices` (default: all); one entry of `mesh_shape` may be -1.

  Raises:
    ConfigError: the shape does not match the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = [int(s) for s in mesh_shape]
  if len(shape) != 2 or shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ConfigError(f"mesh_shape must be (data, model) with positive sizes (one may be -1), "
                      f"got {tuple(mesh_shape)}")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if len(devices) % known:
      raise ConfigError(f"mesh_shape {tuple(mesh_shape)} does not divide the {len(devices)} devices")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) > len(devices):
    raise ConfigError(f"mesh_shape {tuple(shape)} needs {math.prod(shape)} devices, "
                      f"only {len(devices)} available")
  grid = np.asarray(devices[:math.prod(shape)]).reshape(shape)
  return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def logical_to_spec(logical_axes: Sequence[Optional[str]],
                    rules: Sequence[Tuple[str, Optional[str]]] = LOGICAL_AXIS_RULES) -> PartitionSpec:
  """PartitionSpec of one array from its logical axis names; unknown names replicate."""
  table: Dict[str, Optional[str]] = dict(rules)
  used, spec = set(), []
  for name in logical_axes:
    mesh_axis = table.get(name) if name is not None else None
    if mesh_axis in used:  # one mesh axis may shard only one dimension
      mesh_axis = None
    if mesh_axis is not None:
      used.add(mesh_axis)
    spec.append(mesh_axis)
  return PartitionSpec(*spec)


def _divisible_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """Drops the sharding of dimensions the mesh axis does not divide (replicated instead)."""
  return PartitionSpec(*[
      axis if axis is None or dim % mesh.shape[axis] == 0 else None
      for axis, dim in zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape)])


def param_shardings(logical_axes: PyTree, shapes: PyTree, mesh: Mesh,
                    rules: Sequence[Tuple[str, Optional[str]]] = LOGICAL_AXIS_RULES) -> PyTree:
  """NamedSharding for every parameter, from its logical axes (tuples) and its shape."""
  def one(axes, shape):
    spec = _divisible_spec(logical_to_spec(axes, rules), shape.shape, mesh)
    return NamedSharding(mesh, spec)
  return jax.tree.map(one, logical_axes, shapes, is_leaf=lambda x: isinstance(x, tuple))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows of a batch split over the `data` axis, everything else replicated."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def check_batch_divisible(batch_size: int, mesh: Mesh) -> None:
  if batch_size % mesh.shape[DATA_AXIS]:
    raise ConfigError(f"batch_size={batch_size} must be a multiple of the mesh's data axis "
                      f"({mesh.shape[DATA_AXIS]} devices)")


def shard_batch(batch: Dict[str, np.ndarray], mesh: Mesh) -> Dict[str, jax.Array]:
  """Places a host batch on the mesh, rows split over `data` (single-process)."""
  sharding = batch_sharding(mesh)
  return {k: jax.device_put(v, sharding) for k, v in batch.items()}
