"""Privacy accounting for DP training with `dp_accounting` (RDP, PLD, or "auto": the smaller).

One step of DP training is a sampled Gaussian mechanism: every example joins the batch
independently with probability q (Poisson sampling), the clipped per-example gradients are
summed and N(0, σ²C²) is added. Its `DpEvent` is `PoissonSampledDpEvent(q, GaussianDpEvent(σ))`
and a run is that event composed `steps` times (Abadi et al. 2016; Mironov 2017).

The trainer runs every sampled example (a sample of any size is cut into fixed-size
microbatches), so the plain Poisson event above is exact. "auto" reports the smaller of the RDP
(Mironov 2017) and PLD (Meiser and Mohammadi 2018; Doroshenko et al. 2022, "Connect the Dots")
ε of that same event at the same δ; both are valid upper bounds, so the smaller one is too.

Truncation (optional, `DPConfig.sampling="poisson_truncated"`): a Poisson batch is capped at
`max_batch_size` rows. The PLD accountant accounts that mechanism exactly with
`TruncatedSubsampledGaussianDpEvent` (no extra δ). RDP accounts the untruncated event, and the
truncated mechanism differs from it only when the Poisson draw exceeds the cap, which adds
(1 + e^ε) · steps · P[Binomial(N + 1, q) > max_batch_size] to δ (`total_delta`; "How to DP-fy
ML", Ponomareva et al. 2023, §4.3).

Fixed (shuffled) batches are a different mechanism (sampling without replacement); they are
accounted as such under the replace-one neighbouring relation (RDP only), never as Poisson.

Correlated noise by matrix factorization (`strategies`) is accounted for the steps taken as a
whole: banded with amplification, DP-SGD's event over the ceil(t/b) participations of an example
(`banded_dp_event`, jax-privacy's `amplified_bandmf_event`); BLT as one Gaussian release of
multiplier σ·s(n)/s(t) (`blt_dp_event`); `correlated_epsilons`, `calibrate_correlated`.

This is the only module that imports `dp_accounting`: it also accounts DP-SentencePiece (one
Gaussian release of a word histogram and a threshold, `thresholded_gaussian_parameters`), adaptive
DP's per-step noise multipliers (`varying_noise_epsilon`), and composes the events of several
releases (`composed_epsilon`).

The parameters it accounts are named and checked in `privacy_params` (`Sampling`, `NoisySum`,
`validate_privacy_params`), the δ of a truncated batch in `truncation`, DP-SentencePiece's
threshold in `threshold`, and dp_accounting's log is quieted by `accounting_log`; their names are
importable from here as well.
"""
import collections
import math
from typing import Dict, Optional, Sequence, Tuple

import dp_accounting
from dp_accounting import pld
from dp_accounting import rdp
from dp_accounting.pld import accountant as pld_accountant
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_mechanism
from dp_accounting import mechanism_calibration
from scipy import optimize

# The log filter, the parameters, the truncation and the threshold accounted here: their names are
# importable from here as well.
from private_t5.dp.accounting_log import quiet_convergence_warnings
from private_t5.dp.privacy_params import (
    ACCOUNTANTS,
    AUTO,
    SAMPLING_SCHEMES,
    Sampling,
    check_number,
    validate_privacy_params,
)
from private_t5.dp.strategies import BANDED, BLT
from private_t5.dp.threshold import paper_epsilon, paper_threshold, threshold_for, threshold_tail
from private_t5.dp.truncation import truncation_probability
from private_t5.errors import PrivacyError
from private_t5.lazy_imports import lazy_module
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.dp.privacy_params': ('NoisySum', 'check_clip_norm'),
})

# Noise multipliers searched when calibrating σ for a target ε.
MIN_NOISE_MULTIPLIER = 1e-3
MAX_NOISE_MULTIPLIER = 1e4
# PLD discretisation: fine enough for two decimals of ε at the paper's scale.
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3
# The PLD accountant holds the composed privacy-loss distribution as one dense array over its
# whole range, in steps of PLD_VALUE_DISCRETIZATION_INTERVAL: the array (and the time to read it)
# grows with ε and with the number of steps (hundreds of MB at ε ≈ 10^4; TiB, or hours, at 10^12
# steps). RDP needs no such array. PLD is not computed past these bounds (such a run guarantees
# nothing or is far beyond any training run): "auto" then reports RDP's ε alone.
PLD_MAX_EPSILON = 1e4
PLD_MAX_STEPS = 10**7
# What a release is to the accountants (the type of `make_dp_event`'s and `step_dp_event`'s results).
DpEvent = dp_accounting.DpEvent
# jax-privacy's accounting of banded noise (`banded_dp_event`), imported on first use: it imports
# JAX, which `private-t5 epsilon` and a Gaussian run's accounting never need.
jax_privacy_accounting = lazy_module("jax_privacy.experimental.accounting", needed_for="banded noise's accounting",
                                     install="jax-privacy (requirements.txt)")

quiet_convergence_warnings()


class PldOutOfReachError(PrivacyError):
  """The PLD accountant would need more memory or time than a real run ever does (PLD_MAX_STEPS,
  PLD_MAX_EPSILON)."""


class UnreachableTargetError(PrivacyError):
  """A target ε that no σ up to MAX_NOISE_MULTIPLIER reaches; `smallest` maps each accountant
  tried to the smallest ε it reaches (its ε at MAX_NOISE_MULTIPLIER)."""

  def __init__(self, message: str, smallest: Dict[str, float]):
    super().__init__(message)
    self.smallest = dict(smallest)


def unreachable_target(target_epsilon: float, smallest: Dict[str, float], delta: float,
                       settings: str) -> UnreachableTargetError:
  """The one-line error of a target ε below the smallest ε that `settings` reach (`smallest`:
  accountant -> its ε at the largest σ the calibration searches, MAX_NOISE_MULTIPLIER)."""
  name = min(smallest, key=lambda n: (smallest[n], n))
  return UnreachableTargetError(
      f"target_epsilon={target_epsilon:g} is unreachable with these settings ({settings}, δ={delta:g}): the "
      f"smallest ε they reach is {smallest[name]:.4g} (by {name.upper()}), at noise_multiplier="
      f"{MAX_NOISE_MULTIPLIER:g}, the largest σ the calibration searches; raise the target ε or δ, or lower the "
      "sampling rate or the number of steps", smallest)

def make_dp_event(noise_multiplier: float, sampling_rate: float, steps: int, *,
                  sampling: str = Sampling.POISSON, num_examples: Optional[int] = None,
                  max_batch_size: Optional[int] = None) -> DpEvent:
  """The `DpEvent` of `steps` DP-SGD steps (the same object the sampler's config describes):
  `step_dp_event` composed `steps` times.

  Args:
    noise_multiplier: σ, the noise std divided by the clip norm C.
    sampling_rate: q (Poisson rate, or batch/N for fixed batches).
    steps: number of steps composed.
    sampling: "poisson" (default) or "fixed" (shuffled fixed-size batches, sampled without
      replacement; needs `num_examples`).
    num_examples: N; required for fixed batches and for `max_batch_size`.
    max_batch_size: Poisson only: the truncation cap (see `step_dp_event`).
  """
  step = step_dp_event(noise_multiplier, sampling_rate, sampling=sampling, num_examples=num_examples,
                       max_batch_size=max_batch_size)
  return dp_accounting.SelfComposedDpEvent(step, int(steps))


def step_dp_event(noise_multiplier: float, sampling_rate: float, *, sampling: str = Sampling.POISSON,
                  num_examples: Optional[int] = None, max_batch_size: Optional[int] = None) -> DpEvent:
  """The `DpEvent` of one DP-SGD step.

  Args:
    noise_multiplier: σ, the noise std divided by the clip norm C.
    sampling_rate: q (Poisson rate, or batch/N for fixed batches).
    sampling: "poisson" (default) or "fixed" (shuffled fixed-size batches, sampled without
      replacement; needs `num_examples`).
    num_examples: N; required for fixed batches and for `max_batch_size`.
    max_batch_size: Poisson only: the truncation cap. When it truncates with non-zero
      probability the step is `TruncatedSubsampledGaussianDpEvent` (PLD accountant only);
      otherwise (None, the default) the untruncated `PoissonSampled(Gaussian)`, whose
      guarantee holds for the truncated run with δ from `total_delta`.
  """
  if sampling == Sampling.POISSON:
    if max_batch_size is not None:
      if num_examples is None:
        raise PrivacyError("a truncated Poisson event needs num_examples")
      if truncation_probability(num_examples, sampling_rate, max_batch_size) > 0.0:
        return dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=int(num_examples), sampling_probability=sampling_rate,
            truncated_batch_size=int(max_batch_size), noise_multiplier=noise_multiplier)
    return dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
  if sampling == Sampling.FIXED:
    if num_examples is None:
      raise PrivacyError("fixed-batch accounting needs num_examples")
    batch = int(round(sampling_rate * num_examples))
    # Replace-one neighbours: the clipped sum moves by up to 2C, and dp_accounting's
    # without-replacement bound (Wang et al. 2019, Thm 27) takes std / l2-sensitivity = σ/2.
    return dp_accounting.SampledWithoutReplacementDpEvent(
        int(num_examples), batch, dp_accounting.GaussianDpEvent(noise_multiplier / 2.0))
  raise PrivacyError(f"sampling must be one of {SAMPLING_SCHEMES}, got {sampling!r}")


def make_accountant(accountant: str = "rdp", sampling: str = Sampling.POISSON) -> dp_accounting.PrivacyAccountant:
  """A fresh `dp_accounting` accountant (RDP with its default orders, or PLD)."""
  if accountant not in ACCOUNTANTS:
    raise PrivacyError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
  if sampling == Sampling.FIXED:
    if accountant != "rdp":
      raise PrivacyError("fixed-batch (without replacement) accounting is only available with accountant='rdp'")
    return rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  if accountant == "rdp":
    return rdp.RdpAccountant()
  return pld.PLDAccountant(value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)


def compute_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
                    accountant: str = "rdp", *, sampling: str = Sampling.POISSON,
                    num_examples: Optional[int] = None, max_batch_size: Optional[int] = None) -> float:
  """ε of `steps` sampled-Gaussian steps at `delta` (the paper's Table 5 with RDP).

  `accountant="auto"`: the smaller of the RDP and PLD ε (`compute_epsilons`). With
  `max_batch_size` (truncated Poisson), PLD accounts the truncated event exactly; RDP (which
  cannot) the untruncated one, whose δ then grows by `total_delta`'s truncation term.
  """
  if accountant == AUTO:
    return min(compute_epsilons(noise_multiplier, sampling_rate, steps, delta, sampling=sampling,
                                num_examples=num_examples, max_batch_size=max_batch_size).values())
  validate_privacy_params(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps,
                          delta=delta, accountant=accountant, sampling=sampling)
  if accountant == "pld":
    _check_pld_in_reach(noise_multiplier, sampling_rate, steps, delta, sampling, num_examples)
  acc = make_accountant(accountant, sampling)
  event = make_dp_event(noise_multiplier, sampling_rate, steps, sampling=sampling, num_examples=num_examples,
                        max_batch_size=max_batch_size if accountant == "pld" else None)
  try:
    acc.compose(event)
  except MemoryError:
    raise PldOutOfReachError(
        f"the PLD accountant ran out of memory for noise_multiplier={noise_multiplier:g}, "
        f"sampling_rate={sampling_rate:g}, steps={steps}; use accountant='rdp' or 'auto'") from None
  return float(acc.get_epsilon(delta))


def _check_pld_in_reach(noise_multiplier, sampling_rate, steps, delta, sampling, num_examples) -> None:
  """PldOutOfReachError past PLD_MAX_STEPS steps, or when RDP already gives an ε above PLD_MAX_EPSILON."""
  if steps > PLD_MAX_STEPS:
    raise PldOutOfReachError(
        f"steps={steps} is more than the PLD accountant composes ({PLD_MAX_STEPS:.0e} at most: its "
        "arrays and time grow with the steps); use accountant='rdp' or 'auto'")
  eps = compute_epsilon(noise_multiplier, sampling_rate, steps, delta, "rdp", sampling=sampling,
                        num_examples=num_examples)
  if eps > PLD_MAX_EPSILON:
    raise PldOutOfReachError(
        f"ε = {eps:.4g} by RDP for noise_multiplier={noise_multiplier:g}, sampling_rate={sampling_rate:g}, "
        f"steps={steps}: no guarantee, and beyond ε = {PLD_MAX_EPSILON:g} the PLD accountant's arrays "
        "outgrow memory; use accountant='rdp' or 'auto'")


def accountants_for(accountant: str, sampling: str = Sampling.POISSON) -> tuple:
  """The accountants `accountant` runs: both for "auto" (RDP only for fixed batches), else itself."""
  if accountant != AUTO:
    return (accountant,)
  return ("rdp",) if sampling == Sampling.FIXED else ACCOUNTANTS


def compute_epsilons(noise_multiplier: float, sampling_rate: float, steps: int, delta: float, *,
                     sampling: str = Sampling.POISSON, num_examples: Optional[int] = None,
                     max_batch_size: Optional[int] = None, accountant: str = AUTO) -> dict:
  """{accountant name: ε} for each accountant `accountant` runs (`accountants_for`).

  "auto" leaves PLD out where it is out of reach (`PLD_MAX_EPSILON`): RDP's ε alone is reported.
  """
  out = {}
  for name in accountants_for(accountant, sampling):
    try:
      out[name] = compute_epsilon(noise_multiplier, sampling_rate, steps, delta, name, sampling=sampling,
                                  num_examples=num_examples, max_batch_size=max_batch_size)
    except PldOutOfReachError:
      if accountant != AUTO:
        raise
  return out


def calibrate_noise(target_epsilon: float, sampling_rate: float, steps: int, delta: float,
                    accountant: str = "rdp", *, sampling: str = Sampling.POISSON,
                    num_examples: Optional[int] = None, tol: float = 1e-4) -> float:
  """The smallest σ (to `tol`) whose ε at `delta` is at most `target_epsilon`.

  `accountant="auto"`: min(σ_rdp, σ_pld), each calibrated under its own accountant (the
  accountant that gave the smaller σ then reports an ε within the target); an accountant that does
  not reach the target is left out.

  Raises:
    PrivacyError: invalid parameters; `UnreachableTargetError` (one line naming the smallest ε
      reachable) for a target no accountant reaches with σ ≤ MAX_NOISE_MULTIPLIER.
  """
  if accountant == AUTO:
    sigmas, smallest = [], {}
    for name in accountants_for(AUTO, sampling):
      try:
        sigmas.append(calibrate_noise(target_epsilon, sampling_rate, steps, delta, name, sampling=sampling,
                                      num_examples=num_examples, tol=tol))
      except PldOutOfReachError:  # RDP's σ alone
        pass
      except UnreachableTargetError as e:  # the other accountant's σ, if it reaches the target
        smallest.update(e.smallest)
    if not sigmas:
      raise unreachable_target(target_epsilon, smallest, delta, _poisson_settings(sampling_rate, steps))
    return min(sigmas)
  check_number("target_epsilon", target_epsilon, low=0)
  validate_privacy_params(sampling_rate=sampling_rate, steps=steps, delta=delta, accountant=accountant,
                          sampling=sampling)

  def eps(sigma, acct=accountant):
    return compute_epsilon(sigma, sampling_rate, steps, delta, acct, sampling=sampling,
                           num_examples=num_examples)

  # The search ends at MAX_NOISE_MULTIPLIER: a target its ε does not reach is refused, naming the
  # smallest ε reachable (the bracket below must hold a σ whose ε is within the target).
  smallest = eps(MAX_NOISE_MULTIPLIER)
  if smallest > target_epsilon:
    raise unreachable_target(target_epsilon, {accountant: smallest}, delta, _poisson_settings(sampling_rate, steps))
  if eps(MIN_NOISE_MULTIPLIER, "rdp") <= target_epsilon:
    return MIN_NOISE_MULTIPLIER
  low, high = MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER
  if accountant != "rdp":
    # Bracket with RDP first (cheap at any σ). PLD is usually tighter, so its σ is at most RDP's;
    # PLD is slow and memory-hungry at tiny σ, so its lower end is found by halving from RDP's
    # answer. At a tiny target ε PLD's discretisation can need more σ than RDP: its upper end is
    # then found by doubling (up to MAX_NOISE_MULTIPLIER, whose ε is within the target).
    try:
      high = calibrate_noise(target_epsilon, sampling_rate, steps, delta, "rdp", sampling=sampling,
                             num_examples=num_examples, tol=tol)
    except UnreachableTargetError:
      high = MAX_NOISE_MULTIPLIER
    if eps(high) > target_epsilon:
      low = high
      while eps(high) > target_epsilon:
        low, high = high, min(2 * high, MAX_NOISE_MULTIPLIER)
    else:
      low = high / 2
      while eps(low) <= target_epsilon:
        high, low = low, low / 2
        if low < MIN_NOISE_MULTIPLIER:
          return high
  sigma = mechanism_calibration.calibrate_dp_mechanism(
      lambda: make_accountant(accountant, sampling),
      lambda s: make_dp_event(s, sampling_rate, steps, sampling=sampling, num_examples=num_examples),
      target_epsilon, delta,
      bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high),
      tol=tol)
  return float(sigma)

def _poisson_settings(sampling_rate: float, steps: int) -> str:
  """The settings an unreachable target of DP-SGD names."""
  return f"q={sampling_rate:g}, steps={steps}"


# -- correlated noise: banded (amplified) and BLT matrix factorization -------------------------
#
# A matrix factorization mechanism (`strategies`) adds C⁻¹ Z with Z ~ N(0, (σ·C_clip·sens)² I),
# sens = the strategy's sensitivity. Its examples are sampled by cyclic Poisson sampling: b groups,
# group t mod b sampled with rate q at step t.

def banded_rounds(steps: int, num_bands: int) -> int:
  """ceil(t / b): the participations of one example in t steps with b groups."""
  return -(-int(steps) // int(num_bands))


def banded_dp_event(noise_multiplier: float, sampling_rate: float, steps: int, num_bands: int) -> DpEvent:
  """The event of `steps` steps of banded matrix factorization with amplification (Choquette-Choo
  et al. 2023, Thm. 4; jax-privacy's `amplified_bandmf_event`): the columns of an example's ≤
  ceil(t/b) participations do not overlap (≤ b bands, ≥ b steps apart), each a Poisson sampled
  Gaussian of multiplier σ (noise scaled by the max column norm): DP-SGD's event of ceil(t/b)
  steps, `make_dp_event(σ, q, ceil(t/b))`."""
  validate_privacy_params(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps)
  return jax_privacy_accounting.amplified_bandmf_event(
      noise_multiplier=float(noise_multiplier), iterations=int(steps), num_bands=int(num_bands),
      sampling_prob=float(sampling_rate))


def blt_dp_event(noise_multiplier: float, sensitivity_ratio: float) -> DpEvent:
  """The event of the first t steps of a BLT (not amplified): one Gaussian release of multiplier
  σ · s(n) / s(t), the noise std σ·C·s(n) over the release's sensitivity C·s(t)."""
  return dp_accounting.GaussianDpEvent(float(noise_multiplier) * float(sensitivity_ratio))


def correlated_epsilons(noise: str, noise_multiplier: float, sampling_rate: float, steps: int, delta: float, *,
                        num_bands: int, sensitivity_ratio: float = 1.0, accountant: str = AUTO) -> Dict[str, float]:
  """{accountant: ε} after `steps` steps of correlated noise ("banded" or "blt"), as `compute_epsilons`.

  Banded: the amplified event, by RDP and PLD (PLD out of reach as for DP-SGD of ceil(t/b)
  steps). BLT: the Gaussian event of multiplier σ · `sensitivity_ratio` (s(n)/s(t)).
  """
  validate_privacy_params(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps,
                          delta=delta, accountant=accountant)
  if noise == BANDED:
    rounds = banded_rounds(steps, num_bands)
    event = banded_dp_event(noise_multiplier, sampling_rate, steps, num_bands)
    return event_epsilons(event, delta, accountant, pld_check=lambda: _check_pld_in_reach(
        noise_multiplier, sampling_rate, rounds, delta, Sampling.POISSON, None))
  if noise == BLT:
    event = blt_dp_event(noise_multiplier, sensitivity_ratio)
    return event_epsilons(event, delta, accountant, pld_check=lambda: _check_event_in_reach(event, delta))
  raise PrivacyError(f"correlated noise is {BANDED!r} or {BLT!r}, got {noise!r}")


def event_epsilons(event: DpEvent, delta: float, accountant: str = AUTO, *, pld_check=None) -> Dict[str, float]:
  """{accountant: ε at δ} of one add/remove-one event for each accountant `accountant` runs;
  `pld_check` raises `PldOutOfReachError` where PLD would not fit ("auto" then leaves it out)."""
  out = {}
  for name in accountants_for(accountant):
    try:
      if name == "pld" and pld_check is not None:
        pld_check()
      acc = make_accountant(name)
      acc.compose(event)
      out[name] = float(acc.get_epsilon(delta))
    except PldOutOfReachError:
      if accountant != AUTO:
        raise
  return out


def _check_event_in_reach(event: DpEvent, delta: float) -> None:
  """PldOutOfReachError where RDP's ε of `event` is above PLD_MAX_EPSILON (PLD's arrays grow with ε)."""
  eps = event_epsilons(event, delta, "rdp")["rdp"]
  if eps > PLD_MAX_EPSILON:
    raise PldOutOfReachError(f"ε = {eps:.4g} by RDP: no guarantee, and beyond ε = {PLD_MAX_EPSILON:g} the PLD "
                             "accountant's arrays outgrow memory; use accountant='rdp' or 'auto'")


def calibrate_correlated(noise: str, target_epsilon: float, sampling_rate: float, steps: int, delta: float, *,
                         num_bands: int, accountant: str = AUTO, tol: float = 1e-4) -> float:
  """The smallest σ whose ε after `steps` steps of correlated noise is at most `target_epsilon`
  ("auto": the smaller of the RDP and PLD calibrations, as `calibrate_noise`).

  Banded: `calibrate_noise` of DP-SGD over ceil(n/b) steps (the same event, `banded_dp_event`).
  BLT over its n steps: one Gaussian release of multiplier σ (s(n)/s(n) = 1).
  """
  settings = (f"{noise} noise, q={sampling_rate:g} in b={num_bands} groups, steps={steps}"
              + (f" ({banded_rounds(steps, num_bands)} participations)" if noise == BANDED else ""))
  if noise == BANDED:
    try:
      return calibrate_noise(target_epsilon, sampling_rate, banded_rounds(steps, num_bands), delta, accountant,
                             tol=tol)
    except UnreachableTargetError as e:
      raise unreachable_target(target_epsilon, e.smallest, delta, settings) from None
  if noise != BLT:
    raise PrivacyError(f"correlated noise is {BANDED!r} or {BLT!r}, got {noise!r}")
  check_number("target_epsilon", target_epsilon, low=0)
  validate_privacy_params(delta=delta, accountant=accountant)
  def eps(sigma, name):
    return event_epsilons(blt_dp_event(sigma, 1.0), delta, name)[name]

  def calibrate(name, low, high):
    return float(mechanism_calibration.calibrate_dp_mechanism(
        lambda: make_accountant(name), lambda s: blt_dp_event(s, 1.0), target_epsilon, delta,
        bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high), tol=tol))

  # Each accountant searches σ up to MAX_NOISE_MULTIPLIER; one that does not reach the target there
  # is left out, and a target neither reaches is refused, naming the smallest ε reachable.
  smallest = {name: eps(MAX_NOISE_MULTIPLIER, name) for name in accountants_for(accountant)}
  reaching = [name for name, e in smallest.items() if e <= target_epsilon]
  if not reaching:
    raise unreachable_target(target_epsilon, smallest, delta, settings)
  if "rdp" in reaching and eps(MIN_NOISE_MULTIPLIER, "rdp") <= target_epsilon:
    return MIN_NOISE_MULTIPLIER
  sigmas = []
  if "rdp" in reaching:
    sigmas.append(calibrate("rdp", MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER))
  if "pld" in reaching:
    # PLD's arrays grow with ε: bracket near the exact Gaussian σ (a lower bound of PLD's, whose
    # discretisation only adds to ε) instead of searching from tiny σ.
    low = high = min(max(calibrate_gaussian(target_epsilon, delta), MIN_NOISE_MULTIPLIER), MAX_NOISE_MULTIPLIER)
    while eps(high, "pld") > target_epsilon:
      low, high = high, min(high * 2, MAX_NOISE_MULTIPLIER)
    sigmas.append(high if low == high else calibrate("pld", low, high))
  return min(sigmas)


def correlated_plan(noise: str, sampling_rate: float, steps: int, delta: float, *, num_bands: int,
                    noise_multiplier: Optional[float] = None, target_epsilon: Optional[float] = None,
                    accountant: str = AUTO) -> Dict[str, object]:
  """ε (or σ for a target ε) of a whole correlated-noise run of `steps` steps: {"epsilon",
  "epsilon_rdp", "epsilon_pld", "accountant_used", "noise_multiplier", "mechanism", ...}.

  The coefficients do not enter: banded is accounted per participation (ceil(n/b) of them), a
  BLT over its n steps is one Gaussian release of multiplier σ (its strategy's sensitivity s(n)
  scales the noise).
  """
  if (noise_multiplier is None) == (target_epsilon is None):
    raise PrivacyError("give exactly one of noise_multiplier and target_epsilon")
  if isinstance(num_bands, bool) or int(num_bands) != num_bands or not 1 <= num_bands <= steps:
    raise PrivacyError(f"num_bands b must be an integer in [1, steps={steps}], got {num_bands!r}")
  out: Dict[str, object] = {}
  if target_epsilon is not None:
    noise_multiplier = calibrate_correlated(noise, target_epsilon, sampling_rate, steps, delta, num_bands=num_bands,
                                            accountant=accountant)
    out["target_epsilon"] = target_epsilon
  eps = correlated_epsilons(noise, noise_multiplier, sampling_rate, steps, delta, num_bands=num_bands,
                            accountant=accountant)
  used = min(eps, key=lambda name: (eps[name], name))
  mechanism = (f"banded matrix factorization, cyclic Poisson sampling in b={num_bands} groups, amplified: "
               f"{banded_rounds(steps, num_bands)} Poisson sampled Gaussian participations" if noise == BANDED else
               f"BLT matrix factorization, cyclic Poisson sampling in b={num_bands} groups, not amplified: one "
               "Gaussian release (noise scaled by the strategy's min-separation sensitivity)")
  out.update(epsilon=eps[used], epsilon_rdp=eps.get("rdp"), epsilon_pld=eps.get("pld"), accountant_used=used,
             noise_multiplier=float(noise_multiplier), mechanism=mechanism,
             participations=banded_rounds(steps, num_bands))
  return out


# -- several releases: their events composed --------------------------------------------------

def composed_epsilon(events: Sequence[dp_accounting.DpEvent], delta: float, accountant: str = AUTO) -> float:
  """ε at `delta` of the releases whose `DpEvent`s are `events`, composed by one accountant.

  `accountant="auto"`: the smaller ε of RDP and PLD (both are valid bounds of the same events).
  All events must be add/remove-one events (Poisson-sampled or plain Gaussian).
  """
  if accountant == AUTO:
    return min(composed_epsilon(events, delta, name) for name in ACCOUNTANTS)
  validate_privacy_params(delta=delta, accountant=accountant)
  acc = make_accountant(accountant)
  for event in events:
    acc.compose(event)
  return float(acc.get_epsilon(delta))


def varying_noise_epsilon(noise_multipliers: Sequence[float], sampling_rate: float, delta: float,
                          accountant: str = "rdp") -> float:
  """ε of Poisson-sampled Gaussian steps, one per noise multiplier (equal ones self-composed).

  Adaptive DP's implied ε: the multipliers are σ·γ_t, as if each had been fixed in advance.
  """
  counts = collections.Counter(float(v) for v in noise_multipliers)
  events = [dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(v)), counts[v])
            for v in sorted(counts)]
  return composed_epsilon(events, delta, accountant)


# -- DP-SentencePiece: a Gaussian release of a word histogram, then a threshold ---------------
#
# Add/remove one document: words already in the corpus form a Gaussian mechanism with L2
# sensitivity k, (ε, δ_g)-DP; a word present only in the added document is released only if
# m + Z ≥ T, so by a union bound over its ≤ n distinct words the release differs with probability
# at most δ_t = n·Q((T − m)/σ). The whole release is (ε, δ_g + δ_t)-DP, with δ_g = δ_t = δ/2.

def gaussian_event(noise_multiplier: float) -> dp_accounting.DpEvent:
  """The `DpEvent` of one Gaussian release with std / L2 sensitivity = `noise_multiplier`."""
  return dp_accounting.GaussianDpEvent(float(noise_multiplier))


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
  """Tight ε of one Gaussian mechanism (std / L2 sensitivity = noise_multiplier) at δ.

  Inverts dp_accounting's exact hockey-stick divergence of the Gaussian mechanism (Balle &
  Wang 2018, Thm 8), δ(ε) = Φ(1/(2s) − εs) − e^ε·Φ(−1/(2s) − εs) with s = noise_multiplier.
  """
  loss = privacy_loss_mechanism.GaussianPrivacyLoss(standard_deviation=noise_multiplier, sensitivity=1.0)
  f = lambda eps: float(loss.get_delta_for_epsilon(eps)) - delta
  if f(0.0) <= 0:
    return 0.0
  high = 1.0
  while f(high) > 0:
    high *= 2
  return float(optimize.brentq(f, 0.0, high, xtol=1e-12, rtol=1e-10))


def calibrate_gaussian(target_epsilon: float, delta: float) -> float:
  """The smallest Gaussian noise multiplier whose tight ε at δ is ≤ target."""
  if not target_epsilon > 0 or not math.isfinite(target_epsilon):
    raise PrivacyError(f"target epsilon must be a positive number, got {target_epsilon!r}")
  return float(pld_accountant.get_smallest_gaussian_noise(
      pld_common.DifferentialPrivacyParameters(target_epsilon, delta), num_queries=1, sensitivity=1.0))


def _validate_threshold_release(delta, sigma, target_epsilon) -> Tuple[float, Optional[float], Optional[float]]:
  """(δ, σ, target ε) as floats; PrivacyError for a value that is not a finite positive number."""
  if (sigma is None) == (target_epsilon is None):
    raise PrivacyError("give exactly one of noise_std (σ) and target_epsilon")
  return (check_number("delta", delta, 0, 1),
          None if sigma is None else check_number("noise_std (σ)", sigma, 0),
          None if target_epsilon is None else check_number("target_epsilon", target_epsilon, 0))


def thresholded_gaussian_parameters(delta: float, *, l2: float, linf: float, max_distinct: int,
                                    sigma: Optional[float] = None,
                                    target_epsilon: Optional[float] = None) -> Dict[str, object]:
  """A thresholded Gaussian histogram release, both directions: (σ, δ) → ε and T, or (target ε, δ) → σ and T.

  `l2`, `linf`, `max_distinct` are k, m and n of one unit's contribution; δ is the total δ,
  half to the Gaussian counts and half to the threshold. Returns the tight `epsilon` (the
  Gaussian mechanism at δ/2), the paper's `epsilon_paper_formula`, the correct `threshold`, the
  paper's printed `threshold_paper_formula` and the δ that threshold actually spends,
  `noise_std` and `noise_multiplier` (σ/k, the `gaussian_event` of the counts).
  """
  delta, sigma, target_epsilon = _validate_threshold_release(delta, sigma, target_epsilon)
  k, m, n = l2, linf, max_distinct
  delta_gaussian = delta_threshold = delta / 2.0
  if sigma is None:
    sigma = k * calibrate_gaussian(target_epsilon, delta_gaussian)
  eps_paper = paper_epsilon(sigma, delta, k)
  t = threshold_for(sigma, delta_threshold, m, n)
  t_paper = paper_threshold(sigma, delta, m, n)
  return {
      "epsilon": gaussian_epsilon(sigma / k, delta_gaussian),
      "epsilon_paper_formula": eps_paper,
      "epsilon_paper_formula_valid": eps_paper < 1.0,  # the classical bound needs ε < 1
      "target_epsilon": target_epsilon,
      "delta": float(delta),
      "delta_gaussian": delta_gaussian,
      "delta_threshold": delta_threshold,
      "noise_std": float(sigma),
      "noise_multiplier": float(sigma / k),
      "threshold": t,
      "threshold_paper_formula": t_paper,
      "threshold_paper_formula_delta": threshold_tail(sigma, t_paper, m, n),
      "threshold_delta_check": threshold_tail(sigma, t, m, n),
  }
