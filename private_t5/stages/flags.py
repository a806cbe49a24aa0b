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

So each flag's Gin counterpart is declared once, beside the flag, and shown in its --help.

Old flag names stay accepted as aliases (`aliases=("input",)`) and log a deprecation warning.
The verbosity flags and logging set-up are `stages/verbosity.py`.
"""
import argparse
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

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
               macro_entry: str = "T5Config", macros_from_bindings: bool = False):
    """A stage's parser.

    Args:
      gin_required: --gin_file is required.
      macro_entry: the Gin entry whose names the Gin files may use when the plain flags'
        macros are read (`gin_utils.parse(..., entry=...)`).
      macros_from_bindings: the macros are read from --gin.NAME=VALUE overrides alone too
        (default: only with a --gin_file).
    """
    super().__init__(prog=f"private-t5 {stage}", description=description, epilog=epilog,
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    self.stage = stage
    self.gin_required = gin_required
    self.macro_entry = macro_entry
    self.macros_from_bindings = macros_from_bindings
    self._aliases: Dict[str, str] = {}    # "--input" -> "--corpus"
    self._gin_names: Dict[str, str] = {}  # dest -> Gin binding the flag sets
    self._macro_flags: Dict[str, Tuple[str, Any, bool]] = {}  # dest -> (macro, type, repeatable)
    self._options: Dict[str, List[str]] = {}  # dest -> its option strings
    gin = self.add_argument_group("Gin configuration", _GIN_HELP)
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
               macro: Union[bool, str] = True, **kwargs) -> None:
    """Declares `--name` (plus deprecated `--alias` names).

    Args:
      name: the flag's name without dashes.
      gin: the Gin binding the flag sets (a macro `MODEL_DIR` or `configurable.param`).
      aliases: old names still accepted, with a deprecation warning.
      macro: without `gin`, a value the Gin files give macro NAME.upper() (True) or the macro
        named here (a string) is the default; False: none.
      **kwargs: `argparse.add_argument` keywords (type, help, choices, action, ...).
    """
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
      self._macro_flags[name] = (macro_name, kwargs.get("type", str), kwargs.get("action") == "append")
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
    for name, gin_name in self._gin_names.items():
      value = getattr(args, name)
      if isinstance(value, list) and len(value) == 1:  # a repeatable flag given once binds its value
        value = value[0]
      if value is not None:
        bindings.append(gin_utils.Binding(f"{gin_name}={_gin_literal(value)}", f"--{name}={value}"))
    if self._macro_flags and (files or (self.macros_from_bindings and bindings)):
      given = {arg.split("=", 1)[0] for arg in rest if arg.startswith("--")}
      self._defaults_from_macros(args, files, bindings, given)
    return StageArgs(args, files, bindings)

  def _defaults_from_macros(self, args: argparse.Namespace, files: List[str], bindings: List[str],
                            given: set) -> None:
    """Fills plain flags not on the command line from the Gin files' macros (CORPUS -> --corpus).

    The parsed config stays in place for the stage (its other bindings can be queried).
    """
    gin_utils.parse(files, bindings, check_required=False, entry=self.macro_entry, files_required=False)
    for name, (macro, kind, repeatable) in self._macro_flags.items():
      if given.intersection(self._options[name]):
        continue
      value = gin_utils.macro_value(macro)
      if value is None:
        continue
      if not isinstance(value, (list, tuple)) and callable(kind):
        value = kind(value)
      if repeatable and not isinstance(value, (list, tuple)):
        value = [value]
      setattr(args, name, value)


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
