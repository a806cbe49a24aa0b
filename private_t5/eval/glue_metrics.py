"""GLUE metrics of decoded predictions, as T5 computes them (`t5.data.glue_utils.GLUE_METRICS`).

Predictions are decoded strings; they are mapped back to class ids (or STS-B scores) as t5's
postprocessors (`string_label_to_class_id`, `string_to_float`) do: a string outside the label
set becomes -1 and counts as wrong. The metrics are t5's (`t5.evaluation.metrics`): the same
scikit-learn and SciPy calls, made here so that no TensorFlow is imported
(tests/test_glue_tasks.py compares them with t5's). Scores are in percent, as in T5 and
Ponomareva et al. 2022:

  cola: Matthews correlation   sst2, mnli_*, qnli, rte, wnli: accuracy
  mrpc, qqp: F1 and accuracy   stsb: Pearson and Spearman correlation

A task's headline score (one column of the paper's Table 2) is the mean of its metrics
(GLUE's convention for tasks with two metrics); the average is the mean of the columns.
"""
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import scipy.stats
import sklearn.metrics

# metric key -> names of the t5.evaluation.metrics results it reports
TASK_METRICS = {
    "cola": ("matthews_corrcoef",),
    "sst2": ("accuracy",),
    "mrpc": ("f1", "accuracy"),
    "qqp": ("f1", "accuracy"),
    "stsb": ("pearson_corrcoef", "spearman_corrcoef"),
    "mnli": ("accuracy",),
    "mnli_matched": ("accuracy",),
    "mnli_mismatched": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
    "accuracy": ("accuracy",),
}
# Column titles of the results table (Ponomareva et al. 2022, Table 2).
COLUMN_TITLES = {"mnli_matched": "mnli_m", "mnli_mismatched": "mnli_msm"}


def postprocess(prediction: str, label_names: Optional[Sequence[str]]):
  """Decoded text -> class id (-1 when not a label) or float score (-1.0 when not a number)."""
  if label_names is None:
    try:
      return float(prediction)
    except ValueError:
      return -1.0
  label_names = list(label_names)
  return label_names.index(prediction) if prediction in label_names else -1


def _f1_with_invalid(targets, predictions) -> float:
  """Binary F1 where a prediction other than 0 or 1 counts as wrong (t5's f1_score_with_invalid)."""
  targets, predictions = np.asarray(targets), np.array(predictions)
  invalid = np.logical_and(predictions != 0, predictions != 1)
  predictions[invalid] = 1 - targets[invalid]
  return sklearn.metrics.f1_score(targets, predictions)


_METRIC_FNS = {
    "accuracy": sklearn.metrics.accuracy_score,
    "f1": _f1_with_invalid,
    "matthews_corrcoef": sklearn.metrics.matthews_corrcoef,
    "pearson_corrcoef": lambda t, p: scipy.stats.pearsonr(t, p)[0],
    "spearman_corrcoef": lambda t, p: scipy.stats.spearmanr(t, p)[0],
}


def compute_metrics(metric: str, targets: Sequence, predictions: Sequence) -> Dict[str, float]:
  """The task's GLUE metrics (percent) of postprocessed `predictions` against `targets`."""
  if metric not in TASK_METRICS:
    raise ValueError(f"unknown GLUE metric {metric!r}; valid: {', '.join(TASK_METRICS)}")
  targets, predictions = list(targets), list(predictions)
  if len(targets) != len(predictions) or not targets:
    raise ValueError(f"need equally many targets and predictions, got {len(targets)} and {len(predictions)}")
  out = {}
  for name in TASK_METRICS[metric]:
    if name in ("pearson_corrcoef", "spearman_corrcoef") and _constant(targets, predictions):
      out[name] = 0.0  # a constant has no correlation (SciPy returns NaN): report 0
    else:
      out[name] = 100 * float(_METRIC_FNS[name](targets, predictions))
  return out


def _constant(targets, predictions) -> bool:
  return bool(np.std(np.asarray(predictions, np.float64)) == 0 or np.std(np.asarray(targets, np.float64)) == 0)


def headline(scores: Mapping[str, float]) -> float:
  """One number per task: the mean of its metrics."""
  return float(np.mean(list(scores.values())))


def majority_prediction(train_labels: Sequence, is_regression: bool):
  """The majority-class baseline's constant prediction, from the training labels (public
  choice in a benchmark; with private training labels it is a data-dependent statistic)."""
  labels = np.asarray(train_labels)
  if is_regression:
    return float(np.mean(labels))
  values, counts = np.unique(labels, return_counts=True)
  return int(values[np.argmax(counts)])


def average(columns: Mapping[str, float]) -> float:
  return float(np.mean(list(columns.values()))) if columns else float("nan")


def markdown_table(rows: Mapping[str, Mapping[str, float]], task_order: List[str]) -> str:
  """A Markdown table: one row per model, one column per task (headline score) plus Avg."""
  titles = [COLUMN_TITLES.get(t, t) for t in task_order]
  lines = ["| model | " + " | ".join(titles) + " | Avg |",
           "|---|" + "---|" * (len(titles) + 1)]
  for name, columns in rows.items():
    cells = [f"{columns[t]:.1f}" if t in columns else "" for t in task_order]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {average(columns):.1f} |")
  return "\n".join(lines) + "\n"


def bootstrap_interval(metric: str, targets: Sequence, predictions: Sequence, num_samples: int = 1000,
                       confidence: float = 0.95, seed: int = 0) -> List[float]:
  """Percentile bootstrap interval of a task's headline score over its evaluated examples.

  Each of `num_samples` resamples draws len(targets) examples with replacement (seeded) and
  scores them with `compute_metrics`; the interval is the central `confidence` share of those
  scores (Efron and Tibshirani, "An Introduction to the Bootstrap", 1993). Two models whose
  intervals overlap are not shown to differ on this validation set.

  Returns:
    [low, high] in the score's units (percent).
  """
  if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
    raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
  targets, predictions = np.asarray(list(targets)), np.asarray(list(predictions))
  if len(targets) != len(predictions) or not len(targets):
    raise ValueError(f"need equally many targets and predictions, got {len(targets)} and {len(predictions)}")
  rng = np.random.default_rng(seed)
  scores = []
  for _ in range(num_samples):
    rows = rng.integers(0, len(targets), len(targets))
    scores.append(headline(compute_metrics(metric, targets[rows].tolist(), predictions[rows].tolist())))
  tail = 100.0 * (1.0 - confidence) / 2.0
  low, high = np.percentile(scores, [tail, 100.0 - tail])
  return [float(low), float(high)]
