"""Makes this Python process see no TensorFlow, as a machine with only JAX installed.

With this folder first on PYTHONPATH, Python runs this file at start-up: `tensorflow` and the
libraries built on it (tensorflow_datasets, tensorflow_text, seqio, t5, tensorboard, keras) are
then not found, exactly as if they were not installed (`import` raises ModuleNotFoundError,
`importlib.util.find_spec` returns None). tests/test_no_tensorflow.py and
benchmarks/bench_startup.py run `private-t5` this way.
"""
import sys

HIDDEN = frozenset({"tensorflow", "tensorflow_datasets", "tensorflow_text", "tensorflow_metadata",
                    "seqio", "t5", "tensorboard", "keras", "tf_keras"})


class _Hiding:
  """A meta path finder that finds nothing of HIDDEN and passes every other name on."""

  def __init__(self, finder):
    self._finder = finder

  def find_spec(self, name, path=None, target=None):
    if name.partition(".")[0] in HIDDEN:
      return None
    find_spec = getattr(self._finder, "find_spec", None)
    return find_spec(name, path, target) if find_spec else None

  def invalidate_caches(self):
    if hasattr(self._finder, "invalidate_caches"):
      self._finder.invalidate_caches()


sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path]
