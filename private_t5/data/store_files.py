"""The files of a token store entry: their names, format versions and integrity.

What `store.py`'s docstring describes on disk: the names of an entry's files (`shard_file_names`),
the format versions that still open, the `checksums` record of the manifest (size and SHA-256 of
every other file, `entry_checksums`) and the checks made when an entry is opened (`check_entry`,
`check_tokens_file`: a damaged entry is one `DamagedStoreError`); the digest of what training
reads from an entry is `store_index.tokens_digest`.

Opening an entry compares every file's size with the record, and the SHA-256 of every file but
the token files (`*.int32`, the bulk of an entry: the offsets and the index, a few percent of it);
the token files' SHA-256 is compared on request (`private-t5 store --verify`).

Reading: every file a reader memory-maps goes through `MappedFile`, which compares the file's size
with what the reader expects before mapping it, and whose `check` (one `fstat` of the file mapped)
finds a file that shrank later, while a run reads it: the reader checks before each read, and
raises `DamagedStoreError`. A file truncated between that check and the read makes the read fault
(SIGBUS, which Python cannot turn into an exception: a Python handler returns to the faulting
instruction, which faults again, and the process hangs). For that window a last-resort handler is
installed, through ctypes, at the first mapping: it looks for a mapped store file now shorter than
mapped, and if it finds one writes one line naming it to stderr and exits with status 2 (the
status of the command line's other one-line errors); a bus error of anything else is left to the
handler that was there before (the default: the process dies). Copying the files into memory
instead would avoid the fault, but a store is as large as its corpus, and copying only small ones
would leave unguarded the runs where it matters.
"""
import ctypes
import hashlib
import mmap
import os
import signal
import threading
import weakref
from typing import Dict, Mapping, Optional

import numpy as np

from private_t5.errors import DataError

FORMAT_VERSION = 3
JSON_INDEX_FORMAT_VERSION = 2   # shards, with every id and user in documents.json
LEGACY_FORMAT_VERSION = 1
TOKENS_FILE = "tokens.int32"    # version 1 (single file)
OFFSETS_FILE = "offsets.int64"  # version 1 (single file)
DOCUMENTS_FILE = "documents.json"  # versions 1 and 2
MANIFEST_FILE = "manifest.json"
CHECKSUMS_KEY = "checksums"  # manifest: file name -> {"size", "sha256"} of every other file of an entry
TOKENS_SUFFIX = ".int32"  # the token files (documents' or examples' tokens), the bulk of an entry
HASH_BLOCK = 1 << 22  # bytes read at a time when a file is hashed


def shard_file_names(index: int, num_shards: int):
  """(tokens file, offsets file) of shard `index` of `num_shards`."""
  suffix = f"{index:05d}-of-{num_shards:05d}"
  return f"tokens-{suffix}.int32", f"offsets-{suffix}.int64"


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
    for block in iter(lambda: f.read(HASH_BLOCK), b""):
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


def is_tokens_file(name: str) -> bool:
  """Whether `name` is one of an entry's token files (`TOKENS_SUFFIX`), whose SHA-256 is compared
  only on request; every other file's (offsets, index) is compared whenever an entry is opened."""
  return name.endswith(TOKENS_SUFFIX)


def check_entry(path: str, manifest: Mapping[str, object], checksum: bool = False,
                index_checksum: bool = True) -> bool:
  """Compares the files of an entry with its `checksums` record: each file's size (one `stat`),
  with `index_checksum` the SHA-256 of every file but the token files (`is_tokens_file`: the
  offsets and the index, read in blocks), and with `checksum` the token files' SHA-256 too. Returns
  False for an entry written without the record (its caller checks what its index implies).

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
  for name, rec in sorted(record.items(), key=lambda item: (is_tokens_file(item[0]), item[0])):
    if not (checksum if is_tokens_file(name) else checksum or index_checksum):
      continue
    try:
      digest = file_checksum(os.path.join(path, name))["sha256"]
    except OSError as e:
      raise DamagedStoreError(path, f"{name} cannot be read ({e.strerror or e})") from None
    if digest != rec["sha256"]:
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


class MappedFile:
  """A file of a store entry memory-mapped read-only (`array`), once its size matched what its
  reader expects (`size`; None: the size it has now). `check` finds it changed later: one `fstat`
  of the descriptor the mapping keeps (the file mapped, whatever its path names by then). While it
  is mapped, the bus-error guard of the module docstring knows it.

  Raises:
    DamagedStoreError: the file is missing, or not of the expected size.
  """

  def __init__(self, path: str, dtype, size: Optional[int] = None, random_access: bool = False):
    self.entry, self.name = os.path.split(path)
    self.random_access = random_access
    itemsize = np.dtype(dtype).itemsize
    try:
      f = open(path, "rb")
    except OSError:
      expected = "" if size is None else f" (expected {int(size)} bytes)"
      raise DamagedStoreError(self.entry, f"{self.name} is missing{expected}") from None
    with f:
      actual = os.fstat(f.fileno()).st_size
      self.size = actual if size is None else int(size)
      if actual != self.size:
        raise DamagedStoreError(self.entry, f"{self.name} holds {actual} bytes, expected {self.size}")
      if actual % itemsize:
        raise DamagedStoreError(self.entry, f"{self.name} holds {actual} bytes, not a whole number of "
                                            f"{itemsize}-byte values")
      self._map = mmap.mmap(f.fileno(), actual, access=mmap.ACCESS_READ) if actual else None
    if self._map is not None and random_access:
      # Advised for random reads (no read-ahead): DP sampling reads scattered examples, and
      # read-ahead would fetch (and keep resident) the pages around each one.
      try:
        self._map.madvise(mmap.MADV_RANDOM)
      except (AttributeError, OSError, ValueError):
        pass  # a platform without madvise: read-ahead stays on
    if self._map is None:  # nothing to map
      self.array = np.zeros((0,), dtype)
      return
    self.array = np.frombuffer(self._map, dtype=dtype)
    with _GUARD_LOCK:
      _install_guard()
      _WATCHED[self._map] = (self.entry, self.name, self.size)

  def __reduce__(self):  # pickled (to another process): mapped again there, its size checked again
    return MappedFile, (os.path.join(self.entry, self.name), self.array.dtype, self.size, self.random_access)

  def check(self) -> None:
    """Raises DamagedStoreError when the file no longer has the size it was mapped with."""
    if self._map is not None:
      actual = self._map.size()
      if actual != self.size:
        raise DamagedStoreError(self.entry, f"{self.name} holds {actual} bytes, expected {self.size} "
                                            "(it changed while this run read it)")


# The mappings the bus-error guard looks at, each until it is unmapped (no array reads it any more):
# mmap -> (entry, file name, mapped size).
_WATCHED = weakref.WeakKeyDictionary()
_GUARD_LOCK = threading.Lock()
_guard: Optional[tuple] = None  # (the ctypes handler, the handler it replaced, libc's signal) once installed


def _install_guard() -> None:
  """Installs `_on_bus_error` as the process's SIGBUS handler (once; where ctypes can: not on
  Windows, which has no SIGBUS)."""
  global _guard
  if _guard is not None or not hasattr(signal, "SIGBUS"):
    return
  _guard = ()  # tried: not again, whatever happens below
  try:
    set_handler = ctypes.CDLL(None).signal
    set_handler.restype, set_handler.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p]
    handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_bus_error)
    previous = set_handler(signal.SIGBUS, ctypes.cast(handler, ctypes.c_void_p))
  except (ImportError, OSError, AttributeError, TypeError):
    return
  if previous != ctypes.c_void_p(-1).value:  # SIG_ERR: not installed
    _guard = (handler, previous, set_handler)


def _on_bus_error(signum: int) -> None:
  """The SIGBUS handler: for a watched file now shorter than mapped, one line naming it on stderr
  and exit status 2; otherwise the handler it replaced is put back, and takes the fault when the
  faulting read runs again."""
  try:
    for mapped, (entry, name, size) in list(_WATCHED.items()):
      try:
        actual = mapped.size()
      except (OSError, ValueError):
        continue
      if actual < size:
        error = DamagedStoreError(entry, f"{name} shrank to {actual} bytes (from {size}) while this run read it")
        os.write(2, f"error: {error}\n".encode("utf-8", "replace"))
        os._exit(2)  # pylint: disable=protected-access
  except BaseException:  # pylint: disable=broad-except  # back to the read unchanged, it would fault forever
    pass
  _, previous, set_handler = _guard
  set_handler(signum, previous)
