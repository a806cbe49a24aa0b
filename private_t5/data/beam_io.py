"""The runner switch of the corpus-wide stages, and corpus reading on Apache Beam.

Every corpus-wide stage (the DP-SentencePiece histogram, the memorization splits) takes

  --runner=local                 the in-process path (default; fast for small corpora), or
  --runner=DirectRunner|DaskRunner|DataflowRunner|FlinkRunner|SparkRunner|...   an Apache Beam runner,
  --beam_options="--direct_num_workers=2 --direct_running_mode=multi_processing"
                                 passed to `PipelineOptions` unchanged
                                 (DaskRunner: "--dask_client_address=HOST:PORT" of a running
                                 dask.distributed scheduler; docs/scaling.md).

Beam is imported only when a Beam runner is chosen. Every pipeline is written for any runner
(`run_items`): one element a file, band or partition, each its own task; a worker writes what it
makes into the work folder under a unique temporary name and renames it into place, and the
launching process reads the results back. No pipeline relies on a runner finalizing a file sink,
on side inputs computed in the same pipeline, on the order of elements, or on memory shared with
the launching process, and each pipeline ends in one step (the Dask runner computes only the
last one). Corpora on Beam:

* a file pattern (`train-*.jsonl.gz`, `gs://bucket/c4-*.jsonl.gz`, `*.txt`, `*.tsv`), matched
  and read with Beam's file IO (`fileio.MatchFiles`, `ReadMatches`; compression from the
  extension), one worker per file, streaming line by line. Formats and document ids follow
  `private_t5.data.corpora`: JSONL `{"id", "text"}` (id `FILE:LINE` when absent), text one
  document a line (`FILE:LINE`), TSV with a header row.
* `tfds:NAME[:SPLIT]`: a prepared TFDS dataset read shard by shard (`tfds.beam.ReadFromTFDS`),
  never loaded whole.
* anything else `corpora.iter_documents` reads (a folder, `builtin:`): read by the launching
  process and handed to the pipeline (small corpora only).

A malformed line is a `DataError` naming the file and line; with `skip_bad_lines` it is
counted (`bad_lines`) and skipped. Beam metrics (documents read, bad lines, ...) are logged
when the pipeline ends.
"""
import contextlib
import csv
import hashlib
import io
import json
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import uuid
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from private_t5 import errors as errors_lib
from private_t5 import quiet_tf
from private_t5.data import corpora
from private_t5.data import tfds as tfds_lib
from private_t5.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# Apache Beam (optional: `import_beam` says so in one line when it is missing) and
# tensorflow_datasets (it imports TensorFlow) are imported inside the functions that use them.

LOCAL_RUNNER = "local"
BEAM_RUNNERS = ("DirectRunner", "DaskRunner", "PrismRunner", "DataflowRunner", "FlinkRunner", "SparkRunner",
                "PortableRunner", "SwitchingDirectRunner")
DASK_RUNNER = "DaskRunner"
# Runners Beam does not resolve by their short name.
_RUNNER_PATHS = {DASK_RUNNER: "apache_beam.runners.dask.dask_runner.DaskRunner"}
RUNNERS = (LOCAL_RUNNER,) + BEAM_RUNNERS
METRICS_NAMESPACE = "private_t5"
TFDS_PREFIX = "tfds:"
_JSONL = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
_TSV = (".tsv", ".tsv.gz")
_TXT = (".txt", ".txt.gz")


def check_runner(runner: str) -> str:
  """Returns `runner` when it is `local` or a known Beam runner; else one-line ConfigError."""
  if runner not in RUNNERS:
    raise ConfigError(f"unknown runner {runner!r}: use one of {', '.join(RUNNERS)}")
  return runner


def is_beam(runner: Optional[str]) -> bool:
  """True when `runner` names a Beam runner (not the in-process path)."""
  return check_runner(runner or LOCAL_RUNNER) != LOCAL_RUNNER


def add_runner_flags(parser) -> None:
  """Adds --runner, --beam_options and --skip_bad_lines to an argparse parser."""
  parser.add_argument("--runner", default=LOCAL_RUNNER,
                      help=f"'{LOCAL_RUNNER}' (in-process, default) or a Beam runner: {', '.join(BEAM_RUNNERS)}")
  parser.add_argument("--beam_options", default="",
                      help="Beam pipeline flags, passed to PipelineOptions unchanged "
                           "(e.g. \"--direct_num_workers=2 --direct_running_mode=multi_processing\"; "
                           "DaskRunner: \"--dask_client_address=HOST:PORT\")")
  parser.add_argument("--skip_bad_lines", action="store_true",
                      help="Beam runners: count and skip malformed lines instead of stopping")


def import_beam():
  """`apache_beam`, or a one-line ConfigError when it is not importable."""
  try:
    import apache_beam as beam  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f"a Beam runner needs Apache Beam, which is not importable ({e}); install "
                      "apache-beam (requirements.txt) or use --runner=local") from None
  return beam


def pipeline_options(runner: str, beam_options: Union[str, Sequence[str], None] = ""):
  """`PipelineOptions` from the flag string (unchanged) plus the runner name, all parsed.

  Raises:
    ConfigError: an unbalanced quote, `--runner` inside the options, or an invalid option value.
  """
  check_runner(runner)
  if runner == LOCAL_RUNNER:
    raise ConfigError("the local runner builds no Beam pipeline")
  flags = _split_options(beam_options)
  if any(f == "--runner" or f.startswith("--runner=") for f in flags):
    raise ConfigError("give the runner with --runner, not inside --beam_options")
  import_beam()
  from apache_beam.options.pipeline_options import PipelineOptions  # pylint: disable=g-import-not-at-top
  if runner == DASK_RUNNER:
    _import_dask_runner()  # registers its options (--dask_client_address, ...)
    if not any(f.split("=", 1)[0] in ("--dask_npartitions", "--dask_partition_size") for f in flags):
      # One element (a file, a band, a partition) is one Dask task: the runner's default puts up
      # to 128 elements of a Create in one task, which one worker would run one after another.
      flags.append("--dask_partition_size=1")
  options = PipelineOptions(flags=flags + [f"--runner={_RUNNER_PATHS.get(runner, runner)}"])
  _check_options(options, beam_options)
  return options


def runner_name(options) -> str:
  """The short runner name of built options (`DaskRunner`, not its module path)."""
  from apache_beam.options.pipeline_options import StandardOptions  # pylint: disable=g-import-not-at-top
  return str(options.view_as(StandardOptions).runner or "").rsplit(".", 1)[-1]


def _import_dask_runner():
  """Beam's DaskRunner module, or a one-line ConfigError when dask or distributed is missing."""
  try:
    import dask.distributed  # pylint: disable=g-import-not-at-top,unused-import
    from apache_beam.runners.dask import dask_runner  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f"--runner=DaskRunner needs dask and distributed, which are not importable ({e}); "
                      "install them with pip install 'private_t5[dask]'") from None
  return dask_runner


def _split_options(beam_options: Union[str, Sequence[str], None]) -> List[str]:
  """The --beam_options string split as a shell would (a list is taken as it is)."""
  if not isinstance(beam_options, str):
    return list(beam_options or [])
  try:
    return shlex.split(beam_options)
  except ValueError as e:  # an unbalanced quote
    raise ConfigError(f"--beam_options={beam_options!r}: {e}") from None


def _check_options(options, beam_options) -> None:
  """Parses every Beam option now, before anything is built or written.

  Beam parses its options lazily, with argparse: an invalid value would print Beam's whole usage
  text and exit once the pipeline starts. Here it is one ConfigError naming the option.
  """
  usage = io.StringIO()
  try:
    with contextlib.redirect_stderr(usage):
      options.get_all_options()
  except SystemExit:
    lines = usage.getvalue().strip().splitlines()
    reason = lines[-1].split("error: ", 1)[-1] if lines else "invalid option"
    raise ConfigError(f"--beam_options={beam_options!r}: {reason}") from None


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
    raise type(e)(f"{where}: {_STEP.sub('', str(e)).strip()}") from None
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
    from apache_beam.metrics.metric import MetricsFilter  # pylint: disable=g-import-not-at-top
    found = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
  except Exception:  # pylint: disable=broad-except
    return {}  # a runner without metrics support
  out = {}
  for c in found:
    value = c.committed if c.committed is not None else c.attempted
    out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(value or 0)
  return out


# ---------------------------------------------------------------------------------------------
# Parsing one file's lines (shared by every worker)
# ---------------------------------------------------------------------------------------------

def file_format(path: str) -> str:
  """'jsonl', 'tsv' or 'txt' from the file name; DataError for anything else."""
  lower = path.lower()
  if lower.endswith(_JSONL):
    return "jsonl"
  if lower.endswith(_TSV):
    return "tsv"
  if lower.endswith(_TXT):
    return "txt"
  raise DataError(f"unsupported corpus file for a Beam runner: {path} (expected .jsonl[.gz], .tsv[.gz], "
                  ".txt[.gz] or tfds:NAME[:SPLIT])")


class BadLine(DataError):
  """A malformed line; the message names the file and the line."""


def iter_file_documents(path: str, lines, *, text_field: str = "text", id_field: str = "id",
                        errors: str = "strict") -> Iterator[Tuple[int, Any]]:
  """Yields (line number, (id, text)) per non-blank document, or (line number, BadLine).

  `lines` yields raw byte lines of `path` (decompressed). Ids follow `corpora`.
  """
  fmt = file_format(path)
  name = os.path.basename(path)
  header = text_col = id_col = None
  for lineno, raw in enumerate(lines, start=1):
    where = f"{path}: line {lineno}"
    try:
      line = raw.decode("utf-8", errors="strict" if errors == "strict" else "replace")
    except UnicodeDecodeError as e:
      yield lineno, BadLine(f"{where}: invalid UTF-8 at byte {e.start} ({e.reason}); {corpora.UTF8_HINT}")
      continue
    if fmt == "txt":
      text = line.rstrip("\r\n")
      if text.strip():
        yield lineno, (f"{name}:{lineno}", text)
      continue
    if fmt == "tsv":
      row = next(csv.reader([line.rstrip("\r\n")], delimiter="\t", quoting=csv.QUOTE_NONE), [])
      if header is None:
        header = row
        if text_field not in header:
          yield lineno, BadLine(f"{path}: header has no text column {text_field!r} (columns: {header})")
          return
        text_col = header.index(text_field)
        id_col = header.index(id_field) if id_field and id_field in header else None
        continue
      text = row[text_col] if text_col < len(row) else ""
      doc_id = row[id_col] if id_col is not None and id_col < len(row) else None
      if text.strip():
        yield lineno, (doc_id or f"{name}:{lineno}", text)
      continue
    line = line.strip()
    if not line:
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      yield lineno, BadLine(f"{where}: not valid JSON ({e.msg})")
      continue
    if not isinstance(record, dict):
      yield lineno, BadLine(f"{where}: expected a JSON object, got {type(record).__name__}")
      continue
    if text_field not in record:
      yield lineno, BadLine(f"{where}: no text field {text_field!r} (fields: {sorted(record)})")
      continue
    text, doc_id = record[text_field], record.get(id_field) if id_field else None
    if not isinstance(text, (str, int, float, type(None))) or not isinstance(doc_id, (str, int, float, type(None))):
      yield lineno, BadLine(f"{where}: fields {text_field!r} and {id_field!r} must be strings")
      continue
    text = str(text) if text is not None else ""
    if text.strip():
      yield lineno, (str(doc_id) if doc_id is not None else f"{name}:{lineno}", text)


# ---------------------------------------------------------------------------------------------
# Reading corpora into a pipeline
# ---------------------------------------------------------------------------------------------

def _is_pattern_or_file(spec: str) -> bool:
  if spec.startswith(TFDS_PREFIX) or ":" in spec.split("/")[0] and "://" not in spec:
    return False
  if "://" in spec:
    return True
  if any(ch in spec for ch in "*?["):
    return True
  return os.path.isfile(os.path.expanduser(spec))


def read_documents(pipeline, specs: Union[str, Sequence[str]], *, label: str = "corpus",
                   text_field: str = "text", id_field: str = "id", errors: str = "strict",
                   data_dir: Optional[str] = None, skip_bad_lines: bool = False):
  """A PCollection of `(order, (id, text))` for the non-blank documents of `specs`.

  `order` is `(corpus index, file index, line or record number)`: sorting by it gives the
  order in which the local path reads the same corpora (files of a pattern in name order).
  """
  beam = import_beam()
  specs = [specs] if isinstance(specs, str) else list(specs)
  if not specs or not all(isinstance(s, str) and s for s in specs):
    raise ConfigError(f"missing corpus for {label}: give at least one file pattern or corpus spec")
  parts = []
  for c, spec in enumerate(specs):
    step = f"{label}[{c}]"
    if spec.startswith(TFDS_PREFIX):
      parts.append(_read_tfds(pipeline, beam, spec, c, step, text_field, id_field, errors, data_dir))
    elif _is_pattern_or_file(spec):
      paths = match_files(os.path.expanduser(spec))
      for path in paths:
        file_format(path)  # unsupported formats fail before the pipeline starts
      parts.append(
          pipeline
          | f"{step} files" >> beam.Create(list(enumerate(paths)))
          | f"{step} reshuffle" >> beam.Reshuffle()
          | f"{step} read" >> beam.FlatMap(_read_file, c, text_field, id_field, errors, skip_bad_lines))
    else:
      docs = [((c, 0, i), (d.id, d.text)) for i, d in enumerate(corpora.iter_documents(
          spec, text_field=text_field, id_field=id_field, errors=errors, data_dir=data_dir))]
      parts.append(pipeline | f"{step} create" >> beam.Create(docs))
  if len(parts) == 1:
    return parts[0]
  return tuple(parts) | f"{label} flatten" >> beam.Flatten()


def stream_documents(specs: Union[str, Sequence[str]], *, text_field: str = "text", id_field: str = "id",
                     errors: str = "strict", data_dir: Optional[str] = None,
                     skip_bad_lines: bool = False) -> Iterator[Tuple[str, str]]:
  """(id, text) of every document of `specs` in corpus order, read by this process, streaming.

  For what must see the whole corpus in order (a content fingerprint); the same documents
  `read_documents` gives a pipeline.
  """
  import_beam()
  from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  for spec in ([specs] if isinstance(specs, str) else list(specs)):
    if spec.startswith(TFDS_PREFIX) or not _is_pattern_or_file(spec):
      for d in corpora.iter_documents(spec, text_field=text_field, id_field=id_field, errors=errors,
                                      data_dir=data_dir):
        yield d.id, d.text
      continue
    for path in match_files(os.path.expanduser(spec)):
      with FileSystems.open(path) as f:
        for _, doc in iter_file_documents(path, iter(f.readline, b""), text_field=text_field,
                                          id_field=id_field, errors=errors):
          if isinstance(doc, BadLine):
            if not skip_bad_lines:
              raise DataError(f"{doc} (pass --skip_bad_lines to count and skip it)")
            continue
          yield doc


def match_files(pattern: str) -> List[str]:
  """The files a pattern matches (Beam's file systems), sorted; DataError when none."""
  from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  try:
    results = FileSystems.match([pattern])
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"corpus pattern {pattern!r} matches no file ({str(e).splitlines()[0]})") from None
  paths = sorted(m.path for r in results for m in r.metadata_list)
  if not paths:
    raise DataError(f"corpus pattern {pattern!r} matches no file")
  return paths


@contextlib.contextmanager
def output_dir(options, work_dir: Optional[str], name: str) -> Iterator[str]:
  """A fresh folder the workers write a pipeline's result to, for the launching process to read.

  Under `work_dir` if given, else under the options' `temp_location` (both must be readable by
  the workers and the launcher: shared storage on a cluster); else a local temporary folder,
  removed on exit.
  """
  if not work_dir:
    from apache_beam.options.pipeline_options import GoogleCloudOptions  # pylint: disable=g-import-not-at-top
    work_dir = options.view_as(GoogleCloudOptions).temp_location
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
  from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  for path in sorted(m.path for r in FileSystems.match([prefix + "*"]) for m in r.metadata_list):
    with FileSystems.open(path) as f:
      for raw in iter(f.readline, b""):
        if raw.strip():
          yield json.loads(raw)


# ---------------------------------------------------------------------------------------------
# Work items: outputs every runner supports
# ---------------------------------------------------------------------------------------------

def _filesystems():
  from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  return FileSystems


@contextlib.contextmanager
def open_atomic(path: str) -> Iterator[Any]:
  """A binary file handle whose bytes appear at `path` whole or not at all.

  Written under a unique temporary name beside `path` (Beam's file systems: local or remote),
  renamed into place when the block ends without an error, removed when it raises: a worker
  that dies or a retried element never leaves a half-written file, and the last writer wins.
  """
  fs = _filesystems()
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
  with _filesystems().open(path) as f:
    return f.read()


def _run_item(element, fn, args, out_dir: str, step: str):
  """(number, item) -> runs `fn(item, *args)` and writes its JSON result as `out_dir/NNNNNN.json`."""
  number, item = element
  try:
    result = fn(item, *args)
  except errors_lib.PrivateT5Error as e:
    raise type(e)(f"step {step!r}: {e}") from None
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
  from apache_beam.metrics.metric import Metrics  # pylint: disable=g-import-not-at-top
  return Metrics.counter(METRICS_NAMESPACE, name)


def _read_file(element, corpus_index: int, text_field: str, id_field: str, errors: str,
               skip_bad_lines: bool):
  """(file index, path) -> (order, (id, text)) per document of that file, streamed."""
  from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  index, path = element
  docs, bad = counter("documents_read"), counter("bad_lines")
  with FileSystems.open(path) as f:
    lines = iter(f.readline, b"")
    for lineno, doc in iter_file_documents(path, lines, text_field=text_field, id_field=id_field, errors=errors):
      if isinstance(doc, BadLine):
        if not skip_bad_lines:
          raise DataError(f"{doc} (pass --skip_bad_lines to count and skip it)")
        bad.inc()
        logger.warning("skipped: %s", doc)
        continue
      docs.inc()
      yield (corpus_index, index, lineno), doc


def _read_tfds(pipeline, beam, spec, c, step, text_field, id_field, errors, data_dir):
  quiet_tf.import_tensorflow()  # tensorflow_datasets imports it
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  body = spec[len(TFDS_PREFIX):]
  name, split = body, "train"
  if ":" in body:
    head, tail = body.rsplit(":", 1)
    if tail and "/" not in tail:
      name, split = head, tail
  builder = tfds_lib.prepared_builder(name, data_dir)
  keys = list(builder.info.features.keys())
  if text_field not in keys:
    raise DataError(f"TFDS dataset {name!r} has no text feature {text_field!r} (features: {keys})")

  def to_doc(ex):
    text = ex[text_field]
    text = text.decode("utf-8", errors="strict" if errors == "strict" else "replace") if isinstance(
        text, bytes) else str(text)
    doc_id = ex.get(id_field) if id_field else None
    doc_id = doc_id.decode("utf-8", "replace") if isinstance(doc_id, bytes) else doc_id
    return doc_id, text

  def keyed(ex):
    ex = {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in dict(ex).items()}
    doc_id, text = to_doc(ex)
    if not text.strip():
      return []
    if doc_id is None:  # records carry no global number: a content id, the same in every worker
      doc_id = f"{name}:{split}:{hashlib.sha1(text.encode('utf-8')).hexdigest()[:16]}"
    return [((c, 0, str(doc_id)), (str(doc_id), text))]

  return (pipeline
          | f"{step} tfds" >> tfds.beam.ReadFromTFDS(builder, split=split)
          | f"{step} docs" >> beam.FlatMap(keyed))


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
