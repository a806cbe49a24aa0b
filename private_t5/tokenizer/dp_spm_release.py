"""DP-SentencePiece's release: the privacy parameters, then noise and threshold on the histogram.

Steps 3 and 4 of `dp_spm`: the (ε, δ) of a `ContributionBound` in both directions
(`privacy_parameters`, accounted by `dp.accounting`), N(0, σ²) added to every observed count with
the kept words those whose noisy count reaches the threshold (`private_histogram`, noise from OS
entropy: `noise_generator`), and a public corpus's exact counts merged in (`merge_public`: no
privacy cost).
"""
import collections
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from private_t5.dp import accounting
from private_t5.tokenizer.dp_spm_histogram import ContributionBound


def privacy_parameters(delta: float, bound: ContributionBound, *, sigma: Optional[float] = None,
                       target_epsilon: Optional[float] = None) -> Dict[str, Any]:
  """Both directions: (σ, δ) → ε and T, or (target ε, δ) → σ and T. δ is the total δ.

  The release of `bound`'s k, m, n as accounted by `accounting.thresholded_gaussian_parameters`:
  the tight `epsilon` (the Gaussian mechanism at δ/2), the paper's `epsilon_paper_formula`, the
  correct `threshold` (δ/2 to thresholding), the paper's printed `threshold_paper_formula` and
  the δ that threshold actually spends, and `noise_std`.
  """
  return accounting.thresholded_gaussian_parameters(delta, l2=bound.l2, linf=bound.linf,
                                                    max_distinct=bound.max_distinct, sigma=sigma,
                                                    target_epsilon=target_epsilon)


def noise_generator(insecure_seed: Optional[int] = None) -> np.random.Generator:
  """Noise from OS entropy; a fixed seed only when explicitly asked for (tests)."""
  if insecure_seed is None:
    return np.random.default_rng(np.random.SeedSequence())
  return np.random.default_rng(int(insecure_seed))


def private_histogram(histogram: Dict[str, int], noise_std: float, threshold: float,
                      rng: np.random.Generator) -> Dict[str, float]:
  """Algorithm 1: adds N(0, σ²) to every observed count, keeps the noisy counts ≥ threshold."""
  words = list(histogram)
  counts = np.fromiter((histogram[w] for w in words), dtype=np.float64, count=len(words))
  noisy = counts + rng.normal(0.0, noise_std, size=counts.shape)
  keep = np.nonzero(noisy >= threshold)[0]
  return {words[i]: float(noisy[i]) for i in keep}


def merge_public(private_kept: Dict[str, float],
                 public_counts: Optional[Dict[str, int]] = None) -> List[Tuple[str, int]]:
  """The `(word, count)` list SentencePiece trains on, most frequent first.

  `private_kept` is the output of `private_histogram` (only words whose noisy count passed the
  threshold); `public_counts` are exact counts from a public corpus (same bound, no noise). A
  word in both gets the sum. The public counts do not depend on the private corpus, so the
  merge is post-processing of the private release: it costs no privacy.
  """
  merged = collections.Counter()
  for word, count in private_kept.items():
    merged[word] += count
  for word, count in (public_counts or {}).items():
    merged[word] += count
  return sorted(((w, max(1, int(round(c)))) for w, c in merged.items()), key=lambda x: -x[1])
