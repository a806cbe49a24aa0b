"""Names that moved to the modules that define them, still readable at their old address for one release.

A module whose documented names moved sets `__getattr__ = moved_names.moved(__name__, {home: names})`
(PEP 562): reading one of those names from the old module, `from old import name` included, imports
it from its home and warns once per call site with a `DeprecationWarning` that names the new address.
Nothing in the package reads a name through an old address (`tests/test_import_layers.py`).
"""
import importlib
import warnings
from typing import Callable, Dict, Sequence


def moved(module: str, names_by_home: Dict[str, Sequence[str]]) -> Callable[[str], object]:
  """The `__getattr__` of `module`: each moved name read from its home module, with a warning."""
  home = {name: where for where, names in names_by_home.items() for name in names}

  def __getattr__(name: str):  # pylint: disable=invalid-name
    if name not in home:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} moved to {home[name]}.{name}; import it from there (the old address goes "
                  "in the next release)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home[name]), name)

  return __getattr__
