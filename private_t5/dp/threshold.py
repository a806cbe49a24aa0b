"""The threshold of DP-SentencePiece's release: where T lies and the δ it spends.

A word present only in the added document is released only if m + Z ≥ T, Z ~ N(0, σ²); by a
union bound over its ≤ n distinct words that happens with probability at most δ_t = n·Q((T −
m)/σ) (`threshold_tail`), and `threshold_for` picks the T of a given δ_t. The formulas as printed
in Ponomareva et al. 2022 (`paper_epsilon`, `paper_threshold`) are kept to compare with.
`accounting.thresholded_gaussian_parameters` accounts the whole release with them.
"""
import math

from scipy import special, stats


def paper_epsilon(sigma: float, delta: float, k: float) -> float:
  """Hoory et al. Theorem 1 as printed in Ponomareva et al. 2022: ε = (k/σ)·√(2 ln(2.5/δ))."""
  return k / sigma * math.sqrt(2.0 * math.log(2.5 / delta))


def paper_threshold(sigma: float, delta: float, m: float, n: int) -> float:
  """The threshold as printed in Ponomareva et al. 2022: C = m + σ·erf⁻¹(1 − δ/(2N))."""
  return m + sigma * float(special.erfinv(1.0 - delta / (2.0 * n)))


def threshold_for(sigma: float, delta_threshold: float, m: float, n: int) -> float:
  """T with n·P[m + N(0, σ²) ≥ T] = δ_t: T = m + σ·Φ⁻¹(1 − δ_t/n)."""
  return m + sigma * float(stats.norm.isf(delta_threshold / n))


def threshold_tail(sigma: float, threshold: float, m: float, n: int) -> float:
  """δ spent by thresholding: the union bound n·Q((T − m)/σ) that a new word is released."""
  return min(1.0, n * float(stats.norm.sf((threshold - m) / sigma)))

