"""The privacy parameters of DP training, checked once: their names and their checks.

The one name of each sampling scheme (`Sampling`), noise kind (`NoiseKind`) and accountant (`ACCOUNTANTS`, `AUTO`), the
checks of C, σ, q, δ, N and the batch size (`validate_privacy_params`, `check_clip_norm`), and
`NoisySum`, the one record of a run's C, σ and public divisor q·N. Light on purpose: no
accountant, no JAX; `accounting` (which computes ε from these) re-exports every name.
"""
import dataclasses
import enum
import math
import warnings
from typing import Optional

from private_t5.errors import PrivacyError

ACCOUNTANTS = ("rdp", "pld")
# What a run may ask for: one accountant, or "auto", the smaller ε of the two (`compute_epsilons`).
AUTO = "auto"
ACCOUNTANT_CHOICES = (AUTO,) + ACCOUNTANTS


class Sampling(str, enum.Enum):
  """Who is in a step's batch: the one name of each sampling scheme, in configs, samplers,
  accounting and reports (a member equals its string value: "poisson" == Sampling.POISSON).

  POISSON: every example joins each step independently with rate q, the sample of any size
  runs in microbatches (DP training's default). POISSON_TRUNCATED: the same, a sample capped at
  the padded batch size; accounted as POISSON with the cap (`make_dp_event(max_batch_size=)`)
  and the δ the cap adds. FIXED: shuffled fixed-size batches (sampling without replacement;
  the non-private baseline, accounted only as such).
  """
  POISSON = "poisson"
  POISSON_TRUNCATED = "poisson_truncated"
  FIXED = "fixed"

  def __str__(self) -> str:
    return self.value


class NoiseKind(enum.StrEnum):
  """`DPConfig.noise`: independent Gaussian noise (DP-SGD), or correlated noise by a banded or BLT
  matrix factorization strategy (`strategies`). Parsed once, where a config, ledger or strategy is
  made, from the string a Gin file, a flag or a JSON ledger holds; a member is that string
  ("banded" == NoiseKind.BANDED), and its str(), format(), JSON and repr() are the plain string's,
  so every message and record reads as the string would.
  """
  GAUSSIAN = "gaussian"
  BANDED = "banded"
  BLT = "blt"

  def __repr__(self) -> str:
    return repr(self.value)

  @property
  def correlated(self) -> bool:
    """Whether the noise is correlated across steps (a matrix factorization strategy)."""
    return self is not NoiseKind.GAUSSIAN


# The schemes an accountant tells apart (a truncated Poisson sample is POISSON with a cap).
SAMPLING_SCHEMES = (Sampling.POISSON.value, Sampling.FIXED.value)


class MeaninglessGuaranteeWarning(UserWarning):
  """δ is so large that the (ε, δ) guarantee allows leaking a whole example."""


def check_number(name: str, value, low=None, high=None, low_open=True, high_open=True):
  """`value` as a float; PrivacyError naming `name` unless it is a finite number within the bounds
  (`low`, `high`: open unless `low_open`/`high_open` is False; None: unbounded)."""
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise PrivacyError(f"{name} must be a number, got {value!r}") from None
  if math.isnan(v) or math.isinf(v):
    raise PrivacyError(f"{name} must be finite, got {value!r}")
  if low is not None and (v < low or (low_open and v == low)):
    raise PrivacyError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
  if high is not None and (v > high or (high_open and v == high)):
    raise PrivacyError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")
  return v


def check_clip_norm(value, name: str = "clip_norm (C)") -> float:
  """C as a float; PrivacyError unless it is a finite number > 0. The one check of a clip norm:
  a `DPConfig` runs it when the user's config is made, a `NoisySum` when one is built without
  one (a benchmark, a ledger read back from its file)."""
  return check_number(name, value, low=0, low_open=True)


@dataclasses.dataclass(frozen=True)
class NoisySum:
  """What one DP step releases: (Σ_i clip_C(g_i) + N(0, σ²C² I)) / (q N).

  The one record of a run's C, σ and public divisor q·N: `mechanism.build_mechanism` makes it
  once, and the aggregator that computes the release and the ledger that accounts it hold
  this same object. Checked here, once, whoever builds it (the mechanism, a benchmark, a ledger
  read back from its file).

  Attributes:
    clip_norm: C > 0, the L2 bound on each example's gradient.
    noise_multiplier: σ >= 0; the noise std on the sum is σ·C. 0 draws no noise (tests and
      compile benchmarks only: no privacy; a ledger refuses it).
    expected_batch_size: q·N > 0, the public constant the noisy sum is divided by (never the
      realised, private, sample size).
  """
  clip_norm: float
  noise_multiplier: float
  expected_batch_size: float

  def __post_init__(self):
    object.__setattr__(self, "clip_norm", check_clip_norm(self.clip_norm))
    for name, low_open in (("noise_multiplier", False), ("expected_batch_size", True)):
      value = check_number(f"{name} ({_SYMBOLS[name]})", getattr(self, name), low=0, low_open=low_open)
      object.__setattr__(self, name, value)

  @property
  def noise_std(self) -> float:
    """The std of the Gaussian noise on each coordinate of the clipped sum: σ·C."""
    return self.noise_multiplier * self.clip_norm


_SYMBOLS = {"noise_multiplier": "σ", "expected_batch_size": "q·N"}


def sampling_rate_from_batch(batch_size: float, num_examples: int) -> float:
  """q = expected batch size / N, refusing a batch larger than the dataset."""
  n = check_number("num_examples", num_examples, low=0)
  b = check_number("batch_size", batch_size, low=0)
  if b > n:
    raise PrivacyError(f"batch_size {batch_size} is larger than the dataset ({num_examples} examples)")
  return b / n


def validate_privacy_params(*, noise_multiplier: Optional[float] = None,
                            sampling_rate: Optional[float] = None,
                            steps: Optional[int] = None,
                            delta: Optional[float] = None,
                            num_examples: Optional[int] = None,
                            batch_size: Optional[float] = None,
                            accountant: Optional[str] = None,
                            sampling: Optional[str] = None,
                            delta_source: Optional[str] = None) -> None:
  """Checks DP parameters before any compute; raises `PrivacyError` naming the bad value.

  Arguments left as None are not checked. δ ≥ 1/N (N = num_examples) warns loudly with a
  `MeaninglessGuaranteeWarning`: such a δ permits releasing one whole example. `delta_source`
  (e.g. "--delta") says in that warning where δ came from.
  """
  if noise_multiplier is not None:
    check_number("noise_multiplier (σ)", noise_multiplier, low=0)
  if sampling_rate is not None:
    check_number("sampling_rate (q)", sampling_rate, low=0, high=1, high_open=False)
  if steps is not None:
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
      raise PrivacyError(f"steps must be an integer >= 1, got {steps!r}")
  if delta is not None:
    check_number("delta (δ)", delta, low=0, high=1)
  if num_examples is not None:
    if int(num_examples) != num_examples or num_examples < 1:
      raise PrivacyError(f"num_examples must be an integer >= 1, got {num_examples!r}")
  if batch_size is not None:
    check_number("batch_size", batch_size, low=0)
    if num_examples is not None and batch_size > num_examples:
      raise PrivacyError(f"batch_size {batch_size} is larger than the dataset ({num_examples} examples)")
  if accountant is not None and accountant not in ACCOUNTANT_CHOICES:
    raise PrivacyError(f"accountant must be one of {ACCOUNTANT_CHOICES}, got {accountant!r}")
  if sampling is not None and sampling not in SAMPLING_SCHEMES:
    raise PrivacyError(f"sampling must be one of {SAMPLING_SCHEMES}, got {sampling!r}")
  if delta is not None and num_examples is not None and delta >= 1.0 / num_examples:
    source = f" ({delta_source})" if delta_source else ""
    warnings.warn(
        f"delta={delta:g}{source} >= 1/num_examples={1.0 / num_examples:g}: the (ε, δ) guarantee is "
        "meaningless (a mechanism that publishes one random example satisfies it); use δ << 1/N",
        MeaninglessGuaranteeWarning, stacklevel=2)

