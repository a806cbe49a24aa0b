"""A vocabulary declared public (VOCAB_IS_PUBLIC) checked against the documents a run trains on.

A public vocabulary is not counted in ε, so a false declaration under-states the run's. A
DP-SentencePiece vocabulary (`private-t5 dp-spm`) keeps, beside it and private, the keyed
fingerprints of the documents it was built from (`doc_fingerprints`: one 8-byte keyed hash of each
document's normalised text) and their secret key; its privacy report names the fingerprint file
by SHA-256. Before the mechanism is built (`check_declaration`), the run's own training documents
are streamed (the corpus its token store was built from, with the store's reader options and
split; or the source of each seqio Task, as the Task reads it) and each is looked up in that set:

* some training documents are documents the vocabulary was built from (an exact copy of its
  corpus in any file format or compression, a subset, a superset, a re-ordering, a seqio Task
  over the same files): the declaration does not hold for this run. The vocabulary is then
  treated as not public, its report's ε is composed into the ledger, and the log says
  "N of M training documents are documents the vocabulary was built from; its ε is composed".
  When its report cannot be composed (e.g. a unit the training's cannot use), the run is refused
  (`Declaration.confirm`, one PrivacyError line);
* none is: the declaration stands; the vocabulary's record says how many documents were checked;
* the overlap cannot be checked (a report written before fingerprints were recorded, the
  fingerprint or key file gone or not the one the report names, training documents that cannot
  be read here, e.g. a GLUE source or a Task whose source fails): refused in one PrivacyError
  line, unless the user accepts the declaration unchecked (`allow_unchecked`, Gin
  `VOCAB_PUBLIC_UNCHECKED=True`), which the log and the vocabulary's record then say.

A vocabulary that dp-spm wrote but whose report is not beside it is refused (whether it was built
from this run's data cannot be known). A vocabulary with no report that dp-spm did not write (e.g.
T5's public vocabulary, or `private-t5 spm` on public text) rests on the user's word, as before.

A document of a GLUE-style source is one example's input text. A document of a seqio Task is one
element of its source: the element's text, the `text` field of
a JSON line or of a dict element, or else its string fields joined by a space.
"""
import dataclasses
import json
import os
from typing import Any, Callable, Iterator, List, Optional, Tuple

from private_t5 import doc_fingerprints
from private_t5.data import corpora
from private_t5.data import seqio_lookup
from private_t5.data import source as source_lib
from private_t5.dp import privacy_report
from private_t5.errors import DataError, PrivacyError
from private_t5.io import file_sha256
from private_t5.tokenizer import spm as spm_lib

SEQIO_PREFIX = "seqio:"
OVERRIDE = "VOCAB_PUBLIC_UNCHECKED=True"


@dataclasses.dataclass(frozen=True)
class Declaration:
  """What was found of a public declaration, before the mechanism is built.

  Attributes:
    dp: the DP config to build the mechanism with: the one given, or, when the declaration does
      not hold for this run, a copy with `vocab_is_public=False` (its ε is composed).
    line: what was checked, for the vocabulary's record in the ledger (None: nothing to add).
    overlap: training documents that are documents the vocabulary was built from (None: not counted).
    documents: training documents checked (None: not counted).
  """
  dp: Any
  line: Optional[str] = None
  overlap: Optional[int] = None
  documents: Optional[int] = None

  @property
  def contradicted(self) -> bool:
    return bool(self.overlap)

  def confirm(self, ledger) -> None:
    """Checks the built ledger against the declaration and records what was checked.

    Raises:
      PrivacyError: the declaration does not hold and the vocabulary's report could not be
        composed (the ledger would count it as not private, or the run would claim it public).
    """
    vocabulary = [c for c in ledger.components if c["name"] == privacy_report.VOCABULARY_COMPONENT]
    if self.contradicted:
      if ledger.vocabulary_status() != "dp":
        reason = vocabulary[0].get("reason") if vocabulary else None
        raise PrivacyError(
            f"{self.overlap} of {self.documents} training documents are documents the vocabulary was built "
            f"from, so it is not public for this run (VOCAB_IS_PUBLIC=True does not hold), and its "
            f"DP-SentencePiece report cannot be composed" + (f": {reason}" if reason else "")
            + "; train with a vocabulary built without these documents")
      return
    if self.line:
      for component in vocabulary:
        if component.get("public"):
          earlier = component.get("public_check")
          ledger.replace_record(dict(component, public_check=self.line + (f"; {earlier}" if earlier else "")))


def check_declaration(dp, vocab_path: Optional[str], train_data, *, allow_unchecked: bool = False,
                      log: Callable[[str], None] = print) -> Declaration:
  """Checks a public declaration of `vocab_path` against the documents of `train_data`.

  Args:
    dp: the run's `DPConfig` (None: a non-private run, nothing to check).
    vocab_path: the run's vocabulary.
    train_data: the training `ExampleSource` (a token store's `CorpusSource`, a seqio source, ...).
    allow_unchecked: accept the declaration where the overlap cannot be checked (Gin
      `VOCAB_PUBLIC_UNCHECKED`); logged, and said in the vocabulary's record.
    log: progress output.

  Returns:
    The `Declaration`: the DP config to build the mechanism with, and what was checked.

  Raises:
    PrivacyError: a dp-spm vocabulary without its report, or an overlap that cannot be checked
      (without `allow_unchecked`).
  """
  if dp is None or not getattr(dp, "vocab_is_public", False) or not vocab_path:
    return Declaration(dp)
  report_path = privacy_report.find_vocabulary_report(vocab_path)
  report = privacy_report.read_report(report_path) if report_path else None
  if report is not None and privacy_report.vocabulary_report_mismatch(report, vocab_path) is not None:
    report = None  # a report of another vocabulary says nothing about this one
  if report is None:
    if spm_lib.trained_from_word_histogram(vocab_path):
      raise PrivacyError(
          f"the vocabulary {vocab_path} is declared public (VOCAB_IS_PUBLIC=True), but it was written by "
          "`private-t5 dp-spm` (a DP vocabulary of private text) and the privacy report naming it is not "
          "beside it: whether it was built from this run's data cannot be checked; copy its "
          "privacy_report.json beside it (its ε is then composed, or its public declaration checked)")
    return Declaration(dp)
  found, why = _fingerprints(vocab_path, report, report_path)
  if found is not None:
    texts, unreadable = training_texts(train_data)
    if texts is not None:
      try:
        overlap, documents = doc_fingerprints.count_members(texts, *found)
      except Exception as e:  # pylint: disable=broad-except
        why = f"the training documents cannot be read: {_first_line(e)}"
      else:
        return _counted(dp, vocab_path, overlap, documents, found[1], log)
    else:
      why = unreadable
  if not allow_unchecked:
    raise PrivacyError(
        f"the vocabulary {vocab_path} is declared public (VOCAB_IS_PUBLIC=True), but whether this run trains "
        f"on documents it was built from cannot be checked: {why}; set VOCAB_IS_PUBLIC=False (its ε is then "
        f"composed), or {OVERRIDE} to rest the declaration on your word")
  line = f"NOT checked against the training documents ({why}): declared public unchecked by the user ({OVERRIDE})"
  log(f"[privacy] WARNING: the vocabulary {vocab_path}: {line}")
  return Declaration(dp, line=line)


def _counted(dp, vocab_path: str, overlap: int, documents: int, built_from, log) -> Declaration:
  """The declaration after the overlap is counted: composed when some document is shared."""
  if overlap:
    log(f"[privacy] {overlap} of {documents} training documents are documents the vocabulary {vocab_path} was "
        "built from; its ε is composed (the public declaration VOCAB_IS_PUBLIC=True does not hold for this run)")
    return Declaration(dataclasses.replace(dp, vocab_is_public=False), overlap=overlap, documents=documents)
  line = (f"checked by content: none of the {documents} training documents is one of the {len(built_from)} "
          "documents the vocabulary was built from (keyed fingerprints of their normalised text)")
  log(f"[privacy] vocabulary {vocab_path} declared public: {line}")
  return Declaration(dp, line=line, overlap=0, documents=documents)


def _fingerprints(vocab_path: str, report: dict, report_path: str):
  """((key, sorted fingerprints), None), or (None, why they cannot be used)."""
  record = report.get("document_fingerprints")
  if not isinstance(record, dict) or not record.get("sha256"):
    return None, (f"its DP-SentencePiece report {report_path} records no document fingerprints (written by an "
                  "older dp-spm; re-run `private-t5 dp-spm` to record them)")
  path = os.path.join(os.path.dirname(os.path.abspath(vocab_path)),
                      str(record.get("file") or os.path.basename(doc_fingerprints.fingerprints_path(vocab_path))))
  key_path = os.path.join(os.path.dirname(path), str(record.get("key_file") or
                                                      os.path.basename(doc_fingerprints.key_path(vocab_path))))
  if not os.path.isfile(path):
    return None, f"the fingerprints of the documents it was built from ({path}) are not beside it"
  if not os.path.isfile(key_path):
    return None, f"the secret key of its document fingerprints ({key_path}) is not beside it"
  if file_sha256(path) != record["sha256"]:
    return None, f"the document fingerprints {path} are not those its report names (another SHA-256)"
  try:
    key = doc_fingerprints.read_key(key_path)
    values = doc_fingerprints.load(path)
  except DataError as e:
    return None, str(e)
  if not doc_fingerprints.same_key(key, record.get("key_check", "")):
    return None, f"{key_path} is not the key its document fingerprints were made with"
  return (key, values), None


def training_texts(train_data) -> Tuple[Optional[Iterator[str]], Optional[str]]:
  """(the texts of the training documents, streamed, None), or (None, why they cannot be read here).

  A token store's source: the documents of the corpus it was built from, read with the store's
  reader options, those of its split only. A seqio source: each Task's source, as the Task reads it.
  A GLUE-style source: each example's input text.
  """
  described = train_data.describe()
  corpus = described.get("corpus")
  store = getattr(train_data, "store", None)
  manifest = getattr(store, "manifest", None)
  if isinstance(corpus, str) and corpus.startswith(SEQIO_PREFIX):
    return _seqio_texts(list(described.get("tasks") or []), described.get("split") or "train"), None
  if isinstance(corpus, str) and isinstance(manifest, dict):
    return _store_texts(corpus, dict(manifest.get("reader") or {}), described.get("split") or "all",
                        float(described.get("validation_fraction") or 0.0)), None
  inputs = getattr(train_data, "inputs_text", None)
  if isinstance(inputs, (list, tuple)):  # GLUE-style examples, held in memory: each one's input text
    return iter(inputs), None
  return None, f"the documents of {corpus or type(train_data).__name__} cannot be read for this check"


def _store_texts(corpus: str, reader: dict, split: str, validation_fraction: float) -> Iterator[str]:
  options = {k: reader[k] for k in ("text_field", "id_field", "user_field", "errors", "max_documents", "data_dir")
             if k in reader}
  for doc in corpora.iter_documents(corpus, **options):
    if split != "all" and source_lib.in_validation(doc.id, validation_fraction) != (split == "validation"):
      continue
    yield doc.text


def _seqio_texts(tasks: List[str], split: str) -> Iterator[str]:
  for name in tasks:
    dataset = seqio_lookup.seqio.get_mixture_or_task(name).source.get_dataset(split=split, shuffle=False)
    for element in dataset.as_numpy_iterator():
      yield _element_text(element)


def _element_text(element) -> str:
  """The document of one seqio source element (see the module docstring)."""
  if isinstance(element, dict):
    if "text" in element:
      return _as_str(element["text"])
    return " ".join(_as_str(v) for _, v in sorted(element.items()) if isinstance(v, (bytes, str)))
  text = _as_str(element)
  if text.lstrip().startswith("{"):
    try:
      parsed = json.loads(text)
    except ValueError:
      return text
    if isinstance(parsed, dict) and isinstance(parsed.get("text"), str):
      return parsed["text"]
  return text


def _as_str(value) -> str:
  return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]
