"""The one place where a value a user gives is type-checked: booleans, integers and numbers.

Gin macros and bindings, command-line flags, audit records and task files all reach the code as
Python values; a string is never a boolean ("False" is truthy), a boolean is never a number, and a
number is finite unless said otherwise. Every check raises `ConfigError` naming the setting, so
the command prints one line. `check_annotation` checks a value against a parameter's type
annotation (what the Gin layer calls for every binding it parses); `flag_value` checks one against
a command-line flag's type, and `same_setting` says whether two values set a setting alike (a flag
beside the override of its Gin macro).
"""
import math
import numbers
import typing
from typing import Any, Optional, Sequence

from private_t5.errors import ConfigError

_MISSING = object()


def _show(value: Any) -> str:
  return f"{value!r} ({type(value).__name__})"


def is_integer(value: Any) -> bool:
  """Whether `value` is an integer (a bool is not)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
  """Whether `value` is a finite real number (a bool or a string is not)."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def boolean(value: Any, name: str, *, optional: bool = False) -> Optional[bool]:
  """`value` if it is a bool (True/False, NumPy's too); None when `optional`; else ConfigError."""
  if value is None and optional:
    return None
  if isinstance(value, bool) or type(value).__name__ == "bool_":
    return bool(value)
  raise ConfigError(f"{name} must be True or False, got {_show(value)}"
                    + (" (a string is not a boolean: write True or False without quotes)"
                       if isinstance(value, str) else ""))


def integer(value: Any, name: str, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
            optional: bool = False) -> Optional[int]:
  """`value` as an int if it is an integer (not a bool) within [minimum, maximum]; None when
  `optional` and None; else ConfigError."""
  if value is None and optional:
    return None
  if not is_integer(value):
    raise ConfigError(f"{name} must be an integer, got {_show(value)}")
  value = int(value)
  if minimum is not None and value < minimum:
    raise ConfigError(f"{name} must be >= {minimum}, got {value}")
  if maximum is not None and value > maximum:
    raise ConfigError(f"{name} must be <= {maximum}, got {value}")
  return value


def number(value: Any, name: str, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
           positive: bool = False, finite: bool = True, optional: bool = False) -> Optional[float]:
  """`value` as a float if it is a real number (not a bool, not a string), finite unless
  `finite=False` (NaN is never accepted), > 0 when `positive`, within [minimum, maximum]; None when
  `optional` and None; else ConfigError."""
  if value is None and optional:
    return None
  if isinstance(value, str) and value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
    raise ConfigError(f"{name} must be finite, got {value.strip()}")  # a flag's nan or inf, as Gin passes it
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ConfigError(f"{name} must be a number, got {_show(value)}")
  value = float(value)
  if math.isnan(value) or (finite and math.isinf(value)):
    raise ConfigError(f"{name} must be finite, got {value}")
  if positive and not value > 0:
    raise ConfigError(f"{name} must be > 0, got {value:g}")
  if minimum is not None and value < minimum:
    raise ConfigError(f"{name} must be >= {minimum:g}, got {value:g}")
  if maximum is not None and value > maximum:
    raise ConfigError(f"{name} must be <= {maximum:g}, got {value:g}")
  return value


def probability(value: Any, name: str, *, optional: bool = False) -> Optional[float]:
  """`value` as a float if it is a number in the open interval (0, 1) (a δ); None when `optional`
  and None; else ConfigError."""
  value = number(value, name, positive=True, optional=optional)
  if value is not None and not value < 1:
    raise ConfigError(f"{name} must be < 1, got {value:g}")
  return value


def check_annotation(value: Any, annotation: Any, name: str) -> None:
  """ConfigError when `value` cannot be what `annotation` (a parameter's type hint) says.

  Only the kinds users get wrong are checked: bool (a string or a number is not one), int (a
  bool, a float or a string is not one) and float (a bool or a string is not one; NaN is
  refused), alone or inside Optional/Union; other annotations accept anything.
  """
  if annotation is bool:
    boolean(value, name)
  elif annotation is int:
    integer(value, name)
  elif annotation is float:
    number(value, name, finite=False)
  elif typing.get_origin(annotation) is typing.Union:
    options = typing.get_args(annotation)
    if value is None and type(None) in options:
      return
    checked = [a for a in options if a in (bool, int, float)]
    if not checked or len(checked) != len([a for a in options if a is not type(None)]):
      return  # another type is allowed too (a string, a sequence, ...): nothing to check here
    errors = []
    for option in checked:
      try:
        check_annotation(value, option, name)
        return
      except ConfigError as e:
        errors.append(e)
    raise errors[-1]


def flag_value(value: Any, name: str, kind: Any, choices: Optional[Sequence[Any]] = None) -> Any:
  """`value` as a flag of type `kind` (and `choices`) takes it; ConfigError naming `name` when it is
  not of that type ("4" or 1.5 is no integer, "False" no boolean, None or a bool no string) or not
  one of the choices. A number becomes a str flag's text; another callable `kind` is applied to a
  value that is not a list or tuple."""
  value = _of_kind(value, name, kind)
  if choices is not None and value not in choices:
    raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
  return value


def _of_kind(value: Any, name: str, kind: Any) -> Any:
  if kind is bool:
    return boolean(value, name)
  if kind is int:
    return integer(value, name)
  if kind is float:
    return number(value, name)
  if kind is str:
    if isinstance(value, bool) or value is None:
      raise ConfigError(f"{name} must be a string, got {value!r}")
    return value if isinstance(value, (str, list, tuple, dict)) else str(value)
  return kind(value) if callable(kind) and not isinstance(value, (list, tuple)) else value


def same_setting(a: Any, b: Any) -> bool:
  """Whether values `a` and `b` set a setting alike: numbers by value (4 == 4.0), sequences item by
  item, a one-item sequence `a` as its item; anything else of the same type and equal."""
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(same_setting(x, y) for x, y in zip(a, b))
  if isinstance(a, (list, tuple)) and len(a) == 1:
    return same_setting(a[0], b)
  if is_finite_number(a) and is_finite_number(b):
    return float(a) == float(b)
  return type(a) is type(b) and a == b  # pylint: disable=unidiomatic-typecheck
