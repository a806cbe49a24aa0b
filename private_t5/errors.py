"""User-facing errors: the CLI prints these as one clear line and exits non-zero."""
from typing import Optional


class PrivateT5Error(Exception):
  """Base class for errors caused by user input (config, data, paths)."""


class ConfigError(PrivateT5Error):
  """An invalid, unknown or missing configuration value."""


class DataError(PrivateT5Error):
  """A missing, empty or malformed corpus, vocabulary or dataset."""


class CheckpointError(PrivateT5Error):
  """A checkpoint that is missing, corrupt or belongs to another model."""


class PrivacyError(PrivateT5Error):
  """A privacy parameter that is invalid or gives a meaningless guarantee."""


def with_message(e: PrivateT5Error, message: str, cls: Optional[type] = None) -> PrivateT5Error:
  """A copy of `e` whose message is `message`: of `e`'s class (or `cls`), with `e`'s attributes
  (a damaged store's path and reason, an unreachable target's smallest ε).

  Built without calling the class's `__init__`, whose arguments differ from one error class to
  another (`DamagedStoreError(path, reason)`), so any of them can be copied the same way.
  """
  cls = cls or type(e)
  copy = cls.__new__(cls, message)
  copy.__dict__.update(vars(e))
  return copy
