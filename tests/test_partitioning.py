"""Meshes and logical-axis sharding: the sharded train step equals the single-device one."""
import os

import jax
import numpy as np
import pytest

from private_t5.models import config
from private_t5.models import network
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.aggregator import DPAggregator, MeanAggregator
from private_t5.dp.ghost import GhostDPAggregator
from private_t5.errors import ConfigError
from private_t5.models import checkpoints
from private_t5.train import optimizers
from private_t5.models import sharding as sharding_lib
from private_t5.train.main import build_mesh
from private_t5.train.state import RunSeeds
from private_t5.train.trainer import Trainer, make_loss_fn

# Small enough to compile quickly, with every dimension divisible by the model axis (2).
CONFIG = config.T5Config(vocab_size=256, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                         num_decoder_layers=1, dropout_rate=0.0)


def _batch(batch_size=8, inputs=12, targets=6, padding_rows=2, seed=0):
  rng = np.random.default_rng(seed)
  tgt = rng.integers(3, CONFIG.vocab_size, (batch_size, targets)).astype(np.int32)
  dec = np.zeros_like(tgt)
  dec[:, 1:] = tgt[:, :-1]
  weight = np.ones(batch_size, np.float32)
  weight[batch_size - padding_rows:] = 0.0
  return {"encoder_input_tokens": rng.integers(3, CONFIG.vocab_size, (batch_size, inputs)).astype(np.int32),
          "decoder_input_tokens": dec, "decoder_target_tokens": tgt,
          "decoder_loss_weights": np.ones((batch_size, targets), np.float32),
          "example_weight": weight, "is_padding": weight == 0,
          "example_index": np.where(weight > 0, np.arange(batch_size), -1)}


def test_create_mesh_shapes():
  assert len(jax.devices()) == 8, "conftest should provide 8 fake CPU devices"
  mesh = sharding_lib.create_mesh((-1, 2))
  assert dict(mesh.shape) == {"data": 4, "model": 2}
  assert dict(sharding_lib.create_mesh((-1, 1)).shape) == {"data": 8, "model": 1}
  with pytest.raises(ConfigError, match="mesh_shape"):
    sharding_lib.create_mesh((3, -1))
  with pytest.raises(ConfigError, match="needs 16 devices"):
    sharding_lib.create_mesh((8, 2))
  for bad in ("(1, 1)", 1, (1.5, 1), (1, True), (1, 1, 1)):  # a string, an int, a fraction, a flag, three axes
    with pytest.raises(ConfigError, match=r"mesh_shape must be \(data, model\), two integers"):
      sharding_lib.create_mesh(bad)
  with pytest.raises(ConfigError, match="multiple of the mesh's data axis"):
    sharding_lib.check_batch_divisible(6, mesh)
  # Each global microbatch is split over the data axis (of every process) too.
  assert dict(build_mesh((4, 2), 16, 8).shape) == {"data": 4, "model": 2}
  logs = []
  build_mesh((4, 2), 16, log=logs.append)
  build_mesh((2, 1), 16, log=logs.append)  # 2 of the 8 devices
  assert logs == ["[train] WARNING: mesh_shape (2, 1) uses 2 of the 8 devices; the others stay idle "
                  "(mesh_shape=(-1, 1) uses them all)"]
  with pytest.raises(ConfigError, match="microbatch_size=6 must be a multiple of the mesh's data axis"):
    build_mesh((4, 2), 16, 6)


def test_logical_rules_shard_large_dims_on_model_axis():
  mesh = sharding_lib.create_mesh((4, 2))
  shardings = sharding_lib.param_shardings(network.param_logical_axes(CONFIG), network.param_shapes(CONFIG), mesh)

  def spec(*path):
    return tuple(_get(shardings, path).spec)

  assert spec("token_embedder", "embedding") == ("model", None)  # [vocab, embed]
  assert spec("encoder", "layers_0", "mlp", "wi", "kernel") == (None, "model")  # [embed, mlp]
  assert spec("encoder", "layers_0", "attention", "out", "kernel") == ("model", None)  # [joined_kv, embed]
  assert spec("encoder", "encoder_norm", "scale") == (None,)  # [embed] replicated
  assert sharding_lib.logical_to_spec(("batch", "length")) == jax.sharding.PartitionSpec("data", None)
  # A dimension the axis does not divide is replicated instead of failing.
  odd = sharding_lib.param_shardings({"w": ("vocab", "embed")}, {"w": jax.ShapeDtypeStruct((5, 4), np.float32)}, mesh)
  assert tuple(odd["w"].spec) == (None, None)


def test_fully_sharded_rules_split_embed_over_data_and_the_moments_follow():
  mesh = sharding_lib.create_mesh((4, 2))
  tiny = config.load_preset("t5_1_1_tiny")  # dimensions >= 128: Adafactor factors its moments
  trainer = Trainer(tiny, MeanAggregator(make_loss_fn(tiny)), optimizers.adafactor(0.01), mesh,
                    rules=sharding_lib.axis_rules("fully_sharded"))
  params = trainer.state_shardings.params
  assert tuple(params["token_embedder"]["embedding"].spec) == ("model", "data")  # [vocab, embed]
  assert tuple(params["encoder"]["layers_0"]["mlp"]["wo"]["kernel"].spec) == ("model", "data")  # [mlp, embed]
  assert tuple(params["encoder"]["encoder_norm"]["scale"].spec) == ("data",)
  moments = trainer.state_shardings.opt_state[0]  # Adafactor's FactoredState
  embedding = trainer.abstract_state().opt_state[0]
  # [vocab, embed] is factored: a moment [embed] (mean over vocab) and a moment [vocab].
  assert embedding.v_row["token_embedder"]["embedding"].shape == (tiny.d_model,)
  assert tuple(moments.v_row["token_embedder"]["embedding"].spec) == ("data",)
  assert embedding.v_col["token_embedder"]["embedding"].shape == (tiny.vocab_size,)
  assert tuple(moments.v_col["token_embedder"]["embedding"].spec) == ("model",)
  assert tuple(moments.v["encoder"]["encoder_norm"]["scale"].spec) == ("data",)  # unfactored: like the scale
  assert tuple(moments.count.spec) == ()
  with pytest.raises(ConfigError, match="parameter_sharding must be one of"):
    sharding_lib.axis_rules("zero3")


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _two_steps(mesh, aggregator):
  trainer = Trainer(CONFIG, aggregator, optimizers.adafactor(optimizers.constant_schedule(0.01)), mesh)
  seeds = RunSeeds.create(insecure_deterministic_seed=7)
  state = trainer.init_state(seeds.init_key)
  metrics = None
  for step in range(2):
    state, metrics = trainer.train_step(state, _batch(seed=step), seeds.dropout_base_key, seeds.noise_base_key)
  return jax.device_get(state.params), {k: float(v) for k, v in jax.device_get(metrics).items()}


@pytest.mark.parametrize("private", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["mean", "dp_noise_off"])
def test_sharded_step_equals_single_device_step(private):
  loss_fn = make_loss_fn(CONFIG)
  def aggregator(spmd_axis_name):
    if private:  # noise off: the comparison is exact up to float reassociation
      return DPAggregator(loss_fn, NoisySum(0.1, 0.0, 6.0), spmd_axis_name=spmd_axis_name)
    return MeanAggregator(loss_fn)
  single = sharding_lib.create_mesh((1, 1), jax.devices()[:1])
  sharded = sharding_lib.create_mesh((4, 2))
  params_1, metrics_1 = _two_steps(single, aggregator(None))
  params_8, metrics_8 = _two_steps(sharded, aggregator("data"))
  for a, b in zip(jax.tree.leaves(params_1), jax.tree.leaves(params_8)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  for k in metrics_1:
    assert metrics_1[k] == pytest.approx(metrics_8[k], rel=1e-5, abs=1e-5), k
  if private:
    assert metrics_1["nondp/fraction_clipped"] > 0  # the clip is active in this comparison


def _resume_steps(aggregator, tmp_path, first, second, steps=3, split=2):
  """Trains `split` steps on mesh and sharding `first`, saves, restores on `second` and trains
  to `steps`; returns its parameters and those of `steps` uninterrupted steps on `first`."""
  optimizer = optimizers.adafactor(optimizers.constant_schedule(0.01))
  seeds = RunSeeds.create(insecure_deterministic_seed=11)
  keys = (seeds.dropout_base_key, seeds.noise_base_key)

  def trainer(mesh_shape, sharding):
    return Trainer(CONFIG, aggregator, optimizer, sharding_lib.create_mesh(mesh_shape),
                   rules=sharding_lib.axis_rules(sharding))

  def run(t, state, start, stop):
    for step in range(start, stop):
      state, _ = t.train_step(state, _batch(seed=step), *keys)
    return state

  before = trainer(*first)
  reference = jax.device_get(run(before, before.init_state(seeds.init_key), 0, steps).params)
  manager = checkpoints.CheckpointManager(str(tmp_path), async_save=False)
  manager.save(split, run(before, before.init_state(seeds.init_key), 0, split), {})
  after = trainer(*second)
  state, _ = manager.restore(after.abstract_state())
  manager.close()
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(after.state_shardings)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  return reference, jax.device_get(run(after, state, split, steps).params)


@pytest.mark.parametrize("first,second", [
    (((4, 2), "replicated"), ((8, 1), "fully_sharded")),
    pytest.param(((8, 1), "fully_sharded"), ((2, 4), "replicated"), marks=pytest.mark.slow),
], ids=["replicated_4x2_to_fully_sharded_8x1", "fully_sharded_8x1_to_replicated_2x4"])
def test_resume_on_another_mesh_and_parameter_sharding(tmp_path, first, second):
  """A checkpoint written on one mesh and sharding resumes on another: the run continues as
  if uninterrupted (DP-ghost with noise on: the noise does not depend on the mesh either)."""
  aggregator = GhostDPAggregator(make_loss_fn(CONFIG), NoisySum(0.1, 1.0, 6.0), spmd_axis_name="data")
  reference, resumed = _resume_steps(aggregator, tmp_path, first, second)
  for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(resumed)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_init_from_given_params_is_sharded_by_the_rules():
  mesh = sharding_lib.create_mesh((4, 2))
  trainer = Trainer(CONFIG, MeanAggregator(make_loss_fn(CONFIG)), optimizers.adafactor(0.01), mesh)
  given = jax.tree.map(np.asarray, network.init_params(CONFIG, jax.random.PRNGKey(3)))
  state = trainer.init_state(jax.random.PRNGKey(0), initial_params=given)
  assert int(state.step) == 0
  for a, b in zip(jax.tree.leaves(given), jax.tree.leaves(jax.device_get(state.params))):
    np.testing.assert_array_equal(a, b)
  embedding = state.params["token_embedder"]["embedding"]
  assert tuple(embedding.sharding.spec) == ("model", None)


def test_tensorflow_is_kept_off_the_accelerators(tmp_path):
  """In a fresh process: TensorFlow's GPU list is emptied before its first op, its CPU still
  runs ops, and a second call once TensorFlow has started is a harmless no-op."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = (
      "import tensorflow as tf\n"
      "calls = []\n"
      "real = tf.config.set_visible_devices\n"
      "tf.config.set_visible_devices = lambda devices, kind=None: (calls.append((list(devices), kind)), real(devices, kind))\n"
      "from private_t5.train import partitioning\n"
      "partitioning.hide_accelerators_from_tensorflow()\n"
      "assert calls == [([], 'GPU')], calls\n"
      "assert tf.config.get_visible_devices('GPU') == []\n"
      "assert int(tf.constant(2) + 3) == 5 and tf.config.get_visible_devices('CPU')\n"
      "partitioning.hide_accelerators_from_tensorflow()\n"
      "print('ok')\n")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_HOME=str(tmp_path / "keras"))
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
