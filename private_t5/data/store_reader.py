"""Reading a built token store: a document's tokens by global index, across shards.

`DocumentStore` opens an entry (the layout in `store.py`'s docstring, any format version that still
opens), checks its files (`store_files.check_entry`: every file's size, and the SHA-256 of all but
the token files) and memory-maps each shard on first use (`store_files.MappedFile`: its size checked
first). Each read checks the size of the files it reads (one `fstat` each), so a file that shrinks
while a run reads it is a `DamagedStoreError` naming it; one truncated between that check and the
read is caught by the bus-error guard of `store_files` (one line, exit status 2).
"""
import bisect
import json
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from private_t5.data import store_index
from private_t5.data.store_files import (DOCUMENTS_FILE, FORMAT_VERSION, JSON_INDEX_FORMAT_VERSION,
                                         LEGACY_FORMAT_VERSION, MANIFEST_FILE, OFFSETS_FILE, TOKENS_FILE,
                                         DamagedStoreError, MappedFile, check_entry, check_tokens_file)
from private_t5.errors import DataError


class DocumentStore:
  """Read-only view of a built store: `document_tokens(i)` by global index, across shards.

  Shard files are memory-mapped on first use (never read whole); `offsets` (the global
  offsets, as if the shards were one array) and `lengths()` are computed on first use.
  Opening checks the files against the manifest's record (`check_entry`: their sizes, the SHA-256
  of the offsets and index files unless `index_checksum` is False, and with `verify` that of the
  token files too) and raises `DamagedStoreError` for a damaged entry; so does a read of a file
  that changed size since (`MappedFile.check`).
  """

  def __init__(self, path: str, verify: bool = False, index_checksum: bool = True):
    self.path = path
    self.reused = False  # set by `open_cached`: found in the cache rather than built
    self.rebuilt: Optional[str] = None  # why a damaged entry was rebuilt, if it was
    try:
      with open(os.path.join(path, MANIFEST_FILE)) as f:
        self.manifest = json.load(f)
    except (OSError, ValueError) as e:
      raise DataError(f"{path} is not a token store: {e}") from e
    version = self.manifest.get("format_version")
    if version not in (FORMAT_VERSION, JSON_INDEX_FORMAT_VERSION, LEGACY_FORMAT_VERSION):
      raise DataError(f"{path}: unsupported store format {version!r}")
    recorded = check_entry(path, self.manifest, checksum=verify, index_checksum=index_checksum)
    if version == LEGACY_FORMAT_VERSION:
      self._files = [(TOKENS_FILE, OFFSETS_FILE)]
    else:
      shards = self.manifest["shards"]
      self._files = [(sh["tokens"], sh["offsets"]) for sh in shards]
      self._starts = [int(x) for x in self.manifest["shard_starts"]]
      if len(self._starts) != len(shards) + 1 or self._starts[0] != 0:
        raise DataError(f"{path}: the shard index does not match its {len(shards)} shards")
    self._id_hashes: Optional[np.ndarray] = None
    self.user_index: Optional[np.ndarray] = None  # int64[N]: each document's user, with users
    self.user_names: Optional[Sequence[str]] = None  # the users' names, in index order
    if version == FORMAT_VERSION:
      self.ids: Sequence[str] = store_index.ids_column(path, shards)
      if self.manifest.get("num_users") is not None:
        self.user_index, self.user_names = store_index.user_columns(path, int(self.manifest["num_users"]))
    else:
      self._open_json_index(version)
    self.users: Optional[Sequence[str]] = (None if self.user_index is None
                                           else store_index.UserColumn(self.user_index, self.user_names))
    if self._starts[-1] != len(self.ids):
      raise DataError(f"{path}: shard index and ids disagree ({self._starts[-1]} vs {len(self.ids)} documents)")
    for k, (_, offsets_file) in enumerate(self._files):
      expected = (self._starts[k + 1] - self._starts[k] + 1) * 8
      try:
        size = os.path.getsize(os.path.join(path, offsets_file))
      except OSError as e:
        raise DataError(f"{path}: missing shard file {offsets_file}") from e
      if size != expected:
        raise DataError(f"{path}: offsets and ids disagree in {offsets_file} ({size // 8} vs "
                        f"{expected // 8} offsets)")
    if not recorded:  # an entry built before the record: the token files checked against their offsets
      for tokens_file, offsets_file in self._files:
        check_tokens_file(path, tokens_file, offsets_file)
    self._shard_offsets: Dict[int, MappedFile] = {}
    self._shard_tokens: Dict[int, MappedFile] = {}
    self._global_offsets: Optional[np.ndarray] = None

  def __reduce__(self):
    # Pickled (to a data worker process): opened again there from its files, sizes checked, so
    # nothing as long as the corpus (offsets, ids, id hashes) is copied into the pickle.
    return DocumentStore, (self.path, False, False)

  def _open_json_index(self, version: int) -> None:
    """An older store's index: every id and user from documents.json, held in memory."""
    try:
      with open(os.path.join(self.path, DOCUMENTS_FILE)) as f:
        documents = json.load(f)
    except (OSError, ValueError) as e:
      raise DataError(f"{self.path} is not a token store: {e}") from e
    self.ids = documents["ids"]
    if version == LEGACY_FORMAT_VERSION:
      self._starts = [0, len(self.ids)]
    users = documents.get("users")
    if users is not None:
      index: Dict[str, int] = {}
      self.user_index = np.asarray([index.setdefault(u, len(index)) for u in users], dtype=np.int64)
      self.user_names = list(index)

  def id_hashes(self) -> np.ndarray:
    """uint64[N]: the first 8 bytes of each document id's SHA-256 (`store_index.id_hash`), the
    public validation split's input; memory-mapped for a one-shard store."""
    if self._id_hashes is None:
      if self.manifest.get("format_version") == FORMAT_VERSION:
        self._id_hashes = store_index.id_hashes(self.path, self.manifest["shards"])
      else:
        self._id_hashes = np.asarray([store_index.id_hash(i) for i in self.ids], dtype=np.uint64)
    return self._id_hashes

  def id_hash_blocks(self, block: int = 1 << 20):
    """(first document, uint64 id hashes of the next <= `block` documents), in order: the hashes
    read a block at a time from the files (nothing memory-mapped stays resident)."""
    if self.manifest.get("format_version") != FORMAT_VERSION:
      hashes = self.id_hashes()
      for start in range(0, len(hashes), block):
        yield start, hashes[start:start + block]
      return
    for k, shard in enumerate(self.manifest["shards"]):
      path, n = os.path.join(self.path, shard["id_hashes"]), int(shard["documents"])
      for start in range(0, n, block):
        yield self._starts[k] + start, _read(path, np.uint64, min(block, n - start), start)

  def lengths_of(self, docs: np.ndarray, block: int = 1 << 20):
    """The token count of each document of `docs` (int64 indices), a block at a time: (positions
    in `docs`, their int64 lengths). The offsets are read a range at a time from the files
    (`np.fromfile`), so nothing as long as the corpus is mapped or held."""
    docs = np.asarray(docs, dtype=np.int64)
    order = None if np.all(docs[:-1] <= docs[1:]) else np.argsort(docs, kind="stable")
    ordered = docs if order is None else docs[order]
    for k in range(self.num_shards):
      lo, hi = np.searchsorted(ordered, [self._starts[k], self._starts[k + 1]])
      path = os.path.join(self.path, self._files[k][1])
      for a in range(lo, hi, block):
        b = min(hi, a + block)
        local = ordered[a:b] - self._starts[k]
        first, last = int(local[0]), int(local[-1])
        offsets = _read(path, np.int64, last - first + 2, first)
        yield (np.arange(a, b) if order is None else order[a:b]), offsets[local - first + 1] - offsets[local - first]

  @property
  def num_users(self) -> Optional[int]:
    return None if self.user_names is None else len(self.user_names)

  @property
  def num_documents(self) -> int:
    return len(self.ids)

  @property
  def num_shards(self) -> int:
    return len(self._files)

  @property
  def shard_starts(self) -> List[int]:
    """K+1 cumulative document counts: shard S holds global documents [starts[S], starts[S+1])."""
    return list(self._starts)

  @property
  def num_tokens(self) -> int:
    if "num_tokens" in self.manifest:
      return int(self.manifest["num_tokens"])
    return int(self.offsets[-1])

  def shard_of(self, i: int):
    """(shard, local index) of global document `i`: a binary search over the shard starts."""
    if not 0 <= i < len(self.ids):
      raise IndexError(f"document index {i} out of range [0, {len(self.ids)})")
    k = bisect.bisect_right(self._starts, i) - 1
    return k, i - self._starts[k]

  def _offsets_file(self, k: int) -> MappedFile:
    mapped = self._shard_offsets.get(k)
    if mapped is None:
      size = (self._starts[k + 1] - self._starts[k] + 1) * 8
      mapped = self._shard_offsets[k] = MappedFile(os.path.join(self.path, self._files[k][1]), np.int64, size)
    return mapped

  def _offsets_of(self, k: int) -> np.ndarray:
    return self._offsets_file(k).array

  def _tokens_file(self, k: int) -> MappedFile:
    mapped = self._shard_tokens.get(k)
    if mapped is None:
      n = int(self._offsets_of(k)[-1])
      if n < 0:
        raise DamagedStoreError(self.path, f"{self._files[k][1]} ends with a negative offset ({n})")
      mapped = self._shard_tokens[k] = MappedFile(os.path.join(self.path, self._files[k][0]), np.int32, 4 * n)
    return mapped

  def _tokens_of(self, k: int) -> np.ndarray:
    return self._tokens_file(k).array

  def _checked(self, k: int):
    """(offsets, tokens) of shard `k`, once both files were found of the size they were mapped with."""
    offsets, tokens = self._offsets_file(k), self._tokens_file(k)
    offsets.check()
    tokens.check()
    return offsets.array, tokens.array

  def document_tokens(self, i: int) -> np.ndarray:
    k, j = self.shard_of(int(i))
    offsets, tokens = self._checked(k)
    return tokens[offsets[j]:offsets[j + 1]]

  def windows(self, docs, starts, lengths, width: int) -> np.ndarray:
    """int32 [n, width]: row r holds tokens [starts[r], starts[r] + lengths[r]) of global
    document docs[r] (each piece within its document, lengths <= width), then zeros.

    One gather per shard read, its files size-checked once, instead of a `document_tokens` call a row.
    """
    docs = np.asarray(docs, dtype=np.int64).reshape(-1)
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    out = np.zeros((len(docs), width), np.int32)
    if not len(docs):
      return out
    if docs.min() < 0 or docs.max() >= len(self.ids):
      raise IndexError(f"document index out of range [0, {len(self.ids)})")
    shard_starts = np.asarray(self._starts, dtype=np.int64)
    shards = np.searchsorted(shard_starts, docs, side="right") - 1
    column = np.arange(width)[None, :]
    for k in np.unique(shards).tolist():
      rows = np.flatnonzero(shards == k) if self.num_shards > 1 else np.arange(len(docs))
      offsets, tokens = self._checked(k)
      inside = column < lengths[rows, None]
      if not tokens.size:
        continue  # only empty pieces
      first = np.asarray(offsets[docs[rows] - shard_starts[k]], dtype=np.int64) + starts[rows]
      out[rows] = np.where(inside, tokens[np.where(inside, first[:, None] + column, 0)], 0)
    return out

  def document_length(self, i: int) -> int:
    k, j = self.shard_of(int(i))
    offsets = self._offsets_file(k)
    offsets.check()
    return int(offsets.array[j + 1] - offsets.array[j])

  @property
  def offsets(self) -> np.ndarray:
    """N+1 global token offsets (as if the shards were one array); built on first use."""
    if self.num_shards == 1:  # memory-mapped: one shard's offsets are the global ones (checked at each use)
      mapped = self._offsets_file(0)
      mapped.check()
      return mapped.array
    if self._global_offsets is None:
      parts, base = [np.zeros((1,), np.int64)], 0
      for k in range(self.num_shards):
        off = np.asarray(self._offsets_of(k), dtype=np.int64)
        parts.append(off[1:] - off[0] + base)
        base += int(off[-1] - off[0])
      self._global_offsets = np.concatenate(parts)
    return self._global_offsets

  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)


def _read(path: str, dtype, count: int, first: int) -> np.ndarray:
  """`count` 8-byte values of a store file from value `first` on (read, not mapped); a file now too
  short for them is a DamagedStoreError naming it."""
  folder, name = os.path.split(path)
  try:
    values = np.fromfile(path, dtype=dtype, count=count, offset=8 * first)
    if len(values) == count:
      return values
    size = os.path.getsize(path)
  except OSError as e:
    raise DamagedStoreError(folder, f"{name} cannot be read ({e.strerror or e})") from None
  raise DamagedStoreError(folder, f"{name} holds {size} bytes, fewer than the {8 * (first + count)} read from it")
