"""The indexed token store: a corpus tokenized once, then read by random access.

Layout of a store directory (written to a temp dir, then renamed, so it is complete or absent):

  tokens.int32      all documents' tokens back to back (no EOS), raw little-endian int32
  offsets.int64     N+1 offsets: document i is tokens[offsets[i]:offsets[i+1]]
  documents.json    {"ids": [...], "users": [...] | null}
  manifest.json     format version, corpus spec, vocab path and SHA-256, counts, timing

Why a memory-mapped flat array with offsets rather than array_record (TFDS/grain): DP sampling
fetches an arbitrary index set each step (Poisson sampling); with an offsets array a document is
two integer reads and one slice of a `np.memmap`, with no record parsing, no per-read file
handles and no new dependency; the OS page cache makes repeated access free. array_record
would give the same O(1) access but adds a dependency and a serialization layer for what are
just int32 runs.

Stores are cached by (corpus spec and its size/mtime, reader options, vocab file SHA-256)
under `cache_dir` and reused by later runs.
"""
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np

from private_t5 import progress as progress_lib
from private_t5 import vocabulary as vocab_lib
from private_t5.data import corpora
from private_t5.errors import DataError
from private_t5.io import file_sha256, write_json_atomic

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.int32"
OFFSETS_FILE = "offsets.int64"
DOCUMENTS_FILE = "documents.json"
MANIFEST_FILE = "manifest.json"
_ENCODE_CHUNK = 512  # documents per batched SentencePiece call


def default_cache_dir() -> str:
  """$PRIVATE_T5_CACHE, else ~/.cache/private_t5/stores."""
  env = os.environ.get("PRIVATE_T5_CACHE")
  if env:
    return os.path.join(env, "stores")
  return os.path.join(os.path.expanduser("~"), ".cache", "private_t5", "stores")


def _corpus_fingerprint(spec: str) -> Dict[str, object]:
  """Size and mtime of the corpus files (so that an edited corpus is re-tokenized)."""
  if spec.startswith(corpora.BUILTIN_PREFIX):
    return {"python": sys.version}
  if spec.startswith(corpora.TFDS_PREFIX):
    return {}
  path = os.path.abspath(os.path.expanduser(spec))
  if not os.path.exists(path):
    raise DataError(f"corpus not found: {spec}")
  if os.path.isdir(path):
    entries = []
    for root, dirs, names in os.walk(path):
      dirs.sort()
      for n in sorted(names):
        if n.endswith(".txt"):
          st = os.stat(os.path.join(root, n))
          entries.append([os.path.relpath(os.path.join(root, n), path), st.st_size, st.st_mtime_ns])
    return {"path": path, "files": hashlib.sha256(json.dumps(entries).encode()).hexdigest()}
  st = os.stat(path)
  return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class DocumentStore:
  """Read-only view of a built store: `document_tokens(i)` in O(1) from a memmap."""

  def __init__(self, path: str):
    self.path = path
    try:
      with open(os.path.join(path, MANIFEST_FILE)) as f:
        self.manifest = json.load(f)
      with open(os.path.join(path, DOCUMENTS_FILE)) as f:
        documents = json.load(f)
    except (OSError, ValueError) as e:
      raise DataError(f"{path} is not a token store: {e}") from e
    if self.manifest.get("format_version") != FORMAT_VERSION:
      raise DataError(f"{path}: unsupported store format {self.manifest.get('format_version')!r}")
    self.ids: List[str] = documents["ids"]
    self.users: Optional[List[str]] = documents.get("users")
    self.offsets = np.fromfile(os.path.join(path, OFFSETS_FILE), dtype=np.int64)
    num_tokens = int(self.offsets[-1])
    if num_tokens:
      self.tokens = np.memmap(os.path.join(path, TOKENS_FILE), dtype=np.int32, mode="r", shape=(num_tokens,))
    else:
      self.tokens = np.zeros((0,), np.int32)
    if len(self.offsets) != len(self.ids) + 1:
      raise DataError(f"{path}: offsets and ids disagree ({len(self.offsets)} vs {len(self.ids)}+1)")

  @property
  def num_documents(self) -> int:
    return len(self.ids)

  @property
  def num_tokens(self) -> int:
    return int(self.offsets[-1])

  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  def document_tokens(self, i: int) -> np.ndarray:
    return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def store_key(spec: str, vocab_sha256: str, reader_options: Dict[str, object]) -> str:
  payload = {"format_version": FORMAT_VERSION, "spec": spec, "corpus": _corpus_fingerprint(spec),
             "vocab_sha256": vocab_sha256, "reader": reader_options}
  return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _sentencepiece_processor(vocab_path: str):
  """The SentencePiece model as seqio loads it (validated: T5 layout, real model)."""
  vocab = vocab_lib.load_vocabulary(vocab_path)
  return vocab, vocab_lib.sentencepiece_processor(vocab)


BUILDING_PREFIX = ".building-"
# A build directory whose owner cannot be checked (another host, an older name) is removed
# only when nothing has been written to it for this long.
STALE_BUILD_SECONDS = 24 * 3600


def _build_is_stale(path: str, name: str, now: float) -> bool:
  """True if the build directory `name` belongs to a dead process on this host, or is old."""
  parts = name[len(BUILDING_PREFIX):].rsplit("-", 2)  # host, pid, random suffix
  if len(parts) == 3 and parts[0] == socket.gethostname() and parts[1].isdigit():
    try:
      os.kill(int(parts[1]), 0)
    except ProcessLookupError:
      return True
    except PermissionError:
      return False  # alive, owned by another user
    else:
      return False
  try:
    return now - os.stat(path).st_mtime > STALE_BUILD_SECONDS
  except OSError:
    return False


def remove_stale_builds(cache_dir: str) -> List[str]:
  """Deletes unfinished cache builds of killed processes in `cache_dir`; returns their paths.

  Stale means: named after a process on this host that no longer runs, or (owner unknown:
  another host, an old-style name) untouched for `STALE_BUILD_SECONDS`. Builds in progress
  are never touched.
  """
  removed = []
  now = time.time()
  try:
    names = [n for n in os.listdir(cache_dir) if n.startswith(BUILDING_PREFIX)]
  except OSError:
    return removed
  for name in names:
    path = os.path.join(cache_dir, name)
    if os.path.isdir(path) and _build_is_stale(path, name, now):
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
  return removed


def build_store(corpus: str, vocab_path: str, *, cache_dir: Optional[str] = None, text_field: str = "text",
                id_field: str = "id", user_field: Optional[str] = None, errors: str = "strict",
                max_documents: Optional[int] = None, data_dir: Optional[str] = None,
                num_threads: Optional[int] = None, progress: bool = True) -> DocumentStore:
  """Tokenizes `corpus` with `vocab_path` into a cached store (or opens the cached one).

  While building, a progress bar (documents) on a terminal and a summary log line, unless
  `progress=False`.

  Raises:
    DataError: bad corpus or vocabulary, duplicate document ids; nothing is left behind.
  """
  if not os.path.isfile(vocab_path):
    raise DataError(f"vocabulary file not found: {vocab_path}")
  vocab_sha = file_sha256(vocab_path)
  reader_options = {"text_field": text_field, "id_field": id_field, "user_field": user_field,
                    "errors": errors, "max_documents": max_documents, "data_dir": data_dir}
  cache_dir = os.path.abspath(cache_dir or default_cache_dir())
  final = os.path.join(cache_dir, store_key(corpus, vocab_sha, reader_options))
  if os.path.isfile(os.path.join(final, MANIFEST_FILE)):
    return DocumentStore(final)
  vocab, proc = _sentencepiece_processor(vocab_path)
  os.makedirs(cache_dir, exist_ok=True)
  remove_stale_builds(cache_dir)
  tmp = tempfile.mkdtemp(dir=cache_dir, prefix=f"{BUILDING_PREFIX}{socket.gethostname()}-{os.getpid()}-")
  try:
    manifest = _write_store(tmp, corpus, proc, reader_options, num_threads, progress)
    manifest.update(vocab_path=os.path.abspath(vocab_path), vocab_sha256=vocab_sha,
                    vocab_size=int(vocab.vocab_size))
    _write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
    try:
      os.rename(tmp, final)
    except OSError:
      if not os.path.isfile(os.path.join(final, MANIFEST_FILE)):  # lost a race: keep the winner's
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return DocumentStore(final)


def _write_json(path: str, obj) -> None:
  write_json_atomic(path, obj, indent=None, sort_keys=False)


def _write_store(out_dir, corpus, proc, reader_options, num_threads, progress) -> Dict[str, object]:
  start = time.time()
  stats = corpora.CorpusStats()
  docs = corpora.iter_documents(corpus, stats=stats, **reader_options)
  ids, users, offsets = [], [], [0]
  seen = set()
  bar = progress_lib.bar(desc="[store] tokenizing", unit="docs", disable=not (progress and progress_lib.enabled()))
  threads = num_threads or os.cpu_count() or 1

  def flush(batch, f):
    # SentencePiece's batched encode tokenizes on `threads` native threads.
    for tokens in proc.encode([d.text for d in batch], num_threads=threads):
      arr = np.asarray(tokens, dtype=np.int32)
      arr.tofile(f)
      offsets.append(offsets[-1] + len(arr))

  with open(os.path.join(out_dir, TOKENS_FILE), "wb") as f:
    batch = []
    for doc in docs:
      if doc.id in seen:
        raise DataError(f"corpus {corpus}: duplicate document id {doc.id!r} (ids define the privacy unit)")
      seen.add(doc.id)
      ids.append(doc.id)
      users.append(doc.user)
      batch.append(doc)
      if len(batch) == _ENCODE_CHUNK:
        flush(batch, f)
        bar.update(len(batch))
        batch = []
    flush(batch, f)
  bar.close()
  if progress:
    logger.info("[store] %s: %d documents, %d tokens in %.1fs (%d blank skipped)", corpus, len(ids),
                offsets[-1], time.time() - start, stats.blank_skipped)
  np.asarray(offsets, dtype=np.int64).tofile(os.path.join(out_dir, OFFSETS_FILE))
  has_users = reader_options["user_field"] is not None
  if has_users and any(u is None for u in users):
    missing = ids[[u is None for u in users].index(True)]
    raise DataError(f"corpus {corpus}: document {missing!r} has no user ({reader_options['user_field']!r} is null)")
  _write_json(os.path.join(out_dir, DOCUMENTS_FILE), {"ids": ids, "users": users if has_users else None})
  seconds = time.time() - start
  return {
      "format_version": FORMAT_VERSION,
      "corpus": corpus,
      "reader": reader_options,
      "num_documents": len(ids),
      "num_tokens": int(offsets[-1]),
      "num_users": len(set(users)) if has_users else None,
      "blank_skipped": stats.blank_skipped,
      "replaced_lines": stats.replaced_lines,
      "characters": stats.characters,
      "build_seconds": round(seconds, 3),
      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }
