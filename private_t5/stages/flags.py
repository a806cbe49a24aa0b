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
once against its flag's type (`checks.flag_value`: an integer is never "4" or 1.5, a boolean never
a string) and by the flag's own `check` (a range); a flag and the same macro or binding given on the
command line with different values is an error. The flags' bindings and macros are handled by
`stages/flag_macros.py` (`MacroFlags`, the part of `StageParser` that holds them).

Old flag names stay accepted as aliases (`aliases=("input",)`) and log a deprecation warning.
The verbosity flags and logging set-up are `stages/verbosity.py`.
"""
import argparse
import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from private_t5.data import beam_runner
from private_t5.errors import ConfigError
from private_t5.stages import gin_args
from private_t5.stages import gin_paths
# The flags' Gin bindings and macros; `typed_macro` is importable from here too.
from private_t5.stages.flag_macros import MacroFlags, binding_name
# The verbosity and logging helpers, importable from here too.
from private_t5.stages.verbosity import VERBOSITY, configure_logging, parse_verbosity

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
  gin_bindings: List[gin_args.Binding]

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
    self._options: Dict[str, List[str]] = {}  # dest -> its option strings
    self._macros = MacroFlags(self.prog, macro_entry, macros_only, self._options)  # the flags' Gin bindings and macros
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
    self._macros.declare_gin(name, gin, macro, kwargs)
    kwargs.setdefault("dest", name)
    self._options[name] = ["--" + name] + ["--" + a for a in aliases]
    self.flag_group.add_argument("--" + name, *["--" + a for a in aliases], **kwargs)

  def macro_names(self) -> List[str]:
    """The Gin macros the plain flags read, in the order the flags were declared."""
    return self._macros.macro_names()

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
    rest, files, bindings = gin_args.split_gin_args(argv)
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
    gin_paths.set_search_paths(args.gin_search_paths)
    for attr in ("verbosity", "verbose", "quiet", "gin_file", "_gin_override_help", "gin_search_paths"):
      delattr(args, attr)
    if self.gin_required and not files:
      raise ConfigError(f"{self.prog} needs --gin_file=... (see --help)")
    if self.macros_only:
      self._macros.check_only_macros(bindings)
    given = {arg.split("=", 1)[0] for arg in rest if arg.startswith("--")}
    overridden = {binding_name(b): b for b in bindings}  # the command line's overrides (the last of a name wins)
    self._macros.bind_gin_flags(args, bindings, overridden, rest)
    if self.macro_names() and (files or (self.macros_from_bindings and bindings)):
      self._macros.defaults_from_macros(args, files, bindings, given, overridden, rest)
    for name, check in self._checks.items():
      value = getattr(args, name)
      if value is not None:
        setattr(args, name, check(value, self._macros.source(name, given)))
    if hasattr(args, "runner") and hasattr(args, "beam_options"):  # a stage with `add_runner_flags`
      beam_runner.warn_ignored_options(args.runner, args.beam_options)
    return StageArgs(args, files, bindings)


def check_required(parser: StageParser, args: argparse.Namespace, names: Sequence[str]) -> None:
  """ConfigError naming the plain flags still unset (neither on the command line nor in Gin)."""
  missing = [n for n in names if getattr(args, n) is None]
  if missing:
    raise ConfigError(
        f"{parser.prog}: missing {', '.join('--' + n for n in missing)} (or Gin macro(s) "
        f"{', '.join(n.upper() for n in missing)})")
