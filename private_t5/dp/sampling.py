"""Batch samplers over the N indexed examples of an `ExampleSource`.

Samplers are stateless in the step: `indices_for_step(step)` is a pure function of
(seed, step), so the data position of a run is just its step counter and a resumed run draws
exactly the batches an uninterrupted one would have drawn. The returned indices are unpadded;
`ExampleSource.get_batch(indices, seed, batch_size=rows)` pads them to the step's rows
(`mechanism.BatchLayout.rows_for_step`; padding rows have `example_weight` 0): a fixed shape,
so XLA compiles the train step once. Samplers know nothing about microbatches: how a sample is
cut into compiled batches is an execution setting (`mechanism.BatchLayout`).

* `PoissonSampler` (for DP): each example joins each step independently with probability q;
  the privacy accounting (`accounting.make_dp_event`, PoissonSampled / TruncatedSubsampledGaussian
  events) assumes exactly this (DP rule "sampling matches accounting"). Untruncated (the default
  for DP training), every sampled example is returned, whatever their number; truncated, a
  sample is capped at `max_batch_size` rows. Truncation probabilities and caps come from `truncation`
  (`truncation_probability`, `max_batch_size_for`).
* `CyclicPoissonSampler` (for correlated-noise DP, `strategies`): the examples are split into b
  groups by a keyed hash of (secret seed, index), an independent uniform partition; step t samples
  only group t mod b, each of its examples independently with probability q (Choquette-Choo et
  al. 2023's cyclic Poisson sampling; jax-privacy's `CyclicPoissonSampling` with
  `PartitionType.INDEPENDENT`, the partition that matches the add/remove-one relation). b = 1 is
  `PoissonSampler`.
* `ShuffledBatchSampler` (non-private): an epoch-wise random permutation cut into fixed-size
  batches. It is NOT Poisson sampling: a DP run must refuse it, or account it as sampling
  without replacement / shuffling, never as Poisson.

The sampling seed of a DP run must be secret (amplification by sampling assumes the
adversary does not know which examples were drawn): draw it from OS entropy, as for the noise
key, and keep it only in the (private) checkpoint.
"""
from typing import Optional

import numpy as np

from private_t5.dp import privacy_params
from private_t5.dp import truncation
from private_t5.errors import ConfigError, PrivacyError
from private_t5.hashing import mix64

# Domain separation: the same integer seed never yields the same stream in two samplers.
_POISSON_STREAM = 0x5053  # "PS"
_SHUFFLE_STREAM = 0x5342  # "SB"
_GROUP_STREAM = 0x4347  # "CG": the keys of the cyclic groups' hash


def _check_step(step: int) -> int:
  step = int(step)
  if step < 0:
    raise ConfigError(f"step must be >= 0, got {step}")
  return step


class ShuffledBatchSampler:
  """Non-private fixed-size batches: a fresh random permutation of the N examples each epoch.

  Batch `step` is slice `[j * B, (j + 1) * B)` of epoch `step // steps_per_epoch`'s
  permutation (j = step mod steps_per_epoch); the last N mod B examples of each permutation
  are skipped so that every batch has exactly B real rows.
  """

  is_poisson = False
  scheme = privacy_params.Sampling.FIXED

  def __init__(self, num_examples: int, batch_size: int, seed: int):
    num_examples, batch_size = int(num_examples), int(batch_size)
    if num_examples <= 0:
      raise ConfigError(f"num_examples must be > 0, got {num_examples}")
    if batch_size <= 0:
      raise ConfigError(f"batch_size must be > 0, got {batch_size}")
    if batch_size > num_examples:
      raise ConfigError(f"batch_size={batch_size} is larger than the dataset "
                        f"({num_examples} examples)")
    self.num_examples = num_examples
    self.batch_size = batch_size
    self.seed = int(seed)
    self.steps_per_epoch = num_examples // batch_size
    self._cached_epoch = None
    self._cached_permutation = None

  @property
  def padded_batch_size(self) -> int:
    """Rows of every batch (the fixed shape the train step compiles for)."""
    return self.batch_size

  @property
  def expected_batch_size(self) -> float:
    return float(self.batch_size)

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch != self._cached_epoch:
      rng = np.random.default_rng([_SHUFFLE_STREAM, self.seed, epoch])
      # `rng.permutation(N)` shuffles an int64 arange in place; the smallest dtype that holds N
      # draws the same swaps (Generator.shuffle's draws depend on the length only): the same
      # permutation in 4 bytes an example below 2^31.
      perm = np.arange(self.num_examples, dtype=np.int32 if self.num_examples < 2**31 else np.int64)
      rng.shuffle(perm)
      self._cached_permutation = perm
      self._cached_epoch = epoch
    return self._cached_permutation

  def indices_for_step(self, step: int) -> np.ndarray:
    """Example indices (int64[batch_size]) of batch `step`."""
    epoch, j = divmod(_check_step(step), self.steps_per_epoch)
    perm = self._permutation(epoch)
    return perm[j * self.batch_size:(j + 1) * self.batch_size].astype(np.int64)


def validate_sampling_rate(sampling_rate: float) -> float:
  q = float(sampling_rate)
  if not 0.0 < q <= 1.0:
    raise PrivacyError(f"sampling_rate q must be in (0, 1], got {sampling_rate}")
  return q


class PoissonSampler:
  """Poisson sampling with rate q, untruncated (`max_batch_size=None`) or truncated at
  `max_batch_size` rows.

  Each step, every one of the N examples is included independently with probability q.
  Drawing N Bernoulli(q) coins is O(N) per step (N is 5e9 in the paper), so the sample is
  drawn in the equivalent way: the count n ~ Binomial(N, q), then a uniformly random subset of
  size n without replacement. The two have the same distribution: given its size, a Poisson
  sample is a uniform subset of that size (all subsets of size n have probability
  q^n (1-q)^(N-n)).

  Untruncated, every sampled example is returned (the training loop runs them in as many
  microbatches as they need). Truncated: if n exceeds
  `max_batch_size`, a uniformly random subset of `max_batch_size` of the n is
  kept (truncated Poisson sampling; `accounting.make_dp_event(..., max_batch_size=...)` gives the
  matching `TruncatedSubsampledGaussianDpEvent`); `truncation_probability` is
  `truncation.truncation_probability`, the per-step δ cost of the cap.
  """

  is_poisson = True

  def __init__(self, num_examples: int, sampling_rate: float, max_batch_size: Optional[int], seed: int):
    num_examples = int(num_examples)
    if num_examples <= 0:
      raise PrivacyError(f"num_examples (N) must be > 0, got {num_examples}")
    self.sampling_rate = validate_sampling_rate(sampling_rate)
    self.num_examples = num_examples
    if max_batch_size is None:
      self.max_batch_size = None
    else:
      if int(max_batch_size) <= 0:
        raise PrivacyError(f"max_batch_size must be > 0, got {max_batch_size}")
      self.max_batch_size = min(int(max_batch_size), num_examples)
    self.seed = int(seed)

  @property
  def scheme(self) -> "privacy_params.Sampling":
    """`Sampling.POISSON_TRUNCATED` when capped, else `Sampling.POISSON`."""
    return privacy_params.Sampling.POISSON_TRUNCATED if self.truncated else privacy_params.Sampling.POISSON

  @property
  def truncated(self) -> bool:
    """Whether a sample larger than `max_batch_size` is cut down (truncated Poisson sampling)."""
    return self.max_batch_size is not None

  @classmethod
  def from_expected_batch_size(cls, num_examples: int, expected_batch_size: float,
                               max_batch_size: Optional[int] = None, seed: int = 0,
                               max_truncation_probability: float = 1e-6) -> "PoissonSampler":
    """q = expected_batch_size / N; max_batch_size defaults to the smallest size whose
    per-step truncation probability is <= `max_truncation_probability`."""
    num_examples = int(num_examples)
    if not 0 < expected_batch_size <= num_examples:
      raise PrivacyError(f"expected_batch_size={expected_batch_size} must be in (0, N={num_examples}]")
    q = expected_batch_size / num_examples
    if max_batch_size is None:
      max_batch_size = truncation.max_batch_size_for(num_examples, q, max_truncation_probability)
    return cls(num_examples, q, max_batch_size, seed)

  @property
  def padded_batch_size(self) -> Optional[int]:
    """Rows of every batch when truncated; None untruncated, where a step's rows follow its
    sample (`mechanism.BatchLayout.rows_for_step`)."""
    return self.max_batch_size

  @property
  def expected_batch_size(self) -> float:
    """q N: the public constant the DP aggregator divides the noisy sum by."""
    return self.sampling_rate * self.num_examples

  @property
  def truncation_probability(self) -> float:
    """Per-step truncation probability, P[Binomial(N + 1, q) > max_batch_size] (add-one
    neighbour: the bound holds for both datasets); see `truncation.truncation_probability`."""
    return truncation.truncation_probability(self.num_examples, self.sampling_rate, self.max_batch_size)

  def truncation_probability_over(self, steps: int) -> float:
    """Chance that at least one of `steps` steps is truncated: 1 - (1 - p)^steps."""
    return float(-np.expm1(steps * np.log1p(-self.truncation_probability)))

  def sample_size(self, step: int) -> int:
    """The untruncated Poisson count n ~ Binomial(N, q) of step `step`."""
    return int(self._rng(step).binomial(self.num_examples, self.sampling_rate))

  def _rng(self, step: int) -> np.random.Generator:
    return np.random.default_rng([_POISSON_STREAM, self.seed, _check_step(step)])

  def indices_for_step(self, step: int) -> np.ndarray:
    """Sorted example indices (int64[n]; n <= max_batch_size when truncated) of step `step`."""
    rng = self._rng(step)
    count = int(rng.binomial(self.num_examples, self.sampling_rate))
    # Truncation keeps a uniform subset of the sample: drawing min(n, max) uniform indices
    # directly has the same distribution.
    if self.truncated:
      count = min(count, self.max_batch_size)
    if self.sampling_rate == 1.0 and count == self.num_examples:
      return np.arange(self.num_examples, dtype=np.int64)
    chosen = rng.choice(self.num_examples, size=count, replace=False)
    return np.sort(chosen).astype(np.int64)


class CyclicPoissonSampler:
  """Cyclic Poisson sampling: b groups, step t samples group t mod b with rate q.

  Example i belongs to group g(i) = h_k(i) mod b, h_k a hash keyed by 128 bits drawn from the
  secret seed: every example's group is independent and uniform (an independent partition, so
  adding or removing one example changes no other example's group: the add/remove-one relation of
  the accounting), and neither the partition nor any per-example state is stored. Step t's
  sample is every example with g(i) = t mod b, each independently with probability q: the
  Poisson(q) candidates over all N are drawn exactly as `PoissonSampler` draws them (Binomial
  count, then a uniform subset) and those of the step's group are kept. Time and memory per step
  are O(q N), never O(N); with b = 1 the indices are exactly `PoissonSampler`'s for the same
  seed. The expected batch is q N / b, the public divisor of the noisy sum.
  """

  is_poisson = True
  scheme = privacy_params.Sampling.POISSON
  truncated = False
  max_batch_size = None
  padded_batch_size = None

  def __init__(self, num_examples: int, sampling_rate: float, num_groups: int, seed: int):
    num_groups = int(num_groups)
    if num_groups < 1:
      raise PrivacyError(f"num_groups (b) must be >= 1, got {num_groups}")
    self.num_groups = num_groups
    self._poisson = PoissonSampler(num_examples, sampling_rate, None, seed)
    self.num_examples, self.sampling_rate, self.seed = self._poisson.num_examples, self._poisson.sampling_rate, int(seed)
    rng = np.random.default_rng([_GROUP_STREAM, self.seed])
    self._keys = rng.integers(0, np.iinfo(np.uint64).max, size=2, dtype=np.uint64, endpoint=True)

  @property
  def expected_batch_size(self) -> float:
    """q N / b: the expected sample of a step, the public divisor of the noisy sum."""
    return self.sampling_rate * self.num_examples / self.num_groups

  def group_of(self, indices) -> np.ndarray:
    """g(i) in [0, b) of each example index (int64)."""
    i = np.asarray(indices, np.int64).astype(np.uint64)
    if self.num_groups == 1:
      return np.zeros(i.shape, np.int64)
    h = mix64(mix64(i ^ self._keys[0]) + self._keys[1])
    return (h % np.uint64(self.num_groups)).astype(np.int64)

  def indices_for_step(self, step: int) -> np.ndarray:
    """Sorted example indices (int64[n]) of step `step`: the group `step mod b`'s Poisson sample."""
    candidates = self._poisson.indices_for_step(step)
    if self.num_groups == 1:
      return candidates
    return candidates[self.group_of(candidates) == int(step) % self.num_groups]
