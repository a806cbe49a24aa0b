"""The noise transform's state in the train state: made once with the state, threaded through every
step (fused, microbatched, LoRA), float32, sharded like the parameters, in every checkpoint and
restored so that an interrupted run resumes bit for bit; a stateless (Gaussian) run's checkpoints
hold the same entries as before the state existed. (Two processes carry a banded run's noise state like
one: tests/test_multihost.py.)

The stateful transform is a stand-in for correlated noise (matrix factorization): the noise of
step t is `std · z_t + DECAY · (noise of step t-1)`, z_t drawn from the step's key, and its state
is that noise per parameter plus a step counter.
"""
import dataclasses
import json
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from private_t5.models import network
from private_t5.dp import noise as noise_lib
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.aggregator import DPAggregator
from private_t5.models import checkpoints
from private_t5.models import lora as lora_lib
from private_t5.stages import train as train_stage
from private_t5.train import host_microbatches, optimizers, partitioning
from private_t5.models import sharding as sharding_lib
from private_t5.train.state import RunSeeds
from private_t5.train.trainer import Trainer, make_loss_fn

from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab, saved_state as _saved_state
from test_partitioning import CONFIG, _batch

STD, DECAY = 0.05, 0.5
# No JAX call at import: the cluster's processes import this module before JAX is initialised.
SEEDS = RunSeeds.create(insecure_deterministic_seed=5)


def _keys():
  return SEEDS.dropout_base_key, SEEDS.noise_base_key


def history_noise(std: float = STD, dtype=jnp.float32) -> optax.GradientTransformationExtraArgs:
  """Noise `std · z_t + DECAY · previous` (z_t from the step's key); state {"steps", "previous"},
  "previous" kept in `dtype` (bfloat16: a transform that keeps its state in a low precision)."""

  def init(params):
    return {"steps": jnp.zeros((), jnp.int32),
            "previous": jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)}

  def update(updates, state, params=None, *, noise_rng=None, noise_scale=None, **extra):
    del extra
    leaves, treedef = jax.tree.flatten(updates)
    scale = 1.0 if noise_scale is None else noise_scale
    fresh = noise_lib.gaussian_like(noise_rng, leaves)
    noise = [scale * std * z + DECAY * prev.astype(jnp.float32)
             for z, prev in zip(fresh, treedef.flatten_up_to(state["previous"]))]
    noisy = [g.astype(jnp.float32) + n for g, n in zip(leaves, noise)]
    if params is not None:
      noisy = [x.astype(p.dtype) for x, p in zip(noisy, treedef.flatten_up_to(params))]
    return (jax.tree.unflatten(treedef, noisy),
            {"steps": state["steps"] + 1, "previous": jax.tree.unflatten(treedef, [n.astype(dtype) for n in noise])})

  return optax.GradientTransformationExtraArgs(init, update)


def _expected_noise(params, steps: int):
  """The stand-in's noise after `steps` steps, from the run's noise keys fold_in(base, t)."""
  leaves, treedef = jax.tree.flatten(params)
  noise = [np.zeros(x.shape, np.float32) for x in leaves]
  for t in range(steps):
    fresh = noise_lib.gaussian_like(jax.random.fold_in(SEEDS.noise_base_key, t), leaves)
    noise = [STD * np.asarray(z) + DECAY * n for z, n in zip(fresh, noise)]
  return jax.tree.unflatten(treedef, noise)


def _trainer(mesh=None, noise=None, config=CONFIG, sharding="replicated", **kwargs) -> Trainer:
  mesh = sharding_lib.create_mesh((1, 1), jax.devices()[:1]) if mesh is None else mesh
  loss_fn = make_loss_fn(config, lora=kwargs.get("lora"))
  aggregator = DPAggregator(loss_fn, NoisySum(0.1, 1.0, 6.0),
                            spmd_axis_name="data" if mesh.shape["data"] > 1 else None)
  return Trainer(config, aggregator, optimizers.adafactor(optimizers.constant_schedule(0.01)), mesh,
                 rules=sharding_lib.axis_rules(sharding), noise=noise, **kwargs)


def _tree_entries(model_dir: str, step: int):
  """The entries (key paths) of a checkpoint's state, as its tree metadata names them."""
  with open(os.path.join(model_dir, "checkpoints", str(step), "state", "_METADATA")) as f:
    return set(json.load(f)["tree_metadata"])


def _assert_bitwise_equal(a, b):
  a, b = jax.device_get(a), jax.device_get(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(x, y)


def test_state_is_made_once_threaded_through_every_step_and_checkpointed(tmp_path):
  trainer = _trainer(noise=history_noise())
  state = trainer.init_state(SEEDS.init_key)
  previous = state.noise_state["previous"]
  assert jax.tree.structure(previous) == jax.tree.structure(state.params)
  assert all(x.dtype == jnp.float32 and not np.any(np.asarray(x)) for x in jax.tree.leaves(previous))
  # A fused step, then a step in two microbatches: each continues the state with its own key.
  state, _ = trainer.train_step(state, _batch(seed=0), *_keys())
  state, _ = host_microbatches.train_step_microbatched(trainer, state, _batch(seed=1), 4, *_keys())
  assert int(state.noise_state["steps"]) == 2
  expected = _expected_noise(state.params, 2)
  for got, want in zip(jax.tree.leaves(state.noise_state["previous"]), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  sizes = trainer.state_bytes_per_device()
  assert sizes["noise_state"] == sizes["params"] + 4  # its counter: an int32
  assert sizes["total"] == sum(sizes[k] for k in ("params", "opt_state", "noise_state")) + 4  # and the step

  manager = checkpoints.CheckpointManager(str(tmp_path), async_save=False)
  manager.save(2, state, {})
  restored, _ = manager.restore(trainer.abstract_state())
  manager.close()
  entries = _tree_entries(str(tmp_path), 2)
  assert "('noise_state', 'steps')" in entries
  assert "('noise_state', 'previous', 'token_embedder', 'embedding')" in entries
  _assert_bitwise_equal(restored, state)
  # The restored state continues exactly as the one in memory.
  after_saved, _ = trainer.train_step(restored, _batch(seed=2), *_keys())
  after_memory, _ = trainer.train_step(state, _batch(seed=2), *_keys())
  _assert_bitwise_equal(after_saved, after_memory)


@flax.struct.dataclass
class _StateBeforeTheNoiseState:
  """The train state as checkpoints held it before the noise transform's state existed."""
  step: jax.Array
  params: object
  opt_state: object


def test_a_gaussian_run_checkpoints_the_same_entries_as_before(tmp_path):
  trainer = _trainer()  # the Gaussian noise of its DPAggregator: stateless
  state = trainer.init_state(SEEDS.init_key)
  assert state.noise_state == optax.EmptyState() and not state.holds_noise_state
  assert trainer.state_bytes_per_device()["noise_state"] == 0
  state, _ = trainer.train_step(state, _batch(), *_keys())
  new_dir, old_dir = str(tmp_path / "new"), str(tmp_path / "old")
  for model_dir, saved in ((new_dir, state),
                           (old_dir, _StateBeforeTheNoiseState(state.step, state.params, state.opt_state))):
    manager = checkpoints.CheckpointManager(model_dir, async_save=False)
    manager.save(1, saved, {})
    manager.close()
  assert _tree_entries(new_dir, 1) == _tree_entries(old_dir, 1)
  assert not [e for e in _tree_entries(new_dir, 1) if "noise_state" in e]
  # A checkpoint of the former layout restores, and trains on.
  manager = checkpoints.CheckpointManager(old_dir, async_save=False)
  restored, _ = manager.restore(trainer.abstract_state())
  manager.close()
  assert restored.noise_state == optax.EmptyState()
  _assert_bitwise_equal(restored.params, state.params)
  assert int(trainer.train_step(restored, _batch(seed=1), *_keys())[0].step) == 2


def test_fully_sharded_noise_state_follows_each_parameter():
  mesh = sharding_lib.create_mesh((4, 2))
  trainer = _trainer(mesh, history_noise(), sharding="fully_sharded")
  state = trainer.init_state(SEEDS.init_key)
  state, _ = trainer.train_step(state, _batch(), *_keys())
  previous, params = state.noise_state["previous"], state.params
  assert tuple(params["token_embedder"]["embedding"].sharding.spec) == ("model", "data")
  for noise, param, sharding in zip(jax.tree.leaves(previous), jax.tree.leaves(params),
                                    jax.tree.leaves(trainer.state_shardings.params)):
    assert noise.shape == param.shape and noise.dtype == jnp.float32
    assert noise.sharding.is_equivalent_to(sharding, noise.ndim), (noise.sharding, sharding)
  assert state.noise_state["steps"].sharding.is_fully_replicated
  # The noise state of one device is its share of the parameters' (here 1/8 of most of them).
  sizes = trainer.state_bytes_per_device()
  assert sizes["noise_state"] == sizes["params"] + 4
  assert sizes["noise_state"] < 0.2 * sharding_lib.bytes_per_device(
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_lib.replicated(mesh)),
                   previous))


def test_noise_state_shardings_of_stacked_and_flat_states():
  """Banded matrix factorization's buffers (jax-privacy: a counter and b stacked noises per
  parameter) follow the parameter on their trailing dimensions; a flat list of per-parameter
  arrays follows the parameters of its shape when they agree; counters are replicated."""
  from jax_privacy.matrix_factorization import banded  # pylint: disable=g-import-not-at-top
  mesh = sharding_lib.create_mesh((4, 2))
  params = {"ff": jax.ShapeDtypeStruct((8, 16), jnp.float32), "norm": jax.ShapeDtypeStruct((8,), jnp.float32),
            "out": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
  axes = {"ff": ("embed", "mlp"), "norm": ("embed",), "out": ("mlp", "embed")}
  param_shardings = sharding_lib.param_shardings(axes, params, mesh, sharding_lib.FULLY_SHARDED_RULES)
  strategy = banded.ColumnNormalizedBanded.default(10, 3).inverse_as_streaming_matrix()
  stacked = jax.eval_shape(strategy.init_multiply, params)
  shardings = partitioning.noise_state_shardings(stacked, params, param_shardings, mesh)
  counter, buffers = shardings["ff"]
  assert stacked["ff"][1].shape == (3, 8, 16)
  assert tuple(buffers.spec) == (None, "data", "model") and tuple(counter.spec) == ()
  assert tuple(shardings["out"][1].spec) == (None, "model", "data")
  flat = [jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32),
          jax.ShapeDtypeStruct((3,), jnp.float32)]
  flat_shardings = partitioning.noise_state_shardings(flat, params, param_shardings, mesh)
  assert [tuple(s.spec) for s in flat_shardings[:2]] == [("data", "model"), ("data",)]
  assert flat_shardings[2].is_fully_replicated  # no parameter of its shape


def test_noise_state_stays_float32_with_bfloat16_activations():
  config = dataclasses.replace(CONFIG, dtype="bfloat16")
  trainer = _trainer(noise=history_noise(dtype=jnp.bfloat16), config=config)
  state = trainer.init_state(SEEDS.init_key)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.noise_state["previous"]))
  assert state.noise_state["steps"].dtype == jnp.int32
  for _ in range(2):
    state, _ = trainer.train_step(state, _batch(), *_keys())
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.noise_state["previous"]))
  assert state.noise_state["steps"].dtype == jnp.int32 and int(state.noise_state["steps"]) == 2
  assert float(optax.tree.norm(state.noise_state["previous"])) > 0


def test_lora_noise_state_covers_the_adapters_only():
  lora = lora_lib.LoraConfig(rank=2, targets=("query", "wo"))
  base = network.init_params(CONFIG, jax.random.PRNGKey(1))
  trainer = _trainer(noise=history_noise(), lora=lora, base_params=base)
  state = trainer.init_state(SEEDS.init_key)
  state, _ = host_microbatches.train_step_microbatched(trainer, state, _batch(), 4, *_keys())
  previous = state.noise_state["previous"]
  assert jax.tree.structure(previous) == jax.tree.structure(state.params)
  assert sum(x.size for x in jax.tree.leaves(previous)) == trainer.num_trainable_params()
  assert trainer.num_trainable_params() < sum(x.size for x in jax.tree.leaves(base)) / 10
  for got, want in zip(jax.tree.leaves(previous), jax.tree.leaves(_expected_noise(state.params, 1))):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# -- the training stage: interrupted and resumed == uninterrupted (slow: real runs) ---------------

@pytest.fixture(scope="module")
def corpus_and_vocab(shared_data, tmp_path_factory):
  return fortunes_corpus_and_vocab(shared_data, str(tmp_path_factory.mktemp("vocab")))


class _Interrupted(Exception):
  pass


@pytest.mark.slow
def test_interrupted_run_resumes_bit_for_bit(corpus_and_vocab, tmp_path, monkeypatch):
  """A banded-noise run (b = 2, from Gin) stopped in step 4 (its last checkpoint: step 2) and
  started again ends with the parameters, optimizer state and noise state of the run that was not
  stopped, bit for bit (ghost clipping, cyclic Poisson samples in microbatches)."""
  corpus, vocab = corpus_and_vocab

  def args(model_dir):
    return ["--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}", f"--gin.CORPUS={corpus}",
            f"--gin.VOCAB_PATH={vocab}", "--gin.TRAIN_STEPS=5", f"--gin.DATA_CACHE_DIR={os.path.dirname(vocab)}/cache",
            *MICRO_TRAIN_ARGS, "--gin.DPConfig.expected_batch_size=4", "--gin.train.microbatch_size=4",
            "--gin.DPConfig.noise='banded'", "--gin.DPConfig.num_bands=2", "--gin.train.checkpoint_every=2", "--gin.train.eval_examples=0", "--gin.train.log_every=5"]

  reference, stopped = str(tmp_path / "reference"), str(tmp_path / "stopped")
  train_stage.run_from_args(args(reference))
  real_step = Trainer.train_step_stacked

  def stop_in_step_4(self, state, *rest):
    if int(state.step) == 3:
      raise _Interrupted()
    return real_step(self, state, *rest)

  monkeypatch.setattr(Trainer, "train_step_stacked", stop_in_step_4)
  with pytest.raises(_Interrupted):
    train_stage.run_from_args(args(stopped))
  monkeypatch.setattr(Trainer, "train_step_stacked", real_step)
  manager = checkpoints.CheckpointManager(stopped)
  assert manager.all_steps() == [2]
  manager.close()
  summary = train_stage.run_from_args(args(stopped))
  assert summary["resumed_from_step"] == 2 and summary["final_step"] == 5

  for step in (4, 5):
    want, got = _saved_state(reference, step), _saved_state(stopped, step)
    assert want.keys() == got.keys()
    for path in want:
      np.testing.assert_array_equal(got[path], want[path], err_msg=jax.tree_util.keystr(path))
  saved = _saved_state(reference, 5)
  buffers = [k for k in saved if jax.tree_util.keystr(k).startswith("['noise_state']['buffers']")]
  noise = [saved[k] for k in buffers]
  assert len(noise) == len([k for k in saved if jax.tree_util.keystr(k).startswith("['params']")])  # b - 1 = 1
  assert all(v.dtype == np.float32 for v in noise) and any(np.any(v) for v in noise)
  assert int(saved[next(k for k in saved if jax.tree_util.keystr(k) == "['noise_state']['count']")]) == 5
  # The noise state moved between the two checkpoints (it is carried, not re-made).
  before = _saved_state(reference, 4)
  assert any(not np.array_equal(before[k], saved[k]) for k in buffers)
