"""A host-step builder for the worker-pool tests: NumPy only, so a worker that unpickles it imports
nothing the pool itself would not (the tests check that JAX stays out)."""
import os
import sys
import time

import numpy as np

from private_t5.errors import DataError
from private_t5.train.step_rows import HostStep


class Probe:
  """`probe(step, seed)`: a HostStep whose one row says which process built it and whether that
  process imported JAX or TensorFlow; raises at `fail_at`, sleeps at `slow_at`."""

  def __init__(self, fail_at=None, private_error_at=None, slow_at=None):
    self.fail_at, self.private_error_at, self.slow_at = fail_at, private_error_at, slow_at

  def __call__(self, step, seed):
    if step == self.fail_at:
      raise ValueError("mmap length is greater than file size\nsecond line")
    if step == self.private_error_at:
      raise DataError(f"the store changed under step {step}")
    if step == self.slow_at:
      time.sleep(60)
    row = {"pid": np.array([os.getpid()], np.int64),
           "imported": np.array([int("jax" in sys.modules), int("tensorflow" in sys.modules)], np.int32),
           "tokens": (np.arange(12, dtype=np.int32).reshape(3, 4) + step * 100 + seed)}
    return HostStep(step, 3, 4, None, [row])
