"""Orbax for the checkpoint modules: imported on first use with its own error logs kept quiet,
the items every checkpoint holds, and one short line for what made an Orbax call fail."""
import inspect
import logging
import os
import re

from private_t5.lazy_imports import lazy_module

# The two items of every checkpoint: the train state (arrays) and its metadata (JSON).
STATE_ITEM = "state"
METADATA_ITEM = "metadata"

# Warnings orbax logs on every read-only checkpoint read: routine, not for users.
_ROUTINE_ORBAX_WARNINGS = ("CheckpointManagerOptions.read_only=True", "Given directory is read only",
                           "Metadata file does not exist")


class _OrbaxErrorFilter(logging.Filter):
  """Drops orbax's own error logs, and its routine warnings of a read, unless private_t5 logs at
  DEBUG (`--verbosity=debug`).

  A failed save makes orbax log the same error with a full traceback from each of its
  background threads; `CheckpointManager.save`/`wait` report it as one CheckpointError line.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    routine = record.levelno == logging.WARNING and str(record.msg).startswith(_ROUTINE_ORBAX_WARNINGS)
    if (record.levelno < logging.ERROR and not routine) or not _called_from_orbax(record):
      return True
    return logging.getLogger("private_t5").isEnabledFor(logging.DEBUG)


def _called_from_orbax(record: logging.LogRecord) -> bool:
  # `record.pathname` names orbax only once absl's logger class is set up (it skips absl's own
  # frames); otherwise the caller is found on the stack of the logging call.
  orbax_dir = f"{os.sep}orbax{os.sep}"
  if orbax_dir in record.pathname:
    return True
  frame = inspect.currentframe()
  while frame is not None:
    if orbax_dir in frame.f_code.co_filename:
      return True
    frame = frame.f_back
  return False


_ORBAX_ERROR_FILTER = _OrbaxErrorFilter()


def quiet_orbax_errors() -> None:
  """Adds the filter of orbax's own error logs (`_OrbaxErrorFilter`) to absl's logger, once."""
  absl_logger = logging.getLogger("absl")  # orbax logs through absl
  if _ORBAX_ERROR_FILTER not in absl_logger.filters:
    absl_logger.addFilter(_ORBAX_ERROR_FILTER)


# Slow to import: imported on first use, its loggers quieted right before (`quiet_orbax_errors`).
ocp = lazy_module("orbax.checkpoint", needed_for="reading and writing checkpoints",
                  install="orbax-checkpoint (requirements.txt)", before=quiet_orbax_errors)


# TensorStore (orbax's array writer) ends an OS failure with the errno: "... [os_error_code='28']".
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_MAX_CAUSE_CHARS = 200


def _chain(error: BaseException):
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def cause(error: BaseException) -> str:
  """One short line: the OS reason of an OSError (also one that orbax or TensorStore wrapped in
  a long message, e.g. "No space left on device"), else the exception's type and first line."""
  for e in _chain(error):
    if isinstance(e, OSError) and e.strerror:
      return e.strerror
  for e in _chain(error):
    match = _OS_ERROR_CODE.search(str(e))
    if match:
      return os.strerror(int(match.group(1)))
  text = str(error).strip().splitlines()
  line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
  return line if len(line) <= _MAX_CAUSE_CHARS else line[:_MAX_CAUSE_CHARS - 3] + "..."
