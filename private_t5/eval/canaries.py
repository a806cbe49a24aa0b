"""Canaries for the secret-sharer test (Carlini et al. 2019; seeds 002 and 004).

A canary is a sentence of a fixed format with a random secret, e.g. "My ID is 341752". Copies of
each canary are inserted into a training corpus 1, 10, 100, … times; after training, its
exposure (exposure.py) tells how much better than chance the model ranks the true secret.
Every canary is its own document (one privacy unit per copy), placed at a random position of
the corpus. Reference canaries of the same format are generated but never inserted: their
exposure is the chance level.
"""
import array
import dataclasses
import json
import os
import secrets
import string
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from private_t5 import io
from private_t5.data import store_index
from private_t5.errors import ConfigError, DataError

PLACEHOLDER = "{secret}"
RECORD_SUFFIX = ".canaries.json"


@dataclasses.dataclass(frozen=True)
class CanaryFormat:
  """A canary template: `template` with `{secret}` replaced by `length` symbols of `alphabet`."""
  template: str = "My ID is {secret}"
  alphabet: str = string.digits
  length: int = 6

  def validate(self) -> "CanaryFormat":
    if self.template.count(PLACEHOLDER) != 1:
      raise ConfigError(f"canary template must contain {PLACEHOLDER} exactly once, got {self.template!r}")
    if not self.template.split(PLACEHOLDER)[0].strip():
      raise ConfigError(f"canary template needs a prefix before {PLACEHOLDER}, got {self.template!r}")
    if self.length < 1 or len(set(self.alphabet)) != len(self.alphabet) or len(self.alphabet) < 2:
      raise ConfigError(f"canary secret needs length >= 1 and an alphabet of >= 2 distinct symbols, got "
                        f"length={self.length} alphabet={self.alphabet!r}")
    return self

  @property
  def space_size(self) -> int:
    """|R|: the number of possible secrets."""
    return len(self.alphabet) ** self.length

  @property
  def prefix(self) -> str:
    return self.template.split(PLACEHOLDER)[0]

  def render(self, secret: str) -> str:
    return self.template.replace(PLACEHOLDER, secret)

  def secret_at(self, index: int) -> str:
    """The secret with rank `index` in the lexicographic enumeration of the space."""
    base = len(self.alphabet)
    chars = []
    for _ in range(self.length):
      index, r = divmod(index, base)
      chars.append(self.alphabet[r])
    return "".join(reversed(chars))

  def secrets_at(self, indices: Sequence[int]) -> List[str]:
    return [self.secret_at(int(i)) for i in indices]

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Canary:
  """One canary: its secret, full text and how many copies were inserted (0: reference)."""
  id: str
  secret: str
  text: str
  repetitions: int


def make_canaries(fmt: CanaryFormat, repetitions: Sequence[int] = (1, 10, 100), per_repetition: int = 1,
                  num_reference: int = 1, seed: Optional[int] = None) -> Tuple[List[Canary], int]:
  """Distinct random canaries: `per_repetition` for each repetition count, plus references.

  Returns:
    (canaries, seed): the seed is drawn from OS entropy when not given, and recorded.
  """
  fmt.validate()
  if any(int(r) < 1 for r in repetitions):
    raise ConfigError(f"repetitions must be positive integers, got {list(repetitions)}")
  if per_repetition < 1 or num_reference < 0:
    raise ConfigError(f"per_repetition must be >= 1 and num_reference >= 0, got {per_repetition}, {num_reference}")
  count = len(repetitions) * per_repetition + num_reference
  if count > fmt.space_size:
    raise ConfigError(f"{count} distinct canaries do not fit in a secret space of {fmt.space_size}")
  seed = secrets.randbits(63) if seed is None else int(seed)
  rng = np.random.default_rng(seed)
  picked = rng.choice(fmt.space_size, size=count, replace=False)
  out = []
  counts = [int(r) for r in repetitions for _ in range(per_repetition)] + [0] * num_reference
  for k, (index, reps) in enumerate(zip(picked, counts)):
    secret = fmt.secret_at(int(index))
    out.append(Canary(id=f"canary-{k}", secret=secret, text=fmt.render(secret), repetitions=reps))
  return out, seed


def copy_ids(canaries: Sequence[Canary]) -> List[str]:
  """The document id of every inserted copy of `canaries`, in insertion-record order."""
  return [f"{c.id}/copy-{r}" for c in canaries for r in range(c.repetitions)]


def count_documents(open_documents: Callable[[], Iterable], canaries: Sequence[Canary] = ()) -> int:
  """The number of documents of a corpus, in one pass that holds none of them.

  Also checks that the corpus with `canaries` inserted would have distinct document ids (ids
  define the privacy unit, and the store refuses a corpus that repeats one): no document id of
  the corpus is used twice or equals a canary copy's id. Memory: 8 bytes a document (the ids'
  hashes, `store_index.id_hash`), and the canary ids; a hash seen twice is checked on the ids
  themselves (a second pass), so the check is exact.

  Raises:
    DataError: a document id used twice, or one that is also a canary's.
  """
  reserved = set(copy_ids(canaries))
  hashes = array.array("Q")
  for doc in open_documents():
    if doc.id in reserved:
      raise DataError(f"the corpus already has a document with the canary id {doc.id!r} (a corpus with "
                      "canaries given as the input?); insert canaries into the original corpus")
    hashes.append(store_index.id_hash(doc.id))
  ordered = np.frombuffer(hashes, dtype=np.uint64) if len(hashes) else np.zeros((0,), np.uint64)
  ordered.sort()  # in place: 8 bytes a document in all
  shared = ordered[1:][ordered[1:] == ordered[:-1]]
  if len(shared):
    suspects, seen = set(int(h) for h in shared), set()
    for doc in open_documents():
      if store_index.id_hash(doc.id) in suspects:
        if doc.id in seen:
          raise DataError(f"the corpus uses the document id {doc.id!r} twice (ids define the privacy unit; "
                          "the store refuses such a corpus): give its documents distinct ids")
        seen.add(doc.id)
  return len(hashes)


def insert_canaries(documents: Union[Sequence, Callable[[], Iterable]], canaries: Sequence[Canary], seed: int,
                    num_documents: Optional[int] = None) -> Iterator[dict]:
  """Yields `{"id", "text"}` records: the corpus with every canary copy at a random position.

  `documents` is a sequence, or a function that opens the corpus afresh: the corpus is then read
  twice, once to count its documents (skipped when `num_documents` is given) and once while the
  records are yielded, so no document is held past its turn (memory: the canary copies and
  their positions). The positions depend on the count and the seed only: both forms give the
  same records. Any other iterable is read into memory first.
  """
  if callable(documents):
    n = count_documents(documents, canaries) if num_documents is None else int(num_documents)
    docs = documents()
  else:
    docs = documents if isinstance(documents, Sequence) else list(documents)
    n = len(docs)
  copies = list(zip(copy_ids(canaries), [c.text for c in canaries for _ in range(c.repetitions)]))
  rng = np.random.default_rng([seed, 1])
  # Each copy goes before a uniformly random corpus position (ties kept in a random order).
  positions = rng.integers(0, n + 1, size=len(copies))
  order = np.argsort(positions, kind="stable")
  sorted_positions = positions[order]
  c, read = 0, 0
  reserved = set(copy_ids(canaries))
  for d in docs:
    if d.id in reserved:  # never two documents of one id (`count_documents` refuses this before writing)
      raise DataError(f"the corpus already has a document with the canary id {d.id!r}; insert canaries "
                      "into the original corpus")
    while c < len(order) and sorted_positions[c] == read:
      yield {"id": copies[order[c]][0], "text": copies[order[c]][1]}
      c += 1
    yield {"id": d.id, "text": d.text}
    read += 1
  if read != n:
    raise DataError(f"the corpus changed while it was read: {n} documents counted, {read} read")
  for k in order[c:]:
    yield {"id": copies[k][0], "text": copies[k][1]}


def record_path(corpus_path: str, suffix: str = RECORD_SUFFIX) -> str:
  """The JSON file that records the canaries of a canary corpus (beside it, named after it)."""
  base = corpus_path[:-3] if corpus_path.endswith(".gz") else corpus_path
  base = base[:-6] if base.endswith(".jsonl") else base
  return base + suffix


def write_canary_corpus(documents, output_path: str, fmt: CanaryFormat, canaries: Sequence[Canary],
                        seed: int, source: str = "", num_documents: Optional[int] = None) -> Tuple[str, str, int]:
  """Writes the corpus with canaries (jsonl, gzip if the name ends in .gz) and its record.

  `documents` and `num_documents` as in `insert_canaries` (a function that opens the corpus
  streams it).

  Returns:
    (corpus path, record path, number of documents written).
  """
  n = 0
  with io.atomic_open_text(output_path) as f:
    for record in insert_canaries(documents, canaries, seed, num_documents):
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
      n += 1
  rec = {"format": fmt.as_dict(), "space_size": fmt.space_size, "seed": seed, "source": source,
         "corpus": os.path.abspath(output_path), "documents": n,
         "canaries": [dataclasses.asdict(c) for c in canaries]}
  path = record_path(output_path)
  io.write_json_atomic(path, rec, sort_keys=False)
  return output_path, path, n


def load_canaries(path: str) -> Tuple[CanaryFormat, List[Canary]]:
  """Reads a canary record written by `write_canary_corpus`."""
  try:
    with open(path) as f:
      rec = json.load(f)
    fmt = CanaryFormat(**rec["format"]).validate()
    canaries = [Canary(**c) for c in rec["canaries"]]
  except FileNotFoundError:
    raise DataError(f"canary record not found: {path}") from None
  except (ValueError, KeyError, TypeError) as e:
    raise DataError(f"{path} is not a canary record: {e}") from e
  for c in canaries:
    if c.text != fmt.render(c.secret):
      raise DataError(f"{path}: canary {c.id} text {c.text!r} does not match the format {fmt.template!r}")
  return fmt, canaries
