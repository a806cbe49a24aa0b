"""Extraction metrics of Ponomareva et al. 2022, Table 3: exact match, token accuracy, median edit distance.

For each prompt the model generates T tokens that are compared with the true next T tokens:

* EM (exact match): 1 if all T generated tokens equal the target, else 0; averaged over the
  examples of a split.
* TA (token accuracy): the fraction of the T positions whose generated token equals the
  target token; averaged over the examples.
* MED (median edit distance): the token-level Levenshtein distance between the generated and
  the target sequence of each example; the median over the examples.
* Approximate match (the 50/50 protocol of Carlini et al. 2023, "Quantifying Memorization
  Across Neural Language Models", as the Gemma reports use it): 1 if that distance divided by T is at most a threshold
  (default 0.1: 5 wrong tokens of 50 still match, 6 do not), else 0.

Exact and approximate matches are also reported as rates with a two-sided Clopper-Pearson
(exact binomial) confidence interval, so that a rate of 0 of n states how large the true
rate could still be.

A generation that stops early at EOS is compared as it is: the positions after the EOS hold
the pad id, so they count as mismatches.
"""
import dataclasses
from typing import Dict, List, Sequence, Tuple

import editdistance
import numpy as np
from scipy import stats

PAD_ID = 0
APPROXIMATE_THRESHOLD = 0.1
CONFIDENCE = 0.95


def truncate_after_eos(tokens: Sequence[int], eos_id: int = 1) -> np.ndarray:
  """Tokens before the first EOS (the EOS and everything after it dropped)."""
  arr = np.asarray(tokens)
  hits = np.flatnonzero(arr == eos_id)
  return arr[:hits[0]] if hits.size else arr


def per_example_scores(prediction: Sequence[int], target: Sequence[int], eos_id: int = 1):
  """(exact_match, token_accuracy, edit_distance) of one generation against its target.

  Args:
    prediction: generated token ids (any length; content after the first EOS is ignored).
    target: the true continuation (length T, no EOS).
    eos_id: the end-of-sequence id.
  """
  target = np.asarray(target, dtype=np.int64)
  pred = truncate_after_eos(prediction, eos_id).astype(np.int64)
  t = target.shape[0]
  aligned = np.full((t,), PAD_ID - 1, dtype=np.int64)  # never equal to a real token
  aligned[:min(t, pred.shape[0])] = pred[:t]
  correct = aligned == target
  exact = bool(correct.all()) and pred.shape[0] >= t
  accuracy = float(correct.mean()) if t else 0.0
  distance = int(editdistance.eval(pred[:t].tolist(), target.tolist()))
  return exact, accuracy, distance


def exact_matches(predictions: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                  eos_id: int = 1) -> List[bool]:
  """Per example: whether the generation reproduces its target exactly (the EM of one example)."""
  if len(predictions) != len(targets):
    raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
  return [per_example_scores(p, t, eos_id)[0] for p, t in zip(predictions, targets)]


def is_approximate_match(distance: int, target_length: int, threshold: float = APPROXIMATE_THRESHOLD) -> bool:
  """Whether an edit distance is an approximate match: distance / target length <= threshold."""
  if target_length <= 0:
    return False
  # A small tolerance: threshold * T is a float product (0.1 * 30 = 3.0000000000000004).
  return distance <= threshold * target_length + 1e-9


def approximate_matches(predictions: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                        threshold: float = APPROXIMATE_THRESHOLD, eos_id: int = 1) -> List[bool]:
  """Per example: whether the generation is within `threshold` normalized edit distance of its target."""
  if len(predictions) != len(targets):
    raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
  return [is_approximate_match(per_example_scores(p, t, eos_id)[2], len(t), threshold)
          for p, t in zip(predictions, targets)]


def clopper_pearson(successes: int, n: int, confidence: float = CONFIDENCE) -> Tuple[float, float]:
  """The two-sided Clopper-Pearson interval of a binomial proportion: (low, high); (NaN, NaN) for n = 0.

  low is the alpha/2 quantile of Beta(k, n - k + 1) (0 when k = 0), high the 1 - alpha/2
  quantile of Beta(k + 1, n - k) (1 when k = n), alpha = 1 - confidence; as
  `scipy.stats.binomtest(k, n).proportion_ci(confidence, method="exact")`.
  """
  if n <= 0:
    return float("nan"), float("nan")
  if not 0 <= successes <= n:
    raise ValueError(f"{successes} successes of {n} trials")
  alpha = 1.0 - confidence
  low = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes, n - successes + 1))
  high = 1.0 if successes == n else float(stats.beta.ppf(1 - alpha / 2, successes + 1, n - successes))
  return low, high


@dataclasses.dataclass
class SplitMetrics:
  """Aggregated metrics of one split (EM, TA and the match rates as fractions in [0, 1]).

  exact_match_ci and approximate_match_ci are the Clopper-Pearson intervals (at `confidence`)
  of exact_match and approximate_match; approximate_threshold is the normalized edit distance
  up to which a generation counts as an approximate match.
  """
  n: int
  skipped: int
  exact_match: float
  token_accuracy: float
  median_edit_distance: float
  mean_edit_distance: float
  exact_matches: int = 0
  exact_match_ci: Tuple[float, float] = (float("nan"), float("nan"))
  approximate_match: float = float("nan")
  approximate_matches: int = 0
  approximate_match_ci: Tuple[float, float] = (float("nan"), float("nan"))
  approximate_threshold: float = APPROXIMATE_THRESHOLD
  confidence: float = CONFIDENCE

  def as_dict(self) -> Dict[str, float]:
    out = dataclasses.asdict(self)
    out["exact_match_ci"], out["approximate_match_ci"] = list(self.exact_match_ci), list(self.approximate_match_ci)
    return out


def aggregate_scores(scores: Sequence[Tuple[bool, float, int]], target_lengths: Sequence[int], skipped: int = 0,
                     threshold: float = APPROXIMATE_THRESHOLD, confidence: float = CONFIDENCE) -> SplitMetrics:
  """SplitMetrics from the `per_example_scores` of each example and its target's length."""
  if len(scores) != len(target_lengths):
    raise ValueError(f"{len(scores)} scores for {len(target_lengths)} targets")
  if not len(scores):
    nan = float("nan")
    return SplitMetrics(n=0, skipped=skipped, exact_match=nan, token_accuracy=nan, median_edit_distance=nan,
                        mean_edit_distance=nan, approximate_threshold=threshold, confidence=confidence)
  em, ta, ed = (np.asarray(x, dtype=np.float64) for x in zip(*scores))
  n, exact = len(scores), int(em.sum())
  approx = sum(is_approximate_match(int(d), int(t), threshold) for d, t in zip(ed, target_lengths))
  return SplitMetrics(n=n, skipped=skipped, exact_match=float(em.mean()),
                      token_accuracy=float(ta.mean()), median_edit_distance=float(np.median(ed)),
                      mean_edit_distance=float(ed.mean()), exact_matches=exact,
                      exact_match_ci=clopper_pearson(exact, n, confidence), approximate_match=approx / n,
                      approximate_matches=int(approx), approximate_match_ci=clopper_pearson(approx, n, confidence),
                      approximate_threshold=threshold, confidence=confidence)


def aggregate(predictions: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], skipped: int = 0,
              eos_id: int = 1, threshold: float = APPROXIMATE_THRESHOLD,
              confidence: float = CONFIDENCE) -> SplitMetrics:
  """EM / TA / MED and the match rates over a split; NaN metrics when no example was evaluated."""
  if len(predictions) != len(targets):
    raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
  scores = [per_example_scores(p, t, eos_id) for p, t in zip(predictions, targets)]
  return aggregate_scores(scores, [len(t) for t in targets], skipped=skipped, threshold=threshold,
                          confidence=confidence)


def pool(splits: Sequence[dict], confidence: float = CONFIDENCE) -> dict:
  """The metrics of several splits' examples together (`SplitMetrics.as_dict`s): counts summed,
  rates and means weighted by n, intervals recomputed; the median edit distance is not
  poolable from medians and is NaN."""
  n = sum(m["n"] for m in splits)
  exact = sum(m.get("exact_matches", 0) for m in splits)
  approx = sum(m.get("approximate_matches", 0) for m in splits)
  nan = float("nan")
  weighted = lambda key: sum(m[key] * m["n"] for m in splits if m["n"]) / n if n else nan
  return SplitMetrics(
      n=n, skipped=sum(m["skipped"] for m in splits), exact_match=exact / n if n else nan,
      token_accuracy=weighted("token_accuracy"), median_edit_distance=nan,
      mean_edit_distance=weighted("mean_edit_distance"), exact_matches=exact,
      exact_match_ci=clopper_pearson(exact, n, confidence), approximate_match=approx / n if n else nan,
      approximate_matches=approx, approximate_match_ci=clopper_pearson(approx, n, confidence),
      approximate_threshold=splits[0].get("approximate_threshold", APPROXIMATE_THRESHOLD) if splits
      else APPROXIMATE_THRESHOLD, confidence=confidence).as_dict()
