"""LSH candidate pairs: the documents that share a bucket of a band, counted and ranked.

A bucket of n documents gives O(n) pairs (`bucket_candidates`); `band_pairs` forms one band's
pairs in arrays and `PairCounts` counts how many buckets each pair shares, so that a document's
candidates are verified most-shared first (`rank_candidates`).
"""
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np


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

