"""Adafactor (T5's optimizer) through optax, and the learning-rate schedules it runs with.

Schedules map the optimizer step t (0-based, counted by optax inside the optimizer state, so a
resumed run continues it) to a learning rate:

* `rsqrt_schedule(peak | base, warmup_steps)`: T5 / T5X's "constant * rsqrt_decay",
  lr(t) = base / sqrt(max(t, warmup)); given as the peak it starts at, base = peak *
  sqrt(warmup), so lr(t) = peak * min(1, sqrt(warmup / t)). The "warm-up" of T5's rsqrt
  schedule is a constant plateau of `warmup_steps`, not a linear ramp. Ponomareva et al. 2022 (Sec. 4)
  uses "learning rate 0.5, warm-up 1000", which in T5X's terms is base 0.5: peak 0.0158.
* `constant_schedule(lr)`.
* `linear_warmup_schedule(peak, warmup_steps, decay)`: linear ramp from 0 to peak over
  `warmup_steps`, then constant, rsqrt decay or linear decay to 0 at `total_steps`.
"""
import math
from typing import Callable, Optional, Union

import jax.numpy as jnp
import optax

from private_t5.errors import ConfigError

Schedule = Callable[[jnp.ndarray], jnp.ndarray]
DECAYS = ("constant", "rsqrt", "linear")


def _positive(name: str, value, allow_zero: bool = False) -> float:
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ConfigError(f"{name} must be a number, got {value!r}") from None
  if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
    raise ConfigError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
  return v


def rsqrt_schedule(peak_learning_rate: Optional[float] = None, warmup_steps: int = 1000,
                   base_learning_rate: Optional[float] = None) -> Schedule:
  """lr(t) = base * rsqrt(max(t, warmup)) = peak * min(1, sqrt(warmup / t)).

  Give the plateau value `peak_learning_rate`, or T5X's `base_learning_rate` (then
  peak = base / sqrt(warmup)); exactly one of the two. Ponomareva et al.'s (2022) "learning rate 0.5,
  warm-up 1000, rsqrt decay" is T5X's `base_learning_rate=0.5`, i.e. a peak of
  0.5 / sqrt(1000) = 0.0158 (the order of T5's 0.01).
  """
  warmup = _positive("warmup_steps", warmup_steps)
  if (peak_learning_rate is None) == (base_learning_rate is None):
    raise ConfigError("rsqrt_schedule needs exactly one of peak_learning_rate and base_learning_rate, "
                      f"got {peak_learning_rate!r} and {base_learning_rate!r}")
  if peak_learning_rate is not None:
    peak = _positive("peak_learning_rate", peak_learning_rate)
  else:
    peak = _positive("base_learning_rate", base_learning_rate) / math.sqrt(warmup)

  def schedule(count):
    t = jnp.maximum(jnp.asarray(count, jnp.float32), warmup)
    return peak * jnp.sqrt(warmup) / jnp.sqrt(t)

  return schedule


def constant_schedule(learning_rate: float = 1e-3) -> Schedule:
  """lr(t) = learning_rate."""
  return optax.constant_schedule(_positive("learning_rate", learning_rate))


def linear_warmup_schedule(peak_learning_rate: float = 1e-3, warmup_steps: int = 1000,
                           decay: str = "constant", total_steps: Optional[int] = None) -> Schedule:
  """Linear ramp 0 -> peak over `warmup_steps`, then `decay` ("constant", "rsqrt", "linear").

  "rsqrt" continues as peak * sqrt(warmup / t); "linear" decays to 0 at `total_steps`.
  """
  peak = _positive("peak_learning_rate", peak_learning_rate)
  warmup = int(_positive("warmup_steps", warmup_steps, allow_zero=True))
  if decay not in DECAYS:
    raise ConfigError(f"decay must be one of {DECAYS}, got {decay!r}")
  if decay == "constant":
    after = optax.constant_schedule(peak)
  elif decay == "rsqrt":
    after = lambda t: peak * jnp.sqrt(max(warmup, 1)) / jnp.sqrt(jnp.maximum(t + warmup, max(warmup, 1)))
  else:
    if total_steps is None or total_steps <= warmup:
      raise ConfigError(f"linear decay needs total_steps > warmup_steps={warmup}, got {total_steps!r}")
    after = optax.linear_schedule(peak, 0.0, int(total_steps) - warmup)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def adafactor(learning_rate: Union[float, Schedule, None] = None, decay_rate: float = 0.8,
              clipping_threshold: Optional[float] = 1.0, factored: bool = True,
              momentum: Optional[float] = None, multiply_by_parameter_scale: bool = True,
              min_dim_size_to_factor: int = 128,
              weight_decay_rate: Optional[float] = None) -> optax.GradientTransformation:
  """`optax.adafactor` with T5's settings (Ponomareva et al. 2022, Sec. 4: decay rate 0.8, factored second
  moments, no momentum, update clipping threshold 1.0, relative step size scaled by the
  parameter RMS). `learning_rate` defaults to the paper's rsqrt schedule (base 0.5, 1000 steps).
  """
  if learning_rate is None:
    learning_rate = rsqrt_schedule(base_learning_rate=0.5, warmup_steps=1000)
  elif not callable(learning_rate):
    learning_rate = _positive("learning_rate", learning_rate)
  if not 0.0 < float(decay_rate) <= 1.0:
    raise ConfigError(f"decay_rate must be in (0, 1], got {decay_rate!r}")
  return optax.adafactor(
      learning_rate=learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
      decay_rate=decay_rate, multiply_by_parameter_scale=multiply_by_parameter_scale,
      clipping_threshold=clipping_threshold, momentum=momentum,
      weight_decay_rate=weight_decay_rate, factored=factored)
