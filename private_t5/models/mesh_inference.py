"""Decoding and scoring on a device mesh: prompts over the `data` axis, parameters as in training.

`MeshInference(config, mesh, params=...)` places a checkpoint's parameters on a (data, model)
mesh of all devices (of all processes) by the logical-axis rules of training
(`models.sharding`: `LOGICAL_AXIS_RULES` splits `vocab`, `mlp`, `heads` and `joined_kv` over
`model`, `FULLY_SHARDED_RULES` also `embed` over `data`), and runs `EncoderDecoderModel`'s
decoding (greedy, beam search or sampling, with the KV cache) and scoring as one compiled
program per method and shape, as T5X's partitioned `predict_batch` does. A batch is a global
one: its rows are split over the `data` axis, each process supplies the rows of its own devices
(`sharding.local_rows`), and the result is replicated, so every process reads all of it. The
last batch of a pass is padded with zero rows, masked: greedy decoding treats them as ended from
the start (they never keep the loop running), and every method drops their output.

Decoding is row by row independent, so the tokens equal those of one device for any mesh and
any number of processes (checked in tests/test_decode_mesh.py); only the throughput changes.
"""
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from private_t5.models import layers, sharding
from private_t5.models.config import T5Config
from private_t5.models.model import GREEDY, EncoderDecoderModel
from private_t5.models.network import param_logical_axes, param_shapes

PyTree = Any


def _by_path(tree: PyTree) -> Dict[str, Any]:
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


class MeshInference:
  """A model's parameters on a mesh, with its compiled decode and score programs.

  Attributes:
    config: the T5Config.
    mesh: the (data, model) mesh (default: every device on `data`).
    rules: the logical-axis rules of the parameters.
    param_shardings: NamedSharding of every parameter (the tree of `models.param_shapes`).
    params: the parameters placed on the mesh (None for a compile-only object).
  """

  def __init__(self, config: T5Config, mesh: Optional[jax.sharding.Mesh] = None, *, params: PyTree = None,
               rules: Sequence[Tuple[str, Optional[str]]] = sharding.LOGICAL_AXIS_RULES):
    self.config = config
    self.mesh = sharding.create_mesh((-1, 1)) if mesh is None else mesh
    self.rules = tuple(rules)
    self.model = EncoderDecoderModel(config)
    self.param_shapes = param_shapes(config)
    self.param_shardings = sharding.param_shardings(param_logical_axes(config), self.param_shapes, self.mesh,
                                                    self.rules)
    self._programs: Dict[tuple, Callable] = {}
    self.params = None if params is None else self.place(params)

  @property
  def data_size(self) -> int:
    """Positions of the mesh's `data` axis: a batch's rows are a multiple of it."""
    return int(self.mesh.shape[sharding.DATA_AXIS])

  @property
  def devices(self) -> int:
    """Devices of the mesh (of all processes)."""
    return int(self.mesh.devices.size)

  def global_batch_size(self, batch_size: int) -> int:
    """`batch_size` rounded up to a multiple of the `data` axis (the rows of one program)."""
    return -(-int(batch_size) // self.data_size) * self.data_size

  def place(self, params: PyTree) -> PyTree:
    """`params` (host or device arrays, the same on every process) laid out on the mesh."""
    shardings = _by_path(self.param_shardings)

    def put(path, x):
      target = shardings[jax.tree_util.keystr(path)]
      if isinstance(x, jax.Array) and x.sharding == target:
        return x
      return jax.device_put(np.asarray(x), target)

    return jax.tree_util.tree_map_with_path(put, params)

  # -- programs ----------------------------------------------------------------------------------

  def abstract_params(self) -> PyTree:
    """The parameters as ShapeDtypeStructs with their shardings (nothing allocated)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        self.param_shapes, self.param_shardings)

  def decode_program(self, max_decode_length: int, method: str = GREEDY, **options) -> Callable:
    """The jitted `(params, encoder_input_tokens [B, Li], active [B] bool) -> tokens int32
    [B, max_decode_length]` of `EncoderDecoderModel.predict_batch` (`options`: its beam_size,
    alpha, eos_id, use_cache; `active` False marks padding rows), rows over `data`, the result
    replicated."""
    key = ("decode", int(max_decode_length), method, tuple(sorted(options.items())))
    if key not in self._programs:
      def decode(params, tokens, active):
        # Cast once, not on each generated token inside the loop (the same tokens).
        params = layers.cast_at_use(params, self.config.dtype)
        return self.model.predict_batch(params, tokens, max_decode_length=max_decode_length, method=method,
                                        active=active, **options)
      rows = sharding.batch_sharding(self.mesh)
      self._programs[key] = jax.jit(decode, in_shardings=(self.param_shardings, rows, rows),
                                    out_shardings=sharding.replicated(self.mesh))
    return self._programs[key]

  def lower_decode(self, batch_size: int, width: int, max_decode_length: int, method: str = GREEDY, **options):
    """The decode program lowered for a `[batch_size, width]` batch, from shapes alone (no
    parameters needed): `.compile().memory_analysis()` gives its per-device memory."""
    rows, b = sharding.batch_sharding(self.mesh), self.global_batch_size(batch_size)
    tokens = jax.ShapeDtypeStruct((b, width), jnp.int32, sharding=rows)
    active = jax.ShapeDtypeStruct((b,), jnp.bool_, sharding=rows)
    return self.decode_program(max_decode_length, method, **options).lower(self.abstract_params(), tokens, active)

  def score_program(self) -> Callable:
    """The jitted `(params, encoder_inputs, targets, weights) -> log p [B]` (`score_batch`)."""
    if "score" not in self._programs:
      def score(params, encoder_inputs, targets, weights):
        return self.model.score_batch(params, {"encoder_input_tokens": encoder_inputs,
                                               "decoder_target_tokens": targets, "decoder_loss_weights": weights})
      rows = sharding.batch_sharding(self.mesh)
      self._programs["score"] = jax.jit(score, in_shardings=(self.param_shardings, rows, rows, rows),
                                        out_shardings=sharding.replicated(self.mesh))
    return self._programs["score"]

  # -- running -----------------------------------------------------------------------------------

  def _global(self, rows: np.ndarray, batch_size: int, dtype) -> jax.Array:
    """A padded global batch from all its rows (every process has them): this process's part
    placed on its devices."""
    batch = np.zeros((batch_size,) + rows.shape[1:], dtype)
    batch[:len(rows)] = rows
    start, stop = sharding.local_rows(self.mesh, batch_size)
    return sharding.global_batch(batch[start:stop], self.mesh, batch_size)

  def decode(self, inputs: np.ndarray, max_decode_length: int, *, batch_size: int, method: str = GREEDY,
             on_batch: Optional[Callable[[int, float], None]] = None, **options) -> np.ndarray:
    """Decodes every row of `inputs` int32 `[n, Li]` (all rows, on every process) in global
    batches of `batch_size` rows (rounded up to a multiple of the `data` axis; the last one
    padded with zero rows, marked inactive: greedy decoding stops when the real rows are done).

    The first batch is read back before the next is started (its time includes compilation);
    then batch k + 1 is dispatched before batch k is read, so the devices do not wait for the host.

    Args:
      on_batch: called after each batch with (its real rows, seconds since the previous call).
      options: `predict_batch`'s beam_size, alpha, eos_id, use_cache.

    Returns:
      int32 `[n, max_decode_length]`, zeros after the first EOS (beam search: the best beam).
    """
    if self.params is None:
      raise ValueError("MeshInference built without parameters decodes nothing (compile only)")
    inputs = np.asarray(inputs, np.int32)
    n = inputs.shape[0]
    b = self.global_batch_size(batch_size)
    program = self.decode_program(max_decode_length, method, **options)
    out = np.zeros((n, max_decode_length), np.int32)
    starts = list(range(0, n, b))
    clock = [time.time()]

    def dispatch(lo):
      rows = min(b, n - lo)
      return program(self.params, self._global(inputs[lo:lo + rows], b, np.int32),
                     self._global(np.ones(rows, np.bool_), b, np.bool_))

    def read(lo, result):
      rows = min(b, n - lo)
      out[lo:lo + rows] = np.asarray(result)[:rows]
      if on_batch is not None:
        now = time.time()
        on_batch(rows, now - clock[0])
        clock[0] = now

    pending = None
    for i, lo in enumerate(starts):
      result = dispatch(lo)
      if pending is not None:
        read(*pending)
      pending = (lo, result)
      if i == 0:
        read(*pending)
        pending = None
    if pending is not None:
      read(*pending)
    return out

  def score(self, encoder_inputs: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """log p `[B]` of `score_batch` for one batch (padded to a multiple of the `data` axis)."""
    if self.params is None:
      raise ValueError("MeshInference built without parameters scores nothing (compile only)")
    n = len(encoder_inputs)
    b = self.global_batch_size(max(n, 1))
    args = [self._global(np.asarray(x, dtype), b, dtype)
            for x, dtype in ((encoder_inputs, np.int32), (targets, np.int32), (weights, np.float32))]
    return np.asarray(self.score_program()(self.params, *args))[:n]
