"""One run per model directory: an exclusive lock on MODEL_DIR/.lock for the whole run.

Two processes training into the same MODEL_DIR would overwrite each other's checkpoints and
privacy report. The first run takes `fcntl.flock(LOCK_EX)` on `MODEL_DIR/.lock` and writes its
PID and host name into it; a second run fails at once with a `CheckpointError` naming the
holder. The kernel drops a flock when the holding process exits in any way (also SIGKILL), so a
lock of a dead process never blocks: the `.lock` file left behind is only a note.

Within one process the lock is re-entrant (counted): opening the same directory twice in one
process (a resumed run in a test, a notebook) does not lock itself out.

Several JAX processes (`private-t5 launch`, a pod) form one run: process 0 takes the lock for
all of them, and the others wait for its verdict before they touch the directory
(`acquire_on_process_0`). When process 0 is refused, every process raises the same
CheckpointError at once; none of them deletes or writes anything of the run holding the lock.
"""
import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from typing import Callable, Dict, Iterator, Optional, Tuple

import jax
from jax.experimental import multihost_utils
import numpy as np

from private_t5.errors import CheckpointError
from private_t5.models import run_dir

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
    key = os.path.realpath(run_dir.lock_path(model_dir))
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


def acquire_on_process_0(model_dir: str, before: Optional[Callable[[], None]] = None) -> Optional[str]:
  """Takes the lock on process 0 for the whole run; returns its key there, None elsewhere.

  Process 0 runs `before` (a writability check), then `acquire`; its verdict (taken, or the
  error's message) is sent to every process before any returns, so no process touches
  `model_dir` unless the run holds its lock. With one process this is `before` + `acquire`.

  Raises:
    CheckpointError: on every process, with process 0's message, when it was refused.
  """
  if jax.process_count() == 1:
    if before is not None:
      before()
    return acquire(model_dir)
  key, refusal = None, ""
  if jax.process_index() == 0:
    try:
      if before is not None:
        before()
      key = acquire(model_dir)
    except CheckpointError as e:
      refusal = str(e) or "the model directory's lock was refused"
  refusal = _from_process_0(refusal)
  if refusal:
    raise CheckpointError(refusal)
  return key


_VERDICT_BYTES = 4096


def _from_process_0(text: str) -> str:
  """Process 0's `text` on every process (a collective: every process must call it)."""
  data = text.encode("utf-8")[:_VERDICT_BYTES]
  words = np.zeros(_VERDICT_BYTES, np.uint8)
  words[:len(data)] = np.frombuffer(data, np.uint8)
  words = np.asarray(multihost_utils.broadcast_one_to_all(words))
  return bytes(words).rstrip(b"\0").decode("utf-8", "replace")


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
