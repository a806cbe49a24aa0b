"""What makes two documents near-duplicates: their words, MinHash band keys, window hashes, edit similarity.

* MinHash LSH over lower-cased, space-tokenized word n-grams: one 64-bit key a band
  (`compute_band_keys`, `band_key_chunks`), the signatures computed by `datasketch` over the
  CPU cores (spawned worker processes);
* exact substrings: a 64-bit rolling hash of every window of tokens (`shingles.window_hashes`);
* the check of a candidate pair: edit similarity over words (`check_pair`).
"""
import collections
import hashlib
import itertools
import multiprocessing
import os
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import editdistance
import numpy as np

from private_t5 import user_modules
from private_t5.eval.split_types import SplitConfig
from private_t5.hashing import mix64
from private_t5.shingles import GOLDEN
from private_t5.lazy_imports import lazy_module

# About a second to import; only the MinHash workers need it.
datasketch = lazy_module("datasketch", needed_for="the splits' MinHash signatures",
                         install="datasketch (requirements.txt)")



def word_token_ids(text: str) -> List[int]:
  """Whitespace words as stable 63-bit ids (the exact-substring test without a vocabulary).

  Stable across processes (unlike `hash`), so that parallel workers agree.
  """
  return [int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little")
          & 0x7FFFFFFFFFFFFFFF for w in text.split()]


def words(text: str) -> List[str]:
  """Lower-cased, whitespace-tokenized words (Lee et al.'s space tokenization)."""
  return text.lower().split()


def word_shingles(text: str, n: int) -> set:
  """The set of word n-grams of `text`; a text of fewer than n words is one shingle."""
  w = words(text)
  if len(w) <= n:
    return {" ".join(w)} if w else set()
  return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def band_keys_from_signature(hashvalues: np.ndarray, num_bands: int) -> np.ndarray:
  """One 64-bit key per LSH band: equal bands give equal keys; band index mixed in."""
  rows = hashvalues.astype(np.uint64).reshape(num_bands, -1)
  h = np.arange(num_bands, dtype=np.uint64) * GOLDEN
  with np.errstate(over="ignore"):
    for j in range(rows.shape[1]):
      h = mix64(h ^ rows[:, j])
  return h


_WORKER_PERMUTATIONS = {}


def _minhash_band_keys(args) -> np.ndarray:
  """Worker: band keys [len(texts), num_bands] for a chunk of texts."""
  texts, ngram, num_perm, num_bands, seed = args
  perm_key = (num_perm, seed)
  if perm_key not in _WORKER_PERMUTATIONS:
    _WORKER_PERMUTATIONS[perm_key] = datasketch.MinHash(num_perm=num_perm, seed=seed).permutations
  permutations = _WORKER_PERMUTATIONS[perm_key]
  out = np.zeros((len(texts), num_bands), dtype=np.uint64)
  for i, text in enumerate(texts):
    shingles = [s.encode("utf-8") for s in word_shingles(text, ngram)]
    m = datasketch.MinHash(num_perm=num_perm, seed=seed, permutations=permutations, scheme="affine32")
    # Chunked updates bound the [shingles, num_perm] intermediate array.
    for start in range(0, len(shingles), 2048):
      m.update_batch(shingles[start:start + 2048])
    out[i] = band_keys_from_signature(m.hashvalues, num_bands)
  return out


def compute_band_keys(texts: Sequence[str], cfg: SplitConfig,
                      progress: Optional[Callable[[int, int], None]] = None) -> np.ndarray:
  """LSH band keys [len(texts), num_bands] (uint64), over `cfg.num_workers` processes."""
  n = len(texts)
  if n == 0:
    return np.zeros((0, cfg.num_bands), dtype=np.uint64)
  workers = cfg.num_workers or os.cpu_count() or 1
  # ~2 MB of text per chunk keeps workers busy and progress lively.
  chunks, cur, size = [], [], 0
  for t in texts:
    cur.append(t)
    size += len(t)
    if size > 2_000_000 or len(cur) >= 2000:
      chunks.append(cur)
      cur, size = [], 0
  if cur:
    chunks.append(cur)
  jobs = [(c, cfg.ngram, cfg.num_perm, cfg.num_bands, cfg.seed) for c in chunks]
  results, done = [], 0
  if workers > 1 and len(chunks) > 1:
    # "spawn": the caller may already hold JAX/TF threads, which fork would copy unsafely.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(workers, len(chunks)), **user_modules.pool_kwargs()) as pool:  # TASK_MODULE in workers too
      for res in pool.imap(_minhash_band_keys, jobs):
        results.append(res)
        done += len(res)
        if progress:
          progress(done, n)
  else:
    for job in jobs:
      results.append(_minhash_band_keys(job))
      done += len(results[-1])
      if progress:
        progress(done, n)
  return np.concatenate(results, axis=0)


def band_key_chunks(chunks: Iterator[List[str]], cfg: SplitConfig) -> Iterator[np.ndarray]:
  """Band keys of each chunk, in order, over `cfg.num_workers` processes (at most 2 chunks
  a worker in flight, so the corpus is never queued whole)."""
  job = lambda c: (c, cfg.ngram, cfg.num_perm, cfg.num_bands, cfg.seed)
  workers = cfg.num_workers or os.cpu_count() or 1
  first = next(chunks, None)
  if first is None:
    return
  second = next(chunks, None)
  if workers <= 1 or second is None:
    for c in itertools.chain([first], [second] if second is not None else [], chunks):
      yield _minhash_band_keys(job(c))
    return
  # "spawn": the caller may already hold JAX/TF threads, which fork would copy unsafely.
  ctx = multiprocessing.get_context("spawn")
  with ctx.Pool(workers, **user_modules.pool_kwargs()) as pool:  # TASK_MODULE in workers too
    pending = collections.deque()
    for c in itertools.chain([first, second], chunks):
      pending.append(pool.apply_async(_minhash_band_keys, (job(c),)))
      if len(pending) >= 2 * workers:
        yield pending.popleft().get()
    while pending:
      yield pending.popleft().get()


def edit_similarity(a: Sequence, b: Sequence) -> float:
  """1 - ED(a, b) / max(|a|, |b|) (Lee et al. 2021), 1.0 for two empty sequences."""
  longest = max(len(a), len(b))
  if longest == 0:
    return 1.0
  return 1.0 - editdistance.eval(a, b) / longest


def check_pair(a: Sequence, b: Sequence, threshold: float) -> Tuple[bool, bool]:
  """(checked, near duplicate) for two word lists.

  Pairs whose length ratio is below `threshold` are rejected without computing the edit
  distance (edit similarity <= length ratio) and do not count as checked.
  """
  longest, shortest = max(len(a), len(b)), min(len(a), len(b))
  if longest and shortest / longest < threshold:
    return False, False
  return True, edit_similarity(a, b) >= threshold
