"""A vocabulary declared public (VOCAB_IS_PUBLIC) checked against the documents a run trains on.

A public vocabulary is not counted in ε, so a false declaration under-states the run's. A
DP-SentencePiece vocabulary (`private-t5 dp-spm`) keeps, apart from it and private, the keyed
signatures of the documents it was built from (`doc_fingerprints`: a fingerprint of each
document's content words and a sample of its keyed word shingles) and their secret key; its
privacy report names their folder and each file by SHA-256. Before the mechanism is built
(`check_declaration`), the run's own training documents are streamed (the corpus its token store
was built from, with the store's reader options and split; or, for a seqio Task or Mixture, the
text of every example's inputs and targets as the model reads them: the Task's tokens after all
its preprocessors, decoded) and each is compared with the vocabulary's documents:

* some training documents overlap documents the vocabulary was built from (the same document in
  any file format, compression, case, punctuation or invisible characters; a near-copy with words
  changed; a part of one; several merged, or one quoted in a longer text; read through any seqio
  preprocessors): the declaration does not hold for this run. The vocabulary is then treated as
  not public, its report's ε is composed into the ledger, and the log says "N of M training
  documents overlap documents the vocabulary was built from; its ε is composed". When its report
  cannot be composed (e.g. a unit the training's cannot use), the run is refused
  (`Declaration.confirm`, one PrivacyError line);
* none does: the declaration stands; the vocabulary's record says how many documents were checked;
* the overlap cannot be checked (a report written before these signatures were recorded, their
  folder or key gone or not the one the report names, training documents that cannot be read here,
  e.g. a GLUE source or a Task whose source fails): refused in one PrivacyError line, unless the
  user accepts the declaration unchecked (`allow_unchecked`, Gin `VOCAB_PUBLIC_UNCHECKED=True`),
  which the log and the vocabulary's record then say.

A vocabulary that dp-spm wrote but whose report is not beside it is refused (whether it was built
from this run's data cannot be known). A vocabulary with no report that dp-spm did not write (e.g.
T5's public vocabulary, or `private-t5 spm` on public text) rests on the user's word, as before.

A document of a GLUE-style source is one example's input text; of a seqio Task, one example (its
inputs and its targets, each decoded, overlap when either does).
"""
import dataclasses
import json
import os
import re
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np

from private_t5 import doc_fingerprints
from private_t5.data import corpora
from private_t5.data import source as source_lib
from private_t5.dp import privacy_report
from private_t5.errors import DataError, PrivacyError
from private_t5.io import file_sha256
from private_t5.tokenizer import spm as spm_lib
from private_t5.vocabulary import load_vocabulary

SEQIO_PREFIX = "seqio:"
OVERRIDE = "VOCAB_PUBLIC_UNCHECKED=True"


@dataclasses.dataclass(frozen=True)
class Declaration:
  """What was found of a public declaration, before the mechanism is built.

  Attributes:
    dp: the DP config to build the mechanism with: the one given, or, when the declaration does
      not hold for this run, a copy with `vocab_is_public=False` (its ε is composed).
    line: what was checked, for the vocabulary's record in the ledger (None: nothing to add).
    overlap: training documents that overlap documents the vocabulary was built from (None: not counted).
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
            f"{self.overlap} of {self.documents} training documents overlap documents the vocabulary was built "
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
  found, why = _signatures(vocab_path, report, report_path)
  if found is not None:
    texts, unreadable = training_texts(train_data, vocab_path)
    if texts is not None:
      try:
        overlap, documents = found.count_overlaps(texts)
      except Exception as e:  # pylint: disable=broad-except
        why = f"the training documents cannot be read: {_first_line(e)}"
      else:
        return _counted(dp, vocab_path, overlap, documents, len(found.documents), log)
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


def _counted(dp, vocab_path: str, overlap: int, documents: int, built_from: int, log) -> Declaration:
  """The declaration after the overlap is counted: composed when some document overlaps."""
  if overlap:
    log(f"[privacy] {overlap} of {documents} training documents overlap documents the vocabulary {vocab_path} "
        "was built from (the same text, a near-copy, a part or a merge of them); its ε is composed (the public "
        "declaration VOCAB_IS_PUBLIC=True does not hold for this run)")
    return Declaration(dataclasses.replace(dp, vocab_is_public=False), overlap=overlap, documents=documents)
  line = (f"checked by content: none of the {documents} training documents overlaps the {built_from} distinct "
          "documents the vocabulary was built from (keyed signatures: the same content words, a near-copy, a "
          "part or a merge of them)")
  log(f"[privacy] vocabulary {vocab_path} declared public: {line}")
  return Declaration(dp, line=line, overlap=0, documents=documents)


def _signatures(vocab_path: str, report: dict, report_path: str):
  """(the vocabulary's `doc_fingerprints.Signatures`, None), or (None, why they cannot be used)."""
  record = report.get("document_fingerprints")
  if not isinstance(record, dict) or not record.get("key_check"):
    return None, (f"its DP-SentencePiece report {report_path} records no document signatures (written by an "
                  "older dp-spm; re-run `private-t5 dp-spm` to record them)")
  if record.get("format") != doc_fingerprints.FORMAT or not isinstance(record.get("files"), dict):
    return None, (f"its DP-SentencePiece report {report_path} records only exact document fingerprints (an older "
                  "dp-spm), which miss near-copies, parts and merges of the vocabulary's documents; re-run "
                  "`private-t5 dp-spm` to record their signatures")
  # Where dp-spm wrote it (relative to the vocabulary), else where it would be for the vocabulary's
  # place now (both moved together).
  recorded = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(vocab_path)),
                                           str(record.get("directory") or "")))
  directory = next((d for d in (recorded, doc_fingerprints.private_dir(vocab_path)) if os.path.isdir(d)), None)
  if directory is None:
    return None, (f"the private folder of the signatures of the documents it was built from ({recorded}, or "
                  f"{doc_fingerprints.private_dir(vocab_path)}) is not there")
  key_path = os.path.join(directory, str(record.get("key_file") or doc_fingerprints.KEY_FILE))
  if not os.path.isfile(key_path):
    return None, f"the secret key of its document signatures ({key_path}) is not there"
  for kind, name in doc_fingerprints.FILES.items():
    entry = record["files"].get(kind) or {}
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      return None, f"the document signatures {path} are not there"
    if file_sha256(path) != entry.get("sha256"):
      return None, f"the document signatures {path} are not those its report names (another SHA-256)"
  try:
    key = doc_fingerprints.read_key(key_path)
    found = doc_fingerprints.Signatures.load(directory, key)
  except DataError as e:
    return None, str(e)
  if not doc_fingerprints.same_key(key, record.get("key_check", "")):
    return None, f"{key_path} is not the key its document signatures were made with"
  return found, None


def training_texts(train_data, vocab_path: Optional[str] = None) -> Tuple[Optional[Iterator], Optional[str]]:
  """(the training documents, streamed, None), or (None, why they cannot be read here).

  A token store's source: the text of each document of the corpus it was built from, read with the
  store's reader options, those of its split only. A seqio source: each example's (inputs, targets)
  as the model reads them, decoded with the Task's vocabulary. A GLUE-style source: each example's
  input text.
  """
  described = train_data.describe()
  corpus = described.get("corpus")
  store = getattr(train_data, "store", None)
  manifest = getattr(store, "manifest", None)
  if isinstance(corpus, str) and corpus.startswith(SEQIO_PREFIX):
    vocabulary = getattr(train_data, "vocab_path", None) or vocab_path
    if not vocabulary:
      return None, f"the vocabulary of {corpus} is not known, so its examples cannot be read as text"
    return _example_texts(train_data, vocabulary), None
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


# Examples decoded at a time.
_EXAMPLES_CHUNK = 1024


def _example_texts(train_data, vocab_path: str) -> Iterator[List[doc_fingerprints.Segments]]:
  """[inputs, targets] of every example, as the model reads them: the tokens the source holds after
  the Task's preprocessors, decoded (`_decoded`)."""
  vocabulary = load_vocabulary(vocab_path)
  pieces = vocabulary.vocab_size - vocabulary.extra_ids
  for start in range(0, train_data.num_examples, _EXAMPLES_CHUNK):
    indices = np.arange(start, min(start + _EXAMPLES_CHUNK, train_data.num_examples))
    batch = train_data.get_batch(indices, 0, len(indices))
    for inputs, targets in zip(batch["encoder_input_tokens"], batch["decoder_target_tokens"]):
      yield [_decoded(vocabulary, inputs, pieces), _decoded(vocabulary, targets, pieces)]


def _decoded(vocabulary, ids: np.ndarray, pieces: int) -> doc_fingerprints.Segments:
  """The text of `ids` as segments: each run of ordinary pieces between sentinels, EOS and padding,
  decoded (a run that is a JSON object, e.g. a text file's line read whole: its string values)."""
  ids = np.asarray(ids)
  ordinary = np.concatenate([[False], (ids > vocabulary.eos_id) & (ids < pieces), [False]])
  edges = np.flatnonzero(ordinary[1:] != ordinary[:-1])  # run starts and ends, alternating
  runs = [ids[start:end].tolist() for start, end in zip(edges[::2], edges[1::2])]
  return tuple(_json_values(text) for text in vocabulary.tokenizer.DecodeIds(runs)) if runs else ()


# A JSON string escape (\n, \", \u00e9, ...), read back in a part of a JSON line.
_JSON_ESCAPE = re.compile(r'\\(["\\/bfnrt]|u[0-9a-fA-F]{4})')


def _json_values(text: str) -> str:
  """The string values of `text` when it is a JSON object, joined by line breaks; its JSON string
  escapes read back when it is a part of one (e.g. a run of a span-corrupted JSON line); else `text`."""
  if text.lstrip().startswith("{"):
    try:
      parsed = json.loads(text)
    except ValueError:
      parsed = None
    if isinstance(parsed, dict):
      return "\n".join(v for v in parsed.values() if isinstance(v, str))
  return _JSON_ESCAPE.sub(lambda m: json.loads(f'"\\{m.group(1)}"'), text) if "\\" in text else text


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]
