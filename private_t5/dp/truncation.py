"""What truncating a Poisson batch costs: its probability per step and the δ it adds.

A Poisson batch capped at `max_batch_size` rows (`DPConfig.sampling="poisson_truncated"`) differs
from the untruncated mechanism only when the draw exceeds the cap: P[Binomial(N + 1, q) >
max_batch_size] per step (`truncation_probability`), which adds (1 + e^ε) · steps · p_trunc to δ
when the run is accounted as untruncated (`total_delta`; "How to DP-fy ML", Ponomareva et al.
2023, §4.3). `max_batch_size_for` and `max_expected_batch_size_for` invert it.
"""
import math
from typing import Optional

from scipy import stats

from private_t5.dp.privacy_params import check_number, validate_privacy_params
from private_t5.errors import PrivacyError


def truncation_probability(num_examples: int, sampling_rate: float, max_batch_size: Optional[int]) -> float:
  """P[a Poisson batch exceeds `max_batch_size`], the per-step δ cost of truncating it.

  Uses the larger of two add/remove-neighbouring datasets (N + 1 examples), so the bound holds
  for both: P[Binomial(N + 1, q) > max_batch_size].
  """
  if max_batch_size is None:
    return 0.0
  validate_privacy_params(sampling_rate=sampling_rate, num_examples=num_examples)
  if int(max_batch_size) != max_batch_size or max_batch_size < 1:
    raise PrivacyError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
  return float(stats.binom.sf(int(max_batch_size), int(num_examples) + 1, sampling_rate))


def total_delta(delta: float, steps: int, truncation_prob: float, epsilon: float) -> float:
  """δ of a truncated-Poisson run: δ + (1 + e^ε) · steps · p_trunc.

  The truncated run differs from the untruncated (accounted) one only on the event that some
  batch was truncated, of probability η ≤ steps · p_trunc on either dataset (union bound). So
  P[M'(D) ∈ S] ≤ P[M(D) ∈ S] + η ≤ e^ε (P[M'(D') ∈ S] + η) + δ + η.
  """
  eta = int(steps) * float(truncation_prob)
  if eta == 0.0:
    return float(delta)
  return float(delta) + (1.0 + math.exp(min(float(epsilon), 700.0))) * eta


def max_batch_size_for(num_examples: int, sampling_rate: float, max_truncation_probability: float) -> int:
  """The smallest cap whose per-step truncation probability is ≤ `max_truncation_probability`.

  E.g. `max_batch_size_for(N, q, 0.1 * delta / (steps * (1 + e^eps)))` keeps the truncation term
  of δ (`total_delta`) at 10% of δ.
  """
  validate_privacy_params(sampling_rate=sampling_rate, num_examples=num_examples)
  p = check_number("max_truncation_probability", max_truncation_probability, low=0, high=1)
  n = int(num_examples) + 1
  # The survival function falls with the cap: binary search on the exact tail (scipy's isf is
  # unreliable at tails like 1e-19, and stepping from it can take billions of steps).
  lo, hi = 0, n  # sf(n) = 0 <= p
  while lo < hi:
    mid = (lo + hi) // 2
    if stats.binom.sf(mid, n, sampling_rate) <= p:
      hi = mid
    else:
      lo = mid + 1
  return max(1, min(lo, int(num_examples)))


def max_expected_batch_size_for(num_examples: int, max_batch_size: int,
                                max_truncation_probability: float) -> int:
  """The largest integer expected batch q·N whose cap `max_batch_size` truncates with
  per-step probability ≤ `max_truncation_probability` (the inverse of `max_batch_size_for`).

  Raises:
    PrivacyError: even an expected batch of 1 is truncated more often than that.
  """
  n = int(num_examples)
  lo, hi = 1, min(int(max_batch_size), n)
  if truncation_probability(n, lo / n, max_batch_size) > max_truncation_probability:
    raise PrivacyError(f"batch_size={max_batch_size} is too small for Poisson sampling: even an expected "
                       f"batch of 1 exceeds it with probability > {max_truncation_probability:g}")
  while lo < hi:  # the truncation probability grows with q: the last size within the bound
    mid = (lo + hi + 1) // 2
    if truncation_probability(n, mid / n, max_batch_size) <= max_truncation_probability:
      lo = mid
    else:
      hi = mid - 1
  return lo
