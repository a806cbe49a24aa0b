"""What the four memorization splits are: their names, the detection settings, the result.

`SplitConfig` holds the near-duplicate settings (Lee et al. 2021); `Splits` is the result of a
search, a flag a document in corpus order (eval/splits.py says what the four splits are).
"""
import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from private_t5.errors import ConfigError

SPLIT_NAMES = ("train_dup", "train_unique", "valid_in_train", "valid_unique")


@dataclasses.dataclass(frozen=True)
class SplitConfig:
  """Near-duplicate detection settings (defaults: Lee et al. 2021).

  Attributes:
    ngram: words per shingle.
    num_perm: MinHash permutations.
    num_bands: LSH bands; `num_perm / num_bands` rows per band.
    min_edit_similarity: a LSH candidate pair is kept when 1 - ED(a, b) / max(|a|, |b|) over
      word sequences reaches this value.
    exact_substring_tokens: a shared window of this many tokens marks a duplicate (0: off).
    seed: MinHash permutation seed.
    max_candidates_per_doc: at most this many LSH candidates are verified per document.
    num_workers: processes for MinHash (None: all cores).
  """
  ngram: int = 5
  num_perm: int = 9000
  num_bands: int = 450
  min_edit_similarity: float = 0.8
  exact_substring_tokens: int = 50
  seed: int = 1
  max_candidates_per_doc: int = 50
  num_workers: Optional[int] = None

  def validate(self) -> "SplitConfig":
    if self.ngram < 1:
      raise ConfigError(f"ngram must be >= 1, got {self.ngram}")
    if self.num_bands < 1 or self.num_perm < self.num_bands or self.num_perm % self.num_bands:
      raise ConfigError(f"num_perm ({self.num_perm}) must be a positive multiple of num_bands "
                        f"({self.num_bands})")
    if not 0.0 <= self.min_edit_similarity <= 1.0:
      raise ConfigError(f"min_edit_similarity must be in [0, 1], got {self.min_edit_similarity}")
    if self.exact_substring_tokens < 0:
      raise ConfigError(f"exact_substring_tokens must be >= 0, got {self.exact_substring_tokens}")
    return self

  @property
  def rows_per_band(self) -> int:
    return self.num_perm // self.num_bands

  def key_fields(self) -> dict:
    """The settings that change the result (not the worker count)."""
    d = dataclasses.asdict(self)
    d.pop("num_workers")
    return d


@dataclasses.dataclass
class Splits:
  """The four splits as a flag per document (in corpus order) plus how they were found.

  Attributes:
    train_dup: bool [training documents]: True for train dup, False for train unique.
    valid_dup: bool [validation documents]: True for valid in train, False for valid unique.
    stats: detection statistics.
    ids: the document ids of each split, when the documents were at hand (`with_ids`).
    fingerprints: the two corpora's `corpus_fingerprint`s, when computed while reading them.
  """
  train_dup: np.ndarray
  valid_dup: np.ndarray
  stats: dict
  ids: Optional[Dict[str, List[str]]] = None
  fingerprints: Optional[Tuple[str, str]] = None

  def sizes(self) -> Dict[str, int]:
    t, v = int(np.count_nonzero(self.train_dup)), int(np.count_nonzero(self.valid_dup))
    return {"train_dup": t, "train_unique": len(self.train_dup) - t, "valid_in_train": v,
            "valid_unique": len(self.valid_dup) - v}

  def indices(self, name: str) -> np.ndarray:
    """The numbers (0-based positions in its corpus) of split `name`'s documents, ascending."""
    if name not in SPLIT_NAMES:
      raise ConfigError(f"unknown split {name!r} (one of {SPLIT_NAMES})")
    flags = self.train_dup if name.startswith("train") else self.valid_dup
    return np.flatnonzero(flags if name in ("train_dup", "valid_in_train") else ~flags)

  def with_ids(self, train_ids: Iterable[str], valid_ids: Iterable[str]) -> "Splits":
    """A copy with `ids` filled in from the corpora's ids in corpus order."""
    ids = {name: [] for name in SPLIT_NAMES}
    for flags, doc_ids, (dup, unique) in ((self.train_dup, train_ids, SPLIT_NAMES[:2]),
                                          (self.valid_dup, valid_ids, SPLIT_NAMES[2:])):
      for flag, doc_id in zip(flags.tolist(), doc_ids):
        ids[dup if flag else unique].append(doc_id)
    return dataclasses.replace(self, ids=ids)


def check_nonempty(splits: Splits) -> List[str]:
  """Human-readable warnings for empty splits."""
  return [f"split {name!r} is empty" for name, n in splits.sizes().items() if n == 0]

