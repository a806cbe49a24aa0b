"""One run per model directory: an exclusive lock on MODEL_DIR/.lock for the whole run.

Two processes training into the same MODEL_DIR would overwrite each other's checkpoints and
privacy report. The first run takes `fcntl.flock(LOCK_EX)` on `MODEL_DIR/.lock` and writes its
PID and host name into it; a second run fails at once with a `CheckpointError` naming the
holder. The kernel drops a flock when the holding process exits in any way (also SIGKILL), so a
lock of a dead process never blocks: the `.lock` file left behind is only a note.

Within one process the lock is re-entrant (counted): opening the same directory twice in one
process (a resumed run in a test, a notebook) does not lock itself out.
"""
import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from typing import Dict, Iterator, Tuple

from private_t5.errors import CheckpointError

LOCK_FILENAME = ".lock"

_HELD: Dict[str, Tuple[int, int]] = {}  # realpath of the lock file -> (fd, count)
_MUTEX = threading.Lock()


def _holder(fd: int) -> str:
  try:
    info = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
  except (OSError, ValueError):
    info = {}
  return f"PID {info.get('pid', '?')} on host {info.get('host', '?')}"


def acquire(model_dir: str) -> str:
  """Takes the lock of `model_dir` (created if missing); returns the key for `release`.

  Raises:
    CheckpointError: another process holds the lock (the message names its PID and host), or
      the lock file cannot be created.
  """
  try:
    os.makedirs(model_dir, exist_ok=True)
    key = os.path.realpath(os.path.join(model_dir, LOCK_FILENAME))
  except OSError as e:
    raise CheckpointError(f"model_dir {model_dir!r} is not writable: {e.strerror or e}") from e
  with _MUTEX:
    if key in _HELD:
      fd, count = _HELD[key]
      _HELD[key] = (fd, count + 1)
      return key
    try:
      fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise CheckpointError(f"model_dir {model_dir!r} is not writable: {e.strerror or e}") from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = _holder(fd)
      os.close(fd)
      raise CheckpointError(
          f"model_dir {model_dir!r} is in use by another run ({holder}); wait for it to finish "
          "or use another model_dir") from None
    note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, note.encode("utf-8") + b"\n", 0)
    _HELD[key] = (fd, 1)
    return key


def release(key: str) -> None:
  """Undoes one `acquire`; the last one unlocks (the `.lock` file stays, unlocked)."""
  with _MUTEX:
    if key not in _HELD:
      return
    fd, count = _HELD[key]
    if count > 1:
      _HELD[key] = (fd, count - 1)
      return
    del _HELD[key]
    os.close(fd)  # closing the descriptor drops the flock


@contextlib.contextmanager
def run_lock(model_dir: str) -> Iterator[None]:
  """`with run_lock(model_dir):` holds the model directory's lock for the block."""
  key = acquire(model_dir)
  try:
    yield
  finally:
    release(key)
