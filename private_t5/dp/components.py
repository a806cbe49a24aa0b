"""The releases a privacy ledger composes with training: its `components`.

Other DP releases computed from the same data (the DP-SentencePiece vocabulary, the training of
the parameters a run started from) are composed into a run's guarantee as components; a
vocabulary without a matching DP report is recorded as non-private (the total ε is then ∞),
unless it is declared public. A release at a stronger privacy unit than training's is composed by
group privacy (`group_privacy`, `ComposedReleases.group_size`); one at a weaker unit is refused.
`ComposedReleases` works on a ledger's component list alone; `ledger.PrivacyLedger` holds the list
and adds training's (ε, δ) (`privacy_spent.TrainingPrivacy`) to the releases' sums.
"""
import logging
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from private_t5.dp import privacy_report
from private_t5.errors import DataError, PrivacyError
from private_t5.io import file_sha256

logger = logging.getLogger(__name__)

PRIVACY_UNITS = ("document", "example", "user")
# A user's data holds whole documents, and a document holds whole examples (chunks). Larger is
# stronger: a guarantee at a stronger unit covers a weaker one by group privacy (`group_size`).
_UNIT_STRENGTH = {"example": 0, "document": 1, "user": 2}


def group_privacy(epsilon: float, delta: float, size: int) -> tuple:
  """(ε, δ)-DP for one unit, as a guarantee for `size` units: (kε, δ·(1 + e^ε + … + e^((k-1)ε)))."""
  if size == 1:
    return epsilon, delta
  return size * epsilon, delta * sum(math.exp(min(i * epsilon, 700.0)) for i in range(size))


class ComposedReleases:
  """The releases composed with one training run: its ledger's `components`.

  Built with exactly what it works on: the ledger's `components` list (dicts {"name",
  "epsilon", "delta", "source"}, or {"name": "vocabulary", "private": false, "public", "source"}
  for a vocabulary without a matching DP report (`add_vocabulary`), or {"name":
  "initial_checkpoint", ...} for the training of the parameters the run started from
  (`add_initial_checkpoint`); a component whose noise was not secret has "noise_secret": false),
  training's `privacy_unit`, and `documents_per_example`, the bound on the documents one
  training unit holds pieces of (None: not bounded). It adds and lists releases and sums their
  (ε, δ); training's own share is the ledger's. `components` is the current list: a record that
  replaces another leaves a new list there, which the ledger keeps.
  """

  def __init__(self, components: List[Dict[str, Any]], privacy_unit: str, documents_per_example: Optional[int]):
    self.components = components
    self.privacy_unit = privacy_unit
    self.documents_per_example = documents_per_example

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
    training) is composed by group privacy (`group_size`): its own (ε, δ) are kept in the entry
    as "group_privacy". A report whose noise was not secret is composed with "noise_secret": false.

    Raises:
      PrivacyError: the report's privacy unit is weaker than this ledger's, or stronger with no
        bound on the group (`group_size`).
    """
    report = privacy_report.read_report(path)
    for key in ("epsilon", "delta"):
      if not isinstance(report.get(key), (int, float)):
        raise DataError(f"{path}: privacy report has no numeric {key!r}")
    name = str(report.get("mechanism", "dp_sentencepiece"))
    unit = report.get("privacy_unit", "document")
    size = self.group_size(unit, f"{name} ({path})")
    if size is None:
      raise PrivacyError(f"{name} ({path}) cannot be composed: {self.unbounded_group_reason(unit)}")
    epsilon, delta = group_privacy(float(report["epsilon"]), float(report["delta"]), size)
    details = None
    if size > 1:
      details = {"group_privacy": {"size": size, "privacy_unit": unit, "epsilon": float(report["epsilon"]),
                                   "delta": float(report["delta"])}}
      if delta >= 1:
        raise PrivacyError(
            f"{name} ({path}) is {unit}-level DP with (ε, δ) = ({report['epsilon']:g}, {report['delta']:g}); as a "
            f"{self.privacy_unit}-level guarantee (group privacy, {size} {unit}s) its δ is {delta:.3g} >= 1: no "
            f"guarantee; train the vocabulary with a smaller ε, or train at the {unit} unit")
    event = privacy_report.vocabulary_report_event(report) if size == 1 else None
    if event is not None:
      details = {"event": event}
    vocab_sha256 = report.get("vocab_sha256")
    return self.add_component(name, epsilon, delta, source=os.path.abspath(path),
                              vocab_sha256=vocab_sha256 if isinstance(vocab_sha256, str) and vocab_sha256 else None,
                              noise_secret=privacy_report.report_noise_secret(report), details=details)

  def group_size(self, unit: str, what: str) -> Optional[int]:
    """The group size at which a guarantee at `unit` composes into this ledger's unit.

    1 at the same unit. At a stronger unit, 2k, where k bounds the documents (or users) one
    training unit changes (`documents_per_example`): removing one example changes each of the
    k documents it holds pieces of, which for a document-level release is a substitution of each
    (remove the document, add the changed one), so a document-level (ε, δ) covers it as
    (2kε, (1 + e^ε + … + e^((2k-1)ε))·δ) (`group_privacy`); the same holds for a user-level
    release. None when k is not bounded: the release cannot be composed. A weaker unit is
    refused: a document-level ε covers a user with K documents only as K·ε, and K is not bounded.

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
    if _UNIT_STRENGTH[unit] == _UNIT_STRENGTH[self.privacy_unit]:
      return 1
    k = self.documents_per_example
    return None if k is None else 2 * int(k)

  def unbounded_group_reason(self, unit: str) -> str:
    """Why a `unit`-level release cannot be composed (`group_size` is None), for the report."""
    return (f"it is {unit}-level DP and training is {self.privacy_unit}-level on data whose examples may each "
            f"hold pieces of any number of {unit}s (documents_per_example is not declared), so no group size "
            f"covers one {self.privacy_unit}; declare the bound (seqio: DOCUMENTS_PER_EXAMPLE=k, group "
            f"privacy of 2k) or train at the {unit} unit (ONE_EXAMPLE_PER_DOCUMENT=True where it holds)")

  def add_vocabulary(self, vocab_path: str, report_path: Optional[str] = None, *,
                     public: bool = False, public_check: Optional[str] = None) -> Dict[str, Any]:
    """Records the vocabulary's share of the guarantee; returns its component.

    A DP-SentencePiece report (`report_path`) that names this vocabulary by content hash is
    composed ({"name": "dp_sentencepiece", "epsilon", "delta", "source"}). Otherwise (no report,
    an old report without a hash, or a report of another vocabulary) the vocabulary is recorded
    as {"name": "vocabulary", "private": false}: the total ε is then ∞, unless `public` (the
    vocabulary was built without the private data), recorded as "public": true and not counted.
    A public vocabulary's matching report covers the data it was built on, not this run's: it is
    not composed (it is named as "dp_report"), e.g. a DP vocabulary of a pretraining corpus used
    to fine-tune on a task whose examples are not in that corpus. `public_check` (what was checked
    of the declaration, `public_vocabulary.check_public_declaration`) goes into the entry.

    Raises:
      PrivacyError: the matching report's privacy unit is weaker than training's.
    """
    if report_path is None:
      reason = "no DP-SentencePiece privacy report was found beside it"
    else:
      report = privacy_report.read_report(report_path)
      reason = privacy_report.vocabulary_report_mismatch(report, vocab_path)
      unit = report.get("privacy_unit", "document")
      if reason is None and not public and self.group_size(unit, f"the vocabulary's report {report_path}") is None:
        reason = f"its DP-SentencePiece report {report_path} cannot be composed: " + self.unbounded_group_reason(unit)
      elif reason is None and not public:
        return self.add_component_from_report(report_path)
    component = {"name": privacy_report.VOCABULARY_COMPONENT, "private": False, "public": bool(public),
                 "source": os.path.abspath(vocab_path)}
    if os.path.isfile(vocab_path):
      component["vocab_sha256"] = file_sha256(vocab_path)
    if public and report_path is not None and reason is None:
      component["dp_report"] = os.path.abspath(report_path)
    if public and public_check:
      component["public_check"] = public_check
    if public:
      logger.info("vocabulary %s is declared public (VOCAB_IS_PUBLIC): it is not counted in ε", vocab_path)
    else:
      component["reason"] = reason
      logger.warning("vocabulary %s is not covered by differential privacy (%s): the total ε is ∞; run "
                      "`private-t5 dp-spm`, or declare a vocabulary built without the private data "
                      "public (VOCAB_IS_PUBLIC=True)", vocab_path, reason)
    self.replace_record(component)
    return component

  def replace_record(self, component: Dict[str, Any]) -> None:
    """Adds a record without (ε, δ) (a non-private or public vocabulary or initial checkpoint),
    replacing the one of the same name for the same file: the same path, or the same content
    (`vocab_sha256`: a vocabulary moved between a run and its resumption is listed once)."""
    def same(c):
      return c["name"] == component["name"] and (
          c.get("source") == component.get("source")
          or (component.get("vocab_sha256") is not None and c.get("vocab_sha256") == component.get("vocab_sha256")))
    self.components = [c for c in self.components if not same(c)]
    self.components.append(dict(component))

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
    self.components = [c for c in self.components if c["name"] != privacy_report.INITIAL_CHECKPOINT_COMPONENT
                       or c.get("source") != source]
    unit = report.get("privacy_unit", "document")
    size = None
    if report.get("dp") and report.get("epsilon") is not None:
      size = self.group_size(unit, f"the initial checkpoint ({source})")
      if size is None:
        note = f"trained with DP, but {self.unbounded_group_reason(unit)}"
    if size is not None:
      epsilon, delta = group_privacy(float(report["epsilon"]), float(report["delta"]), size)
      return self.add_component(privacy_report.INITIAL_CHECKPOINT_COMPONENT, epsilon, delta, source,
                                noise_secret=privacy_report.report_noise_secret(report), details={"note": note})
    component = {"name": privacy_report.INITIAL_CHECKPOINT_COMPONENT, "private": False, "public": False, "source": source,
                 "reason": f"the initial parameters were {note}: the total ε is ∞"}
    self.components.append(component)
    return component

  def vocabulary_status(self) -> Optional[str]:
    """"dp" (a DP report is composed), "public", "not private", or None (none recorded)."""
    return privacy_report.vocabulary_status(self.components)

  def dp_components(self, exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The components counted in ε (a public vocabulary is not), less those named in `exclude`."""
    return [c for c in self.components if c["name"] not in exclude
            and not (c["name"] == privacy_report.VOCABULARY_COMPONENT and c.get("public"))]

  def components_without_event(self, exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The components counted in ε that record no DP event (they are composed by addition only)."""
    return [c for c in self.dp_components(exclude) if "event" not in c]

  def counts_non_private(self, exclude: Sequence[str] = ()) -> bool:
    """Whether a non-private release (not declared public) is counted: the total ε is then ∞.
    Components named in `exclude` are left out."""
    return any(not c.get("private", True) and not c.get("public") for c in self.components
               if c["name"] not in exclude)

  def epsilon_sum(self, exclude: Sequence[str] = ()) -> float:
    """Every component's ε added up (simple composition), less those named in `exclude`."""
    return sum(c.get("epsilon", 0.0) for c in self.components if c["name"] not in exclude)

  def delta_sum(self, exclude: Sequence[str] = ()) -> float:
    """Every component's δ added up (simple composition), less those named in `exclude`."""
    return sum(c.get("delta", 0.0) for c in self.components if c["name"] not in exclude)

  def noise_secret(self) -> bool:
    """Whether the noise of every component was secret."""
    return all(c.get("noise_secret", True) for c in self.components)
