"""The DP mechanism of a training run, built in one place from its privacy config.

`build_mechanism(dp, execution, ...)`: checks the rules that depend on the data (expected batch
vs N and the padded batch, the δ added by truncation), calibrates σ, and builds the mechanism's
four parts from the same q, σ and C (DP rule "sampling matches accounting"): the clipped-sum
function (carrying C and q·N), the noise transform (an optax transform), the sampler and the DP
event of one step, plus the ledger that composes that event. Its inputs, `DPConfig` (what the
guarantee depends on) and `ExecutionSettings` (speed and memory only; `BatchLayout`), are
`config`'s, checked there when made; their names are importable from here as well.

`dp=None` gives the non-private baseline: the mean (`MeanAggregator`), no noise
(`noise.no_noise()`), shuffled fixed batches, no DP event and a ledger that records steps with
ε = ∞: the same plan with other parts, so the training loop has no private/non-private branch.
A `DPConfig` gives DP-Adafactor: a clipped sum (clip, sum, divide by q N; ghost clipping by
default), Gaussian noise σ·C/(q N) on it, Poisson sampling with rate
q = expected_batch_size / N, and the PoissonSampled Gaussian event of the same q and σ (and
truncation cap, if any). By default the sample is not truncated: a step's sample of any size
runs as ceil(n / m) microbatches of m = microbatch_size (or batch_size) rows, the noise is
added once to their clipped sum, and the ledger accounts the plain Poisson subsampled Gaussian.
`sampling="poisson_truncated"` caps a sample at `batch_size` rows instead.

`DPConfig.noise = "banded"` or `"blt"` gives correlated noise by matrix factorization instead
(`strategies`, docs/dp_training.md): cyclic Poisson sampling in b = `num_bands` groups
(`sampling.CyclicPoissonSampler`, q the rate within a group, q·N/b the expected batch and the
public divisor), the noise C⁻¹ Z of a strategy optimised for the run's steps
(`noise.noise_transform(noisy_sum, strategy)`, a stateful transform: the trainer keeps its state), and the
strategy's event for the steps taken in the ledger (banded: amplified; BLT: one Gaussian
release). b = 1 with "banded" is DP-SGD.

Everything here runs before any compute: invalid privacy parameters, an unreachable target ε
or a batch larger than the dataset fail at once with a PrivacyError.
"""
import dataclasses
import math
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from private_t5.dp import accounting
from private_t5.dp import aggregator as aggregator_lib
from private_t5.dp import ghost
from private_t5.dp import noise as noise_lib
from private_t5.dp import privacy_params
from private_t5.dp import public_vocabulary
from private_t5.dp import sampling
from private_t5.dp import strategies
from private_t5.dp import truncation
# The run's config and settings, importable from here as well (`config` owns them).
from private_t5.dp.config import BOOKKEEPING, GHOST, BatchLayout, DPConfig, ExecutionSettings, default_delta
from private_t5.dp.ledger import PrivacyLedger
from private_t5.dp.privacy_report import find_vocabulary_report, insecure_noise_warning
from private_t5.errors import ConfigError, PrivacyError

# Largest acceptable per-step chance that a Poisson batch exceeds the padded batch size when
# the expected batch size is derived from it.
DEFAULT_MAX_TRUNCATION_PROBABILITY = 1e-6
# The DP aggregator computing the clipped sum of each `ExecutionSettings.method` (`config.DP_METHODS`).
# "vmap": per-example gradients under `jax.vmap` (`aggregator.DPAggregator`, the reference);
# "ghost": ghost norms and book-keeping, no per-example gradients (`ghost.GhostDPAggregator`,
# docs/ghost_clipping.md). Both clip, noise and divide identically: same privacy, same ledger.
AGGREGATORS = {"vmap": aggregator_lib.DPAggregator, GHOST: ghost.GhostDPAggregator}
# Share of δ the batch truncation may add over the run (a larger share is refused).
TRUNCATION_DELTA_SHARE = 0.1
# The name of the mesh axis the examples are sharded over (`train.partitioning.DATA_AXIS`).
DATA_AXIS = "data"


class Sampler(Protocol):
  """Who is in each step's batch (`sampling.PoissonSampler`, `sampling.ShuffledBatchSampler`)."""

  def indices_for_step(self, step: int) -> np.ndarray:
    ...

  @property
  def expected_batch_size(self) -> float:
    ...


@dataclasses.dataclass
class Mechanism:
  """A run's privacy mechanism, built by `build_mechanism`: four parts, and the ledger.

  Attributes:
    clipped_sum: the clipped-sum function (`aggregator.DPAggregator`, `ghost.GhostDPAggregator`;
      `MeanAggregator` for a non-private run): `zero_sum`, `accumulate`, `finish`; it carries C
      and the public divisor q·N (its `noisy_sum`).
    noise: the noise transform (`noise.noise_transform`: Gaussian, or correlated by a strategy,
      whose state the trainer keeps across steps; `noise.no_noise()` for a non-private run), an
      optax `GradientTransformationExtraArgs` applied once per step.
    sampler: draws each step's example indices (it knows nothing about microbatches).
    dp_event: the `dp_accounting.DpEvent` of ONE step (None without a formal guarantee); the
      ledger composes one per step taken. Correlated noise: the event of the whole planned run
      (its steps are accounted together, `PrivacyLedger.training_event`).
    ledger: the privacy spent so far (replaced by the checkpoint's on resume).
    noise_multiplier: σ (calibrated when a target ε was given); None for a non-private run.
    dp_spm_report: the DP-SentencePiece report composed into the ledger, if any.
  """
  clipped_sum: Any
  noise: Any
  sampler: Sampler
  dp_event: Any
  ledger: PrivacyLedger
  noise_multiplier: Optional[float] = None
  dp_spm_report: Optional[str] = None

  @property
  def private(self) -> bool:
    """Whether the run has a formal DP guarantee (its ledger accounts a DP mechanism)."""
    return not self.ledger.non_private

  @property
  def aggregator(self):
    """The former name of `clipped_sum`."""
    return self.clipped_sum

  def indices_for_step(self, step: int) -> np.ndarray:
    """The (unpadded) example indices of step `step`: a pure function of the seed and step."""
    return self.sampler.indices_for_step(step)

  def fingerprint(self) -> Dict[str, Any]:
    """The ledger fields that define the mechanism (part of the checkpoint fingerprint)."""
    d = self.ledger.to_dict()
    out = {k: d.get(k) for k in ("non_private", "noise_multiplier", "sampling_rate", "clip_norm",
                                 "delta", "accountant", "privacy_unit", "max_batch_size", "sampling")}
    if self.ledger.correlated:
      out.update(noise=str(self.ledger.noise), num_bands=self.ledger.num_bands, strategy=self.ledger.strategy_digest)
    return out


def step_parts(noisy_sum: Optional[privacy_params.NoisySum], method: str, loss_fn: Callable, *,
               spmd_axis_name: Optional[str] = None, strategy: Optional[strategies.Strategy] = None,
               **ghost_options) -> Tuple[Any, Any]:
  """(clipped sum, noise transform) of a step: the mean and no noise when `noisy_sum` is None,
  else the `method` clipped sum ("vmap" or "ghost", with `ghost.GhostDPAggregator`'s options)
  of `noisy_sum`'s C and q·N and its noise transform (`noise.noise_transform`: Gaussian, or
  with a `strategy` correlated). `build_mechanism` and the benchmark build their steps here;
  `method` was checked by their settings."""
  if noisy_sum is None:
    return aggregator_lib.MeanAggregator(loss_fn), noise_lib.no_noise()
  clipped_sum = AGGREGATORS[method](loss_fn, noisy_sum, spmd_axis_name=spmd_axis_name, **ghost_options)
  return clipped_sum, noise_lib.noise_transform(noisy_sum, strategy)


def _ghost_options(execution: ExecutionSettings) -> Dict[str, Any]:
  """`ghost.GhostDPAggregator`'s options from the execution settings (none for "vmap")."""
  options = {"stack_layers": True} if execution.stack_layers else {}
  if execution.ghost_clipped_sum != BOOKKEEPING:
    options["clipped_sum_method"] = execution.ghost_clipped_sum
  return options


def _expected_batch_for_delta(dp: "DPConfig", num_examples: int, batch_size: int, train_steps: int,
                              delta: float) -> int:
  """The largest expected batch whose truncation adds at most 10% of δ over the run.

  Truncation adds (1 + e^ε) · steps · p_trunc to δ (`truncation.total_delta`), so the
  per-step bound is 0.1 δ / (steps (1 + e^ε)), never looser than 1e-6. ε is the target ε, or
  with a fixed σ the ε at the 1e-6 batch size: ε only falls as the batch shrinks, so the bound
  from that ε is conservative.
  """
  expected = truncation.max_expected_batch_size_for(num_examples, batch_size,
                                                   DEFAULT_MAX_TRUNCATION_PROBABILITY)
  if dp.target_epsilon is not None:
    epsilon = dp.target_epsilon
  else:
    epsilon = accounting.compute_epsilon(dp.noise_multiplier, expected / num_examples, train_steps,
                                         delta, "rdp")
  bound = TRUNCATION_DELTA_SHARE * delta / (train_steps * (1.0 + math.exp(min(epsilon, 700.0))))
  if bound >= DEFAULT_MAX_TRUNCATION_PROBABILITY:
    return expected
  return truncation.max_expected_batch_size_for(num_examples, batch_size, bound)


def _check_truncation_delta(sigma: float, q: float, num_examples: int, batch_size: int, train_steps: int,
                            delta: float, dp: "DPConfig") -> None:
  """Refuses a batch truncation that adds more than 10% of δ by the end of training."""
  epsilon = (dp.target_epsilon if dp.target_epsilon is not None else
             accounting.compute_epsilon(sigma, q, train_steps, delta, "rdp"))
  p_trunc = truncation.truncation_probability(num_examples, q, batch_size)
  added = truncation.total_delta(delta, train_steps, p_trunc, epsilon) - delta
  if added > TRUNCATION_DELTA_SHARE * delta * (1 + 1e-9):  # (rounding of a derived batch)
    raise PrivacyError(
        f"batch truncation breaks δ: expected_batch_size={q * num_examples:g} capped at batch_size={batch_size} "
        f"is truncated with probability {p_trunc:.2e}/step, adding (1+e^ε)·steps·p = {added:.2e} to "
        f"δ={delta:.3g} over {train_steps} steps (at most {TRUNCATION_DELTA_SHARE:g}·δ allowed); lower "
        "expected_batch_size (or leave it unset to derive it) or raise batch_size")


def build_mechanism(dp: Optional[DPConfig], execution: ExecutionSettings, *, loss_fn: Callable,
                    num_examples: int, privacy_unit: str, batch_size: int, train_steps: int, sampler_seed: int,
                    vocab_path: Optional[str] = None, spmd_axis_name: Optional[str] = DATA_AXIS,
                    noise_secret: bool = True, population: Optional[Mapping[str, Any]] = None,
                    corpus: Union[None, str, Sequence[str]] = None, data_files: Optional[Sequence[str]] = None,
                    unknown_files: Optional[str] = None, log: Callable[[str], None] = print) -> Mechanism:
  """The mechanism's four parts (clipped sum, noise transform, sampler, DP event) and its ledger,
  for a private (`dp`) or non-private (`None`) run.

  The rules that depend on the data are checked here, once: the batch sizes against N, and
  with truncation the δ the cap adds. `spmd_axis_name` is the mesh axis the examples are
  sharded over (None on a mesh with one data position). `noise_secret` is False when the run's
  seeds are fixed (insecure): the ledger records it, and its report says that its ε is no
  guarantee. `population` (public facts on what the N units are, `PrivacyLedger.population`)
  goes into the ledger and every report. `corpus` is the training corpus spec, `data_files` more
  files the training data reads (a seqio Task's) and `unknown_files` why they are not all known: a
  vocabulary declared public is checked against them (`public_vocabulary.check_public_declaration`).
  """
  population = dict(population) if population else None
  if batch_size <= 0 or train_steps <= 0:
    raise ConfigError(f"batch_size and train_steps must be > 0, got {batch_size} and {train_steps}")
  if dp is None:
    if batch_size > num_examples:
      raise ConfigError(f"batch_size={batch_size} is larger than the dataset ({num_examples} examples)")
    clipped_sum, noise = step_parts(None, execution.method, loss_fn)
    return Mechanism(
        clipped_sum=clipped_sum, noise=noise,
        sampler=sampling.ShuffledBatchSampler(num_examples, batch_size, sampler_seed), dp_event=None,
        ledger=PrivacyLedger.non_private_baseline(num_examples=num_examples, privacy_unit=privacy_unit,
                                                  batch_size=batch_size, noise_secret=noise_secret,
                                                  population=population))
  if not isinstance(dp, DPConfig):
    raise ConfigError(f"dp must be a DPConfig or None, got {type(dp).__name__}")
  if dp.correlated:
    return _build_correlated(dp, execution, loss_fn=loss_fn, num_examples=num_examples, privacy_unit=privacy_unit,
                             batch_size=batch_size, train_steps=train_steps, sampler_seed=sampler_seed,
                             vocab_path=vocab_path, spmd_axis_name=spmd_axis_name, noise_secret=noise_secret,
                             population=population, corpus=corpus, data_files=data_files,
                             unknown_files=unknown_files, log=log)
  truncated = dp.truncated
  dp.check_data(num_examples=num_examples, batch_size=batch_size)
  delta = dp.delta if dp.delta is not None else default_delta(num_examples)
  privacy_params.validate_privacy_params(delta=delta, num_examples=num_examples, steps=train_steps)
  expected = dp.expected_batch_size
  if expected is None:
    expected = (_expected_batch_for_delta(dp, num_examples, batch_size, train_steps, delta) if truncated
                else batch_size)
  q = privacy_params.sampling_rate_from_batch(expected, num_examples)
  max_batch_size = batch_size if truncated else None
  sampler = sampling.PoissonSampler(num_examples, q, max_batch_size, sampler_seed)
  sigma = dp.noise_multiplier
  if sigma is None:
    sigma = accounting.calibrate_noise(dp.target_epsilon, q, train_steps, delta, dp.accountant)
    log(f"[privacy] calibrated noise_multiplier σ={sigma:.4f} for ε={dp.target_epsilon:g} at "
        f"δ={delta:.3g}, q={q:.4g}, {train_steps} steps ({dp.accountant})")
  if truncated:
    _check_truncation_delta(sigma, q, num_examples, batch_size, train_steps, delta, dp)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", privacy_params.MeaninglessGuaranteeWarning)  # warned above
    noisy_sum = privacy_params.NoisySum(dp.clip_norm, sigma, q * num_examples)
    ledger = PrivacyLedger.create(noisy_sum=noisy_sum, delta=delta, num_examples=num_examples, sampling_rate=q,
                                  max_batch_size=max_batch_size, accountant=dp.accountant,
                                  privacy_unit=privacy_unit, sampling=privacy_params.Sampling.POISSON.value,
                                  configured_batch_size=batch_size, clipping_method=execution.method,
                                  noise_secret=noise_secret, population=population)
  report = _compose_vocabulary(ledger, vocab_path, dp.vocab_is_public, privacy_unit, log, corpus, data_files,
                               unknown_files)
  clipped_sum, noise = step_parts(noisy_sum, execution.method, loss_fn, spmd_axis_name=spmd_axis_name,
                                  **_ghost_options(execution))
  rows = BatchLayout.for_run(dp, execution, batch_size).batch_rows
  batching = (f"padded {batch_size}, truncation probability/step {ledger.truncation_probability:.2e}"
              if truncated else f"untruncated, run in microbatches of {rows} rows")
  log(f"[privacy] DP training: unit={privacy_unit}, N={num_examples}, q={q:.4g} (expected batch "
      f"{q * num_examples:.1f}, {batching}), C={dp.clip_norm:g}, σ={sigma:.4f}, δ={delta:.3g}, "
      f"clipped sum by {execution.method}")
  # The event of one step, from the same σ, q and cap as the sampler: the ledger composes it per step.
  dp_event = accounting.step_dp_event(sigma, q, sampling=privacy_params.Sampling.POISSON,
                                      num_examples=num_examples, max_batch_size=max_batch_size)
  return Mechanism(clipped_sum=clipped_sum, noise=noise, sampler=sampler,
                   dp_event=dp_event, ledger=ledger, noise_multiplier=sigma, dp_spm_report=report)


def _build_correlated(dp: DPConfig, execution: ExecutionSettings, *, loss_fn: Callable, num_examples: int,
                      privacy_unit: str, batch_size: int, train_steps: int, sampler_seed: int,
                      vocab_path: Optional[str], spmd_axis_name: Optional[str], noise_secret: bool,
                      population: Optional[Dict[str, Any]], corpus, data_files, unknown_files,
                      log: Callable[[str], None]) -> Mechanism:
  """`build_mechanism` for correlated noise: cyclic Poisson sampling in b groups with rate q
  within a group (expected batch q·N/b = `expected_batch_size`, default `batch_size`), the
  strategy for `train_steps` steps, σ calibrated by the strategy's event, the ledger."""
  b = dp.num_bands
  dp.check_data(num_examples=num_examples, batch_size=batch_size)
  if b > train_steps:
    raise PrivacyError(f"DPConfig.num_bands b={b} exceeds train_steps={train_steps}: some group would never be sampled")
  if dp.noise == privacy_params.NoiseKind.BANDED and b == 1:
    log("[privacy] WARNING: DPConfig.noise='banded' with num_bands=1 is plain DP-SGD (one band: the identity "
        "strategy, every example sampled at every step); set DPConfig.num_bands (NUM_BANDS) > 1 for banded noise")
  delta = dp.delta if dp.delta is not None else default_delta(num_examples)
  privacy_params.validate_privacy_params(delta=delta, num_examples=num_examples, steps=train_steps)
  expected = float(dp.expected_batch_size if dp.expected_batch_size is not None else batch_size)
  if b * expected > num_examples:
    raise PrivacyError(f"num_bands × expected batch = {b} × {expected:g} exceeds N = {num_examples}: each of the b "
                       "groups (about N/b examples) must hold the expected batch; lower b or the batch")
  q = b * expected / num_examples
  strategy = strategies.for_run(dp.noise, steps=train_steps, num_bands=b, buffers=dp.buffers,
                                strategy_file=dp.strategy_file, log=log)
  sigma = dp.noise_multiplier
  if sigma is None:
    sigma = accounting.calibrate_correlated(dp.noise, dp.target_epsilon, q, train_steps, delta, num_bands=b,
                                            accountant=dp.accountant)
    log(f"[privacy] calibrated noise_multiplier σ={sigma:.4f} for ε={dp.target_epsilon:g} at δ={delta:.3g}, "
        f"q={q:.4g} in b={b} groups, {train_steps} steps, {dp.noise} noise ({dp.accountant})")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", privacy_params.MeaninglessGuaranteeWarning)  # warned above
    noisy_sum = privacy_params.NoisySum(dp.clip_norm, sigma, expected)
    ledger = PrivacyLedger.create(noisy_sum=noisy_sum, delta=delta, num_examples=num_examples, sampling_rate=q,
                                  accountant=dp.accountant, privacy_unit=privacy_unit,
                                  sampling=privacy_params.Sampling.POISSON.value, configured_batch_size=batch_size,
                                  clipping_method=execution.method, noise_secret=noise_secret,
                                  population=population, noise=dp.noise, strategy=strategy)
  report = _compose_vocabulary(ledger, vocab_path, dp.vocab_is_public, privacy_unit, log, corpus, data_files,
                               unknown_files)
  clipped_sum, noise = step_parts(noisy_sum, execution.method, loss_fn, spmd_axis_name=spmd_axis_name,
                                  strategy=strategy, **_ghost_options(execution))
  rows = BatchLayout.for_run(dp, execution, batch_size).batch_rows
  log(f"[privacy] DP training with {dp.noise} correlated noise: unit={privacy_unit}, N={num_examples}, b={b} "
      f"cyclic Poisson groups, q={q:.4g} within a group (expected batch {expected:.1f}, untruncated, run in "
      f"microbatches of {rows} rows), C={dp.clip_norm:g}, σ={sigma:.4f}, strategy {strategy.digest[:12]} "
      f"(sensitivity {strategy.sensitivity:.4g}), δ={delta:.3g}, clipped sum by {execution.method}")
  planned = dataclasses.replace(ledger, steps=train_steps)
  return Mechanism(clipped_sum=clipped_sum, noise=noise,
                   sampler=sampling.CyclicPoissonSampler(num_examples, q, b, sampler_seed),
                   dp_event=planned.training_event(), ledger=ledger, noise_multiplier=sigma, dp_spm_report=report)


def _compose_vocabulary(ledger: PrivacyLedger, vocab_path: Optional[str], public: bool, privacy_unit: str,
                        log: Callable[[str], None], corpus: Union[None, str, Sequence[str]] = None,
                        data_files: Optional[Sequence[str]] = None,
                        unknown_files: Optional[str] = None) -> Optional[str]:
  """Composes the vocabulary into `ledger`; returns the DP-SentencePiece report composed, if any."""
  report = find_vocabulary_report(vocab_path)
  if not vocab_path:
    return report
  public_check = None
  if public:
    public_check = public_vocabulary.check_public_declaration(vocab_path, report, corpus, data_files, unknown_files)
  component = ledger.add_vocabulary(vocab_path, report, public=public, public_check=public_check)
  if "epsilon" in component:
    group = component.get("group_privacy")
    log(f"[privacy] composed the vocabulary's DP guarantee from {report}: "
        f"ε={component['epsilon']:g}, δ={component['delta']:g}"
        + (f" ({group['privacy_unit']}-level ε={group['epsilon']:g}, δ={group['delta']:g}, for "
           f"{privacy_unit}-level training by group privacy of {group['size']})" if group else "")
        + ("; recorded with its Gaussian event (the report's `composition` says how it composes with "
           "training)" if "event" in component else
           "; its ε is added to training's" + ("" if group else " (the report records no Gaussian event: "
                                                "written by an older dp-spm)")))
    if not component.get("noise_secret", True):
      log(f"[privacy] WARNING: {insecure_noise_warning(f'the vocabulary {vocab_path} (dp-spm --insecure_seed)')}")
    return report
  if component["public"]:
    log(f"[privacy] vocabulary {vocab_path} declared public by the user (VOCAB_IS_PUBLIC=True): not counted in ε"
        + (f" (by that declaration, its DP report {component['dp_report']} covers other data than this run's)"
           if component.get("dp_report") else "") + f"; {public_check}")
  else:
    log(f"[privacy] WARNING: the vocabulary {vocab_path} is not differentially private "
        f"({component['reason']}): the total ε is ∞ (DP-Adafactor's own ε is still reported as "
        "training_epsilon); train it with `private-t5 dp-spm`, or set VOCAB_IS_PUBLIC=True if it "
        "was built without the private data")
  return None
