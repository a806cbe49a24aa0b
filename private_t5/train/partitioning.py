"""Device meshes and logical-axis sharding rules (T5X-style partitioning).

A run uses a 2-D `jax.sharding.Mesh` with axes `data` (examples of a batch are split across
it) and `model` (large parameter dimensions are split across it). Each parameter carries
logical axis names (`models.param_logical_axes`: `vocab`, `embed`, `mlp`, `heads`,
`joined_kv`, ...); a table of rules maps each logical name to a mesh axis or to None
(replicated). Two tables, picked by `train.parameter_sharding`:

* "replicated" (`LOGICAL_AXIS_RULES`, the default): T5X's 1-D model-parallel rules; every
  position of the `data` axis holds a whole copy of the parameters and optimizer state.
* "fully_sharded" (`FULLY_SHARDED_RULES`): also `embed` over `data`, the fully-sharded data
  parallelism of ZeRO stage 3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models") that T5X offers the same way: each parameter (and its
  optimizer state) is split over every device, and XLA gathers a layer's weights where the step
  uses them. On a (D, 1) mesh each device holds about 1/D of the parameters and moments.

The optimizer state follows its parameter (`optimizer_state_shardings`): a moment shaped like
its parameter is sharded like it, Adafactor's factored row and column moments keep the
sharding of the dimensions they keep. So does the noise transform's state
(`noise_state_shardings`: correlated noise's buffers, each shaped like a parameter).

Multi-host (TPU pods, GPU clusters, `private-t5 launch` on one machine): every process runs
the same command; `initialize_distributed` calls `jax.distributed.initialize()` before any
other JAX call (with the coordinator, process count and id of `private-t5 launch`'s
environment variables, else auto-detected from the cluster: TPU metadata, SLURM), and the mesh
then spans the devices of all processes (`jax.devices()`). Each process builds only the rows
of the global batch owned by its own devices on the `data` axis (`local_rows`) and
`shard_batch` assembles the global array from them. With one process it is a no-op.
"""
import atexit
import logging
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from private_t5 import quiet_tf
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


# Environment of one process of a local cluster (set by `private-t5 launch`).
COORDINATOR_ENV = "PRIVATE_T5_COORDINATOR"
NUM_PROCESSES_ENV = "PRIVATE_T5_NUM_PROCESSES"
PROCESS_ID_ENV = "PRIVATE_T5_PROCESS_ID"
# Seconds a process waits for the others to join the cluster.
INITIALIZATION_TIMEOUT_S = 120
# Seconds process 0 waits, once its own client has left the cluster, before it stops the
# coordination service. XLA's gRPC coordination service re-arms a method's handler on its polling
# thread after the handler has already sent its reply (from another thread); if the service stops
# in between, gRPC finds a request left armed when it destroys the server and aborts the process
# (SIGABRT in `RealRequestMatcher`), after the run's work is done. The last reply is the one to
# this process's own shutdown, so a short wait lets that thread finish first.
SERVICE_STOP_DELAY_S = 1.0


def hide_accelerators_from_tensorflow() -> None:
  """TensorFlow, which runs the input pipelines of `tfds:` corpora and GLUE, keeps to the CPU.

  `quiet_tf.import_tensorflow` hides the GPUs from TensorFlow when it imports it; this call
  hides them from a TensorFlow that something else imported already. It never imports
  TensorFlow (a run on local corpora needs none).
  """
  quiet_tf.hide_accelerators()


def initialize_distributed() -> bool:
  """Starts multi-host JAX when launched as one of several processes; returns True if so.

  Triggered by `PRIVATE_T5_COORDINATOR` (+ `PRIVATE_T5_NUM_PROCESSES`, `PRIVATE_T5_PROCESS_ID`:
  a local cluster of CPU processes, collectives through gloo), by `JAX_COORDINATOR_ADDRESS`, or by
  `PRIVATE_T5_MULTIHOST=1` (a TPU pod or SLURM job that jax auto-detects); must run before any
  other JAX computation. Idempotent.
  """
  if jax.distributed.is_initialized():
    return True
  coordinator = os.environ.get(COORDINATOR_ENV)
  if coordinator:
    try:
      num_processes = int(os.environ[NUM_PROCESSES_ENV])
      process_id = int(os.environ[PROCESS_ID_ENV])
    except (KeyError, ValueError) as e:
      raise ConfigError(f"{COORDINATOR_ENV} is set but {NUM_PROCESSES_ENV}/{PROCESS_ID_ENV} are "
                        f"missing or not integers: {e}") from e
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=INITIALIZATION_TIMEOUT_S)
  elif os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("PRIVATE_T5_MULTIHOST") == "1":
    jax.distributed.initialize()
  else:
    return False
  # atexit runs last-registered first: this runs before JAX's own exit hook, which then finds
  # the cluster already left.
  atexit.register(leave_cluster)
  return True


def leave_cluster() -> None:
  """Leaves the cluster that `initialize_distributed` joined (at exit; a no-op without one).

  What `jax.distributed.shutdown()` does, except that process 0 stops the coordination service
  `SERVICE_STOP_DELAY_S` after its client has left rather than at once (see there).
  """
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  state = getattr(jax_distributed, "global_state", None)
  service = getattr(state, "service", None)
  if service is not None:
    state.service = None
  jax.distributed.shutdown()
  if service is not None:
    time.sleep(SERVICE_STOP_DELAY_S)
    service.shutdown()


def is_primary() -> bool:
  """True on the process that writes the run's files (process 0; the only one single-host)."""
  return jax.process_index() == 0


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


def axis_rules(parameter_sharding: str) -> Tuple[Tuple[str, Optional[str]], ...]:
  """The logical-axis rules of `parameter_sharding` ("replicated" | "fully_sharded").

  Raises:
    ConfigError: another name.
  """
  if parameter_sharding not in PARAMETER_SHARDINGS:
    raise ConfigError(f"parameter_sharding must be one of {sorted(PARAMETER_SHARDINGS)}, "
                      f"got {parameter_sharding!r}")
  return PARAMETER_SHARDINGS[parameter_sharding]


def _moment_spec(param_spec: PartitionSpec, param_shape: Sequence[int],
                 shape: Sequence[int]) -> PartitionSpec:
  """Spec of an optimizer-state array of `shape` that belongs to a parameter.

  Shaped like the parameter: the parameter's spec. The parameter's shape less one dimension
  (Adafactor's factored second moments, a mean over that dimension): the spec of the
  dimensions kept. Anything else (a placeholder of shape (1,), a scalar): replicated.
  """
  spec = tuple(param_spec) + (None,) * (len(param_shape) - len(param_spec))
  shape, param_shape = tuple(shape), tuple(param_shape)
  if shape == param_shape:
    return PartitionSpec(*spec)
  for dropped in reversed(range(len(param_shape))):
    if shape == param_shape[:dropped] + param_shape[dropped + 1:]:
      return PartitionSpec(*(spec[:dropped] + spec[dropped + 1:]))
  return PartitionSpec()


def optimizer_state_shardings(optimizer, opt_state: PyTree, params: PyTree, param_shardings: PyTree,
                              mesh: Mesh) -> PyTree:
  """NamedSharding of every array of `opt_state` (abstract or concrete), following its parameter.

  `optax.tree_map_params` pairs each per-parameter entry of the state with its parameter;
  the rest (step counts) is replicated.
  """
  def one(moment, param, sharding):
    spec = _moment_spec(sharding.spec, param.shape, moment.shape)
    return NamedSharding(mesh, _divisible_spec(spec, moment.shape, mesh))

  pairs = jax.tree.map(lambda p, s: (p, s), params, param_shardings)
  return optax.tree_map_params(
      optimizer, lambda moment, pair: one(moment, *pair), opt_state, pairs,
      transform_non_params=lambda _: replicated(mesh), is_leaf=lambda x: isinstance(x, tuple))


def noise_state_shardings(noise_state: PyTree, params: PyTree, param_shardings: PyTree, mesh: Mesh) -> PyTree:
  """NamedSharding of every array of a noise transform's state (abstract or concrete).

  A correlated-noise state holds trees structured like the parameters (a noise history per
  step, buffers), whose leaves may themselves be small trees (a counter and a stack of
  buffers per parameter, as jax-privacy's streaming matrices keep). Each part of the state
  with the parameters' structure is paired with them: an array shaped like its parameter is
  sharded like it, one with extra leading dimensions (a stack of b such arrays) like it on
  the trailing dimensions, one shaped like a factored moment as `optimizer_state_shardings`
  does. An array outside such a part is sharded like the parameters of its shape when they
  all share one sharding (a flat list of per-parameter arrays); the rest (counters, keys,
  scalars) is replicated. No noise transform needs `optax.tree_map_params`'s placeholder
  protocol for this.
  """
  params_def = jax.tree.structure(params)
  specs_by_shape: Dict[Tuple[int, ...], set] = {}
  for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings)):
    specs_by_shape.setdefault(tuple(p.shape), set()).add(s.spec)

  def like_params(node) -> bool:
    if params_def.num_nodes <= 1:
      return False  # a parameter tree of one array would match every leaf
    try:
      params_def.flatten_up_to(node)
    except (ValueError, TypeError):
      return False
    return True

  def leaf_sharding(leaf, param=None, sharding=None) -> NamedSharding:
    shape = tuple(np.shape(leaf))
    if param is not None:
      param_shape = tuple(param.shape)
      extra = len(shape) - len(param_shape)
      if extra > 0 and shape[extra:] == param_shape:  # a stack of arrays like the parameter
        spec = PartitionSpec(*((None,) * extra + tuple(sharding.spec)))
      else:
        spec = _moment_spec(sharding.spec, param_shape, shape)
    else:
      specs = specs_by_shape.get(shape, set())
      spec = next(iter(specs)) if len(specs) == 1 else PartitionSpec()
    return NamedSharding(mesh, _divisible_spec(spec, shape, mesh))

  def part(node):
    if not like_params(node):
      return leaf_sharding(node)  # a leaf (like_params is also the traversal's is_leaf)
    subtrees = params_def.flatten_up_to(node)
    out = [jax.tree.map(lambda leaf, p=p, s=s: leaf_sharding(leaf, p, s), sub)
           for sub, p, s in zip(subtrees, jax.tree.leaves(params), jax.tree.leaves(param_shardings))]
    return jax.tree.unflatten(params_def, out)

  return jax.tree.map(part, noise_state, is_leaf=like_params)


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


def stacked_batch_sharding(mesh: Mesh) -> NamedSharding:
  """A step's microbatches stacked on a leading axis [K, rows, ...]: each microbatch's rows split
  over the `data` axis as `batch_sharding`, the microbatch axis whole on every device."""
  return NamedSharding(mesh, PartitionSpec(None, DATA_AXIS))


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


def spread_over_data(indices: np.ndarray, data_size: int) -> List[np.ndarray]:
  """The example indices of each `data`-axis position: the k-th index goes to position k mod D.

  A Poisson-sampled batch has fewer real rows than its padded size; spread round-robin, the
  real rows (and the corpus reads) are balanced over the data axis and so over the processes,
  instead of filling the first positions and leaving the padding to the last ones. Each
  position's rows are its real rows, then its padding.
  """
  indices = np.asarray(indices)
  return [indices[p::data_size] for p in range(data_size)]


def local_data_positions(mesh: Mesh) -> int:
  """How many positions of the `data` axis this process's devices occupy."""
  axis = mesh.axis_names.index(DATA_AXIS)
  local = {d.id for d in jax.local_devices()}
  return len({idx[axis] for idx, d in np.ndenumerate(mesh.devices) if d.id in local})


def shard_batch(batch: Dict[str, np.ndarray], mesh: Mesh,
                global_batch_size: Optional[int] = None, stacked: bool = False) -> Dict[str, jax.Array]:
  """Places this process's rows of a batch on the mesh, rows split over `data`.

  With one process `batch` is the whole batch; with several it holds the rows `local_rows`
  names and the global array (of `global_batch_size` rows, by default inferred from the
  local rows and the data positions this process holds) is assembled from every process's
  part (`jax.make_array_from_process_local_data`). `stacked`: every array is [K, rows, ...],
  a step's K microbatches (`stacked_batch_sharding`), the rows on the second axis.
  """
  sharding = stacked_batch_sharding(mesh) if stacked else batch_sharding(mesh)
  if jax.process_count() == 1:
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
  row_axis = 1 if stacked else 0
  if global_batch_size is None:
    rows = np.shape(next(iter(batch.values())))[row_axis]
    global_batch_size = rows // local_data_positions(mesh) * mesh.shape[DATA_AXIS]

  def global_shape(v) -> Tuple[int, ...]:
    shape = list(np.shape(v))
    shape[row_axis] = global_batch_size
    return tuple(shape)

  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), global_shape(v))
          for k, v in batch.items()}
