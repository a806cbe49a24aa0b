"""The command line's verbosity and logging: --verbosity / -v / -q, one stderr handler, the stdout reports.

`configure_logging` sets up a command-line run (`stages/cli.py` before a stage runs, and again
when the stage's own flags give a level); `stage_print` is how a stage prints its report lines,
silent under -q.
"""
import logging
import os
import sys
import traceback
from typing import List, Optional, Sequence, Tuple

from private_t5 import progress
from private_t5.errors import ConfigError

# --verbosity values: names or absl-style integers (1 debug, 0 info, -1 warning, -2 error).
VERBOSITY = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
             "error": logging.ERROR, "quiet": logging.WARNING}
_ABSL_LEVELS = {1: logging.DEBUG, 0: logging.INFO, -1: logging.WARNING, -2: logging.ERROR}
QUIET_ENV = progress.QUIET_ENV  # progress bars off when quiet


def parse_verbosity(value: str) -> Tuple[int, bool]:
  """(logging level, quiet) of a --verbosity value; quiet turns progress bars off."""
  text = str(value).strip().lower()
  if text in VERBOSITY:
    return VERBOSITY[text], text == "quiet"
  try:
    number = int(text)
  except ValueError:
    raise ConfigError(f"--verbosity={value!r}: use one of {', '.join(VERBOSITY)} "
                                "or an integer (1 debug, 0 info, -1 warning, -2 error)") from None
  level = _ABSL_LEVELS.get(max(-2, min(1, number)))
  return level, level >= logging.WARNING


def pop_verbosity(argv: Sequence[str]) -> Tuple[List[str], Optional[Tuple[int, bool]]]:
  """Removes --verbosity=LEVEL / --verbosity LEVEL / -v / -q from argv; returns (rest, setting)."""
  rest, setting = [], None
  it = iter(argv)
  for arg in it:
    if arg.startswith("--verbosity="):
      setting = parse_verbosity(arg.split("=", 1)[1])
    elif arg == "--verbosity":
      value = next(it, None)
      if value is None:
        raise ConfigError("--verbosity needs a value")
      setting = parse_verbosity(value)
    elif arg in ("-v", "--verbose"):
      setting = (logging.DEBUG, False)
    elif arg in ("-q", "--quiet"):
      setting = (logging.WARNING, True)
    else:
      rest.append(arg)
  return rest, setting


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
  """Writes to the current `sys.stderr` (not the one at set-up time)."""

  def __init__(self):
    super().__init__(sys.stderr)

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, value):  # StreamHandler.__init__ assigns it
    pass


def is_late_storage_callback(exc_value: BaseException, exc_traceback) -> bool:
  """The error a storage thread meets when it hands a late result to a finished asyncio loop.

  The checkpoint library's storage layer (TensorStore) completes its reads and writes on its own
  threads and posts each result to the asyncio loop that asked for it. When one read or write
  fails (a corrupt checkpoint file, a disk that fills up half-way), the loop ends with that
  error while other transfers are in flight, and each late one raises "Event loop is closed"
  in `call_soon_threadsafe`, which Python reports as an unraisable exception. The real error is
  the one the stage reports in one line.
  """
  if not isinstance(exc_value, RuntimeError) or str(exc_value) != "Event loop is closed":
    return False
  return any(frame.name == "call_soon_threadsafe" and frame.filename.endswith(os.path.join("asyncio", "base_events.py"))
             for frame in traceback.extract_tb(exc_traceback))


def _quiet_unraisablehook(unraisable) -> None:
  """`sys.unraisablehook` without the storage threads' late callbacks (shown with debug)."""
  if is_late_storage_callback(unraisable.exc_value, unraisable.exc_traceback):
    return
  sys.__unraisablehook__(unraisable)


def is_late_storage_task(record: logging.LogRecord) -> bool:
  """asyncio's "Task exception was never retrieved" for a checkpoint transfer of the checkpoint library.

  When one write of a checkpoint fails (a disk that fills up half-way), the save ends with that
  error, the run directory's temporary folder is removed, and the writes still in flight fail on
  the missing folder; nobody awaits them any more, so asyncio logs each one when its task is
  collected, at any later time. The real error is the one the stage reports in one line.
  """
  if record.name != "asyncio":
    return False
  text = record.getMessage()
  return (text.startswith("Task exception was never retrieved")
          and os.path.join("orbax", "checkpoint") in text)


class _DropLateStorageTasks(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    return not is_late_storage_task(record)


_LATE_STORAGE_TASKS = _DropLateStorageTasks()


def stage_print(message: str) -> None:
  """A stage's report line on stdout (`[train] ...`, `[privacy] ...`, progress): what the
  libraries' `log` prints. Dropped under -q and --verbosity=warning or error; errors and warnings
  still reach stderr through logging."""
  if not _SILENT_STDOUT:
    print(message, flush=True)


# True after configure_logging with a level above INFO (-q, --verbosity=warning or error).
_SILENT_STDOUT = False


def configure_logging(level: int = logging.INFO, quiet: bool = False) -> None:
  """Sets up stdlib logging for a command-line run: one stderr handler, `level` for this package."""
  root = logging.getLogger()
  if not any(getattr(h, "_private_t5", False) for h in root.handlers):
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
    handler._private_t5 = True  # pylint: disable=protected-access
    root.addHandler(handler)
  # Other libraries (JAX, TensorFlow, orbax, absl) speak at WARNING and above unless --verbosity=debug.
  root.setLevel(level if level <= logging.DEBUG else max(level, logging.WARNING))
  logging.getLogger("private_t5").setLevel(level)
  sys.unraisablehook = sys.__unraisablehook__ if level <= logging.DEBUG else _quiet_unraisablehook
  asyncio_logger = logging.getLogger("asyncio")
  if level <= logging.DEBUG:
    asyncio_logger.removeFilter(_LATE_STORAGE_TASKS)
  else:
    asyncio_logger.addFilter(_LATE_STORAGE_TASKS)
  global _SILENT_STDOUT
  _SILENT_STDOUT = level > logging.INFO
  if quiet:
    os.environ[QUIET_ENV] = "1"
  else:
    os.environ.pop(QUIET_ENV, None)
