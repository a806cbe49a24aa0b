"""Gin's command-line arguments: `--gin_file=F` and `--gin.NAME=VALUE` overrides split out of argv."""
import re
from typing import Sequence

from private_t5.errors import ConfigError

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


_BARE = re.compile(r"^[A-Za-z_./~][\w./~:-]*$")
_LITERALS = {"True", "False", "None"}


def quote_bare_value(binding: str) -> str:
  name, value = binding.split("=", 1)
  v = value.strip()
  if _BARE.match(v) and v not in _LITERALS and not v.startswith(("@", "%")):
    v = repr(v)
  return f"{name.strip()} = {v}"
