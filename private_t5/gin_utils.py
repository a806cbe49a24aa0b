"""Gin plumbing for the entry points (T5X style): layered files, `--gin.NAME=value` overrides.

Gin binds only entry points: the core library never imports gin. `register_configurables()`
exposes the core classes/functions to Gin under short names, once, from the entry points.
"""
import os
import re
from typing import Sequence

import gin

from private_t5.errors import ConfigError
from private_t5.io import write_text_atomic

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_SEARCH_PATHS = (os.getcwd(), PROJECT_ROOT, os.path.join(PROJECT_ROOT, "private_t5"))

_REGISTERED = False
# name -> the Gin-wrapped callable; call `configured(name)()` to get an object with the
# bindings of the parsed config applied.
_CONFIGURABLES = {}


def external(obj, name: str):
  """Registers `obj` with Gin under `name` and remembers the wrapped callable."""
  if name not in _CONFIGURABLES:
    _CONFIGURABLES[name] = gin.external_configurable(obj, name=name)
  return _CONFIGURABLES[name]


def configured(name: str):
  """The Gin-wrapped callable registered as `name` (bindings applied when called)."""
  register_configurables()
  return _CONFIGURABLES[name]


def register_configurables() -> None:
  """Registers core objects as Gin external configurables (idempotent).

  Each entry is `external(obj, name)`; add new ones here so that every entry point sees the
  same names.
  """
  global _REGISTERED
  if _REGISTERED:
    return
  _REGISTERED = True
  from private_t5.models import config as model_config  # pylint: disable=g-import-not-at-top
  external(model_config.T5Config, "T5Config")
  from private_t5.data import glue_tasks  # pylint: disable=g-import-not-at-top
  from private_t5.train import initial_checkpoint  # pylint: disable=g-import-not-at-top
  external(glue_tasks.make_glue_source, "make_glue_source")
  external(initial_checkpoint.finetune_vocab_path, "finetune_vocab_path")
  for hook in _EXTRA_REGISTRATIONS:
    hook()


# Modules that own entry points append zero-argument callables here (at import time) to
# register their own configurables.
_EXTRA_REGISTRATIONS = []


def split_gin_args(argv: Sequence[str]):
  """Splits `--gin_file=F` / `--gin_file F` and `--gin.NAME=VALUE` out of argv.

  Returns (rest_argv, gin_files, gin_bindings).
  """
  rest, files, bindings = [], [], []
  it = iter(argv)
  for arg in it:
    if arg.startswith("--gin_file="):
      files.append(arg.split("=", 1)[1])
    elif arg == "--gin_file":
      try:
        files.append(next(it))
      except StopIteration:
        raise ConfigError("--gin_file needs a value") from None
    elif arg.startswith("--gin."):
      binding = arg[len("--gin."):]
      if "=" not in binding:
        raise ConfigError(f"--gin override {arg!r} must look like --gin.NAME=VALUE")
      bindings.append(binding)
    elif arg.startswith("--gin_bindings="):
      bindings.append(arg.split("=", 1)[1])
    else:
      rest.append(arg)
  return rest, files, bindings


def _resolve(path: str) -> str:
  if os.path.isabs(path) and os.path.exists(path):
    return path
  for base in CONFIG_SEARCH_PATHS:
    candidate = os.path.join(base, path)
    if os.path.exists(candidate):
      return candidate
  raise ConfigError(f"Gin file not found: {path!r} (looked in {', '.join(CONFIG_SEARCH_PATHS)})")


def parse(gin_files: Sequence[str], gin_bindings: Sequence[str] = (), check_required: bool = True) -> None:
  """Parses layered Gin files then overrides; errors name the offending binding.

  With `check_required`, a macro left at `%gin.REQUIRED` is an error that names it.
  """
  register_configurables()
  gin.clear_config()
  for base in CONFIG_SEARCH_PATHS:
    gin.add_config_file_search_path(base)
  if not gin_files:
    raise ConfigError("at least one --gin_file is required")
  files = [_resolve(f) for f in gin_files]
  # Gin wants string macros quoted; accept bare paths/words in overrides for convenience.
  bindings = [_quote_bare_value(b) for b in gin_bindings]
  try:
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
  except (ValueError, SyntaxError, KeyError, IOError) as e:
    raise ConfigError(f"invalid Gin configuration: {_first_line(e)}") from e
  if check_required:
    check_required_macros()


def check_required_macros() -> None:
  """Raises ConfigError naming every macro still bound to %gin.REQUIRED.

  Gin itself only checks `%gin.REQUIRED` bound directly to a parameter; a required *macro*
  would otherwise reach the code as an opaque sentinel object.
  """
  missing = sorted(scope for (scope, selector), params in gin.config._CONFIG.items()  # pylint: disable=protected-access
                   if selector == "gin.macro" and str(params.get("value")) == "%gin.REQUIRED")
  if missing:
    flags = " ".join(f"--gin.{name}=..." for name in missing)
    raise ConfigError(f"missing required Gin macro(s): {', '.join(missing)} (set them with {flags})")


_BARE = re.compile(r"^[A-Za-z_./~][\w./~:-]*$")
_LITERALS = {"True", "False", "None"}


def _quote_bare_value(binding: str) -> str:
  name, value = binding.split("=", 1)
  v = value.strip()
  if _BARE.match(v) and v not in _LITERALS and not v.startswith(("@", "%")):
    v = repr(v)
  return f"{name.strip()} = {v}"


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def call_configured(fn, *args, **kwargs):
  """Calls a Gin-configured function, turning a missing REQUIRED value into a ConfigError."""
  try:
    return fn(*args, **kwargs)
  except (ValueError, TypeError) as e:
    msg = str(e)
    if "REQUIRED" in msg or "required" in msg or "missing" in msg:
      raise ConfigError(f"missing required Gin value: {_first_line(e)}") from e
    raise


def save_operative_config(model_dir: str) -> str:
  """Writes the operative config atomically to MODEL_DIR/config.gin."""
  return write_text_atomic(os.path.join(model_dir, "config.gin"), gin.operative_config_str())
