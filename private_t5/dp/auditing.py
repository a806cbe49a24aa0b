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

The report's figures come from jax-privacy's `auditing.CanaryScoreAuditor` (`score_audit`),
built from the scores of the included ("in") and held-out ("out") canaries, a higher score
meaning "more likely trained on":

* `epsilon_one_run`: the bound above, for one-sided guesses (k- = 0: "in" for every canary
  scoring at or above a threshold). The library tries the thresholds at the vertices of the ROC
  curve's convex hull and divides 1 - confidence among them (Bonferroni), so the threshold need
  not be fixed in advance. This is the report's ε lower bound.
* `epsilon_one_run_fdp`: Mahloujifar, Melis and Chaudhuri, "Auditing f-Differential Privacy in
  One Run" (2025), with the Gaussian trade-off curve whose (ε, δ) is the one tested: it rejects
  "training is μ-GDP for the μ that gives (ε, δ)" (Dong, Roth and Su, "Gaussian Differential
  Privacy", 2022). It uses the whole ordering of the guesses and so is much tighter with few
  canaries (perfect separation of 64: 3.9 against 2.0), but a Gaussian-DP claim is stronger than
  (ε, δ)-DP: it is compared with the ledger as a note, not as a failure.
* `tpr_at_given_fpr` at FPR 1% and 0.1%, `attack_auroc` (both on the convex hull of the ROC
  curve: a classifier may randomize between two thresholds), and their bootstrap intervals
  (`BootstrapParams.confidence_interval`: resampled in and out scores, bias-corrected
  percentiles, at the audit's confidence).

Not reported: `epsilon_from_gdp`, which gives 7.8 on 128 canaries whose scores carry no signal
(3.0 on 1000): it takes the absolute value of μ computed from upper confidence bounds on both
error rates, so loose bounds read as a strong attack.

Every bound is capped by the number of canaries: when every included canary scores above every
held-out one, all guesses are right and the bound is the cap (`cap`: the bound of perfectly
separated scores with the same numbers in and out), however much more the model memorized.
More canaries raise the one-run cap (about ln(m / 8) at 95%: 2.0 for m = 64, 4.8 for m = 1000)
until its δ term, 2mδ, stops it (near 6.4 at δ = 1e-5); the f-DP bound's cap is higher (3.9 and
8.5).

`epsilon_lower_bound` below is this module's own computation of the one-run bound, kept for the
two-sided guesses (k+ "in" and k- "out", fixed in advance) that the library does not make, and
as a cross-check: on the same counts it agrees with `epsilon_one_run` to the two root finders'
tolerance (1e-6 in ε; tests/test_auditing.py).
"""
import dataclasses
from importlib import metadata
import secrets
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import numpy as np
from scipy import special, stats

from private_t5.errors import ConfigError, DataError
from private_t5.lazy_imports import lazy_module

# jax-privacy's auditing, imported on first use (it imports the whole library and dp_accounting).
jpa = lazy_module("jax_privacy.auditing", needed_for="the privacy audit", install="jax-privacy (requirements.txt)")

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


LIBRARY_AUDITOR = "jax_privacy.auditing.CanaryScoreAuditor"
# The false-positive rates at which the report gives the attack's true-positive rate.
AUDIT_FPRS = (0.01, 0.001)
# Bootstrap resamples of the TPR and AUROC intervals: a second or less for thousands of canaries.
BOOTSTRAP_SAMPLES = 200


def library_version() -> str:
  """The installed jax-privacy's version, read from its metadata (nothing imported)."""
  try:
    return metadata.version("jax-privacy")
  except metadata.PackageNotFoundError:
    return "not installed"


@dataclasses.dataclass(frozen=True)
class ScoreAudit:
  """The figures of `CanaryScoreAuditor` on one set of canary scores; see the module docstring.

  `*_cap` is the bound of perfectly separated scores with the same numbers in and out. With
  `saturated` (perfect separation) the bounds are their caps: the audit could show no more.
  Intervals are [low, high] at `confidence`, None without bootstrap.
  """
  epsilon_one_run: float
  epsilon_one_run_cap: float
  epsilon_one_run_fdp: float
  epsilon_one_run_fdp_cap: float
  tpr_at_fpr: List[Dict[str, Any]]  # [{"fpr", "tpr", "interval"}], in AUDIT_FPRS order
  auroc: float
  auroc_interval: Optional[List[float]]
  saturated: bool  # every included canary scores above every held-out one: all guesses right
  confidence: float
  delta: float
  num_included: int
  num_held_out: int
  bootstrap_samples: int
  bootstrap_seed: int

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def check_bootstrap_samples(samples: int) -> int:
  """`samples` (0: no intervals); ConfigError unless it is a non-negative integer."""
  if not isinstance(samples, (int, np.integer)) or isinstance(samples, bool) or samples < 0:
    raise ConfigError(f"audit bootstrap samples must be a non-negative integer (0: no intervals), got {samples!r}")
  return int(samples)


def _library_bounds(in_scores, out_scores, significance: float, delta: float):
  """(the auditor, its one-run bound, its one-run f-DP bound), thresholds chosen by Bonferroni (the default)."""
  auditor = jpa.CanaryScoreAuditor(in_scores, out_scores)
  return (auditor, float(auditor.epsilon_one_run(significance, delta)),
          float(auditor.epsilon_one_run_fdp(significance, delta)))


def score_audit(scores: Sequence[float], included: Sequence[bool], delta: float, confidence: float = 0.95,
                fprs: Sequence[float] = AUDIT_FPRS, bootstrap_samples: int = BOOTSTRAP_SAMPLES,
                bootstrap_seed: int = 0) -> ScoreAudit:
  """The audit's figures from jax-privacy's `CanaryScoreAuditor`, at `confidence` and `delta`.

  Args:
    scores: one per canary; higher means more likely trained on (e.g. minus the loss). NaN
      scores rank lowest, as in `guess_membership`.
    included: the membership bits.
    delta: δ of the bounds, in (0, 1) (the library's bounds need δ > 0).
    confidence: 1 - β of the bounds and of the bootstrap intervals.
    fprs: the false-positive rates of the TPR figures.
    bootstrap_samples: resamples of the TPR and AUROC intervals; 0 for none.
    bootstrap_seed: the resampling's seed (the intervals are reproducible).
  """
  scores = np.asarray(scores, dtype=np.float64)
  included = np.asarray(included, dtype=bool)
  if included.shape != scores.shape or scores.ndim != 1:
    raise ConfigError(f"{scores.shape} scores for {included.shape} membership bits")
  if included.all() or not included.any():
    raise DataError(f"an audit needs included and held-out canaries, got {int(included.sum())} of "
                    f"{included.size} included")
  if not 0 < confidence < 1:
    raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
  if not 0 < delta < 1:
    raise ConfigError(f"audit delta must be in (0, 1) (jax-privacy's bounds need δ > 0), got {delta}")
  samples = check_bootstrap_samples(bootstrap_samples)
  scores = np.where(np.isnan(scores), -np.inf, scores)
  in_scores, out_scores = scores[included], scores[~included]
  significance = 1.0 - confidence
  auditor, one_run, fdp = _library_bounds(in_scores, out_scores, significance, delta)
  _, one_run_cap, fdp_cap = _library_bounds(np.ones(in_scores.size), np.zeros(out_scores.size), significance, delta)
  params = (jpa.BootstrapParams.confidence_interval(num_samples=samples, confidence=confidence, seed=bootstrap_seed)
            if samples else None)

  def interval(fn):  # fn: bootstrap parameters -> the quantiles of a figure
    return None if params is None else [float(x) for x in fn(params)]

  tprs = [{"fpr": float(f), "tpr": float(auditor.tpr_at_given_fpr(f)),
           "interval": interval(lambda p, f=f: auditor.tpr_at_given_fpr(f, bootstrap_params=p))} for f in fprs]
  return ScoreAudit(
      epsilon_one_run=one_run, epsilon_one_run_cap=one_run_cap, epsilon_one_run_fdp=fdp,
      epsilon_one_run_fdp_cap=fdp_cap, tpr_at_fpr=tprs, auroc=float(auditor.attack_auroc()),
      auroc_interval=interval(lambda p: auditor.attack_auroc(bootstrap_params=p)),
      saturated=bool(in_scores.min() > out_scores.max()), confidence=confidence, delta=delta,
      num_included=int(in_scores.size), num_held_out=int(out_scores.size), bootstrap_samples=samples,
      bootstrap_seed=int(bootstrap_seed))


def saturation_text(num_included: int, num_held_out: int, cap: float) -> str:
  """The report's line for a bound at its cap."""
  m = num_included + num_held_out
  return (f"all guesses right: the bound is the cap for {m} canaries ({num_included} included, {num_held_out} "
          f"held out), {cap:.3f}; the model may have memorized more than this bound can show with {m} "
          "canaries (more canaries raise the cap; the f-DP bound's cap is higher)")


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

