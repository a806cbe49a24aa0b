"""The document record every corpus reader yields, and the counts gathered while reading.

Base layer: imports nothing from the package. The readers themselves live in
`private_t5.data.corpora` (files, folders, JSONL, TSV, TFDS) and
`private_t5.data.builtin_corpus` (`builtin:python_docs`).
"""
import dataclasses
from typing import Dict, Optional


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: the privacy unit of a document-level run.

  Attributes:
    id: stable identifier, unique within the corpus.
    text: the document's text (never blank).
    user: the owner of the document, for user-level DP; None when unknown.
  """
  id: str
  text: str
  user: Optional[str] = None


@dataclasses.dataclass
class CorpusStats:
  """Counts gathered while reading a corpus (filled in as the iterator advances)."""
  spec: str = ""
  documents: int = 0
  blank_skipped: int = 0
  replaced_lines: int = 0
  characters: int = 0

  def as_dict(self) -> Dict[str, object]:
    return dataclasses.asdict(self)
