"""Data worker processes: whole steps' host batches built in N processes, handed back in shared memory.

`WorkerPool(build, workers)` starts `workers` processes (the "spawn" start method: a fresh
interpreter that imports only this module, NumPy and what `build` pickles to, never JAX or
TensorFlow) and gives each a copy of `build`, a `train.step_rows.HostStepBuilder`. `submit(step,
seed)` queues a step; a free worker builds the step's `HostStep` whole, writes its arrays into one
anonymous shared-memory file (`memfd_create`; an unlinked temporary file elsewhere) and passes its
descriptor back over its own pipe; `result(step)` maps it (copy-on-write) and the arrays read it
in place. The memory has no name: it goes with the last array that reads it, and nothing is left
in /dev/shm whoever is killed. A step
is built by one worker from (step, seed) alone, so the batch of step t does not depend on the number
of workers, the order they finish in or a restart (seqio, grain and PyTorch's DataLoader feed from
worker processes in the same way; here the unit of work is a step, not a record, because the
step's sample, a Poisson draw of variable size, is what the privacy accounting fixes).

Failures: an exception in a worker comes back with its step and `result` raises it (a
`PrivateT5Error` as it is, anything else as one `DataError` line naming the step); a worker that
dies (killed, out of memory) makes `result` raise a `DataError` naming the step it was waiting
for (its pipe ends), never a hang. No worker outlives its parent: `close()` stops them (SIGTERM,
then SIGKILL), they are daemonic (stopped at the parent's exit), and each one asks Linux to kill
it when its parent dies (`PR_SET_PDEATHSIG`) and watches its parent's pid otherwise, so a parent
killed with SIGKILL leaves none behind. Workers ignore SIGINT: Ctrl-C reaches the parent's
process group, and the parent's `close()` stops them.
"""
import ctypes
import mmap
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from multiprocessing import connection, reduction
from typing import Dict, List, Optional

import numpy as np

from private_t5.errors import ConfigError, DataError, PrivateT5Error
from private_t5.train.step_rows import HostStep

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5  # how often a waiting parent checks its workers, and a worker its parent
_ALIGN = 64
# glibc's mallopt: a fresh process serves every allocation over 128 KiB (a batch's temporaries) with
# its own mmap, zero-filled page by page, until frees raise that threshold: it made a worker's
# steps 2.3x slower than the same build in a process that had allocated before. Fixed thresholds
# keep the temporaries on the heap (freed memory beyond 64 MiB is still given back).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 32 << 20, 64 << 20


def _tune_allocator() -> None:
  try:
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
  except (AttributeError, OSError):
    pass  # not glibc


def _die_with_parent(parent: int) -> None:
  try:  # Linux: the kernel kills this process when the parent thread exits
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (AttributeError, OSError):
    pass

  def watch():  # elsewhere (and if the parent died before prctl took effect): poll
    while os.getppid() == parent:
      time.sleep(_POLL_S)
    os._exit(1)  # pylint: disable=protected-access

  threading.Thread(target=watch, name="private_t5-parent-watch", daemon=True).start()


def _anonymous_file(size: int) -> int:
  """A descriptor of `size` bytes of shared memory with no name."""
  if hasattr(os, "memfd_create"):
    fd = os.memfd_create("private_t5-step", os.MFD_CLOEXEC)
  else:
    f = tempfile.TemporaryFile()
    fd = os.dup(f.fileno())
    f.close()
  os.ftruncate(fd, size)
  return fd


def _pack(host_step: HostStep):
  """(descriptor or None, layout, size, meta): the arrays of a HostStep written into one anonymous
  shared-memory file."""
  chunks = list(host_step.host) + ([host_step.empty] if host_step.empty is not None else [])
  layout, size = [], 0
  for chunk in chunks:
    entry = []
    for key, array in chunk.items():
      array = np.asarray(array)
      entry.append((key, array.dtype.str, array.shape, size))
      size += -(-array.nbytes // _ALIGN) * _ALIGN
    layout.append(entry)
  fd = None
  if size:
    fd = _anonymous_file(size)
    with mmap.mmap(fd, size) as block:
      for chunk, entry in zip(chunks, layout):
        for key, dtype, shape, start in entry:
          np.ndarray(shape, dtype, block, start)[...] = chunk[key]
  meta = (host_step.step, host_step.num_sampled, host_step.rows, host_step.count, len(host_step.host))
  return fd, layout, size, meta


def _unpack(fd: Optional[int], layout: list, size: int, meta) -> HostStep:
  """The HostStep whose arrays read the file of `fd` in place (a private copy-on-write mapping,
  so writing to them changes nothing the worker sees); closes `fd`."""
  mapped = None
  if fd is not None:
    try:
      mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
      os.close(fd)
  chunks: List[Dict[str, np.ndarray]] = []
  for entry in layout:
    chunks.append({key: (np.frombuffer(mapped, dtype, int(np.prod(shape, dtype=np.int64)), start).reshape(shape)
                         if mapped is not None else np.zeros(shape, dtype))
                   for key, dtype, shape, start in entry})
  step, num_sampled, rows, count, n_host = meta
  return HostStep(step, num_sampled, rows, count, chunks[:n_host], chunks[n_host] if len(chunks) > n_host else None)


def _worker_main(build, tasks, pipe, parent: int) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _die_with_parent(parent)
  _tune_allocator()
  while True:
    task = tasks.get()
    if task is None:
      return
    step, seed = task
    try:
      fd, layout, size, meta = _pack(build(step, seed))
    except PrivateT5Error as e:
      pipe.send(("raise", step, e))
      continue
    except BaseException as e:  # pylint: disable=broad-except
      pipe.send(("error", step, f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__))
      continue
    pipe.send(("ok", step, (fd is not None, layout, size, meta)))
    if fd is not None:
      reduction.send_handle(pipe, fd, parent)
      os.close(fd)


class WorkerPool:
  """`workers` processes building `build(step, seed)` (a picklable `HostStepBuilder`)."""

  def __init__(self, build, workers: int):
    if int(workers) < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    context = multiprocessing.get_context("spawn")
    self._tasks = context.Queue()
    self._done: Dict[int, tuple] = {}
    self._submitted = set()
    self._lock = threading.Lock()  # the books
    self._receiving = threading.Lock()  # one reader of the pipes at a time
    self._closed = False
    self._pipes, self.processes, theirs = [], [], []
    for k in range(int(workers)):
      ours, end = context.Pipe(duplex=True)
      self._pipes.append(ours)
      theirs.append(end)
      self.processes.append(context.Process(target=_worker_main, args=(build, self._tasks, end, os.getpid()),
                                            name=f"private_t5-data-{k}", daemon=True))
    main = sys.modules.get("__main__")
    hidden = {name: getattr(main, name) for name in ("__spec__", "__file__") if getattr(main, name, None) is not None}
    try:
      # Spawned children re-import the parent's main module unless it is hidden; the workers need
      # only this module (a user's script may import JAX or start training at import).
      for name in hidden:
        setattr(main, name, None) if name == "__spec__" else delattr(main, name)
      for process in self.processes:
        try:
          process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as e:
          for end in theirs:
            end.close()
          self.close()
          raise ConfigError(f"train.data_workers={len(self.processes)}: what builds the batches cannot be sent to a "
                            f"worker process ({type(e).__name__}: {e}); set train.data_workers=0") from None
    finally:
      for name, value in hidden.items():
        setattr(main, name, value)
    for end in theirs:  # the children hold their ends now: ours close, so a death is an EOF
      end.close()

  def submit(self, step: int, seed: int) -> None:
    """Queues step `step` (once; later calls for the same step do nothing)."""
    with self._lock:
      if step in self._submitted or self._closed:
        return
      self._submitted.add(step)
    self._tasks.put((int(step), int(seed)))

  def _receive(self, waiting_for: int) -> None:
    """Reads what the workers sent (waiting up to `_POLL_S`); a worker gone is a DataError."""
    live = [pipe for pipe in self._pipes if not pipe.closed]
    for pipe in connection.wait(live, timeout=_POLL_S):
      try:
        kind, step, payload = pipe.recv()
        if kind == "ok":
          has_fd, layout, size, meta = payload
          payload = (reduction.recv_handle(pipe) if has_fd else None, layout, size, meta)
      except (EOFError, OSError):
        process = self.processes[self._pipes.index(pipe)]
        process.join(1.0)
        raise DataError(f"a data worker process ended (exit code {process.exitcode}) while the batch of step "
                        f"{waiting_for} was being built") from None
      with self._lock:
        self._done[step] = (kind, payload)

  def result(self, step: int) -> HostStep:
    """The `HostStep` of a submitted step, waiting for it; raises as the module says."""
    while True:
      with self._lock:
        if step in self._done:
          kind, payload = self._done.pop(step)
          self._submitted.discard(step)
          break
        if self._closed:
          raise DataError(f"the data workers were stopped before the batch of step {step} was built")
      with self._receiving:
        with self._lock:
          if step in self._done:
            continue
        self._receive(step)
    if kind == "ok":
      return _unpack(*payload)
    if kind == "raise":
      raise payload
    raise DataError(f"building the batch of step {step} failed in a data worker process: {payload}")

  def close(self) -> None:
    """Stops the workers and closes what they built that was not taken."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    for _ in self.processes:
      try:
        self._tasks.put_nowait(None)
      except Exception:  # pylint: disable=broad-except
        pass
    started = [process for process in self.processes if process.pid is not None]
    deadline = time.time() + 2.0
    for process in started:
      process.join(max(deadline - time.time(), 0.05))
    for process in started:
      if process.is_alive():
        process.terminate()
        process.join(1.0)
      if process.is_alive():
        process.kill()
        process.join(1.0)
    with self._lock:
      for kind, payload in self._done.values():
        if kind == "ok" and payload[0] is not None:
          os.close(payload[0])
      self._done.clear()
    for pipe in self._pipes:
      pipe.close()
    self._tasks.close()
    self._tasks.cancel_join_thread()
