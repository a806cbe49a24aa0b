"""Where Gin files are found: the current directory, `--gin_search_paths`, the shipped configs."""
import os
from typing import List, Optional, Sequence, Union

from private_t5.errors import ConfigError

# The package folder (this module lives in its `stages/` subfolder).
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_ROOT = os.path.dirname(PACKAGE_DIR)
# The Gin files shipped inside the package (`configs` at the project root links here).
PACKAGE_CONFIGS = os.path.join(PACKAGE_DIR, "configs")
# Where a `--gin_file` name or a Gin `include` is looked up (T5X style), after the current
# directory and any `--gin_search_paths`: the package's configs by name
# (`models/t5_1_0_small.gin`, `runs/pretrain.gin`), then the package folder, for the
# `configs/models/t5_1_0_small.gin` form. So every shipped file is found from any directory.
CONFIG_SEARCH_PATHS = (PACKAGE_CONFIGS, PACKAGE_DIR)


# The user folders of the stage's `--gin_search_paths` flag (set once per command line).
_USER_SEARCH_PATHS: List[str] = []


def set_search_paths(extra: Union[None, str, Sequence[str]]) -> None:
  """Sets the user folders (`--gin_search_paths=a,b`) that every later `parse` searches."""
  if isinstance(extra, str):
    extra = extra.split(",")
  _USER_SEARCH_PATHS[:] = [p for p in (extra or ()) if p.strip()]


def search_paths(extra: Union[None, str, Sequence[str]] = None) -> List[str]:
  """The Gin search path, in order: the current directory, `extra`, CONFIG_SEARCH_PATHS.

  Args:
    extra: user folders: a sequence, or one comma-separated string; None: those of the
      command line's `--gin_search_paths` (`set_search_paths`).
  """
  if extra is None:
    extra = _USER_SEARCH_PATHS
  if isinstance(extra, str):
    extra = extra.split(",")
  paths = [os.getcwd()] + [os.path.abspath(os.path.expanduser(p.strip())) for p in extra if p.strip()]
  return list(dict.fromkeys(paths + list(CONFIG_SEARCH_PATHS)))


def find_file(path: str, paths: Optional[Sequence[str]] = None) -> str:
  """The file a `--gin_file` names: absolute, or the first match along `paths` (search_paths())."""
  path = os.path.expanduser(path)
  if os.path.isabs(path):
    if os.path.isfile(path):
      return path
    raise ConfigError(f"Gin file not found: {path!r}")
  paths = search_paths() if paths is None else paths
  for base in paths:
    candidate = os.path.join(base, path)
    if os.path.isfile(candidate):
      return candidate
  raise ConfigError(f"Gin file not found: {path!r} (looked in {', '.join(paths)})")
