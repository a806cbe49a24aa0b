"""Counter-based random numbers for a batch of examples, computed for all rows at once.

Each example (row) has a 64-bit key, a pure function of (seed, example index); its draw number c
is `mix64(key + (c + 1) * GAMMA)`, SplitMix64's output for state `key` after c + 1 steps
(Steele, Lea and Flood 2014, "Fast Splittable Pseudorandom Number Generators"). A row's numbers
thus depend on (seed, index, draw number) only: not on the other rows of the batch, their
number or their order, and no Generator object is made per example. All arithmetic is uint64
array operations (wrapping, as SplitMix64 is defined).
"""
import numpy as np

from private_t5.hashing import mix64

GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment
_MASK = 0xFFFFFFFFFFFFFFFF
_INV_2_53 = 2.0**-53


def row_keys(seed: int, indices) -> np.ndarray:
  """uint64 [n]: the key of each example index under `seed` (distinct indices, distinct keys)."""
  indices = np.asarray(indices, dtype=np.int64).reshape(-1).astype(np.uint64)
  base = mix64(np.full(1, int(seed) & _MASK, np.uint64))
  with np.errstate(over="ignore"):
    return mix64(base + (indices + np.uint64(1)) * GAMMA)


def bits(keys: np.ndarray, counters) -> np.ndarray:
  """uint64: draw number `counters` of each key; `keys` [n] with `counters` an int gives [n],
  with an int array [m] gives [n, m]."""
  keys = np.asarray(keys, dtype=np.uint64)
  counters = np.asarray(counters, dtype=np.uint64)
  with np.errstate(over="ignore"):
    if counters.ndim == 0:
      return mix64(keys + (counters + np.uint64(1)) * GAMMA)
    return mix64(keys[:, None] + (counters[None, :] + np.uint64(1)) * GAMMA)


def below(draws: np.ndarray, n) -> np.ndarray:
  """int64: each uint64 draw mapped to an integer uniform in [0, n) (0 where n <= 0).

  The top 53 bits as a fraction in [0, 1), times n, rounded down: uniform up to 2^-53.
  """
  n = np.asarray(n, dtype=np.int64)
  u = (np.asarray(draws, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) * _INV_2_53
  out = np.floor(u * n).astype(np.int64)
  return np.clip(out, 0, np.maximum(n - 1, 0))
