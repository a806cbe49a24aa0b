"""DP-SentencePiece's word histogram: each document's bounded histogram, summed in parallel.

Steps 1 and 2 of `dp_spm`: a document (the privacy unit) becomes a word histogram bounded by its
`ContributionBound` ("paper": counts with multiplicity over at most N words; "capped": each of at
most W distinct words once), and `build_histogram` sums them over a corpus, streaming, in worker
processes. The workers import this module alone (NumPy, no accountant, no SentencePiece), so
starting them stays cheap. Nothing here is private yet: noise and threshold come after
(`dp_spm_release`).
"""
import collections
import dataclasses
import math
import multiprocessing
import os
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import toolz

from private_t5 import doc_fingerprints
from private_t5 import progress as progress_lib
from private_t5 import user_modules
from private_t5.errors import ConfigError

SENSITIVITY_MODES = ("paper", "capped")
DEFAULT_SENSITIVITY = "capped"
DEFAULT_MAX_WORDS = 256


@dataclasses.dataclass(frozen=True)
class ContributionBound:
  """How much one document may contribute to the summed histogram.

  Attributes:
    mode: "paper" (counts with multiplicity, ≤ max_words words) or "capped" (each word once,
      ≤ max_words distinct words).
    max_words: N (paper) or W (capped).
  """
  mode: str = DEFAULT_SENSITIVITY
  max_words: int = DEFAULT_MAX_WORDS

  def __post_init__(self):
    if self.mode not in SENSITIVITY_MODES:
      raise ConfigError(f"sensitivity must be one of {SENSITIVITY_MODES}, got {self.mode!r}")
    if isinstance(self.max_words, bool) or int(self.max_words) != self.max_words or self.max_words < 1:
      raise ConfigError(f"max_words_per_document must be an integer >= 1, got {self.max_words!r}")

  @property
  def l2(self) -> float:
    """k: the largest L2 norm of one document's bounded histogram."""
    return float(self.max_words) if self.mode == "paper" else math.sqrt(self.max_words)

  @property
  def linf(self) -> float:
    """m: the largest count one document gives one word."""
    return float(self.max_words) if self.mode == "paper" else 1.0

  @property
  def max_distinct(self) -> int:
    """n: the most distinct words one document can add (the threshold's union bound)."""
    return int(self.max_words)

  def as_dict(self) -> Dict[str, Any]:
    out = {"mode": self.mode, "k_l2": self.l2, "m_linf": self.linf, "max_distinct_words": self.max_distinct}
    out["N_words_per_document" if self.mode == "paper" else "W_distinct_words_per_document"] = self.max_words
    return out


def document_histogram(text: str, bound: ContributionBound) -> Dict[str, int]:
  """The bounded word histogram of one document (words: whitespace-separated, unnormalised)."""
  return bounded_counts(text.split(), bound)


def bounded_counts(words: List[str], bound: ContributionBound) -> Dict[str, int]:
  """The bounded histogram of one document's words (see `ContributionBound`)."""
  if bound.mode == "paper":
    n = bound.max_words
    if len(words) > n:
      # Evenly spaced positions cover the whole document; any fixed choice of ≤ N positions
      # keeps ‖h‖₂ ≤ ‖h‖₁ ≤ N.
      length = len(words)
      words = [words[(i * length) // n] for i in range(n)]
    return collections.Counter(words)
  counts = collections.Counter(words)
  if len(counts) > bound.max_words:
    # most_common is stable, so ties keep first-occurrence order (deterministic).
    return dict.fromkeys((w for w, _ in counts.most_common(bound.max_words)), 1)
  return dict.fromkeys(counts, 1)


@dataclasses.dataclass
class HistogramStats:
  """Counts gathered while building the histogram."""
  documents: int = 0
  bytes: int = 0
  words_raw: int = 0  # word occurrences before bounding
  words_counted: int = 0  # word occurrences after bounding
  seconds: float = 0.0

  def as_dict(self) -> Dict[str, Any]:
    d = dataclasses.asdict(self)
    d["megabytes_per_second"] = (self.bytes / 1e6 / self.seconds) if self.seconds > 0 else None
    return d


def _chunk_histogram(args) -> Tuple[Dict[str, int], int, int, int, int, Optional[np.ndarray]]:
  """Worker: (summed bounded histogram, documents, bytes, raw words, counted words, the documents'
  keyed signatures (`doc_fingerprints.signatures`) or None) of a chunk."""
  texts, mode, max_words, key = args
  bound = ContributionBound(mode, max_words)
  total = collections.Counter()
  n_bytes = n_raw = n_counted = 0
  for text in texts:
    n_bytes += len(text.encode("utf-8"))
    words = text.split()
    n_raw += len(words)
    h = bounded_counts(words, bound)
    n_counted += sum(h.values())
    total.update(h)
  prints = doc_fingerprints.signatures(texts, key) if key is not None else None
  return dict(total), len(texts), n_bytes, n_raw, n_counted, prints


def build_histogram(texts: Iterable[str], bound: ContributionBound, *, num_workers: Optional[int] = None,
                    chunk_size: int = 256, progress: Optional[Callable[[HistogramStats], None]] = None,
                    progress_every: float = 10.0, fingerprints: Optional[doc_fingerprints.FingerprintWriter] = None
                    ) -> Tuple[collections.Counter, HistogramStats]:
  """Sums the bounded histograms of `texts` (one text = one document), streaming.

  Work is spread over `num_workers` processes, a chunk of documents at a time, with at most
  two chunks per worker in flight, so memory grows with the vocabulary, not with the corpus.
  With `fingerprints`, the workers also compute each document's keyed signatures
  (`doc_fingerprints`: its fingerprint and sampled shingles), appended to it (on disk).
  """
  num_workers = num_workers or os.cpu_count() or 1
  if num_workers < 1 or chunk_size < 1:
    raise ConfigError(f"num_workers and chunk_size must be >= 1, got {num_workers}, {chunk_size}")
  total = collections.Counter()
  stats = HistogramStats()
  start = last_report = time.time()
  bar = progress_lib.bar(desc="dp-spm histogram", unit=" docs")

  def merge(result):
    nonlocal last_report
    hist, docs, n_bytes, n_raw, n_counted, prints = result
    bar.update(docs)
    if fingerprints is not None:
      fingerprints.add(*prints)
    total.update(hist)
    stats.documents += docs
    stats.bytes += n_bytes
    stats.words_raw += n_raw
    stats.words_counted += n_counted
    if progress and time.time() - last_report >= progress_every:
      stats.seconds = time.time() - start
      progress(stats)
      last_report = time.time()

  key = fingerprints.key if fingerprints is not None else None
  jobs = ((chunk, bound.mode, bound.max_words, key) for chunk in toolz.partition_all(chunk_size, texts))
  if num_workers == 1:
    for job in jobs:
      merge(_chunk_histogram(job))
  else:
    # Not "fork": the parent may run JAX/TensorFlow threads, and a forked child can deadlock on
    # their locks. The workers import only this module (NumPy), so starting them is cheap.
    ctx = multiprocessing.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")
    in_flight = collections.deque()
    # The user's task modules (TASK_MODULE) are imported in each worker too, as in the run's process.
    with ctx.Pool(num_workers, **user_modules.pool_kwargs()) as pool:
      for job in jobs:
        in_flight.append(pool.apply_async(_chunk_histogram, (job,)))
        if len(in_flight) >= 2 * num_workers:
          merge(in_flight.popleft().get())
      while in_flight:
        merge(in_flight.popleft().get())
  bar.close()
  stats.seconds = time.time() - start
  return total, stats
