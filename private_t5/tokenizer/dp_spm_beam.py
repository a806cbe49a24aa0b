"""The DP-SentencePiece word histogram on Apache Beam (any runner: `beam_io.run_items`).

  corpus files (file patterns; any other spec, such as tfds:, is first streamed by the launching
  process into JSON lines files of the work folder, `CHUNK_DOCUMENTS` documents a file)
    -> per file, in a worker: per document `dp_spm_histogram.bounded_counts(text.split(), bound)` (the
       contribution bound, the same function as the local path, applied before any
       aggregation), summed over the file and written as `PARTITIONS` parts by a hash of the
       word; the file's stats; with `fingerprints`, its documents' keyed signatures
       (`doc_fingerprints`; the secret key travels to the workers with the work, as the corpus
       itself does)
    -> per partition, in a worker: the parts of every file summed (the summed histogram)
    -> read back by the launching process (a Counter of the distinct words, as before).

Two pipelines, one after the other, each one element a file or a partition; every file is written
under a temporary name and renamed into place, so a retried element rewrites its own files whole
and no runner needs to finalize a file sink.

The sensitivity argument of `dp_spm` holds unchanged: each document enters the sum only
through its bounded histogram. Noise and threshold are NOT applied here: the launching
process applies them once, with `dp_spm_release.private_histogram` and OS-entropy keys, exactly as on
the local path (`train_dp_vocabulary(..., histogram_fn=beam_histogram_fn(...))`). The noiseless
histogram is the same as the local path's for the same corpus and bound.
"""
import collections
import functools
import io
import json
import logging
import os
import time
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from private_t5 import doc_fingerprints
from private_t5.data import beam_io
from private_t5.data import beam_files
from private_t5.data import beam_runner
from private_t5.data import beam_pipeline
from private_t5.data import corpora
from private_t5.errors import ConfigError, DataError
from private_t5.tokenizer import dp_spm_histogram

logger = logging.getLogger(__name__)

_STATS_FIELDS = ("documents", "bytes", "words_raw", "words_counted")
PARTITIONS = 32  # the summed histogram, by a hash of the word
CHUNK_DOCUMENTS = 100_000  # documents a work file, for a corpus that is not a file pattern


def _partition_of(word: str) -> int:
  """The histogram partition of a word: the same in every process (CRC-32 of its UTF-8)."""
  return zlib.crc32(word.encode("utf-8")) % PARTITIONS


class _FileSignatures:
  """The keyed signatures (`doc_fingerprints.signatures`) of one file's documents, signed a chunk at a time."""

  def __init__(self, key: bytes):
    self.key, self._texts, self._parts, self._documents = key, [], [], 0

  def add(self, text: str) -> None:
    self._texts.append(text)
    if len(self._texts) >= doc_fingerprints.CHUNK:
      self._sign()

  def _sign(self) -> None:
    prints, sampled, owners = doc_fingerprints.signatures(self._texts, self.key)
    self._parts.append((prints, sampled, owners + self._documents))
    self._documents += len(self._texts)
    self._texts = []

  def to_bytes(self) -> bytes:
    """The file's fingerprints, sampled shingles and the document (0..n-1) of each, as `.npz` bytes."""
    self._sign()
    columns = list(zip(*self._parts)) or [[np.zeros(0, np.uint64)], [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]]
    out = io.BytesIO()
    np.savez(out, prints=np.concatenate(columns[0]), shingles=np.concatenate(columns[1]),
             owners=np.concatenate(columns[2]))
    return out.getvalue()


def _count_file(element, root: str, mode: str, max_words: int, text_field: str, errors: str,
                skip_bad_lines: bool, key: Optional[bytes]) -> Dict[str, int]:
  """(file number, path) -> the file's stats; writes its bounded counts by partition and its
  documents' fingerprints.

  Each document is bounded on its own (`dp_spm_histogram.bounded_counts`, as the local path does it)
  before it is added to the file's sum, so the sum has the local path's sensitivity.
  """
  number, path = element
  bound = dp_spm_histogram.ContributionBound(mode, max_words)
  total = collections.Counter()
  stats = dict.fromkeys(_STATS_FIELDS + ("bad_lines",), 0)
  signed = _FileSignatures(key) if key is not None else None
  with beam_io.filesystems.FileSystems.open(path) as f:
    for _, doc in beam_io.iter_file_documents(path, iter(f.readline, b""), text_field=text_field, errors=errors):
      if isinstance(doc, beam_io.BadLine):
        if not skip_bad_lines:
          raise DataError(f"{doc} (pass --skip_bad_lines to count and skip it)")
        stats["bad_lines"] += 1
        logger.warning("skipped: %s", doc)
        continue
      text = doc[1]
      words = text.split()
      hist = dp_spm_histogram.bounded_counts(words, bound)
      stats["documents"] += 1
      stats["bytes"] += len(text.encode("utf-8"))
      stats["words_raw"] += len(words)
      stats["words_counted"] += sum(hist.values())
      total.update(hist)
      if signed is not None:
        signed.add(text)
  parts = collections.defaultdict(dict)
  for word, count in total.items():
    parts[_partition_of(word)][word] = count
  for p, counts in parts.items():
    beam_files.write_atomic(f"{root}/partial/{p:03d}/{number:06d}.json",
                         json.dumps(counts, ensure_ascii=False).encode("utf-8"))
  if signed is not None:
    beam_files.write_atomic(f"{root}/fingerprints/{number:06d}.npz", signed.to_bytes())
  beam_pipeline.counter("words_counted").inc(stats["words_counted"])
  return stats


def _sum_partition(p: int, root: str, num_files: int) -> int:
  """Partition p: the parts of every file summed, written as counts/PPP.json; its distinct words."""
  total = collections.Counter()
  for number in range(num_files):
    path = f"{root}/partial/{p:03d}/{number:06d}.json"
    if beam_io.filesystems.FileSystems.exists(path):
      total.update(json.loads(beam_files.read_bytes(path)))
  beam_files.write_atomic(f"{root}/counts/{p:03d}.json", json.dumps(dict(total), ensure_ascii=False).encode("utf-8"))
  return len(total)


def _corpus_files(specs, root: str, text_field: str, errors: str, data_dir: Optional[str]) -> List[str]:
  """The files of `specs` in reading order; a spec that is not a file pattern or a file (tfds:, a
  folder, builtin:) is streamed into JSON lines files of the work folder first."""
  out = []
  for c, spec in enumerate([specs] if isinstance(specs, str) else list(specs)):
    if not isinstance(spec, str) or not spec:
      raise ConfigError(f"missing corpus: give at least one file pattern or corpus spec, got {spec!r}")
    if beam_io.is_pattern_or_file(spec) and not spec.startswith(corpora.TFDS_PREFIX):
      paths = beam_io.match_files(os.path.expanduser(spec))
      for path in paths:
        beam_io.file_format(path)  # unsupported formats fail before the pipeline starts
      out += paths
      continue
    docs = corpora.iter_documents(spec, text_field=text_field, errors=errors, data_dir=data_dir)
    chunk, done = 0, False
    while not done:
      path = f"{root}/corpus/{c:03d}-{chunk:05d}.jsonl"
      n = 0
      with beam_files.open_atomic(path) as f:
        for d in docs:
          f.write((json.dumps({"id": d.id, "text": d.text}, ensure_ascii=False) + "\n").encode("utf-8"))
          n += 1
          if n >= CHUNK_DOCUMENTS:
            break
      done = n < CHUNK_DOCUMENTS
      if n:
        out.append(path)
      chunk += 1
  return out


def beam_histogram(corpus: Union[str, Sequence[str]], bound: dp_spm_histogram.ContributionBound, *,
                   runner: str = "DirectRunner", beam_options: Union[str, Sequence[str]] = "",
                   text_field: str = "text", errors: str = "strict", data_dir: Optional[str] = None,
                   max_documents: Optional[int] = None, skip_bad_lines: bool = False,
                   work_dir: Optional[str] = None,
                   fingerprints: Optional[doc_fingerprints.FingerprintWriter] = None
                   ) -> Tuple[collections.Counter, dp_spm_histogram.HistogramStats]:
  """The summed bounded histogram of `corpus` (noiseless) and its stats, computed on Beam.

  Args:
    corpus: file pattern(s) / corpus spec(s) (see `beam_io.read_documents`).
    bound: the per-document contribution bound.
    runner: a Beam runner name.
    beam_options: flags for `PipelineOptions`, unchanged.
    work_dir: where workers write the histogram (default: the options' `temp_location`, else
      a local temporary folder); removed afterwards when local.
    fingerprints: where the documents' keyed fingerprints go (None: not computed).

  Returns:
    (histogram, stats), as `dp_spm_histogram.build_histogram` returns them.
  """
  if not beam_runner.is_beam(runner):
    raise ConfigError("beam_histogram needs a Beam runner, not 'local'")
  if max_documents is not None:
    raise ConfigError("max_documents applies to --runner=local only; give a smaller file pattern instead")
  beam_runner.import_beam()
  options = beam_runner.pipeline_options(runner, beam_options)
  start = time.time()
  with beam_files.output_dir(options, work_dir, "dp_spm_histogram") as out_dir:
    files = _corpus_files(corpus, out_dir, text_field, errors, data_dir)
    run = dict(options=options, out_dir=out_dir + "/results", stage="dp-spm histogram", runner=runner)
    key = fingerprints.key if fingerprints is not None else None
    per_file = beam_pipeline.run_items(list(enumerate(files)), _count_file, out_dir, bound.mode, bound.max_words,
                                 text_field, errors, skip_bad_lines, key, step="count files", **run)
    beam_pipeline.run_items(list(range(PARTITIONS)), _sum_partition, out_dir, len(files), step="sum counts", **run)
    histogram = collections.Counter()
    for p in range(PARTITIONS):
      histogram.update(json.loads(beam_files.read_bytes(f"{out_dir}/counts/{p:03d}.json")))
    if fingerprints is not None:
      for number in range(len(files)):
        with np.load(io.BytesIO(beam_files.read_bytes(f"{out_dir}/fingerprints/{number:06d}.npz"))) as part:
          fingerprints.add(part["prints"], part["shingles"], part["owners"])
  totals = {name: sum(int(r[name]) for r in per_file) for name in _STATS_FIELDS + ("bad_lines",)}
  stats = dp_spm_histogram.HistogramStats(**{name: totals[name] for name in _STATS_FIELDS})
  stats.seconds = time.time() - start
  logger.info("dp-spm (%s): %d documents, %.1f MB, %d distinct words in %.1f s; %d files, %d bad lines skipped",
              runner, stats.documents, stats.bytes / 1e6, len(histogram), stats.seconds, len(files),
              totals["bad_lines"])
  if stats.documents == 0:
    raise DataError(f"corpus {corpus!r} has no documents")
  return histogram, stats


def beam_histogram_fn(runner: str, beam_options: Union[str, Sequence[str]] = "", *, skip_bad_lines: bool = False,
                      work_dir: Optional[str] = None) -> Callable:
  """A `histogram_fn` for `dp_spm.train_dp_vocabulary` that builds the histogram on Beam."""
  beam_runner.check_runner(runner)
  beam_runner.import_beam()
  return functools.partial(beam_histogram, runner=runner, beam_options=beam_options,
                           skip_bad_lines=skip_bad_lines, work_dir=work_dir)
