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

The mesh, the two tables of rules and the row layout (`create_mesh`, `param_shardings`,
`local_rows`, ...) are `models.sharding`, re-exported here: evaluation (`models.mesh_inference`)
lays a checkpoint out on its mesh by the same rules.
"""
import atexit
import logging
import os
import time
from typing import Any, Dict, Optional, Sequence, Tuple

import jax
import numpy as np
import optax
# JAX's distributed state: `leave_cluster` stops the coordination service itself.
from jax._src import distributed as jax_distributed
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from private_t5 import quiet_tf
from private_t5.errors import ConfigError
# The mesh and the logical-axis rules live with the model, which evaluation lays out the same way.
from private_t5.models.sharding import (
    DATA_AXIS,
    PyTree,
    batch_sharding,
    divisible_spec,
    local_data_positions,
    param_shardings,
    replicated,
)
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.models.sharding': ('FULLY_SHARDED_RULES', 'LOGICAL_AXIS_RULES', 'local_rows'),
})

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
    return NamedSharding(mesh, divisible_spec(spec, moment.shape, mesh))

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
    return NamedSharding(mesh, divisible_spec(spec, shape, mesh))

  def part(node):
    if not like_params(node):
      return leaf_sharding(node)  # a leaf (like_params is also the traversal's is_leaf)
    subtrees = params_def.flatten_up_to(node)
    out = [jax.tree.map(lambda leaf, p=p, s=s: leaf_sharding(leaf, p, s), sub)
           for sub, p, s in zip(subtrees, jax.tree.leaves(params), jax.tree.leaves(param_shardings))]
    return jax.tree.unflatten(params_def, out)

  return jax.tree.map(part, noise_state, is_leaf=like_params)


def stacked_batch_sharding(mesh: Mesh) -> NamedSharding:
  """A step's microbatches stacked on a leading axis [K, rows, ...]: each microbatch's rows split
  over the `data` axis as `batch_sharding`, the microbatch axis whole on every device."""
  return NamedSharding(mesh, PartitionSpec(None, DATA_AXIS))


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
