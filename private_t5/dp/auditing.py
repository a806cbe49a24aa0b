"""One-run privacy audit: an ε lower bound from membership guesses on random canaries.

Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run", 2023. m canaries are
drawn; each is included in the training data independently with probability 1/2 (S_i = +1 in,
-1 out). After one training run the auditor looks only at the model, guesses T_i in {+1, -1}
for r of the canaries and abstains on the others (T_i = 0); W is the number of correct guesses.
If training is (ε, δ)-DP with respect to one canary, then for every v

  P[W >= v] <= p(ε, δ) = min(1, B(v) + 2 m δ · max_{1 <= i <= v} (B(v - i) - B(v)) / i),

where B(u) = P[Binomial(r, q) >= u] and q = e^ε / (1 + e^ε) is the accuracy of ε-DP randomized
response. With δ = 0 this is their pure-DP result (W is stochastically dominated by
Binomial(r, q)); the δ term is their bound for approximate DP, computed exactly here: the
binomial tails come from `scipy.stats.binom`, and B(v - i) - B(v) is summed from the pmf so
that it stays accurate when both tails are close to 1.

Observing W = v lets us reject "(ε, δ)-DP" at confidence 1 - β whenever p(ε, δ) <= β; the lower
bound is the largest such ε. (An (ε, δ)-DP algorithm is (ε', δ)-DP for every ε' >= ε, so
p̃(ε) = inf_{ε' >= ε} p(ε', δ) is also a valid bound and it is monotone; {ε : p̃(ε) <= β} is an
interval ending at the largest ε with p(ε, δ) <= β, so reporting that ε is valid even where p is
not monotone. The bisection below returns a point of that set, which is never more.)

The bound is not the ledger's ε: it says how much privacy this run provably did NOT have (with
probability at least 1 - β over the canaries' coin flips). A DP run must give a bound at most its
ε; a larger bound means the implementation or the accounting is wrong. With perfect guesses it is
limited by r: about ln(r / ln(1/β)) (r = 1000, β = 0.05: ε ≈ 5.8 at δ = 0).

Why not jax-privacy's `auditing.CanaryScoreAuditor.epsilon_one_run` (2.0.0): it makes one-sided
guesses only (k- = 0) and it needs chex, which the pinned environment does not have; the
bound itself is a few lines of scipy, tested here against closed forms and exact arithmetic.
"""
import dataclasses
import secrets
from typing import Any, Callable, Dict, Optional, Sequence

import jax
import numpy as np
from scipy import special, stats

from private_t5.errors import ConfigError

# The stream of the membership coin flips in a seeded generator (the canaries' contents use others).
MEMBERSHIP_STREAM = 0x6175646974  # "audit"


def _check_counts(num_canaries: int, guesses: int, correct: int) -> None:
  for name, value in (("num_canaries", num_canaries), ("guesses", guesses), ("correct", correct)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
      raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
  if not correct <= guesses <= num_canaries:
    raise ConfigError(f"need correct <= guesses <= num_canaries, got {correct}, {guesses}, {num_canaries}")


def p_value(num_canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
  """Upper bound on P[>= `correct` correct guesses out of `guesses`] for an (ε, δ)-DP run."""
  _check_counts(num_canaries, guesses, correct)
  if not epsilon >= 0 or not 0 <= delta <= 1:
    raise ConfigError(f"need epsilon >= 0 and 0 <= delta <= 1, got {epsilon}, {delta}")
  q = float(special.expit(epsilon))
  tail = float(stats.binom.sf(correct - 1, guesses, q))  # B(v) = P[Binomial(r, q) >= v]
  if delta == 0 or correct == 0:
    return min(1.0, tail)
  # gaps[i - 1] = B(v - i) - B(v) = P[v - i <= X <= v - 1], i = 1 .. v.
  gaps = np.cumsum(stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q))
  alpha = float(np.max(gaps / np.arange(1, correct + 1)))
  return min(1.0, tail + 2 * num_canaries * delta * alpha)


def epsilon_lower_bound(num_canaries: int, guesses: int, correct: int, delta: float,
                        confidence: float = 0.95, tolerance: float = 1e-6) -> float:
  """The largest ε that `correct` of `guesses` right rejects as (ε, δ)-DP at `confidence`; 0 if none.

  Bisection on ε, as the paper's computation; the result is rounded down (conservative).
  """
  if not 0 < confidence < 1:
    raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
  _check_counts(num_canaries, guesses, correct)
  beta = 1.0 - confidence
  if guesses == 0 or p_value(num_canaries, guesses, correct, 0.0, delta) > beta:
    return 0.0
  lo, hi = 0.0, 1.0
  while p_value(num_canaries, guesses, correct, hi, delta) <= beta:  # ends: q -> 1 makes B(v) -> 1
    lo, hi = hi, 2 * hi
  while hi - lo > tolerance:
    mid = (lo + hi) / 2
    if p_value(num_canaries, guesses, correct, mid, delta) <= beta:
      lo = mid
    else:
      hi = mid
  return lo


def draw_membership(num_canaries: int, seed: Optional[int] = None):
  """(included[m] bool, seed): each canary in with probability 1/2, from `seed` only (OS entropy if None).

  The draw reads nothing but the seed and m, so it is independent of the data by construction.
  """
  if not isinstance(num_canaries, int) or isinstance(num_canaries, bool) or num_canaries < 1:
    raise ConfigError(f"the number of audit canaries must be a positive integer, got {num_canaries!r}")
  seed = secrets.randbits(63) if seed is None else int(seed)
  rng = np.random.default_rng([seed, MEMBERSHIP_STREAM])
  return rng.integers(0, 2, size=num_canaries).astype(bool), seed


def guess_membership(scores: Sequence[float], k_plus: int, k_minus: int) -> np.ndarray:
  """+1 ("in") for the k+ highest scores, -1 ("out") for the k- lowest, 0 (abstain) otherwise.

  A higher score must mean "more likely trained on" (e.g. minus the canary's loss). Ties are
  broken by canary position, which the membership draw does not depend on; NaN scores rank lowest.
  """
  scores = np.asarray(scores, dtype=np.float64)
  m = scores.shape[0]
  if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
    raise ConfigError(f"need k+ >= 0, k- >= 0 and k+ + k- <= m = {m}, got k+ = {k_plus}, k- = {k_minus}")
  ranked = np.where(np.isnan(scores), -np.inf, scores)
  order = np.argsort(-ranked, kind="stable")  # highest first
  guesses = np.zeros(m, dtype=np.int8)
  guesses[order[:k_plus]] = 1
  if k_minus:
    guesses[order[m - k_minus:]] = -1
  return guesses


@dataclasses.dataclass(frozen=True)
class AuditResult:
  """The outcome of one audit: the counts and the ε lower bound at `confidence` for `delta`."""
  epsilon_lower_bound: float
  confidence: float
  delta: float
  num_canaries: int
  num_included: int
  k_plus: int
  k_minus: int
  guesses: int
  correct: int

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def audit(scores: Sequence[float], included: Sequence[bool], k_plus: int, k_minus: int, delta: float,
          confidence: float = 0.95) -> AuditResult:
  """Guesses from `scores` (higher: more likely in), counts the correct ones against `included`,
  and returns the ε lower bound. k+ and k- must be fixed before looking at the scores."""
  included = np.asarray(included, dtype=bool)
  if included.shape != np.shape(scores):
    raise ConfigError(f"{np.shape(scores)} scores for {included.shape} membership bits")
  guesses = guess_membership(scores, k_plus, k_minus)
  truth = np.where(included, 1, -1)
  made = int(np.count_nonzero(guesses))
  correct = int(np.count_nonzero(guesses * truth > 0))
  m = int(included.shape[0])
  eps = epsilon_lower_bound(m, made, correct, delta, confidence)
  return AuditResult(epsilon_lower_bound=eps, confidence=confidence, delta=delta, num_canaries=m,
                     num_included=int(included.sum()), k_plus=k_plus, k_minus=k_minus, guesses=made,
                     correct=correct)


def max_lower_bound(guesses: int, delta: float = 0.0, confidence: float = 0.95,
                    num_canaries: Optional[int] = None) -> float:
  """The bound that `guesses` guesses, all correct, would give: the most this audit can show."""
  return epsilon_lower_bound(num_canaries or guesses, guesses, guesses, delta, confidence)


def sensitivity_ratios(clipped_sum: Callable[[Dict[str, Any]], Any], batch: Dict[str, Any],
                       clip_norm: float) -> np.ndarray:
  """White-box audit of a clipped sum: ||S(D) - S(D minus example i)|| / C for each real row i.

  The neighbour of the batch without example i is the same batch with row i turned into a
  padding row (`example_weight` 0), as the Poisson sampler pads. The Gaussian mechanism's
  guarantee assumes every ratio is at most 1; unlike the one-run audit above this checks the
  implementation (clip, dtype, reductions) directly, before any noise.

  Args:
    clipped_sum: batch -> the noiseless clipped sum (a pytree), e.g. an aggregator's
      `clipped_sum` with the parameters and dropout key fixed.
    batch: a batch in the trainer's layout (numpy arrays, `example_weight` 1 on real rows).
    clip_norm: C.

  Returns:
    float64 ratios [number of real rows], in row order.
  """
  def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])

  weights = np.asarray(batch["example_weight"])
  full = flat(clipped_sum(batch))
  ratios = []
  for row in np.flatnonzero(weights > 0):
    neighbour = dict(batch, example_weight=weights.copy())
    neighbour["example_weight"][row] = 0
    ratios.append(np.linalg.norm(full - flat(clipped_sum(neighbour))) / clip_norm)
  return np.asarray(ratios, np.float64)

