"""The privacy ledger (`privacy_report.json`): what one DP training run has spent so far.

This module owns every report's file name and its writer: a run's `privacy_report.json`
(`write_report`) and `summary.json` (`write_summary`), DP-SentencePiece's report and where it
lies beside its vocabulary (`vocabulary_report_path`, `find_vocabulary_report`), and the names
of the adaptive-DP and JFT reports.

A ledger covers ONE mechanism: fixed σ, q, C, δ, sampling scheme and privacy unit. Resuming
adds steps; changing any of these on resume is refused. Other DP releases computed from the
same data (e.g. the DP-SentencePiece vocabulary) are composed in as `components`. δ adds up;
ε is the smaller of two bounds of the same release at that δ: the sum (simple composition,
Ponomareva et al. 2022, Appendix C) and, where every component records its DP event (a
DP-SentencePiece report at the training unit), the composition of training's and the
components' events by the accountant (`epsilon_by_events`), never more than the sum.

The vocabulary is always a component. Its DP-SentencePiece report is composed only when the
report names this vocabulary by content hash (`vocab_sha256`) and its privacy unit is at least
as strong as the training unit (at a stronger unit by group privacy, see `group_privacy`);
otherwise the vocabulary is recorded as non-private and the total ε is ∞, unless it is declared
public (not built from the private data).

A guarantee needs secret noise: a run (or a component) whose noise came from a fixed seed is
recorded with `noise_secret: false`, and its report says in one line (`warnings`) that its ε is
no guarantee.
"""
import dataclasses
import hashlib
import json
import logging
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from private_t5.dp import accounting
from private_t5.errors import DataError, PrivacyError
from private_t5.io import file_sha256, write_json_atomic

PRIVACY_UNITS = ("document", "example", "user")
LEDGER_VERSION = 1
REPORT_FILENAME = "privacy_report.json"
SUMMARY_FILENAME = "summary.json"
ADAPTIVE_REPORT_FILENAME = "adaptive_dp_report.json"
JFT_REPORT_FILENAME = "jft_privacy_report.json"
# Fields that define the mechanism; a resumed run must keep them unchanged.
_MECHANISM_FIELDS = ("noise_multiplier", "sampling_rate", "clip_norm", "delta", "privacy_unit",
                     "sampling", "max_batch_size", "non_private")
VOCABULARY_COMPONENT = "vocabulary"
DP_SENTENCEPIECE = "dp_sentencepiece"
# The training of the parameters a run started from, when it saw the private data (JFT phase 1).
INITIAL_CHECKPOINT_COMPONENT = "initial_checkpoint"
# A user's data holds whole documents, and a document holds whole examples (chunks). Larger is
# stronger: a guarantee at a stronger unit covers a weaker one by group privacy (`check_unit`).
_UNIT_STRENGTH = {"example": 0, "document": 1, "user": 2}


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
  return _read_json(path)


def write_summary(model_dir: str, summary: Dict[str, Any]) -> str:
  """Writes MODEL_DIR/summary.json atomically (its one writer); returns its path."""
  return write_json_atomic(summary_path(model_dir), summary)


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
      report = _read_json(path)
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


def no_guarantee_report() -> Dict[str, Any]:
  """The report of weights that come without a privacy report: no guarantee (ε = ∞)."""
  return {"private": False, "epsilon": None,
          "statement": "no privacy report: these weights carry no differential-privacy guarantee (ε = ∞)"}


def group_privacy(epsilon: float, delta: float, size: int) -> tuple:
  """(ε, δ)-DP for one unit, as a guarantee for `size` units: (kε, δ·(1 + e^ε + … + e^((k-1)ε)))."""
  if size == 1:
    return epsilon, delta
  return size * epsilon, delta * sum(math.exp(min(i * epsilon, 700.0)) for i in range(size))


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


@dataclasses.dataclass
class PrivacyLedger:
  """Privacy spent by a DP training run, serialisable to JSON.

  Attributes:
    noisy_sum: the released sum's C, σ and divisor q·N (`accounting.NoisySum`): the same
      object the run's aggregator computes with (None for a non-private baseline). The JSON
      form keeps them as the flat fields `clip_norm`, `noise_multiplier`, `expected_batch_size`,
      which are also read here as properties.
    sampling_rate: q, the Poisson sampling rate (expected batch size / N).
    delta: δ of the Gaussian steps (truncation accounted by RDP adds to it, see `training_delta`).
    accountant: "auto" (the smaller ε of RDP and PLD, `accountant_used`), "rdp" or "pld".
    privacy_unit: "document", "example" or "user".
    num_examples: N, the sampling population (units).
    max_batch_size: truncation cap of a Poisson batch (None: not truncated).
    truncation_probability: per-step P[Poisson batch > max_batch_size].
    steps: steps taken so far.
    components: other mechanisms composed in: dicts {"name", "epsilon", "delta", "source"}, or
      {"name": "vocabulary", "private": false, "public", "source"} for a vocabulary without a
      matching DP report (`add_vocabulary`), or {"name": "initial_checkpoint", ...} for the
      training of the parameters the run started from (`add_initial_checkpoint`). A component
      whose noise was not secret has "noise_secret": false.
    non_private: True for a non-private baseline (ε = ∞).
    sampling: "poisson" or "fixed" (fixed batches, accounted without replacement).
    configured_batch_size: the run's configured (padded) batch size, for the report.
    clipping_method: how the clipped sum was computed ("ghost" or "vmap"), for the report.
    noise_secret: False when the training noise came from a fixed seed (insecure: the ε reported
      is then no guarantee); once False it stays False on resume.
    population: public facts on what the N units are, given by the training data when it is not
      one of our corpora (a seqio Task or Mixture: its tasks, their example counts, and whether
      the privacy unit is the user's declaration); None: the data's description says it.
  """
  noisy_sum: Optional[accounting.NoisySum]
  sampling_rate: float
  delta: float
  accountant: str = "rdp"
  privacy_unit: str = "document"
  num_examples: Optional[int] = None
  max_batch_size: Optional[int] = None
  truncation_probability: float = 0.0
  steps: int = 0
  components: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
  non_private: bool = False
  sampling: str = "poisson"
  configured_batch_size: Optional[int] = None
  clipping_method: Optional[str] = None
  noise_secret: bool = True
  population: Optional[Dict[str, Any]] = None

  def __post_init__(self):
    self._epsilon_cache: Dict[Any, Dict[str, float]] = {}
    self._by_events_cache: Dict[Any, Optional[float]] = {}
    if self.privacy_unit not in PRIVACY_UNITS:
      raise PrivacyError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {self.privacy_unit!r}")
    if int(self.steps) != self.steps or self.steps < 0:
      raise PrivacyError(f"ledger steps must be an integer >= 0, got {self.steps!r}")
    self.steps = int(self.steps)
    if self.non_private:
      if self.noisy_sum is not None:
        raise PrivacyError("a non-private ledger records no noisy sum")
      return
    if not isinstance(self.noisy_sum, accounting.NoisySum):
      raise PrivacyError(f"a DP ledger needs its accounting.NoisySum, got {self.noisy_sum!r}")
    accounting.validate_privacy_params(
        noise_multiplier=self.noise_multiplier, sampling_rate=self.sampling_rate, delta=self.delta,
        accountant=self.accountant, num_examples=self.num_examples, sampling=self.sampling)
    if self.num_examples is not None:
      if self.max_batch_size is not None and not self.truncation_probability:
        self.truncation_probability = accounting.truncation_probability(
            self.num_examples, self.sampling_rate, self.max_batch_size)

  @classmethod
  def create(cls, *, delta: float, num_examples: int, noisy_sum: Optional[accounting.NoisySum] = None,
             noise_multiplier: Optional[float] = None, clip_norm: Optional[float] = None,
             sampling_rate: Optional[float] = None, batch_size: Optional[float] = None,
             max_batch_size: Optional[int] = None, accountant: str = "rdp",
             privacy_unit: str = "document", sampling: str = "poisson",
             configured_batch_size: Optional[int] = None,
             clipping_method: Optional[str] = None, noise_secret: bool = True,
             population: Optional[Dict[str, Any]] = None) -> "PrivacyLedger":
    """A fresh ledger from the run's configuration (q from `sampling_rate` or `batch_size`/N).

    `noisy_sum` is the run's (shared with its aggregator; its q·N must be q·N here: DP rule
    "sampling matches accounting"); without it one is made from `noise_multiplier` and
    `clip_norm` with divisor q·N.
    """
    if (sampling_rate is None) == (batch_size is None):
      raise PrivacyError("give exactly one of sampling_rate and batch_size")
    if sampling_rate is None:
      accounting.validate_privacy_params(num_examples=num_examples, batch_size=batch_size)
      sampling_rate = accounting.sampling_rate_from_batch(batch_size, num_examples)
    expected = float(sampling_rate) * int(num_examples)
    if noisy_sum is None:
      noisy_sum = accounting.NoisySum(clip_norm, noise_multiplier, expected)
    elif not math.isclose(noisy_sum.expected_batch_size, expected, rel_tol=1e-9):
      raise PrivacyError(f"the noisy sum is divided by q·N = {noisy_sum.expected_batch_size:g}, but the "
                         f"sampler's q·N is {expected:g}: sampling must match accounting")
    return cls(noisy_sum=noisy_sum, sampling_rate=float(sampling_rate), delta=float(delta),
               accountant=accountant, privacy_unit=privacy_unit, num_examples=int(num_examples),
               max_batch_size=max_batch_size, sampling=sampling, configured_batch_size=configured_batch_size,
               clipping_method=clipping_method, noise_secret=bool(noise_secret), population=population)

  @classmethod
  def non_private_baseline(cls, *, num_examples: Optional[int] = None, privacy_unit: str = "document",
                           batch_size: Optional[float] = None, noise_secret: bool = True,
                           population: Optional[Dict[str, Any]] = None) -> "PrivacyLedger":
    """A ledger for a non-private run: records steps, reports ε = ∞ (null in JSON)."""
    q = (batch_size / num_examples) if (batch_size and num_examples) else 0.0
    return cls(noisy_sum=None, sampling_rate=q, delta=0.0, privacy_unit=privacy_unit,
               num_examples=num_examples, non_private=True, configured_batch_size=batch_size,
               noise_secret=bool(noise_secret), population=population)

  @property
  def noise_multiplier(self) -> float:
    """σ of the noisy sum (0 for a non-private baseline)."""
    return self.noisy_sum.noise_multiplier if self.noisy_sum is not None else 0.0

  @property
  def clip_norm(self) -> float:
    """C of the noisy sum (0 for a non-private baseline)."""
    return self.noisy_sum.clip_norm if self.noisy_sum is not None else 0.0

  @property
  def expected_batch_size(self) -> Optional[float]:
    """q·N, the public divisor of the noisy sum (a non-private run: its batch size)."""
    return self.noisy_sum.expected_batch_size if self.noisy_sum is not None else self.configured_batch_size

  # -- bookkeeping ------------------------------------------------------------------------------

  def record_steps(self, n: int = 1) -> None:
    """Adds `n` steps taken."""
    if int(n) != n or n < 0:
      raise PrivacyError(f"record_steps needs an integer >= 0, got {n!r}")
    self.steps += int(n)

  def add_component(self, name: str, epsilon: float, delta: float, source: str = "",
                    vocab_sha256: Optional[str] = None, noise_secret: bool = True,
                    details: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Composes another (ε, δ)-DP release on the same data, once; returns its entry.

    A release already in the ledger is not composed again (e.g. re-added on resume): the same
    vocabulary by content hash (`vocab_sha256`, so a moved or copied run directory still
    counts it once), else the same `source`. A release whose noise was not secret is recorded
    with "noise_secret": false; `details` (JSON-able) are stored in the entry as they are.
    """
    epsilon = float(epsilon)
    delta = float(delta)
    if not (epsilon >= 0 and math.isfinite(epsilon)) or not 0 <= delta < 1:
      raise PrivacyError(f"component {name!r} has invalid (ε, δ) = ({epsilon}, {delta})")
    for c in self.components:
      same_vocabulary = vocab_sha256 is not None and c.get("vocab_sha256") == vocab_sha256
      if c["name"] == name and (same_vocabulary or c.get("source", "") == source):
        if math.isclose(c["epsilon"], epsilon) and math.isclose(c["delta"], delta):
          if not noise_secret:
            c["noise_secret"] = False
          return c  # already composed
        raise PrivacyError(f"component {name!r} from {source!r} is already in the ledger with "
                           f"(ε, δ) = ({c['epsilon']}, {c['delta']}), not ({epsilon}, {delta})")
    entry = {"name": name, "epsilon": epsilon, "delta": delta, "source": source, **(details or {})}
    if vocab_sha256 is not None:
      entry["vocab_sha256"] = vocab_sha256
    if not noise_secret:
      entry["noise_secret"] = False
    self.components.append(entry)
    return entry

  def add_component_from_report(self, path: str) -> Dict[str, Any]:
    """Composes a DP-SentencePiece `privacy_report.json` (its `epsilon` and `delta`).

    A report at a stronger unit than training's (a document-level vocabulary, example-level
    training) is composed by group privacy (`check_unit`): its own (ε, δ) are kept in the entry
    as "group_privacy". A report whose noise was not secret is composed with "noise_secret": false.

    Raises:
      PrivacyError: the report's privacy unit is weaker than this ledger's (`check_unit`).
    """
    report = _read_json(path)
    for key in ("epsilon", "delta"):
      if not isinstance(report.get(key), (int, float)):
        raise DataError(f"{path}: privacy report has no numeric {key!r}")
    name = str(report.get("mechanism", "dp_sentencepiece"))
    unit = report.get("privacy_unit", "document")
    size = self.check_unit(unit, f"{name} ({path})")
    epsilon, delta = group_privacy(float(report["epsilon"]), float(report["delta"]), size)
    details = None
    if size > 1:
      details = {"group_privacy": {"size": size, "privacy_unit": unit, "epsilon": float(report["epsilon"]),
                                   "delta": float(report["delta"])}}
      if delta >= 1:
        raise PrivacyError(
            f"{name} ({path}) is {unit}-level DP with (ε, δ) = ({report['epsilon']:g}, {report['delta']:g}); as a "
            f"{self.privacy_unit}-level guarantee (group privacy, 2 {unit}s) its δ is {delta:.3g} >= 1: no "
            f"guarantee; train the vocabulary with a smaller ε, or train at the {unit} unit")
    event = _threshold_release_event(report) if size == 1 else None
    if event is not None:
      details = {"event": event}
    vocab_sha256 = report.get("vocab_sha256")
    return self.add_component(name, epsilon, delta, source=os.path.abspath(path),
                              vocab_sha256=vocab_sha256 if isinstance(vocab_sha256, str) and vocab_sha256 else None,
                              noise_secret=report_noise_secret(report), details=details)

  def check_unit(self, unit: str, what: str) -> int:
    """The group size at which a guarantee at `unit` composes into this ledger's unit.

    1 at the same unit. 2 at a stronger unit: removing one example (a chunk of one document)
    changes that document, which for a document-level release is a substitution (remove the
    document, add the changed one), so a document-level (ε, δ) covers it as (2ε, (1 + e^ε)·δ)
    (`group_privacy`); the same holds for a user-level release and document- or example-level
    training. A weaker unit is refused: a document-level ε covers a user with K documents only as
    K·ε, and K is not bounded.

    Raises:
      PrivacyError: `unit` is unknown or weaker than training's.
    """
    if unit not in _UNIT_STRENGTH:
      raise PrivacyError(f"{what}: unknown privacy_unit {unit!r} (expected one of {PRIVACY_UNITS})")
    if _UNIT_STRENGTH[unit] < _UNIT_STRENGTH[self.privacy_unit]:
      raise PrivacyError(
          f"{what} is {unit}-level DP but training is {self.privacy_unit}-level: one "
          f"{self.privacy_unit} with K {unit}s costs up to K·ε of it (group privacy), so its ε cannot "
          f"be composed as is; dp-spm trains document-level vocabularies only, so train the "
          f"vocabulary at the {self.privacy_unit} unit, or use a vocabulary built without the private "
          f"data (VOCAB_IS_PUBLIC=True)")
    return 2 if _UNIT_STRENGTH[unit] > _UNIT_STRENGTH[self.privacy_unit] else 1

  def add_vocabulary(self, vocab_path: str, report_path: Optional[str] = None, *,
                     public: bool = False) -> Dict[str, Any]:
    """Records the vocabulary's share of the guarantee; returns its component.

    A DP-SentencePiece report (`report_path`) that names this vocabulary by content hash is
    composed ({"name": "dp_sentencepiece", "epsilon", "delta", "source"}). Otherwise (no report,
    an old report without a hash, or a report of another vocabulary) the vocabulary is recorded
    as {"name": "vocabulary", "private": false}: the total ε is then ∞, unless `public` (the
    vocabulary was built without the private data), recorded as "public": true and not counted.
    A public vocabulary's matching report covers the data it was built on, not this run's: it is
    not composed (it is named as "dp_report"), e.g. a DP vocabulary of a pretraining corpus used
    to fine-tune on a task whose examples are not in that corpus.

    Raises:
      PrivacyError: the matching report's privacy unit is weaker than training's.
    """
    if report_path is None:
      reason = "no DP-SentencePiece privacy report was found beside it"
    else:
      reason = vocabulary_report_mismatch(_read_json(report_path), vocab_path)
      if reason is None and not public:
        return self.add_component_from_report(report_path)
    component = {"name": VOCABULARY_COMPONENT, "private": False, "public": bool(public),
                 "source": os.path.abspath(vocab_path)}
    if public and report_path is not None and reason is None:
      component["dp_report"] = os.path.abspath(report_path)
    if public:
      logging.info("vocabulary %s is declared public (VOCAB_IS_PUBLIC): it is not counted in ε", vocab_path)
    else:
      component["reason"] = reason
      logging.warning("vocabulary %s is not covered by differential privacy (%s): the total ε is ∞; run "
                      "`private-t5 dp-spm`, or declare a vocabulary built without the private data "
                      "public (VOCAB_IS_PUBLIC=True)", vocab_path, reason)
    self.components = [c for c in self.components if c["name"] != VOCABULARY_COMPONENT
                       or c.get("source") != component["source"]]
    self.components.append(component)
    return component

  def add_initial_checkpoint(self, report: Dict[str, Any], source: str, note: str) -> Dict[str, Any]:
    """Records the training of the parameters this run starts from, when it used the private data.

    `report` is that training's privacy report (`report()`). A DP one is composed at its total
    (ε, δ) (by group privacy at a stronger unit, like `add_component_from_report`); a non-private
    one (or one with ε = ∞) is recorded as {"name": "initial_checkpoint", "private": false,
    "public": false, "source", "reason": note}, and the total ε is then ∞. `note` says how that
    training used the data (e.g. "trained without DP on a redacted copy of this data").

    Raises:
      PrivacyError: the report's privacy unit is weaker than this ledger's.
    """
    source = os.path.abspath(source)
    self.components = [c for c in self.components if c["name"] != INITIAL_CHECKPOINT_COMPONENT
                       or c.get("source") != source]
    if report.get("dp") and report.get("epsilon") is not None:
      size = self.check_unit(report.get("privacy_unit", "document"), f"the initial checkpoint ({source})")
      epsilon, delta = group_privacy(float(report["epsilon"]), float(report["delta"]), size)
      return self.add_component(INITIAL_CHECKPOINT_COMPONENT, epsilon, delta, source,
                                noise_secret=report_noise_secret(report), details={"note": note})
    component = {"name": INITIAL_CHECKPOINT_COMPONENT, "private": False, "public": False, "source": source,
                 "reason": f"the initial parameters were {note}: the total ε is ∞"}
    self.components.append(component)
    return component

  def vocabulary_status(self) -> Optional[str]:
    """"dp" (a DP report is composed), "public", "not private", or None (none recorded)."""
    status = None
    for c in self.components:
      if c["name"] == INITIAL_CHECKPOINT_COMPONENT:
        continue
      if c["name"] == VOCABULARY_COMPONENT:
        if not c.get("public"):
          return "not private"
        status = "public"
      elif "epsilon" in c:
        status = status or "dp"
    return status

  def resume_from(self, saved: "PrivacyLedger") -> "PrivacyLedger":
    """This configuration continued from a saved ledger: its steps and components carried over.

    Raises:
      PrivacyError: the saved ledger describes another mechanism (σ, q, C, δ, unit, sampling,
        truncation cap or private/non-private differ).
    """
    for field in _MECHANISM_FIELDS:
      a, b = getattr(saved, field), getattr(self, field)
      same = (a == b) if not isinstance(a, float) or not isinstance(b, float) else math.isclose(a, b, rel_tol=1e-9)
      if not same:
        raise PrivacyError(f"cannot resume: the checkpoint's ledger has {field}={a!r} but this run "
                           f"has {field}={b!r}; a ledger covers one mechanism (start a new run instead)")
    resumed = dataclasses.replace(self, steps=saved.steps, components=[dict(c) for c in saved.components],
                                  noise_secret=saved.noise_secret and self.noise_secret)
    for c in self.components:
      if "epsilon" in c:
        resumed.add_component(c["name"], c["epsilon"], c["delta"], c.get("source", ""), c.get("vocab_sha256"),
                              noise_secret=c.get("noise_secret", True))
      else:  # a non-private (or public) vocabulary: this run's record replaces the saved one
        resumed.components = [d for d in resumed.components if d["name"] != c["name"]
                              or d.get("source") != c.get("source")]
        resumed.components.append(dict(c))
    return resumed

  # -- privacy spent ----------------------------------------------------------------------------

  def epsilons(self) -> Dict[str, float]:
    """{accountant: training ε at `delta`} for each accountant this ledger runs ("auto": RDP and
    PLD); cached per step count (PLD takes seconds at long runs)."""
    key = (self.steps, self.accountant, self.noise_multiplier, self.sampling_rate)
    if key not in self._epsilon_cache:
      self._epsilon_cache.clear()
      self._epsilon_cache[key] = accounting.compute_epsilons(
          self.noise_multiplier, self.sampling_rate, self.steps, self.delta, sampling=self.sampling,
          num_examples=self.num_examples, max_batch_size=self.max_batch_size, accountant=self.accountant)
    return dict(self._epsilon_cache[key])

  def accountant_used(self) -> Optional[str]:
    """The accountant whose ε is reported: the one asked for, or for "auto" the smaller ε's."""
    if self.non_private:
      return None
    if self.accountant != accounting.AUTO:
      return self.accountant
    if self.steps == 0:
      return accounting.accountants_for(self.accountant, self.sampling)[0]
    eps = self.epsilons()
    return min(eps, key=lambda name: (eps[name], name))

  def training_epsilon(self) -> float:
    """ε of the steps taken, at `delta` (∞ for a non-private run, 0 before the first step)."""
    if self.non_private:
      return math.inf
    if self.steps == 0:
      return 0.0
    return self.epsilons()[self.accountant_used()]

  def training_delta(self) -> float:
    """δ of training: δ, plus (1 + e^ε) · steps · p_trunc when a truncated run is accounted by
    RDP (`accounting.total_delta`); PLD accounts the truncated event itself."""
    if self.non_private:
      return 1.0
    if self.accountant_used() == "pld":
      return float(self.delta)
    return accounting.total_delta(self.delta, self.steps, self.truncation_probability,
                                  self.training_epsilon())

  def epsilon_by_events(self, exclude: Sequence[str] = ()) -> Optional[float]:
    """Total ε with training and the components composed by their `DpEvent`s, at `total_delta()`.

    Every DP component must carry its event (a DP-SentencePiece report at the training unit: a
    Gaussian release of noise multiplier σ/k at its δ_g, plus a threshold whose δ_t only adds
    to δ). Training's events and the components' Gaussian events are composed by the
    accountant(s) that gave training's ε ("auto": the smaller ε of RDP and PLD) at δ + Σ δ_g;
    with Σ δ_t added, the total δ is at most `total_delta()`, the δ of the summed ε, so the two ε
    compare. None when some component has no event (a non-private vocabulary, an initial
    checkpoint, a group-privacy composition, an older report), when there is no component to
    compose, for a non-private run, for fixed batches, and before the first step. Truncated
    sampling is accounted by PLD only here. Components named in `exclude` are left out.
    """
    if (self.non_private or not self.steps or self.sampling != "poisson"
        or self.total_delta(exclude) >= 1.0 or self._components_without_event(exclude)):
      return None
    components = self._dp_components(exclude)
    if not components:
      return None
    key = (self.steps, self.accountant, self.noise_multiplier, self.sampling_rate,
           tuple(json.dumps(c["event"], sort_keys=True) for c in components))
    if key not in self._by_events_cache:
      self._by_events_cache.clear()
      releases = [accounting.gaussian_event(c["event"]["noise_multiplier"]) for c in components]
      delta = self.delta + sum(c["event"]["delta_gaussian"] for c in components)
      # The accountants training's ε came from (PLD is left out past its reach, `epsilons`).
      names = [n for n in self.epsilons() if n == "pld" or not self.truncation_probability]
      self._by_events_cache[key] = min(
          (accounting.composed_epsilon(
              [accounting.make_dp_event(self.noise_multiplier, self.sampling_rate, self.steps,
                                        num_examples=self.num_examples,
                                        max_batch_size=self.max_batch_size if name == "pld" else None)]
              + releases, delta, name) for name in names), default=None)
    return self._by_events_cache[key]

  def _dp_components(self, exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The components counted in ε (a public vocabulary is not), less those named in `exclude`."""
    return [c for c in self.components if c["name"] not in exclude
            and not (c["name"] == VOCABULARY_COMPONENT and c.get("public"))]

  def _components_without_event(self, exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    return [c for c in self._dp_components(exclude) if "event" not in c]

  def epsilon_by_addition(self, exclude: Sequence[str] = ()) -> float:
    """Training ε plus every component's ε (simple composition); ∞ with a non-private component.

    Components named in `exclude` are left out (e.g. the initial checkpoint's training, for the
    share of this run alone).
    """
    components = [c for c in self.components if c["name"] not in exclude]
    if any(not c.get("private", True) and not c.get("public") for c in components):
      return math.inf
    return self.training_epsilon() + sum(c.get("epsilon", 0.0) for c in components)

  def total_epsilon(self, exclude: Sequence[str] = ()) -> float:
    """The ε reported for training and its components at `total_delta()`: the smaller of
    `epsilon_by_addition` and `epsilon_by_events` (both bound the same release at that δ), so
    never more than the sum; the sum where the components cannot be composed by events."""
    added = self.epsilon_by_addition(exclude)
    by_events = self.epsilon_by_events(exclude)
    return added if by_events is None else min(added, by_events)

  def composition(self, exclude: Sequence[str] = ()) -> Optional[str]:
    """How `total_epsilon` composes training with its components, in one line (None: none counted).

    "events" lines name both numbers (by events, and the sum it is checked against); "addition"
    lines say why the components were not composed by events.
    """
    components = self._dp_components(exclude)
    if self.non_private or not components or math.isinf(self.epsilon_by_addition(exclude)):
      return None
    added = self.epsilon_by_addition(exclude)
    parts = " + ".join([f"training {self.training_epsilon():.4g}"]
                       + [f"{c['name']} {c['epsilon']:.4g}" for c in components])
    by_events = self.epsilon_by_events(exclude)
    if by_events is not None and by_events <= added:
      names = [n.upper() for n in self.epsilons() if n == "pld" or not self.truncation_probability]
      accountants = " and ".join(names) + (", the smaller" if len(names) > 1 else "")
      return (f"by events: ε = {by_events:.4g} (training and {', '.join(c['name'] for c in components)} "
              f"composed as DP events by {accountants}); by addition it would be "
              f"{parts} = {added:.4g}")
    if not self.steps:
      why = "no step taken yet"
    elif by_events is not None:
      why = f"composition by events gave more, ε = {by_events:.4g}"
    elif self._components_without_event(exclude):
      why = "; ".join(_why_no_event(c) for c in self._components_without_event(exclude))
    elif self.sampling != "poisson":
      why = "fixed batches are composed by addition only"
    else:
      why = "truncated sampling is composed by events under the PLD accountant only"
    return f"by addition: ε = {parts} = {added:.4g} (not by events: {why})"

  def total_delta(self, exclude: Sequence[str] = ()) -> float:
    """Training δ (with truncation) plus every component's δ (simple composition)."""
    return min(1.0, self.training_delta() + sum(c.get("delta", 0.0) for c in self.components
                                                if c["name"] not in exclude))

  def noise_secret_everywhere(self) -> bool:
    """Whether the noise of training and of every DP component was secret."""
    return self.noise_secret and all(c.get("noise_secret", True) for c in self.components)

  def warnings(self) -> List[str]:
    """One line per reason the reported ε is not the guarantee it reads as (empty when none)."""
    if self.non_private:
      return []
    lines = []
    if not self.noise_secret:
      lines.append(insecure_noise_warning("this training run (train.insecure_deterministic_seed)"))
    for c in self.components:
      if not c.get("noise_secret", True):
        lines.append(insecure_noise_warning(f"the composed {c['name']} ({c.get('source', '')})"))
      if c["name"] == INITIAL_CHECKPOINT_COMPONENT and not c.get("private", True):
        lines.append(c["reason"])
    return lines

  def report(self) -> Dict[str, Any]:
    """A JSON-ready summary of the guarantee.

    `epsilon`/`delta` are the totals over training and components (ε null, i.e. ∞, for a
    non-private run or a non-private vocabulary): ε is the smaller of `epsilon_by_events` and
    `epsilon_by_addition` (`total_epsilon`), and `composition` says in one line which, with both
    numbers; `training_epsilon` is DP-Adafactor's own ε;
    `vocabulary` is `vocabulary_status()`; `accounting_delta` is the δ the training ε is
    computed at; `noise_secret` is False when any noise came from a fixed seed; `warnings` has
    one line per reason the ε is no guarantee as it reads (`warnings()`); with an initial
    checkpoint component, `epsilon_without_initial_checkpoint` / `delta_without_initial_checkpoint`
    are this run's share alone; `ledger` holds the exact fields for `from_dict`.
    """
    def finite(x):
      return None if math.isinf(x) else x
    out = self.to_dict()
    out.update(
        epsilon=finite(self.total_epsilon()), delta=self.total_delta(), accounting_delta=self.delta,
        training_epsilon=finite(self.training_epsilon()), training_delta=self.training_delta(),
        total_epsilon=finite(self.total_epsilon()), total_delta=self.total_delta(),
        truncation_delta=(0.0 if self.non_private else self.training_delta() - self.delta),
        dp=not self.non_private, vocabulary=self.vocabulary_status(),
        batch_size=self.max_batch_size if self.max_batch_size is not None else self.configured_batch_size,
        epsilon_rdp=None, epsilon_pld=None, accountant_used=self.accountant_used(),
        clipping_method=self.clipping_method, noise_secret=self.noise_secret_everywhere(),
        epsilon_by_events=self.epsilon_by_events(),
        epsilon_by_addition=None if self.non_private else finite(self.epsilon_by_addition()),
        composition=self.composition(),
        warnings=self.warnings(),
        ledger=self.to_dict(),
    )
    if any(c["name"] == INITIAL_CHECKPOINT_COMPONENT for c in self.components):
      exclude = (INITIAL_CHECKPOINT_COMPONENT,)
      out.update(epsilon_without_initial_checkpoint=finite(self.total_epsilon(exclude)),
                 delta_without_initial_checkpoint=self.total_delta(exclude))
    if not self.non_private and self.steps:
      for name, eps in self.epsilons().items():
        out[f"epsilon_{name}"] = eps
    elif not self.non_private:
      out.update(epsilon_rdp=0.0, epsilon_pld=0.0 if self.sampling != "fixed" else None)
    return out

  # -- serialisation ----------------------------------------------------------------------------

  def to_dict(self) -> Dict[str, Any]:
    d = dataclasses.asdict(self)
    del d["noisy_sum"]
    d.update(noise_multiplier=self.noise_multiplier, clip_norm=self.clip_norm,
             expected_batch_size=self.expected_batch_size, ledger_version=LEDGER_VERSION)
    return d

  @classmethod
  def from_dict(cls, d: Dict[str, Any]) -> "PrivacyLedger":
    """Inverse of `to_dict`; also accepts a `report()` (reads its `ledger` entry)."""
    if isinstance(d.get("ledger"), dict):
      d = d["ledger"]
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [n for n in ("noise_multiplier", "sampling_rate", "clip_norm", "delta") if n not in d]
    if missing:
      raise DataError(f"privacy ledger is missing {missing}")
    fields = {k: v for k, v in d.items() if k in names and k != "noisy_sum"}
    noisy_sum = None
    if not d.get("non_private", False):
      expected = d.get("expected_batch_size")
      if expected is None and d.get("num_examples"):
        expected = float(d["sampling_rate"]) * int(d["num_examples"])
      if expected is None:
        raise DataError("privacy ledger has neither expected_batch_size nor num_examples")
      noisy_sum = accounting.NoisySum(d["clip_norm"], d["noise_multiplier"], expected)
    return cls(noisy_sum=noisy_sum, **fields)

  def save(self, path: str) -> str:
    """Writes `report()` atomically (temp file then rename); `load` reads it back."""
    return write_report(path, self.report())

  @classmethod
  def load(cls, path: str) -> "PrivacyLedger":
    return cls.from_dict(_read_json(path))


def _threshold_release_event(report: Dict[str, Any]) -> Optional[Dict[str, float]]:
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


def _why_no_event(component: Dict[str, Any]) -> str:
  """Why a composed component has no DP event (it is then added to training's ε)."""
  name, source = component["name"], component.get("source", "")
  if component.get("group_privacy"):
    return f"{name} ({source}) is composed at another privacy unit, by group privacy"
  if name == INITIAL_CHECKPOINT_COMPONENT:
    return f"the initial checkpoint's training ({source}) is composed at its (ε, δ)"
  return (f"the report {source} records no Gaussian event (σ/k, δ_g, δ_t: written by an older "
          "dp-spm; re-run `private-t5 dp-spm` for one that does)")


def _read_json(path: str) -> Dict[str, Any]:
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
