"""A Beam pipeline run to the end on any runner: its work items, its errors in one line, its counters.

Every pipeline is written for any runner (`run_items`): one element a file, band or partition,
each its own task; a worker writes what it makes into the work folder (`data.beam_files`) and the
launching process reads the results back. No pipeline relies on side inputs computed in the same
pipeline, on the order of elements, or on memory shared with the launching process, and each
pipeline ends in one step (the Dask runner computes only the last one). A worker's failure is one
error line naming the stage, and Beam metrics (documents read, bad lines, ...) are logged when
the pipeline ends.
"""
import contextlib
import json
import logging
import re
import sys
from typing import Any, Dict, List, Optional, Sequence

from private_t5 import errors as errors_lib
from private_t5.data.beam_files import read_bytes, write_atomic
from private_t5.data.beam_runner import BEAM_INSTALL, import_beam
from private_t5.errors import DataError
from private_t5.lazy_imports import lazy_module

# Its log lines carry the name of `data.beam_io`, the stages' one module for Beam, as they always have.
logger = logging.getLogger("private_t5.data.beam_io")

metrics_lib = lazy_module("apache_beam.metrics.metric", needed_for="a Beam runner", install=BEAM_INSTALL)

METRICS_NAMESPACE = "private_t5"

_ERROR_IN_WORKER = re.compile(r"private_t5\.errors\.(\w*Error): ([^\n]*)|\b(DataError|ConfigError): ([^\n]*)")
_STEP = re.compile(r"\[while running '([^']+)'\]")
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception|Exit|Interrupt)): (.+)$")


def run_pipeline(pipeline, stage: str = "pipeline", runner: Optional[str] = None) -> Dict[str, int]:
  """Runs a built pipeline to the end; returns (and logs) its counters.

  A failure in a worker (or reaching the runner) is one error line naming the stage, the runner
  and the worker's error: a package error keeps its class (a malformed line stays a DataError),
  anything else is a DataError with the exception's name and first line. The Dask runner's client
  is closed when the pipeline ends. Runners without metrics (Dask) give no counters.
  """
  where = f"{stage} on {runner}" if runner else stage
  result = None
  try:
    result = pipeline.run()
    result.wait_until_finish()
  except errors_lib.PrivateT5Error as e:  # raised as it was in the worker (Dask, in-process runners)
    raise errors_lib.with_message(e, f"{where}: {_STEP.sub('', str(e)).strip()}") from None
  except Exception as e:  # pylint: disable=broad-except
    raise _worker_error(e, where) from None
  finally:
    client = getattr(result, "client", None)
    if client is not None:
      with contextlib.suppress(Exception):
        client.close()
  counters = pipeline_counters(result)
  if counters:
    logger.info("beam counters: %s", ", ".join(f"{k}={v}" for k, v in sorted(counters.items())))
  return counters


def _worker_error(e: BaseException, where: str) -> errors_lib.PrivateT5Error:
  """One line for an exception that a runner raised (wrapped in its traceback, or as it was raised)."""
  text = str(e)
  match = _ERROR_IN_WORKER.search(text)
  if match:
    name = match.group(1) or match.group(3)
    message = match.group(2) or match.group(4)
    return getattr(errors_lib, name, DataError)(f"{where}: {_STEP.sub('', message).strip()}")
  step = _STEP.search(text)
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  named = [m for m in (_EXCEPTION_LINE.match(_STEP.sub("", l).strip()) for l in lines) if m]
  if named:  # the innermost exception a runner's message quotes
    kind, message = named[-1].group(1), named[-1].group(2)
  else:
    kind, message = type(e).__name__, _STEP.sub("", lines[0]).strip() if lines else ""
  in_step = f" in step {step.group(1)!r}" if step else ""
  return DataError(f"{where} failed{in_step}: {kind}: {message}".rstrip(": "))


def pipeline_counters(result) -> Dict[str, int]:
  """The committed (or attempted) counters of this package's metric namespace."""
  try:
    found = result.metrics().query(metrics_lib.MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
  except Exception:  # pylint: disable=broad-except
    return {}  # a runner without metrics support
  out = {}
  for c in found:
    value = c.committed if c.committed is not None else c.attempted
    out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(value or 0)
  return out


def _run_item(element, fn, args, out_dir: str, step: str):
  """(number, item) -> runs `fn(item, *args)` and writes its JSON result as `out_dir/NNNNNN.json`."""
  number, item = element
  try:
    result = fn(item, *args)
  except errors_lib.PrivateT5Error as e:
    raise errors_lib.with_message(e, f"step {step!r}: {e}") from None
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise DataError(f"a worker failed in step {step!r}: {type(e).__name__}: {first}".rstrip(": ")) from e
  write_atomic(f"{out_dir}/{number:06d}.json", json.dumps(result).encode("utf-8"))
  counter(f"{step}_done").inc()
  yield number


def run_items(items: Sequence[Any], fn, *args, options, out_dir: str, stage: str, step: str,
              runner: Optional[str] = None) -> List[Any]:
  """Runs `fn(item, *args)` for each item on a Beam runner; returns the results in item order.

  One pipeline, `Create(items) | Reshuffle | FlatMap`: each item is one element (one task on
  Dask), and the pipeline has one last step, which every runner computes. `fn` (a module-level
  function) does its work in the worker and returns a small JSON value, which the worker writes
  as `out_dir/step/NNNNNN.json` (`write_atomic`); the launching process reads them back once the
  pipeline has ended. A retried element rewrites its own file, so every runner gives each result
  once. An item without a result is a DataError naming it.
  """
  if not items:
    return []
  beam = import_beam()
  folder = f"{out_dir.rstrip('/')}/{step.replace(' ', '_')}"
  pipeline = beam.Pipeline(options=options)
  _ = (pipeline
       | f"{step}: items" >> beam.Create(list(enumerate(items)))
       | f"{step}: spread" >> beam.Reshuffle()
       | step >> beam.FlatMap(_run_item, fn, tuple(args), folder, step))
  run_pipeline(pipeline, stage=stage, runner=runner)
  results = []
  for number, item in enumerate(items):
    path = f"{folder}/{number:06d}.json"
    try:
      results.append(json.loads(read_bytes(path)))
    except Exception as e:  # pylint: disable=broad-except
      where = f"{stage} on {runner}" if runner else stage
      raise DataError(f"{where}: step {step!r} left no result for item {number} ({str(item)[:200]}): "
                      f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
  return results


def counter(name: str):
  """A Beam counter in this package's metrics namespace (inside a worker)."""
  return metrics_lib.Metrics.counter(METRICS_NAMESPACE, name)


def log_to_stderr_once() -> None:
  """Makes `logging.info` visible on stderr when nothing configured logging (CLI runs)."""
  root = logging.getLogger()
  if not root.handlers:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")


def do_fn(beam, body):
  """A `beam.DoFn` around `body` (an object with `setup()` and `process(element)`): the pipeline's
  work as plain Python, testable without Beam, wrapped only when a pipeline is built."""
  class BodyFn(beam.DoFn):  # pylint: disable=missing-class-docstring
    def __init__(self, inner):
      super().__init__()
      self.inner = inner

    def setup(self):
      self.inner.setup()

    def process(self, element):
      yield from self.inner.process(element)

  return BodyFn(body)
