"""Corpus reading on Apache Beam, and the one module the corpus-wide stages use for Beam.

The runner switch (`--runner`, `--beam_options`: `data.beam_runner`), running a pipeline on any
runner (`run_items`, `run_pipeline`, counters: `data.beam_pipeline`) and the files its workers
write (`open_atomic`, `output_dir`: `data.beam_files`) have their own modules; their names are
also read from here. Corpora on Beam:

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
counted (`bad_lines`) and skipped.
"""
import csv
import hashlib
import json
import logging
import os
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

from private_t5.data import corpora
from private_t5.data import tfds as tfds_lib
from private_t5.data.beam_pipeline import counter
from private_t5.data.beam_runner import BEAM_INSTALL, import_beam
from private_t5.errors import ConfigError, DataError
from private_t5.lazy_imports import lazy_module
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.data.beam_files': ('open_atomic',),
})

logger = logging.getLogger(__name__)

filesystems = lazy_module("apache_beam.io.filesystems", needed_for="a Beam runner", install=BEAM_INSTALL)

TFDS_PREFIX = "tfds:"
_JSONL = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
_TSV = (".tsv", ".tsv.gz")
_TXT = (".txt", ".txt.gz")


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

def is_pattern_or_file(spec: str) -> bool:
  """Whether a corpus spec names files: a remote URL, a glob, or a file that exists (not `tfds:` or
  another `name:` spec)."""
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
    elif is_pattern_or_file(spec):
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
  for spec in ([specs] if isinstance(specs, str) else list(specs)):
    if spec.startswith(TFDS_PREFIX) or not is_pattern_or_file(spec):
      for d in corpora.iter_documents(spec, text_field=text_field, id_field=id_field, errors=errors,
                                      data_dir=data_dir):
        yield d.id, d.text
      continue
    for path in match_files(os.path.expanduser(spec)):
      with filesystems.FileSystems.open(path) as f:
        for _, doc in iter_file_documents(path, iter(f.readline, b""), text_field=text_field,
                                          id_field=id_field, errors=errors):
          if isinstance(doc, BadLine):
            if not skip_bad_lines:
              raise DataError(f"{doc} (pass --skip_bad_lines to count and skip it)")
            continue
          yield doc


def match_files(pattern: str) -> List[str]:
  """The files a pattern matches (Beam's file systems), sorted; DataError when none."""
  try:
    results = filesystems.FileSystems.match([pattern])
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"corpus pattern {pattern!r} matches no file ({str(e).splitlines()[0]})") from None
  paths = sorted(m.path for r in results for m in r.metadata_list)
  if not paths:
    raise DataError(f"corpus pattern {pattern!r} matches no file")
  return paths


def _read_file(element, corpus_index: int, text_field: str, id_field: str, errors: str,
               skip_bad_lines: bool):
  """(file index, path) -> (order, (id, text)) per document of that file, streamed."""
  index, path = element
  docs, bad = counter("documents_read"), counter("bad_lines")
  with filesystems.FileSystems.open(path) as f:
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
          | f"{step} tfds" >> tfds_lib.tfds.beam.ReadFromTFDS(builder, split=split)
          | f"{step} docs" >> beam.FlatMap(keyed))
