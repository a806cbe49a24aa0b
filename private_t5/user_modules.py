"""The user's own Python modules that a configuration names, imported before a run.

Two settings name such modules: `MIXTURE_OR_TASK_MODULE` (seqio Tasks, as T5X's) and `TASK_MODULE`
(GLUE-style tasks registered with `data.glue_registry.register_local_tsv_task`). Both are imported
here, the one place that turns a module that cannot be imported, or whose own code raises, into a
one-line `ConfigError` naming the setting and the module (a Ctrl-C still stops the run).

A module is looked up on `sys.path`; when its top-level package is found nowhere there, the current
folder is tried too (a `private-t5` console script does not put it on `sys.path`, `python -m` does),
so `--gin.TASK_MODULE=my_tasks` finds `./my_tasks.py` either way.

Modules imported with `in_workers=True` are imported again in every worker process a pool of the
run starts (`pool_kwargs()`: the initializer of a `multiprocessing` pool), so a worker started
with "spawn" or "forkserver" sees the tasks they register, as the run's own process does.
"""
import importlib
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from private_t5.errors import ConfigError

logger = logging.getLogger(__name__)

ModuleSpec = Union[None, str, Sequence[str]]
_IN_WORKERS: List[str] = []


def module_names(module: ModuleSpec, setting: str) -> List[str]:
  """The module names of a setting: None -> [], "a.b" -> ["a.b"], "a,b" or a list -> both; ConfigError otherwise."""
  if module is None:
    return []
  names = module.split(",") if isinstance(module, str) else module  # "a,b": two modules (a flag's list)
  if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n.strip() for n in names):
    raise ConfigError(f"{setting} must be a module name (e.g. 'my.tasks') or a list of them, got {module!r}")
  return [n.strip() for n in names]


def error_line(e: BaseException) -> str:
  """`type: first line of message` of an error the user's module raised, on one line (a
  SyntaxError with its file and line; an ImportError: its message alone)."""
  if isinstance(e, SyntaxError):
    return f"{type(e).__name__}: {e.msg} ({e.filename}, line {e.lineno})"
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  if isinstance(e, ImportError):
    return lines[0] if lines else type(e).__name__
  return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _import(name: str):
  """Imports `name`; retries from the current folder when its top-level package is on no path."""
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    cwd = os.getcwd()
    if e.name != name.split(".")[0] or cwd in sys.path or "" in sys.path:
      raise
    if not (os.path.isfile(os.path.join(cwd, e.name + ".py")) or os.path.isdir(os.path.join(cwd, e.name))):
      raise
    sys.path.append(cwd)  # kept: the workers of a pool inherit the parent's path
    return importlib.import_module(name)


def import_modules(module: ModuleSpec, setting: str, *, describe: Optional[Callable[[BaseException], str]] = None,
                   in_workers: bool = False) -> List[str]:
  """Imports the module(s) of `setting`; returns their names.

  Args:
    module: a module name, a list of them, or None (nothing to import).
    setting: the setting's name in messages ("TASK_MODULE", "MIXTURE_OR_TASK_MODULE").
    describe: error -> its one-line description (default `error_line`).
    in_workers: import them in the worker processes of the run's pools too (`pool_kwargs`).

  Raises:
    ConfigError: "cannot import SETTING 'name': what went wrong", in one line.
  """
  describe = describe or error_line
  names = module_names(module, setting)
  for name in names:
    try:
      _import(name)
    except Exception as e:  # pylint: disable=broad-except  # the user's code failed; Ctrl-C still stops us
      raise ConfigError(f"cannot import {setting} {name!r}: {describe(e)}") from e
    if in_workers and name not in _IN_WORKERS:
      _IN_WORKERS.append(name)
  return names


def worker_modules() -> List[str]:
  """The modules every worker process imports first (those imported with `in_workers=True`)."""
  return list(_IN_WORKERS)


def _import_in_worker(names: Sequence[str], path: Sequence[str]) -> None:
  """A pool's initializer. The run's process imported these modules already: a failure here is
  logged, not raised (a pool whose initializer raises starts new workers without end)."""
  for entry in path:
    if entry not in sys.path:
      sys.path.append(entry)
  for name in names:
    try:
      importlib.import_module(name)
    except Exception as e:  # pylint: disable=broad-except
      logger.warning("worker process %d: cannot import %r: %s", os.getpid(), name, error_line(e))


def pool_kwargs() -> Dict[str, Any]:
  """Keyword arguments of `multiprocessing` pools (`initializer`, `initargs`) that import the user's
  task modules in each worker; {} when there are none."""
  if not _IN_WORKERS:
    return {}
  return {"initializer": _import_in_worker, "initargs": (tuple(_IN_WORKERS), tuple(sys.path))}
