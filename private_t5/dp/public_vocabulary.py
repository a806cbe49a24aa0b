"""The file-level part of checking a vocabulary declared public (VOCAB_IS_PUBLIC) against a run's data.

A public vocabulary is not counted in ε, so a false declaration under-states the run's. The
declaration of a DP-SentencePiece vocabulary is decided by content before the mechanism is built,
by `tokenizer.public_declaration`: the run's training documents are looked up in the keyed
fingerprints of the documents the vocabulary was built from (any shared document: its ε is
composed; an overlap that cannot be checked: refused unless the user accepts it unchecked). That
module also refuses a dp-spm vocabulary whose report is not beside it.

What is left here, called by the mechanism for a declaration that still stands, needs only the
report and the run's data spec:

* the files that report says the vocabulary was built from (their SHA-256, recorded by dp-spm;
  for an older report, the files at the recorded paths when they are still there) must not be
  files of the training data: neither the same path nor the same bytes;
* what could not be checked (a recorded file gone, a source that is not a local file, a seqio
  Task whose files are not known) is said in the log and in the report's vocabulary entry.

A vocabulary with no report that names it rests on the user's word, and the report says so.
"""
import os
from typing import Dict, List, Optional, Sequence, Union

from private_t5.data import corpora
from private_t5.dp.privacy_report import read_report, vocabulary_report_mismatch
from private_t5.errors import PrivacyError
from private_t5.io import file_sha256

CorpusSpecs = Union[None, str, Sequence[str]]


def file_digests(paths: Sequence[str]) -> List[Dict[str, object]]:
  """{"path", "bytes", "sha256"} of each local file of `paths` (what dp-spm records)."""
  return [{"path": p, "bytes": os.path.getsize(p), "sha256": file_sha256(p)} for p in paths if os.path.isfile(p)]


def _specs(value: CorpusSpecs) -> List[str]:
  return [value] if isinstance(value, str) else [v for v in (value or []) if isinstance(v, str)]


def _training_files(corpus: CorpusSpecs, data_files: Optional[Sequence[str]]) -> List[str]:
  files = [f for spec in _specs(corpus) for f in corpora.corpus_files(spec)]
  files += [os.path.realpath(f) for f in (data_files or [])]
  return sorted(set(files))


def _built_from(report: dict) -> List[Dict[str, object]]:
  """The files the report says the vocabulary was built from: path, and bytes/sha256 when known."""
  recorded = {d["path"]: d for d in report.get("corpus_file_digests") or [] if isinstance(d, dict) and "path" in d}
  paths = report.get("corpus_files") or [f for spec in _specs(report.get("corpus")) for f in corpora.corpus_files(spec)]
  out = []
  for path in paths:
    entry = dict(recorded.get(path, {"path": path}))
    if "sha256" not in entry and os.path.isfile(path):  # an older report: the file as it is now
      entry.update(bytes=os.path.getsize(path), sha256=file_sha256(path), read_now=True)
    out.append(entry)
  return out


def check_public_declaration(vocab_path: str, report_path: Optional[str], corpus: CorpusSpecs,
                             data_files: Optional[Sequence[str]] = None,
                             unknown_files: Optional[str] = None) -> str:
  """Checks that the vocabulary declared public was not built from this run's training data.

  Args:
    vocab_path: the vocabulary declared public.
    report_path: the DP-SentencePiece report found beside it (None: none).
    corpus: the training corpus spec(s) (local files, folders, patterns; other specs by name).
    data_files: more files the training data reads (a seqio Task's files).
    unknown_files: why the training data's files are not all known (None: they are).

  Returns:
    One line saying what was checked and what could not be, for the log and the report.

  Raises:
    PrivacyError: the declaration is false (the report names a file of the training data, by
      path or by content).
  """
  report = read_report(report_path) if report_path else None
  if report is not None and vocabulary_report_mismatch(report, vocab_path) is not None:
    report = None  # a report of another vocabulary says nothing about this one
  if report is None:  # (a dp-spm vocabulary without its report is refused by `tokenizer.public_declaration`)
    return ("not checked: no DP-SentencePiece report names this vocabulary, so the text it was built from "
            "is not known; the declaration rests on the user's word")
  built = _built_from(report)
  training = _training_files(corpus, data_files)
  same_path = sorted({str(b["path"]) for b in built} & set(training))
  if same_path:
    raise _built_from_training(vocab_path, report_path, same_path, "")
  sizes = {b.get("bytes") for b in built if b.get("sha256")}
  digests = {b["sha256"]: b["path"] for b in built if b.get("sha256")}
  copies = []
  for path in training:
    if os.path.isfile(path) and os.path.getsize(path) in sizes:
      digest = file_sha256(path)
      if digest in digests:
        copies.append(f"{digests[digest]} (the same bytes as {path})")
  if copies:
    raise _built_from_training(vocab_path, report_path, copies, " by content")
  unchecked: List[str] = []
  gone = [str(b["path"]) for b in built if not b.get("sha256") and "://" not in str(b["path"])
          and not str(b["path"]).startswith((corpora.TFDS_PREFIX, corpora.BUILTIN_PREFIX))]
  if gone:
    unchecked.append(f"{len(gone)} file(s) the report names are gone and it records no SHA-256 of them "
                     f"(e.g. {gone[0]})")
  not_local = [f for f in training if not os.path.isfile(f)]
  if not_local:
    unchecked.append(f"training data not held in local files (e.g. {not_local[0]}) is compared by name only")
  if unknown_files:
    unchecked.append(unknown_files)
  checked = (f"checked by file: none of the {len(digests)} file(s) its DP-SentencePiece report "
             f"{report_path} was built from is a file of this run's training data (path and SHA-256)")
  return checked + ("; not checked: " + "; ".join(unchecked) if unchecked else "")


def _built_from_training(vocab_path: str, report_path: str, files: Sequence[str], how: str) -> PrivacyError:
  return PrivacyError(
      f"the vocabulary {vocab_path} is declared public (VOCAB_IS_PUBLIC=True), but its DP-SentencePiece "
      f"report {report_path} says it was built from {files[0]}"
      + (f" (and {len(files) - 1} more file(s))" if len(files) > 1 else "")
      + f", which this run trains on{how}: set VOCAB_IS_PUBLIC=False, and its ε is composed into the run's")
