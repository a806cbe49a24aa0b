"""The mechanism as parts: a clipped sum, a noise transform, a sampler, a DP event.

A non-private run is the same plan with other parts: the mean and no noise give the same update
as the DP clipped sum with σ = 0 and a clip norm no gradient reaches; the noise transform is an
optax transform that chains in front of an optimizer; the noise is drawn and added by one
function, once per step, on every training path (fused, microbatched, adaptive DP).
"""
import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from private_t5.models import config
from private_t5.dp import noise as noise_lib
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.aggregator import MeanAggregator
from private_t5.dp.mechanism import AGGREGATORS
from private_t5.selective import adaptive
from private_t5.train import host_microbatches, optimizers
from private_t5.models import sharding
from private_t5.train.state import RunSeeds
from private_t5.train.trainer import Trainer, make_loss_fn

CONFIG = config.T5Config(vocab_size=256, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                         num_decoder_layers=1, dropout_rate=0.0)
ROWS = 4
NO_CLIP = 1e30  # C = ∞ in effect: min(1, C / ‖g‖) = 1 for every finite gradient
PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "private_t5"


def _batch(rows=ROWS, seed=0):
  rng = np.random.default_rng(seed)
  tgt = rng.integers(3, CONFIG.vocab_size, (rows, 6)).astype(np.int32)
  dec = np.zeros_like(tgt)
  dec[:, 1:] = tgt[:, :-1]
  return {"encoder_input_tokens": rng.integers(3, CONFIG.vocab_size, (rows, 10)).astype(np.int32),
          "decoder_input_tokens": dec, "decoder_target_tokens": tgt,
          "decoder_loss_weights": np.ones(tgt.shape, np.float32), "example_weight": np.ones(rows, np.float32)}


def _trainer(clipped_sum, noise=None):
  mesh = sharding.create_mesh((1, 1), devices=jax.devices()[:1])
  return Trainer(CONFIG, clipped_sum, optimizers.adafactor(optimizers.constant_schedule(0.01)), mesh, noise=noise)


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_non_private_plan_equals_dp_plan_without_noise_or_clipping(method):
  """Mean + no noise vs the DP clipped sum with σ = 0, C = ∞ and q·N = the batch's real rows:
  the same Adafactor update (the loop and the trainer are the same for both)."""
  seeds = RunSeeds.create(insecure_deterministic_seed=0)
  updates = {}
  for name, clipped_sum, noise in (
      ("non-private", MeanAggregator(make_loss_fn(CONFIG)), noise_lib.no_noise()),
      ("dp", AGGREGATORS[method](make_loss_fn(CONFIG), NoisySum(NO_CLIP, 0.0, float(ROWS))),
       noise_lib.noise_transform(NoisySum(NO_CLIP, 0.0, float(ROWS))))):
    trainer = _trainer(clipped_sum, noise)
    state = trainer.init_state(seeds.init_key)
    before = _flat(state.params)
    state, metrics = trainer.train_step(state, _batch(), seeds.dropout_base_key, seeds.noise_base_key)
    updates[name] = _flat(state.params) - before
    if name == "dp":
      assert float(metrics["nondp/fraction_clipped"]) == 0.0  # nothing was clipped
  assert np.abs(updates["dp"]).max() > 0
  np.testing.assert_allclose(updates["dp"], updates["non-private"], rtol=2e-4, atol=1e-7)


def test_noise_transform_chains_in_front_of_an_optimizer():
  """`noise_transform` is an optax transform: chained with SGD it gives g + N(0, (σC/qN)²), the
  key passed as an extra argument of `update`."""
  noisy_sum = NoisySum(2.0, 1.5, 4.0)
  params = {"w": jnp.zeros((50_000,)), "b": jnp.zeros((3, 4))}
  grads = jax.tree.map(jnp.ones_like, params)
  chain = optax.chain(noise_lib.noise_transform(noisy_sum), optax.sgd(-1.0))
  key = jax.random.PRNGKey(5)
  updates, _ = chain.update(grads, chain.init(params), params, noise_rng=key)
  direct = noise_lib.add_gaussian_noise(grads, key, 1.5 * 2.0 / 4.0)
  np.testing.assert_allclose(_flat(updates), _flat(direct), rtol=1e-6)
  assert float(jnp.std(updates["w"])) == pytest.approx(0.75, rel=0.02)
  # The identity of a non-private run takes the same arguments.
  same, _ = noise_lib.no_noise().update(grads, optax.EmptyState(), params, noise_rng=key)
  np.testing.assert_array_equal(_flat(same), _flat(grads))


def test_noise_is_drawn_once_per_step_on_every_path(monkeypatch):
  calls = []
  original = noise_lib.add_gaussian_noise

  def counting(tree, key, std):
    calls.append(std)
    return original(tree, key, std)

  monkeypatch.setattr(noise_lib, "add_gaussian_noise", counting)
  seeds = RunSeeds.create(insecure_deterministic_seed=1)
  noisy_sum = NoisySum(0.1, 1.0, 3.0)
  batch = _batch()
  for clipped_sum in (AGGREGATORS["ghost"](make_loss_fn(CONFIG), noisy_sum),
                      adaptive.AdaptiveDPAggregator(AGGREGATORS["vmap"](make_loss_fn(CONFIG), noisy_sum))):
    if isinstance(clipped_sum, adaptive.AdaptiveDPAggregator):
      batch = dict(batch, **{adaptive.PRIVACY_PROBABILITY: np.full(ROWS, 0.5, np.float32)})
    trainer = _trainer(clipped_sum)
    state = trainer.init_state(seeds.init_key)
    calls.clear()
    state, _ = trainer.train_step(state, batch, seeds.dropout_base_key, seeds.noise_base_key)
    assert len(calls) == 1  # traced once: one draw in the fused step
    calls.clear()
    state, metrics = host_microbatches.train_step_microbatched(trainer, state, batch, 2, seeds.dropout_base_key,
                                                               seeds.noise_base_key)
    assert len(calls) == 1  # two microbatches accumulated, one draw in the finalize step
  assert float(metrics[adaptive.METRIC_PRIVACY_WEIGHT]) == pytest.approx(0.5)


def test_gaussian_draws_live_in_one_module():
  """No module of the training path draws Gaussian noise but `dp/noise.py`."""
  drawers = []
  for folder in ("dp", "train", "selective", "experiments", "stages"):
    for path in sorted((PACKAGE / folder).glob("*.py")):
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "normal" and "random" in ast.unparse(node.value):
          drawers.append(path.relative_to(PACKAGE).as_posix())
  assert sorted(set(drawers)) == ["dp/noise.py"]
