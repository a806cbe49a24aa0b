"""Writes the redacted corpus D' of Just Fine-tune Twice and its detector report.

D' keeps every document's id (and user) with its private spans replaced by typed
placeholders. A document left with no public word is counted and skipped: it carries nothing
that phase 1 may learn. The report gives, for each detector level, the fraction of tokens
marked private (Shi et al.'s (2022) "Pct" column), the placeholder counts and the throughput, and names
the backend of every level, so a missing NER model or POS tagger shows as the fallback used.
"""
import collections
import gzip
import json
import logging
import os
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from private_t5.errors import DataError
from private_t5.io import atomic_open_text, write_json_atomic
from private_t5.selective import detectors as detectors_lib

logger = logging.getLogger(__name__)

REPORT_SUFFIX = ".report.json"
MAX_LISTED_IDS = 20


def default_report_path(output_path: str) -> str:
  base = output_path
  for ext in (".gz", ".jsonl", ".json"):
    if base.endswith(ext):
      base = base[:-len(ext)]
  return base + REPORT_SUFFIX


class _LevelStats:
  """Token and placeholder counts of one level."""

  def __init__(self, detector: detectors_lib.SecretDetector):
    self.detector = detector
    self.tokens = 0
    self.private = 0
    self.labels = collections.Counter()
    self.seconds = 0.0
    self.documents = 0

  def add(self, text: str) -> detectors_lib.Detection:
    t0 = time.perf_counter()
    detection = self.detector.analyze(text)
    self.seconds += time.perf_counter() - t0
    self.documents += 1
    self.tokens += detection.num_tokens
    self.private += detection.num_private
    self.labels.update(s.label for s in detection.spans)
    return detection

  def as_dict(self) -> Dict[str, object]:
    return {"pct": self.private / self.tokens if self.tokens else 0.0,
            "private_tokens": self.private, "tokens": self.tokens,
            "placeholders": dict(sorted(self.labels.items())),
            "documents_per_second": self.documents / self.seconds if self.seconds else None,
            "backends": self.detector.backends}


def redact_corpus(documents: Iterable, output_path: str, *, level: str = "entity",
                  report_levels: Optional[Sequence[str]] = None, backend: str = "auto",
                  report_path: Optional[str] = None, source: str = "",
                  progress_every: int = 1000, log: Callable[[str], None] = print) -> Dict[str, object]:
  """Redacts `documents` at `level`, writes D' (JSONL, atomically) and the report.

  Args:
    documents: `corpora.Document`s (id, text, user).
    output_path: the redacted corpus, `.jsonl` or `.jsonl.gz`.
    level: the detector level whose redaction is written (see `detectors.LEVELS`).
    report_levels: levels whose private-token fraction is reported (default: `pattern` up to
      `level`); `level` itself is always included.
    backend: "auto" (NER model / POS tagger when installed) or "heuristic".
    report_path: where the JSON report goes (default: beside the output, `*.report.json`).
    source: the corpus spec, recorded in the report.
    progress_every: a progress line every this many documents (0: none).
    log: progress output.

  Returns:
    The report dict (also written to `report_path`).
  """
  report_levels = list(report_levels or detectors_lib.levels_up_to(level))
  if level not in report_levels:
    report_levels.append(level)
  stats = {lvl: _LevelStats(detectors_lib.SecretDetector(lvl, backend)) for lvl in report_levels}
  main = stats[level]
  for lvl, s in stats.items():
    fallbacks = [v for v in s.detector.backends.values() if "heuristic" in v]
    if lvl == level and fallbacks:
      log(f"[redact] level {lvl}: {'; '.join(fallbacks)}")
  read = written = 0
  skipped_ids: List[str] = []
  skipped = 0
  t0 = time.time()
  with atomic_open_text(output_path) as f:
    for doc in documents:
      read += 1
      detection = None
      for lvl, s in stats.items():
        d = s.add(doc.text)
        if lvl == level:
          detection = d
      if detection.fully_private():
        skipped += 1
        if len(skipped_ids) < MAX_LISTED_IDS:
          skipped_ids.append(doc.id)
        continue
      record = {"id": doc.id, "text": detection.redacted()}
      if getattr(doc, "user", None) is not None:
        record["user"] = doc.user
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
      written += 1
      if progress_every and read % progress_every == 0:
        log(f"[redact] {read} documents ({read / max(time.time() - t0, 1e-9):.0f}/s), "
            f"{skipped} fully redacted, private tokens at {level}: "
            f"{main.private / max(main.tokens, 1):.2%}")
    if read == 0:
      raise DataError(f"corpus {source or '(documents)'} has no documents")
    if written == 0:
      raise DataError(f"every document of {source or 'the corpus'} was fully redacted at level {level!r}; "
                      "nothing left to write")
  elapsed = time.time() - t0
  report = {
      "source": source,
      "output": os.path.abspath(output_path),
      "level": level,
      "backends": main.detector.backends,
      "fallbacks": sorted({v for s in stats.values() for v in s.detector.backends.values() if "heuristic" in v}),
      "documents_read": read,
      "documents_written": written,
      "fully_redacted_skipped": skipped,
      "fully_redacted_ids": skipped_ids,
      "levels": {lvl: s.as_dict() for lvl, s in stats.items()},
      "documents_per_second": read / elapsed if elapsed > 0 else None,
      "wall_time_s": elapsed,
      "note": ("pct is the fraction of word/punctuation tokens marked private (Shi et al.'s (2022) Pct column); "
               "the redacted corpus is public only if the detector missed no secret"),
  }
  report_path = report_path or default_report_path(output_path)
  write_json_atomic(report_path, report)
  report["report_path"] = os.path.abspath(report_path)
  return report


def read_redacted(path: str) -> List[Dict[str, str]]:
  """The records of a redacted corpus (for tests and tools)."""
  opener = gzip.open if path.endswith(".gz") else open
  if not os.path.isfile(path):
    raise DataError(f"redacted corpus not found: {path}")
  with opener(path, "rt", encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def log_to_stderr(msg: str) -> None:
  """Progress output that does not mix with the summary on stdout (the `logging` INFO level)."""
  logger.info("%s", msg)
