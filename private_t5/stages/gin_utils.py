"""Gin plumbing for the stages (T5X style): layered files, `--gin.NAME=value` overrides.

Gin binds only the stages (this package): the library below never imports gin.
`GIN_TABLE` is the one table of the names .gin files may use: each name maps to
"module:attribute" and to the stage entries that use it, and is imported and registered only
when such a stage asks for it (`parse(..., entry=NAME)`), so that `private-t5 info` does not
import the trainer. `CONFIGURABLES` and `STAGE_CONFIGURABLES` are views of it.
"""
import importlib
import io
import logging
import os
import re
import tokenize
from typing import Any, Iterable, List, Optional, Sequence, Union

import gin
from gin import config_parser

from private_t5 import errors
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

# The one Gin table: each name .gin files may use -> ("module:attribute" of the class or
# function it configures, the stage entries whose `parse(..., entry=...)` registers it).
# The entries are the names listed as users (each lists itself); `CONFIGURABLES`,
# `STAGE_CONFIGURABLES` and `ENTRIES` below are views of this table, never edited by hand.
_MODEL_USERS = ("T5Config", "train", "just_fine_tune_twice", "train_adaptive", "run_memorization", "evaluate", "run_study",
                "run_utility_study")
_TRAINING_USERS = ("train", "just_fine_tune_twice", "train_adaptive", "run_study", "run_utility_study")
GIN_TABLE = {
    # models
    "T5Config": ("private_t5.models.config:T5Config", _MODEL_USERS),
    # training (`private-t5 train`, and the runs built on it)
    "train": ("private_t5.train.main:train", _TRAINING_USERS),
    "DPConfig": ("private_t5.dp.mechanism:DPConfig", _TRAINING_USERS),
    "LoraConfig": ("private_t5.models.lora:LoraConfig", ("train",)),
    "make_source": ("private_t5.data.source:make_source", _TRAINING_USERS),
    "make_glue_source": ("private_t5.data.glue_tasks:make_glue_source", _TRAINING_USERS),
    "make_seqio_source": ("private_t5.data.seqio_source:make_seqio_source", _TRAINING_USERS),
    "seqio_vocab_path": ("private_t5.data.seqio_source:seqio_vocab_path", _TRAINING_USERS),
    "finetune_vocab_path": ("private_t5.train.initial_checkpoint:finetune_vocab_path", _TRAINING_USERS),
    "adafactor": ("private_t5.train.optimizers:adafactor", _TRAINING_USERS),
    "rsqrt_schedule": ("private_t5.train.optimizers:rsqrt_schedule", _TRAINING_USERS),
    "constant_schedule": ("private_t5.train.optimizers:constant_schedule", _TRAINING_USERS),
    "linear_warmup_schedule": ("private_t5.train.optimizers:linear_warmup_schedule", _TRAINING_USERS),
    # selective DP
    "just_fine_tune_twice": ("private_t5.selective.jft:just_fine_tune_twice", ("just_fine_tune_twice",)),
    "train_adaptive": ("private_t5.selective.adaptive_train:train_adaptive", ("train_adaptive",)),
    # evaluation
    "run_memorization": ("private_t5.eval.memorization_run:run_memorization", ("run_memorization",)),
    "SplitConfig": ("private_t5.eval.splits:SplitConfig", ("run_memorization", "run_study")),
    "evaluate": ("private_t5.eval.glue_eval:evaluate", ("evaluate",)),
    # tokenizer
    "train_dp_vocabulary": ("private_t5.tokenizer.dp_spm:train_dp_vocabulary", ("train_dp_vocabulary",)),
    # benchmarks
    "benchmark": ("private_t5.experiments.benchmark:benchmark", ("benchmark",)),
    # the end-to-end study
    "run_study": ("private_t5.experiments.study:run_study", ("run_study",)),
    "run_utility_study": ("private_t5.experiments.study_utility:run_utility_study", ("run_utility_study",)),
}
# Views of GIN_TABLE. Gin name -> "module:attribute".
CONFIGURABLES = {name: target for name, (target, _) in GIN_TABLE.items()}
# The stage entries (the names a `parse(..., entry=...)` may give), in the table's order.
ENTRIES = tuple(dict.fromkeys(user for _, users in GIN_TABLE.values() for user in users))
# Entry -> the names its configs may use (registered by `parse(..., entry=...)`).
STAGE_CONFIGURABLES = {entry: tuple(name for name, (_, users) in GIN_TABLE.items() if entry in users)
                       for entry in ENTRIES}

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


class Binding(str):
  """A `NAME=VALUE` override that remembers the command-line flag that carried it."""
  flag: str = ""

  def __new__(cls, binding: str, flag: str = ""):
    obj = super().__new__(cls, binding)
    obj.flag = flag or binding
    return obj


def split_gin_args(argv: Sequence[str]):
  """Splits `--gin_file=F` / `--gin_file F` and `--gin.NAME=VALUE` out of argv.

  Returns (rest_argv, gin_files, gin_bindings); each binding is a `Binding` (a str) whose
  `flag` is the argument it came from.
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
      bindings.append(Binding(binding, arg))
    elif arg.startswith("--gin_bindings="):
      bindings.append(Binding(arg.split("=", 1)[1], arg))
    else:
      rest.append(arg)
  return rest, files, bindings


def _resolve(path: str, paths: Optional[Sequence[str]] = None) -> str:
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


def _syntax_error(text: str, filename: Optional[str] = None) -> Optional[str]:
  """Gin's syntax error in `text` as "message (line N)", or None; binds nothing."""
  stream = io.StringIO(text)
  if filename:
    stream.name = filename
  try:
    for _ in config_parser.ConfigParser(stream, gin.config.ParserDelegate(skip_unknown=True)):
      pass
  except tokenize.TokenError as e:  # an unclosed bracket or quote: Gin lets the tokenizer's error through
    bracket = _unclosed_bracket(text)
    if bracket:
      return f"{bracket[0]!r}" + (f" opened on line {bracket[1]}" if filename else "") + " is not closed"
    return f"unclosed bracket or quote ({e.args[0]})" + (" at the end of the file" if filename else "")
  except SyntaxError as e:
    return describe_syntax_error(e, text if filename else None)
  return None


# ast.literal_eval's message for a bare word where Gin expects a value, as Gin passes it on.
_NOT_A_VALUE = re.compile(r"malformed node or string.*Failed to parse token '(.*)'", re.DOTALL)


def describe_syntax_error(e: SyntaxError, text: Optional[str] = None) -> str:
  """A Gin SyntaxError in words, for one line.

  In a file (`text`: its content, "" when unknown): "message (line N)", or "'[' opened on line M
  is not closed (line N: message)" when a bracket left open earlier is the cause. In a binding
  (`text` None): the message alone.
  """
  message = (e.msg or "invalid syntax").strip()
  word = _NOT_A_VALUE.match(message)
  bracket = _unclosed_bracket(text, (e.lineno, e.offset or 0)) if e.lineno and text is not None else None
  if bracket and bracket[1] < e.lineno:
    found = f"unexpected {word.group(1)!r}" if word else message.splitlines()[0].rstrip(".")
    return f"{bracket[0]!r} opened on line {bracket[1]} is not closed (line {e.lineno}: {found})"
  if word:
    message = (f"{word.group(1)!r} is not a value: quote a string, write @name for a configurable "
               "or %NAME for a macro")
  else:
    message = message.splitlines()[0].rstrip(".")
  return f"{message} (line {e.lineno})" if e.lineno and text is not None else message


def _unclosed_bracket(text: str, before: Optional[tuple] = None) -> Optional[tuple]:
  """(bracket, line) of the innermost bracket of `text` still open at position `before`
  ((line, column); default: the end), or None."""
  stack = []
  try:
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
      if before and token.start >= before:
        break
      if token.type == tokenize.OP and token.string in "([{":
        stack.append((token.string, token.start[0]))
      elif token.type == tokenize.OP and token.string in ")]}" and stack:
        stack.pop()
  except (tokenize.TokenError, SyntaxError):  # the end of a file with an open bracket, or worse
    pass
  return stack[-1] if stack else None


def check_syntax(files: Sequence[str], bindings: Sequence[str]) -> None:
  """Parses each file and each binding alone (syntax only); the error names it, in one line."""
  for path in files:
    with open(path, encoding="utf-8") as f:
      error = _syntax_error(f.read(), path)
    if error:
      raise ConfigError(f"invalid Gin syntax in {path}: {error}")
  for binding in bindings:
    error = _syntax_error(binding)
    if error:
      flag = getattr(binding, "flag", "") or binding
      raise ConfigError(f"invalid Gin binding {binding!r} (from {flag}): {error}")


def _quiet_include_lookups(record: logging.LogRecord) -> bool:
  """Drops Gin's log lines for each search-path folder that lacks an included file."""
  return not str(record.msg).startswith(("Path not found", "system_path_file_exists"))


def parse(gin_files: Sequence[str], gin_bindings: Sequence[str] = (), check_required: bool = True,
          entry: Optional[str] = None, gin_search_paths: Union[None, str, Sequence[str]] = None,
          files_required: bool = True) -> None:
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
  """
  if entry and entry not in STAGE_CONFIGURABLES:
    raise ConfigError(f"no Gin stage entry named {entry!r} (one of {', '.join(ENTRIES)})")
  register(STAGE_CONFIGURABLES[entry] if entry else None)
  gin.clear_config()
  paths = search_paths(gin_search_paths)
  _set_include_search_path(paths)
  if not gin_files and files_required:
    raise ConfigError("at least one --gin_file is required")
  files = [_resolve(f, paths) for f in gin_files]
  # Gin wants string macros quoted; accept bare paths/words in overrides for convenience.
  bindings = [Binding(_quote_bare_value(b), getattr(b, "flag", "")) for b in gin_bindings]
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
    raise ConfigError(f"invalid Gin configuration: {_first_line(e)}") from e
  finally:
    root_logger.removeFilter(_quiet_include_lookups)
  if check_required:
    check_required_macros()


# Gin's private state: the only two uses, kept here. Gin 0.5 has no public call that
# replaces its include search path (`add_config_file_search_path` only appends, and a file
# reader registered with `register_file_reader` comes after Gin's package reader, which fails
# on names such as `configs/models/x.gin`), nor one that lists the macros bound so far.


def _set_include_search_path(paths: Sequence[str]) -> None:
  """Makes `paths`, then Gin's default "", the folders where Gin looks up `include`d files.

  Gin keeps its search path across parses: it is rebuilt. The folders come before "" so that
  an `include` is found as a file first: with "" first, Gin's package reader would take
  `configs/models` for a Python package name and can fail on it.
  """
  del gin.config._LOCATION_PREFIXES[:]  # pylint: disable=protected-access
  for base in list(paths) + [""]:
    gin.add_config_file_search_path(base)


def _bound_macros() -> dict:
  """Macro name -> the value the parsed config binds it to (every macro bound so far)."""
  return {scope: params.get("value")
          for (scope, selector), params in gin.config._CONFIG.items()  # pylint: disable=protected-access
          if selector == "gin.macro"}


def _read_text(path: Optional[str]) -> Optional[str]:
  """The text of file `path`, or None when it cannot be read."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, TypeError, UnicodeDecodeError):
    return None


def macro_value(name: str) -> Any:
  """The parsed value of Gin macro `name`; None when it is unbound or still %gin.REQUIRED."""
  try:
    value = gin.query_parameter(f"{name}/gin.macro.value")
  except ValueError:
    return None
  return None if value is None or str(value) == "%gin.REQUIRED" else value


def check_required_macros() -> None:
  """Raises ConfigError naming every macro still bound to %gin.REQUIRED.

  Gin itself only checks `%gin.REQUIRED` bound directly to a parameter; a required *macro*
  would otherwise reach the code as an opaque sentinel object.
  """
  missing = sorted(name for name, value in _bound_macros().items() if str(value) == "%gin.REQUIRED")
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


_GIN_CONTEXT = "In call to configurable"


def error_message(e: BaseException) -> str:
  """`e`'s message without the "In call to configurable ..." lines Gin appends."""
  lines = [l for l in str(e).splitlines() if not l.strip().startswith(_GIN_CONTEXT)]
  return "\n".join(lines).strip()


def unwrap_error(e: errors.PrivateT5Error) -> errors.PrivateT5Error:
  """The project's error that Gin wrapped: its own class (not Gin's proxy subclass) and message."""
  cls = next(c for c in type(e).__mro__
             if issubclass(c, errors.PrivateT5Error) and "__getattr__" not in c.__dict__
             and not c.__module__.startswith("gin"))
  if cls is type(e) and _GIN_CONTEXT not in str(e):
    return e
  return cls(error_message(e))


def run_stage(gin_files: Sequence[str], gin_bindings: Sequence[str], entry: str, **kwargs):
  """Runs a Gin stage: joins the JAX processes (several processes only; before any other JAX
  call), parses the files and overrides for `entry`, keeps TensorFlow off the accelerators,
  then calls `entry` (with `kwargs`, which are not Gin's); returns its result."""
  from private_t5.train import partitioning  # pylint: disable=g-import-not-at-top
  partitioning.initialize_distributed()
  parse(gin_files, gin_bindings, entry=entry)
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
      raise ConfigError(f"missing required Gin value: {_first_line(e)}") from e
    raise


def operative_config() -> str:
  """The operative Gin config so far (what a run's MODEL_DIR/config.gin holds)."""
  return gin.operative_config_str()
