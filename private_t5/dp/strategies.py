"""Strategies of correlated-noise DP training: the lower-triangular Toeplitz matrix C of a matrix
factorization mechanism, its sensitivity and its C⁻¹ as a streaming matrix.

A matrix factorization mechanism releases the gradients x_t + (C⁻¹ Z)_t: the noise of step t is
a fixed linear combination of the i.i.d. Gaussian draws of steps 0..t (Choquette-Choo et al.
2023, "Amplified Banded Matrix Factorization: A unified approach to private training"; McKenna
et al. 2024, "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private
ML"). Its privacy is that of C X + Z, so the noise std is σ·C_clip·sens(C), where sens(C) is C's
sensitivity for the participation pattern of the sampler: cyclic Poisson sampling with b groups
(`sampling.CyclicPoissonSampler`) lets an example join only steps t ≡ g (mod b), at least b
steps apart, at most ceil(n/b) times in n steps.

* "banded": C is b-banded Toeplitz (`jax_privacy.matrix_factorization.toeplitz`,
  `optimize_banded_toeplitz(n, bands=b)`, coefficients of L2 norm 1). Two participations are at
  least b steps apart, so their columns of C do not overlap: each participation is one Poisson
  sampled Gaussian of sensitivity ‖coef‖₂ (the max column norm, jax-privacy's plan), and the run
  is accounted with amplification by sampling (`accounting.banded_dp_event`). b = 1 with the
  coefficient [1.0] is DP-SGD.
* "blt": C is a buffered linear Toeplitz matrix (Dvijotham et al. 2024, "Efficient and
  Near-Optimal Noise Generation for Streaming Differential Privacy";
  `buffered_toeplitz.optimize(n, min_sep=b, max_participations=ceil(n/b))`): C⁻¹ Z needs only a
  few buffers of state. It is not amplified: its sensitivity is the min-separation sensitivity
  over all ceil(n/b) participations (`toeplitz.minsep_sensitivity_squared`), valid because its
  Toeplitz coefficients are non-negative and non-increasing (checked: C^T C is then non-negative,
  so any subset of participations has no more sensitivity, `sensitivity_over`).

Optimising a strategy takes seconds to minutes, so a strategy is cached on disk by its inputs
(kind, steps, b, buffers, jax-privacy version) under `$PRIVATE_T5_CACHE/strategies` or
`~/.cache/private_t5/strategies`, written atomically; `DPConfig.strategy_file` gives the
coefficients instead. jax-privacy (and JAX) are imported only when a strategy is optimised,
measured or applied, never by a Gaussian run.
"""
import dataclasses
import functools
import hashlib
import json
import math
import os
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
from scipy import signal

from private_t5.dp.privacy_params import NoiseKind
from private_t5.errors import ConfigError, DataError, PrivacyError
from private_t5.io import write_json_atomic
from private_t5.lazy_imports import lazy_module

# jax-privacy and JAX, imported on first use: only when a strategy is optimised, measured or applied,
# never by a Gaussian run (nor by `private-t5 epsilon`, which imports this module for its names).
_JAX_PRIVACY_INSTALL = "jax-privacy (requirements.txt)"
jax = lazy_module("jax", needed_for="correlated noise", install=_JAX_PRIVACY_INSTALL)
jnp = lazy_module("jax.numpy", needed_for="correlated noise", install=_JAX_PRIVACY_INSTALL)
jax_privacy = lazy_module("jax_privacy", needed_for="correlated noise", install=_JAX_PRIVACY_INSTALL)
toeplitz = lazy_module("jax_privacy.matrix_factorization.toeplitz", needed_for="correlated noise",
                       install=_JAX_PRIVACY_INSTALL)
buffered_toeplitz = lazy_module("jax_privacy.matrix_factorization.buffered_toeplitz", needed_for="BLT noise",
                                install=_JAX_PRIVACY_INSTALL)

GAUSSIAN = NoiseKind.GAUSSIAN
BANDED = NoiseKind.BANDED
BLT = NoiseKind.BLT
# DPConfig.noise values (`privacy_params.NoiseKind`): independent Gaussian noise (DP-SGD), or
# correlated noise by a strategy.
NOISE_KINDS = tuple(NoiseKind)
CORRELATED = tuple(kind for kind in NoiseKind if kind.correlated)
# BLT buffers: jax-privacy chooses between 0 and this many when `DPConfig.buffers` is None; it
# refuses more than MAX_BUFFERS (numerically unstable).
DEFAULT_MAX_BUFFERS = 8
MAX_BUFFERS = 15
# The error both optimisers minimise: the mean squared error of the noisy prefix sums.
OPTIMIZED_ERROR = "mean"
CACHE_VERSION = 1
# A banded strategy's scale does not change the mechanism (C and kC add the same noise: σ·C_clip·sens(C)
# times C⁻¹Z), but its noise is computed in float32: a strategy file's sensitivity ‖coefs‖₂ must lie
# in [MIN_SENSITIVITY, MAX_SENSITIVITY] (jax-privacy's optimised strategies have 1), and C⁻¹'s
# coefficients over the run's steps at most MAX_NOISE_GAIN / sens(C) (a C whose inverse grows
# geometrically turns the noise into inf, and the loss into NaN, within a few steps; optimised
# strategies stay near 1-2).
MIN_SENSITIVITY = 1e-6
MAX_SENSITIVITY = 1e6
MAX_NOISE_GAIN = 1e6
# The keys of a strategy file: the coefficients of each kind, and what a cached or recorded strategy
# also holds (read, not used: the run's own steps and b apply; a recorded digest must match).
FILE_KEYS = {"banded": ("kind", "coefs"), "blt": ("kind", "buf_decay", "output_scale")}
RECORD_KEYS = ("digest", "num_bands", "steps", "sensitivity", "source", "buffers", "jax_privacy", "cache_version")


def default_cache_dir() -> str:
  """$PRIVATE_T5_CACHE/strategies, else ~/.cache/private_t5/strategies."""
  env = os.environ.get("PRIVATE_T5_CACHE")
  if env:
    return os.path.join(env, "strategies")
  return os.path.join(os.path.expanduser("~"), ".cache", "private_t5", "strategies")


def jax_privacy_version() -> str:
  return str(jax_privacy.__version__)


def max_participations(steps: int, num_bands: int) -> int:
  """ceil(n / b): the most steps one example joins under cyclic Poisson sampling."""
  return -(-int(steps) // int(num_bands))


def _floats(values, what: str) -> Tuple[float, ...]:
  try:
    out = tuple(float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1))
  except (TypeError, ValueError):
    raise PrivacyError(f"{what} must be a list of numbers, got {values!r}") from None
  if not all(math.isfinite(v) for v in out):
    raise PrivacyError(f"{what} must be finite numbers, got {list(out)}")
  return out


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A correlated-noise strategy C for a run of `steps` steps with `num_bands` sampling groups.

  Attributes:
    kind: "banded" or "blt" (a `NoiseKind`).
    num_bands: b, the number of cyclic Poisson groups (the minimum separation of an example's
      participations); a banded strategy has at most b bands.
    steps: n, the number of steps the strategy was made for (BLT's sensitivity is over n steps).
    coefs: banded: the Toeplitz coefficients of C (C[:, 0]), at most b of them.
    buf_decay, output_scale: blt: C's BLT parameters (C[0, 0] = 1, C[k, 0] = Σ_i s_i d_i^(k-1)).
    source: "optimized" (by jax-privacy, for these steps and b) or the strategy file's path.
  """
  kind: NoiseKind
  num_bands: int
  steps: int
  coefs: Tuple[float, ...] = ()
  buf_decay: Tuple[float, ...] = ()
  output_scale: Tuple[float, ...] = ()
  source: str = "optimized"

  def __post_init__(self):
    if self.kind not in CORRELATED:
      raise PrivacyError(f"a strategy's kind must be one of {CORRELATED}, got {self.kind!r}")
    object.__setattr__(self, "kind", NoiseKind(self.kind))
    for name in ("num_bands", "steps"):
      value = getattr(self, name)
      if isinstance(value, bool) or int(value) != value or value < 1:
        raise PrivacyError(f"a strategy's {name} must be an integer >= 1, got {value!r}")
      object.__setattr__(self, name, int(value))
    for name in ("coefs", "buf_decay", "output_scale"):
      object.__setattr__(self, name, _floats(getattr(self, name), f"the strategy's {name}"))
    if self.kind == BANDED:
      if not 1 <= len(self.coefs) <= self.num_bands:
        raise PrivacyError(f"a banded strategy needs 1 to b = {self.num_bands} coefficients (its bands), got "
                           f"{len(self.coefs)}: more bands than groups would let one example's "
                           "participations overlap")
      if self.buf_decay or self.output_scale:
        raise PrivacyError("a banded strategy has coefs, not BLT parameters")
      self._check_banded_scale()
    else:
      if len(self.buf_decay) != len(self.output_scale) or self.coefs:
        raise PrivacyError("a BLT strategy has buf_decay and output_scale of the same length, and no coefs")
      if not all(0.0 <= d < 1.0 for d in self.buf_decay):
        raise PrivacyError(f"a BLT strategy's buf_decay must lie in [0, 1), got {list(self.buf_decay)}")

  def _check_banded_scale(self) -> None:
    """PrivacyError unless C's diagonal is positive, sens(C) = ‖coefs‖₂ is within [MIN_SENSITIVITY,
    MAX_SENSITIVITY] and C⁻¹ stays bounded over the steps (its noise must stay finite in float32)."""
    if not self.coefs[0] > 0.0:
      raise PrivacyError(f"a banded strategy's first coefficient (C's diagonal) must be positive, got "
                         f"{self.coefs[0]!r}: 0 makes C singular, and a negative one only flips every sign")
    with np.errstate(over="ignore"):
      sensitivity = float(np.linalg.norm(np.asarray(self.coefs, np.float64)))
    if not MIN_SENSITIVITY <= sensitivity <= MAX_SENSITIVITY:  # inf (an overflowing norm) included
      raise PrivacyError(
          f"a banded strategy's sensitivity ‖coefs‖₂ must be a finite number in [{MIN_SENSITIVITY:g}, "
          f"{MAX_SENSITIVITY:g}], got {sensitivity:.4g}: its noise is computed in float32 (scaling all the "
          "coefficients by one factor gives the same mechanism; optimised strategies have sensitivity 1)")
    impulse = np.zeros(self.steps, np.float64)
    impulse[0] = 1.0
    with np.errstate(all="ignore"):
      inverse = signal.lfilter([1.0], np.asarray(self.coefs, np.float64), impulse)  # C⁻¹[:, 0]
      gain = float(np.max(np.abs(inverse))) * sensitivity
    if not gain <= MAX_NOISE_GAIN:
      raise PrivacyError(
          f"a banded strategy's C⁻¹ grows to {gain:.3g} times its sensitivity over {self.steps} steps (at most "
          f"{MAX_NOISE_GAIN:g}): the polynomial of its coefficients has a root inside the unit circle, so its "
          "noise grows geometrically and overflows float32 (the loss turns NaN); use an optimised strategy")

  # -- identity ---------------------------------------------------------------------------------

  def parameters(self) -> Dict[str, Any]:
    """The canonical coefficients: {"kind", "coefs"} or {"kind", "buf_decay", "output_scale"}."""
    if self.kind == BANDED:
      return {"kind": self.kind.value, "coefs": list(self.coefs)}
    return {"kind": self.kind.value, "buf_decay": list(self.buf_decay), "output_scale": list(self.output_scale)}

  @property
  def digest(self) -> str:
    """SHA-256 of the canonical coefficients (`parameters`, as sorted compact JSON)."""
    text = json.dumps(self.parameters(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()

  @property
  def state_depth(self) -> int:
    """How many parameter-shaped buffers C⁻¹'s streaming state holds (b - 1 bands, or the BLT's buffers)."""
    return len(self.coefs) - 1 if self.kind == BANDED else len(self.buf_decay)

  def to_dict(self) -> Dict[str, Any]:
    """What a ledger records: kind, digest, coefficients, b, steps, sensitivity, source."""
    return dict(self.parameters(), digest=self.digest, num_bands=self.num_bands, steps=self.steps,
                sensitivity=self.sensitivity, source=self.source)

  @classmethod
  def from_dict(cls, d: Dict[str, Any]) -> "Strategy":
    """Inverse of `to_dict`; DataError when the digest does not match the coefficients."""
    try:
      strategy = cls(kind=d["kind"], num_bands=d["num_bands"], steps=d["steps"], coefs=d.get("coefs", ()),
                     buf_decay=d.get("buf_decay", ()), output_scale=d.get("output_scale", ()),
                     source=d.get("source", "optimized"))
    except KeyError as e:
      raise DataError(f"a recorded strategy is missing {e}") from None
    if d.get("digest") not in (None, strategy.digest):
      raise DataError(f"a recorded strategy's digest {d['digest'][:12]}… does not match its coefficients")
    return strategy

  # -- sensitivity ------------------------------------------------------------------------------

  @functools.cached_property
  def sensitivity(self) -> float:
    """sens(C) per unit clip norm for cyclic Poisson sampling with b groups over `steps` steps:
    banded, one participation's (max column norm ‖coef‖₂: accounted per participation, with
    amplification); BLT, all ceil(n/b) participations' (min-separation sensitivity)."""
    return self.sensitivity_over(self.steps)

  def sensitivity_over(self, steps: int) -> float:
    """The sensitivity of the first `steps` released steps (`sensitivity` at steps = n).

    BLT: sqrt(minsep_sensitivity_squared(C's coefficients over t steps, min_sep=b,
    max_participations=ceil(t/b))), the worst case of ceil(t/b) participations exactly b apart
    with equal contributions. The coefficients are checked non-negative and non-increasing, so
    C^T C is entrywise non-negative: ‖C Σ_j x_j‖² = Σ_jk (C^T C)_jk <x_j, x_k> only grows with
    more (aligned) participations, and an example that joins fewer steps than the worst case
    (Poisson sampling, fewer steps taken) has no more sensitivity. Banded: ‖coef‖₂ whatever t.
    """
    steps = int(steps)
    if steps < 1:
      raise PrivacyError(f"a sensitivity needs steps >= 1, got {steps}")
    if self.kind == BANDED:
      return float(np.linalg.norm(np.asarray(self.coefs, np.float64)))
    coefs = self.toeplitz_coefs(steps)
    with jax.enable_x64():
      squared = toeplitz.minsep_sensitivity_squared(
          np.asarray(coefs), min_sep=self.num_bands, max_participations=max_participations(steps, self.num_bands),
          n=steps, skip_checks=True)
      return float(np.sqrt(float(squared)))

  def toeplitz_coefs(self, steps: int) -> np.ndarray:
    """C[:steps, 0] in float64; for a BLT, checked non-negative and non-increasing (PrivacyError)."""
    if self.kind == BANDED:
      out = np.zeros(steps, np.float64)
      k = min(steps, len(self.coefs))
      out[:k] = self.coefs[:k]
      return out
    powers = np.arange(max(steps - 1, 0), dtype=np.float64)
    decay = np.asarray(self.buf_decay, np.float64)
    scale = np.asarray(self.output_scale, np.float64)
    tail = (decay[None, :] ** powers[:, None] * scale[None, :]).sum(axis=1) if decay.size else np.zeros(len(powers))
    coefs = np.concatenate([[1.0], tail])[:steps]
    if np.any(coefs < 0) or np.any(np.diff(coefs) > 1e-12 * np.maximum(1.0, np.abs(coefs[1:]))):
      raise PrivacyError("the BLT strategy's Toeplitz coefficients must be non-negative and non-increasing "
                         "(its min-separation sensitivity holds only then)")
    return coefs

  def dense(self, steps: int) -> np.ndarray:
    """C as a dense lower-triangular float64 [steps, steps] matrix (tests, small n)."""
    coefs = self.toeplitz_coefs(steps)
    c = np.zeros((steps, steps))
    for k in range(steps):
      c[np.arange(k, steps), np.arange(0, steps - k)] = coefs[k]
    return c

  # -- C⁻¹ as a streaming matrix ------------------------------------------------------------------

  def noising_matrix(self):
    """C⁻¹ as a jax-privacy `StreamingMatrix` over float32 values (state: `state_depth` buffers).

    Banded: `toeplitz.inverse_as_streaming_matrix(coefs)`. BLT:
    `BufferedToeplitz.inverse_as_streaming_matrix()` of C's parameters in float32 (C⁻¹ Z by
    Dvijotham et al.'s recursion, x_t = y_t - Σ_i s_i buf_i, buf_i ← d_i buf_i + x_t).
    """
    if self.kind == BANDED:
      return toeplitz.inverse_as_streaming_matrix(jnp.asarray(self.coefs, jnp.float32))
    if not self.buf_decay:  # no buffers: C = I
      return toeplitz.inverse_as_streaming_matrix(jnp.ones((1,), jnp.float32))
    blt = buffered_toeplitz.BufferedToeplitz(buf_decay=jnp.asarray(self.buf_decay, jnp.float32),
                                             output_scale=jnp.asarray(self.output_scale, jnp.float32))
    return blt.inverse_as_streaming_matrix()


def identity(num_bands: int = 1, steps: int = 1) -> Strategy:
  """The banded strategy C = I (coefficient [1.0]): with b = 1, DP-SGD."""
  return Strategy(BANDED, num_bands, steps, coefs=(1.0,), source="identity")


# -- making a run's strategy: from a file, the cache, or the optimiser ---------------------------

def check_buffers(buffers: Optional[int]) -> Optional[int]:
  """BLT's number of buffers: None (jax-privacy chooses, up to DEFAULT_MAX_BUFFERS) or 1..MAX_BUFFERS."""
  if buffers is None:
    return None
  if isinstance(buffers, bool) or not isinstance(buffers, (int, np.integer)) or not 1 <= buffers <= MAX_BUFFERS:
    raise PrivacyError(f"DPConfig.buffers (BLT buffers) must be an integer in [1, {MAX_BUFFERS}] or None, "
                       f"got {buffers!r}")
  return int(buffers)


def for_run(kind: str, *, steps: int, num_bands: int, buffers: Optional[int] = None,
            strategy_file: Optional[str] = None, cache_dir: Optional[str] = None,
            log: Callable[[str], None] = print) -> Strategy:
  """The strategy of a run: read from `strategy_file`, else the cached or newly optimised one."""
  if kind not in CORRELATED:
    raise PrivacyError(f"correlated noise is one of {CORRELATED}, got {kind!r}")
  if not 1 <= int(num_bands) <= int(steps):
    raise PrivacyError(f"num_bands b={num_bands} must be in [1, steps={steps}]")
  if strategy_file:
    return from_file(strategy_file, kind=kind, steps=steps, num_bands=num_bands)
  if kind == BANDED and num_bands == 1:
    return identity(1, steps)  # the only 1-band strategy of norm 1
  buffers = check_buffers(buffers) if kind == BLT else None
  version = jax_privacy_version()
  path = cache_path(kind, steps=steps, num_bands=num_bands, buffers=buffers, version=version, cache_dir=cache_dir)
  cached = _read_cached(path)
  if cached is not None:
    return cached
  log(f"[privacy] optimising a {kind} strategy for {steps} steps, b={num_bands}"
      + (f", {buffers} buffers" if buffers else "") + f" (jax-privacy {version}; cached in {path})")
  strategy = optimize(kind, steps=steps, num_bands=num_bands, buffers=buffers)
  strategy.toeplitz_coefs(steps)  # a BLT must satisfy the sensitivity's premise before it is cached
  write_json_atomic(path, dict(strategy.to_dict(), buffers=buffers, jax_privacy=version,
                               cache_version=CACHE_VERSION))
  return strategy


def cache_path(kind: str, *, steps: int, num_bands: int, buffers: Optional[int], version: str,
               cache_dir: Optional[str] = None) -> str:
  """The cache file of an optimised strategy: one per (kind, steps, b, buffers, jax-privacy version)."""
  name = f"{kind}-n{int(steps)}-b{int(num_bands)}-buffers{'auto' if buffers is None else int(buffers)}-jp{version}.json"
  return os.path.join(cache_dir or default_cache_dir(), name)


def _read_cached(path: str) -> Optional[Strategy]:
  """The strategy cached at `path`, or None (absent, unreadable or inconsistent: optimised again)."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
    strategy = Strategy.from_dict(dict(d, source="optimized"))
    strategy.toeplitz_coefs(strategy.steps)
    return strategy
  except (OSError, ValueError, TypeError, KeyError, DataError, PrivacyError):
    return None


def optimize(kind: str, *, steps: int, num_bands: int, buffers: Optional[int] = None) -> Strategy:
  """A strategy optimised by jax-privacy for the mean squared error of the prefix sums over
  `steps` steps, under b-min-separated participation (not cached: `for_run` caches)."""
  if kind == BANDED:
    coefs = np.asarray(toeplitz.optimize_banded_toeplitz(n=steps, bands=num_bands), np.float64)
    return Strategy(BANDED, num_bands, steps, coefs=tuple(coefs))
  low, high = (0, DEFAULT_MAX_BUFFERS) if buffers is None else (buffers, buffers)
  with jax.enable_x64():
    blt = buffered_toeplitz.optimize(n=steps, min_sep=num_bands, max_participations=max_participations(steps, num_bands),
                                     error=OPTIMIZED_ERROR, min_buffers=low, max_buffers=high)
    blt = blt.canonicalize()
    decay, scale = np.asarray(blt.buf_decay, np.float64), np.asarray(blt.output_scale, np.float64)
  return Strategy(BLT, num_bands, steps, buf_decay=tuple(decay), output_scale=tuple(scale))


def read_file(path: str, kind: str) -> Dict[str, Any]:
  """The JSON object of strategy file `path` for noise `kind`, its keys checked; ConfigError or
  PrivacyError in one line for a missing file, bad JSON, another kind, or an unknown key."""
  if not os.path.isfile(path):
    raise ConfigError(f"DPConfig.strategy_file {path} does not exist")
  try:
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"DPConfig.strategy_file {path} is not valid JSON: {e}") from None
  if not isinstance(d, dict):
    raise ConfigError(f"DPConfig.strategy_file {path} must hold a JSON object")
  if d.get("kind", kind) != kind:
    raise PrivacyError(f"DPConfig.strategy_file {path} holds a {d.get('kind')!r} strategy, but DPConfig.noise is {kind!r}")
  known = FILE_KEYS.get(kind, ()) + RECORD_KEYS
  unknown = sorted(str(k) for k in d if k not in known)
  if unknown:
    raise ConfigError(f"DPConfig.strategy_file {path} has unknown key {unknown[0]!r}"
                      + (f" (and {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else "")
                      + f"; a {kind} strategy's keys are {', '.join(FILE_KEYS.get(kind, ()))} (a cached or recorded "
                      f"strategy's also {', '.join(RECORD_KEYS)})")
  return d


def from_file(path: str, *, kind: str, steps: int, num_bands: int) -> Strategy:
  """A strategy given as JSON: {"kind": "banded", "coefs": [...]} or {"kind": "blt", "buf_decay":
  [...], "output_scale": [...]} (a cached or recorded strategy also reads). ConfigError/PrivacyError
  in one line for a missing file, bad JSON, another kind, an unknown key, a recorded digest that
  does not match, or coefficients that break the accounting or the float32 noise
  (`Strategy._check_banded_scale`)."""
  d = read_file(path, kind)
  try:
    strategy = Strategy(kind, num_bands, steps, coefs=d.get("coefs", ()), buf_decay=d.get("buf_decay", ()),
                        output_scale=d.get("output_scale", ()), source=os.path.abspath(path))
    strategy.toeplitz_coefs(steps)
  except PrivacyError as e:
    raise PrivacyError(f"DPConfig.strategy_file {path}: {e}") from None
  if d.get("digest") not in (None, strategy.digest):
    raise PrivacyError(f"DPConfig.strategy_file {path} records digest {str(d['digest'])[:12]}…, which does not "
                       "match its coefficients")
  return strategy
