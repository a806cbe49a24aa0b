"""The train step on 8 fake devices, compiled only: XLA's per-device memory of the DP step.

Nothing runs; each step is compiled from the abstract train state and its per-device
`memory_analysis()` read. Three properties of the sharded step:

* the Gaussian noise is drawn sharded like the parameters, in a loop (a CPU) or batched (an
  accelerator): adding it costs a device about its shard of the parameters, not a whole copy
  (the control, a single flat draw cut into the leaves, does cost a whole copy on every device);
* the DP-ghost step's per-device peak stays close to the non-DP step's on a (1, 8)
  model-parallel mesh;
* fully-sharded parameters and optimizer state (ZeRO-3) hold about 1/8 of the replicated bytes
  on each device of an (8, 1) mesh, and the compiled step needs less memory.
"""
import jax
import jax.numpy as jnp
import numpy as np

from private_t5.models import config
from private_t5.models import network
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp import aggregator as aggregator_lib
from private_t5.dp import ghost
from private_t5.dp import noise as noise_lib
from private_t5.train import optimizers
from private_t5.models import sharding as sharding_lib
from private_t5.train.trainer import Trainer, make_loss_fn

# T5 v1.1 tiny cut to one layer each side (2.5M parameters, 9.6 MiB, most of them in the two
# embeddings): with 8-token inputs its activations are small next to its parameters, so a whole
# copy of the noise on each device is a decisive difference; it compiles in seconds.
CONFIG = config.load_preset("t5_1_1_tiny", dropout_rate=0.0, num_encoder_layers=1, num_decoder_layers=1)
BATCH = 8
SHORT = (8, 4)  # (inputs, targets): activations small next to the parameters
PAPER_LIKE = (128, 32)  # activations dominate, as in training
KEYS = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))


def _batch(inputs, targets):
  ones = lambda *shape: np.ones(shape, np.int32)
  return {"encoder_input_tokens": ones(BATCH, inputs), "decoder_input_tokens": ones(BATCH, targets),
          "decoder_target_tokens": ones(BATCH, targets),
          "decoder_loss_weights": np.ones((BATCH, targets), np.float32),
          "example_weight": np.ones((BATCH,), np.float32)}


def _trainer(method: str, mesh_shape, sharding=sharding_lib.REPLICATED, sigma=1.0):
  mesh = sharding_lib.create_mesh(mesh_shape)
  loss_fn = make_loss_fn(CONFIG)
  spmd = sharding_lib.DATA_AXIS if mesh.shape[sharding_lib.DATA_AXIS] > 1 else None
  if method == "nondp":
    aggregator = aggregator_lib.MeanAggregator(loss_fn)
  else:
    aggregator = ghost.GhostDPAggregator(loss_fn, NoisySum(1.0, sigma, BATCH), spmd_axis_name=spmd)
  return Trainer(CONFIG, aggregator, optimizers.adafactor(learning_rate=1e-3), mesh,
                 rules=sharding_lib.axis_rules(sharding))


def _memory(trainer, lengths=SHORT):
  return trainer.compile_train_step(trainer.abstract_state(), _batch(*lengths), *KEYS).memory_analysis()


def _peak(trainer, lengths=SHORT) -> int:
  return _peak_of(_memory(trainer, lengths))


def _peak_of(m) -> int:
  """Arguments + outputs + temporaries - donated aliases, per device."""
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def _flat_gaussian_like(key, leaves):
  """The control: one flat draw of every coordinate, cut into the leaves (not shardable)."""
  sizes = [int(leaf.size) for leaf in leaves]
  flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
  starts = np.cumsum([0] + sizes)
  return [flat[a:b].reshape(leaf.shape) for a, b, leaf in zip(starts, starts[1:], leaves)]


def test_noise_is_drawn_sharded_like_the_parameters(monkeypatch):
  param_bytes = 4 * network.num_params(CONFIG)
  without_noise = _peak(_trainer("ghost", (1, 8), sigma=0.0))
  added = _peak(_trainer("ghost", (1, 8))) - without_noise
  assert 0 < added < param_bytes / 4, (added, param_bytes)  # about its 1/8 shard
  # The measurement can tell: a noise draw materialised whole on each device costs a copy.
  # An accelerator's draw (each shape's rows in one batched draw behind an optimization barrier,
  # `noise.normal_rows(loop=False)`), compiled here: sharded too.
  rows = noise_lib.normal_rows
  monkeypatch.setattr(noise_lib, "normal_rows", lambda key, count, shape, loop: rows(key, count, shape, loop=False))
  batched = _peak(_trainer("ghost", (1, 8))) - without_noise
  assert 0 < batched < param_bytes / 4, (batched, param_bytes)
  monkeypatch.setattr(noise_lib, "gaussian_like", _flat_gaussian_like)
  whole = _peak(_trainer("ghost", (1, 8))) - without_noise
  assert whole > 3 * param_bytes / 4, (whole, param_bytes)


def test_dp_ghost_peak_is_close_to_nondp_on_a_model_parallel_mesh():
  # 1.06x; 1.17x when XLA formed the norms' Gram matrices `a a^T` in the forward pass and
  # kept them through the backward pass (`dp.schedule.after`, `ghost_norms.gram_sq_norms`).
  nondp = _peak(_trainer("nondp", (1, 8)), PAPER_LIKE)
  dp_ghost = _peak(_trainer("ghost", (1, 8)), PAPER_LIKE)
  assert dp_ghost < 1.08 * nondp, (dp_ghost, nondp)


def test_fully_sharded_state_is_an_eighth_per_device_on_a_data_parallel_mesh():
  replicated = _trainer("nondp", (8, 1), sharding_lib.REPLICATED)
  sharded = _trainer("nondp", (8, 1), sharding_lib.FULLY_SHARDED)
  state_bytes = lambda t: sharding_lib.bytes_per_device(t.abstract_state())
  assert state_bytes(sharded) <= 0.15 * state_bytes(replicated), (state_bytes(sharded), state_bytes(replicated))
  # What XLA compiled agrees: the step's arguments (state and batch) and its peak shrink.
  m_replicated, m_sharded = _memory(replicated), _memory(sharded)
  assert m_sharded.argument_size_in_bytes <= 0.2 * m_replicated.argument_size_in_bytes
  assert _peak_of(m_sharded) < 0.6 * _peak_of(m_replicated)
