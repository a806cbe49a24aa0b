"""Per-document arrays that data worker processes map instead of copying.

A source holds a few arrays as long as its corpus (the documents of its split, a user's
documents): 8 bytes a document each. Pickled to N worker processes as they start (the "spawn"
start method), each would hold its own copy. `pickled_state(state, names)` moves each such array
into anonymous shared memory once (`memfd_create`), makes the parent read it there too, and
pickles it as the memory's file descriptor (passed to the child as it is spawned); the child
maps the same pages (`unpickled_state`). Outside a process start (or where there is no
`memfd_create`) arrays pickle as themselves.
"""
import mmap
import os
from multiprocessing import context as mp_context
from multiprocessing import reduction
from typing import Dict, Sequence

import numpy as np

_MIN_BYTES = 1 << 20  # smaller arrays are copied: one page table is not worth a descriptor


class _Mapped:
  """What a shared array pickles as: the descriptor of its memory (duplicated into the child as
  it is spawned), its dtype and shape."""

  def __init__(self, fd, dtype: str, shape):
    self.fd, self.dtype, self.shape = fd, dtype, shape

  def array(self) -> np.ndarray:
    fd = self.fd.detach() if hasattr(self.fd, "detach") else self.fd
    try:
      size = int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize
      block = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
      os.close(fd)
    return np.frombuffer(block, self.dtype).reshape(self.shape)


def _shared(array: np.ndarray):
  """(the array's copy in anonymous shared memory, read-only; its descriptor)."""
  array = np.ascontiguousarray(array)
  fd = os.memfd_create("private_t5-documents", os.MFD_CLOEXEC)
  os.ftruncate(fd, array.nbytes)
  with mmap.mmap(fd, array.nbytes) as block:
    np.frombuffer(block, array.dtype)[:] = array.reshape(-1)
  copy = np.frombuffer(mmap.mmap(fd, array.nbytes, access=mmap.ACCESS_READ), array.dtype).reshape(array.shape)
  return copy, fd


def pickled_state(obj, names: Sequence[str]) -> Dict[str, object]:
  """`obj.__dict__` for pickling: each of its arrays `names` of 1 MiB or more as shared memory
  when pickled for a process being spawned (the object then reads the shared copy itself)."""
  state = dict(obj.__dict__)
  if mp_context.get_spawning_popen() is None or not hasattr(os, "memfd_create"):
    return state
  fds = obj.__dict__.setdefault("_shared_fds", {})
  state.pop("_shared_fds", None)
  for name in names:
    array = state.get(name)
    if not isinstance(array, np.ndarray) or array.nbytes < _MIN_BYTES or array.ndim != 1:
      continue
    if name not in fds:
      array, fds[name] = _shared(array)
      obj.__dict__[name] = array
    state[name] = _Mapped(reduction.DupFd(fds[name]), array.dtype.str, array.shape)
  return state


def unpickled_state(state: Dict[str, object]) -> Dict[str, object]:
  """The state `pickled_state` made, its shared arrays mapped."""
  return {k: v.array() if isinstance(v, _Mapped) else v for k, v in state.items()}
