"""Files of a Beam pipeline's work: written whole or not at all by a worker, read back by the
launching process, on Beam's file systems (a local folder or remote storage such as `gs://`).

No pipeline relies on a runner finalizing a file sink: a worker writes what it makes under a
unique temporary name and renames it into place (`open_atomic`), in a fresh folder both it and
the launching process can read (`output_dir`).
"""
import contextlib
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Iterator, Optional

from private_t5.data.beam_runner import BEAM_INSTALL, options_lib
from private_t5.lazy_imports import lazy_module

filesystems = lazy_module("apache_beam.io.filesystems", needed_for="a Beam runner", install=BEAM_INSTALL)


@contextlib.contextmanager
def output_dir(options, work_dir: Optional[str], name: str) -> Iterator[str]:
  """A fresh folder the workers write a pipeline's result to, for the launching process to read.

  Under `work_dir` if given, else under the options' `temp_location` (both must be readable by
  the workers and the launcher: shared storage on a cluster); else a local temporary folder,
  removed on exit.
  """
  if not work_dir:
    work_dir = options.view_as(options_lib.GoogleCloudOptions).temp_location
  if work_dir:
    yield work_dir.rstrip("/") + f"/{name}-{uuid.uuid4().hex[:12]}"
    return
  local = tempfile.mkdtemp(prefix=f"{name}-")
  try:
    yield local
  finally:
    shutil.rmtree(local, ignore_errors=True)


def read_json_lines(prefix: str) -> Iterator[Any]:
  """The JSON values of the non-blank lines of the files `WriteToText(prefix)` wrote, in file order."""
  fs = filesystems.FileSystems
  for path in sorted(m.path for r in fs.match([prefix + "*"]) for m in r.metadata_list):
    with fs.open(path) as f:
      for raw in iter(f.readline, b""):
        if raw.strip():
          yield json.loads(raw)


@contextlib.contextmanager
def open_atomic(path: str) -> Iterator[Any]:
  """A binary file handle whose bytes appear at `path` whole or not at all.

  Written under a unique temporary name beside `path` (Beam's file systems: local or remote),
  renamed into place when the block ends without an error, removed when it raises: a worker
  that dies or a retried element never leaves a half-written file, and the last writer wins.
  """
  fs = filesystems.FileSystems
  directory, name = path.rsplit("/", 1) if "/" in path else (".", path)
  if "://" not in path:
    os.makedirs(directory, exist_ok=True)
  tmp = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
  handle = fs.create(tmp)
  try:
    yield handle
    handle.close()
  except BaseException:
    with contextlib.suppress(Exception):
      handle.close()
    with contextlib.suppress(Exception):
      fs.delete([tmp])
    raise
  fs.rename([tmp], [path])


def write_atomic(path: str, data: bytes) -> None:
  """Writes `data` to `path` whole or not at all (`open_atomic`)."""
  with open_atomic(path) as f:
    f.write(data)


def read_bytes(path: str) -> bytes:
  """The bytes of a file (Beam's file systems: local or remote)."""
  with filesystems.FileSystems.open(path) as f:
    return f.read()
