"""Integer hashing shared by the layers: SplitMix64's finaliser on numpy arrays."""
import numpy as np

# SplitMix64's finaliser constants (Steele, Lea and Flood 2014, "Fast Splittable Pseudorandom
# Number Generators"): the finaliser is a bijection of 64-bit integers that spreads every input bit.
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finaliser, element-wise on uint64 (wrap-around arithmetic is intended)."""
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))
