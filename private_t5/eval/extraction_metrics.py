"""Extraction metrics of Ponomareva et al. 2022, Table 3: exact match, token accuracy, median edit distance.

For each prompt the model generates T tokens that are compared with the true next T tokens:

* EM (exact match): 1 if all T generated tokens equal the target, else 0; averaged over the
  examples of a split.
* TA (token accuracy): the fraction of the T positions whose generated token equals the
  target token; averaged over the examples.
* MED (median edit distance): the token-level Levenshtein distance between the generated and
  the target sequence of each example; the median over the examples.

A generation that stops early at EOS is compared as it is: the positions after the EOS hold
the pad id, so they count as mismatches.
"""
import dataclasses
from typing import Dict, List, Sequence

import editdistance
import numpy as np

PAD_ID = 0


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


@dataclasses.dataclass
class SplitMetrics:
  """Aggregated metrics of one split (EM and TA as fractions in [0, 1])."""
  n: int
  skipped: int
  exact_match: float
  token_accuracy: float
  median_edit_distance: float
  mean_edit_distance: float

  def as_dict(self) -> Dict[str, float]:
    return dataclasses.asdict(self)


def aggregate(predictions: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], skipped: int = 0,
              eos_id: int = 1) -> SplitMetrics:
  """EM / TA / MED over a split; NaN metrics when no example was evaluated."""
  if len(predictions) != len(targets):
    raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
  if not predictions:
    nan = float("nan")
    return SplitMetrics(n=0, skipped=skipped, exact_match=nan, token_accuracy=nan,
                        median_edit_distance=nan, mean_edit_distance=nan)
  scores = [per_example_scores(p, t, eos_id) for p, t in zip(predictions, targets)]
  em, ta, ed = (np.asarray(x, dtype=np.float64) for x in zip(*scores))
  return SplitMetrics(n=len(scores), skipped=skipped, exact_match=float(em.mean()),
                      token_accuracy=float(ta.mean()), median_edit_distance=float(np.median(ed)),
                      mean_edit_distance=float(ed.mean()))
