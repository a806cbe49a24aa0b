"""The token store built in parallel on Apache Beam (any runner): one shard per input file.

  sorted input files (a pattern, `beam_io.match_files`)
    -> Reshuffle                                   (files spread over the workers)
    -> per file: read its documents in line order, tokenize with SentencePiece (the model is
       loaded once per worker, in `setup`), write shard S of K straight into the build
       directory (`store_writer.ShardWriter`: tokens + offsets and the shard's index of ids and users,
       each complete or absent) and a small side file with the shard's counts and its users
    -> the launching process reads the side files (a shard without one is one DataError; the
       counters of the summary are summed from them, the same on every runner, metrics or not),
       checks ids over all shards (a duplicate is one DataError),
       merges the users, writes the manifest with the shard index, and renames the build
       directory into the cache, exactly as the local build does.

Document order is the sorted input files, then line order inside each file: the order in which
`corpora.iter_documents` reads the same pattern, so document i of the Beam store equals
document i of the local store (`store.build_store`), and both live under the same cache key.

The build directory is under `cache_dir`, which every worker must be able to write: a local
folder for DirectRunner, a shared file system for a cluster (Dask, Flink, Spark on several
machines). The pipeline is one chain (files -> shards) with one last step, and each shard's
files and side file are complete or absent, so every runner, Dask included, builds the same entry.
"""
import json
import logging
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

import sentencepiece as spm

from private_t5 import documents as documents_lib
from private_t5.data import beam_io, corpora
from private_t5.data import beam_runner
from private_t5.data import beam_pipeline
from private_t5.data import store as store_lib
from private_t5.data import store_reader, store_writer
from private_t5.errors import ConfigError, DataError
from private_t5.io import write_json_atomic
from private_t5.lazy_imports import lazy_module

# Apache Beam is optional (`data.beam_io.import_beam`): its file systems are imported for a remote file only.
filesystems = lazy_module("apache_beam.io.filesystems", needed_for="a remote corpus file",
                          install="apache-beam (requirements.txt)")

logger = logging.getLogger(__name__)

_SIDE_FILE = "shard-{:05d}.json"


def input_files(corpus: str) -> List[str]:
  """The sorted files of a file pattern (or a single file), local or remote; DataError when none."""
  if corpus.startswith((corpora.TFDS_PREFIX, corpora.BUILTIN_PREFIX)):
    raise ConfigError(f"the Beam store build reads file patterns, not {corpus!r}: use --runner=local")
  if "://" in corpus:
    return beam_io.match_files(corpus)
  if corpora.is_file_pattern(corpus):
    return corpora.match_pattern(corpus)
  path = os.path.expanduser(corpus)
  if os.path.isdir(path):
    raise ConfigError(f"the Beam store build reads file patterns, not the folder {corpus!r}: use --runner=local")
  if not os.path.isfile(path):
    raise DataError(f"corpus not found: {corpus}")
  return [path]


def _documents_of(path: str, reader_options, stats: documents_lib.CorpusStats):
  """The documents of one file in line order, as the local path reads them."""
  if "://" not in path:
    return corpora.iter_documents(path, stats=stats, allow_empty=True, **reader_options)
  return _remote_documents(path, reader_options, stats)


def _remote_documents(path: str, reader_options, stats: documents_lib.CorpusStats):
  with filesystems.FileSystems.open(path) as f:
    for _, doc in beam_io.iter_file_documents(path, iter(f.readline, b""), text_field=reader_options["text_field"],
                                              id_field=reader_options["id_field"], errors=reader_options["errors"]):
      if isinstance(doc, DataError):
        raise DataError(str(doc))
      stats.documents += 1
      stats.characters += len(doc[1])
      yield documents_lib.Document(id=doc[0], text=doc[1])


class _WriteShard:
  """DoFn body: (shard index, path) -> writes that shard; yields its index entry."""

  def __init__(self, out_dir: str, num_shards: int, model_proto: bytes, reader_options, num_threads: int):
    self.out_dir, self.num_shards, self.model_proto = out_dir, num_shards, model_proto
    self.reader_options, self.num_threads = reader_options, num_threads
    self.proc = None

  def setup(self):
    self.proc = spm.SentencePieceProcessor()
    self.proc.LoadFromSerializedProto(self.model_proto)

  def process(self, element):
    index, path = element
    stats = documents_lib.CorpusStats()
    writer = store_writer.ShardWriter(self.out_dir, index, self.num_shards, self.proc, self.num_threads,
                                   with_users=self.reader_options["user_field"] is not None)
    try:
      for doc in _documents_of(path, self.reader_options, stats):
        writer.add(doc)
      shard = writer.close()
    except BaseException:
      writer.abort()
      raise
    side = {"shard": shard,
            "stats": {"blank_skipped": stats.blank_skipped, "replaced_lines": stats.replaced_lines,
                      "characters": stats.characters, "text_bytes": writer.text_bytes}}
    write_json_atomic(os.path.join(self.out_dir, _SIDE_FILE.format(index)), side, indent=None,
                                sort_keys=False)
    beam_pipeline.counter("documents_tokenized").inc(writer.documents)
    beam_pipeline.counter("tokens_written").inc(int(shard["num_tokens"]))
    beam_pipeline.counter("text_bytes").inc(writer.text_bytes)
    beam_pipeline.counter("shards_written").inc()
    yield index


def build_store_beam(corpus: str, vocab_path: str, *, runner: str = "DirectRunner",
                     beam_options: Union[str, Sequence[str]] = "", cache_dir: Optional[str] = None,
                     text_field: str = "text", id_field: str = "id", user_field: Optional[str] = None,
                     errors: str = "strict", max_documents: Optional[int] = None, data_dir: Optional[str] = None,
                     num_threads: int = 1, verify: bool = False, rebuild_damaged: bool = False
                     ) -> Tuple[store_reader.DocumentStore, Dict[str, int]]:
  """Builds (or reuses) the cached store of `corpus` on Beam; returns it and the Beam counters.

  Args:
    corpus: a file pattern or file (local or remote); each matching file becomes one shard.
    vocab_path: the SentencePiece model (T5 layout).
    runner, beam_options: the Beam runner and its `PipelineOptions` flags, unchanged.
    cache_dir: the store cache (the same entry `store.build_store` and training use).
    num_threads: SentencePiece threads per worker.
    verify, rebuild_damaged: how a cached entry is checked, and whether a damaged one is built
      again (`store.build_store`).

  Raises:
    ConfigError: a local runner, `max_documents`, a corpus that is not a file pattern.
    DataError: no file matches, malformed input, duplicate ids (also across files), a damaged
      cached entry (without `rebuild_damaged`).
  """
  if not beam_runner.is_beam(runner):
    raise ConfigError("build_store_beam needs a Beam runner, not 'local'")
  if max_documents is not None:
    raise ConfigError("max_documents applies to --runner=local only; give a smaller file pattern instead")
  reader_options = store_lib.reader_options_of(text_field=text_field, id_field=id_field, user_field=user_field,
                                               errors=errors, max_documents=None, data_dir=data_dir)
  if errors not in corpora.ERROR_MODES:
    raise ConfigError(f"errors must be one of {corpora.ERROR_MODES}, got {errors!r}")
  target = store_lib.cache_target(corpus, vocab_path, reader_options, cache_dir)
  cached = target.open(verify=verify, rebuild_damaged=rebuild_damaged)
  if cached is not None:
    return cached, {}
  files = input_files(corpus)
  if user_field and any("://" in f for f in files):
    raise ConfigError("user_field is supported for local files only on a Beam runner")
  for f in files:
    beam_io.file_format(f)  # unsupported formats fail before the pipeline starts
  beam = beam_runner.import_beam()
  options = beam_runner.pipeline_options(runner, beam_options)
  vocab, proc = store_lib.load_processor(vocab_path)
  counters: Dict[str, int] = {}
  worker_options = {k: v for k, v in reader_options.items() if k != "max_documents"}

  def write(tmp: str):
    start = time.time()
    body = _WriteShard(tmp, len(files), proc.serialized_model_proto(), worker_options, num_threads)
    pipeline = beam.Pipeline(options=options)
    _ = (pipeline
         | "files" >> beam.Create(list(enumerate(files)))
         | "reshuffle" >> beam.Reshuffle()
         | "tokenize and write shards" >> beam.ParDo(beam_pipeline.do_fn(beam, body)))
    beam_pipeline.run_pipeline(pipeline, stage="store", runner=runner)
    shards = []
    totals = {"blank_skipped": 0, "replaced_lines": 0, "characters": 0, "text_bytes": 0}
    for k in range(len(files)):
      side_path = os.path.join(tmp, _SIDE_FILE.format(k))
      try:
        with open(side_path, encoding="utf-8") as f:
          side = json.load(f)
      except OSError as e:
        raise DataError(f"the Beam build wrote no shard {k} for {files[k]}: {e}") from e
      os.remove(side_path)
      shards.append(side["shard"])
      for name in totals:
        totals[name] += int(side["stats"][name])
    # Summed from the side files rather than read from Beam's metrics: the same on every runner.
    counters.update({"documents_tokenized": sum(int(sh["documents"]) for sh in shards),
                     "tokens_written": sum(int(sh["num_tokens"]) for sh in shards),
                     "text_bytes": totals["text_bytes"], "shards_written": len(shards)})
    manifest = store_writer.finish_store(tmp, corpus, reader_options, shards, totals, start, sources=files)
    manifest["runner"] = runner
    logger.info("[store] %s on %s: %d documents, %d tokens, %d shards in %.1fs", corpus, runner,
                 manifest["num_documents"], manifest["num_tokens"], len(shards), manifest["build_seconds"])
    return manifest

  return target.build(write, vocab), counters
