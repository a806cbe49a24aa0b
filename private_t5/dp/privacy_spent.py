"""What a privacy ledger's mechanism has spent: training's DP events and (ε, δ), and the total.

`PrivacySpent` is a base class of `ledger.PrivacyLedger`, as `components.ComposedReleases` is:
it works on the ledger's mechanism (`noisy_sum`'s σ, q, δ, `accountant`, `sampling`, truncation,
correlated `noise` and its strategy) and `steps`, and gives training's events (`step_event`,
`training_event`), ε by each accountant (`epsilons`, cached per step count in the ledger's
`_epsilon_cache`), training's (ε, δ), and the total ε with the components: the smaller of the
sum (`epsilon_by_addition`) and the composition of the releases' events (`epsilon_by_events`,
cached in `_by_events_cache`).
"""
import json
import math
from typing import Dict, List, Optional, Sequence

from private_t5.dp import accounting
from private_t5.dp import privacy_params
from private_t5.dp import strategies
from private_t5.dp import truncation


class PrivacySpent:
  """The privacy a `PrivacyLedger` has spent (its base class; see the module docstring)."""

  def step_event(self) -> Optional[accounting.DpEvent]:
    """The `DpEvent` of one training step of this ledger's mechanism (None for a non-private run,
    and for correlated noise, whose steps are accounted together: `training_event`).

    `accounting.step_dp_event` of σ and q: a Poisson-sampled Gaussian (fixed batches: sampled
    without replacement); truncated (`truncation_probability` > 0), the event only PLD accounts.
    """
    if self.non_private or self.correlated:
      return None
    return accounting.step_dp_event(
        self.noise_multiplier, self.sampling_rate, sampling=self.sampling, num_examples=self.num_examples,
        max_batch_size=self.max_batch_size if self.truncation_probability else None)

  def training_event(self, accountant: str = "pld") -> Optional[accounting.DpEvent]:
    """The `DpEvent` of the `steps` steps taken, as `accountant` accounts them (None for a
    non-private run or before the first step): Gaussian noise, the step event composed `steps`
    times (truncation for PLD only); banded, the amplified event (`accounting.banded_dp_event`);
    BLT, one Gaussian release of multiplier σ·s(n)/s(t) (`accounting.blt_dp_event`)."""
    if self.non_private or not self.steps:
      return None
    if self.noise == strategies.BANDED:
      return accounting.banded_dp_event(self.noise_multiplier, self.sampling_rate, self.steps, self.num_bands)
    if self.noise == strategies.BLT:
      return accounting.blt_dp_event(self.noise_multiplier, self.sensitivity_ratio())
    return accounting.make_dp_event(self.noise_multiplier, self.sampling_rate, self.steps,
                                    num_examples=self.num_examples,
                                    max_batch_size=self.max_batch_size if accountant == "pld" else None)

  def sensitivity_ratio(self) -> float:
    """BLT: s(n) / s(t), the noise std (set for the strategy's n steps) over the sensitivity of the
    t = `steps` steps released so far (≥ 1 for t ≤ n; valid for t > n as well); 1 otherwise."""
    if self.noise != strategies.BLT or not self.steps:
      return 1.0
    return self.strategy_sensitivity / self._strategy.sensitivity_over(self.steps)

  def epsilons(self) -> Dict[str, float]:
    """{accountant: training ε at `delta`} for each accountant this ledger runs ("auto": RDP and
    PLD); cached per step count (PLD takes seconds at long runs)."""
    key = (self.steps, self.accountant, self.noise_multiplier, self.sampling_rate, self.noise, self.num_bands,
           self.strategy_digest)
    if key not in self._epsilon_cache:
      self._epsilon_cache.clear()
      if self.correlated:
        self._epsilon_cache[key] = accounting.correlated_epsilons(
            self.noise, self.noise_multiplier, self.sampling_rate, self.steps, self.delta, num_bands=self.num_bands,
            sensitivity_ratio=self.sensitivity_ratio(), accountant=self.accountant)
      else:
        self._epsilon_cache[key] = accounting.compute_epsilons(
            self.noise_multiplier, self.sampling_rate, self.steps, self.delta, sampling=self.sampling,
            num_examples=self.num_examples, max_batch_size=self.max_batch_size, accountant=self.accountant)
    return dict(self._epsilon_cache[key])

  def accountant_used(self) -> Optional[str]:
    """The accountant whose ε is reported: the one asked for, or for "auto" the smaller ε's."""
    if self.non_private:
      return None
    if self.accountant != privacy_params.AUTO:
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
    return truncation.total_delta(self.delta, self.steps, self.truncation_probability,
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
    if (self.non_private or not self.steps or self.sampling != privacy_params.Sampling.POISSON
        or self.total_delta(exclude) >= 1.0 or self.components_without_event(exclude)):
      return None
    components = self.dp_components(exclude)
    if not components:
      return None
    key = (self.steps, self.accountant, self.noise_multiplier, self.sampling_rate, self.noise, self.num_bands,
           self.strategy_digest, tuple(json.dumps(c["event"], sort_keys=True) for c in components))
    if key not in self._by_events_cache:
      self._by_events_cache.clear()
      releases = [accounting.gaussian_event(c["event"]["noise_multiplier"]) for c in components]
      delta = self.delta + sum(c["event"]["delta_gaussian"] for c in components)
      self._by_events_cache[key] = min(
          (accounting.composed_epsilon([self.training_event(name)] + releases, delta, name)
           for name in self.event_accountants()), default=None)
    return self._by_events_cache[key]

  def event_accountants(self) -> List[str]:
    """The accountants of `epsilon_by_events`: training's (`epsilons`), less RDP for a truncated run."""
    return [n for n in self.epsilons() if n == "pld" or not self.truncation_probability]

  def total_epsilon(self, exclude: Sequence[str] = ()) -> float:
    """The ε reported for training and its components at `total_delta()`: the smaller of
    `epsilon_by_addition` and `epsilon_by_events` (both bound the same release at that δ), so
    never more than the sum; the sum where the components cannot be composed by events."""
    added = self.epsilon_by_addition(exclude)
    by_events = self.epsilon_by_events(exclude)
    return added if by_events is None else min(added, by_events)
