"""Learning-rate schedules and T5's Adafactor settings."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from private_t5.errors import ConfigError
from private_t5.train import optimizers
from private_t5.train.state import RunSeeds, step_keys


def test_rsqrt_schedule_is_t5x_constant_times_rsqrt_decay():
  # T5X: lr(t) = base / sqrt(max(t, warmup)).
  base, warmup = 0.5, 1000
  schedule = optimizers.rsqrt_schedule(base_learning_rate=base, warmup_steps=warmup)
  for t in (0, 1, 999, 1000, 4000, 100000):
    assert float(schedule(t)) == pytest.approx(base / math.sqrt(max(t, warmup)), rel=1e-6)
  # Given as the peak: starts at the peak, constant during warm-up, then peak * sqrt(warmup / t).
  peak = optimizers.rsqrt_schedule(peak_learning_rate=0.5, warmup_steps=100)
  assert float(peak(0)) == pytest.approx(0.5) and float(peak(100)) == pytest.approx(0.5)
  assert float(peak(400)) == pytest.approx(0.25)
  with pytest.raises(ConfigError, match="exactly one"):
    optimizers.rsqrt_schedule(peak_learning_rate=0.1, base_learning_rate=0.5)
  with pytest.raises(ConfigError, match="warmup_steps"):
    optimizers.rsqrt_schedule(peak_learning_rate=0.1, warmup_steps=-5)


def test_constant_and_linear_warmup_schedules():
  assert float(optimizers.constant_schedule(0.3)(12345)) == pytest.approx(0.3)
  lin = optimizers.linear_warmup_schedule(1.0, warmup_steps=10)
  assert [round(float(lin(t)), 6) for t in (0, 5, 10, 50)] == [0.0, 0.5, 1.0, 1.0]
  decayed = optimizers.linear_warmup_schedule(1.0, warmup_steps=10, decay="linear", total_steps=20)
  assert float(decayed(15)) == pytest.approx(0.5) and float(decayed(20)) == pytest.approx(0.0)
  rsqrt = optimizers.linear_warmup_schedule(1.0, warmup_steps=10, decay="rsqrt")
  assert float(rsqrt(40)) == pytest.approx(0.5, rel=1e-5)
  with pytest.raises(ConfigError, match="decay"):
    optimizers.linear_warmup_schedule(1.0, decay="cosine")
  with pytest.raises(ConfigError, match="total_steps"):
    optimizers.linear_warmup_schedule(1.0, warmup_steps=10, decay="linear")


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_adafactor_matches_optax_with_t5_settings(momentum):
  # Several parameters of one shape: batched over shapes (the default), each is still updated on
  # its own, with the same state structure and values as optax's per-parameter Adafactor.
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {"w": jnp.ones((256, 160)), "w2": jax.random.normal(keys[0], (256, 160)),
            "layer": {"w": 3.0 * jax.random.normal(keys[1], (256, 160)), "b": jnp.ones((7,))},
            "b": jnp.ones((7,)) * 0.5, "v": jax.random.normal(keys[2], (160, 256))}
  grads = jax.tree.map(lambda p: 0.01 * jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape), params)
  grads["w2"] = grads["w2"] * 40.0  # one member's update is clipped, the others' are not
  ours = optimizers.adafactor(optimizers.constant_schedule(0.01), momentum=momentum, batched_over_shapes=True)
  assert ours.update is not optax.adafactor(0.01).update
  reference = optax.adafactor(0.01, decay_rate=0.8, clipping_threshold=1.0, momentum=momentum, factored=True,
                              multiply_by_parameter_scale=True)
  per_parameter = optimizers.adafactor(optimizers.constant_schedule(0.01), momentum=momentum,
                                       batched_over_shapes=False)
  state_a, state_b, state_c = ours.init(params), reference.init(params), per_parameter.init(params)
  update = jax.jit(ours.update)
  for _ in range(3):
    ua, state_a = update(grads, state_a, params)
    ub, state_b = reference.update(grads, state_b, params)
    uc, state_c = per_parameter.update(grads, state_c, params)
    assert jax.tree.structure(state_a) == jax.tree.structure(state_c)
    for a, c in zip(jax.tree.leaves((ua, state_a)), jax.tree.leaves((uc, state_c))):
      np.testing.assert_allclose(a, c, rtol=2e-5, atol=1e-8)
    for a, b in zip(jax.tree.leaves(ua), jax.tree.leaves(ub)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-8)
    params = optax.apply_updates(params, ub)
  # Factored second moments for the large matrix (rows + columns), no momentum.
  factored = [x for x in jax.tree.leaves(state_a) if getattr(x, "shape", None) in ((256,), (160,))]
  assert len(factored) >= 2
  with pytest.raises(ConfigError, match="decay_rate"):
    optimizers.adafactor(0.1, decay_rate=1.5)


def test_keys_continue_and_never_repeat():
  seeds = RunSeeds.create(insecure_deterministic_seed=5)
  keys = [step_keys(seeds.dropout_base_key, seeds.noise_base_key, t) for t in range(50)]
  noise = {tuple(np.asarray(k[1]).tolist()) for k in keys}  # raw uint32[2] threefry keys
  dropout = {tuple(np.asarray(k[0]).tolist()) for k in keys}
  assert len(noise) == 50 and len(dropout) == 50 and not noise & dropout
  # A resumed run (same seeds, restored from the checkpoint) derives the same key for step t.
  again = RunSeeds.from_dict(seeds.to_dict())
  np.testing.assert_array_equal(step_keys(again.dropout_base_key, again.noise_base_key, 17)[1], keys[17][1])
  # Seeds use all 64 bits; OS entropy by default.
  assert RunSeeds.create(2**40 + 1).noise_base_key.tolist() != RunSeeds.create(1).noise_base_key.tolist()
  fresh_a, fresh_b = RunSeeds.create(), RunSeeds.create()
  assert not fresh_a.deterministic and fresh_a.root_seed != fresh_b.root_seed
  assert seeds.sampler_seed != seeds.data_seed(0) and seeds.data_seed(0) != seeds.data_seed(1)
