"""The indexed token store: a corpus tokenized once, then read by random access.

Layout of a store directory (written to a temp dir, then renamed, so it is complete or absent):

  tokens-SSSSS-of-KKKKK.int32   shard S of K: its documents' tokens back to back (no EOS),
                                raw little-endian int32
  offsets-SSSSS-of-KKKKK.int64  n_S+1 offsets into that shard's tokens: the shard's local
                                document j is tokens[offsets[j]:offsets[j+1]]
  ids-*, idhash-*, users.int64, user-names.*
                                the per-document index: ids and users on disk, read on demand
                                (`store_index`): opening a store loads no string per document
  manifest.json                 format version, corpus spec, vocab path and SHA-256, counts,
                                timing, and the shard index: `shards` (file names, documents
                                and tokens per shard) and `shard_starts` (K+1 cumulative document
                                counts: global document i lives in the shard S with
                                shard_starts[S] <= i < shard_starts[S+1], at local index
                                i - shard_starts[S]), and `checksums`: the size and SHA-256
                                of every other file of the entry (`entry_checksums`)

Global document order is shard order, then the order inside each shard. The local build
writes K=1 shard; the Beam build (`store_beam.py`) writes one shard per input file, each by
the worker that tokenized it, so both give the same document i for the same corpus.

Reading: a document is a binary search over the K+1 shard starts (O(log K)), two integer
reads and one slice of that shard's `np.memmap`; a shard's files are opened on first use and
never read whole, so a process touches only the shards its documents live in (per-host reads).

Why memory-mapped flat arrays with offsets rather than array_record (TFDS/grain): DP sampling
fetches an arbitrary index set each step (Poisson sampling); with offsets a document costs no
record parsing, no per-read file handles and no new dependency; the OS page cache makes
repeated access free. array_record would give the same O(1) access but adds a dependency and a
serialization layer for what are just int32 runs.

Format versions: version 3 is the layout above. Versions 2 (the same shards, with every id and
user in one `documents.json`) and 1 (one `tokens.int32` + `offsets.int64`, no shard index) still
open, their `documents.json` read whole (about 180 bytes a document); the cache key includes the
format version, so the stages build a version-3 store beside an old cached one instead of reusing
it (delete old cache entries to reclaim the space).

Integrity: opening an entry compares each file's size with its `checksums` record (one `stat`
a file), so a truncated or missing file is one DataError naming it (`DamagedStoreError`), never
a crash while training reads it; `private-t5 store --verify` also compares the SHA-256 of every
file (read in blocks), and `private-t5 store` rebuilds a damaged entry. An entry written before
the record existed is checked on what its index implies (offsets files of the right size, token
files as long as their last offset).

Stores are cached by (corpus spec and its files' size/mtime, reader options, vocab file SHA-256)
under `cache_dir` and reused by later runs; `private-t5 store` builds the same entry ahead of
training, locally or on Apache Beam.
"""
import array
import bisect
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

from private_t5 import progress as progress_lib
from private_t5 import vocabulary as vocab_lib
from private_t5.data import corpora
from private_t5.data import store_index
from private_t5.documents import Document
from private_t5.errors import ConfigError, DataError
from private_t5.io import (STALE_TEMP_SECONDS, atomic_open, file_sha256, make_temp_dir, remove_stale_temp_dirs,
                           write_json_atomic)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
JSON_INDEX_FORMAT_VERSION = 2   # shards, with every id and user in documents.json
LEGACY_FORMAT_VERSION = 1
TOKENS_FILE = "tokens.int32"    # version 1 (single file)
OFFSETS_FILE = "offsets.int64"  # version 1 (single file)
DOCUMENTS_FILE = "documents.json"  # versions 1 and 2
MANIFEST_FILE = "manifest.json"
_ENCODE_CHUNK = 512  # documents per batched SentencePiece call
CHECKSUMS_KEY = "checksums"  # manifest: file name -> {"size", "sha256"} of every other file of an entry
_HASH_BLOCK = 1 << 22  # bytes read at a time when a file is hashed


def shard_file_names(index: int, num_shards: int):
  """(tokens file, offsets file) of shard `index` of `num_shards`."""
  suffix = f"{index:05d}-of-{num_shards:05d}"
  return f"tokens-{suffix}.int32", f"offsets-{suffix}.int64"


def default_cache_dir() -> str:
  """$PRIVATE_T5_CACHE, else ~/.cache/private_t5/stores."""
  env = os.environ.get("PRIVATE_T5_CACHE")
  if env:
    return os.path.join(env, "stores")
  return os.path.join(os.path.expanduser("~"), ".cache", "private_t5", "stores")


def _files_digest(entries) -> str:
  return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _corpus_fingerprint(spec: str) -> Dict[str, object]:
  """Size and mtime of the corpus files (so that an edited corpus is re-tokenized)."""
  if spec.startswith(corpora.BUILTIN_PREFIX):
    return {"python": sys.version}
  if spec.startswith(corpora.TFDS_PREFIX):
    return {}
  if "://" in spec:  # a remote pattern (gs://...): sizes and times from Beam's file systems
    # Lazy: Apache Beam is optional (`data.beam_io.import_beam`).
    from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
    found = sorted((m.path, m.size_in_bytes, m.last_updated_in_seconds)
                   for r in FileSystems.match([spec]) for m in r.metadata_list)
    return {"pattern": spec, "files": _files_digest(found)}
  if corpora.is_file_pattern(spec):
    entries = []
    for p in corpora.match_pattern(spec):
      st = os.stat(p)
      entries.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    return {"pattern": os.path.abspath(os.path.expanduser(spec)), "files": _files_digest(entries)}
  path = os.path.abspath(os.path.expanduser(spec))
  if not os.path.exists(path):
    raise DataError(f"corpus not found: {spec}")
  if os.path.isdir(path):
    entries = []
    for root, dirs, names in os.walk(path):
      dirs.sort()
      for n in sorted(names):
        if n.endswith(".txt"):
          st = os.stat(os.path.join(root, n))
          entries.append([os.path.relpath(os.path.join(root, n), path), st.st_size, st.st_mtime_ns])
    return {"path": path, "files": _files_digest(entries)}
  st = os.stat(path)
  return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class DamagedStoreError(DataError):
  """A cache entry whose files no longer match what was written: a file missing, truncated or altered.

  `reason` names the file (and its expected and actual size); the message says how to rebuild it.
  """

  def __init__(self, path: str, reason: str):
    self.path, self.reason = path, reason
    super().__init__(f"store {path} is damaged: {reason}; run `private-t5 store` with the same settings "
                     f"to rebuild it (or delete that folder)")


def file_checksum(path: str) -> Dict[str, object]:
  """{"size", "sha256"} of a file, read in blocks (never held whole)."""
  h, size = hashlib.sha256(), 0
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(_HASH_BLOCK), b""):
      h.update(block)
      size += len(block)
  return {"size": size, "sha256": h.hexdigest()}


def entry_checksums(path: str, known: Optional[Mapping[str, Mapping[str, object]]] = None
                    ) -> Dict[str, Dict[str, object]]:
  """The manifest's `checksums` record of an entry folder: size and SHA-256 of each of its files
  (the manifest and hidden temporary files aside). Files in `known` (hashed while they were
  written) keep their record when their size still matches; the others are read once, in blocks."""
  out = {}
  for name in sorted(os.listdir(path)):
    full = os.path.join(path, name)
    if name == MANIFEST_FILE or name.startswith(".") or not os.path.isfile(full):
      continue
    rec = (known or {}).get(name)
    if rec is not None and int(rec["size"]) == os.path.getsize(full):
      out[name] = {"size": int(rec["size"]), "sha256": str(rec["sha256"])}
    else:
      out[name] = file_checksum(full)
  return out


def check_entry(path: str, manifest: Mapping[str, object], checksum: bool = False) -> bool:
  """Compares the files of an entry with its `checksums` record: each file's size (one `stat`),
  and with `checksum` its SHA-256 (every file read, in blocks). Returns False for an entry written
  without the record (its caller checks what its index implies).

  Raises:
    DamagedStoreError: a recorded file is missing, of another size, or of another SHA-256.
  """
  record = manifest.get(CHECKSUMS_KEY)
  if not isinstance(record, dict):
    return False
  for name, rec in sorted(record.items()):
    try:
      size = os.path.getsize(os.path.join(path, name))
    except OSError:
      raise DamagedStoreError(path, f"{name} is missing (expected {int(rec['size'])} bytes)") from None
    if size != int(rec["size"]):
      raise DamagedStoreError(path, f"{name} holds {size} bytes, expected {int(rec['size'])}")
  if checksum:
    for name, rec in sorted(record.items()):
      if file_checksum(os.path.join(path, name))["sha256"] != rec["sha256"]:
        raise DamagedStoreError(path, f"{name} has the expected size ({int(rec['size'])} bytes) but not "
                                      f"the SHA-256 recorded when it was built")
  return True


def check_tokens_file(path: str, tokens_file: str, offsets_file: str, itemsize: int = 4) -> None:
  """An entry without a `checksums` record: the tokens file must be as long as its offsets'
  last value says (one 8-byte read).

  Raises:
    DamagedStoreError: the tokens file is missing or of another size.
  """
  offsets_path = os.path.join(path, offsets_file)
  try:
    n = os.path.getsize(offsets_path) // 8
    last = int(np.fromfile(offsets_path, dtype="<i8", count=1, offset=8 * (n - 1))[0]) if n else 0
  except (OSError, ValueError, IndexError):
    raise DamagedStoreError(path, f"{offsets_file} cannot be read") from None
  expected = last * itemsize
  try:
    size = os.path.getsize(os.path.join(path, tokens_file))
  except OSError:
    if not expected:
      return
    raise DamagedStoreError(path, f"{tokens_file} is missing (expected {expected} bytes)") from None
  if size != expected:
    raise DamagedStoreError(path, f"{tokens_file} holds {size} bytes, expected {expected}")


def discard_entry(cache_dir: str, final: str) -> None:
  """Removes a (damaged) cache entry: renamed to a build directory first, so that a killed removal
  leaves only what `remove_stale_builds` deletes, never a half-deleted entry under its key."""
  aside = make_temp_dir(cache_dir, BUILDING_PREFIX)
  try:
    os.rename(final, aside)  # onto the empty folder
  except FileNotFoundError:
    pass  # removed by another process meanwhile
  except OSError as e:
    os.rmdir(aside)
    raise DataError(f"cannot remove the damaged store {final}: {e.strerror or e}") from None
  shutil.rmtree(aside, ignore_errors=True)


def open_cached(cache_dir: str, final: str, opener: Callable[..., object], verify: bool = False,
                rebuild_damaged: bool = False):
  """(the cached entry `final` opened by `opener(final, verify=...)`, marked `reused`, or None when
  there is none; the reason it was discarded, or None).

  A damaged entry (`DamagedStoreError`) is refused, or with `rebuild_damaged` removed (one log line)
  so that the caller builds it again.
  """
  if not os.path.isfile(os.path.join(final, MANIFEST_FILE)):
    return None, None
  try:
    store = opener(final, verify=verify)
  except DamagedStoreError as e:
    if not rebuild_damaged:
      raise
    logger.warning("[store] rebuilding the damaged entry %s: %s", final, e.reason)
    discard_entry(cache_dir, final)
    return None, e.reason
  if verify and CHECKSUMS_KEY not in store.manifest:
    logger.warning("[store] %s was built without a checksums record: only the sizes its index implies were "
                   "checked (delete it and run `private-t5 store` again to get one)", final)
  store.reused = True
  return store, None


_ENTRY_NAME = re.compile(r"^(seqio-)?[0-9a-f]{24}$")


def check_cache_dir(cache_dir: str) -> None:
  """ConfigError when `cache_dir` is a cache entry or lies inside one (a store would be built
  among another store's files)."""
  path = os.path.abspath(os.path.expanduser(cache_dir))
  while True:
    if _ENTRY_NAME.match(os.path.basename(path)) and os.path.isfile(os.path.join(path, MANIFEST_FILE)):
      raise ConfigError(f"store cache_dir {cache_dir!r} is inside the store {path}; give the cache folder "
                        f"that holds it ({os.path.dirname(path)})")
    parent = os.path.dirname(path)
    if parent == path:
      return
    path = parent


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


def tokens_digest(path: str, manifest: Dict[str, object],
                  checksums: Optional[Dict[str, Dict[str, object]]] = None) -> str:
  """SHA-256 of what training reads from a store: its token stream, each document's length and
  its users, whatever the sharding and wherever the corpus lay (a corpus moved to another path
  gives the same digest). Written into the manifest when the store is built. `checksums`, when
  given, receives each token file's own record (`file_checksum`) from the same read."""
  h = hashlib.sha256()
  for shard in manifest["shards"]:
    own, size = hashlib.sha256(), 0
    with open(os.path.join(path, shard["tokens"]), "rb") as f:
      for chunk in iter(lambda: f.read(_HASH_BLOCK), b""):
        h.update(chunk)
        own.update(chunk)
        size += len(chunk)
    if checksums is not None:
      checksums[shard["tokens"]] = {"size": size, "sha256": own.hexdigest()}
  for shard in manifest["shards"]:
    h.update(np.diff(np.fromfile(os.path.join(path, shard["offsets"]), dtype=np.int64)).astype("<i8").tobytes())
  users = None
  if manifest.get("num_users") is not None:
    users = store_index.UserColumn(*store_index.user_columns(path, int(manifest["num_users"])))
  store_index.users_json_digest(h, users)  # the same bytes as the JSON list of an older store
  return h.hexdigest()


def store_key(spec: str, vocab_sha256: str, reader_options: Dict[str, object]) -> str:
  payload = {"format_version": FORMAT_VERSION, "spec": spec, "corpus": _corpus_fingerprint(spec),
             "vocab_sha256": vocab_sha256, "reader": reader_options}
  return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _sentencepiece_processor(vocab_path: str):
  """The vocabulary with its sentinels and its processor (validated: T5 layout, real model)."""
  vocab = vocab_lib.load_vocabulary(vocab_path)
  return vocab, vocab_lib.sentencepiece_processor(vocab)


BUILDING_PREFIX = ".building-"
# A build directory whose owner cannot be checked (another host, an older name) is removed
# only when nothing has been written to it for this long.
STALE_BUILD_SECONDS = STALE_TEMP_SECONDS


def remove_stale_builds(cache_dir: str) -> List[str]:
  """Deletes unfinished cache builds of killed processes in `cache_dir`; returns their paths.

  Stale means: named after a process on this host that no longer runs, or (owner unknown:
  another host, an old-style name) untouched for `STALE_BUILD_SECONDS`. Builds in progress
  are never touched.
  """
  return remove_stale_temp_dirs(cache_dir, BUILDING_PREFIX)


def build_store(corpus: str, vocab_path: str, *, cache_dir: Optional[str] = None, text_field: str = "text",
                id_field: str = "id", user_field: Optional[str] = None, errors: str = "strict",
                max_documents: Optional[int] = None, data_dir: Optional[str] = None,
                num_threads: Optional[int] = None, progress: bool = True, verify: bool = False,
                rebuild_damaged: bool = False) -> DocumentStore:
  """Tokenizes `corpus` with `vocab_path` into a cached store (or opens the cached one).

  The local build writes one shard. While building, a progress bar (documents) on a terminal
  and a summary log line, unless `progress=False`. A cached entry is checked as it is opened
  (`DocumentStore`; `verify`: the SHA-256 of its files too); a damaged one is refused, or with
  `rebuild_damaged` built again (the store's `rebuilt` says why).

  Raises:
    DataError: bad corpus or vocabulary, duplicate document ids; nothing is left behind.
    DamagedStoreError: the cached entry is damaged (without `rebuild_damaged`).
  """
  reader_options = reader_options_of(text_field=text_field, id_field=id_field, user_field=user_field,
                                     errors=errors, max_documents=max_documents, data_dir=data_dir)
  target = cache_target(corpus, vocab_path, reader_options, cache_dir)
  store = target.open(verify=verify, rebuild_damaged=rebuild_damaged)
  if store is not None:
    return store
  vocab, proc = _sentencepiece_processor(vocab_path)

  def write(tmp):
    return _write_store(tmp, corpus, proc, reader_options, num_threads, progress)

  return target.build(write, vocab)


def reader_options_of(*, text_field: str = "text", id_field: str = "id", user_field: Optional[str] = None,
                      errors: str = "strict", max_documents: Optional[int] = None,
                      data_dir: Optional[str] = None) -> Dict[str, object]:
  """The corpus reader options, as they enter the cache key."""
  return {"text_field": text_field, "id_field": id_field, "user_field": user_field,
          "errors": errors, "max_documents": max_documents, "data_dir": data_dir}


class CacheTarget:
  """Where the store of (corpus, vocabulary, reader options) lives in a cache, and its build."""

  def __init__(self, corpus: str, vocab_path: str, vocab_sha256: str, reader_options, cache_dir: str):
    self.corpus, self.vocab_path, self.vocab_sha256 = corpus, vocab_path, vocab_sha256
    self.reader_options, self.cache_dir = reader_options, cache_dir
    self.final = os.path.join(cache_dir, store_key(corpus, vocab_sha256, reader_options))
    self.rebuilt: Optional[str] = None

  def exists(self) -> bool:
    return os.path.isfile(os.path.join(self.final, MANIFEST_FILE))

  def open(self, verify: bool = False, rebuild_damaged: bool = False) -> Optional[DocumentStore]:
    """The cached store (`open_cached`), or None when it must be built (absent, or damaged and removed)."""
    store, self.rebuilt = open_cached(self.cache_dir, self.final, DocumentStore, verify, rebuild_damaged)
    return store

  def build(self, write, vocab) -> DocumentStore:
    """Runs `write(tmp_dir) -> manifest` in a fresh build directory, then renames it into place
    (`build_in_cache`).

    Raises:
      DataError: `cache_dir` cannot be created or written.
    """
    def manifest(tmp):
      m = write(tmp)
      checksums: Dict[str, Dict[str, object]] = {}
      m.update(vocab_path=os.path.abspath(self.vocab_path), vocab_sha256=self.vocab_sha256,
               vocab_size=int(vocab.vocab_size), tokens_sha256=tokens_digest(tmp, m, checksums))
      m[CHECKSUMS_KEY] = checksums  # the token files' records, from the digest's read
      return m

    build_in_cache(self.cache_dir, self.final, manifest)
    store = DocumentStore(self.final)
    store.rebuilt = self.rebuilt
    return store


def build_in_cache(cache_dir: str, final: str, write: Callable[[str], Dict[str, object]]) -> None:
  """Builds a cache entry: `write(tmp_dir) -> manifest` in a fresh build directory of `cache_dir`,
  the manifest written last, then the directory renamed to `final` (complete or absent).

  The manifest gets the `checksums` record of every file of the entry (`entry_checksums`: those
  the manifest already records, hashed while written, are kept; the others are read once).

  A failed (or interrupted) build leaves the cache as it was: its build directory goes, and so do
  the cache folders it created (when still empty). A build that lost a race to another process
  building the same entry keeps the winner's.

  Raises:
    DataError: `cache_dir` cannot be created or written.
  """
  created = _missing_folders(cache_dir)
  try:
    tmp = _make_build_dir(cache_dir)
    try:
      manifest = write(tmp)
      manifest[CHECKSUMS_KEY] = entry_checksums(tmp, manifest.get(CHECKSUMS_KEY))
      _write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
      try:
        os.rename(tmp, final)
      except OSError:
        if not os.path.isfile(os.path.join(final, MANIFEST_FILE)):  # lost a race: keep the winner's
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  except BaseException:
    _remove_empty_folders(created)
    raise


def _make_build_dir(cache_dir: str) -> str:
  """A fresh build directory in the cache (created if need be), after removing stale ones."""
  try:
    os.makedirs(cache_dir, exist_ok=True)
    remove_stale_builds(cache_dir)
    return make_temp_dir(cache_dir, BUILDING_PREFIX)
  except OSError as e:
    file = _file_in_the_way(cache_dir)
    reason = f"{file!r} is a file, not a folder" if file else (e.strerror or e)
    raise DataError(f"store cache_dir {cache_dir!r} is not writable: {reason}") from None


def _file_in_the_way(path: str) -> Optional[str]:
  """`path` or the nearest of its parents that exists, if that is not a folder; else None."""
  path = os.path.abspath(path)
  while not os.path.lexists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return None if os.path.isdir(path) else path


def _missing_folders(path: str) -> List[str]:
  """`path` and those of its parents that do not exist yet, deepest first."""
  missing = []
  while path and not os.path.exists(path) and os.path.dirname(path) != path:
    missing.append(path)
    path = os.path.dirname(path)
  return missing


def _remove_empty_folders(folders: Sequence[str]) -> None:
  """Removes `folders` (deepest first) while they are empty: what a failed build created."""
  for folder in folders:
    try:
      os.rmdir(folder)
    except FileNotFoundError:
      continue  # never created
    except OSError:
      return


def cache_target(corpus: str, vocab_path: str, reader_options, cache_dir: Optional[str] = None) -> CacheTarget:
  """The cache entry of a store (checks that the vocabulary file exists)."""
  if not os.path.isfile(vocab_path):
    raise DataError(f"vocabulary file not found: {vocab_path}")
  check_cache_dir(cache_dir or default_cache_dir())
  return CacheTarget(corpus, vocab_path, file_sha256(vocab_path), reader_options,
                     os.path.abspath(cache_dir or default_cache_dir()))


def load_processor(vocab_path: str):
  """(vocabulary, SentencePieceProcessor) exactly as the store build tokenizes with them."""
  return _sentencepiece_processor(vocab_path)


def _write_json(path: str, obj) -> None:
  write_json_atomic(path, obj, indent=None, sort_keys=False)


class ShardWriter:
  """Writes one shard (tokens + offsets, and its index: ids, id hashes, users) from documents,
  tokenizing them in batches.

  Files are written through `atomic_open`, so a shard file is complete or absent (a retried
  Beam bundle overwrites it whole). Memory: one batch of texts, the offsets and the shard's
  distinct users; no string per document.
  """

  def __init__(self, out_dir: str, index: int, num_shards: int, proc, num_threads: int = 1,
               with_users: bool = False):
    self.proc, self.num_threads = proc, max(1, int(num_threads))
    self.tokens_file, self.offsets_file = shard_file_names(index, num_shards)
    self._out_dir = out_dir
    self.index = store_index.IndexWriter(out_dir, index, num_shards, with_users)
    self.offsets = array.array("q", [0])  # 8 bytes a document
    self.text_bytes = 0
    self._batch: List[str] = []
    self._ctx = atomic_open(os.path.join(out_dir, self.tokens_file), "wb")
    self._f = self._ctx.__enter__()
    self._open = True

  @property
  def documents(self) -> int:
    return self.index.documents

  def add(self, doc: Document) -> int:
    """Adds a document; returns how many documents were tokenized by this call (0 or a batch)."""
    self.index.add(doc.id, doc.user)
    self._batch.append(doc.text)
    if len(self._batch) == _ENCODE_CHUNK:
      return self._flush()
    return 0

  def _flush(self) -> int:
    texts = self._batch
    # SentencePiece's batched encode tokenizes on `num_threads` native threads.
    for tokens in self.proc.encode(texts, num_threads=self.num_threads):
      arr = np.asarray(tokens, dtype=np.int32)
      arr.tofile(self._f)
      self.offsets.append(self.offsets[-1] + len(arr))
    self.text_bytes += sum(len(t.encode("utf-8")) for t in texts)
    n, self._batch = len(self._batch), []
    return n

  def close(self) -> Dict[str, object]:
    """Finishes every file; returns the shard's entry of the manifest index."""
    self._flush()
    self._open = False
    self._ctx.__exit__(None, None, None)
    with atomic_open(os.path.join(self._out_dir, self.offsets_file), "wb") as f:
      np.frombuffer(self.offsets, dtype=np.int64).tofile(f)
    return {"tokens": self.tokens_file, "offsets": self.offsets_file, "documents": self.documents,
            "num_tokens": int(self.offsets[-1]), **self.index.close()}

  def abort(self) -> None:
    """Removes the unfinished files (after an error)."""
    self.index.abort()
    if self._open:
      self._open = False
      error = DataError("shard aborted")
      try:
        self._ctx.__exit__(DataError, error, None)
      except DataError:
        pass


def finish_store(out_dir: str, corpus: str, reader_options, shards: List[Dict[str, object]],
                 stats: Dict[str, int], start: float, sources: Optional[Sequence[str]] = None) -> Dict[str, object]:
  """Checks the ids over all shards, merges the users; returns the manifest.

  Raises:
    DataError: a document id used twice (in one shard or two), or an empty corpus.
  """
  num_documents = sum(int(sh["documents"]) for sh in shards)
  if not num_documents:
    raise DataError(f"corpus {corpus} is empty ({stats.get('blank_skipped', 0)} blank documents skipped)")
  store_index.check_unique_ids(out_dir, shards, corpus, sources)
  has_users = reader_options["user_field"] is not None
  num_users = store_index.merge_users(out_dir, shards) if has_users else None
  starts = [0]
  for sh in shards:
    starts.append(starts[-1] + int(sh["documents"]))
  seconds = time.time() - start
  return {
      "format_version": FORMAT_VERSION,
      "corpus": corpus,
      "reader": reader_options,
      "num_documents": num_documents,
      "num_tokens": int(sum(int(sh["num_tokens"]) for sh in shards)),
      "num_users": num_users,
      "blank_skipped": int(stats.get("blank_skipped", 0)),
      "replaced_lines": int(stats.get("replaced_lines", 0)),
      "characters": int(stats.get("characters", 0)),
      "text_bytes": int(stats.get("text_bytes", 0)),
      "num_shards": len(shards),
      "shards": list(shards),
      "shard_starts": starts,
      "build_seconds": round(seconds, 3),
      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }


def _write_store(out_dir, corpus, proc, reader_options, num_threads, progress) -> Dict[str, object]:
  start = time.time()
  stats = corpora.CorpusStats()
  docs = corpora.iter_documents(corpus, stats=stats, **reader_options)
  bar = progress_lib.bar(desc="[store] tokenizing", unit="docs", disable=not (progress and progress_lib.enabled()))
  writer = ShardWriter(out_dir, 0, 1, proc, num_threads or os.cpu_count() or 1,
                       with_users=reader_options["user_field"] is not None)
  try:
    for doc in docs:
      bar.update(writer.add(doc))
    shard = writer.close()
  except BaseException:
    writer.abort()
    raise
  bar.close()
  if progress:
    logger.info("[store] %s: %d documents, %d tokens in %.1fs (%d blank skipped)", corpus, writer.documents,
                shard["num_tokens"], time.time() - start, stats.blank_skipped)
  counts = {"blank_skipped": stats.blank_skipped, "replaced_lines": stats.replaced_lines,
            "characters": stats.characters, "text_bytes": writer.text_bytes}
  return finish_store(out_dir, corpus, reader_options, [shard], counts, start)
