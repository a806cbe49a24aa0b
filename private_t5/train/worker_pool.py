"""Data worker processes: whole steps' host batches built in N processes, handed back in shared memory.

`WorkerPool(build, workers)` starts `workers` processes (the "spawn" start method: a fresh
interpreter that imports only this module, NumPy and what `build` pickles to, never JAX or
TensorFlow) and gives each a copy of `build`, a `train.step_rows.HostStepBuilder`. `submit(step,
seed)` sends the step over its own pipe to the worker with the fewest steps waiting; the worker
builds the step's `HostStep` whole and writes its arrays into one of its anonymous shared-memory
files (`memfd_create`; an unlinked temporary file elsewhere); a new file's descriptor is passed back
once, and the parent keeps its mapping of the file for as long as the worker keeps the file, so a
step costs the parent one small message and no mapping or page fault. `result(step)` gives arrays
that read the file in place. When the last of them is gone, the parent tells the worker, which
writes a later step into the same file (a fresh file's first touch costs a fifth of a step's
build). The memory has no name: it goes with the worker and the last array that reads it, and
nothing is left in /dev/shm whoever is killed. A step is built by one worker from (step, seed)
alone, so the batch of step t does not depend on the number of workers, the order they finish in
or a restart (seqio, grain and PyTorch's DataLoader feed from worker processes in the same way;
here the unit of work is a step, not a record, because the step's sample, a Poisson draw of
variable size, is what the privacy accounting fixes).

Failures: an exception in a worker comes back with its step and `result` raises it (a
`PrivateT5Error` as it is, anything else as one `DataError` line naming the step); a worker that
dies (killed, out of memory) makes `result` raise a `DataError` naming the step it was waiting
for (its pipe ends), never a hang. No worker outlives its parent: `close()` stops them (SIGTERM,
then SIGKILL), they are daemonic (stopped at the parent's exit), and each one asks Linux to kill
it when its parent dies (`PR_SET_PDEATHSIG`) and watches its parent's pid otherwise, so a parent
killed with SIGKILL leaves none behind. Workers ignore SIGINT: Ctrl-C reaches the parent's
process group, and the parent's `close()` stops them.
"""
import collections
import ctypes
import functools
import mmap
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing import reduction
from typing import Dict, List, Optional

import numpy as np

from private_t5.errors import ConfigError, DataError, PrivateT5Error
from private_t5.train.step_rows import HostStep

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5  # how often a waiting parent checks its workers, and a worker its parent
_ALIGN = 64
_KEEP_FREE = 2  # a worker's released files kept to write again
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


class _Buffers:
  """A worker's shared-memory files: one a step in the parent's hands, the rest free to write again.

  Writing a fresh file costs its pages' first touch (zero-filled by the kernel: 0.7 ms for the
  0.9 MB of a 256-row span-corruption step on the 2-core machine of docs/performance.md, a fifth
  of the step's build); a file the parent has released is written again at memory speed. The
  parent releases a file when the last array reading it is gone (`WorkerPool`), never before.
  """

  def __init__(self):
    self._free: Dict[int, tuple] = {}  # id -> (fd, mapping, size)
    self._held: Dict[int, tuple] = {}
    self._next = 0
    self.dropped: List[int] = []

  def take(self, size: int):
    """(id, fd or None, mapping) of a file of at least `size` bytes, free to write; the descriptor
    only for a new file (the parent keeps its mapping of a file it has seen)."""
    fitting = [key for key, (_, _, have) in self._free.items() if have >= size]
    fd = None
    if fitting:
      key = min(fitting, key=lambda k: self._free[k][2])
      entry = self._free.pop(key)
    else:
      size = -(-(size + size // 8) // mmap.PAGESIZE) * mmap.PAGESIZE  # room for the next step's sample
      fd = _anonymous_file(size)
      entry, key = (fd, mmap.mmap(fd, size), size), self._next
      self._next += 1
    self._held[key] = entry
    return key, fd, entry[1]

  def release(self, key: int) -> None:
    entry = self._held.pop(key, None)
    if entry is None:
      return
    self._free[key] = entry
    while len(self._free) > _KEEP_FREE:
      dropped = min(self._free)
      fd, mapping, _ = self._free.pop(dropped)
      mapping.close()
      os.close(fd)
      self.dropped.append(dropped)

  def take_dropped(self) -> List[int]:
    """The ids of the files closed since the last call (the parent forgets its mappings of them)."""
    dropped, self.dropped = self.dropped, []
    return dropped


def _pack(host_step: HostStep, buffers: _Buffers):
  """(file id or None, descriptor or None, layout, size, meta): the arrays of a HostStep written into
  one of the worker's shared-memory files."""
  chunks = list(host_step.host) + ([host_step.empty] if host_step.empty is not None else [])
  layout, size = [], 0
  for chunk in chunks:
    entry = []
    for key, array in chunk.items():
      array = np.asarray(array)
      entry.append((key, array.dtype.str, array.shape, size))
      size += -(-array.nbytes // _ALIGN) * _ALIGN
    layout.append(entry)
  key = fd = None
  if size:
    key, fd, block = buffers.take(size)
    for chunk, entry in zip(chunks, layout):
      for name, dtype, shape, start in entry:
        np.ndarray(shape, dtype, block, start)[...] = chunk[name]
  meta = (host_step.step, host_step.num_sampled, host_step.rows, host_step.count, len(host_step.host))
  return key, fd, layout, size, meta


def _unpack(block: Optional[mmap.mmap], layout: list, size: int, meta, on_release=None) -> HostStep:
  """The HostStep whose arrays read `block` (the parent's mapping of a worker's file) in place.
  `on_release()` is called once the last of the arrays is gone (the file may be written again then)."""
  base = None
  if block is not None:
    base = np.frombuffer(block, np.uint8, size)  # this step's view: every array below is a view of it
    if on_release is not None:
      weakref.finalize(base, on_release).atexit = False
  chunks: List[Dict[str, np.ndarray]] = []
  for entry in layout:
    chunks.append({key: np.ndarray(shape, dtype, base, start) if base is not None else np.zeros(shape, dtype)
                   for key, dtype, shape, start in entry})
  step, num_sampled, rows, count, n_host = meta
  return HostStep(step, num_sampled, rows, count, chunks[:n_host], chunks[n_host] if len(chunks) > n_host else None)


def _drain(queue: collections.deque) -> List[int]:
  out = []
  while True:
    try:
      out.append(queue.popleft())
    except IndexError:
      return out


def _worker_main(build, pipe, parent: int) -> None:
  """A worker: reads (step, seed) tasks and released file ids from its pipe until None or EOF."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _die_with_parent(parent)
  _tune_allocator()
  buffers = _Buffers()
  while True:
    try:
      task = pipe.recv()
    except (EOFError, OSError):
      return
    if task is None:
      return
    if isinstance(task, int):  # a file the parent has released
      buffers.release(task)
      continue
    step, seed, released = task  # a task carries the files released since the last one
    for key in released:
      buffers.release(key)
    try:
      key, fd, layout, size, meta = _pack(build(step, seed), buffers)
    except PrivateT5Error as e:
      pipe.send(("raise", step, e))
      continue
    except BaseException as e:  # pylint: disable=broad-except
      pipe.send(("error", step, f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__))
      continue
    pipe.send(("ok", step, (key, fd is not None, layout, size, meta, buffers.take_dropped())))
    if fd is not None:  # a new file: its descriptor goes once, the parent maps it for good
      reduction.send_handle(pipe, fd, parent)


class WorkerPool:
  """`workers` processes building `build(step, seed)` (a picklable `HostStepBuilder`)."""

  def __init__(self, build, workers: int):
    if int(workers) < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    context = multiprocessing.get_context("spawn")
    self._done: Dict[int, tuple] = {}
    self._files: Dict[tuple, mmap.mmap] = {}  # (worker, file id) -> the parent's mapping of it
    self._submitted: Dict[int, int] = {}  # step -> the worker building it, until `result` takes it
    self._lock = threading.Lock()  # the books
    self._receiving = threading.Lock()  # one reader of the pipes at a time
    self._closed = False
    self._pipes, self.processes, theirs = [], [], []
    self._sending = [threading.Lock() for _ in range(int(workers))]  # a pipe's writers
    self._released = [collections.deque() for _ in range(int(workers))]  # file ids not yet told
    for k in range(int(workers)):
      ours, end = context.Pipe(duplex=True)
      self._pipes.append(ours)
      theirs.append(end)
      self.processes.append(context.Process(target=_worker_main, args=(build, end, os.getpid()),
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
    """Sends step `step` to a worker (once; later calls for the same step do nothing)."""
    with self._lock:
      if step in self._submitted or self._closed:
        return
      waiting = collections.Counter(self._submitted.values())
      worker = min(range(len(self._pipes)), key=waiting.__getitem__)  # the one with the fewest steps not yet taken
      self._submitted[step] = worker
    self._send(worker, (int(step), int(seed), _drain(self._released[worker])))

  def _receive(self, worker: int, waiting_for: int) -> None:
    """Reads one message of `worker`, the one building step `waiting_for` (waiting up to `_POLL_S`;
    a worker answers its steps in order, so only its pipe is watched); a worker gone is a DataError."""
    pipe = self._pipes[worker]
    try:
      if not pipe.poll(_POLL_S):
        return
      kind, step, payload = pipe.recv()
      if kind == "ok":
        key, new, layout, size, meta, dropped = payload
        if new:
          self._map(worker, key, reduction.recv_handle(pipe))
        for gone in dropped:  # closed by the worker: mapped here until its last array is gone
          self._files.pop((worker, gone), None)
        payload = (None if key is None else self._files[(worker, key)], layout, size, meta, worker, key)
    except (EOFError, OSError):
      process = self.processes[worker]
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
          self._submitted.pop(step)
          break
        if self._closed:
          raise DataError(f"the data workers were stopped before the batch of step {step} was built")
        if step not in self._submitted:
          raise ValueError(f"step {step} was not submitted")
        worker = self._submitted[step]
      with self._receiving:
        with self._lock:
          if step in self._done:
            continue
        self._receive(worker, step)
    if kind == "ok":
      block, layout, size, meta, worker, key = payload
      return _unpack(block, layout, size, meta, None if key is None else functools.partial(self._release, worker, key))
    if kind == "raise":
      raise payload
    raise DataError(f"building the batch of step {step} failed in a data worker process: {payload}")

  def _map(self, worker: int, key: int, fd: int) -> None:
    """Maps a worker's new file (shared, for as long as the worker keeps it) and closes `fd`."""
    try:
      self._files[(worker, key)] = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
      os.close(fd)

  def _release(self, worker: int, key: int) -> None:
    """The last array reading a file is gone (from whichever thread dropped it): the id goes to the
    worker with its next task, or at once when the worker would otherwise run out of files."""
    self._released[worker].append(key)  # (a deque: no lock, a finalizer may run in any thread at any time)
    if len(self._released[worker]) > _KEEP_FREE:
      for one in _drain(self._released[worker]):
        self._send(worker, one)

  def _send(self, worker: int, message) -> None:
    """Sends worker `worker` a task, a released file's id (from whichever thread dropped the
    last array reading it) or None (stop); a worker that has ended is found by `_receive`."""
    with self._sending[worker]:
      pipe = self._pipes[worker]
      if pipe.closed:
        return
      try:
        pipe.send(message)
      except (OSError, ValueError):
        pass

  def close(self) -> None:
    """Stops the workers and closes what they built that was not taken."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    for worker in range(len(self._pipes)):
      self._send(worker, None)
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
      self._done.clear()
      self._files.clear()  # each mapping goes with the last array that reads it
    for pipe, sending in zip(self._pipes, self._sending):
      with sending:
        pipe.close()
