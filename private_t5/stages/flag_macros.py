"""The plain flags' Gin counterparts, for `flags.StageParser`: bindings, macros and their overrides.

A flag of a Gin-configured stage sets its binding (`--model_dir` is `--gin.MODEL_DIR=...`); a flag
of a plain-argument stage takes its default from its macro (`CORPUS = "a.txt"` is `--corpus=a.txt`),
read from the Gin files and the `--gin.NAME=VALUE` overrides alike and typed as the flag
(`typed_macro`, `checks.flag_value`). A flag given beside an override of its own binding or macro
must agree with it (`checks.same_setting`).
"""
import argparse
import ast
from typing import Any, Dict, List, Optional, Sequence, Tuple

from private_t5 import checks
from private_t5.errors import ConfigError
from private_t5.stages import gin_utils
from private_t5.stages import gin_queries
from private_t5.stages import gin_args

# What `binding_literal` returns for an override whose value is no literal.
UNREADABLE = object()


class MacroFlags:
  """`StageParser`'s part for the flags' Gin bindings and macros: the parser holds one and hands it
  each flag as it is declared (`declare_gin`) and the parsed command line (`bind_gin_flags`,
  `defaults_from_macros`)."""

  def __init__(self, prog: str, macro_entry: str, macros_only: bool, options: Dict[str, List[str]]):
    """`prog`: the stage's name in messages; `macro_entry`, `macros_only`: as `StageParser` takes
    them; `options`: each flag's option strings (dest -> ["--name", "--alias", ...]), the parser's
    own dict, filled as the flags are declared."""
    self.prog, self.macro_entry, self.macros_only, self._options = prog, macro_entry, macros_only, options
    self._gin_names: Dict[str, str] = {}  # dest -> Gin binding the flag sets
    self._macro_flags: Dict[str, Tuple[str, Any, bool, Optional[Sequence[Any]]]] = {}  # dest -> (macro, type,
    # repeatable, choices)

  def declare_gin(self, name: str, gin: Optional[str], macro: Any, kwargs: Dict[str, Any]) -> None:
    """Records flag `name`'s binding `gin`, or else its macro (`add_flag`'s `macro`), in its help too."""
    if gin:
      kwargs["help"] = (kwargs.get("help") or "") + f" [Gin: {gin}]"
      self._gin_names[name] = gin
    elif macro:
      macro_name = macro if isinstance(macro, str) else name.upper()
      kwargs["help"] = (kwargs.get("help") or "") + f" [Gin macro: {macro_name}]"
      kind = bool if kwargs.get("action") in ("store_true", "store_false") else kwargs.get("type", str)
      self._macro_flags[name] = (macro_name, kind, kwargs.get("action") == "append", kwargs.get("choices"))

  def bind_gin_flags(self, args: argparse.Namespace, bindings: List[str], overridden: Dict[str, str],
                      rest: Sequence[str]) -> None:
    """Appends to `bindings` the binding of each given flag that names one (after the overrides); an
    override of the same binding must agree with the flag."""
    for name, gin_name in self._gin_names.items():
      value = getattr(args, name)
      if isinstance(value, list) and len(value) == 1:  # a repeatable flag given once binds its value
        value = value[0]
      if value is not None:
        if gin_name in overridden:
          self._check_same(name, value, overridden[gin_name], binding_literal(overridden[gin_name]), rest)
        bindings.append(gin_args.Binding(f"{gin_name}={gin_literal(value)}", f"--{name}={value}"))

  def source(self, name: str, given: set) -> str:
    """Where flag `name`'s value came from, as an error names it: "--name" or "Gin macro NAME"."""
    if name in self._macro_flags and not given.intersection(self._options[name]):
      return f"Gin macro {self._macro_flags[name][0]}"
    return f"--{name}"

  def macro_names(self) -> List[str]:
    """The Gin macros the plain flags read, in the order the flags were declared."""
    return [macro for macro, *_ in self._macro_flags.values()]

  def check_only_macros(self, bindings: Sequence[str]) -> None:
    """ConfigError for an override that sets no flag's macro (a stage with `macros_only`)."""
    macros = self.macro_names()
    for binding in bindings:
      if binding_name(binding) not in macros:
        raise ConfigError(f"{self.prog}: {getattr(binding, 'flag', '') or binding} sets nothing this stage reads: "
                          f"its Gin macros are {', '.join(macros)}")

  def _check_same(self, name: str, value: Any, binding: str, other: Any, rest: Sequence[str]) -> None:
    """ConfigError unless --name's `value` and the override `binding` (its value `other`) agree;
    `rest`: the plain flags as given (the message quotes the flag)."""
    if other is UNREADABLE or not checks.same_setting(value, other):
      flag = next((a for a in reversed(rest) if "=" in a and a.split("=", 1)[0] in self._options[name]),
                  f"--{name}={value}")
      raise ConfigError(f"{self.prog}: {flag} and {getattr(binding, 'flag', '') or binding} set the same setting "
                        "to different values; give one of them")

  def defaults_from_macros(self, args: argparse.Namespace, files: List[str], bindings: List[str],
                            given: set, overridden: Dict[str, str], rest: Sequence[str]) -> None:
    """Fills plain flags not on the command line from the Gin macros (CORPUS -> --corpus), each
    value checked against the flag's type (`typed_macro`); a flag given on the command line
    beside an override of its macro must agree with it.

    The parsed config stays in place for the stage (its other bindings can be queried).
    """
    gin_utils.parse(files, bindings, check_required=False, entry=self.macro_entry, files_required=False,
                    configurables=bool(files) or not self.macros_only)
    for name, (macro, kind, repeatable, choices) in self._macro_flags.items():
      value = gin_queries.macro_value(macro)
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
  naming the macro when it is not of that type (`checks.flag_value`: "4" or 1.5 is no integer,
  "False" no boolean) or not one of the choices. A repeatable flag takes a list (one value becomes
  a list of it)."""
  name = f"Gin macro {macro}"
  if repeatable:
    return [checks.flag_value(v, name, kind, choices) for v in (value if isinstance(value, (list, tuple)) else [value])]
  return checks.flag_value(value, name, kind, choices)


def binding_name(binding: str) -> str:
  """The name an override `NAME=VALUE` sets."""
  return binding.split("=", 1)[0].strip()


def binding_literal(binding: str) -> Any:
  """The Python value an override `NAME=VALUE` gives (bare words as strings, as Gin reads them);
  `UNREADABLE` for a reference (@fn, %MACRO) or anything else that is not a literal."""
  text = gin_args.quote_bare_value(binding).split("=", 1)[1].strip()
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return UNREADABLE


def gin_literal(value: Any) -> str:
  """A Python value as Gin text (strings quoted)."""
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(gin_literal(v) for v in value) + "]"
  return repr(value)
