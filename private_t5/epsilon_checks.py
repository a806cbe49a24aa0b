"""The settings of `private-t5 epsilon` checked together, each refusal one `PrivacyError` line.

Pure checks, before and beside the accounting (`dp.accounting`): `settings` is any object with the
command's flags as attributes (`noise`, a `dp.privacy_params.NoiseKind`; `num_bands`, `steps`,
`batch_size`, `num_examples`, `sampling_rate`, `sampling`, `max_batch_size`, `buffers`, `delta`), as
the stage parses them.
"""
from typing import Any

from private_t5.errors import PrivacyError


def check_bands(settings: Any) -> None:
  """PrivacyError when --num_bands is below 1, or (correlated noise) when the b = --num_bands cyclic
  Poisson groups cannot be: more groups than steps (some group would never be sampled), or groups
  too small to hold the expected batch."""
  s = settings
  if s.num_bands < 1:
    raise PrivacyError(f"--num_bands must be >= 1, got {s.num_bands}")
  if not s.noise.correlated:
    return
  if s.steps is not None and s.num_bands > s.steps:
    raise PrivacyError(f"--num_bands b={s.num_bands} exceeds --steps={s.steps}: with cyclic Poisson "
                       f"sampling in b groups, group g joins only steps g, g + b, ..., so groups "
                       f"{s.steps}..{s.num_bands - 1} would never be sampled; lower b to at most the steps")
  if s.batch_size is not None and s.num_examples is not None and s.sampling_rate is None:
    if s.num_bands * s.batch_size > s.num_examples:
      raise PrivacyError(f"--num_bands × --batch_size = {s.num_bands} × {s.batch_size:g} exceeds "
                         f"--num_examples={s.num_examples}: each of the b groups (about N/b examples) must "
                         "hold the expected batch; lower b or the batch")


def check_sampling_source(settings: Any) -> None:
  """PrivacyError unless the sampling rate comes from one source: --sampling_rate, or both
  --batch_size and --num_examples."""
  s = settings
  if s.sampling_rate is not None:
    if s.batch_size is not None:
      raise PrivacyError("give --sampling_rate or --batch_size/--num_examples, not both")
  elif s.batch_size is None or s.num_examples is None:
    raise PrivacyError("need --sampling_rate, or both --batch_size and --num_examples")


def check_gaussian(settings: Any) -> None:
  """PrivacyError for a setting of correlated noise (--num_bands b > 1, --buffers) with Gaussian noise."""
  if settings.num_bands != 1 or settings.buffers is not None:
    raise PrivacyError("--num_bands and --buffers are settings of correlated noise (--noise=banded or blt)")


def check_gaussian_sampling(settings: Any) -> None:
  """PrivacyError when fixed batches (--sampling=fixed) or a truncated Poisson batch
  (--max_batch_size) come without the --num_examples they are accounted with."""
  if settings.sampling == "fixed" and settings.num_examples is None:
    raise PrivacyError("--sampling=fixed needs --num_examples")
  if settings.max_batch_size is not None and settings.num_examples is None:
    raise PrivacyError("--max_batch_size needs --num_examples")


def check_correlated(settings: Any) -> None:
  """PrivacyError for settings correlated noise (--noise=banded or blt) cannot take: other than
  untruncated Poisson sampling, or --buffers outside [1, 15] or without --noise=blt."""
  s = settings
  if s.sampling != "poisson" or s.max_batch_size is not None:
    raise PrivacyError(f"--noise={s.noise} needs untruncated Poisson sampling (no --sampling=fixed, no --max_batch_size)")
  if s.buffers is not None and (s.noise != "blt" or not 1 <= s.buffers <= 15):
    raise PrivacyError(f"--buffers must be in [1, 15], with --noise=blt only (got {s.buffers} with --noise={s.noise})")


def no_guarantee(settings: Any, p_trunc: float, delta_total: float, delta_source: str, auto: bool) -> str:
  """The one line refusing a result whose total δ is >= 1 (`auto`: the accountant is "auto")."""
  s = settings
  fix = ("raise --max_batch_size" if auto else
         "raise --max_batch_size, or use --accountant=pld or auto (PLD accounts the truncation exactly at δ)")
  return (f"no guarantee: truncating batches at --max_batch_size={s.max_batch_size} (probability "
          f"{p_trunc:.3g} a step) adds {delta_total - s.delta:.4g} to δ={s.delta:g} (from {delta_source}) "
          f"under RDP, a total δ of {delta_total:.4g} >= 1; {fix}")
