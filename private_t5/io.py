"""Atomic file output and content hashes: the one owner for every artifact the stages write.

Every artifact (reports, summaries, vocabularies, corpora, configs) is written to a temporary
file beside its destination and renamed over it, so a reader never sees a half-written file
and a killed process leaves either the old file or the new one (plus, at worst, a `*.tmp`
file that the next write replaces). Base layer: imports nothing from the package.
"""
import contextlib
import dataclasses
import errno
import gzip
import hashlib
import json
import os
import tempfile
from typing import Any, IO, Iterator

import numpy as np


def json_default(x):
  """`json.dump`'s `default`: numpy scalars/arrays as numbers/lists, dataclasses as dicts, else str."""
  if isinstance(x, np.integer):
    return int(x)
  if isinstance(x, np.floating):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  return str(x)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **kwargs) -> Iterator[IO]:
  """Opens a temp file beside `path`; on a clean exit renames it over `path`.

  On any exception the temp file is removed and `path` is left as it was.
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_open writes only ('w' or 'wb'), got {mode!r}")
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                             suffix=".tmp")
  try:
    with os.fdopen(fd, mode, **kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def check_writable_file(path: str) -> None:
  """Raises OSError unless `atomic_open` could write `path`; creates nothing.

  `path` must not be a folder, and its nearest existing ancestor must be a folder in which this
  process can create a file (the missing folders between are created by the write).
  """
  path = os.path.abspath(path)
  if os.path.isdir(path):
    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
  folder = os.path.dirname(path)
  while not os.path.exists(folder):
    folder = os.path.dirname(folder)
  if not os.path.isdir(folder):
    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), folder)
  try:
    with tempfile.TemporaryFile(dir=folder):  # an unnamed file where the OS supports it
      pass
  except OSError as e:
    raise type(e)(e.errno, e.strerror, folder) from None


@contextlib.contextmanager
def atomic_open_text(path: str) -> Iterator[IO[str]]:
  """`atomic_open` for UTF-8 text, gzip-compressed when `path` ends in `.gz`."""
  if not path.endswith(".gz"):
    with atomic_open(path, "w", encoding="utf-8") as f:
      yield f
    return
  with atomic_open(path, "wb") as raw, gzip.open(raw, "wt", encoding="utf-8") as f:
    yield f


def write_text_atomic(path: str, text: str) -> str:
  """Writes `text` (UTF-8) to `path` atomically; returns `path`."""
  with atomic_open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path


def write_bytes_atomic(path: str, data: bytes) -> str:
  """Writes `data` to `path` atomically; returns `path`."""
  with atomic_open(path, "wb") as f:
    f.write(data)
  return path


def write_json_atomic(path: str, obj: Any, *, indent: int = 2, sort_keys: bool = True) -> str:
  """Writes `obj` as JSON (numpy scalars/arrays and dataclasses allowed) atomically."""
  with atomic_open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=indent, sort_keys=sort_keys, default=json_default)
    f.write("\n")
  return path


def file_sha256(path: str) -> str:
  """SHA-256 hex digest of a file's bytes (read in 1 MiB blocks)."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()
