"""Train / validation documents and a training corpus with planted duplicates.

The memorization experiment of Ponomareva et al. 2022 (§4, Table 3) compares documents that
occur several times in the training data with documents that occur once. `plant_duplicates`
builds such a corpus: a seeded random `fraction` of the training documents is repeated, each
chosen document `r` times in all (r cycles through `repetitions`, e.g. 2, 5, 10), beside the
corpus's own natural near-duplicates. Every copy is its own document (id `ID#copyK`), so the
privacy unit stays the document as written to the training file.
"""
import dataclasses
import json
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from private_t5 import io as io_lib
from private_t5.documents import Document
from private_t5.errors import ConfigError, DataError


@dataclasses.dataclass(frozen=True)
class DuplicationConfig:
  """How the corpus is split and duplicated.

  Attributes:
    validation_fraction: share of documents held out for validation (never duplicated).
    fraction: share of training documents that get repeated.
    repetitions: total occurrences of a repeated document, cycled over the chosen documents.
    seed: seed of the split and of the choice.
    max_documents: use at most this many documents of the corpus (its first ones); None: all.
  """
  validation_fraction: float = 0.1
  fraction: float = 0.1
  repetitions: Tuple[int, ...] = (2, 5, 10)
  seed: int = 0
  max_documents: Optional[int] = None

  def validate(self) -> "DuplicationConfig":
    if not 0.0 < self.validation_fraction < 1.0:
      raise ConfigError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")
    if not 0.0 <= self.fraction <= 1.0:
      raise ConfigError(f"duplicate fraction must be in [0, 1], got {self.fraction}")
    reps = tuple(self.repetitions or ())
    if not reps or any(not isinstance(r, int) or isinstance(r, bool) or r < 2 for r in reps):
      raise ConfigError(f"repetitions must be integers >= 2, got {self.repetitions!r}")
    if self.max_documents is not None and (not isinstance(self.max_documents, int) or self.max_documents < 2):
      raise ConfigError(f"max_documents must be an integer >= 2 or None, got {self.max_documents!r}")
    return self

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["repetitions"] = list(self.repetitions)
    return out


@dataclasses.dataclass
class StudyCorpus:
  """The documents of a study: training (with copies), validation, and which were repeated."""
  train: List[Document]
  valid: List[Document]
  repeated: Dict[str, int]  # original training document id -> total occurrences
  num_train_original: int

  def describe(self) -> dict:
    counts: Dict[str, int] = {}
    for r in self.repeated.values():
      counts[str(r)] = counts.get(str(r), 0) + 1
    return {"train_documents": self.num_train_original, "train_documents_with_copies": len(self.train),
            "valid_documents": len(self.valid), "repeated_documents": len(self.repeated),
            "repeated_by_count": counts}


COPY_MARK = "#copy"


def original_id(doc_id: str) -> str:
  """The training document a planted copy (`ID#copyK`) repeats; other ids are their own."""
  return doc_id.split(COPY_MARK, 1)[0]


def plant_duplicates(docs: Sequence[Document], cfg: DuplicationConfig) -> StudyCorpus:
  """Splits `docs` into train / validation and repeats a fraction of the training documents.

  Deterministic in `cfg.seed`. Copies are appended after the originals in a seeded random
  order. Raises DataError when either side would be empty.
  """
  cfg.validate()
  docs = list(docs)[:cfg.max_documents] if cfg.max_documents else list(docs)
  ids = [d.id for d in docs]
  if len(set(ids)) != len(ids):
    raise DataError("the corpus has repeated document ids; a study needs unique ids")
  rng = np.random.default_rng(cfg.seed)
  order = rng.permutation(len(docs))
  num_valid = int(round(cfg.validation_fraction * len(docs)))
  if num_valid < 1 or num_valid >= len(docs):
    raise DataError(f"{len(docs)} documents cannot be split with validation_fraction "
                    f"{cfg.validation_fraction} (both sides need at least one document)")
  valid_pos = set(order[:num_valid].tolist())
  train = [d for i, d in enumerate(docs) if i not in valid_pos]
  valid = [d for i, d in enumerate(docs) if i in valid_pos]
  num_repeated = int(round(cfg.fraction * len(train)))
  chosen = sorted(rng.choice(len(train), size=num_repeated, replace=False).tolist()) if num_repeated else []
  repeated, copies = {}, []
  for k, i in enumerate(chosen):
    r = int(cfg.repetitions[k % len(cfg.repetitions)])
    repeated[train[i].id] = r
    copies += [Document(f"{train[i].id}{COPY_MARK}{c}", train[i].text, train[i].user) for c in range(1, r)]
  copies = [copies[i] for i in rng.permutation(len(copies))]
  return StudyCorpus(train=train + copies, valid=valid, repeated=repeated, num_train_original=len(train))


def write_jsonl(path: str, docs: Sequence[Document]) -> str:
  """Writes documents as JSONL (`id`, `text`) atomically; `.gz` compresses."""
  with io_lib.atomic_open_text(path) as f:
    for d in docs:
      f.write(json.dumps({"id": d.id, "text": d.text}, ensure_ascii=False) + "\n")
  return path
