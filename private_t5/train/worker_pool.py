"""Data worker processes: whole steps' host batches built in N processes, handed back in shared memory.

`WorkerPool(build, workers)` starts `workers` processes (the "spawn" start method: a fresh
interpreter that imports only this module, NumPy and what `build` pickles to, never JAX or
TensorFlow) and gives each a copy of `build`, a `train.step_rows.HostStepBuilder`. `submit(step,
seed)` queues a step; a free worker builds the step's `HostStep` whole and writes its arrays into
one shared-memory block; `result(step)` maps the block, copies the arrays out and frees it. A step
is built by one worker from (step, seed) alone, so the batch of step t does not depend on the number
of workers, the order they finish in or a restart (seqio, grain and PyTorch's DataLoader feed from
worker processes in the same way; here the unit of work is a step, not a record, because the
step's sample, a Poisson draw of variable size, is what the privacy accounting fixes).

Failures: an exception in a worker comes back with its step and `result` raises it (a
`PrivateT5Error` as it is, anything else as one `DataError` line naming the step); a worker that
dies (killed, out of memory) makes `result` raise a `DataError` naming the step it was waiting
for, within a second, never a hang. No worker outlives its parent: `close()` stops them (SIGTERM,
then SIGKILL), they are daemonic (stopped at the parent's exit), and each one asks Linux to kill
it when its parent dies (`PR_SET_PDEATHSIG`) and watches its parent's pid otherwise, so a parent
killed with SIGKILL leaves none behind. Workers ignore SIGINT: Ctrl-C reaches the parent's
process group, and the parent's `close()` stops them.
"""
import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Dict, List, Optional, Tuple

import numpy as np

from private_t5.errors import DataError, PrivateT5Error
from private_t5.train.step_rows import HostStep

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5  # how often a waiting parent checks its workers, and a worker its parent


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


def _block(**kwargs) -> shared_memory.SharedMemory:
  """A shared-memory block the parent unlinks, kept out of the resource tracker's books (Python
  3.13+: `track=False`; before, an attached block is registered and `unlink` unregisters it, so
  only a block a worker makes is unregistered at once, `_made`)."""
  if sys.version_info >= (3, 13):
    return shared_memory.SharedMemory(track=False, **kwargs)  # pylint: disable=unexpected-keyword-arg
  return shared_memory.SharedMemory(**kwargs)


def _made(size: int) -> shared_memory.SharedMemory:
  block = _block(create=True, size=size)
  if sys.version_info < (3, 13):
    resource_tracker.unregister(block._name, "shared_memory")  # pylint: disable=protected-access
  return block


def _pack(host_step) -> Tuple[Optional[str], list, object]:
  """Writes the arrays of a HostStep into one new shared-memory block: (block name, layout, the
  step with its arrays taken out)."""
  chunks = list(host_step.host) + ([host_step.empty] if host_step.empty is not None else [])
  layout, offset = [], 0
  for chunk in chunks:
    entry = []
    for key, array in chunk.items():
      array = np.ascontiguousarray(array)
      entry.append((key, array.dtype.str, array.shape, offset))
      offset += -(-array.nbytes // 64) * 64
    layout.append(entry)
  name = None
  if offset:
    block = _made(offset)
    for chunk, entry in zip(chunks, layout):
      for key, dtype, shape, start in entry:
        np.ndarray(shape, dtype, block.buf, start)[...] = chunk[key]
    name = block.name
    block.close()
  meta = (host_step.step, host_step.num_sampled, host_step.rows, host_step.count, len(host_step.host))
  return name, layout, meta


def _unpack(name: Optional[str], layout: list, meta) -> object:
  chunks: List[Dict[str, np.ndarray]] = []
  block = _block(name=name) if name else None
  try:
    for entry in layout:
      chunks.append({key: np.ndarray(shape, dtype, block.buf, start).copy() if block is not None
                     else np.zeros(shape, dtype) for key, dtype, shape, start in entry})
  finally:
    if block is not None:
      block.close()
      block.unlink()
  step, num_sampled, rows, count, n_host = meta
  return HostStep(step, num_sampled, rows, count, chunks[:n_host], chunks[n_host] if len(chunks) > n_host else None)


def _free(name: Optional[str]) -> None:
  if name:
    try:
      _block(name=name).unlink()
    except (FileNotFoundError, OSError):
      pass


def _worker_main(build, tasks, results, parent: int) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _die_with_parent(parent)
  while True:
    task = tasks.get()
    if task is None:
      return
    step, seed = task
    try:
      results.put(("ok", step, _pack(build(step, seed))))
    except BaseException as e:  # pylint: disable=broad-except
      if isinstance(e, PrivateT5Error):
        results.put(("raise", step, e))
      else:
        results.put(("error", step, f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__))


class WorkerPool:
  """`workers` processes building `build(step, seed)` (a picklable `HostStepBuilder`)."""

  def __init__(self, build, workers: int):
    if int(workers) < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    context = multiprocessing.get_context("spawn")
    self._tasks = context.Queue()
    self._results = context.Queue()
    self._done: Dict[int, tuple] = {}
    self._submitted = set()
    self._lock = threading.Lock()
    self._closed = False
    self.processes = [context.Process(target=_worker_main, args=(build, self._tasks, self._results, os.getpid()),
                                      name=f"private_t5-data-{k}", daemon=True) for k in range(int(workers))]
    main = sys.modules.get("__main__")
    hidden = {name: getattr(main, name) for name in ("__spec__", "__file__") if getattr(main, name, None) is not None}
    try:
      # Spawned children re-import the parent's main module unless it is hidden; the workers need
      # only this module (a user's script may import JAX or start training at import).
      for name in hidden:
        setattr(main, name, None) if name == "__spec__" else delattr(main, name)
      for process in self.processes:
        process.start()
    finally:
      for name, value in hidden.items():
        setattr(main, name, value)

  def submit(self, step: int, seed: int) -> None:
    """Queues step `step` (once; later calls for the same step do nothing)."""
    with self._lock:
      if step in self._submitted or self._closed:
        return
      self._submitted.add(step)
    self._tasks.put((int(step), int(seed)))

  def result(self, step: int):
    """The `HostStep` of a submitted step, waiting for it; raises as the module says."""
    while True:
      with self._lock:
        if step in self._done:
          kind, payload = self._done.pop(step)
          self._submitted.discard(step)
          break
      try:
        kind, done, payload = self._results.get(timeout=_POLL_S)
      except queue.Empty:
        dead = [p for p in self.processes if p.exitcode is not None]
        if dead:
          raise DataError(f"a data worker process ended (exit code {dead[0].exitcode}) while the batch of step "
                          f"{step} was being built") from None
        continue
      with self._lock:
        self._done[done] = (kind, payload)
    if kind == "ok":
      return _unpack(*payload)
    if kind == "raise":
      raise payload
    raise DataError(f"building the batch of step {step} failed in a data worker process: {payload}")

  def close(self) -> None:
    """Stops the workers and frees what they built that was not taken."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    for _ in self.processes:
      try:
        self._tasks.put_nowait(None)
      except Exception:  # pylint: disable=broad-except
        pass
    deadline = time.time() + 2.0
    for process in self.processes:
      process.join(max(deadline - time.time(), 0.05))
    for process in self.processes:
      if process.is_alive():
        process.terminate()
        process.join(1.0)
      if process.is_alive():
        process.kill()
        process.join(1.0)
    while True:  # blocks built and never taken
      try:
        kind, _, payload = self._results.get_nowait()
      except (queue.Empty, OSError, ValueError):
        break
      if kind == "ok":
        _free(payload[0])
    for kind, payload in self._done.values():
      if kind == "ok":
        _free(payload[0])
    self._done.clear()
    for q in (self._tasks, self._results):
      q.close()
      q.cancel_join_thread()
