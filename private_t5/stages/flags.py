"""One command-line style for every stage: Gin files, Gin overrides, plain flags, verbosity.

Every stage accepts

  --gin_file=FILE (repeatable)   --gin.NAME=VALUE (repeatable)   --verbosity=LEVEL / -v / -q

plus a few plain flags for its common settings, named the same in every stage that has them
(`--corpus`, `--output`, `--model_dir`, `--target_epsilon`, `--delta`, `--vocab_size`, ...).
A stage declares each plain flag in one line with `StageParser.add_flag`:

  * a Gin-configured stage names the binding the flag sets (`gin="MODEL_DIR"`): the flag is
    the same as `--gin.MODEL_DIR=VALUE`, applied after the other overrides;
  * a plain-argument stage reads its defaults from the Gin files' macros: the macro named
    after the flag in capitals (`CORPUS = "a.txt"` in a .gin file is `--corpus=a.txt`), or the
    one the flag names (`macro="DATA_CACHE_DIR"`); the flag wins.

So each flag's Gin counterpart is declared once, beside the flag, and shown in its --help. The
macros are read from the Gin files and from the `--gin.NAME=VALUE` overrides alike, each checked
once against its flag's type (`checks`: an integer is never "4" or 1.5, a boolean never a string)
and by the flag's own `check` (a range); a flag and the same macro or binding given on the command
line with different values is an error.

Old flag names stay accepted as aliases (`aliases=("input",)`) and log a deprecation warning.
The verbosity flags and logging set-up are `stages/verbosity.py`.
"""
import argparse
import ast
import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from private_t5 import checks
from private_t5.errors import ConfigError
from private_t5.stages import gin_utils
# The verbosity and logging helpers, importable from here too.
from private_t5.stages.verbosity import (  # pylint: disable=unused-import
    LOG_FORMAT, QUIET_ENV, VERBOSITY, configure_logging, is_late_storage_callback, parse_verbosity,
    pop_verbosity, stage_print)

logger = logging.getLogger(__name__)

_GIN_HELP = ("--gin_file=FILE (repeatable; later files override earlier ones) and "
             "--gin.NAME=VALUE overrides (a macro such as --gin.MODEL_DIR=/tmp/run or a binding such "
             "as --gin.DPConfig.noise_multiplier=1.1), applied after the files")
_GIN_MACROS_HELP = ("--gin_file=FILE (repeatable; later files override earlier ones) and "
                    "--gin.NAME=VALUE overrides of the flags' macros below (--gin.STEPS=100 is --steps=100), "
                    "applied after the files; a flag wins over the files, and must agree with its own override")


@dataclasses.dataclass
class StageArgs:
  """A stage's parsed command line."""
  args: argparse.Namespace
  gin_files: List[str]
  gin_bindings: List[gin_utils.Binding]

  def __iter__(self):  # args, gin_files, gin_bindings = parser.parse_stage_args(argv)
    return iter((self.args, self.gin_files, self.gin_bindings))


class StageParser(argparse.ArgumentParser):
  """argparse with the common flags of every stage (Gin, verbosity) and declared plain flags."""

  def __init__(self, stage: str, description: str, epilog: Optional[str] = None, gin_required: bool = False,
               macro_entry: str = "T5Config", macros_from_bindings: bool = True, macros_only: bool = False):
    """A stage's parser.

    Args:
      gin_required: --gin_file is required.
      macro_entry: the Gin entry whose names the Gin files may use when the plain flags'
        macros are read (`gin_utils.parse(..., entry=...)`).
      macros_from_bindings: the macros are read from --gin.NAME=VALUE overrides alone too
        (default; False: only with a --gin_file).
      macros_only: the stage reads nothing from Gin but its flags' macros: an override that
        sets anything else is refused (it would be ignored).
    """
    super().__init__(prog=f"private-t5 {stage}", description=description, epilog=epilog,
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    self.stage = stage
    self.gin_required = gin_required
    self.macro_entry = macro_entry
    self.macros_from_bindings = macros_from_bindings
    self.macros_only = macros_only
    self._aliases: Dict[str, str] = {}    # "--input" -> "--corpus"
    self._checks: Dict[str, Callable[[Any, str], Any]] = {}  # dest -> its value's check
    self._gin_names: Dict[str, str] = {}  # dest -> Gin binding the flag sets
    self._macro_flags: Dict[str, Tuple[str, Any, bool, Optional[Sequence[Any]]]] = {}  # dest -> (macro, type,
    # repeatable, choices)
    self._options: Dict[str, List[str]] = {}  # dest -> its option strings
    gin = self.add_argument_group("Gin configuration", _GIN_MACROS_HELP if macros_only else _GIN_HELP)
    gin.add_argument("--gin_file", action="append", metavar="FILE",
                     help="Gin file (a path, or a name found in the config search path)"
                     + (" (required)" if gin_required else ""))
    gin.add_argument("--gin.NAME=VALUE", dest="_gin_override_help", action="append", metavar="",
                     help="override a Gin macro or binding")
    gin.add_argument("--gin_search_paths", metavar="DIR1,DIR2",
                     help="folders where Gin file names and includes are looked up, after the "
                     "current directory and before the configs shipped in the package")
    logs = self.add_argument_group("logging")
    logs.add_argument("--verbosity", metavar="LEVEL",
                      help=f"{', '.join(VERBOSITY)} or an integer (1 debug .. -2 error); default info")
    logs.add_argument("-v", "--verbose", action="store_true", help="same as --verbosity=debug")
    logs.add_argument("-q", "--quiet", action="store_true",
                      help="warnings only, no progress bars (same as --verbosity=quiet)")
    self.flag_group = self.add_argument_group("common settings")

  def add_flag(self, name: str, *, gin: Optional[str] = None, aliases: Sequence[str] = (),
               macro: Union[bool, str] = True, check: Optional[Callable[[Any, str], Any]] = None,
               **kwargs) -> None:
    """Declares `--name` (plus deprecated `--alias` names).

    Args:
      name: the flag's name without dashes.
      gin: the Gin binding the flag sets (a macro `MODEL_DIR` or `configurable.param`).
      aliases: old names still accepted, with a deprecation warning.
      macro: without `gin`, a value the Gin files or overrides give macro NAME.upper() (True) or
        the macro named here (a string) is the default; False: none.
      check: `check(value, name)` returns the value to use or raises ConfigError naming `name`
        ("--num_bands" or "Gin macro NUM_BANDS"): run once on the value, wherever it came from
        (not on an unset flag's None).
      **kwargs: `argparse.add_argument` keywords (type, help, choices, action, ...).
    """
    if check is not None:
      self._checks[name] = check
    for alias in aliases:
      self._aliases["--" + alias] = "--" + name
    if aliases:
      kwargs["help"] = (kwargs.get("help") or "") + f" (old name{'s' if len(aliases) > 1 else ''}: " \
          + ", ".join("--" + a for a in aliases) + ", deprecated)"
    if gin:
      kwargs["help"] = (kwargs.get("help") or "") + f" [Gin: {gin}]"
      self._gin_names[name] = gin
    elif macro:
      macro_name = macro if isinstance(macro, str) else name.upper()
      kwargs["help"] = (kwargs.get("help") or "") + f" [Gin macro: {macro_name}]"
      kind = bool if kwargs.get("action") in ("store_true", "store_false") else kwargs.get("type", str)
      self._macro_flags[name] = (macro_name, kind, kwargs.get("action") == "append", kwargs.get("choices"))
    kwargs.setdefault("dest", name)
    self._options[name] = ["--" + name] + ["--" + a for a in aliases]
    self.flag_group.add_argument("--" + name, *["--" + a for a in aliases], **kwargs)

  def error(self, message: str):
    """A bad command line is a ConfigError (one line, exit status 2), not argparse's SystemExit."""
    if message.startswith("unrecognized arguments:"):
      message = "unknown flag(s)" + message[len("unrecognized arguments"):] + " (see --help)"
    raise ConfigError(f"{self.prog}: {message}")

  def _warn_aliases(self, argv: Sequence[str]) -> None:
    for arg in argv:
      option = arg.split("=", 1)[0]
      if option in self._aliases:
        logger.warning("%s %s is deprecated; use %s", self.prog, option, self._aliases[option])

  def parse_stage_args(self, argv: Sequence[str]) -> StageArgs:
    """Parses argv: Gin files and overrides, verbosity, plain flags (as Gin bindings or args)."""
    argv = list(argv)
    rest, files, bindings = gin_utils.split_gin_args(argv)
    self._warn_aliases(rest)
    args = self.parse_args(rest)
    setting = None
    if args.verbosity is not None:
      setting = parse_verbosity(args.verbosity)
    elif args.verbose:
      setting = (logging.DEBUG, False)
    elif args.quiet:
      setting = (logging.WARNING, True)
    if setting is not None:
      configure_logging(*setting)
    gin_utils.set_search_paths(args.gin_search_paths)
    for attr in ("verbosity", "verbose", "quiet", "gin_file", "_gin_override_help", "gin_search_paths"):
      delattr(args, attr)
    if self.gin_required and not files:
      raise ConfigError(f"{self.prog} needs --gin_file=... (see --help)")
    if self.macros_only:
      self._check_only_macros(bindings)
    given = {arg.split("=", 1)[0] for arg in rest if arg.startswith("--")}
    overridden = {_binding_name(b): b for b in bindings}  # the command line's overrides (the last of a name wins)
    for name, gin_name in self._gin_names.items():
      value = getattr(args, name)
      if isinstance(value, list) and len(value) == 1:  # a repeatable flag given once binds its value
        value = value[0]
      if value is not None:
        if gin_name in overridden:
          self._check_same(name, value, overridden[gin_name], _binding_literal(overridden[gin_name]), rest)
        bindings.append(gin_utils.Binding(f"{gin_name}={_gin_literal(value)}", f"--{name}={value}"))
    if self._macro_flags and (files or (self.macros_from_bindings and bindings)):
      self._defaults_from_macros(args, files, bindings, given, overridden, rest)
    for name, check in self._checks.items():
      value = getattr(args, name)
      if value is not None:
        setattr(args, name, check(value, self._source(name, given)))
    return StageArgs(args, files, bindings)

  def _source(self, name: str, given: set) -> str:
    """Where flag `name`'s value came from, as an error names it: "--name" or "Gin macro NAME"."""
    if name in self._macro_flags and not given.intersection(self._options[name]):
      return f"Gin macro {self._macro_flags[name][0]}"
    return f"--{name}"

  def macro_names(self) -> List[str]:
    """The Gin macros the plain flags read, in the order the flags were declared."""
    return [macro for macro, *_ in self._macro_flags.values()]

  def _check_only_macros(self, bindings: Sequence[str]) -> None:
    """ConfigError for an override that sets no flag's macro (a stage with `macros_only`)."""
    macros = self.macro_names()
    for binding in bindings:
      if _binding_name(binding) not in macros:
        raise ConfigError(f"{self.prog}: {getattr(binding, 'flag', '') or binding} sets nothing this stage reads: "
                          f"its Gin macros are {', '.join(macros)}")

  def _check_same(self, name: str, value: Any, binding: str, other: Any, rest: Sequence[str]) -> None:
    """ConfigError unless --name's `value` and the override `binding` (its value `other`) agree;
    `rest`: the plain flags as given (the message quotes the flag)."""
    if not _same_value(value, other):
      flag = next((a for a in reversed(rest) if "=" in a and a.split("=", 1)[0] in self._options[name]),
                  f"--{name}={value}")
      raise ConfigError(f"{self.prog}: {flag} and {getattr(binding, 'flag', '') or binding} set the same setting "
                        "to different values; give one of them")

  def _defaults_from_macros(self, args: argparse.Namespace, files: List[str], bindings: List[str],
                            given: set, overridden: Dict[str, str], rest: Sequence[str]) -> None:
    """Fills plain flags not on the command line from the Gin macros (CORPUS -> --corpus), each
    value checked against the flag's type (`typed_macro`); a flag given on the command line
    beside an override of its macro must agree with it.

    The parsed config stays in place for the stage (its other bindings can be queried).
    """
    gin_utils.parse(files, bindings, check_required=False, entry=self.macro_entry, files_required=False,
                    configurables=bool(files) or not self.macros_only)
    for name, (macro, kind, repeatable, choices) in self._macro_flags.items():
      value = gin_utils.macro_value(macro)
      if value is None:
        continue
      if given.intersection(self._options[name]):  # the flag wins over the files; an override must agree
        if macro in overridden:
          self._check_same(name, getattr(args, name), overridden[macro],
                           typed_macro(value, macro, kind, repeatable, choices), rest)
        continue
      setattr(args, name, typed_macro(value, macro, kind, repeatable, choices))


def typed_macro(value: Any, macro: str, kind: Any, repeatable: bool = False,
                choices: Optional[Sequence[Any]] = None) -> Any:
  """Gin macro `macro`'s `value` as a flag of type `kind` (and `choices`) takes it; ConfigError
  naming the macro when it is not of that type (`checks`: "4" or 1.5 is no integer, "False" no
  boolean) or not one of the choices. A repeatable flag takes a list (one value becomes a list of it)."""
  name = f"Gin macro {macro}"
  if repeatable:
    return [_typed(v, name, kind, choices) for v in (value if isinstance(value, (list, tuple)) else [value])]
  return _typed(value, name, kind, choices)


def _typed(value: Any, name: str, kind: Any, choices: Optional[Sequence[Any]] = None) -> Any:
  value = _typed_value(value, name, kind)
  if choices is not None and value not in choices:
    raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
  return value


def _typed_value(value: Any, name: str, kind: Any) -> Any:
  if kind is bool:
    return checks.boolean(value, name)
  if kind is int:
    return checks.integer(value, name)
  if kind is float:
    return checks.number(value, name)
  if kind is str:
    if isinstance(value, bool) or value is None:
      raise ConfigError(f"{name} must be a string, got {value!r}")
    return value if isinstance(value, (str, list, tuple, dict)) else str(value)
  return kind(value) if callable(kind) and not isinstance(value, (list, tuple)) else value


def _binding_name(binding: str) -> str:
  return binding.split("=", 1)[0].strip()


_UNREADABLE = object()


def _binding_literal(binding: str) -> Any:
  """The Python value an override `NAME=VALUE` gives (bare words as strings, as Gin reads them);
  `_UNREADABLE` for a reference (@fn, %MACRO) or anything else that is not a literal."""
  text = gin_utils.quote_bare_value(binding).split("=", 1)[1].strip()
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return _UNREADABLE


def _same_value(a: Any, b: Any) -> bool:
  """Whether a flag's value and an override's are the same setting (numbers by value, 4 == 4.0)."""
  if b is _UNREADABLE:
    return False
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
  if isinstance(a, (list, tuple)) and len(a) == 1:
    return _same_value(a[0], b)
  if checks.is_finite_number(a) and checks.is_finite_number(b):
    return float(a) == float(b)
  return type(a) is type(b) and a == b  # pylint: disable=unidiomatic-typecheck


def _gin_literal(value: Any) -> str:
  """A Python value as Gin text (strings quoted)."""
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(_gin_literal(v) for v in value) + "]"
  return repr(value)


def check_required(parser: StageParser, args: argparse.Namespace, names: Sequence[str]) -> None:
  """ConfigError naming the plain flags still unset (neither on the command line nor in Gin)."""
  missing = [n for n in names if getattr(args, n) is None]
  if missing:
    raise ConfigError(
        f"{parser.prog}: missing {', '.join('--' + n for n in missing)} (or Gin macro(s) "
        f"{', '.join(n.upper() for n in missing)})")
