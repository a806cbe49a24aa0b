"""Corpus readers: every supported source yields `Document(id, text, user)`.

A corpus is named by a *spec* string:

* `path/to/file.txt`            one document a line (id `file.txt:LINE`),
* `path/to/folder/`             every `*.txt` file below it is one document (id: relative path),
* `path/to/file.jsonl[.gz]`     one JSON object a line, text in `text_field`, optional id/user,
* `path/to/file.tsv`            tab-separated with a header row, text in column `text_field`,
* `path/to/train-*.jsonl.gz`    a file pattern (`*`, `?`, `[...]`): the matching files in sorted
                                path order, each read as above, then concatenated (the order a
                                Beam pipeline's shards follow, see `data/store_beam.py`),
* `tfds:NAME[:SPLIT]`           a TFDS dataset already prepared under `data_dir` (e.g.
                                `tfds:c4/en:train`), or `tfds:/path/to/builder_dir[:SPLIT]`,
* `builtin:python_docs`         the Python reference manual and standard-library docstrings
                                shipped with every Python installation (see builtin_corpus.py).

Readers yield `private_t5.documents.Document` records (also importable from here, with
`CorpusStats`). Every document keeps its id: the privacy unit of a document-level DP run. Blank documents are
skipped and counted in `CorpusStats`; invalid UTF-8 is an error naming the file and line, or
is replaced by U+FFFD when `errors="replace"`; a file that cannot be read (truncated or corrupt
gzip data included) is an error naming the file.
"""
import csv
import glob
import gzip
import itertools
import json
import os
import sys
import zlib
from typing import Iterator, List, Optional, Tuple

from private_t5.data import builtin_corpus
from private_t5.data import tfds as tfds_lib
from private_t5.documents import CorpusStats, Document
from private_t5.errors import ConfigError, DataError

ERROR_MODES = ("strict", "replace")
TFDS_PREFIX = "tfds:"
BUILTIN_PREFIX = "builtin:"


# What an invalid UTF-8 error suggests: only options that exist, and the stages that have them
# (the splits and memorization stages read strictly: there the file must be fixed).
UTF8_HINT = ("re-encode the file as UTF-8, or substitute U+FFFD where a stage offers it: "
             "`private-t5 store` / `spm` --errors=replace, training's make_source.errors='replace'")


def _check_errors(errors: str) -> None:
  if errors not in ERROR_MODES:
    raise ConfigError(f"errors must be one of {ERROR_MODES}, got {errors!r}")


def _decode(raw: bytes, errors: str, where: str, stats: CorpusStats) -> str:
  """Decodes UTF-8; `where` names the file (and line) in the error message."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    if errors == "strict":
      raise DataError(f"{where}: invalid UTF-8 at byte {e.start} ({e.reason}); {UTF8_HINT}") from None
    stats.replaced_lines += 1
    return raw.decode("utf-8", errors="replace")


def _open_binary(path: str):
  if path.endswith(".gz"):
    return gzip.open(path, "rb")
  return open(path, "rb")


# What reading a corpus file raises when the file itself is bad: unreadable, not gzip data
# (gzip.BadGzipFile is an OSError), truncated (EOFError) or corrupt compressed data.
_READ_ERRORS = (OSError, EOFError, zlib.error)


def _raw_lines(path: str) -> Iterator[Tuple[int, bytes]]:
  """(line number, raw bytes) of each line of a corpus file, gunzipped when it ends in .gz.

  Every line-based reader reads through here, so an unreadable, truncated or corrupt file is
  one DataError naming it, whatever its format.
  """
  try:
    with _open_binary(path) as f:
      yield from enumerate(f, start=1)
  except _READ_ERRORS as e:
    raise DataError(f"cannot read {path}: {e}") from e


def _iter_txt_lines(path, errors, stats) -> Iterator[Document]:
  name = os.path.basename(path)
  for lineno, raw in _raw_lines(path):
    text = _decode(raw.rstrip(b"\r\n"), errors, f"{path}: line {lineno}", stats)
    yield Document(id=f"{name}:{lineno}", text=text)


def _iter_txt_folder(path, errors, stats) -> Iterator[Document]:
  files = []
  for root, dirs, names in os.walk(path):
    dirs.sort()
    files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".txt"))
  if not files:
    raise DataError(f"folder {path} contains no .txt files")
  for file in files:
    with open(file, "rb") as f:
      raw = f.read()
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      line = raw[:e.start].count(b"\n") + 1
      if errors == "strict":
        raise DataError(f"{file}: line {line}: invalid UTF-8 ({e.reason}); {UTF8_HINT}") from None
      stats.replaced_lines += 1
      text = raw.decode("utf-8", errors="replace")
    yield Document(id=os.path.relpath(file, path), text=text)


def _field(record, key, where):
  value = record[key]
  if value is None:
    return None
  if not isinstance(value, (str, int, float)):
    raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
  return str(value)


def _iter_jsonl(path, text_field, id_field, user_field, errors, stats) -> Iterator[Document]:
  name = os.path.basename(path)
  for lineno, raw in _raw_lines(path):
    where = f"{path}: line {lineno}"
    line = _decode(raw, errors, where, stats).strip()
    if not line:
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
      raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
      raise DataError(f"{where}: no text field {text_field!r} (fields: {sorted(record)})")
    text = _field(record, text_field, where) or ""
    doc_id = _field(record, id_field, where) if id_field and id_field in record else None
    user = None
    if user_field:
      if user_field not in record:
        raise DataError(f"{where}: no user field {user_field!r} (fields: {sorted(record)})")
      user = _field(record, user_field, where)
    yield Document(id=doc_id if doc_id is not None else f"{name}:{lineno}", text=text, user=user)


def _iter_tsv(path, text_field, id_field, user_field, errors, stats) -> Iterator[Document]:
  name = os.path.basename(path)
  csv.field_size_limit(sys.maxsize)
  header = None
  for lineno, raw in _raw_lines(path):
    where = f"{path}: line {lineno}"
    line = _decode(raw.rstrip(b"\r\n"), errors, where, stats)
    row = next(csv.reader([line], delimiter="\t", quoting=csv.QUOTE_NONE), [])
    if header is None:
      header = row
      if text_field not in header:
        raise DataError(f"{path}: header has no text column {text_field!r} (columns: {header})")
      if user_field and user_field not in header:
        raise DataError(f"{path}: header has no user column {user_field!r} (columns: {header})")
      text_col = header.index(text_field)
      id_col = header.index(id_field) if id_field and id_field in header else None
      user_col = header.index(user_field) if user_field else None
      continue
    if not line.strip():
      continue

    def cell(col):
      return row[col] if col is not None and col < len(row) else None

    text = cell(text_col) or ""
    doc_id = cell(id_col)
    yield Document(id=doc_id if doc_id else f"{name}:{lineno}", text=text, user=cell(user_col))
  if header is None:
    raise DataError(f"{path}: empty TSV file (a header row is required)")


def _split_tfds_spec(body: str) -> Tuple[str, str]:
  # `c4/en:train`, `c4/en:3.0.1:train` is not supported; `/dir/builder:train` is.
  if ":" in body:
    name, split = body.rsplit(":", 1)
    if split and "/" not in split:
      return name, split
  return body, "train"


def _iter_tfds(body, data_dir, text_field, id_field, user_field, errors, stats) -> Iterator[Document]:
  name, split = _split_tfds_spec(body)
  builder = tfds_lib.prepared_builder(name, data_dir)
  features = builder.info.features
  keys = list(features.keys()) if hasattr(features, "keys") else []
  if text_field not in keys:
    raise DataError(f"TFDS dataset {name!r} has no text feature {text_field!r} (features: {keys})")
  if user_field and user_field not in keys:
    raise DataError(f"TFDS dataset {name!r} has no user feature {user_field!r} (features: {keys})")
  ds = tfds_lib.split_dataset(builder, name, split)

  def as_text(value, where):
    if isinstance(value, bytes):
      return _decode(value, errors, where, stats)
    return str(value)

  for i, ex in enumerate(ds.as_numpy_iterator()):
    where = f"tfds:{name}:{split} record {i}"
    text = as_text(ex[text_field], where)
    doc_id = as_text(ex[id_field], where) if id_field and id_field in ex else f"{name}:{split}:{i}"
    user = as_text(ex[user_field], where) if user_field else None
    yield Document(id=doc_id, text=text, user=user)


def is_file_pattern(spec: str) -> bool:
  """True when `spec` is a local file pattern (`*`, `?` or `[`, and not itself an existing path)."""
  if not isinstance(spec, str) or spec.startswith((TFDS_PREFIX, BUILTIN_PREFIX)) or "://" in spec:
    return False
  return any(ch in spec for ch in "*?[") and not os.path.exists(os.path.expanduser(spec))


def match_pattern(spec: str) -> List[str]:
  """The files of a local file pattern in sorted path order; DataError when none matches."""
  paths = sorted(p for p in glob.glob(os.path.expanduser(spec)) if os.path.isfile(p))
  if not paths:
    raise DataError(f"corpus pattern {spec!r} matches no file")
  return paths


def corpus_files(spec: str) -> List[str]:
  """What a corpus spec reads, to compare two corpora: the real paths of its local files (a pattern's
  matches, every file under a folder), or the spec itself for other sources (tfds:, builtin:, URLs)."""
  if not isinstance(spec, str) or not spec:
    return []
  if spec.startswith((TFDS_PREFIX, BUILTIN_PREFIX)) or "://" in spec:
    return [spec]
  path = os.path.expanduser(spec)
  if is_file_pattern(spec):
    paths = [p for p in glob.glob(path) if os.path.isfile(p)]
  elif os.path.isdir(path):
    paths = [os.path.join(root, n) for root, _, names in os.walk(path) for n in names]
  else:
    paths = [path]
  return sorted(os.path.realpath(p) for p in paths)


def _raw_documents(spec, text_field, id_field, user_field, errors, data_dir, stats) -> Iterator[Document]:
  """Dispatches on the spec; checks the path eagerly, so a missing file fails at once."""
  if spec.startswith(BUILTIN_PREFIX):
    return builtin_corpus.iter_builtin(spec[len(BUILTIN_PREFIX):])
  if spec.startswith(TFDS_PREFIX):
    return _iter_tfds(spec[len(TFDS_PREFIX):], data_dir, text_field, id_field, user_field, errors, stats)
  if is_file_pattern(spec):
    return itertools.chain.from_iterable(
        _raw_documents(p, text_field, id_field, user_field, errors, data_dir, stats) for p in match_pattern(spec))
  path = os.path.expanduser(spec)
  if not os.path.exists(path):
    raise DataError(f"corpus not found: {spec}")
  if os.path.isdir(path):
    return _iter_txt_folder(path, errors, stats)
  lower = path.lower()
  if lower.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".json")):
    return _iter_jsonl(path, text_field, id_field, user_field, errors, stats)
  if lower.endswith((".tsv", ".tsv.gz")):
    return _iter_tsv(path, text_field, id_field, user_field, errors, stats)
  if lower.endswith((".txt", ".txt.gz")):
    return _iter_txt_lines(path, errors, stats)
  raise DataError(f"unsupported corpus format: {spec} (expected .txt, a folder of .txt, .jsonl[.gz], "
                  ".tsv, tfds:NAME[:SPLIT] or builtin:python_docs)")


def iter_documents(spec: str, *, text_field: str = "text", id_field: str = "id",
                   user_field: Optional[str] = None, errors: str = "strict",
                   data_dir: Optional[str] = None, stats: Optional[CorpusStats] = None,
                   max_documents: Optional[int] = None, allow_empty: bool = False) -> Iterator[Document]:
  """Yields the non-blank documents of a corpus in a deterministic order.

  Args:
    spec: the corpus (see the module docstring).
    text_field: JSONL field / TSV column / TFDS feature holding the text.
    id_field: field holding the document id; when absent the id is `FILE:LINE` (or the
      TFDS record number).
    user_field: field holding the user (owner) id, for user-level DP; required to exist when set.
    errors: "strict" (invalid UTF-8 is a DataError naming file and line) or "replace".
    data_dir: TFDS data directory for `tfds:` specs.
    stats: if given, filled in with counts as the iterator advances.
    max_documents: stop after this many (non-blank) documents.
    allow_empty: a corpus without a non-blank document yields nothing instead of raising
      (one file of a larger corpus).

  Raises:
    DataError: missing path, unsupported format, malformed records, invalid UTF-8 (strict),
      or a corpus without a single non-blank document (raised when iteration ends).
    ConfigError: an unknown `errors` mode or a non-positive `max_documents`.
  """
  _check_errors(errors)
  if max_documents is not None and max_documents <= 0:
    raise ConfigError(f"max_documents must be positive, got {max_documents}")
  if not isinstance(spec, str) or not spec:
    raise ConfigError(f"corpus spec must be a non-empty string, got {spec!r}")
  stats = stats if stats is not None else CorpusStats()
  stats.spec = spec
  raw = _raw_documents(spec, text_field, id_field, user_field, errors, data_dir, stats)
  return _filter_blank(raw, spec, stats, max_documents, allow_empty)


def _filter_blank(raw, spec, stats, max_documents, allow_empty=False) -> Iterator[Document]:
  for doc in raw:
    if not doc.text.strip():
      stats.blank_skipped += 1
      continue
    stats.documents += 1
    stats.characters += len(doc.text)
    yield doc
    if max_documents is not None and stats.documents >= max_documents:
      return
  if stats.documents == 0 and not allow_empty:
    raise DataError(f"corpus {spec} is empty ({stats.blank_skipped} blank documents skipped)")


def read_corpus(spec: str, **kwargs) -> Tuple[List[Document], CorpusStats]:
  """Reads a whole corpus into memory: returns (documents, stats). Same args as iter_documents."""
  stats = CorpusStats()
  docs = list(iter_documents(spec, stats=stats, **kwargs))
  return docs, stats
