"""What a privacy ledger's training mechanism has spent: its DP events and (ε, δ) after t steps.

`TrainingPrivacy` holds one mechanism's parameters (`noisy_sum`'s σ, q, δ, the accountant, the
sampling, truncation, correlated `noise` and its strategy) and answers for a step count t:
training's events (`step_event`, `training_event`), ε by each accountant (`epsilons`, cached per
step count), training's (ε, δ), and `epsilon_with_releases`, the ε of training composed by the
accountant with other releases' Gaussian events (cached). It knows nothing of those releases'
records: `ledger.PrivacyLedger` holds one `TrainingPrivacy` and its `components.ComposedReleases`
and composes the two into the total (ε, δ).
"""
import dataclasses
import json
import math
from typing import Any, Dict, List, Optional, Sequence

from private_t5.dp import accounting
from private_t5.dp import privacy_params
from private_t5.dp import strategies
from private_t5.dp import truncation


@dataclasses.dataclass(frozen=True)
class TrainingPrivacy:
  """The privacy one training mechanism spends in t steps (see the module docstring).

  Attributes: the ledger's fields of the same names; `strategy` is the correlated-noise
  strategy (None for Gaussian noise), `strategy_digest` and `strategy_sensitivity` its recorded
  digest and sensitivity. Two of them are equal when their mechanisms are (the caches aside).
  """
  non_private: bool
  noise: privacy_params.NoiseKind
  noise_multiplier: float
  sampling_rate: float
  delta: float
  accountant: str
  sampling: str
  num_examples: Optional[int]
  max_batch_size: Optional[int]
  truncation_probability: float
  num_bands: int
  strategy_digest: Optional[str]
  strategy_sensitivity: Optional[float]
  strategy: Optional[strategies.Strategy] = dataclasses.field(default=None, compare=False)
  _epsilon_cache: Dict[Any, Dict[str, float]] = dataclasses.field(
      default_factory=dict, init=False, compare=False, repr=False)
  _by_events_cache: Dict[Any, Optional[float]] = dataclasses.field(
      default_factory=dict, init=False, compare=False, repr=False)

  @property
  def correlated(self) -> bool:
    return self.noise.correlated

  def step_event(self) -> Optional[accounting.DpEvent]:
    """The `DpEvent` of one training step of this mechanism (None for a non-private run, and for
    correlated noise, whose steps are accounted together: `training_event`).

    `accounting.step_dp_event` of σ and q: a Poisson-sampled Gaussian (fixed batches: sampled
    without replacement); truncated (`truncation_probability` > 0), the event only PLD accounts.
    """
    if self.non_private or self.correlated:
      return None
    return accounting.step_dp_event(
        self.noise_multiplier, self.sampling_rate, sampling=self.sampling, num_examples=self.num_examples,
        max_batch_size=self.max_batch_size if self.truncation_probability else None)

  def training_event(self, steps: int, accountant: str = "pld") -> Optional[accounting.DpEvent]:
    """The `DpEvent` of `steps` steps, as `accountant` accounts them (None for a non-private run
    or before the first step): Gaussian noise, the step event composed `steps` times (truncation
    for PLD only); banded, the amplified event (`accounting.banded_dp_event`); BLT, one Gaussian
    release of multiplier σ·s(n)/s(t) (`accounting.blt_dp_event`)."""
    if self.non_private or not steps:
      return None
    if self.noise == privacy_params.NoiseKind.BANDED:
      return accounting.banded_dp_event(self.noise_multiplier, self.sampling_rate, steps, self.num_bands)
    if self.noise == privacy_params.NoiseKind.BLT:
      return accounting.blt_dp_event(self.noise_multiplier, self.sensitivity_ratio(steps))
    return accounting.make_dp_event(self.noise_multiplier, self.sampling_rate, steps,
                                    num_examples=self.num_examples,
                                    max_batch_size=self.max_batch_size if accountant == "pld" else None)

  def sensitivity_ratio(self, steps: int) -> float:
    """BLT: s(n) / s(t), the noise std (set for the strategy's n steps) over the sensitivity of the
    t = `steps` steps released so far (≥ 1 for t ≤ n; valid for t > n as well); 1 otherwise."""
    if self.noise != privacy_params.NoiseKind.BLT or not steps:
      return 1.0
    return self.strategy_sensitivity / self.strategy.sensitivity_over(steps)

  def epsilons(self, steps: int) -> Dict[str, float]:
    """{accountant: ε of `steps` steps at `delta`} for each accountant this mechanism runs
    ("auto": RDP and PLD); cached per step count (PLD takes seconds at long runs)."""
    if steps not in self._epsilon_cache:
      self._epsilon_cache.clear()
      if self.correlated:
        self._epsilon_cache[steps] = accounting.correlated_epsilons(
            self.noise, self.noise_multiplier, self.sampling_rate, steps, self.delta, num_bands=self.num_bands,
            sensitivity_ratio=self.sensitivity_ratio(steps), accountant=self.accountant)
      else:
        self._epsilon_cache[steps] = accounting.compute_epsilons(
            self.noise_multiplier, self.sampling_rate, steps, self.delta, sampling=self.sampling,
            num_examples=self.num_examples, max_batch_size=self.max_batch_size, accountant=self.accountant)
    return dict(self._epsilon_cache[steps])

  def accountant_used(self, steps: int) -> Optional[str]:
    """The accountant whose ε is reported: the one asked for, or for "auto" the smaller ε's."""
    if self.non_private:
      return None
    if self.accountant != privacy_params.AUTO:
      return self.accountant
    if steps == 0:
      return accounting.accountants_for(self.accountant, self.sampling)[0]
    eps = self.epsilons(steps)
    return min(eps, key=lambda name: (eps[name], name))

  def training_epsilon(self, steps: int) -> float:
    """ε of `steps` steps, at `delta` (∞ for a non-private run, 0 before the first step)."""
    if self.non_private:
      return math.inf
    if steps == 0:
      return 0.0
    return self.epsilons(steps)[self.accountant_used(steps)]

  def training_delta(self, steps: int) -> float:
    """δ of training: δ, plus (1 + e^ε) · steps · p_trunc when a truncated run is accounted by
    RDP (`accounting.total_delta`); PLD accounts the truncated event itself."""
    if self.non_private:
      return 1.0
    if self.accountant_used(steps) == "pld":
      return float(self.delta)
    return truncation.total_delta(self.delta, steps, self.truncation_probability,
                                  self.training_epsilon(steps))

  def event_accountants(self, steps: int) -> List[str]:
    """The accountants of `epsilon_with_releases`: training's (`epsilons`), less RDP for a
    truncated run."""
    return [n for n in self.epsilons(steps) if n == "pld" or not self.truncation_probability]

  def epsilon_with_releases(self, steps: int, events: Sequence[Dict[str, Any]]) -> Optional[float]:
    """ε of `steps` steps composed with Gaussian releases by the `event_accountants`, at δ + Σ δ_g.

    `events` are the releases' recorded events (dicts with "noise_multiplier" and
    "delta_gaussian", as a DP-SentencePiece report records its Gaussian release); the smaller ε
    of the accountants; cached per step count and events.
    """
    key = (steps, tuple(json.dumps(e, sort_keys=True) for e in events))
    if key not in self._by_events_cache:
      self._by_events_cache.clear()
      releases = [accounting.gaussian_event(e["noise_multiplier"]) for e in events]
      delta = self.delta + sum(e["delta_gaussian"] for e in events)
      self._by_events_cache[key] = min(
          (accounting.composed_epsilon([self.training_event(steps, name)] + releases, delta, name)
           for name in self.event_accountants(steps)), default=None)
    return self._by_events_cache[key]
