"""The privacy ledger: what one DP training run has spent so far (its `privacy_report.json`).

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

A ledger of correlated noise (`noise` "banded" or "blt", `strategies`) records its b and its
strategy (kind, digest, coefficients, sensitivity) and accounts the steps taken as one event:
banded, the amplified event of ceil(t/b) participations; BLT, one Gaussian release
(`accounting.correlated_epsilons`). A Gaussian ledger has none of these fields (its JSON is as
before).

A guarantee needs secret noise: a run (or a component) whose noise came from a fixed seed is
recorded with `noise_secret: false`, and its report says so (`warnings`).

The ledger composes two parts and adds their shares: what its mechanism has spent (training's
DP events and (ε, δ), `privacy_spent.TrainingPrivacy`, built from the mechanism's fields and
asked for the steps taken) and the releases composed in (`components.ComposedReleases`, built on
the `components` list, the training unit and `documents_per_example`); the ledger's
JSON (`to_dict`, `from_dict`, ledgers of earlier versions included) is `ledger_json`'s, and the
rules of its making (a run's fresh ledger, the checks of its fields, a resume of the same
mechanism only) are `ledger_setup`'s. The reports
themselves (a ledger's `report()`, its file names and writers, DP-SentencePiece's report) are
`private_t5.dp.privacy_report`'s.
"""
import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence

from private_t5.dp import accounting
from private_t5.dp import privacy_params
from private_t5.dp import strategies
from private_t5.dp.components import ComposedReleases
from private_t5.dp import ledger_setup
from private_t5.dp import privacy_report
from private_t5.dp.ledger_json import ledger_from_dict, ledger_to_dict
from private_t5.dp.privacy_spent import TrainingPrivacy
from private_t5.dp.privacy_report import read_report, write_report
from private_t5.errors import PrivacyError
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.dp.privacy_report': ('find_vocabulary_report', 'vocabulary_report_path'),
})


@dataclasses.dataclass
class PrivacyLedger:
  """Privacy spent by a DP training run, serialisable to JSON.

  Attributes:
    noisy_sum: the release's C, σ and divisor q·N (`privacy_params.NoisySum`, the object the run's
      clipped sum and noise transform hold; None for a non-private baseline), kept in JSON as
      the flat fields `clip_norm`, `noise_multiplier`, `expected_batch_size` (also properties).
    sampling_rate: q, the Poisson sampling rate (expected batch size / N).
    delta: δ of the Gaussian steps (truncation accounted by RDP adds to it, see `training_delta`).
    accountant: "auto" (the smaller ε of RDP and PLD, `accountant_used`), "rdp" or "pld".
    privacy_unit: "document", "example" or "user".
    num_examples: N, the sampling population (units).
    max_batch_size: truncation cap of a Poisson batch (None: not truncated).
    truncation_probability: per-step P[Poisson batch > max_batch_size].
    steps: steps taken so far.
    components: other mechanisms composed in (records of `components.ComposedReleases`).
    non_private: True for a non-private baseline (ε = ∞).
    sampling: "poisson" or "fixed" (fixed batches, accounted without replacement).
    configured_batch_size: the run's configured (padded) batch size, for the report.
    clipping_method: how the clipped sum was computed ("ghost" or "vmap"), for the report.
    noise_secret: False when the training noise came from a fixed seed (insecure: the ε reported
      is then no guarantee); once False it stays False on resume.
    population: public facts on the N units when the data is a seqio Task or Mixture (its tasks,
      example counts, whether the unit is the user's declaration); None: the data's description.
    noise: "gaussian" (DP-SGD), or correlated noise: "banded" or "blt".
    num_bands: b, the cyclic Poisson groups of correlated noise (q is the rate within a group,
      the expected batch q·N/b); 1 for Gaussian noise.
    strategy: correlated noise: the strategy's record (`strategies.Strategy.to_dict`: kind,
      digest, coefficients or BLT parameters, b, steps, sensitivity); None for Gaussian noise.
  """
  noisy_sum: Optional[privacy_params.NoisySum]
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
  sampling: str = privacy_params.Sampling.POISSON.value
  configured_batch_size: Optional[int] = None
  clipping_method: Optional[str] = None
  noise_secret: bool = True
  population: Optional[Dict[str, Any]] = None
  noise: privacy_params.NoiseKind = privacy_params.NoiseKind.GAUSSIAN
  num_bands: int = 1
  strategy: Optional[Dict[str, Any]] = None

  def __post_init__(self):
    self._spent: Optional[TrainingPrivacy] = None  # `_training`'s, rebuilt when the mechanism changes
    self._strategy: Optional[strategies.Strategy] = ledger_setup.check_fields(self)  # PrivacyError: a bad field

  @property
  def correlated(self) -> bool:
    """Whether the noise is correlated across steps (a matrix factorization strategy)."""
    return self.noise.correlated

  @property
  def strategy_digest(self) -> Optional[str]:
    """The SHA-256 of the strategy's coefficients (None for Gaussian noise)."""
    return self.strategy.get("digest") if self.strategy else None

  @property
  def strategy_sensitivity(self) -> Optional[float]:
    """The strategy's sensitivity per unit clip norm (None for Gaussian noise)."""
    return float(self.strategy["sensitivity"]) if self.strategy else None

  # A fresh run's ledger, and a non-private run's (`ledger_setup`).
  create = classmethod(ledger_setup.new_ledger)
  non_private_baseline = classmethod(ledger_setup.non_private_ledger)

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

  # -- training's share: `privacy_spent.TrainingPrivacy` of the mechanism, at `steps` ----------

  def _training(self) -> TrainingPrivacy:
    """What this mechanism spends (kept, with its caches, while the mechanism's fields stay)."""
    current = TrainingPrivacy(
        non_private=self.non_private, noise=self.noise, noise_multiplier=self.noise_multiplier,
        sampling_rate=self.sampling_rate, delta=self.delta, accountant=self.accountant, sampling=self.sampling,
        num_examples=self.num_examples, max_batch_size=self.max_batch_size,
        truncation_probability=self.truncation_probability, num_bands=self.num_bands,
        strategy_digest=self.strategy_digest, strategy_sensitivity=self.strategy_sensitivity,
        strategy=self._strategy)
    if self._spent != current:
      self._spent = current
    return self._spent

  def step_event(self) -> Optional[accounting.DpEvent]:
    """The `DpEvent` of one training step (None: non-private, or correlated noise)."""
    return self._training().step_event()

  def training_event(self, accountant: str = "pld") -> Optional[accounting.DpEvent]:
    """The `DpEvent` of the `steps` steps taken, as `accountant` accounts them."""
    return self._training().training_event(self.steps, accountant)

  def epsilons(self) -> Dict[str, float]:
    """{accountant: training ε at `delta`} for each accountant this ledger runs (cached)."""
    return self._training().epsilons(self.steps)

  def accountant_used(self) -> Optional[str]:
    """The accountant whose ε is reported: the one asked for, or for "auto" the smaller ε's."""
    return self._training().accountant_used(self.steps)

  def training_epsilon(self) -> float:
    """ε of the steps taken, at `delta` (∞ for a non-private run, 0 before the first step)."""
    return self._training().training_epsilon(self.steps)

  def training_delta(self) -> float:
    """δ of training: δ, plus the truncation's share when RDP accounts a truncated run."""
    return self._training().training_delta(self.steps)

  def event_accountants(self) -> List[str]:
    """The accountants of `epsilon_by_events`: training's, less RDP for a truncated run."""
    return self._training().event_accountants(self.steps)

  # -- the releases composed in: `components.ComposedReleases` of `components` -----------------

  def documents_per_example(self) -> Optional[int]:
    """At most how many documents one training unit holds pieces of: 1, except where the data
    says otherwise (`population["documents_per_example"]`: a seqio Task's declared bound, None
    when not bounded, since span corruption joins documents)."""
    population = self.population or {}
    return population.get("documents_per_example", 1) if self.privacy_unit == "example" else 1

  def _releases(self) -> ComposedReleases:
    return ComposedReleases(self.components, self.privacy_unit, self.documents_per_example())

  def add_component(self, name: str, epsilon: float, delta: float, source: str = "",
                    vocab_sha256: Optional[str] = None, noise_secret: bool = True,
                    details: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Composes another (ε, δ)-DP release on the same data, once; returns its entry."""
    return self._releases().add_component(name, epsilon, delta, source, vocab_sha256, noise_secret, details)

  def add_component_from_report(self, path: str) -> Dict[str, Any]:
    """Composes a DP-SentencePiece `privacy_report.json` (its `epsilon` and `delta`)."""
    return self._releases().add_component_from_report(path)

  def add_vocabulary(self, vocab_path: str, report_path: Optional[str] = None, *,
                     public: bool = False, public_check: Optional[str] = None) -> Dict[str, Any]:
    """Records the vocabulary's share of the guarantee; returns its component."""
    releases = self._releases()
    component = releases.add_vocabulary(vocab_path, report_path, public=public, public_check=public_check)
    self.components = releases.components
    return component

  def replace_record(self, component: Dict[str, Any]) -> None:
    """Adds a record without (ε, δ), replacing the one of the same name for the same file."""
    releases = self._releases()
    releases.replace_record(component)
    self.components = releases.components

  def add_initial_checkpoint(self, report: Dict[str, Any], source: str, note: str) -> Dict[str, Any]:
    """Records the training of the parameters this run starts from; returns its component."""
    releases = self._releases()
    component = releases.add_initial_checkpoint(report, source, note)
    self.components = releases.components
    return component

  def vocabulary_status(self) -> Optional[str]:
    """"dp" (a DP report is composed), "public", "not private", or None (none recorded)."""
    return self._releases().vocabulary_status()

  def dp_components(self, exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The components counted in ε (a public vocabulary is not), less those named in `exclude`."""
    return self._releases().dp_components(exclude)

  def components_without_event(self, exclude: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The components counted in ε that record no DP event (they are composed by addition only)."""
    return self._releases().components_without_event(exclude)

  # -- the total: training and its releases ----------------------------------------------------

  def epsilon_by_addition(self, exclude: Sequence[str] = ()) -> float:
    """Training ε plus every component's ε (simple composition); ∞ with a non-private component.

    Components named in `exclude` are left out (e.g. the initial checkpoint's training, for the
    share of this run alone).
    """
    releases = self._releases()
    if releases.counts_non_private(exclude):
      return math.inf
    return self.training_epsilon() + releases.epsilon_sum(exclude)

  def total_delta(self, exclude: Sequence[str] = ()) -> float:
    """Training δ (with truncation) plus every component's δ (simple composition)."""
    return min(1.0, self.training_delta() + self._releases().delta_sum(exclude))

  def epsilon_by_events(self, exclude: Sequence[str] = ()) -> Optional[float]:
    """Total ε with training and the components composed by their `DpEvent`s, at `total_delta()`.

    Every DP component must carry its event (a DP-SentencePiece report at the training unit: a
    Gaussian release of noise multiplier σ/k at its δ_g, plus a threshold whose δ_t only adds
    to δ). Training's events and the components' Gaussian events are composed by the
    accountant(s) that gave training's ε ("auto": the smaller ε of RDP and PLD) at δ + Σ δ_g
    (`TrainingPrivacy.epsilon_with_releases`); with Σ δ_t added, the total δ is at most
    `total_delta()`, the δ of the summed ε, so the two ε compare. None when some component has
    no event (a non-private vocabulary, an initial checkpoint, a group-privacy composition, an
    older report), when there is no component to compose, for a non-private run, for fixed
    batches, and before the first step. Truncated sampling is accounted by PLD only here.
    Components named in `exclude` are left out.
    """
    releases = self._releases()
    if (self.non_private or not self.steps or self.sampling != privacy_params.Sampling.POISSON
        or self.total_delta(exclude) >= 1.0 or releases.components_without_event(exclude)):
      return None
    components = releases.dp_components(exclude)
    if not components:
      return None
    return self._training().epsilon_with_releases(self.steps, [c["event"] for c in components])

  def total_epsilon(self, exclude: Sequence[str] = ()) -> float:
    """The ε reported for training and its components at `total_delta()`: the smaller of
    `epsilon_by_addition` and `epsilon_by_events` (both bound the same release at that δ), so
    never more than the sum; the sum where the components cannot be composed by events."""
    added = self.epsilon_by_addition(exclude)
    by_events = self.epsilon_by_events(exclude)
    return added if by_events is None else min(added, by_events)

  def composition(self, exclude: Sequence[str] = ()) -> Optional[str]:
    """How `total_epsilon` composes training with its components, in one line (None: none
    counted; `privacy_report.composition`)."""
    return privacy_report.composition(self, exclude)

  def noise_secret_everywhere(self) -> bool:
    """Whether the noise of training and of every DP component was secret."""
    return self.noise_secret and self._releases().noise_secret()

  # -- bookkeeping ------------------------------------------------------------------------------

  @property
  def fixed_batches(self) -> bool:  # shuffled fixed batches, not Poisson sampling
    return self.sampling == privacy_params.Sampling.FIXED

  def record_steps(self, n: int = 1) -> None:
    """Adds `n` steps taken."""
    if int(n) != n or n < 0:
      raise PrivacyError(f"record_steps needs an integer >= 0, got {n!r}")
    self.steps += int(n)

  def resume_from(self, saved: "PrivacyLedger") -> "PrivacyLedger":
    """This configuration continued from a saved ledger: its steps and components carried over.

    Raises:
      PrivacyError: the saved ledger describes another mechanism (σ, q, C, δ, unit, sampling,
        truncation cap or private/non-private differ).
    """
    ledger_setup.check_same_mechanism(saved, self)
    resumed = dataclasses.replace(self, steps=saved.steps, components=[dict(c) for c in saved.components],
                                  noise_secret=saved.noise_secret and self.noise_secret)
    for c in self.components:
      if "epsilon" in c:
        resumed.add_component(c["name"], c["epsilon"], c["delta"], c.get("source", ""), c.get("vocab_sha256"),
                              noise_secret=c.get("noise_secret", True))
      else:  # a non-private (or public) vocabulary: this run's record replaces the saved one
        resumed.replace_record(c)
    return resumed

  def warnings(self) -> List[str]:
    """One line per reason the reported ε is not the guarantee it reads as (empty when none)."""
    return privacy_report.report_warnings(self)

  def report(self) -> Dict[str, Any]:
    """A JSON-ready summary of the guarantee (`privacy_report.ledger_report`); `from_dict` reads it."""
    return privacy_report.ledger_report(self)

  # -- serialisation (`ledger_json`) ------------------------------------------------------------

  def to_dict(self) -> Dict[str, Any]:
    return ledger_to_dict(self)

  @classmethod
  def from_dict(cls, d: Dict[str, Any]) -> "PrivacyLedger":
    """Inverse of `to_dict`; also accepts a `report()` (reads its `ledger` entry)."""
    return ledger_from_dict(cls, d)

  def save(self, path: str) -> str:
    """Writes `report()` atomically (temp file then rename); `load` reads it back."""
    return write_report(path, self.report())

  @classmethod
  def load(cls, path: str) -> "PrivacyLedger":
    return cls.from_dict(read_report(path))
