"""The trainer's privacy setup: one config picks the aggregator, the sampler and the ledger.

DP is one swapped component. `dp=None` gives the non-private baseline: `MeanAggregator`,
shuffled fixed batches, and a ledger that records steps with ε = ∞. A `DPConfig` gives
DP-Adafactor: a DP aggregator (clip, sum, noise, divide by q N; ghost clipping by default),
Poisson sampling with rate q = expected_batch_size / N, and a ledger whose accounting event is
built from the same q, σ (and truncation cap, if any) as the sampler (DP rule "sampling matches accounting"). By default
the sample is not truncated: a step's sample of any size runs as ceil(n / m) microbatches of
m = microbatch_size (or batch_size) rows, the noise is added once to their clipped sum, and the
ledger accounts the plain Poisson subsampled Gaussian. `sampling="poisson_truncated"` caps a
sample at `batch_size` rows instead.

Everything here runs before any compute: invalid privacy parameters, an unreachable target ε
or a batch larger than the dataset fail at once with a PrivacyError.
"""
import dataclasses
import math
import warnings
from typing import Any, Callable, Dict, Optional

from private_t5.dp import accounting
from private_t5.dp import aggregator as aggregator_lib
from private_t5.dp import factory
from private_t5.dp import sampling
from private_t5.dp.ledger import PrivacyLedger, find_vocabulary_report, insecure_noise_warning
from private_t5.errors import ConfigError, PrivacyError
from private_t5.train import partitioning

# Largest acceptable per-step chance that a Poisson batch exceeds the padded batch size when
# the expected batch size is derived from it.
DEFAULT_MAX_TRUNCATION_PROBABILITY = 1e-6


@dataclasses.dataclass(frozen=True)
class DPConfig:
  """Differential privacy of a training run (all fixed before training: DP rule "nothing else leaks").

  Attributes:
    clip_norm: C, the per-example gradient L2 bound.
    noise_multiplier: σ (noise std σ·C on the clipped sum). Exactly one of this and
      `target_epsilon`.
    target_epsilon: calibrate σ before training so that the run ends at this ε.
    delta: δ; None uses min(1e-5, 1 / N^1.1) (`default_delta`): well below 1/N, where a
      mechanism that publishes one random example would already satisfy the guarantee.
    accountant: "auto" (default: the smaller ε of RDP and PLD for the same event, and σ
      calibrated by the same rule), "rdp" (the paper's) or "pld".
    expected_batch_size: q·N, the Poisson sample's expected size and the public divisor of the
      noisy sum. None: `batch_size` (untruncated sampling); with truncation, the largest size
      whose truncation at the padded `batch_size` adds at most 10% of δ over the run,
      (1 + e^ε)·steps·p_trunc ≤ 0.1 δ (and p_trunc ≤ 1e-6); an explicit value whose truncation
      adds more than that is refused (PrivacyError).
    sampling: "poisson" (default: untruncated Poisson sampling run in microbatches) or
      "poisson_truncated" (a sample is capped at `batch_size` rows).
    method: how the clipped sum is computed: "ghost" (default: ghost norms and book-keeping,
      no per-example gradients; docs/ghost_clipping.md) or "vmap" (per-example gradients, the
      reference implementation). Same mechanism, same ledger.
    vocab_is_public: the vocabulary was built without the private data (Gin macro
      VOCAB_IS_PUBLIC). Without a DP-SentencePiece report that names the vocabulary, the total ε
      is ∞ unless this is set.
  """
  clip_norm: float = 1.0
  noise_multiplier: Optional[float] = None
  target_epsilon: Optional[float] = None
  delta: Optional[float] = None
  accountant: str = "auto"
  expected_batch_size: Optional[float] = None
  sampling: str = "poisson"
  method: str = "ghost"
  vocab_is_public: bool = False


@dataclasses.dataclass
class PrivacySetup:
  """What the trainer needs from the privacy configuration."""
  aggregator: Callable
  sampler: Any
  ledger: PrivacyLedger
  private: bool
  noise_multiplier: Optional[float] = None
  dp_spm_report: Optional[str] = None
  # Untruncated Poisson sampling: a step's sample runs as microbatches of this many rows
  # (`Trainer.train_step_microbatched`); None: one fixed-size batch per step.
  microbatch_size: Optional[int] = None

  def mechanism(self) -> Dict[str, Any]:
    """The ledger fields that define the mechanism (part of the checkpoint fingerprint)."""
    d = self.ledger.to_dict()
    return {k: d.get(k) for k in ("non_private", "noise_multiplier", "sampling_rate", "clip_norm",
                                  "delta", "accountant", "privacy_unit", "max_batch_size", "sampling")}


# DPConfig.sampling values: untruncated Poisson (microbatched), or truncated at batch_size.
POISSON = "poisson"
POISSON_TRUNCATED = "poisson_truncated"
DP_SAMPLING = (POISSON, POISSON_TRUNCATED)
# Share of δ the batch truncation may add over the run (a larger share is refused).
TRUNCATION_DELTA_SHARE = 0.1
# The default δ is min(DEFAULT_DELTA_CAP, 1 / N^DEFAULT_DELTA_EXPONENT).
DEFAULT_DELTA_CAP = 1e-5
DEFAULT_DELTA_EXPONENT = 1.1


def default_delta(num_examples: int) -> float:
  """min(1e-5, 1 / N^1.1): δ well below 1/N (a δ ≥ 1/N permits leaking a whole example)."""
  return min(DEFAULT_DELTA_CAP, float(num_examples) ** -DEFAULT_DELTA_EXPONENT)


def _expected_batch_for_delta(dp: "DPConfig", num_examples: int, batch_size: int, train_steps: int,
                              delta: float) -> int:
  """The largest expected batch whose truncation adds at most 10% of δ over the run.

  Truncation adds (1 + e^ε) · steps · p_trunc to δ (`accounting.total_delta`), so the
  per-step bound is 0.1 δ / (steps (1 + e^ε)), never looser than 1e-6. ε is the target ε, or
  with a fixed σ the ε at the 1e-6 batch size: ε only falls as the batch shrinks, so the bound
  from that ε is conservative.
  """
  expected = accounting.max_expected_batch_size_for(num_examples, batch_size,
                                                   DEFAULT_MAX_TRUNCATION_PROBABILITY)
  if dp.target_epsilon is not None:
    epsilon = dp.target_epsilon
  else:
    epsilon = accounting.compute_epsilon(dp.noise_multiplier, expected / num_examples, train_steps,
                                         delta, "rdp")
  bound = TRUNCATION_DELTA_SHARE * delta / (train_steps * (1.0 + math.exp(min(epsilon, 700.0))))
  if bound >= DEFAULT_MAX_TRUNCATION_PROBABILITY:
    return expected
  return accounting.max_expected_batch_size_for(num_examples, batch_size, bound)


def _check_truncation_delta(sigma: float, q: float, num_examples: int, batch_size: int, train_steps: int,
                            delta: float, dp: "DPConfig") -> None:
  """Refuses a batch truncation that adds more than 10% of δ by the end of training."""
  epsilon = (dp.target_epsilon if dp.target_epsilon is not None else
             accounting.compute_epsilon(sigma, q, train_steps, delta, "rdp"))
  p_trunc = accounting.truncation_probability(num_examples, q, batch_size)
  added = accounting.total_delta(delta, train_steps, p_trunc, epsilon) - delta
  if added > TRUNCATION_DELTA_SHARE * delta * (1 + 1e-9):  # (rounding of a derived batch)
    raise PrivacyError(
        f"batch truncation breaks δ: expected_batch_size={q * num_examples:g} capped at batch_size={batch_size} "
        f"is truncated with probability {p_trunc:.2e}/step, adding (1+e^ε)·steps·p = {added:.2e} to "
        f"δ={delta:.3g} over {train_steps} steps (at most {TRUNCATION_DELTA_SHARE:g}·δ allowed); lower "
        "expected_batch_size (or leave it unset to derive it) or raise batch_size")


def setup_privacy(dp: Optional[DPConfig], *, loss_fn: Callable, num_examples: int, privacy_unit: str,
                  batch_size: int, train_steps: int, microbatch_size: Optional[int], sampler_seed: int,
                  vocab_path: Optional[str] = None, spmd_axis_name: Optional[str] = partitioning.DATA_AXIS,
                  noise_secret: bool = True, log: Callable[[str], None] = print) -> PrivacySetup:
  """Builds aggregator, sampler and ledger for a private (`dp`) or non-private (`None`) run.

  `noise_secret` is False when the run's seeds are fixed (insecure): the ledger records it, and
  its report says that its ε is no guarantee.
  """
  if batch_size <= 0 or train_steps <= 0:
    raise ConfigError(f"batch_size and train_steps must be > 0, got {batch_size} and {train_steps}")
  if dp is None:
    if batch_size > num_examples:
      raise ConfigError(f"batch_size={batch_size} is larger than the dataset ({num_examples} examples)")
    return PrivacySetup(
        aggregator=aggregator_lib.MeanAggregator(loss_fn, microbatch_size),
        sampler=sampling.ShuffledBatchSampler(num_examples, batch_size, sampler_seed),
        ledger=PrivacyLedger.non_private_baseline(num_examples=num_examples, privacy_unit=privacy_unit,
                                                  batch_size=batch_size, noise_secret=noise_secret),
        private=False)
  if not isinstance(dp, DPConfig):
    raise ConfigError(f"dp must be a DPConfig or None, got {type(dp).__name__}")
  if dp.sampling not in DP_SAMPLING:
    raise PrivacyError(f"DP training supports sampling in {DP_SAMPLING}, got {dp.sampling!r}: fixed "
                       "shuffled batches are a different mechanism and are not offered")
  truncated = dp.sampling == POISSON_TRUNCATED
  if (dp.noise_multiplier is None) == (dp.target_epsilon is None):
    raise PrivacyError("set exactly one of DPConfig.noise_multiplier and DPConfig.target_epsilon "
                       f"(got {dp.noise_multiplier!r} and {dp.target_epsilon!r})")
  delta = dp.delta if dp.delta is not None else default_delta(num_examples)
  accounting.validate_privacy_params(noise_multiplier=dp.noise_multiplier, clip_norm=dp.clip_norm,
                                     delta=delta, num_examples=num_examples, batch_size=batch_size,
                                     accountant=dp.accountant, steps=train_steps)
  if dp.noise_multiplier is not None and dp.noise_multiplier <= 0:
    raise PrivacyError(f"noise_multiplier must be > 0 for DP training, got {dp.noise_multiplier} "
                       "(use dp=None for a non-private run)")
  expected = dp.expected_batch_size
  if expected is None:
    expected = (_expected_batch_for_delta(dp, num_examples, batch_size, train_steps, delta) if truncated
                else batch_size)
  accounting.validate_privacy_params(batch_size=expected, num_examples=num_examples)
  if truncated and expected > batch_size:
    raise PrivacyError(f"expected_batch_size={expected} exceeds the padded batch_size={batch_size}")
  q = accounting.sampling_rate_from_batch(expected, num_examples)
  rows = int(microbatch_size) if microbatch_size else batch_size
  sampler = (sampling.PoissonSampler(num_examples, q, batch_size, sampler_seed) if truncated else
             sampling.PoissonSampler(num_examples, q, None, sampler_seed, microbatch_size=rows))
  sigma = dp.noise_multiplier
  if sigma is None:
    sigma = accounting.calibrate_noise(dp.target_epsilon, q, train_steps, delta, dp.accountant)
    log(f"[privacy] calibrated noise_multiplier σ={sigma:.4f} for ε={dp.target_epsilon:g} at "
        f"δ={delta:.3g}, q={q:.4g}, {train_steps} steps ({dp.accountant})")
  if truncated:
    _check_truncation_delta(sigma, q, num_examples, batch_size, train_steps, delta, dp)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", accounting.MeaninglessGuaranteeWarning)  # warned above
    ledger = PrivacyLedger.create(noise_multiplier=sigma, clip_norm=dp.clip_norm, delta=delta,
                                  num_examples=num_examples, sampling_rate=q,
                                  max_batch_size=batch_size if truncated else None,
                                  accountant=dp.accountant, privacy_unit=privacy_unit, sampling="poisson",
                                  configured_batch_size=batch_size, clipping_method=dp.method,
                                  noise_secret=noise_secret)
  report = find_vocabulary_report(vocab_path)
  if vocab_path:
    component = ledger.add_vocabulary(vocab_path, report, public=dp.vocab_is_public)
    if "epsilon" in component:
      group = component.get("group_privacy")
      log(f"[privacy] composed the vocabulary's DP guarantee from {report}: "
          f"ε={component['epsilon']:g}, δ={component['delta']:g}"
          + (f" ({group['privacy_unit']}-level ε={group['epsilon']:g}, δ={group['delta']:g}, for "
             f"{privacy_unit}-level training by group privacy of {group['size']})" if group else ""))
      if not component.get("noise_secret", True):
        log(f"[privacy] WARNING: {insecure_noise_warning(f'the vocabulary {vocab_path} (dp-spm --insecure_seed)')}")
    elif component["public"]:
      report = None
      log(f"[privacy] vocabulary {vocab_path} declared public (VOCAB_IS_PUBLIC): not counted in ε")
    else:
      report = None
      log(f"[privacy] WARNING: the vocabulary {vocab_path} is not differentially private "
          f"({component['reason']}): the total ε is ∞ (DP-Adafactor's own ε is still reported as "
          "training_epsilon); train it with `private-t5 dp-spm`, or set VOCAB_IS_PUBLIC=True if it "
          "was built without the private data")
  aggregator = factory.make_dp_aggregator(loss_fn, dp.clip_norm, sigma, q * num_examples, microbatch_size,
                                         spmd_axis_name=spmd_axis_name, method=dp.method)
  batching = (f"padded {batch_size}, truncation probability/step {ledger.truncation_probability:.2e}"
              if truncated else f"untruncated, run in microbatches of {rows} rows")
  log(f"[privacy] DP training: unit={privacy_unit}, N={num_examples}, q={q:.4g} (expected batch "
      f"{q * num_examples:.1f}, {batching}), C={dp.clip_norm:g}, σ={sigma:.4f}, δ={delta:.3g}, "
      f"clipped sum by {dp.method}")
  return PrivacySetup(aggregator=aggregator, sampler=sampler, ledger=ledger, private=True,
                      noise_multiplier=sigma, dp_spm_report=report,
                      microbatch_size=None if truncated else rows)
