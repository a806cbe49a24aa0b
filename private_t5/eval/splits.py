"""The four memorization splits of Lee et al. (2021) and Ponomareva et al. 2022 (§4, Table 3).

* train dup: training documents with a near-duplicate elsewhere in the training set;
* train unique: the other training documents;
* valid in train: validation documents with a near-duplicate in the training set;
* valid unique: the other validation documents.

Two documents are near-duplicates (Lee et al. 2021, "Deduplicating Training Data Makes
Language Models Better", §4) when either
  * NearDup: MinHash LSH over lower-cased, space-tokenized word 5-grams puts them in one
    bucket (9,000 permutations in 450 bands of 20 rows: a pair with Jaccard similarity s is a
    candidate with probability 1 - (1 - s^20)^450, 0.994 at s = 0.8) and the candidate pair
    has an edit similarity over words of at least 0.8; or
  * ExactSubstr: they share a substring of at least 50 tokens (found here with a 64-bit
    rolling hash of every 50-token window instead of a suffix array).

Near-duplicates of a document with itself (a boilerplate paragraph repeated inside one
document) do not count. MinHash signatures come from `datasketch` and are computed over
the CPU cores; each document is reduced to one 64-bit key per band right away, so memory
stays at `num_bands` integers a document.
"""
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import editdistance
import numpy as np

from private_t5 import progress as progress_lib
from private_t5 import user_modules
from private_t5.errors import ConfigError
from private_t5.io import write_json_atomic

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train_dup", "train_unique", "valid_in_train", "valid_unique")
SPLITS_FORMAT_VERSION = 1

# 64-bit mixing constants (SplitMix64 finaliser, Steele et al. 2014).
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclasses.dataclass(frozen=True)
class SplitConfig:
  """Near-duplicate detection settings (defaults: Lee et al. 2021).

  Attributes:
    ngram: words per shingle.
    num_perm: MinHash permutations.
    num_bands: LSH bands; `num_perm / num_bands` rows per band.
    min_edit_similarity: a LSH candidate pair is kept when 1 - ED(a, b) / max(|a|, |b|) over
      word sequences reaches this value.
    exact_substring_tokens: a shared window of this many tokens marks a duplicate (0: off).
    seed: MinHash permutation seed.
    max_candidates_per_doc: at most this many LSH candidates are verified per document.
    num_workers: processes for MinHash (None: all cores).
  """
  ngram: int = 5
  num_perm: int = 9000
  num_bands: int = 450
  min_edit_similarity: float = 0.8
  exact_substring_tokens: int = 50
  seed: int = 1
  max_candidates_per_doc: int = 50
  num_workers: Optional[int] = None

  def validate(self) -> "SplitConfig":
    if self.ngram < 1:
      raise ConfigError(f"ngram must be >= 1, got {self.ngram}")
    if self.num_bands < 1 or self.num_perm < self.num_bands or self.num_perm % self.num_bands:
      raise ConfigError(f"num_perm ({self.num_perm}) must be a positive multiple of num_bands "
                        f"({self.num_bands})")
    if not 0.0 <= self.min_edit_similarity <= 1.0:
      raise ConfigError(f"min_edit_similarity must be in [0, 1], got {self.min_edit_similarity}")
    if self.exact_substring_tokens < 0:
      raise ConfigError(f"exact_substring_tokens must be >= 0, got {self.exact_substring_tokens}")
    return self

  @property
  def rows_per_band(self) -> int:
    return self.num_perm // self.num_bands

  def key_fields(self) -> dict:
    """The settings that change the result (not the worker count)."""
    d = dataclasses.asdict(self)
    d.pop("num_workers")
    return d


@dataclasses.dataclass
class Splits:
  """Document ids of the four splits plus how they were found."""
  ids: Dict[str, List[str]]
  stats: dict

  def sizes(self) -> Dict[str, int]:
    return {name: len(self.ids.get(name, [])) for name in SPLIT_NAMES}


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


def _mix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64 finaliser, element-wise on uint64 (wrap-around arithmetic is intended)."""
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def band_keys_from_signature(hashvalues: np.ndarray, num_bands: int) -> np.ndarray:
  """One 64-bit key per LSH band: equal bands give equal keys; band index mixed in."""
  rows = hashvalues.astype(np.uint64).reshape(num_bands, -1)
  h = np.arange(num_bands, dtype=np.uint64) * _GOLDEN
  with np.errstate(over="ignore"):
    for j in range(rows.shape[1]):
      h = _mix64(h ^ rows[:, j])
  return h


_WORKER_PERMUTATIONS = {}


def _minhash_band_keys(args) -> np.ndarray:
  """Worker: band keys [len(texts), num_bands] for a chunk of texts."""
  texts, ngram, num_perm, num_bands, seed = args
  # Lazy: datasketch takes about a second to import; only the MinHash workers need it.
  from datasketch import MinHash  # pylint: disable=g-import-not-at-top
  perm_key = (num_perm, seed)
  if perm_key not in _WORKER_PERMUTATIONS:
    _WORKER_PERMUTATIONS[perm_key] = MinHash(num_perm=num_perm, seed=seed).permutations
  permutations = _WORKER_PERMUTATIONS[perm_key]
  out = np.zeros((len(texts), num_bands), dtype=np.uint64)
  for i, text in enumerate(texts):
    shingles = [s.encode("utf-8") for s in word_shingles(text, ngram)]
    m = MinHash(num_perm=num_perm, seed=seed, permutations=permutations, scheme="affine32")
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
    s = np.concatenate([[np.uint64(0)], np.cumsum(_mix64(x + _GOLDEN) * inv_pows, dtype=np.uint64)])
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


def bucket_candidates(members: Sequence[int], max_candidates: int) -> Iterator[Tuple[int, int]]:
  """(i, j) candidate pairs of one LSH bucket (sorted distinct members, at least two).

  Every member is paired with the bucket's first `max_candidates + 1` members (itself
  excluded): a bucket of n documents gives O(n) pairs, however large it is.
  """
  head = members[:max_candidates + 1]
  for i in members:
    for j in head:
      if j != i:
        yield i, j


def rank_candidates(shared: Dict[int, int], max_candidates: int) -> List[int]:
  """Candidates by shared buckets (most first), ties by document number; at most max_candidates."""
  return sorted(shared, key=lambda j: (-shared[j], j))[:max_candidates]


class _Verifier:
  """Edit-similarity check of candidate pairs, with cached word lists."""

  def __init__(self, texts: Sequence[str], threshold: float):
    self._texts = texts
    self._threshold = threshold
    self._cache = {}
    self.checked = 0

  def _words(self, i):
    w = self._cache.get(i)
    if w is None:
      w = words(self._texts[i])
      if len(self._cache) > 4096:
        self._cache.clear()
      self._cache[i] = w
    return w

  def __call__(self, i: int, other: "_Verifier", j: int) -> bool:
    """Whether document i of this corpus and document j of `other` are near-duplicates."""
    checked, dup = check_pair(self._words(i), other._words(j), self._threshold)
    self.checked += checked
    return dup


def _bucket_index(keys: np.ndarray):
  """Sorted (key, doc) arrays for band keys [n, bands]."""
  n, bands = keys.shape
  flat = keys.reshape(-1)
  docs = np.repeat(np.arange(n, dtype=np.int64), bands)
  order = np.argsort(flat)
  return flat[order], docs[order]


def _near_dups_within(keys: np.ndarray, verify: _Verifier, max_candidates: int) -> np.ndarray:
  """Bool[n]: documents with a verified LSH near-duplicate among the others.

  Each document i, independently of the others: its candidates (`bucket_candidates` over every
  bucket it is in) ranked by `rank_candidates` are verified in turn; the first verified j
  marks i and j. The result does not depend on the order of the documents or buckets, so a
  parallel run (eval/splits_beam.py) finds the same documents.
  """
  n = keys.shape[0]
  found = np.zeros(n, dtype=bool)
  if n < 2:
    return found
  sorted_keys, sorted_docs = _bucket_index(keys)
  starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
  ends = np.r_[starts[1:], len(sorted_keys)]
  multi = (ends - starts) > 1
  shared: Dict[int, Dict[int, int]] = {}
  for s, e in zip(starts[multi], ends[multi]):
    members = np.unique(sorted_docs[s:e])
    if len(members) < 2:
      continue
    for i, j in bucket_candidates(members.tolist(), max_candidates):
      counts = shared.setdefault(i, {})
      counts[j] = counts.get(j, 0) + 1
  for i in sorted(shared):
    for j in rank_candidates(shared[i], max_candidates):
      if verify(i, verify, j):
        found[i] = found[j] = True
        break
  return found


def _near_dups_across(query_keys: np.ndarray, index_keys: np.ndarray, verify_query: _Verifier,
                      verify_index: _Verifier, max_candidates: int) -> np.ndarray:
  """Bool[len(query)]: query documents with a verified LSH near-duplicate in the index."""
  found = np.zeros(query_keys.shape[0], dtype=bool)
  if query_keys.shape[0] == 0 or index_keys.shape[0] == 0:
    return found
  sorted_keys, sorted_docs = _bucket_index(index_keys)
  flat = query_keys.reshape(-1)
  order = np.argsort(flat)  # sorted queries make searchsorted cache-friendly
  lo, hi = np.empty_like(order), np.empty_like(order)
  lo[order] = np.searchsorted(sorted_keys, flat[order], side="left")
  hi[order] = np.searchsorted(sorted_keys, flat[order], side="right")
  hit_rows = np.flatnonzero(hi > lo)
  hits_by_query: Dict[int, list] = {}
  for r in hit_rows:
    hits_by_query.setdefault(int(r) // query_keys.shape[1], []).append(sorted_docs[lo[r]:hi[r]])
  for i, parts in hits_by_query.items():
    # Most shared bands first: the likeliest true duplicates are verified first.
    docs, counts = np.unique(np.concatenate(parts), return_counts=True)
    for j in docs[np.argsort(-counts, kind="stable")][:max_candidates]:
      if verify_query(i, verify_index, int(j)):
        found[i] = True
        break
  return found


def _exact_substring_dups(train_tokens, valid_tokens, window: int):
  """(train bool[n], valid bool[m]): documents sharing a `window`-token substring with
  another training document."""
  train_found = np.zeros(len(train_tokens), dtype=bool)
  valid_found = np.zeros(len(valid_tokens), dtype=bool)
  if window <= 0:
    return train_found, valid_found
  per_doc = [window_hashes(t, window) for t in train_tokens]
  if per_doc:
    all_h = np.concatenate(per_doc) if per_doc else np.zeros(0, np.uint64)
    owner = np.repeat(np.arange(len(per_doc)), [len(h) for h in per_doc])
    order = np.argsort(all_h, kind="stable")
    all_h, owner = all_h[order], owner[order]
    # Hashes are unique per document, so an equal neighbour belongs to another document.
    same = all_h[1:] == all_h[:-1]
    train_found[owner[1:][same]] = True
    train_found[owner[:-1][same]] = True
    unique_h = all_h[np.r_[True, ~same]] if all_h.size else all_h
  else:
    unique_h = np.zeros(0, np.uint64)
  for i, t in enumerate(valid_tokens):
    h = window_hashes(t, window)
    if h.size and unique_h.size:
      pos = np.clip(np.searchsorted(unique_h, h), 0, unique_h.size - 1)
      valid_found[i] = bool(np.any(unique_h[pos] == h))
  return train_found, valid_found


def build_splits(train_docs: Sequence, valid_docs: Sequence, cfg: SplitConfig = SplitConfig(),
                 tokenize: Optional[Callable[[str], Sequence[int]]] = None,
                 verbose: bool = False) -> Splits:
  """Assigns every document to one of the four splits.

  Args:
    train_docs: documents with `.id` and `.text` (the training corpus).
    valid_docs: documents of the validation corpus.
    cfg: detection settings.
    tokenize: text -> token ids for the exact-substring test (the model's vocabulary);
      None uses words.
    verbose: progress lines on stderr.

  Returns:
    `Splits` with the document ids of each split and detection statistics.
  """
  cfg.validate()
  t0 = time.time()
  train_texts = [d.text for d in train_docs]
  valid_texts = [d.text for d in valid_docs]
  say = logger.info if verbose else (lambda msg: None)
  say(f"splits: MinHash ({cfg.num_perm} permutations, {cfg.num_bands} bands x "
      f"{cfg.rows_per_band}, {cfg.ngram}-grams) over {len(train_texts)} train + "
      f"{len(valid_texts)} validation documents")
  keys = compute_band_keys(train_texts + valid_texts, cfg,
                           progress=progress_lib.callback("minhash", "documents") if verbose else None)
  train_keys, valid_keys = keys[:len(train_texts)], keys[len(train_texts):]
  t_minhash = time.time() - t0

  verify_train = _Verifier(train_texts, cfg.min_edit_similarity)
  verify_valid = _Verifier(valid_texts, cfg.min_edit_similarity)
  near_train = _near_dups_within(train_keys, verify_train, cfg.max_candidates_per_doc)
  near_valid = _near_dups_across(valid_keys, train_keys, verify_valid, verify_train,
                                 cfg.max_candidates_per_doc)
  t_lsh = time.time() - t0 - t_minhash

  if cfg.exact_substring_tokens:
    tok = tokenize or word_token_ids
    say(f"splits: exact substrings of >= {cfg.exact_substring_tokens} "
        f"{'tokens' if tokenize else 'words'}")
    exact_train, exact_valid = _exact_substring_dups([tok(t) for t in train_texts],
                                                     [tok(t) for t in valid_texts],
                                                     cfg.exact_substring_tokens)
  else:
    exact_train = np.zeros(len(train_texts), bool)
    exact_valid = np.zeros(len(valid_texts), bool)
  t_exact = time.time() - t0 - t_minhash - t_lsh

  train_dup = near_train | exact_train
  valid_dup = near_valid | exact_valid
  ids = {
      "train_dup": [d.id for d, f in zip(train_docs, train_dup) if f],
      "train_unique": [d.id for d, f in zip(train_docs, train_dup) if not f],
      "valid_in_train": [d.id for d, f in zip(valid_docs, valid_dup) if f],
      "valid_unique": [d.id for d, f in zip(valid_docs, valid_dup) if not f],
  }
  stats = {
      "train_documents": len(train_texts),
      "valid_documents": len(valid_texts),
      "train_near_dup_minhash": int(near_train.sum()),
      "train_exact_substring": int(exact_train.sum()),
      "valid_near_dup_minhash": int(near_valid.sum()),
      "valid_exact_substring": int(exact_valid.sum()),
      "verified_pairs": verify_train.checked + verify_valid.checked,
      "exact_substring_unit": "tokens" if tokenize else "words",
      "seconds": {"minhash": round(t_minhash, 2), "lsh_verify": round(t_lsh, 2),
                  "exact_substring": round(t_exact, 2), "total": round(time.time() - t0, 2)},
  }
  return Splits(ids=ids, stats=stats)


def corpus_fingerprint(docs: Iterable) -> str:
  """SHA-256 over document ids and texts: identifies the corpus content."""
  h = hashlib.sha256()
  for d in docs:
    h.update(d.id.encode("utf-8") + b"\0" + d.text.encode("utf-8") + b"\1")
  return h.hexdigest()


def splits_key(train_docs, valid_docs, cfg: SplitConfig, tokenizer_id: Optional[str]) -> str:
  """Cache key of a split file: corpus contents + settings + the tokenizer used."""
  return splits_key_from_fingerprints(corpus_fingerprint(train_docs), corpus_fingerprint(valid_docs), cfg,
                                      tokenizer_id)


def splits_key_from_fingerprints(train_fingerprint: str, valid_fingerprint: str, cfg: SplitConfig,
                                 tokenizer_id: Optional[str]) -> str:
  """`splits_key` from the two `corpus_fingerprint`s (computed while streaming a corpus)."""
  payload = json.dumps({
      "version": SPLITS_FORMAT_VERSION,
      "train": train_fingerprint,
      "valid": valid_fingerprint,
      "config": cfg.key_fields(),
      "tokenizer": tokenizer_id,
  }, sort_keys=True)
  return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def load_or_build_splits(out_dir: str, train_docs: Sequence, valid_docs: Sequence,
                         cfg: SplitConfig = SplitConfig(),
                         tokenize: Optional[Callable[[str], Sequence[int]]] = None,
                         tokenizer_id: Optional[str] = None, specs: Optional[dict] = None,
                         verbose: bool = False):
  """Reads `out_dir/splits_<key>.json` when it exists, else builds and writes it.

  Returns:
    (splits, path, reused).
  """
  key = splits_key(train_docs, valid_docs, cfg, tokenizer_id if tokenize else None)
  path = os.path.join(out_dir, f"splits_{key}.json")
  if os.path.isfile(path):
    try:
      with open(path) as f:
        data = json.load(f)
      if data.get("key") == key and set(data.get("splits", {})) == set(SPLIT_NAMES):
        if verbose:
          logger.info("splits: reusing %s", path)
        return Splits(ids=data["splits"], stats=data.get("stats", {})), path, True
    except (OSError, ValueError):
      pass  # unreadable: rebuild below
  splits = build_splits(train_docs, valid_docs, cfg, tokenize=tokenize, verbose=verbose)
  write_json_atomic(path, splits_file_content(splits, key, cfg, tokenizer_id, specs), indent=None, sort_keys=False)
  return splits, path, False


def splits_file_content(splits: Splits, key: str, cfg: SplitConfig, tokenizer_id: Optional[str],
                        specs: Optional[dict] = None) -> dict:
  """The JSON object of a split file (what `load_or_build_splits` reads back)."""
  return {"key": key, "specs": specs or {}, "config": cfg.key_fields(), "tokenizer": tokenizer_id,
          "sizes": splits.sizes(), "stats": splits.stats, "splits": splits.ids}


def check_nonempty(splits: Splits) -> List[str]:
  """Human-readable warnings for empty splits."""
  return [f"split {name!r} is empty" for name, n in splits.sizes().items() if n == 0]

