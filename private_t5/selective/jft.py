"""Just Fine-tune Twice (JFT, Shi et al. 2022): selective DP in two training phases.

`just_fine_tune_twice` runs both phases (the `private-t5 jft` stage binds it with Gin). Phase 1 ("redacted fine-tune") trains on D', the corpus written by `private-t5 redact`, with
an ordinary optimizer (PHASE1_DP = None) or with light-noise DP (PHASE1_DP = a DPConfig with
its own epsilon). Phase 2 ("private fine-tune") starts from phase 1's checkpoint and trains
with DP on the full private data D. MODEL_DIR/phase1_redacted and MODEL_DIR/phase2_private are
ordinary training runs (each with its own ledger); MODEL_DIR/jft_privacy_report.json states
the selective guarantee and its assumption. Phase 2's ledger records phase 1 as its
`initial_checkpoint` component, so phase 2's own privacy_report.json states the ordinary DP
guarantee of the release: ε = ∞ (null) after an ordinary phase 1, eps_1 + eps_2 after a light-noise
one; its (eps_2, delta_2) alone is `epsilon_without_initial_checkpoint`, a selective guarantee only.

Guarantee (Shi et al. 2022, Definitions 3-4): a secret caught by the policy function F never reaches
phase 1, so with respect to F-neighbours (datasets differing in private tokens only) the
release is (eps_2, delta_2)-selective-DP, eps_2 being phase 2's epsilon. This holds only if
the detector missed nothing. A missed secret is protected by phase 2's DP plus phase 1's:
eps_1 + eps_2 with light noise (redaction maps each document to one document, so phase 1 is
eps_1-DP with respect to D as well), and not at all (epsilon = infinity) with an ordinary phase 1.
"""
import json
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from scipy import stats

from private_t5 import io as io_lib
from private_t5.dp import privacy_report
from private_t5.dp.config import DPConfig, require_gaussian
from private_t5.errors import ConfigError, DataError
from private_t5.selective import detectors
from private_t5.train import main as train_main
from private_t5.train import metrics

REPORT_FILENAME = privacy_report.JFT_REPORT_FILENAME
PHASE1_DIR = "phase1_redacted"
PHASE2_DIR = "phase2_private"


def _clopper_pearson(k: int, n: int, confidence: float = 0.95):
  alpha = 1.0 - confidence
  lo = 0.0 if k == 0 else float(stats.beta.ppf(alpha / 2, k, n - k + 1))
  hi = 1.0 if k == n else float(stats.beta.ppf(1 - alpha / 2, k + 1, n - k))
  return lo, hi


def measure_miss_rate(level: str, records: Sequence[Dict[str, Any]], backend: str = "auto") -> Dict[str, Any]:
  """Fraction of hand-labelled secrets that the detector of `level` leaves in the text.

  Args:
    level: detector level (see `detectors.LEVELS`).
    records: dicts {"text": str, "secrets": [substrings of text that are private]}.
    backend: detector backend.

  Returns:
    {"secrets", "missed", "miss_rate", "miss_rate_95ci", "examples_missed"}.
  """
  detector = detectors.SecretDetector(level, backend)
  total = missed = 0
  examples: List[str] = []
  for i, rec in enumerate(records):
    text, secrets = rec.get("text"), rec.get("secrets")
    if not isinstance(text, str) or not isinstance(secrets, list):
      raise DataError(f"miss-rate sample record {i} needs 'text' (string) and 'secrets' (list)")
    redacted = detector.redact(text)
    for s in secrets:
      if s not in text:
        raise DataError(f"miss-rate sample record {i}: secret {s!r} does not occur in its text")
      total += 1
      if s in redacted:
        missed += 1
        if len(examples) < 10:
          examples.append(s)
  if total == 0:
    raise DataError("the miss-rate sample holds no secrets")
  return {"level": level, "secrets": total, "missed": missed, "miss_rate": missed / total,
          "miss_rate_95ci": _clopper_pearson(missed, total), "examples_missed": examples}


def load_miss_rate_sample(path: str) -> List[Dict[str, Any]]:
  if not os.path.isfile(path):
    raise DataError(f"miss-rate sample not found: {path}")
  with open(path) as f:
    try:
      return [json.loads(line) for line in f if line.strip()]
    except json.JSONDecodeError as e:
      raise DataError(f"{path}: not valid JSONL ({e.msg})") from None


def jft_privacy_report(phase1: Dict[str, Any], phase2: Dict[str, Any], *, detector_level: Optional[str],
                       redaction_report: Optional[Dict[str, Any]] = None,
                       miss_rate: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
  """The selective guarantee of a JFT run from both phases' privacy reports (ledger `report()`s).

  Phase 2's own share is read without its `initial_checkpoint` component (phase 1) when it has one.
  """
  if not phase2.get("dp"):
    raise ConfigError("JFT phase 2 must be differentially private (PHASE2 DP = a DPConfig)")
  # A report's ε is None (∞) when a component, e.g. a non-private vocabulary, is not DP.
  own = "_without_initial_checkpoint" if "epsilon_without_initial_checkpoint" in phase2 else ""
  eps2 = math.inf if phase2.get("epsilon" + own) is None else float(phase2["epsilon" + own])
  delta2 = float(phase2["delta" + own])
  phase1_dp = bool(phase1.get("dp"))
  eps1 = (math.inf if phase1.get("epsilon") is None else float(phase1["epsilon"])) if phase1_dp else math.inf
  delta1 = float(phase1["delta"]) if phase1_dp else 0.0
  missed_eps = eps1 + eps2
  statement = (
      f"({eps2:.4g}, {delta2:.3g})-selective DP with respect to the policy function of level "
      f"{detector_level!r} (Shi et al. 2022): secrets the detector caught never reached phase 1. ASSUMPTION: the "
      f"detector missed no secret in D'. ")
  if phase1_dp:
    statement += (f"A missed secret is still covered by ordinary DP over both phases: "
                  f"({missed_eps:.4g}, {delta1 + delta2:.3g}) by simple composition (phase 1 light noise "
                  f"ε1 = {eps1:.4g} + phase 2 ε2 = {eps2:.4g}).")
  else:
    statement += ("Phase 1 used an ordinary (non-private) optimizer on D', so a secret the detector missed "
                  "has NO formal protection (ε = ∞).")
  if miss_rate is not None:
    lo, hi = miss_rate["miss_rate_95ci"]
    statement += (f" Measured miss rate on a hand-checked sample: {miss_rate['missed']}/{miss_rate['secrets']} "
                  f"= {miss_rate['miss_rate']:.2%} (95% CI {lo:.2%}–{hi:.2%}).")
  return {
      "mechanism": "Just Fine-tune Twice (Shi et al. 2022): phase 1 on the redacted corpus D', phase 2 DP on D",
      "guarantee": "selective differential privacy",
      "epsilon_s": None if math.isinf(eps2) else eps2,
      "delta_s": delta2,
      "assumption": "the secret detector missed no private token (D' holds no secret)",
      "epsilon_if_detector_missed": None if math.isinf(missed_eps) else missed_eps,
      "delta_if_detector_missed": delta1 + delta2 if phase1_dp else None,
      "phase1": {"dp": phase1_dp, "epsilon": None if math.isinf(eps1) else eps1,
                 "delta": delta1 if phase1_dp else None, "steps": phase1.get("steps"),
                 "noise_multiplier": phase1.get("noise_multiplier") if phase1_dp else None},
      "phase2": {"epsilon": None if math.isinf(eps2) else eps2, "delta": delta2, "steps": phase2.get("steps"),
                 "noise_multiplier": phase2.get("noise_multiplier"), "sampling_rate": phase2.get("sampling_rate"),
                 "privacy_unit": phase2.get("privacy_unit")},
      "detector_level": detector_level,
      "redaction": ({k: redaction_report.get(k) for k in ("source", "output", "level", "backends", "fallbacks",
                                                          "fully_redacted_skipped")}
                    if redaction_report else None),
      "private_token_fraction": (redaction_report["levels"][redaction_report["level"]]["pct"]
                                 if redaction_report else None),
      "miss_rate": miss_rate,
      "statement": statement,
  }


def just_fine_tune_twice(*, model_dir: str, redacted_data, full_data, phase1_steps: int, phase2_steps: int,
                         phase2_dp, phase1_dp=None, detector_level: Optional[str] = None,
                         redaction_report_path: Optional[str] = None,
                         miss_rate_sample: Optional[str] = None, train_fn: Optional[Callable] = None,
                         log: Callable[[str], None] = print, **train_kwargs) -> Dict[str, Any]:
  """Runs both JFT phases and writes MODEL_DIR/jft_privacy_report.json; returns the report.

  Args:
    model_dir: parent directory of the two phase runs.
    redacted_data: `ExampleSource` of D' (phase 1).
    full_data: `ExampleSource` of the private data D (phase 2).
    phase1_steps, phase2_steps: optimizer steps of each phase.
    phase2_dp: `DPConfig` of phase 2 (required: JFT's phase 2 is private).
    phase1_dp: None (ordinary optimizer on D') or a light-noise `DPConfig`.
    detector_level: level D' was redacted at (read from the redaction report when given).
    redaction_report_path: the `private-t5 redact` report of D'.
    miss_rate_sample: JSONL of hand-checked {"text", "secrets"} records: the detector's miss
      rate on it goes into the report.
    train_fn: the trainer (default `train.main.train`).
    **train_kwargs: passed to both phases (model_config, batch_size, validation_data, ...).
  """
  if phase2_dp is None:
    raise ConfigError("JFT phase 2 must be differentially private: give phase2_dp (a DPConfig)")
  train_main.check_train_kwargs(train_kwargs, "just_fine_tune_twice")
  # Phase 2's privacy settings are checked against its data before phase 1 trains (phase 1's
  # are checked when its mechanism is built, at once).
  if not isinstance(phase2_dp, DPConfig) or not isinstance(phase1_dp, (DPConfig, type(None))):
    raise ConfigError("phase1_dp and phase2_dp must be DPConfigs (@DPConfig(); phase1_dp may be None)")
  for phase_dp in (phase1_dp, phase2_dp):
    require_gaussian(phase_dp, "JFT (its phases' ledgers compose per-step Gaussian events)")
  if train_kwargs.get("batch_size") is not None:
    phase2_dp.check_data(num_examples=full_data.num_examples, batch_size=train_kwargs["batch_size"])
  if train_fn is None:
    train_fn = train_main.train
  redaction_report = None
  if redaction_report_path:
    if not os.path.isfile(redaction_report_path):
      raise DataError(f"redaction report not found: {redaction_report_path}")
    with open(redaction_report_path) as f:
      redaction_report = json.load(f)
    detector_level = detector_level or redaction_report.get("level")
  miss_rate = None
  if miss_rate_sample:
    miss_rate = measure_miss_rate(detector_level or "entity", load_miss_rate_sample(miss_rate_sample))
  phase1_dir = os.path.join(model_dir, PHASE1_DIR)
  phase2_dir = os.path.join(model_dir, PHASE2_DIR)
  if "privacy_hook" in train_kwargs:
    raise ConfigError("just_fine_tune_twice sets phase 2's privacy_hook itself")
  log(f"[jft] phase 1: {'light-noise DP' if phase1_dp is not None else 'ordinary'} training on the redacted "
      f"corpus ({redacted_data.num_examples} examples, {phase1_steps} steps) -> {phase1_dir}")
  s1 = train_fn(model_dir=phase1_dir, train_data=redacted_data, train_steps=phase1_steps, dp=phase1_dp,
                **train_kwargs)
  log(f"[jft] phase 2: DP training on the full data ({full_data.num_examples} examples, {phase2_steps} steps) "
      f"from phase 1's checkpoint -> {phase2_dir}")
  phase1_report = privacy_report.read_report(s1["privacy_report"])
  s2 = train_fn(model_dir=phase2_dir, train_data=full_data, train_steps=phase2_steps, dp=phase2_dp,
                initial_checkpoint=phase1_dir, privacy_hook=phase1_in_ledger(phase1_report, phase1_dir),
                **train_kwargs)
  phase2_report = privacy_report.read_report(s2["privacy_report"])
  report = jft_privacy_report(phase1_report, phase2_report, detector_level=detector_level,
                              redaction_report=redaction_report, miss_rate=miss_rate)
  # Validation documents are held out of the private corpus: their metrics are not DP.
  report.update(phase1_model_dir=os.path.abspath(phase1_dir), phase2_model_dir=os.path.abspath(phase2_dir),
                phase1_validation=metrics.validation_metrics(s1), phase2_validation=metrics.validation_metrics(s2),
                not_dp=["phase1_validation", "phase2_validation", "private_token_fraction"])
  path = io_lib.write_json_atomic(os.path.join(model_dir, REPORT_FILENAME), report)
  log(f"[jft] {report['statement']}")
  log(f"[jft] report: {path}")
  report["report_path"] = os.path.abspath(path)
  return report


def phase1_in_ledger(phase1_report: Dict[str, Any], phase1_dir: str) -> train_main.PrivacyHook:
  """The `train` privacy hook of phase 2: its ledger records phase 1 as the initial checkpoint.

  Phase 1 trained on a redacted copy of phase 2's data, so phase 2's privacy report does not
  present phase 2's (ε, δ) as the release's guarantee: with an ordinary phase 1 its ε is ∞, with a
  light-noise one it composes phase 1's ε.
  """
  note = (f"trained {'with' if phase1_report.get('dp') else 'WITHOUT'} DP on a redacted copy of this data "
          f"(JFT phase 1; the selective guarantee is in ../{REPORT_FILENAME})")

  def hook(setup, data) -> train_main.PrivacyOverride:
    setup.ledger.add_initial_checkpoint(phase1_report, phase1_dir, note)
    return train_main.PrivacyOverride(mechanism=setup, source=data)
  return hook
