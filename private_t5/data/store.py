"""The indexed token store: a corpus tokenized once, then read by random access.

Layout of a store directory (written to a temp dir, then renamed, so it is complete or absent):

  tokens-SSSSS-of-KKKKK.int32   shard S of K: its documents' tokens back to back (no EOS),
                                raw little-endian int32
  offsets-SSSSS-of-KKKKK.int64  n_S+1 offsets into that shard's tokens: the shard's local
                                document j is tokens[offsets[j]:offsets[j+1]]
  ids-*, idhash-*, users.int64, user-names.*
                                the per-document index: ids and users on disk, read on demand
                                (`store_index`): opening a store loads no string per document
  manifest.json                 format version, corpus spec, vocab path and SHA-256, counts,
                                timing, and the shard index: `shards` (file names, documents
                                and tokens per shard) and `shard_starts` (K+1 cumulative document
                                counts: global document i lives in the shard S with
                                shard_starts[S] <= i < shard_starts[S+1], at local index
                                i - shard_starts[S]), and `checksums`: the size and SHA-256
                                of every other file of the entry (`entry_checksums`)

Global document order is shard order, then the order inside each shard. The local build
writes K=1 shard; the Beam build (`store_beam.py`) writes one shard per input file, each by
the worker that tokenized it, so both give the same document i for the same corpus.

Reading: a document is a binary search over the K+1 shard starts (O(log K)), two integer
reads and one slice of that shard's memory map; a shard's files are opened on first use and
never read whole, so a process touches only the shards its documents live in (per-host reads).

Why memory-mapped flat arrays with offsets rather than array_record (TFDS/grain): DP sampling
fetches an arbitrary index set each step (Poisson sampling); with offsets a document costs no
record parsing, no per-read file handles and no new dependency; the OS page cache makes
repeated access free. array_record would give the same O(1) access but adds a dependency and a
serialization layer for what are just int32 runs.

Format versions: version 3 is the layout above. Versions 2 (the same shards, with every id and
user in one `documents.json`) and 1 (one `tokens.int32` + `offsets.int64`, no shard index) still
open, their `documents.json` read whole (about 180 bytes a document); the cache key includes the
format version, so the stages build a version-3 store beside an old cached one instead of reusing
it (delete old cache entries to reclaim the space).

Integrity: opening an entry compares each file's size with its `checksums` record (one `stat`
a file) and the SHA-256 of every file but the token files (the offsets and the index: 8 to 50
bytes a document, read in blocks), so a truncated, missing or altered file is one DataError naming
it (`DamagedStoreError`), never a crash while training reads it; `private-t5 store --verify` also
compares the token files' SHA-256 (the whole entry read once; a token file of another size is
damaged without it), and `private-t5 store` rebuilds a damaged entry. While a run reads an entry,
each read checks the size of the files it reads, and a file truncated under it is one line and
exit status 2, never a bare bus error (`store_files`' docstring says how, and why this way). An
entry written before the record existed is checked on what its index implies (offsets files of the
right size, token files as long as their last offset).

Stores are cached by (corpus spec and its files' size/mtime, reader options, vocab file SHA-256)
under `cache_dir` and reused by later runs; `private-t5 store` builds the same entry ahead of
training, locally or on Apache Beam.

The store's parts: `store_files` (the files of an entry, their format versions and integrity
checks), `store_reader` (`DocumentStore`, reading by global index), `store_writer` (`ShardWriter`
and `finish_store`, writing shards and the manifest) and `store_index` (ids and users on disk);
this module is the cache: an entry's key, its build in a temporary folder renamed into place, and
the reuse of a built entry.
"""
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from private_t5 import progress as progress_lib
from private_t5 import vocabulary as vocab_lib
from private_t5.data import corpora
from private_t5 import documents
from private_t5.data.store_files import (
    CHECKSUMS_KEY,
    FORMAT_VERSION,
    MANIFEST_FILE,
    DamagedStoreError,
    entry_checksums,
)
from private_t5.data.store_index import tokens_digest
from private_t5.data.store_reader import DocumentStore
from private_t5.data.store_writer import ShardWriter, finish_store
from private_t5.errors import ConfigError, DataError
from private_t5.io import STALE_TEMP_SECONDS, file_sha256, make_temp_dir, remove_stale_temp_dirs, write_json_atomic
from private_t5.lazy_imports import lazy_module

# Apache Beam is optional (`data.beam_io.import_beam`): its file systems are imported for a remote pattern only.
filesystems = lazy_module("apache_beam.io.filesystems", needed_for="a remote corpus pattern",
                          install="apache-beam (requirements.txt)")

logger = logging.getLogger(__name__)


def default_cache_dir() -> str:
  """$PRIVATE_T5_CACHE, else ~/.cache/private_t5/stores."""
  env = os.environ.get("PRIVATE_T5_CACHE")
  if env:
    return os.path.join(env, "stores")
  return os.path.join(os.path.expanduser("~"), ".cache", "private_t5", "stores")


def _files_digest(entries) -> str:
  return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _corpus_fingerprint(spec: str) -> Dict[str, object]:
  """Size and mtime of the corpus files (so that an edited corpus is re-tokenized)."""
  if spec.startswith(corpora.BUILTIN_PREFIX):
    return {"python": sys.version}
  if spec.startswith(corpora.TFDS_PREFIX):
    return {}
  if "://" in spec:  # a remote pattern (gs://...): sizes and times from Beam's file systems
    found = sorted((m.path, m.size_in_bytes, m.last_updated_in_seconds)
                   for r in filesystems.FileSystems.match([spec]) for m in r.metadata_list)
    return {"pattern": spec, "files": _files_digest(found)}
  if corpora.is_file_pattern(spec):
    entries = []
    for p in corpora.match_pattern(spec):
      st = os.stat(p)
      entries.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    return {"pattern": os.path.abspath(os.path.expanduser(spec)), "files": _files_digest(entries)}
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
    return {"path": path, "files": _files_digest(entries)}
  st = os.stat(path)
  return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}



def discard_entry(cache_dir: str, final: str) -> None:
  """Removes a (damaged) cache entry: renamed to a build directory first, so that a killed removal
  leaves only what `remove_stale_builds` deletes, never a half-deleted entry under its key."""
  aside = make_temp_dir(cache_dir, BUILDING_PREFIX)
  try:
    os.rename(final, aside)  # onto the empty folder
  except FileNotFoundError:
    pass  # removed by another process meanwhile
  except OSError as e:
    os.rmdir(aside)
    raise DataError(f"cannot remove the damaged store {final}: {e.strerror or e}") from None
  shutil.rmtree(aside, ignore_errors=True)


def open_cached(cache_dir: str, final: str, opener: Callable[..., object], verify: bool = False,
                rebuild_damaged: bool = False):
  """(the cached entry `final` opened by `opener(final, verify=...)`, marked `reused`, or None when
  there is none; the reason it was discarded, or None). The opener checks the entry's files
  (`store_files.check_entry`: sizes, and the SHA-256 of all but the token files; `verify`: of those
  too).

  A damaged entry (`DamagedStoreError`) is refused, or with `rebuild_damaged` removed (one log line)
  so that the caller builds it again.
  """
  if not os.path.isfile(os.path.join(final, MANIFEST_FILE)):
    return None, None
  try:
    store = opener(final, verify=verify)
  except DamagedStoreError as e:
    if not rebuild_damaged:
      raise
    logger.warning("[store] rebuilding the damaged entry %s: %s", final, e.reason)
    discard_entry(cache_dir, final)
    return None, e.reason
  if verify and CHECKSUMS_KEY not in store.manifest:
    logger.warning("[store] %s was built without a checksums record: only the sizes its index implies were "
                   "checked (delete it and run `private-t5 store` again to get one)", final)
  store.reused = True
  return store, None


_ENTRY_NAME = re.compile(r"^(seqio-)?[0-9a-f]{24}$")


def check_cache_dir(cache_dir: str) -> None:
  """ConfigError when `cache_dir` is a cache entry or lies inside one (a store would be built
  among another store's files)."""
  path = os.path.abspath(os.path.expanduser(cache_dir))
  while True:
    if _ENTRY_NAME.match(os.path.basename(path)) and os.path.isfile(os.path.join(path, MANIFEST_FILE)):
      raise ConfigError(f"store cache_dir {cache_dir!r} is inside the store {path}; give the cache folder "
                        f"that holds it ({os.path.dirname(path)})")
    parent = os.path.dirname(path)
    if parent == path:
      return
    path = parent


def store_key(spec: str, vocab_sha256: str, reader_options: Dict[str, object]) -> str:
  payload = {"format_version": FORMAT_VERSION, "spec": spec, "corpus": _corpus_fingerprint(spec),
             "vocab_sha256": vocab_sha256, "reader": reader_options}
  return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _sentencepiece_processor(vocab_path: str):
  """The vocabulary with its sentinels and its processor (validated: T5 layout, real model)."""
  vocab = vocab_lib.load_vocabulary(vocab_path)
  return vocab, vocab_lib.sentencepiece_processor(vocab)


BUILDING_PREFIX = ".building-"
# A build directory whose owner cannot be checked (another host, an older name) is removed
# only when nothing has been written to it for this long.
STALE_BUILD_SECONDS = STALE_TEMP_SECONDS


def remove_stale_builds(cache_dir: str) -> List[str]:
  """Deletes unfinished cache builds of killed processes in `cache_dir`; returns their paths.

  Stale means: named after a process on this host that no longer runs, or (owner unknown:
  another host, an old-style name) untouched for `STALE_BUILD_SECONDS`. Builds in progress
  are never touched.
  """
  return remove_stale_temp_dirs(cache_dir, BUILDING_PREFIX)


def build_store(corpus: str, vocab_path: str, *, cache_dir: Optional[str] = None, text_field: str = "text",
                id_field: str = "id", user_field: Optional[str] = None, errors: str = "strict",
                max_documents: Optional[int] = None, data_dir: Optional[str] = None,
                num_threads: Optional[int] = None, progress: bool = True, verify: bool = False,
                rebuild_damaged: bool = False) -> DocumentStore:
  """Tokenizes `corpus` with `vocab_path` into a cached store (or opens the cached one).

  The local build writes one shard. While building, a progress bar (documents) on a terminal
  and a summary log line, unless `progress=False`. A cached entry is checked as it is opened
  (`DocumentStore`: sizes and the SHA-256 of its offsets and index; `verify`: of its token files
  too); a damaged one is refused, or with `rebuild_damaged` built again (the store's `rebuilt`
  says why).

  Raises:
    DataError: bad corpus or vocabulary, duplicate document ids; nothing is left behind.
    DamagedStoreError: the cached entry is damaged (without `rebuild_damaged`).
  """
  reader_options = reader_options_of(text_field=text_field, id_field=id_field, user_field=user_field,
                                     errors=errors, max_documents=max_documents, data_dir=data_dir)
  target = cache_target(corpus, vocab_path, reader_options, cache_dir)
  store = target.open(verify=verify, rebuild_damaged=rebuild_damaged)
  if store is not None:
    return store
  vocab, proc = _sentencepiece_processor(vocab_path)

  def write(tmp):
    return _write_store(tmp, corpus, proc, reader_options, num_threads, progress)

  return target.build(write, vocab)


def reader_options_of(*, text_field: str = "text", id_field: str = "id", user_field: Optional[str] = None,
                      errors: str = "strict", max_documents: Optional[int] = None,
                      data_dir: Optional[str] = None) -> Dict[str, object]:
  """The corpus reader options, as they enter the cache key."""
  return {"text_field": text_field, "id_field": id_field, "user_field": user_field,
          "errors": errors, "max_documents": max_documents, "data_dir": data_dir}


class CacheTarget:
  """Where the store of (corpus, vocabulary, reader options) lives in a cache, and its build."""

  def __init__(self, corpus: str, vocab_path: str, vocab_sha256: str, reader_options, cache_dir: str):
    self.corpus, self.vocab_path, self.vocab_sha256 = corpus, vocab_path, vocab_sha256
    self.reader_options, self.cache_dir = reader_options, cache_dir
    self.final = os.path.join(cache_dir, store_key(corpus, vocab_sha256, reader_options))
    self.rebuilt: Optional[str] = None

  def exists(self) -> bool:
    return os.path.isfile(os.path.join(self.final, MANIFEST_FILE))

  def open(self, verify: bool = False, rebuild_damaged: bool = False) -> Optional[DocumentStore]:
    """The cached store (`open_cached`), or None when it must be built (absent, or damaged and removed)."""
    store, self.rebuilt = open_cached(self.cache_dir, self.final, DocumentStore, verify, rebuild_damaged)
    return store

  def build(self, write, vocab) -> DocumentStore:
    """Runs `write(tmp_dir) -> manifest` in a fresh build directory, then renames it into place
    (`build_in_cache`).

    Raises:
      DataError: `cache_dir` cannot be created or written.
    """
    def manifest(tmp):
      m = write(tmp)
      checksums: Dict[str, Dict[str, object]] = {}
      m.update(vocab_path=os.path.abspath(self.vocab_path), vocab_sha256=self.vocab_sha256,
               vocab_size=int(vocab.vocab_size), tokens_sha256=tokens_digest(tmp, m, checksums))
      m[CHECKSUMS_KEY] = checksums  # the token files' records, from the digest's read
      return m

    build_in_cache(self.cache_dir, self.final, manifest)
    store = DocumentStore(self.final, index_checksum=False)  # hashed as it was written, a moment ago
    store.rebuilt = self.rebuilt
    return store


def build_in_cache(cache_dir: str, final: str, write: Callable[[str], Dict[str, object]]) -> None:
  """Builds a cache entry: `write(tmp_dir) -> manifest` in a fresh build directory of `cache_dir`,
  the manifest written last, then the directory renamed to `final` (complete or absent).

  The manifest gets the `checksums` record of every file of the entry (`entry_checksums`: those
  the manifest already records, hashed while written, are kept; the others are read once).

  A failed (or interrupted) build leaves the cache as it was: its build directory goes, and so do
  the cache folders it created (when still empty). A build that lost a race to another process
  building the same entry keeps the winner's.

  Raises:
    DataError: `cache_dir` cannot be created or written.
  """
  created = _missing_folders(cache_dir)
  try:
    tmp = _make_build_dir(cache_dir)
    try:
      manifest = write(tmp)
      manifest[CHECKSUMS_KEY] = entry_checksums(tmp, manifest.get(CHECKSUMS_KEY))
      _write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
      try:
        os.rename(tmp, final)
      except OSError:
        if not os.path.isfile(os.path.join(final, MANIFEST_FILE)):  # lost a race: keep the winner's
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  except BaseException:
    _remove_empty_folders(created)
    raise


def _make_build_dir(cache_dir: str) -> str:
  """A fresh build directory in the cache (created if need be), after removing stale ones."""
  try:
    os.makedirs(cache_dir, exist_ok=True)
    remove_stale_builds(cache_dir)
    return make_temp_dir(cache_dir, BUILDING_PREFIX)
  except OSError as e:
    file = _file_in_the_way(cache_dir)
    reason = f"{file!r} is a file, not a folder" if file else (e.strerror or e)
    raise DataError(f"store cache_dir {cache_dir!r} is not writable: {reason}") from None


def _file_in_the_way(path: str) -> Optional[str]:
  """`path` or the nearest of its parents that exists, if that is not a folder; else None."""
  path = os.path.abspath(path)
  while not os.path.lexists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return None if os.path.isdir(path) else path


def _missing_folders(path: str) -> List[str]:
  """`path` and those of its parents that do not exist yet, deepest first."""
  missing = []
  while path and not os.path.exists(path) and os.path.dirname(path) != path:
    missing.append(path)
    path = os.path.dirname(path)
  return missing


def _remove_empty_folders(folders: Sequence[str]) -> None:
  """Removes `folders` (deepest first) while they are empty: what a failed build created."""
  for folder in folders:
    try:
      os.rmdir(folder)
    except FileNotFoundError:
      continue  # never created
    except OSError:
      return


def cache_target(corpus: str, vocab_path: str, reader_options, cache_dir: Optional[str] = None) -> CacheTarget:
  """The cache entry of a store (checks that the vocabulary file exists)."""
  if not os.path.isfile(vocab_path):
    raise DataError(f"vocabulary file not found: {vocab_path}")
  check_cache_dir(cache_dir or default_cache_dir())
  return CacheTarget(corpus, vocab_path, file_sha256(vocab_path), reader_options,
                     os.path.abspath(cache_dir or default_cache_dir()))


def load_processor(vocab_path: str):
  """(vocabulary, SentencePieceProcessor) exactly as the store build tokenizes with them."""
  return _sentencepiece_processor(vocab_path)


def _write_json(path: str, obj) -> None:
  write_json_atomic(path, obj, indent=None, sort_keys=False)



def _write_store(out_dir, corpus, proc, reader_options, num_threads, progress) -> Dict[str, object]:
  start = time.time()
  stats = documents.CorpusStats()
  docs = corpora.iter_documents(corpus, stats=stats, **reader_options)
  bar = progress_lib.bar(desc="[store] tokenizing", unit="docs", disable=not (progress and progress_lib.enabled()))
  writer = ShardWriter(out_dir, 0, 1, proc, num_threads or os.cpu_count() or 1,
                       with_users=reader_options["user_field"] is not None)
  try:
    for doc in docs:
      bar.update(writer.add(doc))
    shard = writer.close()
  except BaseException:
    writer.abort()
    raise
  bar.close()
  if progress:
    logger.info("[store] %s: %d documents, %d tokens in %.1fs (%d blank skipped)", corpus, writer.documents,
                shard["num_tokens"], time.time() - start, stats.blank_skipped)
  counts = {"blank_skipped": stats.blank_skipped, "replaced_lines": stats.replaced_lines,
            "characters": stats.characters, "text_bytes": writer.text_bytes}
  return finish_store(out_dir, corpus, reader_options, [shard], counts, start)
