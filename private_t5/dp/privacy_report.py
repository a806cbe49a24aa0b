"""Privacy reports: their schemas, file names and writers.

This module owns every report's file name and its writer: a run's `privacy_report.json`
(`write_report`, its content `ledger_report`) and `summary.json` (`write_summary`),
DP-SentencePiece's report (`vocabulary_report`, and `vocabulary_report_event`, the DP event it
records) and where it lies beside its vocabulary (`vocabulary_report_path`,
`find_vocabulary_report`), and the names of the adaptive-DP and JFT reports. The accounting a
run's report states is the ledger's (`private_t5.dp.ledger`).

A guarantee needs secret noise: a report of a release whose noise came from a fixed seed says in
one line (`warnings`) that its ε is no guarantee.
"""
import hashlib
import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from private_t5.dp.privacy_params import NoiseKind
from private_t5.errors import DataError
from private_t5.io import file_sha256, write_json_atomic

REPORT_FILENAME = "privacy_report.json"
SUMMARY_FILENAME = "summary.json"
ADAPTIVE_REPORT_FILENAME = "adaptive_dp_report.json"
JFT_REPORT_FILENAME = "jft_privacy_report.json"
# The names of the components a ledger composes, as its report lists them (`components`).
VOCABULARY_COMPONENT = "vocabulary"
DP_SENTENCEPIECE = "dp_sentencepiece"
# The training of the parameters a run started from, when it saw the private data (JFT phase 1).
INITIAL_CHECKPOINT_COMPONENT = "initial_checkpoint"


def insecure_noise_warning(what: str) -> str:
  """The one line that says a report with predictable noise is no privacy guarantee."""
  return (f"NO PRIVACY GUARANTEE: the noise of {what} came from a fixed seed (insecure, for tests and "
          "reproductions only): it is predictable, so the ε reported is not a guarantee")


def report_noise_secret(report: Dict[str, Any]) -> bool:
  """Whether a DP report's noise was secret: False when it records a fixed (insecure) seed."""
  return not (report.get("noise_secret") is False or report.get("insecure_seed") is not None
              or report.get("noise_seed") == "insecure_fixed_seed")


def report_path(directory: str) -> str:
  """The privacy report of a run directory, an export or a vocabulary's folder."""
  return os.path.join(directory, REPORT_FILENAME)


def summary_path(model_dir: str) -> str:
  """A training run's summary."""
  return os.path.join(model_dir, SUMMARY_FILENAME)


def write_report(path: str, report: Dict[str, Any], *, sort_keys: bool = True) -> str:
  """Writes a privacy report atomically (the one writer of `privacy_report.json`); returns `path`."""
  return write_json_atomic(path, report, sort_keys=sort_keys)


def read_report(path: str) -> Dict[str, Any]:
  """A privacy report (a JSON object); `DataError` when missing or not one."""
  if not os.path.isfile(path):
    raise DataError(f"privacy report not found: {path}")
  try:
    with open(path) as f:
      data = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise DataError(f"{path}: expected a JSON object")
  return data


def write_summary(model_dir: str, summary: Dict[str, Any]) -> str:
  """Writes MODEL_DIR/summary.json atomically (its one writer); returns its path."""
  return write_json_atomic(summary_path(model_dir), summary)


def no_guarantee_report() -> Dict[str, Any]:
  """The report of weights that come without a privacy report: no guarantee (ε = ∞)."""
  return {"private": False, "epsilon": None,
          "statement": "no privacy report: these weights carry no differential-privacy guarantee (ε = ∞)"}


# -- DP-SentencePiece's report -----------------------------------------------------------------

def vocabulary_report_path(vocab_path: str) -> str:
  """Where DP-SentencePiece writes a vocabulary's report: `privacy_report.json` in its folder."""
  return report_path(os.path.dirname(os.path.abspath(vocab_path)))


def find_vocabulary_report(vocab_path: Optional[str]) -> Optional[str]:
  """The DP-SentencePiece report of a vocabulary, if one lies beside it.

  Looks at `vocabulary_report_path`, then at the names older runs used,
  `<vocab>.privacy_report.json` and `<vocab without .model>.privacy_report.json`, and returns the
  first that names this vocabulary by content hash; when none does, the first that exists (the
  ledger then records the vocabulary as non-private and says why), else None.
  """
  if not vocab_path:
    return None
  candidates = [vocabulary_report_path(vocab_path), vocab_path + "." + REPORT_FILENAME,
                os.path.splitext(vocab_path)[0] + "." + REPORT_FILENAME]
  existing = [path for path in dict.fromkeys(candidates) if os.path.isfile(path)]
  for path in existing:
    try:
      report = read_report(path)
    except DataError:
      continue
    if vocabulary_report_mismatch(report, vocab_path) is None:
      return path
  return existing[0] if existing else None


def vocabulary_report(params: Dict[str, Any], *, model_bytes: bytes, insecure_seed: Optional[int],
                      **fields) -> Dict[str, Any]:
  """A DP-SentencePiece report: the privacy fields training composes, then `fields`.

  `params` are the release's accounting (`accounting.thresholded_gaussian_parameters`),
  `model_bytes` the vocabulary's `.model` (named by hash, `vocab_sha256`: training composes the
  report only into runs whose vocabulary has this hash), `insecure_seed` the fixed noise seed
  (None: OS entropy); `fields` (diagnostics) come after them, in order.
  """
  report = {"mechanism": DP_SENTENCEPIECE, "privacy_unit": "document", **params, **fields}
  report["vocab_sha256"] = hashlib.sha256(model_bytes).hexdigest()
  report["noise_seed"] = "insecure_fixed_seed" if insecure_seed is not None else "os_entropy"
  # Whether the noise was secret: a training ledger composes this vocabulary with the flag, and
  # the report says in one line that a fixed seed makes its ε no guarantee.
  report["noise_secret"] = insecure_seed is None
  report["warnings"] = []
  if insecure_seed is not None:
    report["insecure_seed"] = int(insecure_seed)
    report["warnings"].append(insecure_noise_warning("this DP-SentencePiece vocabulary (--insecure_seed)"))
  return report


def vocabulary_report_mismatch(report: Dict[str, Any], vocab_path: str) -> Optional[str]:
  """Why a DP-SentencePiece report does not describe `vocab_path` (None when it does).

  The report must name the vocabulary by the SHA-256 of its `.model` bytes (`vocab_sha256`);
  where it lies says nothing about which vocabulary it describes.
  """
  recorded = report.get("vocab_sha256")
  if not isinstance(recorded, str) or not recorded:
    return ("its privacy report names no vocabulary hash (written by an older dp-spm); re-run "
            "`private-t5 dp-spm` to write a report that names the vocabulary it describes")
  if not os.path.isfile(vocab_path):
    return f"the vocabulary {vocab_path} does not exist"
  actual = file_sha256(vocab_path)
  if recorded != actual:
    return (f"its privacy report describes another vocabulary (sha256 {recorded[:12]}…, this one is "
            f"{actual[:12]}…)")
  return None


def vocabulary_report_event(report: Dict[str, Any]) -> Optional[Dict[str, float]]:
  """The event of a DP-SentencePiece report: its Gaussian noise multiplier σ/k with δ_g, and δ_t.

  None when the report does not give them (an older report) or they do not add up to its δ.
  """
  try:
    event = {"noise_multiplier": float(report["noise_multiplier"]),
             "delta_gaussian": float(report["delta_gaussian"]),
             "delta_threshold": float(report["delta_threshold"])}
  except (KeyError, TypeError, ValueError):
    return None
  if not (event["noise_multiplier"] > 0 and math.isfinite(event["noise_multiplier"])) or not math.isclose(
      event["delta_gaussian"] + event["delta_threshold"], float(report["delta"]), rel_tol=1e-9):
    return None
  return event


# -- a training run's report: what its ledger has spent ----------------------------------------

def ledger_report(ledger) -> Dict[str, Any]:
  """The JSON-ready report of a `PrivacyLedger`'s guarantee (`PrivacyLedger.report`).

  The ledger's fields (`to_dict`), then: `epsilon`/`delta`, the totals over training and
  components (ε null, i.e. ∞, for a non-private run or a non-private vocabulary): ε is the
  smaller of `epsilon_by_events` and `epsilon_by_addition` (`total_epsilon`), and `composition`
  says in one line which, with both numbers; `training_epsilon` is DP-Adafactor's own ε;
  `vocabulary` is `vocabulary_status`; `accounting_delta` is the δ the training ε is computed at;
  `noise_secret` is False when any noise came from a fixed seed; a correlated-noise run also
  names its `mechanism` (`correlated_mechanism`), `strategy_digest`, `num_bands` (b) and the
  strategy's `sensitivity` per unit clip norm; `warnings` has one line per
  reason the ε is no guarantee as it reads (`report_warnings`); with an initial checkpoint component,
  `epsilon_without_initial_checkpoint` / `delta_without_initial_checkpoint` are this run's share
  alone; `ledger` holds the exact fields for `PrivacyLedger.from_dict`.
  """
  def finite(x):
    return None if math.isinf(x) else x
  out = ledger.to_dict()
  out.update(
      epsilon=finite(ledger.total_epsilon()), delta=ledger.total_delta(), accounting_delta=ledger.delta,
      training_epsilon=finite(ledger.training_epsilon()), training_delta=ledger.training_delta(),
      total_epsilon=finite(ledger.total_epsilon()), total_delta=ledger.total_delta(),
      truncation_delta=(0.0 if ledger.non_private else ledger.training_delta() - ledger.delta),
      dp=not ledger.non_private, vocabulary=vocabulary_status(ledger.components),
      batch_size=ledger.max_batch_size if ledger.max_batch_size is not None else ledger.configured_batch_size,
      epsilon_rdp=None, epsilon_pld=None, accountant_used=ledger.accountant_used(),
      clipping_method=ledger.clipping_method, noise_secret=ledger.noise_secret_everywhere(),
      epsilon_by_events=ledger.epsilon_by_events(),
      epsilon_by_addition=None if ledger.non_private else finite(ledger.epsilon_by_addition()),
      composition=composition(ledger),
      warnings=report_warnings(ledger),
      ledger=ledger.to_dict(),
  )
  if getattr(ledger, "correlated", False):
    out.update(mechanism=correlated_mechanism(ledger), strategy_digest=ledger.strategy_digest,
               sensitivity=ledger.strategy_sensitivity, num_bands=ledger.num_bands)
  if any(c["name"] == INITIAL_CHECKPOINT_COMPONENT for c in ledger.components):
    exclude = (INITIAL_CHECKPOINT_COMPONENT,)
    out.update(epsilon_without_initial_checkpoint=finite(ledger.total_epsilon(exclude)),
               delta_without_initial_checkpoint=ledger.total_delta(exclude))
  if not ledger.non_private and ledger.steps:
    for name, eps in ledger.epsilons().items():
      out[f"epsilon_{name}"] = eps
  elif not ledger.non_private:
    out.update(epsilon_rdp=0.0, epsilon_pld=0.0 if not ledger.fixed_batches else None)
  return out


def correlated_mechanism(ledger) -> str:
  """A correlated-noise report's `mechanism`, in one line."""
  s = ledger.strategy
  if ledger.noise == NoiseKind.BANDED:
    return (f"banded matrix factorization, {len(s['coefs'])} bands, cyclic Poisson sampling in b={ledger.num_bands} "
            "groups, amplified (Choquette-Choo et al. 2023)")
  return (f"BLT matrix factorization, {len(s['buf_decay'])} buffers, cyclic Poisson sampling in b={ledger.num_bands} "
          "groups, min-separation sensitivity, not amplified (Dvijotham et al. 2024)")


def vocabulary_status(components: Sequence[Dict[str, Any]]) -> Optional[str]:
  """A report's `vocabulary`: "dp" (a DP report is composed), "public", "not private", or None
  (none recorded), from a ledger's components."""
  status = None
  for c in components:
    if c["name"] == INITIAL_CHECKPOINT_COMPONENT:
      continue
    if c["name"] == VOCABULARY_COMPONENT:
      if not c.get("public"):
        return "not private"
      status = "public"
    elif "epsilon" in c:
      status = status or "dp"
  return status


def report_warnings(ledger) -> List[str]:
  """A report's `warnings`: one line per reason the ledger's ε is not the guarantee it reads as."""
  if ledger.non_private:
    return []
  lines = []
  if not ledger.noise_secret:
    lines.append(insecure_noise_warning("this training run (train.insecure_deterministic_seed)"))
  for c in ledger.components:
    if not c.get("noise_secret", True):
      lines.append(insecure_noise_warning(f"the composed {c['name']} ({c.get('source', '')})"))
    if c["name"] == INITIAL_CHECKPOINT_COMPONENT and not c.get("private", True):
      lines.append(c["reason"])
  return lines


def composition(ledger, exclude: Sequence[str] = ()) -> Optional[str]:
  """A report's `composition`: how the ledger's `total_epsilon` composes training with its
  components, in one line (None: none counted).

  "events" lines name both numbers (by events, and the sum it is checked against); "addition"
  lines say why the components were not composed by events.
  """
  components = ledger.dp_components(exclude)
  if ledger.non_private or not components or math.isinf(ledger.epsilon_by_addition(exclude)):
    return None
  added = ledger.epsilon_by_addition(exclude)
  parts = " + ".join([f"training {ledger.training_epsilon():.4g}"]
                     + [f"{c['name']} {c['epsilon']:.4g}" for c in components])
  by_events = ledger.epsilon_by_events(exclude)
  if by_events is not None and by_events <= added:
    names = [n.upper() for n in ledger.event_accountants()]
    accountants = " and ".join(names) + (", the smaller" if len(names) > 1 else "")
    return (f"by events: ε = {by_events:.4g} (training and {', '.join(c['name'] for c in components)} "
            f"composed as DP events by {accountants}); by addition it would be "
            f"{parts} = {added:.4g}")
  if not ledger.steps:
    why = "no step taken yet"
  elif by_events is not None:
    why = f"composition by events gave more, ε = {by_events:.4g}"
  elif ledger.components_without_event(exclude):
    why = "; ".join(_why_no_event(c) for c in ledger.components_without_event(exclude))
  elif ledger.sampling != "poisson":
    why = "fixed batches are composed by addition only"
  else:
    why = "truncated sampling is composed by events under the PLD accountant only"
  return f"by addition: ε = {parts} = {added:.4g} (not by events: {why})"


def _why_no_event(component: Dict[str, Any]) -> str:
  """Why a composed component has no DP event (it is then added to training's ε)."""
  name, source = component["name"], component.get("source", "")
  if component.get("group_privacy"):
    return f"{name} ({source}) is composed at another privacy unit, by group privacy"
  if name == INITIAL_CHECKPOINT_COMPONENT:
    return f"the initial checkpoint's training ({source}) is composed at its (ε, δ)"
  return (f"the report {source} records no Gaussian event (σ/k, δ_g, δ_t: written by an older "
          "dp-spm; re-run `private-t5 dp-spm` for one that does)")
