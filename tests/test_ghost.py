"""Ghost clipping on full tiny T5 models against the vmap DP aggregator (float32)."""
import functools

import flax.linen as nn

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from private_t5.dp.config import BOOKKEEPING, LAYERWISE, SECOND_PASS
from private_t5.models import config as config_lib
from private_t5.models import network
from private_t5.models import model as model_lib
from private_t5.dp import clipping, ghost, mechanism
from private_t5.dp import config as dp_config
from private_t5.dp import noise as noise_lib
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.aggregator import DPAggregator
from private_t5.errors import ConfigError
from private_t5.models import layers
from private_t5.train.host_microbatches import split_microbatches

NORM_RTOL = 1e-4
CLIP = 0.5  # well below the tiny models' gradient norms: every real example is clipped


def _batch(config, batch_size=4, input_len=12, target_len=6, seed=0):
  """Random tokens with a padding row, encoder padding and masked target tokens."""
  rng = np.random.default_rng(seed)
  top = min(config.vocab_size, 60)
  enc = rng.integers(2, top, size=(batch_size, input_len)).astype(np.int32)
  enc[:, input_len - 3:] = 0  # encoder padding positions
  enc[0, 1] = enc[0, 2] = enc[0, 5]  # repeated tokens in one example
  targets = rng.integers(2, top, size=(batch_size, target_len)).astype(np.int32)
  targets[1, 2] = enc[1, 0]  # a target token that also appears in the input (tied cross term)
  dec = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
  weights = np.ones((batch_size, target_len), np.float32)
  weights[1, target_len // 2:] = 0.0  # masked target tokens
  example_weight = np.ones((batch_size,), np.float32)
  example_weight[-1] = 0.0  # a padding example
  weights[-1] = 0.0
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=targets,
              decoder_loss_weights=weights, example_weight=example_weight,
              is_padding=example_weight == 0,
              example_index=np.where(example_weight > 0, np.arange(batch_size), -1))


def _setup(preset, **overrides):
  config = config_lib.load_preset(preset, **overrides)
  params = network.init_params(config, jax.random.PRNGKey(1))
  loss_fn = functools.partial(model_lib.example_loss_fn, config=config)
  return config, params, lambda p, b, k: loss_fn(p, b, dropout_rng=k)


def _model_batch(batch):
  return {k: v for k, v in batch.items() if k not in ("is_padding", "example_index")}


def _max_rel_err(a, b):
  errs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)),
                      a, b)
  return max(jax.tree.leaves(errs))


def _vmap_reference(loss_fn, clip, batch, dropout_rng):
  """Per-example norms and the clipped sum from explicitly instantiated per-example grads."""
  agg = DPAggregator(loss_fn, NoisySum(clip, 0.0, 1.0))
  rows = jnp.arange(batch["example_weight"].shape[0], dtype=jnp.int32)

  @jax.jit
  def run(params, b):
    _, grads = agg.per_example_grads(params, b, rows, dropout_rng)
    norms = jax.vmap(optax.tree.norm)(grads)
    scale = jnp.minimum(1.0, clip / jnp.maximum(norms, 1e-30)) * b["example_weight"]
    return norms, jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grads)
  return run


@pytest.mark.slow
@pytest.mark.parametrize("preset, overrides", [
    ("t5_1_0_tiny", {}), ("t5_1_1_tiny", {}), ("t5_1_1_tiny", {"attention": "xla", "dropout_rate": 0.0})],
    ids=["t5_1_0_tiny", "t5_1_1_tiny", "t5_1_1_tiny_dot_product_attention"])
def test_full_tiny_model_norms_and_clipped_sums_equal_vmap(preset, overrides):
  """Tied (v1.0) and untied (v1.1) tiny T5 with dropout, padding rows and masked targets; and
  with the attention as one `jax.nn.dot_product_attention` call (no dropout there)."""
  config, params, loss_fn = _setup(preset, **{"dropout_rate": 0.1, **overrides})
  batch = _model_batch(_batch(config))
  dropout_rng = jax.random.PRNGKey(7)  # the same per-example dropout keys in both paths
  want_norms, want_sum = _vmap_reference(loss_fn, CLIP, batch, dropout_rng)(params, batch)
  agg = ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.0, 4.0))
  rows = jnp.arange(4, dtype=jnp.int32)
  got_sum, _, got_norms, factors = jax.jit(
      lambda p, b: agg.ghost_clipped_sum(p, b, jax.vmap(
          lambda r: jax.random.fold_in(dropout_rng, r))(rows)))(params, batch)
  want_norms, got_norms = np.asarray(want_norms), np.asarray(got_norms)
  assert want_norms[-1] == 0.0 and got_norms[-1] == 0.0  # the padding example
  assert np.all(want_norms[:-1] > CLIP) and np.all(np.asarray(factors)[:-1] < 1)  # all clipped
  np.testing.assert_allclose(got_norms, want_norms, rtol=NORM_RTOL)
  assert jax.tree.structure(got_sum) == jax.tree.structure(want_sum)
  assert _max_rel_err(got_sum, want_sum) <= 1e-4


def _micro_setup(**overrides):
  """A one-layer tied T5 v1.0 small enough to compile in seconds."""
  return _setup("t5_1_0_tiny", **{**dict(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                                         num_decoder_layers=1, vocab_size=64, dropout_rate=0.0),
                                  **overrides})


def _clipped_sum_in_microbatches(agg, params, batch, microbatch_size, dropout_rng=None):
  """(clipped sum, metrics) of `batch` run as microbatches through `zero_sum` / `accumulate`,
  as the trainer's accumulate loop runs them."""
  accumulate = jax.jit(agg.accumulate)
  acc = agg.zero_sum(params)
  for micro in split_microbatches({k: np.asarray(v) for k, v in batch.items()}, microbatch_size):
    acc = accumulate(params, acc, micro, dropout_rng)
  grad_sum, sums = acc
  return grad_sum, clipping.metrics_from_sums(**sums)


@pytest.mark.slow
def test_second_pass_microbatches_and_instantiation_agree_with_vmap_aggregator():
  config, params, loss_fn = _micro_setup(dropout_rate=0.1)
  batch = _model_batch(_batch(config, seed=3))
  dropout_rng = jax.random.PRNGKey(11)
  step = lambda agg: jax.jit(functools.partial(agg, dropout_rng=dropout_rng))(params, batch)
  want, want_metrics = step(DPAggregator(loss_fn, NoisySum(CLIP, 0.0, 3.0)))
  assert float(want_metrics["nondp/fraction_clipped"]) == 1.0  # clipping really happened
  second_pass = ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.0, 3.0), clipped_sum_method=SECOND_PASS)
  grad_sum, micro_metrics = _clipped_sum_in_microbatches(second_pass, params, batch, 2, dropout_rng)
  micro = second_pass.finalize(params, grad_sum), micro_metrics
  # Book-keeping that sums the instantiated per-example kernel gradients.
  instantiated = step(ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.0, 3.0), norm_method="instantiate",
                                              reuse_instantiated=True))
  # The layers of one shape stacked (one batched norm and sum a shape), both norm methods.
  stacked = step(ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.0, 3.0), stack_layers=True))
  stacked_instantiated = step(ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.0, 3.0), norm_method="instantiate",
                                                      stack_layers=True))
  for variant, (got, got_metrics) in (("second pass in microbatches of 2", micro),
                                      ("instantiated book-keeping", instantiated),
                                      ("stacked layers", stacked),
                                      ("stacked layers, instantiated", stacked_instantiated)):
    assert _max_rel_err(got, want) <= 1e-4, variant
    for name, value in want_metrics.items():
      np.testing.assert_allclose(got_metrics[name], value, rtol=1e-4, err_msg=f"{name} {variant}")


@pytest.mark.slow
def test_sharded_equals_unsharded():
  devices = np.array(jax.devices()[:8])
  if devices.size < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
  config, params, loss_fn = _micro_setup()
  batch = _model_batch(_batch(config, batch_size=8, seed=5))
  mesh = Mesh(devices, ("data",))
  sharded_batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
  replicated_params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
  noise_rng = jax.random.PRNGKey(3)
  unsharded = ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 1.0, 8.0))
  sharded = ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 1.0, 8.0), spmd_axis_name="data")
  release = lambda agg: jax.jit(lambda p, b: noise_lib.privatize(agg, p, b, noise_rng=noise_rng))
  want, _ = release(unsharded)(params, batch)
  with mesh:
    got, _ = release(sharded)(replicated_params, sharded_batch)
  assert _max_rel_err(got, want) <= 1e-5


def test_uncovered_parameter_is_refused():
  config = config_lib.load_preset("t5_1_0_tiny", d_model=16, num_heads=2, d_ff=32, vocab_size=64,
                              num_encoder_layers=1, num_decoder_layers=1)
  params = network.param_shapes(config)
  loss_fn = lambda p, b, k: model_lib.example_loss_fn(p["model"], b, config, k) * p["temperature"]
  extended = {"model": params, "temperature": jax.ShapeDtypeStruct((), jnp.float32)}
  example = jax.tree.map(lambda x: x[0], _model_batch(_batch(config, seed=2)))
  recording = ghost.record_layer_uses(loss_fn, extended, example, None)
  with pytest.raises(ConfigError, match="temperature"):
    ghost.check_coverage(extended, recording)


def _tiny_config():
  return config_lib.load_preset("t5_1_0_tiny", d_model=16, num_heads=2, d_ff=32, vocab_size=64,
                            num_encoder_layers=1, num_decoder_layers=1)


def test_a_parameter_also_used_outside_its_layer_is_refused():
  """An L2 penalty on the (recorded) embedding would escape the ghost norm: refused."""
  config = _tiny_config()
  params = network.init_params(config, jax.random.PRNGKey(0))
  penalty = lambda p: 1e-2 * jnp.sum(jnp.square(p["token_embedder"]["embedding"]))
  loss_fn = lambda p, b, k: model_lib.example_loss_fn(p, b, config, k) + penalty(p)
  batch = _model_batch(_batch(config, seed=3))
  example = jax.tree.map(lambda x: x[0], batch)
  recording = ghost.record_layer_uses(loss_fn, params, example, None)
  assert set(recording.unrecorded) == {("token_embedder", "embedding")}
  with pytest.raises(ConfigError, match="token_embedder/embedding.*outside any recorded layer"):
    ghost.check_coverage(params, recording)
  # The aggregator refuses it at trace time, before any step: the ghost norm would bound only
  # the model's part of the gradient, and the penalty's part would be summed unclipped.
  agg = ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.0, 4.0))
  with pytest.raises(ConfigError, match="token_embedder/embedding"):
    jax.jit(agg.clipped_sum)(params, batch)
  # The unmodified loss of the same model passes.
  plain = lambda p, b, k: model_lib.example_loss_fn(p, b, config, k)
  ghost.check_coverage(params, ghost.record_layer_uses(plain, params, example, None))


class _TwoDense(nn.Module):
  """T5 `Dense` layers; the first kernel is also the input of another layer."""

  @nn.compact
  def __call__(self, x):
    first = layers.Dense(features=3, kernel_axes=("embed", "mlp"), name="first")
    y = layers.Dense(features=2, kernel_axes=("embed", "mlp"), name="second")(first(x))
    z = layers.Dense(features=2, kernel_axes=("embed", "mlp"), name="third")(
        first.variables["params"]["kernel"])
    return y + jnp.sum(z, axis=0)


def test_a_parameter_feeding_another_layers_input_is_refused():
  """A kernel read inside another recorded layer (as part of its input) is not its own use."""
  model = _TwoDense()

  def loss_fn(p, batch, key):
    del key
    return jnp.sum(model.apply({"params": p}, batch["x"]) ** 2, axis=-1)

  params = {"first": {"kernel": jnp.ones((3, 3))}, "second": {"kernel": jnp.ones((3, 2))},
            "third": {"kernel": jnp.ones((3, 2))}}
  example = {"x": jnp.ones((3,)), "example_weight": jnp.ones(())}
  recording = ghost.record_layer_uses(loss_fn, params, example, None)
  assert set(recording.unrecorded) == {("first", "kernel")}
  with pytest.raises(ConfigError, match="first/kernel.*inside the recorded layer of third"):
    ghost.check_coverage(params, recording)


def test_a_parameter_read_through_a_nested_jit_inside_no_layer_is_refused():
  dense = layers.Dense(features=2, kernel_axes=("embed", "mlp"))
  scale = jax.jit(lambda y, k: y * jnp.mean(k))

  def loss_fn(p, batch, key):
    del key
    y = dense.apply({"params": p}, batch["x"])
    return jnp.sum(scale(y, p["kernel"]) ** 2, axis=-1)

  params = {"kernel": jnp.ones((3, 2))}
  example = {"x": jnp.ones((3,)), "example_weight": jnp.ones(())}
  recording = ghost.record_layer_uses(loss_fn, params, example, None)
  assert set(recording.unrecorded) == {("kernel",)}


def test_invalid_methods_raise_config_error():
  loss_fn = lambda p, b, k: jnp.zeros(b["example_weight"].shape)
  with pytest.raises(ConfigError, match="norm_method"):
    ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.0, 4.0), norm_method="fast")
  with pytest.raises(ConfigError, match="clipped_sum_method"):
    ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.0, 4.0), clipped_sum_method="magic")


@pytest.mark.parametrize("preset", ["t5_1_0_small", "t5_1_1_small"])
def test_every_parameter_of_the_real_presets_is_covered(preset):
  """Abstract trace only: every parameter of the full-size presets has a recorded use."""
  config = config_lib.load_preset(preset)
  params = network.param_shapes(config)
  loss_fn = lambda p, b, k: model_lib.example_loss_fn(p, b, config, k)
  example = jax.tree.map(lambda x: x[0], _model_batch(_batch(config, input_len=512,
                                                             target_len=114)))
  recording = ghost.record_layer_uses(loss_fn, params, example, None)
  assert recording.unrecorded == {}
  ghost.check_coverage(params, recording)
  rows = ghost.cost_breakdown(recording)
  kernels = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
             if path[-1].key == "kernel"]
  assert len([r for r in rows if ":dense" in r["layer"]]) == len(kernels)
  assert any(":attend" in r["layer"] for r in rows) == config.tie_embeddings
  methods = {r["layer"]: r["method"] for r in rows}
  # Long encoder sequences: instantiate; short decoder self-attention: Gram.
  assert methods["encoder/layers_0/mlp/wi:dense0" if preset.startswith("t5_1_0")
                 else "encoder/layers_0/mlp/wi_0:dense0"] == "instantiate"
  assert methods["decoder/layers_0/self_attention/query:dense0"] == "gram"


def _dense_loss_fn():
  """A one-layer model built from the T5 `Dense` layer: loss_i = ||x_i W||^2."""
  dense = layers.Dense(features=2, kernel_axes=("embed", "mlp"))

  def loss_fn(p, batch, key):
    del key
    return jnp.sum(dense.apply({"params": p}, batch["x"]) ** 2, axis=-1)
  return loss_fn


@pytest.mark.parametrize("stack_layers", [False, True])
def test_nonfinite_example_gradient_is_dropped_not_propagated(stack_layers):
  loss_fn = _dense_loss_fn()
  p = {"kernel": jnp.ones((3, 2))}
  x = np.array([[1, 0, 0], [np.inf, 0, 0], [0, 1, 0], [0, 0, 0]], np.float32)
  batch = {"x": x, "example_weight": np.array([1, 1, 1, 0], np.float32)}
  agg = ghost.GhostDPAggregator(loss_fn, NoisySum(1.0, 0.0, 3.0), stack_layers=stack_layers)
  summed, metrics = jax.jit(agg.clipped_sum)(p, batch)
  assert np.isfinite(summed["kernel"]).all() and np.isfinite(metrics["nondp/grad_norm_mean"])
  without_inf = dict(batch, example_weight=np.array([1, 0, 1, 0], np.float32))
  want, _ = jax.jit(DPAggregator(loss_fn, NoisySum(1.0, 0.0, 3.0)).clipped_sum)(p, without_inf)
  np.testing.assert_allclose(summed["kernel"], want["kernel"], rtol=1e-6)


def _aggregator(method, loss_fn, **kwargs):
  if method == "vmap":
    return DPAggregator(loss_fn, NoisySum(1.0, 0.0, 3.0), **kwargs)
  return ghost.GhostDPAggregator(loss_fn, NoisySum(1.0, 0.0, 3.0), clipped_sum_method=method, **kwargs)


@pytest.mark.parametrize("method", ["vmap", BOOKKEEPING, SECOND_PASS, LAYERWISE])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
@pytest.mark.parametrize("microbatch_size", [None, 2])
def test_every_method_drops_a_nonfinite_example_exactly(method, poison, microbatch_size):
  """One example whose loss and gradient are NaN/inf gives the clipped sum of the batch without it."""
  loss_fn = _dense_loss_fn()
  p = {"kernel": jnp.arange(6, dtype=jnp.float32).reshape(3, 2) / 4}
  x = np.array([[1, 0, 2], [poison, 1, 0], [0, 1, 0], [0, 0, 0]], np.float32)
  batch = {"x": x, "example_weight": np.array([1, 1, 1, 0], np.float32)}
  # The same batch without the poisoned row (a zero padding row keeps the shape).
  without = {"x": x[[0, 2, 3, 3]], "example_weight": np.array([1, 1, 0, 0], np.float32)}
  agg = _aggregator(method, loss_fn)
  if microbatch_size is None:
    clipped_sum = jax.jit(agg.clipped_sum)
  else:
    clipped_sum = functools.partial(_clipped_sum_in_microbatches, agg, microbatch_size=microbatch_size)
  got, metrics = clipped_sum(p, batch)
  want, _ = clipped_sum(p, without)
  assert np.isfinite(got["kernel"]).all() and np.isfinite(metrics["nondp/grad_norm_mean"])
  np.testing.assert_allclose(got["kernel"], want["kernel"], rtol=1e-6)
  assert np.abs(want["kernel"]).sum() > 0


@pytest.mark.parametrize("method", ["vmap", BOOKKEEPING, SECOND_PASS, LAYERWISE])
def test_a_batch_of_only_nonfinite_examples_sums_to_zero(method):
  x = np.array([[np.nan, 0, 0], [np.inf, 1, 0]], np.float32)
  batch = {"x": x, "example_weight": np.array([1, 1], np.float32)}
  got, _ = jax.jit(_aggregator(method, _dense_loss_fn()).clipped_sum)({"kernel": jnp.ones((3, 2))}, batch)
  np.testing.assert_array_equal(got["kernel"], 0.0)


def test_the_execution_method_picks_the_aggregator_and_both_share_the_noisy_sum():
  noisy_sum = NoisySum(1.0, 1.0, 4.0)
  for method, cls in (("vmap", DPAggregator), ("ghost", ghost.GhostDPAggregator)):
    agg = mechanism.AGGREGATORS[dp_config.ExecutionSettings(method=method).method](_dense_loss_fn(), noisy_sum)
    assert type(agg) is cls and agg.noisy_sum is noisy_sum
  with pytest.raises(ConfigError, match="ghost"):
    dp_config.ExecutionSettings(method="jit")
