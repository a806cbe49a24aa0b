"""User-facing errors: the CLI prints these as one clear line and exits non-zero."""


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
