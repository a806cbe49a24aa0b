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
the CPU cores; each document is reduced to one 64-bit key per band right away.

`build_splits_streaming` reads each corpus once and keeps ~20 bytes a document in memory: the
texts, the band keys and the window hashes go to a temporary folder; buckets are formed one band
at a time (sorting that band's keys), candidate pairs are counted in arrays, and the texts of a
pair are read back by offset when it is verified. The result is a flag a document.
"""
import array
import base64
import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import editdistance
import numpy as np

from private_t5 import user_modules
from private_t5.errors import ConfigError
from private_t5.hashing import mix64
from private_t5.io import make_temp_dir, remove_stale_temp_dirs, write_json_atomic

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train_dup", "train_unique", "valid_in_train", "valid_unique")
SPLITS_FORMAT_VERSION = 1  # of the results: part of the split file's key
SPLIT_FILE_FORMAT = 2  # of the file: 2 = a bit a document; 1 (no "format" field) = id lists

# The golden-ratio increment of SplitMix64 (Steele et al. 2014; its finaliser: `hashing.mix64`).
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
  """The four splits as a flag per document (in corpus order) plus how they were found.

  Attributes:
    train_dup: bool [training documents]: True for train dup, False for train unique.
    valid_dup: bool [validation documents]: True for valid in train, False for valid unique.
    stats: detection statistics.
    ids: the document ids of each split, when the documents were at hand (`with_ids`).
    fingerprints: the two corpora's `corpus_fingerprint`s, when computed while reading them.
  """
  train_dup: np.ndarray
  valid_dup: np.ndarray
  stats: dict
  ids: Optional[Dict[str, List[str]]] = None
  fingerprints: Optional[Tuple[str, str]] = None

  def sizes(self) -> Dict[str, int]:
    t, v = int(np.count_nonzero(self.train_dup)), int(np.count_nonzero(self.valid_dup))
    return {"train_dup": t, "train_unique": len(self.train_dup) - t, "valid_in_train": v,
            "valid_unique": len(self.valid_dup) - v}

  def indices(self, name: str) -> np.ndarray:
    """The numbers (0-based positions in its corpus) of split `name`'s documents, ascending."""
    if name not in SPLIT_NAMES:
      raise ConfigError(f"unknown split {name!r} (one of {SPLIT_NAMES})")
    flags = self.train_dup if name.startswith("train") else self.valid_dup
    return np.flatnonzero(flags if name in ("train_dup", "valid_in_train") else ~flags)

  def with_ids(self, train_ids: Iterable[str], valid_ids: Iterable[str]) -> "Splits":
    """A copy with `ids` filled in from the corpora's ids in corpus order."""
    ids = {name: [] for name in SPLIT_NAMES}
    for flags, doc_ids, (dup, unique) in ((self.train_dup, train_ids, SPLIT_NAMES[:2]),
                                          (self.valid_dup, valid_ids, SPLIT_NAMES[2:])):
      for flag, doc_id in zip(flags.tolist(), doc_ids):
        ids[dup if flag else unique].append(doc_id)
    return dataclasses.replace(self, ids=ids)


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
  h = np.arange(num_bands, dtype=np.uint64) * _GOLDEN
  with np.errstate(over="ignore"):
    for j in range(rows.shape[1]):
      h = mix64(h ^ rows[:, j])
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
    s = np.concatenate([[np.uint64(0)], np.cumsum(mix64(x + _GOLDEN) * inv_pows, dtype=np.uint64)])
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


# Documents a block of the band-key file holds (written band-major: one band's keys of a block
# are contiguous, so one band of the whole corpus is read block by block).
KEY_BLOCK = 4096
# Window-hash partitions (by the hash's top 8 bits): one is in memory at a time.
_HASH_PARTITIONS = 256
_WINDOW_DTYPE = np.dtype([("h", "<u8"), ("d", "<u4")])
_MAX_DOCUMENTS = 1 << 32  # document numbers are stored as uint32


class _Spill:
  """What the search needs per document, on disk in a temporary folder.

  * texts: UTF-8 bytes one after the other, read back by offset (`text`); the offsets stay in
    memory (8 bytes a document);
  * band keys: blocks of `KEY_BLOCK` documents, band-major (`band` reads one band of every
    document: 8 bytes a document in memory);
  * window hashes (exact substrings): (hash, document) records in `_HASH_PARTITIONS` files by
    the hash's top bits (`window_partitions` yields one file's records at a time).
  """

  def __init__(self, directory: str, num_bands: int):
    self._dir = directory
    self._bands = num_bands
    self._texts = open(os.path.join(directory, "texts.bin"), "w+b")  # pylint: disable=consider-using-with
    self._keys = open(os.path.join(directory, "band_keys.bin"), "w+b")  # pylint: disable=consider-using-with
    self.offsets = array.array("q", [0])
    self._block = np.zeros((KEY_BLOCK, num_bands), dtype=np.uint64)
    self._in_block = 0
    self.num_keyed = 0
    self._windows: List[np.ndarray] = []
    self._windows_buffered = 0
    self.windows = 0

  def close(self):
    self._texts.close()
    self._keys.close()

  @property
  def num_documents(self) -> int:
    return len(self.offsets) - 1

  def add_text(self, text: str) -> None:
    raw = text.encode("utf-8")
    self._texts.write(raw)
    self.offsets.append(self.offsets[-1] + len(raw))

  def text(self, i: int) -> str:
    start, end = self.offsets[i], self.offsets[i + 1]
    return os.pread(self._texts.fileno(), end - start, start).decode("utf-8")

  def flush_texts(self) -> None:
    self._texts.flush()

  def add_keys(self, keys: np.ndarray) -> None:
    """Appends band keys [m, num_bands] of the next m documents."""
    done = 0
    while done < len(keys):
      take = min(len(keys) - done, KEY_BLOCK - self._in_block)
      self._block[self._in_block:self._in_block + take] = keys[done:done + take]
      self._in_block += take
      done += take
      if self._in_block == KEY_BLOCK:
        self._write_block()
    self.num_keyed += len(keys)

  def _write_block(self) -> None:
    np.ascontiguousarray(self._block.T).tofile(self._keys)
    self._block[:] = 0
    self._in_block = 0

  def finish_keys(self) -> None:
    if self._in_block:
      self._write_block()
    self._keys.flush()

  def band(self, b: int) -> np.ndarray:
    """uint64 [num_keyed]: band b's key of every document."""
    blocks = -(-self.num_keyed // KEY_BLOCK)
    out = np.empty(blocks * KEY_BLOCK, dtype=np.uint64)
    for k in range(blocks):
      self._keys.seek((k * self._bands + b) * KEY_BLOCK * 8)
      self._keys.readinto(memoryview(out[k * KEY_BLOCK:(k + 1) * KEY_BLOCK]).cast("B"))
    return out[:self.num_keyed]

  def add_windows(self, hashes: np.ndarray, doc: int) -> None:
    if hashes.size:
      rec = np.empty(hashes.size, dtype=_WINDOW_DTYPE)
      rec["h"], rec["d"] = hashes, doc
      self._windows.append(rec)
      self._windows_buffered += hashes.size
      self.windows += hashes.size
      if self._windows_buffered >= 1 << 20:
        self.flush_windows()

  def flush_windows(self) -> None:
    if not self._windows:
      return
    rec = np.concatenate(self._windows)
    self._windows, self._windows_buffered = [], 0
    part = (rec["h"] >> np.uint64(56)).astype(np.int64)
    order = np.argsort(part, kind="stable")
    rec, part = rec[order], part[order]
    bounds = np.searchsorted(part, np.arange(_HASH_PARTITIONS + 1))
    for p in np.flatnonzero(np.diff(bounds)):
      with open(os.path.join(self._dir, f"windows-{p:03d}.bin"), "ab") as f:
        rec[bounds[p]:bounds[p + 1]].tofile(f)

  def window_partitions(self) -> Iterator[np.ndarray]:
    self.flush_windows()
    for p in range(_HASH_PARTITIONS):
      path = os.path.join(self._dir, f"windows-{p:03d}.bin")
      if os.path.exists(path):
        yield np.fromfile(path, dtype=_WINDOW_DTYPE)


class _Verifier:
  """Edit-similarity check of candidate pairs, texts read from the spill, word lists cached."""

  def __init__(self, spill: _Spill, threshold: float):
    self._spill = spill
    self._threshold = threshold
    self._cache = {}
    self.checked = 0

  def _words(self, i: int):
    w = self._cache.get(i)
    if w is None:
      w = words(self._spill.text(i))
      if len(self._cache) > 4096:
        self._cache.clear()
      self._cache[i] = w
    return w

  def __call__(self, i: int, j: int) -> bool:
    """Whether documents i and j (numbers in the spill) are near-duplicates."""
    checked, dup = check_pair(self._words(i), self._words(j), self._threshold)
    self.checked += checked
    return dup


class PairCounts:
  """How many times each (query, candidate) pair was formed: uint64 codes q << 32 | j, counted."""

  def __init__(self):
    self._pending: List[np.ndarray] = []
    self._pending_size = 0
    self.codes = np.zeros(0, dtype=np.uint64)
    self.counts = np.zeros(0, dtype=np.int64)

  def add(self, query: np.ndarray, cand: np.ndarray) -> None:
    """Counts each (query[k], cand[k]) once."""
    if query.size:
      self._pending.append((query.astype(np.uint64) << np.uint64(32)) | cand.astype(np.uint64))
      self._pending_size += query.size
      if self._pending_size > 1 << 22:
        self.compact()

  def add_counted(self, codes: np.ndarray, counts: np.ndarray) -> None:
    """Adds counts of pairs already counted elsewhere (codes as in `codes`)."""
    self.compact()
    self._merge(np.asarray(codes, dtype=np.uint64), np.asarray(counts, dtype=np.int64))

  def compact(self) -> None:
    if not self._pending:
      return
    new, counts = np.unique(np.concatenate(self._pending), return_counts=True)
    self._pending, self._pending_size = [], 0
    self._merge(new, counts)

  def _merge(self, codes: np.ndarray, counts: np.ndarray) -> None:
    if self.codes.size:
      codes, inverse = np.unique(np.concatenate([self.codes, codes]), return_inverse=True)
      counts = np.bincount(inverse, weights=np.concatenate([self.counts, counts])).astype(np.int64)
    self.codes, self.counts = codes, counts

  def ranked(self, max_candidates: int) -> Iterator[Tuple[int, np.ndarray]]:
    """(query, its candidates): most shared buckets first, ties by number (`rank_candidates`)."""
    self.compact()
    if not self.codes.size:
      return
    q = (self.codes >> np.uint64(32)).astype(np.int64)
    j = (self.codes & np.uint64(0xFFFFFFFF)).astype(np.int64)
    order = np.lexsort((j, -self.counts, q))
    q, j = q[order], j[order]
    starts = np.flatnonzero(np.r_[True, q[1:] != q[:-1]])
    ends = np.r_[starts[1:], q.size]
    for s, e in zip(starts.tolist(), ends.tolist()):
      yield q[s], j[s:min(e, s + max_candidates)]


def _expand(starts: np.ndarray, lengths: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """(owner, position): for each k, lengths[k] entries owner k at positions starts[k] + 0..lengths[k]-1."""
  owner = np.repeat(np.arange(lengths.size), lengths)
  first = np.repeat(np.cumsum(lengths) - lengths, lengths)
  return owner, np.repeat(starts, lengths) + np.arange(owner.size) - first


def band_pairs(keys: np.ndarray, n_train: int, max_candidates: int, within: PairCounts,
                across: PairCounts) -> None:
  """One band's buckets -> candidate pairs, as `bucket_candidates` forms them (train x train) and
  every train member for a validation document."""
  train, valid = keys[:n_train], keys[n_train:]
  if not n_train:
    return
  sorted_train = np.sort(train)
  same = sorted_train[1:] == sorted_train[:-1]
  shared = np.unique(sorted_train[1:][same])  # buckets of 2+ training documents
  pos = np.minimum(np.searchsorted(sorted_train, valid), n_train - 1)
  hit = sorted_train[pos] == valid if valid.size else np.zeros(0, bool)
  wanted = np.union1d(shared, valid[hit])
  if not wanted.size:
    return
  docs = np.flatnonzero(np.isin(train, wanted))  # ascending
  order = np.argsort(train[docs], kind="stable")
  bucket_keys, members = train[docs][order], docs[order]  # members ascending within a bucket
  starts = np.flatnonzero(np.r_[True, bucket_keys[1:] != bucket_keys[:-1]])
  lengths = np.diff(np.r_[starts, bucket_keys.size])
  multi = lengths >= 2
  if multi.any():
    s, n = starts[multi], lengths[multi]
    owner, at = _expand(s, n)  # every member of a bucket of 2+
    heads = np.minimum(n, max_candidates + 1)[owner]
    rep, head_at = _expand(at, heads)
    head_at = head_at - at[rep] + s[owner[rep]]
    i, j = members[at[rep]], members[head_at]
    keep = i != j
    within.add(i[keep], j[keep])
  if hit.any():
    q = np.flatnonzero(hit)
    b = np.searchsorted(bucket_keys[starts], valid[q])
    owner, at = _expand(starts[b], lengths[b])
    across.add(q[owner], members[at])


def _near_dups(spill: _Spill, n_train: int, cfg: SplitConfig, verify: _Verifier) -> Tuple[np.ndarray, np.ndarray]:
  """(train bool[n], valid bool[m]): MinHash LSH near-duplicates, verified by edit similarity.

  Train: each document i, independently of the others, verifies its candidates
  (`bucket_candidates` over every bucket it is in, ranked by `rank_candidates`) in turn; the
  first verified j marks i and j. Validation: each document's candidates are every training
  document of its buckets, ranked the same way; the first verified one marks it. The result
  does not depend on the order of documents or buckets (eval/splits_beam.py finds the same).
  Buckets are formed band by band (8 bytes a document in memory); pairs are counted in arrays.
  """
  n_valid = spill.num_keyed - n_train
  within, across = PairCounts(), PairCounts()
  for b in range(cfg.num_bands):
    band_pairs(spill.band(b), n_train, cfg.max_candidates_per_doc, within, across)
  train_found = np.zeros(n_train, dtype=bool)
  valid_found = np.zeros(n_valid, dtype=bool)
  for i, cands in within.ranked(cfg.max_candidates_per_doc):
    for j in cands.tolist():
      if verify(int(i), j):
        train_found[i] = train_found[j] = True
        break
  for q, cands in across.ranked(cfg.max_candidates_per_doc):
    for j in cands.tolist():
      if verify(n_train + int(q), j):
        valid_found[q] = True
        break
  return train_found, valid_found


def _exact_substring_dups(spill: _Spill, n_train: int, n_valid: int) -> Tuple[np.ndarray, np.ndarray]:
  """(train bool[n], valid bool[m]): documents sharing a window hash with another training
  document, one hash partition in memory at a time."""
  train_found = np.zeros(n_train, dtype=bool)
  valid_found = np.zeros(n_valid, dtype=bool)
  for rec in spill.window_partitions():
    is_train = rec["d"] < n_train
    tr = rec[is_train]
    order = np.argsort(tr["h"], kind="stable")
    h, owner = tr["h"][order], tr["d"][order]
    # Hashes are unique per document, so an equal neighbour belongs to another document.
    same = h[1:] == h[:-1]
    train_found[owner[1:][same]] = True
    train_found[owner[:-1][same]] = True
    va = rec[~is_train]
    if va.size and h.size:
      valid_found[va["d"][np.isin(va["h"], h)] - n_train] = True
  return train_found, valid_found


def _chunks_of(docs: Iterable, spill: _Spill, fingerprint, window: int, tok) -> Iterator[List[str]]:
  """Texts of `docs` in chunks of ~2 MB (the MinHash workers' unit), spilled and fingerprinted on the way."""
  cur, size = [], 0
  for d in docs:
    text = d.text
    fingerprint.update(d.id.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\1")
    if spill.num_documents >= _MAX_DOCUMENTS - 1:
      raise ConfigError(f"more than {_MAX_DOCUMENTS - 1} documents: split the corpora")
    if window:
      spill.add_windows(window_hashes(tok(text), window), spill.num_documents)
    spill.add_text(text)
    cur.append(text)
    size += len(text)
    if size > 2_000_000 or len(cur) >= 2000:
      yield cur
      cur, size = [], 0
  if cur:
    yield cur


def _band_key_chunks(chunks: Iterator[List[str]], cfg: SplitConfig) -> Iterator[np.ndarray]:
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


WORK_DIR_PREFIX = "private_t5_splits_"


def remove_stale_work_dirs(parent: str) -> List[str]:
  """Deletes the work folders of killed searches in `parent` (named after a process on this host
  that no longer runs, or of unknown owner and untouched for a day); returns their paths. Folders
  of running searches are never touched."""
  return remove_stale_temp_dirs(parent, WORK_DIR_PREFIX)


def build_splits_streaming(train_docs: Iterable, valid_docs: Iterable, cfg: SplitConfig = SplitConfig(),
                           tokenize: Optional[Callable[[str], Sequence[int]]] = None, verbose: bool = False,
                           work_dir: Optional[str] = None) -> Splits:
  """Assigns every document to one of the four splits, reading each corpus once, in order.

  Memory per document: the text offsets (8 bytes) and the flags (2 bytes), plus one band's keys
  (8 bytes, while the buckets of that band are formed); texts, band keys and window hashes go
  to a temporary folder (in `work_dir`, default the system's; removed afterwards): the text,
  8 bytes a band a document, and 12 bytes a window. The folder is named after this process
  (`io.make_temp_dir`), so the folders that killed runs left in `work_dir` are removed when the
  next search starts (`remove_stale_work_dirs`).

  Args:
    train_docs: documents with `.id` and `.text` (the training corpus), iterated once.
    valid_docs: documents of the validation corpus, iterated once after them.
    cfg: detection settings.
    tokenize: text -> token ids for the exact-substring test (the model's vocabulary);
      None uses words.
    verbose: progress lines in the log.
    work_dir: parent folder of the temporary files.

  Returns:
    `Splits` with a flag per document (no ids) and the two corpora's `corpus_fingerprint`s.
  """
  cfg.validate()
  t0 = time.time()
  say = logger.info if verbose else (lambda msg: None)
  say(f"splits: MinHash ({cfg.num_perm} permutations, {cfg.num_bands} bands x {cfg.rows_per_band}, "
      f"{cfg.ngram}-grams), reading the corpora once")
  window = cfg.exact_substring_tokens
  tok = tokenize or word_token_ids
  fingerprints = [hashlib.sha256(), hashlib.sha256()]
  counts = []
  parent = work_dir or tempfile.gettempdir()
  remove_stale_work_dirs(parent)
  tmp = make_temp_dir(parent, WORK_DIR_PREFIX)
  try:
    spill = _Spill(tmp, cfg.num_bands)
    try:
      def texts():
        for k, docs in enumerate((train_docs, valid_docs)):
          yield from _chunks_of(docs, spill, fingerprints[k], window, tok)
          counts.append(spill.num_documents - sum(counts))

      for keys in _band_key_chunks(texts(), cfg):
        spill.add_keys(keys)
        if verbose and spill.num_keyed // 100_000 != (spill.num_keyed - len(keys)) // 100_000:
          say(f"splits: {spill.num_keyed} documents read and MinHashed")
      counts += [0] * (2 - len(counts))  # an empty corpus ends the chunks early
      spill.finish_keys()
      spill.flush_texts()
      n_train, n_valid = counts
      t_minhash = time.time() - t0
      say(f"splits: {n_train} train + {n_valid} validation documents; LSH buckets band by band")
      verify = _Verifier(spill, cfg.min_edit_similarity)
      near_train, near_valid = _near_dups(spill, n_train, cfg, verify)
      t_lsh = time.time() - t0 - t_minhash
      if window:
        say(f"splits: exact substrings of >= {window} {'tokens' if tokenize else 'words'} "
            f"({spill.windows} windows)")
        exact_train, exact_valid = _exact_substring_dups(spill, n_train, n_valid)
      else:
        exact_train, exact_valid = np.zeros(n_train, bool), np.zeros(n_valid, bool)
      t_exact = time.time() - t0 - t_minhash - t_lsh
    finally:
      spill.close()
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  stats = {
      "train_documents": n_train,
      "valid_documents": n_valid,
      "train_near_dup_minhash": int(near_train.sum()),
      "train_exact_substring": int(exact_train.sum()),
      "valid_near_dup_minhash": int(near_valid.sum()),
      "valid_exact_substring": int(exact_valid.sum()),
      "verified_pairs": verify.checked,
      "exact_substring_unit": "tokens" if tokenize else "words",
      "seconds": {"read_minhash": round(t_minhash, 2), "lsh_verify": round(t_lsh, 2),
                  "exact_substring": round(t_exact, 2), "total": round(time.time() - t0, 2)},
  }
  return Splits(train_dup=near_train | exact_train, valid_dup=near_valid | exact_valid, stats=stats,
                fingerprints=(fingerprints[0].hexdigest(), fingerprints[1].hexdigest()))


def build_splits(train_docs: Sequence, valid_docs: Sequence, cfg: SplitConfig = SplitConfig(),
                 tokenize: Optional[Callable[[str], Sequence[int]]] = None,
                 verbose: bool = False) -> Splits:
  """`build_splits_streaming` of documents in memory, with the ids of each split filled in."""
  splits = build_splits_streaming(train_docs, valid_docs, cfg, tokenize=tokenize, verbose=verbose)
  return splits.with_ids((d.id for d in train_docs), (d.id for d in valid_docs))


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


def split_file_path(out_dir: str, key: str) -> str:
  """Where `load_or_build_splits` (and the memorization stage) look for the split file of `key`."""
  return os.path.join(out_dir, f"splits_{key}.json")


def load_split_file(path: str, key: str, verbose: bool = False) -> Optional[Splits]:
  """The splits stored at `path` for `key`, or None (no file, another key, unreadable, or the
  old format of id lists, which is rebuilt: one log line says so)."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    if data.get("key") != key:
      return None
    if data.get("format") != SPLIT_FILE_FORMAT:
      logger.info("splits: %s lists document ids (an older format); rebuilding it as a flag a document", path)
      return None
    flags = [_unpack_flags(data["flags"][side]) for side in ("train", "valid")]
  except (OSError, ValueError, KeyError, TypeError):
    return None  # unreadable: rebuilt by the caller
  if verbose:
    logger.info("splits: reusing %s", path)
  return Splits(train_dup=flags[0], valid_dup=flags[1], stats=data.get("stats", {}))


def load_or_build_splits(out_dir: str, train_docs: Sequence, valid_docs: Sequence,
                         cfg: SplitConfig = SplitConfig(),
                         tokenize: Optional[Callable[[str], Sequence[int]]] = None,
                         tokenizer_id: Optional[str] = None, specs: Optional[dict] = None,
                         verbose: bool = False):
  """Reads `out_dir/splits_<key>.json` when it exists, else builds and writes it (documents in memory).

  Returns:
    (splits with ids, path, reused).
  """
  key = splits_key(train_docs, valid_docs, cfg, tokenizer_id if tokenize else None)
  path = split_file_path(out_dir, key)
  splits = load_split_file(path, key, verbose)
  reused = splits is not None
  if not reused:
    splits = build_splits_streaming(train_docs, valid_docs, cfg, tokenize=tokenize, verbose=verbose)
    write_split_file(path, splits, key, cfg, tokenizer_id, specs)
  return splits.with_ids((d.id for d in train_docs), (d.id for d in valid_docs)), path, reused


def write_split_file(path: str, splits: Splits, key: str, cfg: SplitConfig, tokenizer_id: Optional[str],
                     specs: Optional[dict] = None) -> str:
  """Writes `splits_file_content` atomically; returns the path."""
  return write_json_atomic(path, splits_file_content(splits, key, cfg, tokenizer_id, specs), indent=None,
                           sort_keys=False)


def splits_file_content(splits: Splits, key: str, cfg: SplitConfig, tokenizer_id: Optional[str],
                        specs: Optional[dict] = None) -> dict:
  """The JSON object of a split file (what `load_split_file` reads back).

  `flags.train` / `flags.valid`: `count` documents and `dup`, the base64 of their flags packed
  8 a byte (`numpy.packbits`, first document in the high bit): 1 for train dup / valid in
  train, 0 for train unique / valid unique. A split's documents are then named by their number
  in the corpus (0-based, in the order the corpus is read), which the key pins down.
  """
  return {"key": key, "format": SPLIT_FILE_FORMAT, "specs": specs or {}, "config": cfg.key_fields(),
          "tokenizer": tokenizer_id, "sizes": splits.sizes(), "stats": splits.stats,
          "flags": {"train": _pack_flags(splits.train_dup), "valid": _pack_flags(splits.valid_dup)}}


def _pack_flags(flags: np.ndarray) -> dict:
  return {"count": int(len(flags)), "dup": base64.b64encode(np.packbits(flags.astype(bool))).decode("ascii")}


def _unpack_flags(packed: dict) -> np.ndarray:
  count = int(packed["count"])
  bits = np.unpackbits(np.frombuffer(base64.b64decode(packed["dup"]), dtype=np.uint8), count=count)
  if bits.size != count:
    raise ValueError("flag count mismatch")
  return bits.astype(bool)


def check_nonempty(splits: Splits) -> List[str]:
  """Human-readable warnings for empty splits."""
  return [f"split {name!r} is empty" for name, n in splits.sizes().items() if n == 0]

