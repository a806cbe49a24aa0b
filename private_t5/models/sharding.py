"""Device meshes and the logical-axis rules that lay a T5's parameters and batches out on them.

A run uses a 2-D `jax.sharding.Mesh` with axes `data` (the rows of a batch are split across it)
and `model` (large parameter dimensions are split across it). Each parameter carries logical
axis names (`models.param_logical_axes`: `vocab`, `embed`, `mlp`, `heads`, `joined_kv`, ...);
a table of rules maps each logical name to a mesh axis or to None (replicated), as T5X's
partitioner does. Two tables:

* "replicated" (`LOGICAL_AXIS_RULES`, the default): T5X's 1-D model-parallel rules; every
  position of the `data` axis holds a whole copy of the parameters.
* "fully_sharded" (`FULLY_SHARDED_RULES`): also `embed` over `data` (ZeRO stage 3 / fully
  sharded data parallelism, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models").

Training (`train.partitioning`, which adds the optimizer state, multi-host start-up and
stacked microbatches) and evaluation (`models.mesh_decoding`) use the same tables, so a model
trained on a mesh is evaluated laid out the same way. With several processes the mesh spans
the devices of all of them (`jax.devices()`); each process holds the rows of a global batch
that its own devices hold on the `data` axis (`local_rows`).
"""
import math
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
    ("lora_rank", None),
)
# The same, with the parameters' `embed` dimension also split over `data` (ZeRO-3 / FSDP).
FULLY_SHARDED_RULES: Tuple[Tuple[str, Optional[str]], ...] = tuple(
    (name, DATA_AXIS if name == "embed" else axis) for name, axis in LOGICAL_AXIS_RULES)
REPLICATED, FULLY_SHARDED = "replicated", "fully_sharded"
PARAMETER_SHARDINGS = {REPLICATED: LOGICAL_AXIS_RULES, FULLY_SHARDED: FULLY_SHARDED_RULES}


def create_mesh(mesh_shape: Sequence[int] = (-1, 1), devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A (data, model) mesh over `devices` (default: all); one entry of `mesh_shape` may be -1.

  Raises:
    ConfigError: the shape does not match the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  if (not isinstance(mesh_shape, (list, tuple)) or len(mesh_shape) != 2
      or any(not isinstance(s, (int, np.integer)) or isinstance(s, bool) for s in mesh_shape)):
    raise ConfigError(f"mesh_shape must be (data, model), two integers (one may be -1), got {mesh_shape!r}")
  shape = [int(s) for s in mesh_shape]
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
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


def mesh_shape_of(mesh: Mesh) -> Tuple[int, int]:
  """(data, model) sizes of a mesh built by `create_mesh`."""
  return int(mesh.shape[DATA_AXIS]), int(mesh.shape[MODEL_AXIS])


def axis_rules(parameter_sharding: str) -> Tuple[Tuple[str, Optional[str]], ...]:
  """The logical-axis rules of `parameter_sharding` ("replicated" | "fully_sharded").

  Raises:
    ConfigError: another name.
  """
  if parameter_sharding not in PARAMETER_SHARDINGS:
    raise ConfigError(f"parameter_sharding must be one of {sorted(PARAMETER_SHARDINGS)}, "
                      f"got {parameter_sharding!r}")
  return PARAMETER_SHARDINGS[parameter_sharding]


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


def divisible_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """Drops the sharding of dimensions the mesh axis does not divide (replicated instead)."""
  return PartitionSpec(*[
      axis if axis is None or dim % mesh.shape[axis] == 0 else None
      for axis, dim in zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape)])


def param_shardings(logical_axes: PyTree, shapes: PyTree, mesh: Mesh,
                    rules: Sequence[Tuple[str, Optional[str]]] = LOGICAL_AXIS_RULES) -> PyTree:
  """NamedSharding for every parameter, from its logical axes (tuples) and its shape."""
  def one(axes, shape):
    spec = divisible_spec(logical_to_spec(axes, rules), shape.shape, mesh)
    return NamedSharding(mesh, spec)
  return jax.tree.map(one, logical_axes, shapes, is_leaf=lambda x: isinstance(x, tuple))


def bytes_per_device(tree: PyTree) -> int:
  """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs with a sharding): the
  largest per-device total over the devices of the mesh."""
  totals: Dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    sharding, itemsize = leaf.sharding, np.dtype(leaf.dtype).itemsize
    for device in sharding.device_set:
      totals[device] = totals.get(device, 0) + math.prod(sharding.shard_shape(leaf.shape)) * itemsize
  return max(totals.values(), default=0)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows of a batch split over the `data` axis, everything else replicated."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def check_batch_divisible(batch_size: int, mesh: Mesh) -> None:
  if batch_size % mesh.shape[DATA_AXIS]:
    raise ConfigError(f"batch_size={batch_size} must be a multiple of the mesh's data axis "
                      f"({mesh.shape[DATA_AXIS]} devices)")


def local_rows(mesh: Mesh, batch_size: int) -> Tuple[int, int]:
  """[start, stop) of the rows of a global batch this process's devices hold (`data` axis).

  Every row is held by exactly one data-axis position; the positions of one process are
  contiguous for meshes built by `create_mesh` (devices in process order). One process: all rows.
  """
  check_batch_divisible(batch_size, mesh)
  index_map = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
  starts = sorted({idx[0].start or 0 for idx in index_map.values()})
  stops = sorted({batch_size if idx[0].stop is None else idx[0].stop for idx in index_map.values()})
  start, stop = starts[0], stops[-1]
  per_position = batch_size // mesh.shape[DATA_AXIS]
  if (stop - start) != per_position * len(starts):
    raise ConfigError(f"the rows of this process's devices on the data axis are not contiguous "
                      f"(mesh {dict(mesh.shape)}); order the mesh's devices by process")
  return start, stop


def local_data_positions(mesh: Mesh) -> int:
  """How many positions of the `data` axis this process's devices occupy."""
  axis = mesh.axis_names.index(DATA_AXIS)
  local = {d.id for d in jax.local_devices()}
  return len({idx[axis] for idx, d in np.ndenumerate(mesh.devices) if d.id in local})


def global_batch(local: np.ndarray, mesh: Mesh, batch_size: int) -> jax.Array:
  """The global `[batch_size, ...]` array, rows over `data`, from this process's rows of it
  (`local_rows`; with one process the whole batch)."""
  sharding = batch_sharding(mesh)
  local = np.asarray(local)
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  return jax.make_array_from_process_local_data(sharding, local, (batch_size,) + local.shape[1:])
