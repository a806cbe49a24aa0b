"""The DP mechanism of a training run: one privacy config, the speed settings, the built mechanism.

* `DPConfig`: what the guarantee depends on (C, σ or a target ε, δ, accountant, expected batch
  size, sampling scheme, whether the vocabulary is public). Each value is checked once, when
  the config is made (`__post_init__`); a bad value fails there with one PrivacyError line.
* `ExecutionSettings`: what changes only speed and memory, never the guarantee: how the
  clipped sum is computed ("ghost" or "vmap") and the microbatch size; `BatchLayout`, built from
  them, says how a step's sample runs as compiled batches.
* `build_mechanism(dp, execution, ...)`: checks the rules that depend on the data (expected
  batch vs N and the padded batch, the δ added by truncation), calibrates σ, and builds the
  mechanism's four parts from the same q, σ and C (DP rule "sampling matches accounting"):
  the clipped-sum function (carrying C and q·N), the noise transform (an optax transform), the
  sampler and the DP event of one step, plus the ledger that composes that event.

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
(`correlated_noise.correlated_noise`, a stateful transform: the trainer keeps its state), and the
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
from private_t5.dp import public_vocabulary
from private_t5.dp import sampling
from private_t5.dp import strategies
from private_t5.dp.ledger import (PrivacyLedger, find_vocabulary_report, insecure_noise_warning, read_report,
                                  vocabulary_report_mismatch)
from private_t5.errors import ConfigError, PrivacyError

# Largest acceptable per-step chance that a Poisson batch exceeds the padded batch size when
# the expected batch size is derived from it.
DEFAULT_MAX_TRUNCATION_PROBABILITY = 1e-6
# DPConfig.sampling values (`accounting.Sampling`): untruncated Poisson (microbatched), or
# truncated at batch_size.
POISSON = accounting.Sampling.POISSON
POISSON_TRUNCATED = accounting.Sampling.POISSON_TRUNCATED
DP_SAMPLING = (POISSON, POISSON_TRUNCATED)
# ExecutionSettings.method: the DP aggregator computing the clipped sum; ghost clipping by default.
# "vmap": per-example gradients under `jax.vmap` (`aggregator.DPAggregator`, the reference);
# "ghost": ghost norms and book-keeping, no per-example gradients (`ghost.GhostDPAggregator`,
# docs/ghost_clipping.md). Both clip, noise and divide identically: same privacy, same ledger.
GHOST = "ghost"
AGGREGATORS = {"vmap": aggregator_lib.DPAggregator, GHOST: ghost.GhostDPAggregator}
DP_METHODS = tuple(AGGREGATORS)
# Share of δ the batch truncation may add over the run (a larger share is refused).
TRUNCATION_DELTA_SHARE = 0.1
# The default δ is min(DEFAULT_DELTA_CAP, 1 / N^DEFAULT_DELTA_EXPONENT).
DEFAULT_DELTA_CAP = 1e-5
DEFAULT_DELTA_EXPONENT = 1.1
# The name of the mesh axis the examples are sharded over (`train.partitioning.DATA_AXIS`).
DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class DPConfig:
  """Differential privacy of a training run (all fixed before training: DP rule "nothing else leaks").

  Every value is checked here, once; the rules that need the data (N, the padded batch size,
  the number of steps) are checked by `build_mechanism`.

  Attributes:
    clip_norm: C, the per-example gradient L2 bound (finite, > 0).
    noise_multiplier: σ > 0 (noise std σ·C on the clipped sum). Exactly one of this and
      `target_epsilon`.
    target_epsilon: calibrate σ before training so that the run ends at this ε (finite, > 0).
    delta: δ in (0, 1); None uses min(1e-5, 1 / N^1.1) (`default_delta`): well below 1/N, where
      a mechanism that publishes one random example would already satisfy the guarantee.
    accountant: "auto" (default: the smaller ε of RDP and PLD for the same event, and σ
      calibrated by the same rule), "rdp" (the paper's) or "pld".
    expected_batch_size: q·N, the Poisson sample's expected size and the public divisor of the
      noisy sum. None: `batch_size` (untruncated sampling); with truncation, the largest size
      whose truncation at the padded `batch_size` adds at most 10% of δ over the run,
      (1 + e^ε)·steps·p_trunc ≤ 0.1 δ (and p_trunc ≤ 1e-6); an explicit value whose truncation
      adds more than that is refused (PrivacyError).
      With correlated noise it is the expected sample of a step, q·N/b (default `batch_size`).
    sampling: "poisson" (default: untruncated Poisson sampling run in microbatches) or
      "poisson_truncated" (a sample is capped at `batch_size` rows).
    method: deprecated: how the clipped sum is computed is a speed setting
      (`ExecutionSettings.method`, Gin `train.clipping_method`); a value set here is used for it,
      with a warning.
    vocab_is_public: the vocabulary was built without the private data (Gin macro
      VOCAB_IS_PUBLIC). Without a DP-SentencePiece report that names the vocabulary, the total ε
      is ∞ unless this is set.
    noise: "gaussian" (default: independent noise each step, DP-SGD), or correlated noise by
      matrix factorization: "banded" (amplified banded strategy) or "blt" (buffered linear
      Toeplitz); both need untruncated "poisson" sampling.
    num_bands: b, correlated noise only: the cyclic Poisson groups (an example joins only every
      b-th step), the bands of a banded strategy, the minimum separation of a BLT's
      participations. 1 for Gaussian noise.
    buffers: "blt" only: its number of buffers (1..15); None: jax-privacy chooses (up to 8).
    strategy_file: correlated noise only: a JSON file of the strategy's coefficients
      ({"coefs": [...]}, or for "blt" {"buf_decay": [...], "output_scale": [...]}) instead of the
      one optimised for the run's steps.
  """
  clip_norm: float = 1.0
  noise_multiplier: Optional[float] = None
  target_epsilon: Optional[float] = None
  delta: Optional[float] = None
  accountant: str = "auto"
  expected_batch_size: Optional[float] = None
  sampling: str = POISSON
  method: Optional[str] = None
  vocab_is_public: bool = False
  noise: str = strategies.GAUSSIAN
  num_bands: int = 1
  buffers: Optional[int] = None
  strategy_file: Optional[str] = None

  def __post_init__(self):
    if self.sampling not in DP_SAMPLING:
      raise PrivacyError(f"DPConfig.sampling must be one of {tuple(map(str, DP_SAMPLING))}, got "
                         f"{self.sampling!r}: fixed shuffled batches are a different mechanism and are not offered")
    object.__setattr__(self, "sampling", accounting.Sampling(self.sampling))
    if (self.noise_multiplier is None) == (self.target_epsilon is None):
      raise PrivacyError("set exactly one of DPConfig.noise_multiplier and DPConfig.target_epsilon "
                         f"(got {self.noise_multiplier!r} and {self.target_epsilon!r})")
    if self.noise_multiplier is not None and not _positive_finite(self.noise_multiplier):
      raise PrivacyError(f"DPConfig.noise_multiplier (σ) must be a finite number > 0, got "
                         f"{self.noise_multiplier!r} (use DP=None for a non-private run)")
    if self.target_epsilon is not None and not _positive_finite(self.target_epsilon):
      raise PrivacyError(f"DPConfig.target_epsilon (ε) must be a finite number > 0, got {self.target_epsilon!r}")
    accounting.check_clip_norm(self.clip_norm, "DPConfig.clip_norm (C)")
    if self.expected_batch_size is not None and not _positive_finite(self.expected_batch_size):
      raise PrivacyError(f"DPConfig.expected_batch_size (q·N) must be a finite number > 0, got "
                         f"{self.expected_batch_size!r}")
    accounting.validate_privacy_params(delta=self.delta, accountant=self.accountant)
    if self.method is not None and self.method not in DP_METHODS:
      raise ConfigError(f"DPConfig.method must be one of {DP_METHODS}, got {self.method!r}")
    self._check_noise()

  def _check_noise(self) -> None:
    if self.noise not in strategies.NOISE_KINDS:
      raise PrivacyError(f"DPConfig.noise must be one of {strategies.NOISE_KINDS}, got {self.noise!r}")
    b = self.num_bands
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
      raise PrivacyError(f"DPConfig.num_bands (b) must be an integer >= 1, got {b!r}")
    if self.strategy_file is not None and (not isinstance(self.strategy_file, str) or not self.strategy_file):
      raise PrivacyError(f"DPConfig.strategy_file must be a path or None, got {self.strategy_file!r}")
    if not self.correlated:
      if b != 1 or self.buffers is not None or self.strategy_file is not None:
        raise PrivacyError("DPConfig.num_bands, buffers and strategy_file are settings of correlated noise: set "
                           "DPConfig.noise = 'banded' or 'blt' (got noise='gaussian')")
      return
    if self.truncated:
      raise PrivacyError(f"DPConfig.noise={self.noise!r} needs untruncated 'poisson' sampling (its accounting "
                         "assumes it), got sampling='poisson_truncated'")
    if self.noise == strategies.BANDED and self.buffers is not None:
      raise PrivacyError("DPConfig.buffers is a setting of noise='blt', not of 'banded'")
    if self.noise == strategies.BLT:
      strategies.check_buffers(self.buffers)
    if self.strategy_file is not None:  # refused now, not after the data is read (again with the run's steps)
      strategies.from_file(self.strategy_file, kind=self.noise, steps=b, num_bands=b)

  @property
  def correlated(self) -> bool:
    """Whether the noise is correlated across steps (a matrix factorization strategy)."""
    return self.noise != strategies.GAUSSIAN
  @property
  def truncated(self) -> bool:
    """Whether a Poisson sample is capped at the padded batch size."""
    return self.sampling == POISSON_TRUNCATED

  def check_data(self, *, num_examples: int, batch_size: int) -> None:
    """The rules that need the data: the padded batch and the expected batch within the
    dataset, and with truncation the expected batch within the padded batch; raises PrivacyError."""
    accounting.validate_privacy_params(num_examples=num_examples, batch_size=batch_size)
    if self.expected_batch_size is not None:
      accounting.validate_privacy_params(batch_size=self.expected_batch_size, num_examples=num_examples)
      if self.truncated and self.expected_batch_size > batch_size:
        raise PrivacyError(f"expected_batch_size={self.expected_batch_size} exceeds the padded "
                           f"batch_size={batch_size}")


def _positive_finite(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
          and 0 < value < math.inf)


@dataclasses.dataclass(frozen=True)
class ExecutionSettings:
  """How a step is computed, never what it releases: the same mechanism, the same ledger.

  Attributes:
    method: how the DP clipped sum is computed: "ghost" (default: ghost norms and book-keeping,
      no per-example gradients; docs/ghost_clipping.md) or "vmap" (per-example gradients, the
      reference implementation). Ignored by a non-private run.
    microbatch_size: examples per accumulation step (memory knob); None: the whole batch. A
      step with more rows runs as microbatches of this many rows through the trainer's
      accumulate loop; with untruncated Poisson sampling it always does (default: `batch_size`).
  """
  method: str = GHOST
  microbatch_size: Optional[int] = None

  def __post_init__(self):
    if self.method not in DP_METHODS:
      raise ConfigError(f"the clipped-sum method must be one of {DP_METHODS}, got {self.method!r}")
    m = self.microbatch_size
    if m is not None and (isinstance(m, bool) or int(m) != m or m < 1):
      raise ConfigError(f"microbatch_size must be an integer >= 1 or None, got {m!r}")

  @classmethod
  def for_run(cls, dp: Optional[DPConfig], method: Optional[str] = None,
              microbatch_size: Optional[int] = None,
              log: Callable[[str], None] = print) -> "ExecutionSettings":
    """The settings of a run from `train`'s arguments; a deprecated `DPConfig.method` is used
    for `method` (with a warning) and must agree with it when both are set."""
    legacy = dp.method if dp is not None else None
    if legacy is not None:
      log(f"[privacy] WARNING: DPConfig.method is deprecated (it changes only speed): use "
          f"train.clipping_method = {legacy!r}")
      if method is not None and method != legacy:
        raise ConfigError(f"DPConfig.method={legacy!r} and clipping_method={method!r} disagree; set "
                          "only clipping_method")
    return cls(method=method or legacy or GHOST, microbatch_size=microbatch_size)


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
    noise: the noise transform (`noise.gaussian_noise`; `noise.no_noise()` for a non-private
      run; `correlated_noise.correlated_noise`, whose state the trainer keeps across steps), an
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
      out.update(noise=self.ledger.noise, num_bands=self.ledger.num_bands, strategy=self.ledger.strategy_digest)
    return out


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How a step's sample runs as compiled batches: speed and memory only, never the guarantee.

  Attributes:
    batch_rows: rows of every compiled batch: the fixed batch size, or with untruncated Poisson
      sampling the rows of one microbatch.
    variable_rows: untruncated Poisson sampling: a step runs every sampled example, in as many
      batches of `batch_rows` rows as it needs.
    microbatch_size: the rows of one microbatch when a step's rows run as microbatches through
      the trainer's accumulate loop (always with untruncated Poisson sampling, and for a fixed
      batch larger than `ExecutionSettings.microbatch_size`); None: one fused compiled step.
  """
  batch_rows: int
  variable_rows: bool = False
  microbatch_size: Optional[int] = None

  @classmethod
  def for_run(cls, dp: Optional[DPConfig], execution: ExecutionSettings, batch_size: int) -> "BatchLayout":
    """The layout of a run of padded `batch_size` rows (ConfigError for a microbatch size that
    does not divide a fixed batch)."""
    m = execution.microbatch_size
    if dp is not None and not dp.truncated:
      rows = int(m) if m else batch_size
      return cls(batch_rows=rows, variable_rows=True, microbatch_size=rows)
    return cls(batch_rows=batch_size, microbatch_size=_fixed_batch_microbatch(batch_size, m))

  def rows_for_step(self, num_sampled: int, microbatched: Optional[bool] = None) -> int:
    """Rows a step's batch runs on: `batch_rows`, or for untruncated Poisson sampling the sample
    rounded up to whole microbatches of `batch_rows` (at least one when not microbatched;
    `microbatched` defaults to whether this layout microbatches)."""
    if not self.variable_rows:
      return self.batch_rows
    microbatched = self.microbatch_size is not None if microbatched is None else microbatched
    rows = -(-int(num_sampled) // self.batch_rows) * self.batch_rows
    return rows if microbatched else max(rows, self.batch_rows)


def step_parts(noisy_sum: Optional[accounting.NoisySum], method: str, loss_fn: Callable, *,
               spmd_axis_name: Optional[str] = None, strategy: Optional[strategies.Strategy] = None,
               **ghost_options) -> Tuple[Any, Any]:
  """(clipped sum, noise transform) of a step: the mean and no noise when `noisy_sum` is None,
  else the `method` clipped sum ("vmap" or "ghost", with `ghost.GhostDPAggregator`'s options)
  of `noisy_sum`'s C and q·N and its Gaussian noise transform, or with a `strategy` its
  correlated noise transform. `build_mechanism` and the benchmark build their steps here;
  `method` was checked by their settings."""
  if noisy_sum is None:
    return aggregator_lib.MeanAggregator(loss_fn), noise_lib.no_noise()
  clipped_sum = AGGREGATORS[method](loss_fn, noisy_sum, spmd_axis_name=spmd_axis_name, **ghost_options)
  if strategy is not None:
    from private_t5.dp import correlated_noise  # pylint: disable=g-import-not-at-top  # (imports jax-privacy)
    return clipped_sum, correlated_noise.correlated_noise(noisy_sum, strategy)
  return clipped_sum, noise_lib.gaussian_noise(noisy_sum)


# The run fingerprint's entries that follow from num_bands (b): q = b·batch/N, the σ calibrated for a
# target ε, the strategy; a resume whose b changed differs first at one of them.
NUM_BANDS_ENTRIES = ("privacy.noise_multiplier", "privacy.num_bands", "privacy.sampling_rate", "privacy.strategy")


def num_bands_resume_hint(dp: Optional["DPConfig"], saved_privacy: Optional[Dict[str, Any]]) -> Optional[str]:
  """What a refused resume says when the checkpoint's run had another num_bands (b) than `dp`
  (`saved_privacy`: the checkpoint fingerprint's "privacy" entry); None when b is the same, or
  either run is not correlated noise of the same kind (then the noise differs first)."""
  if dp is None or not dp.correlated or not isinstance(saved_privacy, dict):
    return None
  if saved_privacy.get("noise") != dp.noise or saved_privacy.get("num_bands") in (None, dp.num_bands):
    return None
  old = saved_privacy["num_bands"]
  calibrated = (f", and the σ calibrated for target_epsilon={dp.target_epsilon:g}" if dp.target_epsilon is not None
                else "")
  return (f"num_bands changed: the checkpoint's run has num_bands b={old}, this run b={dp.num_bands}; b sets the "
          f"cyclic Poisson groups, the sampling rate q = b × batch / N{calibrated} and the strategy, so these differ "
          f"too: to resume, keep num_bands={old} (--gin.NUM_BANDS={old}, or DPConfig.num_bands); another b is "
          "another run (a new model_dir)")


def require_gaussian(dp: Optional["DPConfig"], what: str) -> None:
  """PrivacyError unless `dp` is None or has Gaussian noise: `what` (adaptive DP, JFT) scales or
  composes per-step Gaussian noise and offers no correlated noise."""
  if dp is not None and getattr(dp, "noise", strategies.GAUSSIAN) != strategies.GAUSSIAN:
    raise PrivacyError(f"{what} needs DPConfig.noise='gaussian', got {dp.noise!r}: correlated noise is offered "
                       "only for plain DP training")


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
  if dp.noise == strategies.BANDED and b == 1:
    log("[privacy] WARNING: DPConfig.noise='banded' with num_bands=1 is plain DP-SGD (one band: the identity "
        "strategy, every example sampled at every step); set DPConfig.num_bands (NUM_BANDS) > 1 for banded noise")
  delta = dp.delta if dp.delta is not None else default_delta(num_examples)
  accounting.validate_privacy_params(delta=delta, num_examples=num_examples, steps=train_steps)
  expected = dp.expected_batch_size
  if expected is None:
    expected = (_expected_batch_for_delta(dp, num_examples, batch_size, train_steps, delta) if truncated
                else batch_size)
  q = accounting.sampling_rate_from_batch(expected, num_examples)
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
    warnings.simplefilter("ignore", accounting.MeaninglessGuaranteeWarning)  # warned above
    noisy_sum = accounting.NoisySum(dp.clip_norm, sigma, q * num_examples)
    ledger = PrivacyLedger.create(noisy_sum=noisy_sum, delta=delta, num_examples=num_examples, sampling_rate=q,
                                  max_batch_size=max_batch_size, accountant=dp.accountant,
                                  privacy_unit=privacy_unit, sampling=accounting.Sampling.POISSON.value,
                                  configured_batch_size=batch_size, clipping_method=execution.method,
                                  noise_secret=noise_secret, population=population)
  report = _compose_vocabulary(ledger, vocab_path, dp.vocab_is_public, privacy_unit, log, corpus, data_files,
                               unknown_files)
  clipped_sum, noise = step_parts(noisy_sum, execution.method, loss_fn, spmd_axis_name=spmd_axis_name)
  rows = BatchLayout.for_run(dp, execution, batch_size).batch_rows
  batching = (f"padded {batch_size}, truncation probability/step {ledger.truncation_probability:.2e}"
              if truncated else f"untruncated, run in microbatches of {rows} rows")
  log(f"[privacy] DP training: unit={privacy_unit}, N={num_examples}, q={q:.4g} (expected batch "
      f"{q * num_examples:.1f}, {batching}), C={dp.clip_norm:g}, σ={sigma:.4f}, δ={delta:.3g}, "
      f"clipped sum by {execution.method}")
  # The event of one step, from the same σ, q and cap as the sampler: the ledger composes it per step.
  dp_event = accounting.step_dp_event(sigma, q, sampling=accounting.Sampling.POISSON, num_examples=num_examples,
                                      max_batch_size=max_batch_size)
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
  if dp.noise == strategies.BANDED and b == 1:
    log("[privacy] WARNING: DPConfig.noise='banded' with num_bands=1 is plain DP-SGD (one band: the identity "
        "strategy, every example sampled at every step); set DPConfig.num_bands (NUM_BANDS) > 1 for banded noise")
  delta = dp.delta if dp.delta is not None else default_delta(num_examples)
  accounting.validate_privacy_params(delta=delta, num_examples=num_examples, steps=train_steps)
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
    warnings.simplefilter("ignore", accounting.MeaninglessGuaranteeWarning)  # warned above
    noisy_sum = accounting.NoisySum(dp.clip_norm, sigma, expected)
    ledger = PrivacyLedger.create(noisy_sum=noisy_sum, delta=delta, num_examples=num_examples, sampling_rate=q,
                                  accountant=dp.accountant, privacy_unit=privacy_unit,
                                  sampling=accounting.Sampling.POISSON.value, configured_batch_size=batch_size,
                                  clipping_method=execution.method, noise_secret=noise_secret,
                                  population=population, noise=dp.noise, strategy=strategy)
  report = _compose_vocabulary(ledger, vocab_path, dp.vocab_is_public, privacy_unit, log, corpus, data_files,
                               unknown_files)
  clipped_sum, noise = step_parts(noisy_sum, execution.method, loss_fn, spmd_axis_name=spmd_axis_name,
                                  strategy=strategy)
  rows = BatchLayout.for_run(dp, execution, batch_size).batch_rows
  log(f"[privacy] DP training with {dp.noise} correlated noise: unit={privacy_unit}, N={num_examples}, b={b} "
      f"cyclic Poisson groups, q={q:.4g} within a group (expected batch {expected:.1f}, untruncated, run in "
      f"microbatches of {rows} rows), C={dp.clip_norm:g}, σ={sigma:.4f}, strategy {strategy.digest[:12]} "
      f"(sensitivity {strategy.sensitivity:.4g}), δ={delta:.3g}, clipped sum by {execution.method}")
  planned = dataclasses.replace(ledger, steps=train_steps)
  return Mechanism(clipped_sum=clipped_sum, noise=noise,
                   sampler=sampling.CyclicPoissonSampler(num_examples, q, b, sampler_seed),
                   dp_event=planned.training_event(), ledger=ledger, noise_multiplier=sigma, dp_spm_report=report)


def _fixed_batch_microbatch(batch_size: int, microbatch_size: Optional[int]) -> Optional[int]:
  """The microbatch size of a fixed batch of `batch_size` rows: None (one compiled step) unless
  `microbatch_size` is smaller; it must then divide the batch (ConfigError)."""
  if microbatch_size is None or int(microbatch_size) >= batch_size:
    return None
  if batch_size % int(microbatch_size):
    raise ConfigError(f"microbatch_size={microbatch_size} must divide batch_size={batch_size}")
  return int(microbatch_size)


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
