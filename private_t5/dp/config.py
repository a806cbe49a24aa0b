"""A DP training run's privacy config and speed settings, each value checked once when made.

* `DPConfig`: what the guarantee depends on (C, σ or a target ε, δ, accountant, expected batch
  size, sampling scheme, whether the vocabulary is public, the noise: Gaussian or correlated).
  Each value is checked once, when the config is made (`__post_init__`); a bad value fails
  there with one PrivacyError line. `default_delta` is δ when none is set.
* `ExecutionSettings`: what changes only speed and memory, never the guarantee: how the
  clipped sum is computed ("ghost" or "vmap") and the microbatch size; `BatchLayout`, built from
  them, says how a step's sample runs as compiled batches.

`mechanism.build_mechanism` builds a run's mechanism from them. No JAX here: the stages that only
check or report a config import this module alone; `mechanism` re-exports its names.
"""
import dataclasses
import math
from typing import Any, Callable, Dict, Optional

import numpy as np

from private_t5.dp import strategies
from private_t5.dp.privacy_params import NoiseKind, Sampling, check_clip_norm, validate_privacy_params
from private_t5.errors import ConfigError, PrivacyError

# DPConfig.sampling values (`privacy_params.Sampling`): untruncated Poisson (microbatched), or
# truncated at batch_size.
POISSON = Sampling.POISSON
POISSON_TRUNCATED = Sampling.POISSON_TRUNCATED
DP_SAMPLING = (POISSON, POISSON_TRUNCATED)
# ExecutionSettings.method: how the DP clipped sum is computed, ghost clipping by default; the keys
# of `mechanism.AGGREGATORS`: "vmap" (per-example gradients under `jax.vmap`, the reference) and
# "ghost" (ghost norms and book-keeping, no per-example gradients, docs/ghost_clipping.md).
GHOST = "ghost"
DP_METHODS = ("vmap", GHOST)
# How ghost clipping forms the clipped sum (`ghost.GhostDPAggregator.clipped_sum_method`): book-keeping
# (default), a second backward pass of the reweighted loss, or layer by layer inside two passes
# (`ghost_layerwise`, float32 only). `train.ghost_clipped_sum` takes the first
# and the last.
BOOKKEEPING = "bookkeeping"
SECOND_PASS = "second_pass"
LAYERWISE = "layerwise"
CLIPPED_SUM_METHODS = (BOOKKEEPING, SECOND_PASS, LAYERWISE)
GHOST_CLIPPED_SUMS = (BOOKKEEPING, LAYERWISE)
# The default δ is min(DEFAULT_DELTA_CAP, 1 / N^DEFAULT_DELTA_EXPONENT).
DEFAULT_DELTA_CAP = 1e-5
DEFAULT_DELTA_EXPONENT = 1.1
# The run fingerprint's entries that follow from num_bands (b): q = b·batch/N, the σ calibrated for a
# target ε, the strategy; a resume whose b changed differs first at one of them.
NUM_BANDS_ENTRIES = ("privacy.noise_multiplier", "privacy.num_bands", "privacy.sampling_rate", "privacy.strategy")


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
      Toeplitz); both need untruncated "poisson" sampling. Parsed into a
      `privacy_params.NoiseKind` (a member is its string).
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
  noise: NoiseKind = NoiseKind.GAUSSIAN
  num_bands: int = 1
  buffers: Optional[int] = None
  strategy_file: Optional[str] = None

  def __post_init__(self):
    if self.sampling not in DP_SAMPLING:
      raise PrivacyError(f"DPConfig.sampling must be one of {tuple(map(str, DP_SAMPLING))}, got "
                         f"{self.sampling!r}: fixed shuffled batches are a different mechanism and are not offered")
    object.__setattr__(self, "sampling", Sampling(self.sampling))
    if (self.noise_multiplier is None) == (self.target_epsilon is None):
      raise PrivacyError("set exactly one of DPConfig.noise_multiplier and DPConfig.target_epsilon "
                         f"(got {self.noise_multiplier!r} and {self.target_epsilon!r})")
    if self.noise_multiplier is not None and not _positive_finite(self.noise_multiplier):
      raise PrivacyError(f"DPConfig.noise_multiplier (σ) must be a finite number > 0, got "
                         f"{self.noise_multiplier!r} (use DP=None for a non-private run)")
    if self.target_epsilon is not None and not _positive_finite(self.target_epsilon):
      raise PrivacyError(f"DPConfig.target_epsilon (ε) must be a finite number > 0, got {self.target_epsilon!r}")
    check_clip_norm(self.clip_norm, "DPConfig.clip_norm (C)")
    if self.expected_batch_size is not None and not _positive_finite(self.expected_batch_size):
      raise PrivacyError(f"DPConfig.expected_batch_size (q·N) must be a finite number > 0, got "
                         f"{self.expected_batch_size!r}")
    validate_privacy_params(delta=self.delta, accountant=self.accountant)
    if self.method is not None and self.method not in DP_METHODS:
      raise ConfigError(f"DPConfig.method must be one of {DP_METHODS}, got {self.method!r}")
    self._check_noise()

  def _check_noise(self) -> None:
    if self.noise not in strategies.NOISE_KINDS:
      raise PrivacyError(f"DPConfig.noise must be one of {strategies.NOISE_KINDS}, got {self.noise!r}")
    object.__setattr__(self, "noise", NoiseKind(self.noise))  # parsed once: the string of a Gin file
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
    if self.noise == NoiseKind.BANDED and self.buffers is not None:
      raise PrivacyError("DPConfig.buffers is a setting of noise='blt', not of 'banded'")
    if self.noise == NoiseKind.BLT:
      strategies.check_buffers(self.buffers)
    if self.strategy_file is not None:  # refused now, not after the data is read (again with the run's steps)
      strategies.from_file(self.strategy_file, kind=self.noise, steps=b, num_bands=b)

  @property
  def correlated(self) -> bool:
    """Whether the noise is correlated across steps (a matrix factorization strategy)."""
    return self.noise.correlated

  @property
  def truncated(self) -> bool:
    """Whether a Poisson sample is capped at the padded batch size."""
    return self.sampling == POISSON_TRUNCATED

  def check_data(self, *, num_examples: int, batch_size: int) -> None:
    """The rules that need the data: the padded batch and the expected batch within the
    dataset, and with truncation the expected batch within the padded batch; raises PrivacyError."""
    validate_privacy_params(num_examples=num_examples, batch_size=batch_size)
    if self.expected_batch_size is not None:
      validate_privacy_params(batch_size=self.expected_batch_size, num_examples=num_examples)
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
    stack_layers: "ghost" only: the norms and book-keeping sums of the layers of one shape are
      computed stacked (`ghost.GhostDPAggregator(stack_layers=True)`): fewer kernel launches on
      an accelerator, more memory (docs/performance.md). Default False.
    ghost_clipped_sum: "ghost" only: "bookkeeping" (default: one forward and backward pass, every
      layer's input and output gradient kept until the end) or "layerwise" (the norms and sums of
      the dense kernels and norm scales formed inside two forward and backward passes: with `T5Config.remat_policy="full"` a
      fraction of book-keeping's memory; float32 activations only; docs/ghost_clipping.md).
  """
  method: str = GHOST
  microbatch_size: Optional[int] = None
  stack_layers: bool = False
  ghost_clipped_sum: str = BOOKKEEPING

  def __post_init__(self):
    if self.method not in DP_METHODS:
      raise ConfigError(f"the clipped-sum method must be one of {DP_METHODS}, got {self.method!r}")
    m = self.microbatch_size
    if m is not None and (isinstance(m, bool) or int(m) != m or m < 1):
      raise ConfigError(f"microbatch_size must be an integer >= 1 or None, got {m!r}")
    if not isinstance(self.stack_layers, bool):
      raise ConfigError(f"ghost_stack_layers must be True or False, got {self.stack_layers!r}")
    if self.stack_layers and self.method != GHOST:
      raise ConfigError(f"ghost_stack_layers=True stacks ghost clipping's layers; the clipped-sum method "
                        f"is {self.method!r}: set clipping_method='ghost' or drop ghost_stack_layers")
    if self.ghost_clipped_sum not in GHOST_CLIPPED_SUMS:
      raise ConfigError(f"ghost_clipped_sum must be one of {GHOST_CLIPPED_SUMS}, got {self.ghost_clipped_sum!r}")
    if self.ghost_clipped_sum != BOOKKEEPING and self.method != GHOST:
      raise ConfigError(f"ghost_clipped_sum={self.ghost_clipped_sum!r} is how ghost clipping sums; the "
                        f"clipped-sum method is {self.method!r}: set clipping_method='ghost' or drop ghost_clipped_sum")
    if self.ghost_clipped_sum == LAYERWISE and self.stack_layers:
      raise ConfigError("ghost_stack_layers=True stacks the layers that ghost_clipped_sum='layerwise' handles one "
                        "at a time inside the backward pass: set one of them")

  @classmethod
  def for_run(cls, dp: Optional[DPConfig], method: Optional[str] = None,
              microbatch_size: Optional[int] = None,
              log: Callable[[str], None] = print, stack_layers: bool = False,
              ghost_clipped_sum: str = BOOKKEEPING) -> "ExecutionSettings":
    """The settings of a run from `train`'s arguments; a deprecated `DPConfig.method` is used
    for `method` (with a warning) and must agree with it when both are set."""
    legacy = dp.method if dp is not None else None
    if legacy is not None:
      log(f"[privacy] WARNING: DPConfig.method is deprecated (it changes only speed): use "
          f"train.clipping_method = {legacy!r}")
      if method is not None and method != legacy:
        raise ConfigError(f"DPConfig.method={legacy!r} and clipping_method={method!r} disagree; set "
                          "only clipping_method")
    return cls(method=method or legacy or GHOST, microbatch_size=microbatch_size, stack_layers=stack_layers,
               ghost_clipped_sum=ghost_clipped_sum)


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


def _fixed_batch_microbatch(batch_size: int, microbatch_size: Optional[int]) -> Optional[int]:
  """The microbatch size of a fixed batch of `batch_size` rows: None (one compiled step) unless
  `microbatch_size` is smaller; it must then divide the batch (ConfigError)."""
  if microbatch_size is None or int(microbatch_size) >= batch_size:
    return None
  if batch_size % int(microbatch_size):
    raise ConfigError(f"microbatch_size={microbatch_size} must divide batch_size={batch_size}")
  return int(microbatch_size)

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
  if dp is not None and getattr(dp, "noise", NoiseKind.GAUSSIAN) != NoiseKind.GAUSSIAN:
    raise PrivacyError(f"{what} needs DPConfig.noise='gaussian', got {dp.noise!r}: correlated noise is offered "
                       "only for plain DP training")


def default_delta(num_examples: int) -> float:
  """min(1e-5, 1 / N^1.1): δ well below 1/N (a δ ≥ 1/N permits leaking a whole example)."""
  return min(DEFAULT_DELTA_CAP, float(num_examples) ** -DEFAULT_DELTA_EXPONENT)
