"""GLUE metrics of decoded predictions, as T5 computes them (`t5.data.glue_utils.GLUE_METRICS`).

Predictions are decoded strings; they are mapped back to class ids (or STS-B scores) with
t5's postprocessors (`string_label_to_class_id`, `string_to_float`): a string outside the
label set becomes -1 and counts as wrong. Scores are in percent, as in T5 and Ponomareva et al. 2022:

  cola: Matthews correlation   sst2, mnli_*, qnli, rte, wnli: accuracy
  mrpc, qqp: F1 and accuracy   stsb: Pearson and Spearman correlation

A task's headline score (one column of the paper's Table 2) is the mean of its metrics
(GLUE's convention for tasks with two metrics); the average is the mean of the columns.
"""
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from private_t5 import quiet_tf

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
  quiet_tf.import_tensorflow()  # t5 imports it
  # Lazy: t5 imports TensorFlow; only the GLUE postprocessors and metrics need it.
  from t5.data import postprocessors  # pylint: disable=g-import-not-at-top
  if label_names is None:
    return float(postprocessors.string_to_float(prediction, default=-1.0))
  return int(postprocessors.string_label_to_class_id(prediction, label_classes=list(label_names),
                                                     default=-1))


def compute_metrics(metric: str, targets: Sequence, predictions: Sequence) -> Dict[str, float]:
  """The task's GLUE metrics (percent) of postprocessed `predictions` against `targets`."""
  quiet_tf.import_tensorflow()  # t5 imports it
  # Lazy: t5 imports TensorFlow; only the GLUE metrics need it.
  from t5.evaluation import metrics as t5_metrics  # pylint: disable=g-import-not-at-top
  if metric not in TASK_METRICS:
    raise ValueError(f"unknown GLUE metric {metric!r}; valid: {', '.join(TASK_METRICS)}")
  targets, predictions = list(targets), list(predictions)
  if len(targets) != len(predictions) or not targets:
    raise ValueError(f"need equally many targets and predictions, got {len(targets)} and {len(predictions)}")
  out = {}
  for name in TASK_METRICS[metric]:
    if name == "accuracy":
      out.update(t5_metrics.accuracy(targets, predictions))
    elif name == "f1":
      out.update(t5_metrics.f1_score_with_invalid(targets, predictions))
    elif name == "matthews_corrcoef":
      fn = t5_metrics.sklearn_metrics_wrapper("matthews_corrcoef", metric_post_process_fn=lambda x: 100 * x)
      out.update(fn(targets, predictions))
    elif name == "pearson_corrcoef":
      out.update(_correlation(t5_metrics.pearson_corrcoef, "pearson_corrcoef", targets, predictions))
    elif name == "spearman_corrcoef":
      out.update(_correlation(t5_metrics.spearman_corrcoef, "spearman_corrcoef", targets, predictions))
  return {k: float(v) for k, v in out.items()}


def _correlation(fn, name: str, targets, predictions) -> Dict[str, float]:
  # A constant prediction has no correlation; SciPy returns NaN there: report 0.
  if np.std(np.asarray(predictions, np.float64)) == 0 or np.std(np.asarray(targets, np.float64)) == 0:
    return {name: 0.0}
  return fn(targets, predictions)


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
