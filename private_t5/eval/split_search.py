"""The in-process search for the four splits (`build_splits_streaming`), the documents spilled to disk.

`build_splits_streaming` reads each corpus once and keeps ~20 bytes a document in memory: the
texts, the band keys and the window hashes go to a temporary folder; buckets are formed one band
at a time (sorting that band's keys), candidate pairs are counted in arrays, and the texts of a
pair are read back by offset when it is verified. The result is a flag a document. Near-duplicates
of a document with itself (a boilerplate paragraph repeated inside one document) do not count.
"""
import array
import hashlib
import logging
import os
import shutil
import tempfile
import time
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from private_t5.errors import ConfigError
from private_t5.eval.lsh_pairs import PairCounts, band_pairs
from private_t5.eval.near_dup import band_key_chunks, check_pair, word_token_ids, words
from private_t5.shingles import window_hashes
from private_t5.eval.split_types import SplitConfig, Splits
from private_t5.io import make_temp_dir, remove_stale_temp_dirs

# The splits' log lines keep one logger name, whichever module writes them.
logger = logging.getLogger("private_t5.eval.splits")

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

      for keys in band_key_chunks(texts(), cfg):
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

