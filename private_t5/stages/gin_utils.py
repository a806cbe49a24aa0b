"""Gin plumbing for the stages (T5X style): layered files, `--gin.NAME=value` overrides.

Gin binds only the stages (this package): the library below never imports gin. The names .gin
files may use are `gin_table.GIN_TABLE`, each registered only when a stage that uses it asks
(`parse(..., entry=NAME)`). Files are found along `gin_paths`, overrides come from `gin_args`,
every bound value is type-checked by `gin_types`, errors are put in one line by `gin_errors`, what the
parsed config binds is read by `gin_queries`; their public names are importable from here too.
"""
import importlib
import logging
import tokenize
from typing import Iterable, Optional, Sequence, Union

import gin

from private_t5 import errors
from private_t5.errors import ConfigError
# pylint: disable=unused-import
from private_t5.stages.gin_args import Binding, quote_bare_value
from private_t5.stages.gin_errors import check_syntax, describe_syntax_error, first_line, unwrap_error
from private_t5.stages.gin_paths import find_file, search_paths
from private_t5.stages.gin_queries import check_required_macros, ignored_dp_settings
from private_t5.stages.gin_table import CONFIGURABLES, ENTRIES, STAGE_CONFIGURABLES
from private_t5.stages.gin_types import check_binding_types
# pylint: enable=unused-import

# name -> the Gin-wrapped callable; `configured(name)()` applies the parsed bindings.
_WRAPPED = {}


def external(obj, name: str):
  """Registers `obj` with Gin under `name` (once) and returns the wrapped callable.

  For configurables outside the package (scripts); the package's own are in `CONFIGURABLES`.
  """
  if name not in _WRAPPED:
    _WRAPPED[name] = gin.external_configurable(obj, name=name)
  return _WRAPPED[name]


def resolve(target: str):
  """The object a "module:attribute" registry entry names (imports its module)."""
  module, attr = target.split(":", 1)
  return getattr(importlib.import_module(module), attr)


def register(names: Optional[Iterable[str]] = None) -> None:
  """Registers `names` (default: every entry of `CONFIGURABLES`) with Gin; idempotent."""
  for name in (CONFIGURABLES if names is None else names):
    if name not in _WRAPPED:
      if name not in CONFIGURABLES:
        raise ConfigError(f"no Gin configurable named {name!r} is registered")
      external(resolve(CONFIGURABLES[name]), name)


def configured(name: str):
  """The Gin-wrapped callable registered as `name` (bindings applied when called)."""
  register((name,))
  return _WRAPPED[name]


def _quiet_include_lookups(record: logging.LogRecord) -> bool:
  """Drops Gin's log lines for each search-path folder that lacks an included file."""
  return not str(record.msg).startswith(("Path not found", "system_path_file_exists"))


def parse(gin_files: Sequence[str], gin_bindings: Sequence[str] = (), check_required: bool = True,
          entry: Optional[str] = None, gin_search_paths: Union[None, str, Sequence[str]] = None,
          files_required: bool = True, configurables: bool = True) -> None:
  """Parses layered Gin files then overrides; errors name the offending file or binding.

  Args:
    gin_files: files, in order (later ones override earlier ones).
    gin_bindings: `NAME=VALUE` overrides, applied last.
    check_required: a macro left at `%gin.REQUIRED` is an error that names it.
    entry: the configurable the stage will call: only the names of its
      `STAGE_CONFIGURABLES` entry are registered. None: every name in `CONFIGURABLES`.
    gin_search_paths: extra folders searched after the current directory and before the
      package's configs, for the files and their `include`s; None: the command line's
      `--gin_search_paths=a,b` (`set_search_paths`).
    files_required: False for stages whose Gin files are optional (bindings alone are parsed).
    configurables: False registers nothing (macros alone are parsed, without importing the
      modules the configurables live in).
  """
  if entry and entry not in STAGE_CONFIGURABLES:
    raise ConfigError(f"no Gin stage entry named {entry!r} (one of {', '.join(ENTRIES)})")
  if configurables:
    register(STAGE_CONFIGURABLES[entry] if entry else None)
  gin.clear_config()
  paths = search_paths(gin_search_paths)
  _set_include_search_path(paths)
  if not gin_files and files_required:
    raise ConfigError("at least one --gin_file is required")
  files = [find_file(f, paths) for f in gin_files]
  # Gin wants string macros quoted; accept bare paths/words in overrides for convenience.
  bindings = [Binding(quote_bare_value(b), getattr(b, "flag", "")) for b in gin_bindings]
  check_syntax(files, bindings)
  root_logger = logging.getLogger()
  root_logger.addFilter(_quiet_include_lookups)
  try:
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
  except SyntaxError as e:  # in an included file
    where = f" in {e.filename}" if e.filename else ""
    text = _read_text(e.filename) or ""
    raise ConfigError(f"invalid Gin syntax{where}: {describe_syntax_error(e, text)}") from e
  except (ValueError, KeyError, IOError, TypeError, tokenize.TokenError) as e:
    raise ConfigError(f"invalid Gin configuration: {first_line(e)}") from e
  finally:
    root_logger.removeFilter(_quiet_include_lookups)
  if check_required:
    check_required_macros()
  check_binding_types()


# Gin's private state, its one use here (gin_queries lists the macros bound so far). Gin 0.5 has
# no public call that replaces its include search path (`add_config_file_search_path` only
# appends, and a file reader registered with `register_file_reader` comes after Gin's package
# reader, which fails on names such as `configs/models/x.gin`).


def _set_include_search_path(paths: Sequence[str]) -> None:
  """Makes `paths`, then Gin's default "", the folders where Gin looks up `include`d files.

  Gin keeps its search path across parses: it is rebuilt. The folders come before "" so that
  an `include` is found as a file first: with "" first, Gin's package reader would take
  `configs/models` for a Python package name and can fail on it.
  """
  del gin.config._LOCATION_PREFIXES[:]  # pylint: disable=protected-access
  for base in list(paths) + [""]:
    gin.add_config_file_search_path(base)


def _read_text(path: Optional[str]) -> Optional[str]:
  """The text of file `path`, or None when it cannot be read."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, TypeError, UnicodeDecodeError):
    return None


def run_stage(gin_files: Sequence[str], gin_bindings: Sequence[str], entry: str, **kwargs):
  """Runs a Gin stage: joins the JAX processes (several processes only; before any other JAX
  call), parses the files and overrides for `entry` (warning about DP settings a non-private run
  ignores), keeps TensorFlow off the accelerators, then calls `entry` (with `kwargs`, which are
  not Gin's); returns its result."""
  from private_t5.train import partitioning  # pylint: disable=g-import-not-at-top
  partitioning.initialize_distributed()
  parse(gin_files, gin_bindings, entry=entry, check_required=False)
  ignored = ignored_dp_settings(entry, gin_bindings)
  if ignored:
    logging.getLogger(__name__).warning(
        "%s.dp is None (DP=None: a non-private run, no noise at all), so these DP settings are ignored: %s",
        entry, ", ".join(ignored))
  check_required_macros()
  partitioning.hide_accelerators_from_tensorflow()
  return call_configured(configured(entry), **kwargs)


def call_configured(fn, *args, **kwargs):
  """Calls a Gin-configured function; errors come out as the project's own, in one line.

  A missing REQUIRED value becomes a ConfigError; a `PrivateT5Error` raised inside loses Gin's
  proxy class and its "In call to configurable" context.
  """
  try:
    return fn(*args, **kwargs)
  except errors.PrivateT5Error as e:
    clean = unwrap_error(e)
    if clean is e:
      raise
    raise clean from e
  except (ValueError, TypeError) as e:
    msg = str(e)
    if "REQUIRED" in msg or "required" in msg or "missing" in msg:
      raise ConfigError(f"missing required Gin value: {first_line(e)}") from e
    raise


def operative_config() -> str:
  """The operative Gin config so far (what a run's MODEL_DIR/config.gin holds)."""
  return gin.operative_config_str()
