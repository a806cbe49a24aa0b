"""Every Gin binding's value checked against its parameter's type annotation, once, at parse.

Gin passes what a file or `--gin.NAME=VALUE` says as it is: `ONE_EXAMPLE_PER_DOCUMENT = "False"`
would reach the code as a non-empty string, which Python reads as True. `check_binding_types`
follows every binding (through chains of macros) to the literal the user wrote and checks it with
`private_t5.checks.check_annotation`: a string is never a boolean, a boolean never a number.
"""
import inspect
import typing
from typing import Any

import gin

from private_t5 import checks

# What `macro_target` returns for a chain of macros that ends at no literal.
UNRESOLVED = object()


def macro_target(value: Any, seen: tuple = ()) -> tuple:
  """(the value a chain of macros ends at, the first macro's name): `value` itself and None when it
  is not a macro; `UNRESOLVED` when the chain is unbound or ends at a configurable reference."""
  if not isinstance(value, gin.config.ConfigurableReference):
    return value, None
  if value.configurable.selector != "gin.macro" or not value.evaluate:
    return UNRESOLVED, None  # @fn() or @fn: the value of a call, not the user's literal
  name = value.scoped_selector.rsplit("/", 1)[0]
  params = gin.config._CONFIG.get((name, "gin.macro"))  # pylint: disable=protected-access
  if params is None or "value" not in params or name in seen:
    return UNRESOLVED, name
  target, _ = macro_target(params["value"], seen + (name,))
  return target, name


def _annotations(selector: str) -> dict:
  """Parameter name -> type hint of the configurable `selector` ({} when they cannot be read)."""
  try:
    fn = gin.config._REGISTRY.get_match(selector).wrapped  # pylint: disable=protected-access
    return typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
  except Exception:  # pylint: disable=broad-except
    return {}  # an annotation that does not resolve: nothing to check against


def check_binding_types() -> None:
  """ConfigError when a bound value (directly or through macros) is not of its parameter's type.

  The one check of every Gin binding's type (`checks.check_annotation`): a string is never a
  boolean (`ONE_EXAMPLE_PER_DOCUMENT = "False"` is refused, not read as True), a boolean never a
  number, NaN never a float.
  """
  for (scope, selector), params in list(gin.config._CONFIG.items()):  # pylint: disable=protected-access
    if selector == "gin.macro":
      continue
    hints = _annotations(selector)
    for param, value in params.items():
      if param not in hints:
        continue
      target, macro = macro_target(value)
      if target is UNRESOLVED or str(target) == "%gin.REQUIRED":
        continue
      binding = f"{scope + '/' if scope else ''}{selector.rsplit('.', 1)[-1]}.{param}"
      checks.check_annotation(target, hints[param], f"Gin {macro} (bound to {binding})" if macro else
                              f"Gin binding {binding}")
