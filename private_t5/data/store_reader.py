"""Reading a built token store: a document's tokens by global index, across shards.

`DocumentStore` opens an entry (the layout in `store.py`'s docstring, any format version that still
opens), checks its files (`store_files.check_entry`) and memory-maps each shard on first use.
"""
import bisect
import json
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from private_t5.data import store_index
from private_t5.data.store_files import (DOCUMENTS_FILE, FORMAT_VERSION, JSON_INDEX_FORMAT_VERSION,
                                         LEGACY_FORMAT_VERSION, MANIFEST_FILE, OFFSETS_FILE, TOKENS_FILE,
                                         check_entry, check_tokens_file)
from private_t5.errors import DataError


class DocumentStore:
  """Read-only view of a built store: `document_tokens(i)` by global index, across shards.

  Shard files are memory-mapped on first use (never read whole); `offsets` (the global
  offsets, as if the shards were one array) and `lengths()` are computed on first use.
  Opening checks the files' sizes against the manifest's record (`check_entry`; `verify`: their
  SHA-256 too) and raises `DamagedStoreError` for a damaged entry.
  """

  def __init__(self, path: str, verify: bool = False):
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
    recorded = check_entry(path, self.manifest, checksum=verify)
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
    self._shard_offsets: Dict[int, np.ndarray] = {}
    self._shard_tokens: Dict[int, np.ndarray] = {}
    self._global_offsets: Optional[np.ndarray] = None

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
        yield self._starts[k] + start, np.fromfile(path, dtype=np.uint64, count=min(block, n - start), offset=8 * start)

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
        offsets = np.fromfile(path, dtype=np.int64, count=last - first + 2, offset=8 * first)
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

  def _offsets_of(self, k: int) -> np.ndarray:
    arr = self._shard_offsets.get(k)
    if arr is None:
      arr = np.memmap(os.path.join(self.path, self._files[k][1]), dtype=np.int64, mode="r")
      self._shard_offsets[k] = arr
    return arr

  def _tokens_of(self, k: int) -> np.ndarray:
    arr = self._shard_tokens.get(k)
    if arr is None:
      n = int(self._offsets_of(k)[-1])
      if n:
        arr = np.memmap(os.path.join(self.path, self._files[k][0]), dtype=np.int32, mode="r", shape=(n,))
      else:
        arr = np.zeros((0,), np.int32)
      self._shard_tokens[k] = arr
    return arr

  def document_tokens(self, i: int) -> np.ndarray:
    k, j = self.shard_of(int(i))
    offsets = self._offsets_of(k)
    return self._tokens_of(k)[offsets[j]:offsets[j + 1]]

  def document_length(self, i: int) -> int:
    k, j = self.shard_of(int(i))
    offsets = self._offsets_of(k)
    return int(offsets[j + 1] - offsets[j])

  @property
  def offsets(self) -> np.ndarray:
    """N+1 global token offsets (as if the shards were one array); built on first use."""
    if self._global_offsets is None and self.num_shards == 1:
      self._global_offsets = self._offsets_of(0)  # memory-mapped: one shard's offsets are the global ones
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
