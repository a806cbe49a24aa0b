"""Training metrics: TensorBoard event files, the console progress line, summary.json's labels.

Labelling (DP rule "nothing else leaks"): loss and token accuracy computed on the private training batches are
not covered by the privacy guarantee. Their TensorBoard tags start with `nondp/` and the
console shows them as "(train batch, not DP)". Validation metrics are computed on held-out
documents of the same private corpus: the model never trains on them, but releasing the
numbers is not covered by the guarantee either, so their tags (MODEL_DIR/tensorboard/
validation) start with `nondp/` too and summary.json of a DP run holds them under
`validation_not_dp` (`validation` for a non-private run, like the training batch metrics).
The throughput (examples/s, the share of real rows) counts the private examples sampled: the
console labels "ex/s" "(not DP)" in a DP run, and summary.json of a DP run names every such key
in its `not_dp` list (`NOT_DP_SUMMARY_KEYS`).
"""
import math
import os
import sys
import time
from typing import Dict, Mapping, Optional, TextIO

from private_t5.models import run_dir
from private_t5.train import event_file

# Tag prefix of metrics computed from private data without DP (training batches, validation).
NOT_DP_PREFIX = "nondp/"
# summary.json keys of a DP run computed from private data without DP (listed under "not_dp").
NOT_DP_SUMMARY_KEYS = ("examples_per_second", "real_row_fraction", "train_batch_metrics_not_dp",
                       "validation_not_dp")


def validation_key(private: bool) -> str:
  """summary.json key of the validation metrics: labelled not-DP in a DP run."""
  return "validation_not_dp" if private else "validation"


def validation_metrics(summary: Mapping) -> Optional[Dict]:
  """The validation metrics of a training summary, whichever key holds them."""
  return summary.get("validation_not_dp") or summary.get("validation")


class SummaryWriter:
  """Scalars to TensorBoard event files in MODEL_DIR/tensorboard/<split> (no TensorFlow needed)."""

  def __init__(self, model_dir: str, enabled: bool = True):
    self._root = run_dir.tensorboard_dir(model_dir)
    self._enabled = enabled
    self._writers: Dict[str, event_file.EventFileWriter] = {}

  @property
  def log_dir(self) -> str:
    return self._root

  def scalars(self, split: str, step: int, values: Mapping[str, float]) -> None:
    """Writes the finite values at `step` to the `split` event file and flushes it."""
    if not self._enabled:
      return
    if split not in self._writers:
      self._writers[split] = event_file.EventFileWriter(os.path.join(self._root, split))
    self._writers[split].add_scalars(step, values)
    self._writers[split].flush()

  def close(self) -> None:
    for writer in self._writers.values():
      writer.close()
    self._writers.clear()


def read_scalars(event_dir: str) -> Dict[str, list]:
  """{tag: [(step, value), ...]} from the event files in `event_dir` (for tests and tools)."""
  return event_file.read_scalars(event_dir)


def format_duration(seconds: float) -> str:
  if not math.isfinite(seconds) or seconds < 0:
    return "?"
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


class ProgressPrinter:
  """The console progress line: step, loss, token accuracy, examples/s, ETA, ε."""

  def __init__(self, total_steps: int, start_step: int = 0, stream: Optional[TextIO] = None):
    self.total_steps = int(total_steps)
    self.stream = stream or sys.stdout
    self._last_time = time.time()
    self._last_step = int(start_step)
    self._examples_since = 0.0

  def add_examples(self, count: float) -> None:
    self._examples_since += float(count)

  def restart(self, step: int) -> None:
    """Counts the rates and the ETA from now and `step` on (called after a session's first
    step, whose time is mostly compilation); a line at `step` itself shows neither."""
    self._last_time, self._last_step, self._examples_since = time.time(), int(step), 0.0

  def line(self, step: int, loss: Optional[float], accuracy: Optional[float],
           epsilon: Optional[float] = None, private: bool = False,
           learning_rate: Optional[float] = None, training_epsilon: Optional[float] = None) -> str:
    """Formats (and resets the rate counters of) the progress line at `step`.

    `epsilon` is the run's total ε; `training_epsilon`, when it differs (a DP vocabulary or DP
    initial weights composed in), is shown beside it.
    """
    now = time.time()
    elapsed = max(now - self._last_time, 1e-9)
    steps_done = max(step - self._last_step, 0)
    examples_per_s = self._examples_since / elapsed
    steps_per_s = steps_done / elapsed
    eta = (self.total_steps - step) / steps_per_s if steps_per_s > 0 else float("nan")
    self._last_time, self._last_step, self._examples_since = now, step, 0.0
    parts = [f"step {step}/{self.total_steps}"]
    label = " (train batch, not DP)" if private else " (train batch)"
    if loss is not None:
      acc = f" acc {accuracy:.4f}" if accuracy is not None else ""
      parts.append(f"loss {loss:.4f}{acc}{label}")
    if learning_rate is not None:
      parts.append(f"lr {learning_rate:.3g}")
    if steps_done:
      parts.append(f"{examples_per_s:.1f} ex/s{' (not DP)' if private else ''}")
      parts.append(f"{steps_per_s:.2f} steps/s")
      parts.append(f"ETA {format_duration(eta)}")
    if epsilon is not None:
      text = f"ε {epsilon:.4g}" if math.isfinite(epsilon) else "ε ∞"
      if training_epsilon is not None and training_epsilon != epsilon:
        text += f" (total; training alone {training_epsilon:.4g})"
      parts.append(text)
    return " | ".join(parts)

  def print(self, text: str) -> None:
    print(text, file=self.stream, flush=True)
