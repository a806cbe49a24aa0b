"""A stage module's re-exported library names, imported when first read.

`private-t5 bench` and `private-t5 study` have long let users import their library's names from
the stage module (`from private_t5.stages.bench import run_case`). Importing that library pulls in
JAX and the trainer (~2 s), which `private-t5 <stage> --help` must not pay; so the stage module
names them here and Python asks for them on first use (a module-level `__getattr__`, PEP 562).
"""
import importlib
from typing import Callable, Dict, Sequence


def lazy_names(stage: str, names_by_module: Dict[str, Sequence[str]]) -> Callable[[str], object]:
  """The `__getattr__` of the stage module `stage`: each name read from its library module."""
  home = {name: module for module, names in names_by_module.items() for name in names}

  def __getattr__(name: str):  # pylint: disable=invalid-name
    if name not in home:
      raise AttributeError(f"module {stage!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home[name]), name)

  return __getattr__
