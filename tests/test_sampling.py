"""Statistical and contract tests of the batch samplers (fixed seeds: deterministic)."""
import math

import numpy as np
import pytest
import scipy.stats
from dp_accounting import dp_event

from private_t5.dp import accounting
from private_t5.dp import truncation
from private_t5.dp import sampling as sampling_lib
from private_t5.dp.config import BatchLayout, DPConfig, ExecutionSettings
from private_t5.dp.mechanism import build_mechanism
from private_t5.dp.sampling import PoissonSampler, ShuffledBatchSampler
from private_t5.errors import ConfigError, PrivacyError


def _inclusion_matrix(sampler, steps):
  """bool[steps, N]: whether example j is in the batch of step t."""
  m = np.zeros((steps, sampler.num_examples), bool)
  for t in range(steps):
    m[t, sampler.indices_for_step(t)] = True
  return m


def test_poisson_inclusion_rate_is_q():
  n, q, steps = 2000, 0.03, 600
  sampler = PoissonSampler(n, q, max_batch_size=n, seed=11)
  m = _inclusion_matrix(sampler, steps)
  total = m.sum()
  # Total inclusions ~ Binomial(steps * N, q).
  sd = math.sqrt(steps * n * q * (1 - q))
  assert abs(total - steps * n * q) < 5 * sd
  # Every example has the same rate: per-example counts ~ Binomial(steps, q) (chi-square).
  counts = m.sum(axis=0)
  expected_var = steps * q * (1 - q)
  chi2 = ((counts - steps * q) ** 2 / expected_var).sum()
  assert scipy.stats.chi2.sf(chi2, df=n) > 1e-4
  # Batch sizes ~ Binomial(N, q): mean and variance.
  sizes = m.sum(axis=1)
  assert abs(sizes.mean() - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
  assert 0.75 < sizes.var() / (n * q * (1 - q)) < 1.3


def test_poisson_steps_are_independent():
  n, q, steps = 1000, 0.05, 800
  sampler = PoissonSampler(n, q, max_batch_size=n, seed=5)
  m = _inclusion_matrix(sampler, steps).astype(float)
  # P[j in step t and in step t+1] = q^2 for independent steps.
  joint = (m[:-1] * m[1:]).mean()
  sd = math.sqrt(q * q * (1 - q * q) / ((steps - 1) * n))
  assert abs(joint - q * q) < 6 * sd, (joint, q * q)
  # Consecutive batch sizes are uncorrelated.
  sizes = m.sum(axis=1)
  r = np.corrcoef(sizes[:-1], sizes[1:])[0, 1]
  assert abs(r) < 5 / math.sqrt(steps)
  # Within a step, two examples are included independently (no fixed-size coupling).
  pair = (m[:, 0:500] * m[:, 500:1000]).mean()
  assert abs(pair - q * q) < 6 * math.sqrt(q * q / (steps * 500))


def test_poisson_is_deterministic_in_seed_and_step():
  a = PoissonSampler(10_000, 0.01, 500, seed=3)
  b = PoissonSampler(10_000, 0.01, 500, seed=3)  # e.g. rebuilt after a resume
  for step in (0, 1, 17, 10_000):
    np.testing.assert_array_equal(a.indices_for_step(step), b.indices_for_step(step))
  # Random access: asking for step 17 first gives the same batch as iterating up to it.
  c = PoissonSampler(10_000, 0.01, 500, seed=3)
  np.testing.assert_array_equal(c.indices_for_step(17), a.indices_for_step(17))
  other = PoissonSampler(10_000, 0.01, 500, seed=4)
  assert not np.array_equal(a.indices_for_step(1), other.indices_for_step(1))
  assert not np.array_equal(a.indices_for_step(1), a.indices_for_step(2))


def test_poisson_indices_are_sorted_unique_in_range():
  sampler = PoissonSampler(5000, 0.2, 2000, seed=1)
  for step in range(20):
    idx = sampler.indices_for_step(step)
    assert idx.dtype == np.int64
    assert (np.diff(idx) > 0).all()
    assert idx.min() >= 0 and idx.max() < 5000


def test_poisson_huge_population_is_cheap():
  # The paper's N: the count is drawn from Binomial(N, q), then a uniform subset.
  n = 5_240_387_307
  sampler = PoissonSampler(n, 8192 / n, max_batch_size=9000, seed=0)
  idx = sampler.indices_for_step(123)
  assert abs(len(idx) - 8192) < 6 * math.sqrt(8192)
  assert idx.max() < n and len(np.unique(idx)) == len(idx)
  assert sampler.truncation_probability < 1e-15


def test_truncation_probability_matches_empirical_rate():
  n, q, cap = 1000, 0.05, 55
  sampler = PoissonSampler(n, q, max_batch_size=cap, seed=9)
  p = sampler.truncation_probability
  # The add-one neighbour's tail (N + 1 examples): the δ cost the accounting charges.
  np.testing.assert_allclose(p, scipy.stats.binom.sf(cap, n + 1, q))
  assert p == truncation.truncation_probability(n, q, cap)
  assert 0.1 < p < 0.4
  steps = 3000
  truncated = 0
  for t in range(steps):
    size = len(sampler.indices_for_step(t))
    assert size <= cap
    truncated += sampler.sample_size(t) > cap
    # A truncated step is exactly full; an untruncated one has the Poisson count.
    if sampler.sample_size(t) > cap:
      assert size == cap
    else:
      assert size == sampler.sample_size(t)
  assert abs(truncated / steps - p) < 5 * math.sqrt(p * (1 - p) / steps)
  np.testing.assert_allclose(sampler.truncation_probability_over(10), 1 - (1 - p) ** 10)


def test_default_cap_meets_the_truncation_bound():
  n, q = 100_000, 0.01
  m = truncation.max_batch_size_for(n, q, 1e-6)
  assert scipy.stats.binom.sf(m, n + 1, q) <= 1e-6 < scipy.stats.binom.sf(m - 1, n + 1, q)
  sampler = PoissonSampler.from_expected_batch_size(n, 1000, seed=0)
  assert sampler.max_batch_size == m and sampler.expected_batch_size == pytest.approx(1000)
  assert sampler.padded_batch_size == m


def test_dp_event_describes_the_sampler():
  sampler = PoissonSampler(1000, 0.05, 55, seed=0)
  event = accounting.make_dp_event(1.1, sampler.sampling_rate, 10, num_examples=sampler.num_examples,
                                   max_batch_size=sampler.max_batch_size)
  assert isinstance(event, dp_event.SelfComposedDpEvent) and event.count == 10
  assert event.event == dp_event.TruncatedSubsampledGaussianDpEvent(1000, 0.05, 55, 1.1)
  plain = accounting.make_dp_event(1.1, sampler.sampling_rate, 10)
  assert plain.event == dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.1))
  # A cap of N: truncation probability 0 (underflows), the plain Poisson event.
  untruncated = accounting.make_dp_event(1.1, 0.05, 3, num_examples=1000, max_batch_size=1000)
  assert isinstance(untruncated.event, dp_event.PoissonSampledDpEvent)


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan")])
def test_bad_sampling_rate_is_refused(q):
  with pytest.raises(PrivacyError, match="sampling_rate"):
    PoissonSampler(100, q, 10, seed=0)


def test_bad_poisson_sizes_are_refused():
  with pytest.raises(PrivacyError, match="num_examples"):
    PoissonSampler(0, 0.1, 10, seed=0)
  with pytest.raises(PrivacyError, match="max_batch_size"):
    PoissonSampler(100, 0.1, 0, seed=0)
  with pytest.raises(PrivacyError, match="expected_batch_size"):
    PoissonSampler.from_expected_batch_size(100, 200, seed=0)
  with pytest.raises(ConfigError, match="step"):
    PoissonSampler(100, 0.1, 10, seed=0).indices_for_step(-1)


def test_q_equal_one_takes_everything():
  sampler = PoissonSampler(50, 1.0, 50, seed=0)
  np.testing.assert_array_equal(sampler.indices_for_step(4), np.arange(50))


def test_shuffled_batches_cover_each_epoch_once():
  n, b = 103, 10
  sampler = ShuffledBatchSampler(n, b, seed=2)
  assert not sampler.is_poisson and sampler.padded_batch_size == b
  assert sampler.steps_per_epoch == 10
  epoch0 = [sampler.indices_for_step(t) for t in range(10)]
  assert all(len(x) == b for x in epoch0)
  seen = np.concatenate(epoch0)
  assert len(np.unique(seen)) == 100  # no repeats within an epoch, 3 left over
  epoch1 = np.concatenate([sampler.indices_for_step(t) for t in range(10, 20)])
  assert not np.array_equal(seen, epoch1)
  again = ShuffledBatchSampler(n, b, seed=2)
  np.testing.assert_array_equal(again.indices_for_step(13), sampler.indices_for_step(13))


def test_shuffled_batches_are_those_of_an_int64_permutation():
  # The permutation is held in int32 (4 bytes an example); its batches are those of
  # `rng.permutation(N)` (int64) for the same seed and epoch.
  for n, b, seed in ((103, 10, 2), (1, 1, 0), (5000, 64, 7), (2**16 + 3, 1000, 1)):
    sampler = ShuffledBatchSampler(n, b, seed=seed)
    for step in (0, sampler.steps_per_epoch - 1, sampler.steps_per_epoch, 3 * sampler.steps_per_epoch + 1):
      epoch, j = divmod(step, sampler.steps_per_epoch)
      reference = np.random.default_rng([sampling_lib._SHUFFLE_STREAM, seed, epoch]).permutation(n)
      got = sampler.indices_for_step(step)
      assert got.dtype == np.int64
      np.testing.assert_array_equal(got, reference[j * b:(j + 1) * b])
    assert sampler._cached_permutation.dtype == np.int32


def test_shuffled_bad_sizes_are_refused():
  with pytest.raises(ConfigError, match="larger than the dataset"):
    ShuffledBatchSampler(5, 6, seed=0)
  with pytest.raises(ConfigError, match="batch_size"):
    ShuffledBatchSampler(5, 0, seed=0)


def test_untruncated_sizes_are_exactly_binomial():
  """No cap: the sample sizes over many steps are Binomial(N, q) (mean, variance, chi-square)."""
  n, q, steps = 500, 0.04, 4000
  sampler = PoissonSampler(n, q, max_batch_size=None, seed=5)
  assert not sampler.truncated and sampler.truncation_probability == 0.0
  sizes = np.array([len(sampler.indices_for_step(t)) for t in range(steps)])
  mean, var = n * q, n * q * (1 - q)
  assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / steps)
  assert abs(sizes.var() - var) < 0.1 * var
  assert sizes.max() > mean + 2 * math.sqrt(var)  # the upper tail is there: nothing is cut
  # Chi-square over bins of the Binomial pmf (tails pooled so every bin expects >= 5).
  edges = np.arange(int(mean - 2 * math.sqrt(var)), int(mean + 2 * math.sqrt(var)) + 1)
  cdf = scipy.stats.binom.cdf(edges, n, q)
  expected = np.diff(np.concatenate([[0.0], cdf[:-1], [1.0]])) * steps
  observed = np.array([np.sum(sizes <= edges[0])] +
                      [np.sum((sizes > a) & (sizes <= b)) for a, b in zip(edges[:-2], edges[1:-1])] +
                      [np.sum(sizes > edges[-2])])
  assert expected.min() >= 5 and observed.sum() == steps
  assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3


def test_every_sampled_example_runs_in_exactly_one_microbatch():
  sampler = PoissonSampler(300, 0.05, max_batch_size=None, seed=2)
  layout = BatchLayout(batch_rows=4, variable_rows=True, microbatch_size=4)
  for t in range(200):
    indices = sampler.indices_for_step(t)
    rows = layout.rows_for_step(len(indices))
    assert rows % 4 == 0 and 0 <= rows - len(indices) <= 3  # at most m - 1 padding rows
    slots = np.full(rows, -1)
    slots[:len(indices)] = indices
    chunks = [slots[i:i + 4] for i in range(0, rows, 4)]
    seen = np.concatenate(chunks) if chunks else np.array([], int)
    real = seen[seen >= 0]
    assert sorted(real.tolist()) == sorted(indices.tolist()) and len(set(real.tolist())) == len(real)
  # Untruncated, no batch has a fixed size: a step's rows follow its sample.
  assert layout.rows_for_step(0) == 0 and sampler.padded_batch_size is None


def test_untruncated_resume_draws_the_same_samples():
  """The sample of step t is a function of (seed, t): a resumed sampler continues the sequence."""
  a = PoissonSampler(1000, 0.02, max_batch_size=None, seed=9)
  first = [a.indices_for_step(t) for t in range(20)]
  b = PoissonSampler(1000, 0.02, max_batch_size=None, seed=9)
  for t in range(10, 20):
    np.testing.assert_array_equal(b.indices_for_step(t), first[t])


@pytest.mark.parametrize("sampling", ["poisson", "poisson_truncated", None])
def test_the_sampler_does_not_depend_on_the_microbatch_size(sampling):
  """Microbatching is an execution setting: the mechanism built with any microbatch size draws
  the same samples (and the sampler has no microbatch setting at all)."""
  dp = None if sampling is None else DPConfig(noise_multiplier=1.0, expected_batch_size=3, sampling=sampling)
  draws = []
  for m in (None, 2, 4, 16):
    mechanism = build_mechanism(dp, ExecutionSettings(microbatch_size=m), loss_fn=lambda *a: None,
                                num_examples=4000, privacy_unit="document", batch_size=16, train_steps=10,
                                sampler_seed=7, log=lambda _: None)
    assert "microbatch_size" not in vars(mechanism.sampler)
    draws.append([mechanism.indices_for_step(t) for t in range(12)])
  for other in draws[1:]:
    for want, got in zip(draws[0], other):
      np.testing.assert_array_equal(got, want)
