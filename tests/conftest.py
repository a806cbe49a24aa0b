"""Shared test setup: quiet TensorFlow, 8 fake CPU devices for mesh tests, real-text data paths."""
import errno
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_HOME", tempfile.mkdtemp(prefix="keras_home_"))
# Tests check behaviour, not speed: XLA skips most of its optimization passes, which makes the
# suite's many small compilations 2-3x cheaper (inherited by the stages the tests start as
# subprocesses). Real runs and `private-t5 bench` compile with full optimization; no test
# asserts a speed or memory figure of its own run.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# 8 CPU devices so that mesh/sharding tests run on one machine; must precede `import jax`.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # pylint: disable=g-import-not-at-top

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The full data set, when a checkout has it beside the project (see tests/data/README.md).
SHARED_DATA = os.path.abspath(os.path.join(PROJECT_ROOT, "..", "shared", "data"))
# The small fixtures shipped in the repository: same formats, same layout, fewer rows.
FIXTURE_DATA = os.path.join(PROJECT_ROOT, "tests", "data")
USING_SHARED_DATA = os.path.isdir(SHARED_DATA)
# Fixture files standing in for full-data files that are not shipped (licence or size).
FIXTURE_FOR = {"pretrain/linux_docs.jsonl.gz": "pretrain/python_docs.jsonl.gz"}


def data_root() -> str:
  """The data folder the tests read: ../shared/data when present, otherwise tests/data."""
  return SHARED_DATA if USING_SHARED_DATA else FIXTURE_DATA


def shared_or_fixture(name: str) -> str:
  """Path of data file `name` (e.g. "pretrain/fortunes.jsonl.gz") in ../shared/data or the fixtures."""
  if USING_SHARED_DATA:
    return os.path.join(SHARED_DATA, name)
  return os.path.join(FIXTURE_DATA, FIXTURE_FOR.get(name, name))


def expected(full: int, fixture: int) -> int:
  """A count that depends on the data: `full` on ../shared/data, `fixture` on tests/data."""
  return full if USING_SHARED_DATA else fixture


@pytest.fixture(scope="session")
def shared_data():
  """Root of the real text (pretrain/*.jsonl.gz, glue_like/*): ../shared/data or tests/data."""
  return data_root()


@pytest.fixture
def read_only(monkeypatch):
  """`read_only(folder)`: creating anything in `folder` (or below it) then fails as on a read-only
  file system, whatever the permissions of the user running the tests (root ignores chmod)."""
  folders = []
  real_mkdir, real_open = os.mkdir, os.open

  def inside(path) -> bool:
    path = os.path.abspath(os.fsdecode(path))
    return any(path == f or path.startswith(f + os.sep) for f in folders)

  def refuse(path):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

  def mkdir(path, *args, **kwargs):
    if inside(path):
      refuse(path)
    return real_mkdir(path, *args, **kwargs)

  def open_(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
      refuse(path)
    return real_open(path, flags, *args, **kwargs)

  monkeypatch.setattr(os, "mkdir", mkdir)
  monkeypatch.setattr(os, "open", open_)
  return lambda folder: folders.append(os.path.abspath(str(folder)))


@pytest.fixture(autouse=True)
def _stage_reports_on_stdout():
  """A test that ran a stage with -q does not silence the next test's stage output."""
  yield
  import sys  # pylint: disable=g-import-not-at-top
  verbosity = sys.modules.get("private_t5.stages.verbosity")
  if verbosity is not None:
    verbosity._SILENT_STDOUT = False  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def _task_registry_restored():
  """A test that registers a task (a task folder named like a built-in task, a user's task.json)
  leaves the process-wide registry of GLUE-layout tasks as it found it for the next test."""
  from private_t5.data import glue_registry, glue_rows  # pylint: disable=g-import-not-at-top
  tasks, mixtures = dict(glue_registry._TASKS), dict(glue_registry._MIXTURES)  # pylint: disable=protected-access
  yield
  if glue_registry._TASKS != tasks or glue_registry._MIXTURES != mixtures:  # pylint: disable=protected-access
    glue_registry._TASKS.clear()  # pylint: disable=protected-access
    glue_registry._TASKS.update(tasks)  # pylint: disable=protected-access
    glue_registry._MIXTURES.clear()  # pylint: disable=protected-access
    glue_registry._MIXTURES.update(mixtures)  # pylint: disable=protected-access
    glue_rows.load_rows.cache_clear()
