"""Correlated-noise DP training by matrix factorization (banded and BLT): strategies, the noise
transform, cyclic Poisson sampling, accounting and the ledger.

Property tests against dense C for small n (sensitivity of the released sequence, the noise's
covariance), reference comparisons (b = 1 is DP-SGD bit for bit; ε equals jax-privacy's own
accountant for the same plan), exact resume of the noise state, and the ledger's records.
"""
import json
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from private_t5.dp import accounting
from private_t5.dp import noise as noise_lib
from private_t5.dp import strategies
from private_t5.dp.privacy_params import NoiseKind, NoisySum
from private_t5.dp.ledger import PrivacyLedger
from private_t5.dp.config import DPConfig, ExecutionSettings, require_gaussian
from private_t5.dp.mechanism import build_mechanism
from private_t5.dp.sampling import CyclicPoissonSampler, PoissonSampler
from private_t5.errors import ConfigError, DataError, PrivacyError
from private_t5.stages import cli

# Hand-made strategies (no optimisation): b = 3 bands, and a two-buffer BLT whose Toeplitz
# coefficients are positive and decreasing.
BANDED = strategies.Strategy("banded", 3, 12, coefs=(0.8, 0.5, 0.33))
BLT = strategies.Strategy("blt", 3, 12, buf_decay=(0.9, 0.4), output_scale=(0.3, 0.2))
NOISY_SUM = NoisySum(clip_norm=1.5, noise_multiplier=0.8, expected_batch_size=20.0)


def _quiet(_):
  pass


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
  """$PRIVATE_T5_CACHE of this module's tests, shared by them (optimised strategies are slow)."""
  return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True)
def _strategy_cache_env(cache_root, monkeypatch):
  monkeypatch.setenv("PRIVATE_T5_CACHE", cache_root)


@pytest.fixture
def strategy_cache(cache_root):
  return strategies.default_cache_dir()


def _params():
  return {"dense": jnp.zeros((40, 50), jnp.bfloat16), "bias": jnp.zeros((50,), jnp.float32),
          "embed": jnp.zeros((1000,), jnp.float32)}


def _noise_over(transform, steps, key=0, params=None, state=None):
  """[steps, coordinates]: the noise the transform adds to zero updates, and the final state."""
  params = _params() if params is None else params
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  state = transform.init(params) if state is None else state
  update = jax.jit(transform.update)
  rows = []
  for t in range(steps):
    noisy, state = update(zeros, state, None, noise_rng=jax.random.fold_in(jax.random.PRNGKey(key), t))
    rows.append(np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(noisy)]))
  return np.stack(rows), state


# -- strategies: sensitivity ------------------------------------------------------------------

@pytest.mark.parametrize("strategy", [BANDED, BLT], ids=["banded", "blt"])
def test_released_sequence_sensitivity_is_bounded_by_the_strategy(strategy):
  """Add/remove one example: it joins a random subset of its group's steps (t ≡ g mod b) with
  contributions of norm ≤ C; ‖C X‖ stays within what the accounting assumes: BLT, all
  participations together within sens(C)·C; banded, each participation within sens(C)·C on rows
  no other participation touches (amplified per participation)."""
  n, b, clip = strategy.steps, strategy.num_bands, 1.5
  dense = strategy.dense(n)
  rng = np.random.default_rng(0)
  worst = 0.0
  for _ in range(300):
    group = rng.integers(b)
    steps = [t for t in range(group, n, b) if rng.random() < rng.uniform(0.2, 1.0)]
    x = np.zeros((n, 4))
    for t in steps:
      v = rng.normal(size=4) if rng.random() < 0.5 else np.ones(4)  # random or aligned directions
      x[t] = v / np.linalg.norm(v) * clip * rng.uniform(0.5, 1.0)
    released = dense @ x
    if strategy.kind == "blt":
      worst = max(worst, np.linalg.norm(released) / clip)
      assert np.linalg.norm(released) <= strategy.sensitivity * clip * (1 + 1e-9)
    else:
      rows = [set(np.flatnonzero(np.abs(dense[:, t]) > 0)) for t in steps]
      for i, r in enumerate(rows):
        assert all(not r & other for other in rows[i + 1:])  # disjoint: separate Gaussian releases
      for t in steps:  # one participation's change of the release
        assert np.linalg.norm(np.outer(dense[:, t], x[t])) <= strategy.sensitivity * clip * (1 + 1e-9)
  # The stated sensitivity is attained: every participation, aligned, of the first group.
  x = np.zeros(n)
  x[0::b] = 1.0
  if strategy.kind == "blt":
    assert np.linalg.norm(dense @ x) == pytest.approx(strategy.sensitivity, rel=1e-9)
    assert worst <= strategy.sensitivity
  else:
    assert np.max(np.linalg.norm(dense, axis=0)) == pytest.approx(strategy.sensitivity, rel=1e-12)


def test_blt_sensitivity_grows_with_the_steps_released():
  """s(t) ≤ s(n) for t ≤ n (the BLT's accounting after t steps uses σ·s(n)/s(t) ≥ σ)."""
  values = [BLT.sensitivity_over(t) for t in range(1, 13)]
  assert values[0] == pytest.approx(1.0)
  assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
  assert values[-1] == pytest.approx(BLT.sensitivity)


def test_strategies_that_break_the_accounting_are_refused(tmp_path):
  with pytest.raises(PrivacyError, match="bands"):  # more bands than groups: participations overlap
    strategies.Strategy("banded", 2, 10, coefs=(0.8, 0.5, 0.3))
  rising = strategies.Strategy("blt", 2, 10, buf_decay=(0.5,), output_scale=(1.5,))  # 1, 1.5, ...
  with pytest.raises(PrivacyError, match="non-increasing"):
    rising.sensitivity_over(10)
  path = tmp_path / "s.json"
  path.write_text(json.dumps({"kind": "blt", "buf_decay": [0.5], "output_scale": [-0.2]}))
  with pytest.raises(PrivacyError, match="non-negative"):
    strategies.from_file(str(path), kind="blt", steps=10, num_bands=2)
  with pytest.raises(PrivacyError, match="noise is 'banded'"):
    strategies.from_file(str(path), kind="banded", steps=10, num_bands=2)
  with pytest.raises(ConfigError, match="does not exist"):
    strategies.from_file(str(tmp_path / "missing.json"), kind="banded", steps=10, num_bands=2)


def test_optimised_strategies_are_cached_by_their_inputs(strategy_cache, monkeypatch):
  banded = strategies.for_run("banded", steps=16, num_bands=4, cache_dir=strategy_cache, log=_quiet)
  assert len(banded.coefs) == 4 and banded.sensitivity == pytest.approx(1.0, abs=1e-6)
  blt = strategies.for_run("blt", steps=16, num_bands=2, buffers=2, cache_dir=strategy_cache, log=_quiet)
  assert blt.sensitivity == pytest.approx(blt.sensitivity_over(16))
  assert np.all(np.diff(blt.toeplitz_coefs(16)) <= 0)
  # Read back from the cache, not optimised again; another input is another file.
  def optimise_again(*args, **kwargs):
    raise RuntimeError("optimised again")

  monkeypatch.setattr(strategies, "optimize", optimise_again)
  again = strategies.for_run("banded", steps=16, num_bands=4, cache_dir=strategy_cache, log=_quiet)
  assert again.digest == banded.digest and again.coefs == banded.coefs
  assert strategies.for_run("blt", steps=16, num_bands=2, buffers=2, cache_dir=strategy_cache,
                            log=_quiet).digest == blt.digest
  with pytest.raises(RuntimeError, match="optimised again"):
    strategies.for_run("banded", steps=17, num_bands=4, cache_dir=strategy_cache, log=_quiet)
  # b = 1 banded is the identity, without optimisation.
  assert strategies.for_run("banded", steps=16, num_bands=1, cache_dir=strategy_cache).coefs == (1.0,)


# -- the noise transform ----------------------------------------------------------------------

@pytest.mark.parametrize("strategy", [BANDED, BLT], ids=["banded", "blt"])
def test_noise_has_the_strategy_s_covariance(strategy):
  """Over a window of T steps the noise of each coordinate is N(0, s² C⁻¹ C⁻ᵀ), s = σ·C·sens/(qN/b):
  the empirical covariance over the coordinates matches it (tolerance from the sample size)."""
  steps = 6
  transform = noise_lib.noise_transform(NOISY_SUM, strategy)
  draws, _ = _noise_over(transform, steps)
  std = NOISY_SUM.noise_std * strategy.sensitivity / NOISY_SUM.expected_batch_size
  inverse = np.linalg.inv(strategy.dense(steps))
  expected = std ** 2 * inverse @ inverse.T
  empirical = draws @ draws.T / draws.shape[1]
  d = draws.shape[1]
  tolerance = 5 * np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected ** 2) / d)
  assert np.all(np.abs(empirical - expected) < tolerance), (empirical, expected)
  assert np.abs(expected - np.diag(np.diag(expected))).max() > 3 * tolerance.max()  # correlated indeed


def test_identity_strategy_with_one_band_is_gaussian_noise_bit_for_bit():
  params = _params()
  updates = jax.tree.map(lambda p: jnp.full(p.shape, 0.25, jnp.float32), params)
  gaussian = noise_lib.noise_transform(NOISY_SUM)  # no strategy: the identity, kept without a state
  identity = noise_lib.noise_transform(NOISY_SUM, strategies.identity())
  assert isinstance(gaussian.init(params), optax.EmptyState)  # a Gaussian run's TrainState layout
  state = identity.init(params)
  assert state.buffers == ()  # b = 1: no history
  for t in range(3):
    key = jax.random.fold_in(jax.random.PRNGKey(7), t)
    want, _ = jax.jit(gaussian.update)(updates, gaussian.init(params), params, noise_rng=key)
    got, state = jax.jit(identity.update)(updates, state, params, noise_rng=key)
    for name in want:
      assert got[name].dtype == params[name].dtype
      np.testing.assert_array_equal(np.asarray(got[name], np.float32), np.asarray(want[name], np.float32))
  assert int(state.count) == 3


@pytest.mark.parametrize("strategy", [BANDED, BLT], ids=["banded", "blt"])
def test_resumed_noise_state_continues_exactly(strategy):
  """The state after k steps, saved (as host arrays) and restored, then m more steps: the same
  noise and state as k + m steps at once (a pure function of the keys and the state); k = 4 is
  mid-band for b = 3."""
  transform = noise_lib.noise_transform(NOISY_SUM, strategy)
  params = _params()
  whole, state = _noise_over(transform, 7, key=3, params=params)
  first, saved = _noise_over(transform, 4, key=3, params=params)
  restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), saved)
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  rest = []
  for t in range(4, 7):
    noisy, restored = jax.jit(transform.update)(zeros, restored, None,
                                                noise_rng=jax.random.fold_in(jax.random.PRNGKey(3), t))
    rest.append(np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(noisy)]))
  np.testing.assert_array_equal(np.concatenate([first, np.stack(rest)]), whole)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The state is float32 buffers shaped like the parameters, and a step counter.
  assert len(state.buffers) == strategy.state_depth and int(state.count) == 7
  for buffer in state.buffers:
    assert jax.tree.map(lambda x: (x.shape, x.dtype), buffer) == jax.tree.map(
        lambda p: (p.shape, jnp.dtype(jnp.float32)), params)


def test_stateless_apply_refuses_correlated_noise():
  transform = noise_lib.noise_transform(NOISY_SUM, BANDED)
  params = _params()
  with pytest.raises(PrivacyError, match="keeps a state"):
    noise_lib.apply(transform, params, {}, params, jax.random.PRNGKey(0))
  state = transform.init(params)
  _, state = noise_lib.apply_with_state(transform, params, {}, params, state, jax.random.PRNGKey(0))
  assert int(state.count) == 1
  with pytest.raises(PrivacyError, match="adaptive DP"):
    transform.update(params, state, params, noise_rng=jax.random.PRNGKey(1), noise_scale=0.5)
  # The former names: thin aliases of the one constructor (`correlated_noise` moved to `noise`).
  with pytest.raises(PrivacyError, match="needs a strategies.Strategy"):
    noise_lib.correlated_noise(NOISY_SUM, None)
  with pytest.warns(DeprecationWarning, match="moved to private_t5.dp.noise"):
    from private_t5.dp import correlated_noise as old_home  # pylint: disable=import-outside-toplevel
    assert old_home.correlated_noise is noise_lib.correlated_noise


# -- cyclic Poisson sampling ------------------------------------------------------------------

def test_cyclic_sampler_with_one_group_is_the_poisson_sampler():
  cyclic = CyclicPoissonSampler(5000, 0.02, 1, seed=9)
  poisson = PoissonSampler(5000, 0.02, None, seed=9)
  for t in range(30):
    np.testing.assert_array_equal(cyclic.indices_for_step(t), poisson.indices_for_step(t))
  assert cyclic.expected_batch_size == poisson.expected_batch_size


def test_cyclic_sampler_samples_each_example_only_in_its_group_s_steps_at_rate_q():
  n, q, b, steps = 3000, 0.1, 4, 800
  sampler = CyclicPoissonSampler(n, q, b, seed=21)
  groups = sampler.group_of(np.arange(n))
  sizes = np.bincount(groups, minlength=b)
  assert abs(sizes - n / b).max() < 5 * math.sqrt(n / b)  # an independent uniform partition
  counts = np.zeros(n)
  for t in range(steps):
    idx = sampler.indices_for_step(t)
    assert np.all(groups[idx] == t % b) and np.all(np.diff(idx) > 0)
    counts[idx] += 1
  rate = counts / (steps / b)  # each example is eligible in steps/b steps
  assert abs(rate.mean() - q) < 5 * math.sqrt(q * (1 - q) / (n * steps / b))
  assert sampler.expected_batch_size == pytest.approx(q * n / b)
  # Another seed, another partition.
  assert np.mean(CyclicPoissonSampler(n, q, b, seed=22).group_of(np.arange(n)) == groups) < 0.35


def test_cyclic_sampler_is_independent_of_the_microbatch_size_and_o_of_the_sample():
  dp = DPConfig(noise="banded", num_bands=4, noise_multiplier=1.0, vocab_is_public=True)
  samples = []
  for microbatch in (None, 8, 3):
    m = build_mechanism(dp, ExecutionSettings(microbatch_size=microbatch), loss_fn=lambda *a: 0.0,
                        num_examples=4000, privacy_unit="document", batch_size=16, train_steps=8, sampler_seed=5,
                        log=_quiet)
    samples.append([m.indices_for_step(t).tolist() for t in range(8)])
  assert samples[0] == samples[1] == samples[2]
  # At C4's scale (N = 3.65e8, q·N/b = 4096) a step costs O(q N), not O(N).
  big = CyclicPoissonSampler(365_000_000, 4 * 4096 / 365_000_000, 4, seed=1)
  import time  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  sizes = [len(big.indices_for_step(t)) for t in range(20)]
  assert (time.perf_counter() - start) / 20 < 0.05  # ~1 ms on one core; O(N) would take seconds
  assert abs(np.mean(sizes) - 4096) < 5 * math.sqrt(4096 / 20)


# -- accounting -------------------------------------------------------------------------------

def test_banded_event_is_dp_sgd_over_the_participations():
  event = accounting.banded_dp_event(0.9, 0.03, 100, 4)
  assert event == accounting.make_dp_event(0.9, 0.03, 25)
  assert accounting.banded_dp_event(0.9, 0.03, 101, 4) == accounting.make_dp_event(0.9, 0.03, 26)


@pytest.mark.parametrize("num_bands", [1, 3])
def test_epsilon_equals_jax_privacy_s_own_accountant(num_bands):
  """Our ledger's ε for a banded run = jax-privacy's BandMFExecutionPlanConfig (independent
  partition, add/remove-one PLD and RDP accountants) for the same σ, q, steps and b."""
  from jax_privacy import batch_selection  # pylint: disable=g-import-not-at-top
  from jax_privacy.experimental import execution_plan  # pylint: disable=g-import-not-at-top
  sigma, q, steps, delta = 1.1, 0.02, 60, 1e-6
  coefs = (1.0,) if num_bands == 1 else (0.8, 0.5, 0.33)
  relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  ledger = PrivacyLedger.create(
      noise_multiplier=sigma, clip_norm=1.0, delta=delta, num_examples=10_000, sampling_rate=q, accountant="auto",
      noise="banded", strategy=strategies.Strategy("banded", num_bands, steps, coefs=coefs))
  ledger.record_steps(steps)
  ours = ledger.epsilons()
  for name, accountant in (("pld", dp_accounting.pld.PLDAccountant(
      relation, value_discretization_interval=accounting.PLD_VALUE_DISCRETIZATION_INTERVAL)),
                           ("rdp", dp_accounting.rdp.RdpAccountant(neighboring_relation=relation))):
    plan = execution_plan.BandMFExecutionPlanConfig(
        iterations=steps, strategy=np.asarray(coefs), noise_multiplier=sigma, epsilon=None, delta=None,
        sampling_prob=q, partition_type=batch_selection.PartitionType.INDEPENDENT, accountant=accountant).plan
    theirs = accountant.compose(plan.dp_event).get_epsilon(delta)
    assert ours[name] == pytest.approx(theirs, rel=1e-9), name
    assert plan.batch_selection_strategy.cycle_length == num_bands
  if num_bands == 1:  # b = 1 is DP-SGD: the Gaussian ledger's ε
    gaussian = PrivacyLedger.create(noise_multiplier=sigma, clip_norm=1.0, delta=delta, num_examples=10_000,
                                    sampling_rate=q, accountant="auto")
    gaussian.record_steps(steps)
    assert gaussian.epsilons() == ours


def test_one_band_mechanism_is_today_s_mechanism():
  """DPConfig(noise="banded", num_bands=1) builds DP-SGD: the same sample, σ, divisor and ε."""
  kw = dict(loss_fn=lambda *a: 0.0, num_examples=5000, privacy_unit="document", batch_size=25, train_steps=40,
            sampler_seed=3, log=_quiet)
  gaussian = build_mechanism(DPConfig(target_epsilon=2.0, vocab_is_public=True), ExecutionSettings(), **kw)
  banded = build_mechanism(DPConfig(target_epsilon=2.0, noise="banded", vocab_is_public=True),
                           ExecutionSettings(), **kw)
  assert banded.noise_multiplier == gaussian.noise_multiplier
  assert banded.clipped_sum.noisy_sum == gaussian.clipped_sum.noisy_sum
  for t in range(5):
    np.testing.assert_array_equal(banded.indices_for_step(t), gaussian.indices_for_step(t))
  for m in (banded, gaussian):
    m.ledger.record_steps(40)
  assert banded.ledger.epsilons() == gaussian.ledger.epsilons()
  assert banded.ledger.training_epsilon() <= 2.0


def test_blt_accounting_is_one_gaussian_release_scaled_by_the_sensitivity_ratio():
  ledger = PrivacyLedger.create(noise_multiplier=2.0, clip_norm=1.0, delta=1e-6, num_examples=1000,
                                sampling_rate=0.06, accountant="pld", noise="blt", strategy=BLT)
  ledger.record_steps(5)
  ratio = BLT.sensitivity / BLT.sensitivity_over(5)
  assert ratio > 1.0
  assert ledger.training_event() == dp_accounting.GaussianDpEvent(2.0 * ratio)
  acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=accounting.PLD_VALUE_DISCRETIZATION_INTERVAL)
  assert ledger.training_epsilon() == pytest.approx(acc.compose(dp_accounting.GaussianDpEvent(2.0 * ratio))
                                                    .get_epsilon(1e-6), rel=1e-12)
  ledger.record_steps(7)  # all n steps: one Gaussian of multiplier σ
  assert ledger.training_epsilon() == pytest.approx(accounting.gaussian_epsilon(2.0, 1e-6), rel=2e-2)
  # A target ε is calibrated by the same event.
  sigma = accounting.calibrate_correlated("blt", 1.5, 0.06, 12, 1e-6, num_bands=3, accountant="auto")
  assert min(accounting.correlated_epsilons("blt", sigma, 0.06, 12, 1e-6, num_bands=3).values()) <= 1.5 + 1e-6


# -- the ledger and the report ----------------------------------------------------------------

def _correlated_ledger(**overrides):
  kw = dict(noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, num_examples=3000, sampling_rate=0.03,
            accountant="auto", noise="banded", strategy=BANDED)
  kw.update(overrides)
  return PrivacyLedger.create(**kw)


def test_ledger_round_trips_and_refuses_a_changed_strategy_on_resume():
  ledger = _correlated_ledger()
  assert ledger.expected_batch_size == pytest.approx(0.03 * 3000 / 3)  # q·N/b
  ledger.record_steps(5)
  back = PrivacyLedger.from_dict(json.loads(json.dumps(ledger.report())))
  assert back.to_dict() == ledger.to_dict() and back.training_epsilon() == ledger.training_epsilon()
  report = ledger.report()
  assert report["noise"] == "banded" and report["num_bands"] == 3 and report["sensitivity"] == BANDED.sensitivity
  assert report["strategy_digest"] == BANDED.digest == report["strategy"]["digest"]
  assert report["strategy"]["coefs"] == list(BANDED.coefs) and "banded matrix factorization" in report["mechanism"]
  resumed = _correlated_ledger().resume_from(back)
  assert resumed.steps == 5
  other_coefs = strategies.Strategy("banded", 3, 12, coefs=(0.8, 0.5, 0.3))
  other_b = strategies.Strategy("banded", 4, 12, coefs=BANDED.coefs)
  for changed in (_correlated_ledger(strategy=other_coefs), _correlated_ledger(strategy=other_b),
                  PrivacyLedger.create(noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, num_examples=3000,
                                       sampling_rate=0.03, accountant="auto")):
    with pytest.raises(PrivacyError, match="cannot resume"):
      changed.resume_from(back)
  # A tampered record is refused when read.
  tampered = json.loads(json.dumps(ledger.to_dict()))
  tampered["strategy"]["coefs"][0] = 0.9
  with pytest.raises(DataError, match="digest"):
    PrivacyLedger.from_dict(tampered)
  tampered = json.loads(json.dumps(ledger.to_dict()))
  tampered["strategy"]["sensitivity"] = 0.5
  with pytest.raises(DataError, match="sensitivity"):
    PrivacyLedger.from_dict(tampered)


def test_the_noise_kind_is_parsed_once_and_reads_as_its_string():
  """DPConfig.noise (a Gin string) and a ledger's noise (a JSON string) become a `NoiseKind`, which
  equals, prints, formats and writes as the string; the ledger's JSON holds the plain string."""
  dp = DPConfig(noise_multiplier=1.0, noise="banded", num_bands=3)
  assert dp.noise is NoiseKind.BANDED and dp.noise == "banded" and dp.correlated
  assert (str(dp.noise), f"{dp.noise}", repr(dp.noise), json.dumps([dp.noise])) == ("banded",) * 2 + ("'banded'", '["banded"]')
  assert DPConfig(noise_multiplier=1.0).noise is NoiseKind.GAUSSIAN and not DPConfig(noise_multiplier=1.0).correlated
  with pytest.raises(PrivacyError, match=r"^DPConfig.noise must be one of \('gaussian', 'banded', 'blt'\), got 'x'$"):
    DPConfig(noise_multiplier=1.0, noise="x")
  ledger = _correlated_ledger()
  assert ledger.noise is NoiseKind.BANDED and type(ledger.to_dict()["noise"]) is str  # pylint: disable=unidiomatic-typecheck
  assert PrivacyLedger.from_dict(json.loads(json.dumps(ledger.to_dict()))).noise is NoiseKind.BANDED
  assert BANDED.kind is NoiseKind.BANDED and strategies.CORRELATED == ("banded", "blt")


def test_gaussian_ledger_json_has_no_correlated_fields():
  ledger = PrivacyLedger.create(noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, num_examples=3000,
                                batch_size=30)
  ledger.record_steps(3)
  assert not {"noise", "num_bands", "strategy", "mechanism", "strategy_digest"} & set(ledger.report())
  assert PrivacyLedger.from_dict(ledger.to_dict()).to_dict() == ledger.to_dict()


def test_correlated_training_composes_with_a_dp_vocabulary_by_events(tmp_path):
  from private_t5.dp import privacy_report  # pylint: disable=g-import-not-at-top
  vocab = tmp_path / "dp.model"
  vocab.write_bytes(b"a dp vocabulary")
  params = accounting.thresholded_gaussian_parameters(1e-8, l2=8.0, linf=1.0, max_distinct=64, target_epsilon=3.0)
  report = privacy_report.vocabulary_report(params, model_bytes=b"a dp vocabulary", insecure_seed=None)
  path = privacy_report.write_report(privacy_report.vocabulary_report_path(str(vocab)), report)
  for strategy in (BANDED, BLT):
    ledger = _correlated_ledger(noise=strategy.kind, strategy=strategy, delta=1e-8, accountant="pld")
    ledger.add_vocabulary(str(vocab), path)
    ledger.record_steps(9)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=accounting.PLD_VALUE_DISCRETIZATION_INTERVAL)
    acc.compose(ledger.training_event("pld")).compose(dp_accounting.GaussianDpEvent(params["noise_multiplier"]))
    by_events = ledger.epsilon_by_events()
    assert by_events == pytest.approx(acc.get_epsilon(1e-8 + params["delta_gaussian"]), rel=1e-9)
    assert by_events < ledger.epsilon_by_addition() and ledger.total_epsilon() == by_events


# -- configuration, the epsilon command, the refusals ------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(noise="laplace"), "DPConfig.noise"),
    (dict(noise="banded", num_bands=0), "num_bands"),
    (dict(num_bands=4), "settings of correlated noise"),
    (dict(buffers=3), "settings of correlated noise"),
    (dict(noise="banded", num_bands=2, sampling="poisson_truncated"), "untruncated"),
    (dict(noise="banded", buffers=3), "setting of noise='blt'"),
    (dict(noise="blt", buffers=16), "buffers"),
])
def test_bad_correlated_settings_fail_in_one_line(kwargs, match):
  with pytest.raises(PrivacyError, match=match) as e:
    DPConfig(noise_multiplier=1.0, **kwargs)
  assert "\n" not in str(e.value)


def test_build_mechanism_refuses_groups_that_cannot_hold_the_batch():
  with pytest.raises(PrivacyError, match="exceeds N"):
    build_mechanism(DPConfig(noise="banded", num_bands=8, noise_multiplier=1.0), ExecutionSettings(),
                    loss_fn=lambda *a: 0.0, num_examples=100, privacy_unit="document", batch_size=20,
                    train_steps=16, sampler_seed=0, log=_quiet)
  with pytest.raises(PrivacyError, match="exceeds train_steps"):
    build_mechanism(DPConfig(noise="banded", num_bands=8, noise_multiplier=1.0), ExecutionSettings(),
                    loss_fn=lambda *a: 0.0, num_examples=1000, privacy_unit="document", batch_size=2,
                    train_steps=4, sampler_seed=0, log=_quiet)


def test_adaptive_dp_and_jft_refuse_correlated_noise(tmp_path):
  from private_t5.selective import adaptive_train, jft  # pylint: disable=g-import-not-at-top
  banded = DPConfig(noise="banded", num_bands=2, noise_multiplier=1.0)
  require_gaussian(DPConfig(noise_multiplier=1.0), "x")
  require_gaussian(None, "x")
  with pytest.raises(PrivacyError, match="adaptive DP.*noise='gaussian'"):
    adaptive_train.train_adaptive(reference_model_dir="ref", model_config=object(), train_data=object(),
                                  model_dir=str(tmp_path), train_steps=2, batch_size=2, dp=banded)
  with pytest.raises(PrivacyError, match="JFT.*noise='gaussian'"):
    jft.just_fine_tune_twice(model_dir=str(tmp_path), redacted_data=None, full_data=None, phase1_steps=1,
                             phase2_steps=1, phase2_dp=banded)


def _epsilon_cli(capsys, argv):
  assert cli.main(["epsilon"] + argv) == 0
  return json.loads(capsys.readouterr().out)


def test_epsilon_command_accounts_correlated_noise(capsys):
  plan = ["--noise_multiplier=1.0", "--batch_size=50", "--num_examples=10000", "--steps=64", "--delta=1e-5"]
  banded = _epsilon_cli(capsys, plan + ["--noise=banded", "--num_bands=4"])
  assert banded["noise"] == "banded" and "banded matrix factorization" in banded["mechanism"]
  assert banded["sampling_rate"] == pytest.approx(0.02) and banded["expected_batch_size"] == pytest.approx(50)
  # = DP-SGD at q = b·batch/N over ceil(64/4) = 16 steps.
  dpsgd = _epsilon_cli(capsys, ["--noise_multiplier=1.0", "--sampling_rate=0.02", "--steps=16", "--delta=1e-5"])
  assert banded["epsilon"] == dpsgd["epsilon"] and dpsgd["noise"] == "gaussian"
  target = _epsilon_cli(capsys, ["--target_epsilon=2", "--batch_size=50", "--num_examples=10000", "--steps=64",
                                 "--delta=1e-5", "--noise=blt", "--num_bands=4", "--buffers=3"])
  assert "BLT" in target["mechanism"] and target["epsilon"] <= 2.0 + 1e-6
  assert target["noise_multiplier"] == pytest.approx(accounting.calibrate_gaussian(2.0, 1e-5), rel=1e-2)
  assert cli.main(["epsilon"] + plan + ["--num_bands=4"]) == 2
  assert cli.main(["epsilon"] + plan + ["--noise=banded", "--num_bands=2", "--max_batch_size=80"]) == 2
  assert "error:" in capsys.readouterr().err


def test_pretrain_banded_config_binds_banded_noise_over_pretrain_gin():
  import gin  # pylint: disable=g-import-not-at-top
  from private_t5.stages import gin_utils  # pylint: disable=g-import-not-at-top
  gin_utils.parse(["configs/models/t5_1_0_tiny.gin", "configs/runs/pretrain_banded.gin"],
                  ['MODEL_DIR="/tmp/x"', "TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 4}", "TRAIN_STEPS=3",
                   'CORPUS="c.jsonl"', 'VOCAB_PATH="v.model"'], entry="train")
  try:
    dp = gin.get_configurable(DPConfig)()
  finally:
    gin.clear_config()
  assert (dp.noise, dp.num_bands, dp.target_epsilon, dp.sampling) == ("banded", 4, 8.0, "poisson")


def test_banded_run_end_to_end_on_a_micro_model(shared_data, tmp_path):
  """`private-t5 train` of a micro T5 with banded noise (b = 2): the trainer threads the noise
  state; the report names the mechanism and accounts the amplified event of the steps taken."""
  from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab  # pylint: disable=g-import-not-at-top
  from private_t5.stages import train as train_stage  # pylint: disable=g-import-not-at-top
  corpus, vocab = fortunes_corpus_and_vocab(shared_data, str(tmp_path))
  model_dir = tmp_path / "model"
  train_stage.run_from_args([
      "--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}", f"--gin.CORPUS={corpus}",
      f"--gin.VOCAB_PATH={vocab}", f"--gin.DATA_CACHE_DIR={tmp_path / 'cache'}", *MICRO_TRAIN_ARGS,
      "--gin.VOCAB_IS_PUBLIC=True", "--gin.TRAIN_STEPS=4", "--gin.DPConfig.noise='banded'",
      "--gin.DPConfig.num_bands=2", "--gin.DPConfig.expected_batch_size=4.0", "--gin.train.eval_every=100"])
  report = json.loads((model_dir / "privacy_report.json").read_text())
  assert report["noise"] == "banded" and report["num_bands"] == 2 and report["steps"] == 4
  assert "banded matrix factorization, 2 bands" in report["mechanism"] and len(report["strategy_digest"]) == 64
  expected = accounting.correlated_epsilons("banded", 1.0, report["sampling_rate"], 4, report["delta"], num_bands=2)
  assert report["training_epsilon"] == min(expected.values())
  assert report["expected_batch_size"] == pytest.approx(4.0)
