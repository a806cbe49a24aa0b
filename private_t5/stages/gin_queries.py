"""What the parsed Gin config binds, for the stages: a macro's value, the macros still
`%gin.REQUIRED`, and the DP settings a non-private run ignores. Importable from `gin_utils` too.
"""
from typing import Any, Sequence

import gin

from private_t5.errors import ConfigError
from private_t5.stages import gin_types
from private_t5.stages.gin_table import STAGE_CONFIGURABLES


def _bound_macros() -> dict:
  """Macro name -> the value the parsed config binds it to (every macro bound so far).

  Reads Gin's private state: Gin 0.5 has no public call that lists the macros bound so far.
  """
  return {scope: params.get("value")
          for (scope, selector), params in gin.config._CONFIG.items()  # pylint: disable=protected-access
          if selector == "gin.macro"}


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


# DPConfig's settings of correlated noise, each with the value that leaves the noise Gaussian.
_CORRELATED_SETTINGS = {"noise": "gaussian", "num_bands": 1, "buffers": None, "strategy_file": None}
_UNBOUND = object()


def _bound_value(name: str) -> Any:
  """The value the parsed config binds `configurable.param` to, through macros; `_UNBOUND` when it
  is unbound or its value is not a literal (a call of a configurable)."""
  try:
    value = gin.query_parameter(name)
  except ValueError:
    return _UNBOUND
  target, _ = gin_types.macro_target(value)
  if target is gin_types.UNRESOLVED or isinstance(target, gin.config.ConfigurableReference):
    return _UNBOUND
  return target


def ignored_dp_settings(entry: str, gin_bindings: Sequence[str] = ()) -> list:
  """The DP settings nothing reads while `entry`'s `dp` is None (a non-private run, e.g.
  --gin.DP=None): the correlated-noise settings the parsed config gives DPConfig
  ("DPConfig.num_bands=4"), and the command line's other DPConfig overrides and flags
  ("--target_epsilon=3"; `gin_bindings`: the overrides, each with the flag that carried it)."""
  if "DPConfig" not in STAGE_CONFIGURABLES.get(entry, ()) or _bound_value(f"{entry}.dp") is not None:
    return []
  settings = []
  for param, default in _CORRELATED_SETTINGS.items():
    value = _bound_value(f"DPConfig.{param}")
    if value is not _UNBOUND and value != default:
      settings.append(f"DPConfig.{param}={value!r}")
  for binding in gin_bindings:
    name = binding.split("=", 1)[0].strip()
    flag = getattr(binding, "flag", "") or binding
    if (name.startswith("DPConfig.") and name[len("DPConfig."):] not in _CORRELATED_SETTINGS and "=" in flag
        and flag not in settings):
      settings.append(flag)  # a flag that only follows another one (no "=VALUE") is not the user's
  return settings
