"""TensorFlow imported without the lines its C++ start-up writes to the console.

Importing TensorFlow (directly, or through seqio, t5 or tensorflow_datasets) writes, from C++,
"All log messages before absl::InitializeLog() is called are written to STDERR", the oneDNN
notice and "Could not find cuda drivers", and its first look at the devices writes
"failed call to cuInit" on a machine without a GPU. These are written before absl's logging
is set up, so `TF_CPP_MIN_LOG_LEVEL` does not hold them back, and a user reads them as errors.
Every module that imports TensorFlow, or a library that imports it, calls `import_tensorflow()`
first. Base layer: imports nothing from the package.
"""
import contextlib
import logging
import os
import sys
from typing import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def silenced_stderr() -> Iterator[None]:
  """Points file descriptor 2 at the null device for the block (C++ and Python writes alike)."""
  try:
    sys.stderr.flush()
  except (AttributeError, ValueError):  # no stderr, or a closed one
    pass
  try:
    saved = os.dup(2)
  except OSError:  # no file descriptor 2: nothing to silence
    yield
    return
  try:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
      os.dup2(null, 2)
    finally:
      os.close(null)
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


def import_tensorflow():
  """The `tensorflow` module, imported the first time with its start-up lines silenced.

  On that first import TensorFlow is kept off the GPUs (`hide_accelerators`). Later C++ log
  lines below errors are held back by `TF_CPP_MIN_LOG_LEVEL` (set to 2 unless the environment
  sets it). Raises ImportError as `import tensorflow` does.
  """
  if "tensorflow" not in sys.modules:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with silenced_stderr():
      # Importing TensorFlow with its start-up lines silenced is this function's job.
      import tensorflow  # pylint: disable=g-import-not-at-top,unused-import,redefined-outer-name  # this function's job
    hide_accelerators()
  return sys.modules["tensorflow"]


def hide_accelerators() -> None:
  """Keeps an imported TensorFlow, which runs input pipelines only, on the CPU; else a no-op.

  Otherwise TensorFlow claims (nearly all of) every GPU's memory the first time it runs an
  op, and JAX's training step then runs out of memory (T5X does the same). It must run
  before TensorFlow's first op; later it is a no-op (logged). TensorFlow is never imported
  for this: `import_tensorflow` calls it when it imports TensorFlow.
  """
  tf = sys.modules.get("tensorflow")
  if tf is None or not hasattr(tf, "config"):  # not imported, or still importing
    return
  try:
    with silenced_stderr():  # its look at the devices logs "failed call to cuInit" without a GPU
      tf.config.set_visible_devices([], "GPU")
  except RuntimeError as e:  # TensorFlow's runtime already started in this process
    logger.debug("TensorFlow keeps its devices: %s", e)
