"""Atomic file output and content hashes: the one owner for every artifact the stages write.

Every artifact (reports, summaries, vocabularies, corpora, configs) is written to a temporary
file beside its destination and renamed over it, so a reader never sees a half-written file
and a killed process leaves either the old file or the new one (plus, at worst, a `*.tmp`
file that the next write replaces). Temporary files and folders get the modes a plain `open`
or `os.mkdir` gives (0o666 / 0o777 less the umask), not `tempfile`'s private 0o600 / 0o700:
they become the artifacts, which are as readable as the user's umask says. Folders of work in
progress (`make_temp_dir`) are named after their process, so that a later run can remove
those of a killed one (`remove_stale_temp_dirs`). Base layer: imports only `errors` from the package.
"""
import contextlib
import dataclasses
import errno
import gzip
import hashlib
import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from typing import Any, Callable, IO, Iterator, List, Optional, Tuple

import numpy as np

from private_t5.errors import ConfigError


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
  prefix = "." + os.path.basename(path) + "."
  remove_stale_temp_files(directory, prefix, ".tmp")  # of writers of `path` that were killed
  fd, tmp = make_temp_file(directory, f"{prefix}{socket.gethostname()}-{os.getpid()}-", ".tmp")
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


def check_output_file(path: str, what: str = "--output") -> None:
  """ConfigError in one line unless `path` can be written (`check_writable_file`): checked before any work.

  `what` names the setting in the message (a flag such as "--output", or a Gin name).
  """
  try:
    check_writable_file(path)
  except OSError as e:
    where = f" ({e.filename})" if e.filename and os.path.abspath(e.filename) != os.path.abspath(path) else ""
    raise ConfigError(f"{what} {path!r} cannot be written: {e.strerror or e}{where}") from None


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


def write_bytes_atomic(path: str, data: bytes, *, before_rename: Optional[Callable[[], Any]] = None) -> str:
  """Writes `data` to `path` atomically; returns `path`.

  `before_rename` runs once `data` is on disk, just before it is renamed over `path` (to commit
  first a file that names the new content, so that `path` never appears without it); if it
  raises, `path` is left as it was.
  """
  with atomic_open(path, "wb") as f:
    f.write(data)
    if before_rename is not None:
      f.flush()
      os.fsync(f.fileno())
      before_rename()
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


# -- temporary files and folders ----------------------------------------------------------------

# A temporary folder whose owner cannot be checked (another host, an older name) is removed
# only when nothing has been written to it for this long.
STALE_TEMP_SECONDS = 24 * 3600
_TEMP_NAME_TRIES = 100


def _create_unique(directory: str, prefix: str, suffix: str, create: Callable[[str], Any]) -> Tuple[Any, str]:
  """(create(path), path) for a new `directory/<prefix><random><suffix>` (`create` fails if it exists)."""
  for _ in range(_TEMP_NAME_TRIES):
    path = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}{suffix}")
    try:
      return create(path), path
    except FileExistsError:
      continue
  raise FileExistsError(f"no free temporary name {prefix}*{suffix} in {directory}")


def make_temp_file(directory: str, prefix: str, suffix: str = "") -> Tuple[int, str]:
  """(fd, path) of a new empty file in `directory`, open for writing, mode 0o666 less the umask."""
  flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
  return _create_unique(directory, prefix, suffix, lambda path: os.open(path, flags, 0o666))


def make_temp_dir(parent: str, prefix: str) -> str:
  """A new empty folder `parent/<prefix><host>-<pid>-<random>`, mode 0o777 less the umask.

  Its name tells `remove_stale_temp_dirs` whose it is. `parent` must exist.
  """
  owner = f"{prefix}{socket.gethostname()}-{os.getpid()}-"
  return _create_unique(parent, owner, "", lambda path: os.mkdir(path, 0o777))[1]


def _temp_is_stale(path: str, name: str, prefix: str, now: float) -> bool:
  """True if the temporary file or folder `name` belongs to a dead process on this host, or is old."""
  parts = name[len(prefix):].rsplit("-", 2)  # host, pid, random suffix
  if len(parts) == 3 and parts[0] == socket.gethostname() and parts[1].isdigit():
    try:
      os.kill(int(parts[1]), 0)
    except ProcessLookupError:
      return True
    except PermissionError:
      return False  # alive, owned by another user
    else:
      return False
  try:
    return now - os.stat(path).st_mtime > STALE_TEMP_SECONDS
  except OSError:
    return False


def remove_stale_temp_dirs(parent: str, prefix: str) -> List[str]:
  """Deletes the `make_temp_dir(parent, prefix)` folders of killed processes; returns their paths.

  Stale means: named after a process on this host that no longer runs, or (owner unknown:
  another host, an old-style name) untouched for `STALE_TEMP_SECONDS`. Folders of running
  processes are never touched.
  """
  removed = []
  now = time.time()
  try:
    names = [n for n in os.listdir(parent) if n.startswith(prefix)]
  except OSError:
    return removed
  for name in names:
    path = os.path.join(parent, name)
    if os.path.isdir(path) and _temp_is_stale(path, name, prefix, now):
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
  return removed


def remove_stale_temp_files(directory: str, prefix: str, suffix: str) -> List[str]:
  """Deletes the temporary files `directory/<prefix><host>-<pid>-<random><suffix>` that killed
  processes left (as `remove_stale_temp_dirs` does for folders); returns their paths."""
  removed = []
  now = time.time()
  try:
    names = [n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(suffix)]
  except OSError:
    return removed
  for name in names:
    path = os.path.join(directory, name)
    if os.path.isfile(path) and _temp_is_stale(path, name, prefix, now):
      with contextlib.suppress(OSError):
        os.remove(path)
        removed.append(path)
  return removed
