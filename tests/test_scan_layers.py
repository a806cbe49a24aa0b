"""`T5Config.scan_layers` and `T5Config.remat_policy`: the same network in another layout.

A scanned network (each stack one `nn.scan` over stacked parameters) and a rematerialised one
(each layer under `jax.checkpoint`) compute the function of the unrolled network on the same
parameters (`network.to_layout`): logits, losses, gradients, DP-vmap per-example norms and clipped
sums, Adafactor's steps and cached decoding agree to float32 rounding; the layout conversion is
bit-identical both ways; a tiny run trains scanned, checkpoints, is resumed unrolled from that
checkpoint and ends where an unrolled run of the same steps ends.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5.dp.config import LAYERWISE, SECOND_PASS
from private_t5.dp import clipping, ghost
from private_t5.dp.aggregator import DPAggregator
from private_t5.dp.privacy_params import NoisySum
from private_t5.errors import ConfigError
from private_t5.models import hf_convert
from private_t5.models import lora as lora_lib
from private_t5.models import network
from private_t5.models.config import REMAT_POLICIES, load_preset
from private_t5.models.model import EncoderDecoderModel
from private_t5.train import main as train_main
from private_t5.dp import config as config_lib
from private_t5.train import optimizers
from private_t5.train.trainer import make_loss_fn

BATCH, INPUTS, TARGETS = 4, 12, 7
RTOL = 2e-5


def _close(a, b, rtol=RTOL):
  """Leaf by leaf, to `rtol` of each element and of the leaf's largest magnitude (float32 sums in
  another order)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    y = np.asarray(y)
    np.testing.assert_allclose(np.asarray(x), y, rtol=rtol, atol=rtol * float(np.max(np.abs(y), initial=0.0)))


def _tiny(preset: str):
  return load_preset(preset, dropout_rate=0.0, num_encoder_layers=2, num_decoder_layers=3, vocab_size=512,
                     d_model=64, num_heads=2, d_kv=16, d_ff=128)


@pytest.fixture(scope="module")
def config():
  """T5 v1.1 (gated GELU, untied logits), 2 + 3 layers, no dropout."""
  return _tiny("t5_1_1_tiny")


@pytest.fixture(scope="module")
def params(config):
  return network.init_params(config, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  enc = rng.integers(2, 500, (BATCH, INPUTS)).astype(np.int32)
  enc[1, 9:] = 0  # padding
  tgt = rng.integers(2, 500, (BATCH, TARGETS)).astype(np.int32)
  dec = np.concatenate([np.zeros((BATCH, 1), np.int32), tgt[:, :-1]], axis=1)
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=tgt,
              decoder_loss_weights=np.ones((BATCH, TARGETS), np.float32),
              example_weight=np.ones((BATCH,), np.float32))


def test_layout_conversion_is_bit_identical_both_ways(config, params):
  scanned_config = config.replace(scan_layers=True)
  scanned = network.to_layout(params, True)
  assert network.is_scanned(scanned) and not network.is_scanned(params)
  assert set(scanned["encoder"]) == {"layers", "relpos_bias", "encoder_norm"}
  assert scanned["encoder"]["layers"]["mlp"]["wo"]["kernel"].shape[0] == 2
  assert scanned["decoder"]["layers"]["mlp"]["wo"]["kernel"].shape[0] == 3
  back = network.to_layout(scanned, False)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
  # Host arrays and shapes convert the same way; a tree already in the layout is unchanged.
  host = network.to_layout(jax.tree.map(np.asarray, params), True)
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
  assert jax.tree.map(np.shape, host) == jax.tree.map(np.shape, scanned)
  assert network.to_layout(scanned, True) is not None
  assert jax.tree.map(lambda s: s.shape, network.param_shapes(scanned_config)) == jax.tree.map(np.shape, scanned)
  # Fresh parameters of the scanned network are the unrolled network's, stacked.
  fresh = network.init_params(scanned_config, jax.random.PRNGKey(0))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(scanned)))
  # Imported or fine-tuning weights (unrolled) are accepted for a scanned network, and a scanned tree too.
  hf_convert.check_param_shapes(params, scanned_config)
  hf_convert.check_param_shapes(scanned, config)
  axes = network.param_logical_axes(scanned_config)
  assert axes["encoder"]["layers"]["attention"]["query"]["kernel"] == ("layers", "embed", "joined_kv")
  assert axes["encoder"]["relpos_bias"]["rel_embedding"] == ("heads", "relpos_buckets")


def test_scan_and_remat_compute_the_unrolled_logits_and_gradients(config, params, batch):
  def loss_and_grads(cfg, p):
    loss = make_loss_fn(cfg)
    return jax.jit(jax.value_and_grad(lambda q: jnp.sum(loss(q, batch, None))))(p)

  value, grads = loss_and_grads(config, params)
  scanned_params = network.to_layout(params, True)
  _close(EncoderDecoderModel(config.replace(scan_layers=True)).compute_logits(scanned_params, batch),
         EncoderDecoderModel(config).compute_logits(params, batch))
  for policy in REMAT_POLICIES:  # remat changes only what the backward pass recomputes
    v, g = loss_and_grads(config.replace(scan_layers=True, remat_policy=policy), scanned_params)
    np.testing.assert_allclose(v, value, rtol=RTOL)
    _close(network.to_layout(g, False), grads, rtol=1e-4)


def test_dp_vmap_clipped_sums_are_the_unrolled_ones(config, params, batch):
  """Per-example gradients vmapped over the scanned, fully rematerialised network: the clipped sum
  and mean norm of the unrolled network (ghost's per-example norms: the test below)."""
  def clipped(cfg, p):
    return jax.jit(DPAggregator(make_loss_fn(cfg), NoisySum(0.5, 1.0, float(BATCH))).clipped_sum)(p, batch)

  total, metrics = clipped(config, params)
  assert float(metrics[clipping.METRIC_FRACTION_CLIPPED]) == 1.0  # the sum tests the clip factors too
  t, m = clipped(config.replace(scan_layers=True, remat_policy="full"), network.to_layout(params, True))
  np.testing.assert_allclose(m[clipping.METRIC_GRAD_NORM], metrics[clipping.METRIC_GRAD_NORM], rtol=1e-5)
  _close(network.to_layout(t, False), total, rtol=1e-4)


@pytest.mark.parametrize("batched", [False, True])
def test_per_layer_adafactor_takes_the_unrolled_steps(config, params, batched):
  """Each stacked leaf's layers updated as separate parameters (vmapped over the layer axis), also
  with `batched_over_shapes`; the state is the unrolled state in the scanned layout."""
  inner = optimizers.adafactor(learning_rate=0.1, batched_over_shapes=batched)
  grads = jax.tree.map(lambda p: jnp.sin(p * 3.0 + 1.0) * 0.01, params)
  state = inner.init(params)
  updates, state = inner.update(grads, state, params)
  updates, state = inner.update(grads, state, params)
  tx = optimizers.per_layer(inner)
  scanned = network.to_layout(params, True)
  s_state = tx.init(scanned)
  _close(network.to_layout(s_state, False), inner.init(params), rtol=0)
  s_grads = network.to_layout(grads, True)
  s_updates, s_state = jax.jit(tx.update)(s_grads, s_state, scanned)
  s_updates, s_state = jax.jit(tx.update)(s_grads, s_state, scanned)
  assert jax.tree.structure(s_state) == jax.tree.structure(network.to_layout(state, True))
  _close(network.to_layout(s_updates, False), updates, rtol=1e-6)
  _close(network.to_layout(s_state, False), state, rtol=1e-6)


@pytest.mark.parametrize("preset", ["t5_1_1_tiny", "t5_1_0_tiny"])
def test_cached_decoding_of_the_scanned_network_matches(preset):
  """v1.1 and v1.0 (ReLU, tied embedding: the logits through `Embed.attend`)."""
  config = _tiny(preset)
  params = jax.tree.map(lambda x: x * 2.0, network.init_params(config, jax.random.PRNGKey(0)))  # not flat
  enc = np.random.default_rng(1).integers(2, 500, (2, INPUTS)).astype(np.int32)
  reference = EncoderDecoderModel(config)
  scanned = EncoderDecoderModel(config.replace(scan_layers=True, remat_policy="full"))
  scanned_params = network.to_layout(params, True)
  for method in ("greedy", "beam"):
    expected = np.asarray(reference.predict_batch(params, enc, max_decode_length=6, method=method))
    assert len(np.unique(expected)) >= 3
    for use_cache in (True, False):
      got = scanned.predict_batch(scanned_params, enc, max_decode_length=6, method=method, use_cache=use_cache)
      np.testing.assert_array_equal(np.asarray(got), expected)


def test_ghost_clipping_inside_the_scanned_stacks_gives_the_unrolled_norms_and_sums(config, params, batch):
  """Ghost norms and book-keeping sums (and the second pass, and the layer-by-layer sums) of the
  scanned network, with and without remat, equal ghost clipping's of the unrolled network: each
  stack's layers hand their recorded inputs out of the scan, stacked, and their norms are computed
  a stack at a time (layer by layer: inside the scan's backward pass, from the rematerialised inputs)."""
  def ghost_sum(cfg, p, **options):
    aggregator = ghost.GhostDPAggregator(make_loss_fn(cfg), NoisySum(0.5, 1.0, float(BATCH)), **options)
    total, _, norms, _ = jax.jit(lambda q: aggregator.ghost_clipped_sum(q, batch, None))(p)
    return norms, total

  norms, total = ghost_sum(config, params)
  scanned = network.to_layout(params, True)
  for policy, options in (("none", {}), ("full", dict(clipped_sum_method=SECOND_PASS)),
                          ("full", dict(clipped_sum_method=LAYERWISE))):
    n, t = ghost_sum(config.replace(scan_layers=True, remat_policy=policy), scanned, **options)
    np.testing.assert_allclose(n, norms, rtol=1e-5)
    _close(network.to_layout(t, False), total, rtol=1e-5)
  recording = ghost.record_layer_uses(make_loss_fn(config.replace(scan_layers=True)), scanned,
                                      jax.tree.map(lambda x: x[0], batch), None)
  stacked = {k: use for k, use in recording.uses.items() if use.stacked}
  assert len(stacked) == len(jax.tree.leaves(scanned["encoder"]["layers"])) + len(
      jax.tree.leaves(scanned["decoder"]["layers"]))
  assert recording.output_shapes["encoder/layers/mlp/wo:dense0"].shape[0] == 2


def test_bad_settings_and_ghost_inside_unrolled_remat_are_refused_in_one_line(config, params, batch):
  with pytest.raises(ConfigError, match="remat_policy must be one of"):
    config.replace(remat_policy="everything")
  with pytest.raises(ConfigError, match="scan_layers must be True or False"):
    config.replace(scan_layers=1)
  rematerialised = config.replace(remat_policy="minimal")
  with pytest.raises(ConfigError, match="scan_layers=True with it, or train.clipping_method='vmap'"):
    ghost.record_layer_uses(make_loss_fn(rematerialised), params, jax.tree.map(lambda x: x[0], batch), None)
  low = ghost.GhostDPAggregator(make_loss_fn(config.replace(dtype="bfloat16")), NoisySum(1.0, 1.0, float(BATCH)),
                                clipped_sum_method=LAYERWISE)
  with pytest.raises(ConfigError, match="layerwise' recomputes the output gradients in bfloat16"):
    jax.eval_shape(lambda p: low.norm_pass(p, batch, None).norms, params)
  dp = config_lib.DPConfig(clip_norm=1.0, noise_multiplier=1.0)
  with pytest.raises(ConfigError, match="clipping_method='ghost' does not run inside remat_policy"):
    train_main.clipping_method_for(rematerialised, dp, "ghost", print)
  said = []
  assert train_main.clipping_method_for(rematerialised, dp, None, said.append) == "vmap" and len(said) == 1
  assert train_main.clipping_method_for(rematerialised.replace(scan_layers=True), dp, None, said.append) is None
  assert train_main.clipping_method_for(rematerialised, None, None, said.append) is None and len(said) == 1


def test_ghost_clipping_inside_the_scan_moves_the_sum_by_at_most_c_per_example(config, params, batch):
  """The sensitivity property on the scanned, fully rematerialised network, its clipped sum formed
  layer by layer inside the backward passes: removing any one example (its weight zeroed) moves the
  noiseless clipped sum by at most C, tightly when clipped."""
  clip = 1.0
  aggregator = ghost.GhostDPAggregator(make_loss_fn(config.replace(scan_layers=True, remat_policy="full")),
                                       NoisySum(clip, 1.0, float(BATCH)), clipped_sum_method=LAYERWISE)
  fn = jax.jit(lambda p, b: aggregator.clipped_sum(p, b)[0])
  flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])
  largest, smallest = 0.0, np.inf
  for factor in (1e-3, 1.0, 1e3):
    scaled = network.to_layout(params, True)
    scaled["decoder"]["decoder_norm"] = {"scale": scaled["decoder"]["decoder_norm"]["scale"] * factor}
    full = flat(fn(scaled, batch))
    for row in range(BATCH):
      weights = batch["example_weight"].copy()
      weights[row] = 0.0
      change = np.linalg.norm(full - flat(fn(scaled, dict(batch, example_weight=weights))))
      assert change <= clip * (1 + 1e-5), (factor, row, change)
      largest, smallest = max(largest, change), min(smallest, change)
  assert largest > 0.99 * clip and smallest < 0.9 * clip  # both sides of C were exercised


def test_dp_lora_inside_the_scan_gives_the_unrolled_norms(config, params, batch):
  """LoRA adapters of a scanned network (stacked like the layers): ghost and vmap norms of the
  adapters' gradients, the base weights closed over, equal the unrolled network's."""
  lora = lora_lib.LoraConfig(rank=2, alpha=4.0, targets=("query", "value", "wo"))
  adapters = network.init_adapters(config, lora, jax.random.PRNGKey(5))
  adapters = jax.tree.map(lambda a: a + 0.05, adapters)  # B is zero at init: give it a gradient path

  def norms(cfg, base, adapters_):
    loss = functools.partial(make_loss_fn(cfg, lora=lora), base=base)
    out = []
    for aggregator in (ghost.GhostDPAggregator(loss, NoisySum(1.0, 1.0, float(BATCH))),
                       DPAggregator(loss, NoisySum(1.0, 1.0, float(BATCH)))):
      _, metrics = jax.jit(aggregator.clipped_sum)(adapters_, batch)
      out.append(float(metrics[clipping.METRIC_GRAD_NORM]))
    return out

  expected = norms(config, params, adapters)
  got = norms(config.replace(scan_layers=True), network.to_layout(params, True), network.to_layout(adapters, True))
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  np.testing.assert_allclose(expected[0], expected[1], rtol=1e-5)
