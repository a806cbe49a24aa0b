"""The DP-SentencePiece word histogram as an Apache Beam pipeline (any runner).

  read documents (file patterns or TFDS, `beam_io.read_documents`)
    -> per document: `dp_spm.bounded_counts(text.split(), bound)`   (the contribution bound,
       the same function as the local path, applied before any aggregation)
    -> CombinePerKey(sum)                                              (the summed histogram)
    -> written as JSON lines, read back by the launching process.
  and, with `fingerprints`, per batch of documents their keyed fingerprints (`doc_fingerprints`),
  written as JSON lines and appended by the launching process to the vocabulary's private file.
  The secret key then travels to the workers with the pipeline (as the corpus itself does).

The sensitivity argument of `dp_spm` holds unchanged: each document enters the sum only
through its bounded histogram. Noise and threshold are NOT applied here: the launching
process applies them once, with `dp_spm.private_histogram` and OS-entropy keys, exactly as on
the local path (`train_dp_vocabulary(..., histogram_fn=beam_histogram_fn(...))`). The noiseless
histogram is the same as the local path's for the same corpus and bound.
"""
import collections
import functools
import json
import logging
import time
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np

from private_t5 import doc_fingerprints
from private_t5.data import beam_io
from private_t5.errors import ConfigError, DataError
from private_t5.tokenizer import dp_spm

logger = logging.getLogger(__name__)

_STATS_FIELDS = ("documents", "bytes", "words_raw", "words_counted")


def _bounded_batch(batch, mode: str, max_words: int):
  """Documents -> the sum of their bounded histograms as (word, count) pairs; stats on `stats`.

  Each document is bounded on its own (`dp_spm.bounded_counts`, as the local path does it)
  before it is added to the batch's sum, so the sum has the local path's sensitivity.
  """
  # Lazy: Apache Beam is optional (`data.beam_io.import_beam`).
  from apache_beam import pvalue  # pylint: disable=g-import-not-at-top
  bound = dp_spm.ContributionBound(mode, max_words)
  total = collections.Counter()
  n_bytes = n_raw = n_counted = 0
  for _, (_, text) in batch:
    words = text.split()
    hist = dp_spm.bounded_counts(words, bound)
    n_bytes += len(text.encode("utf-8"))
    n_raw += len(words)
    n_counted += sum(hist.values())
    total.update(hist)
  beam_io.counter("words_counted").inc(n_counted)
  yield pvalue.TaggedOutput("stats", (len(batch), n_bytes, n_raw, n_counted))
  yield from total.items()


def _fingerprint_batch(batch, key: bytes):
  """Documents -> one list of their keyed fingerprints (ints, JSON-safe)."""
  yield [int(v) for v in doc_fingerprints.fingerprints((text for _, (_, text) in batch), key)]


def _sum_tuples(rows):
  out = [0] * len(_STATS_FIELDS)
  for row in rows:
    for i, v in enumerate(row):
      out[i] += v
  return tuple(out)


def beam_histogram(corpus: Union[str, Sequence[str]], bound: dp_spm.ContributionBound, *,
                   runner: str = "DirectRunner", beam_options: Union[str, Sequence[str]] = "",
                   text_field: str = "text", errors: str = "strict", data_dir: Optional[str] = None,
                   max_documents: Optional[int] = None, skip_bad_lines: bool = False,
                   work_dir: Optional[str] = None,
                   fingerprints: Optional[doc_fingerprints.FingerprintWriter] = None
                   ) -> Tuple[collections.Counter, dp_spm.HistogramStats]:
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
    (histogram, stats), as `dp_spm.build_histogram` returns them.
  """
  if not beam_io.is_beam(runner):
    raise ConfigError("beam_histogram needs a Beam runner, not 'local'")
  if max_documents is not None:
    raise ConfigError("max_documents applies to --runner=local only; give a smaller file pattern instead")
  beam = beam_io.import_beam()
  options = beam_io.pipeline_options(runner, beam_options)
  start = time.time()
  with beam_io.output_dir(options, work_dir, "dp_spm_histogram") as out_dir:
    pipeline = beam.Pipeline(options=options)
    docs = beam_io.read_documents(pipeline, corpus, label="corpus", text_field=text_field, errors=errors,
                                  data_dir=data_dir, skip_bad_lines=skip_bad_lines)
    batches = docs | "batch" >> beam.BatchElements(min_batch_size=16, max_batch_size=4096)
    if fingerprints is not None:
      (batches
       | "fingerprint documents" >> beam.FlatMap(_fingerprint_batch, fingerprints.key)
       | "encode fingerprints" >> beam.Map(json.dumps)
       | "write fingerprints" >> beam.io.WriteToText(out_dir + "/fingerprints"))
    bounded = (batches
               | "bound per document" >> beam.FlatMap(_bounded_batch, bound.mode, bound.max_words).with_outputs(
                   "stats", main="counts"))
    (bounded.counts
     | "sum counts" >> beam.CombinePerKey(sum)
     | "encode counts" >> beam.Map(lambda kv: json.dumps(kv, ensure_ascii=False))
     | "write counts" >> beam.io.WriteToText(out_dir + "/counts"))
    (bounded.stats
     | "sum stats" >> beam.CombineGlobally(_sum_tuples)
     | "encode stats" >> beam.Map(json.dumps)
     | "write stats" >> beam.io.WriteToText(out_dir + "/stats"))
    counters = beam_io.run_pipeline(pipeline)
    histogram = collections.Counter()
    for word, count in beam_io.read_json_lines(out_dir + "/counts"):
      histogram[word] = count
    totals = list(beam_io.read_json_lines(out_dir + "/stats")) or [[0] * len(_STATS_FIELDS)]
    if fingerprints is not None:
      for values in beam_io.read_json_lines(out_dir + "/fingerprints"):
        fingerprints.add(np.array(values, dtype=np.uint64))
  stats = dp_spm.HistogramStats(**dict(zip(_STATS_FIELDS, totals[0])))
  stats.seconds = time.time() - start
  logger.info("dp-spm (%s): %d documents, %.1f MB, %d distinct words in %.1f s; counters %s", runner,
               stats.documents, stats.bytes / 1e6, len(histogram), stats.seconds, counters)
  if stats.documents == 0:
    raise DataError(f"corpus {corpus!r} has no documents")
  return histogram, stats


def beam_histogram_fn(runner: str, beam_options: Union[str, Sequence[str]] = "", *, skip_bad_lines: bool = False,
                      work_dir: Optional[str] = None) -> Callable:
  """A `histogram_fn` for `dp_spm.train_dp_vocabulary` that builds the histogram on Beam."""
  beam_io.check_runner(runner)
  beam_io.import_beam()
  return functools.partial(beam_histogram, runner=runner, beam_options=beam_options,
                           skip_bad_lines=skip_bad_lines, work_dir=work_dir)
