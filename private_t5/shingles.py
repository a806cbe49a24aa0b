"""Word shingles of a text as 64-bit hashes: the one implementation both near-duplicate tests use.

* `window_hashes`: a 64-bit polynomial hash of every window of `n` tokens, all windows of a
  sequence in O(len) NumPy operations. The splits' exact-substring test (`eval.near_dup`) hashes
  50-token windows of word ids with it; the public-vocabulary check (`doc_fingerprints`) hashes
  5-word shingles of keyed word ids with it.
* `content_words`: the words of a text with what does not change whose text it is taken out:
  Unicode compatibility forms (NFKC, as SentencePiece sees text), format characters (category Cf:
  BOM, zero-width space and joiners, soft hyphen, bidirectional marks), case (full case folding),
  punctuation and symbols (categories P and S, read as word breaks), and whitespace runs.
* `sample_one_in`: the shingles whose (mixed) hash is 0 modulo m, a consistent sample: two texts
  keep the same sample of the shingles they share, so the fraction of one text's sample found in
  another's estimates how much of the first is contained in the second (Broder, "On the
  resemblance and containment of documents", 1997: the MOD-m sketch).

Base layer: NumPy only.
"""
import unicodedata
from typing import List, Sequence

import numpy as np

from private_t5.hashing import mix64

# The golden-ratio increment of SplitMix64 (Steele et al. 2014; its finaliser: `hashing.mix64`).
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class _Breaks(dict):
  """str.translate table, filled as characters are met: format characters (Cf) removed,
  punctuation and symbols (P*, S*) read as spaces, every other character kept."""

  def __missing__(self, code: int):
    category = unicodedata.category(chr(code))
    value = None if category == "Cf" else " " if category[0] in "PS" else code
    self[code] = value
    return value


_BREAKS = _Breaks()


def content_words(text: str) -> List[str]:
  """The words that identify a text's content (see the module docstring)."""
  text = unicodedata.normalize("NFKC", text).translate(_BREAKS).casefold()
  return text.split()


def window_hashes(tokens: Sequence[int], window: int) -> np.ndarray:
  """Sorted unique 64-bit polynomial hashes of every `window`-token substring.

  With S[k] = sum_{j<k} x_j B^{-j} (mod 2^64, B odd so invertible), the window starting
  at i hashes to B^{i+window-1} (S[i+window] - S[i]) = sum_j x_{i+j} B^{window-1-j}: all
  windows in O(len) numpy operations.
  """
  x = np.asarray(tokens, dtype=np.uint64)
  n = x.shape[0]
  if window <= 0 or n < window:
    return np.zeros((0,), dtype=np.uint64)
  base = np.uint64(0x100000001B3)  # FNV prime (odd)
  base_inv = np.uint64(pow(int(base), -1, 1 << 64))
  with np.errstate(over="ignore"):
    idx = np.arange(n + 1, dtype=np.uint64)
    inv_pows = _pow_u64(base_inv, idx[:n])
    pows = _pow_u64(base, idx[:n])
    # Mix token ids first so that small ids do not give structured hashes.
    s = np.concatenate([[np.uint64(0)], np.cumsum(mix64(x + GOLDEN) * inv_pows, dtype=np.uint64)])
    h = pows[window - 1:] * (s[window:] - s[:-window])
  return np.unique(h)


def _pow_u64(base: np.uint64, exps: np.ndarray) -> np.ndarray:
  """base ** exps modulo 2^64, element-wise, by square-and-multiply."""
  result = np.ones_like(exps)
  b = np.full_like(exps, base)
  e = exps.copy()
  with np.errstate(over="ignore"):
    while np.any(e):
      odd = (e & np.uint64(1)).astype(bool)
      result[odd] *= b[odd]
      b = b * b
      e >>= np.uint64(1)
  return result


def sample_one_in(hashes: np.ndarray, m: int) -> np.ndarray:
  """The hashes (mixed once more, so that the sample does not follow the polynomial's structure)
  that are 0 modulo `m`, sorted and unique as `hashes` were."""
  mixed = np.unique(mix64(np.asarray(hashes, dtype=np.uint64)))
  return mixed if m == 1 else mixed[mixed % np.uint64(m) == 0]
