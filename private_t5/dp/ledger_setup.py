"""A privacy ledger made and continued: a run's fresh ledger, the checks of a ledger's fields,
and a resume of the same mechanism only.

`new_ledger` and `non_private_ledger` are `PrivacyLedger.create` and
`PrivacyLedger.non_private_baseline`: the ledger of a run's configuration, its noisy sum divided
by the sampler's q·N (DP rule "sampling matches accounting"). `check_fields` runs whenever a
ledger is made (also from JSON and on resume): the privacy unit, the steps, the noisy sum of a DP
ledger and its parameters (`privacy_params.validate_privacy_params`), and with `check_noise` the
correlated-noise fields (noise kind, b, the strategy and its recorded sensitivity; correlated
noise is accounted for untruncated Poisson sampling only). `check_same_mechanism` refuses to
resume a saved ledger of another mechanism (`MECHANISM_FIELDS`).
"""
import math
from typing import Any, Dict, Optional

from private_t5.dp import privacy_params
from private_t5.dp import strategies
from private_t5.dp import truncation
from private_t5.dp.components import PRIVACY_UNITS
from private_t5.errors import DataError, PrivacyError

# Fields that define the mechanism; a resumed run must keep them unchanged.
MECHANISM_FIELDS = ("noise_multiplier", "sampling_rate", "clip_norm", "delta", "privacy_unit",
                    "sampling", "max_batch_size", "non_private", "noise", "num_bands", "strategy_digest",
                    "strategy_sensitivity")


def new_ledger(cls, *, delta: float, num_examples: int, noisy_sum: Optional[privacy_params.NoisySum] = None,
               noise_multiplier: Optional[float] = None, clip_norm: Optional[float] = None,
               sampling_rate: Optional[float] = None, batch_size: Optional[float] = None,
               max_batch_size: Optional[int] = None, accountant: str = "rdp",
               privacy_unit: str = "document", sampling: str = privacy_params.Sampling.POISSON.value,
               configured_batch_size: Optional[int] = None,
               clipping_method: Optional[str] = None, noise_secret: bool = True,
               population: Optional[Dict[str, Any]] = None,
               noise: privacy_params.NoiseKind = privacy_params.NoiseKind.GAUSSIAN,
               strategy: Optional[strategies.Strategy] = None):
  """A fresh ledger from the run's configuration (q from `sampling_rate` or `batch_size`/N).

  `noisy_sum` is the run's (shared with its aggregator; its q·N must be q·N here: DP rule
  "sampling matches accounting"); without it one is made from `noise_multiplier` and
  `clip_norm` with divisor q·N. Correlated `noise` takes its `strategy`: q is then the rate
  within one of its b groups and the divisor q·N/b.
  """
  num_bands = strategy.num_bands if strategy is not None else 1
  if (sampling_rate is None) == (batch_size is None):
    raise PrivacyError("give exactly one of sampling_rate and batch_size")
  if sampling_rate is None:
    privacy_params.validate_privacy_params(num_examples=num_examples, batch_size=batch_size)
    sampling_rate = privacy_params.sampling_rate_from_batch(batch_size, num_examples)
  expected = float(sampling_rate) * int(num_examples) / num_bands
  if noisy_sum is None:
    noisy_sum = privacy_params.NoisySum(clip_norm, noise_multiplier, expected)
  elif not math.isclose(noisy_sum.expected_batch_size, expected, rel_tol=1e-9):
    raise PrivacyError(f"the noisy sum is divided by q·N = {noisy_sum.expected_batch_size:g}, but the "
                       f"sampler's q·N is {expected:g}: sampling must match accounting")
  return cls(noisy_sum=noisy_sum, sampling_rate=float(sampling_rate), delta=float(delta),
             accountant=accountant, privacy_unit=privacy_unit, num_examples=int(num_examples),
             max_batch_size=max_batch_size, sampling=sampling, configured_batch_size=configured_batch_size,
             clipping_method=clipping_method, noise_secret=bool(noise_secret), population=population,
             noise=noise, num_bands=num_bands, strategy=strategy.to_dict() if strategy is not None else None)


def non_private_ledger(cls, *, num_examples: Optional[int] = None, privacy_unit: str = "document",
                       batch_size: Optional[float] = None, noise_secret: bool = True,
                       population: Optional[Dict[str, Any]] = None):
  """A ledger for a non-private run: records steps, reports ε = ∞ (null in JSON)."""
  q = (batch_size / num_examples) if (batch_size and num_examples) else 0.0
  return cls(noisy_sum=None, sampling_rate=q, delta=0.0, privacy_unit=privacy_unit,
             num_examples=num_examples, non_private=True, configured_batch_size=batch_size,
             noise_secret=bool(noise_secret), population=population)


def check_fields(ledger) -> Optional[strategies.Strategy]:
  """Checks a `PrivacyLedger`'s fields as it is made (PrivacyError; DataError for a strategy
  whose recorded sensitivity is not its coefficients'), makes its steps and b integers and fills
  in the truncation probability of a capped batch; returns its correlated-noise strategy (None
  for Gaussian noise)."""
  strategy = check_noise(ledger)
  if ledger.privacy_unit not in PRIVACY_UNITS:
    raise PrivacyError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {ledger.privacy_unit!r}")
  if int(ledger.steps) != ledger.steps or ledger.steps < 0:
    raise PrivacyError(f"ledger steps must be an integer >= 0, got {ledger.steps!r}")
  ledger.steps = int(ledger.steps)
  if ledger.non_private:
    if ledger.noisy_sum is not None:
      raise PrivacyError("a non-private ledger records no noisy sum")
    return strategy
  if not isinstance(ledger.noisy_sum, privacy_params.NoisySum):
    raise PrivacyError(f"a DP ledger needs its accounting.NoisySum, got {ledger.noisy_sum!r}")
  privacy_params.validate_privacy_params(
      noise_multiplier=ledger.noise_multiplier, sampling_rate=ledger.sampling_rate, delta=ledger.delta,
      accountant=ledger.accountant, num_examples=ledger.num_examples, sampling=ledger.sampling)
  if ledger.num_examples is not None:
    if ledger.max_batch_size is not None and not ledger.truncation_probability:
      ledger.truncation_probability = truncation.truncation_probability(
          ledger.num_examples, ledger.sampling_rate, ledger.max_batch_size)
  return strategy


def check_noise(ledger) -> Optional[strategies.Strategy]:
  """The correlated-noise fields agree with each other and with the sampling (PrivacyError);
  makes b an integer and returns the strategy (None for Gaussian noise)."""
  if ledger.noise not in strategies.NOISE_KINDS:
    raise PrivacyError(f"noise must be one of {strategies.NOISE_KINDS}, got {ledger.noise!r}")
  ledger.noise = privacy_params.NoiseKind(ledger.noise)  # parsed once: a JSON ledger holds the string
  if isinstance(ledger.num_bands, bool) or int(ledger.num_bands) != ledger.num_bands or ledger.num_bands < 1:
    raise PrivacyError(f"num_bands must be an integer >= 1, got {ledger.num_bands!r}")
  ledger.num_bands = int(ledger.num_bands)
  if not ledger.correlated:
    if ledger.num_bands != 1 or ledger.strategy is not None:
      raise PrivacyError("a Gaussian-noise ledger has num_bands = 1 and no strategy")
    return None
  if ledger.non_private or ledger.sampling != privacy_params.Sampling.POISSON or ledger.max_batch_size is not None:
    raise PrivacyError("correlated noise is accounted for untruncated Poisson sampling only")
  if not isinstance(ledger.strategy, dict):
    raise PrivacyError(f"a {ledger.noise} ledger needs its strategy, got {ledger.strategy!r}")
  strategy = strategies.Strategy.from_dict(ledger.strategy)
  if strategy.kind != ledger.noise or strategy.num_bands != ledger.num_bands:
    raise PrivacyError(f"the strategy is {strategy.kind!r} with b={strategy.num_bands}, but the "
                       f"ledger's noise is {ledger.noise!r} with b={ledger.num_bands}")
  recorded = ledger.strategy.get("sensitivity")
  if not isinstance(recorded, (int, float)) or not math.isclose(recorded, strategy.sensitivity, rel_tol=1e-9):
    raise DataError(f"the recorded strategy's sensitivity {recorded!r} is not its coefficients' "
                    f"({strategy.sensitivity!r})")
  return strategy


def check_same_mechanism(saved, ledger) -> None:
  """PrivacyError unless the `saved` ledger has `ledger`'s mechanism (σ, q, C, δ, unit, sampling,
  truncation cap, private/non-private, noise, b and strategy: `MECHANISM_FIELDS`)."""
  for field in MECHANISM_FIELDS:
    a, b = getattr(saved, field), getattr(ledger, field)
    same = (a == b) if not isinstance(a, float) or not isinstance(b, float) else math.isclose(a, b, rel_tol=1e-9)
    if not same:
      raise PrivacyError(f"cannot resume: the checkpoint's ledger has {field}={a!r} but this run "
                         f"has {field}={b!r}; a ledger covers one mechanism (start a new run instead)")
