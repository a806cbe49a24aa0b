"""Heavy optional libraries, named at a module's top and imported on first use.

The one way the package imports lazily. Every other import sits at the top of its module, so a
reader sees a module's dependencies there and an import cycle cannot hide behind a function.
Libraries that are heavy to import (TensorFlow and what imports it: seqio, TensorFlow Datasets),
optional (Apache Beam, Dask, PyTorch, transformers, Matplotlib, spaCy, NLTK, datasketch), or
both, are named at the top as well, through `lazy_module`:

    beam = lazy_module("apache_beam", needed_for="a Beam runner",
                       install="apache-beam (requirements.txt), or use --runner=local")

    def run(...):
      with beam.Pipeline(options=...) as pipeline:   # Beam is imported here, once
        ...

The stand-in imports the library the first time one of its attributes is read (or
`import_now(stand_in)` is called) and hands every later read to the module itself; it has no
public attribute of its own, so none hides the library's (`spacy.load`, `tfds.load`). A library that is not installed is one
`MissingLibrary` line naming what needed it and how to install it: a `ConfigError` (the CLI
prints it as one line and exits non-zero) that is also an `ImportError` (code that falls back
when a library is absent catches either). `before` runs once, just before the first import:
`quiet_tf.import_tensorflow` for a library that imports TensorFlow, say.

Base layer: imports nothing from the package but its errors.
"""
import importlib
import importlib.util
import threading
from typing import Callable, Optional

from private_t5.errors import ConfigError


class MissingLibrary(ConfigError, ImportError):
  """An optional library that is needed but not importable (one line: what needs it, how to install)."""


class LazyModule:
  """A module named now and imported on first use; see the module docstring."""

  def __init__(self, name: str, needed_for: str = "", install: str = "",
               before: Optional[Callable[[], object]] = None):
    self.__dict__.update(_name=name, _needed_for=needed_for, _install=install, _before=before,
                         _module=None, _lock=threading.Lock())

  def _lazy_import(self):
    """The module itself, imported now if it was not yet."""
    module = self.__dict__["_module"]
    if module is not None:
      return module
    with self.__dict__["_lock"]:
      if self.__dict__["_module"] is None:
        try:
          if self._before is not None:
            self._before()
          module = importlib.import_module(self._name)
        except ImportError as e:
          raise MissingLibrary(self._missing_message(e)) from e
        self.__dict__["_module"] = module
    return self.__dict__["_module"]

  def _lazy_installed(self) -> bool:
    """Whether the library can be found, without importing it."""
    if self.__dict__["_module"] is not None:
      return True
    try:
      return importlib.util.find_spec(self._name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or not a package
      return False

  def _missing_message(self, error: ImportError) -> str:
    who = f"{self._needed_for} needs" if self._needed_for else "this needs"
    install = f"; install {self._install}" if self._install else ""
    return f"{who} {self._name}, which is not importable ({error}){install}"

  def __getattr__(self, attribute: str):
    return getattr(self._lazy_import(), attribute)

  def __setattr__(self, attribute: str, value) -> None:
    setattr(self._lazy_import(), attribute, value)

  def __dir__(self):
    return dir(self._lazy_import())

  def __repr__(self) -> str:
    state = "imported" if self.__dict__["_module"] is not None else "not imported yet"
    return f"<lazy module {self._name!r} ({state})>"


def lazy_module(name: str, needed_for: str = "", install: str = "",
                before: Optional[Callable[[], object]] = None) -> LazyModule:
  """A stand-in for the module `name`, imported the first time one of its attributes is read.

  Args:
    name: the module's full dotted name (`apache_beam.io.filesystems`).
    needed_for: what needs it, for the error when it is missing ("a Beam runner").
    install: how to install it, for that error ("pip install 'private_t5[dask]'").
    before: called once, right before the first import (e.g. `quiet_tf.import_tensorflow`).
  """
  return LazyModule(name, needed_for, install, before)


def import_now(stand_in: LazyModule):
  """The module behind `stand_in`, imported now if it was not yet (MissingLibrary if it cannot be)."""
  return stand_in._lazy_import()  # pylint: disable=protected-access


def installed(stand_in: LazyModule) -> bool:
  """Whether the library behind `stand_in` can be found, without importing it."""
  return stand_in._lazy_installed()  # pylint: disable=protected-access
