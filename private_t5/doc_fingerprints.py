"""Keyed signatures of documents: which documents a DP vocabulary was built from, kept private.

A vocabulary declared public (not counted in ε) must not have been built from the documents a
run trains on, nor from edited copies or parts of them: the vocabulary's guarantee is about the
people who wrote its documents, and their text with a word changed, a character added, merged with
another document or cut in two is still theirs. Comparing files decides nothing once the same
documents are re-compressed, re-ordered, subsetted or read through a seqio Task; comparing the
documents does. `private-t5 dp-spm` therefore records, while it reads every document anyway, a
keyed signature of each document, and training looks its own documents up in them
(`tokenizer.public_declaration`).

What is compared (`shingles.content_words`): the words of a text in Unicode NFKC (as SentencePiece
sees text), without format characters (BOM, zero-width space and joiners, soft hyphen), case
folded, with punctuation and symbols read as word breaks. Two signatures a document:

* its fingerprint: a keyed 64-bit hash of those words (an identical document, whatever its file
  format, case, punctuation or invisible characters);
* its shingles: the keyed 64-bit hashes of every run of `SHINGLE_WORDS` consecutive words, of which
  the one in `SAMPLE_ONE_IN` whose hash is 0 modulo that number is kept (Broder, "On the
  resemblance and containment of documents", 1997: a consistent sample, so that shared text keeps
  the same sample in both documents).

A training document T overlaps the vocabulary's documents (`Signatures.overlaps`) when its
fingerprint is one of theirs, or when it shares at least `MIN_SHARED` sampled shingles with one
vocabulary document V and those are at least `SHARED_FRACTION` of the smaller of the two samples:
T is (mostly) contained in V (a near-copy with words changed, a half of a split document) or V is
(mostly) contained in T (merged documents, a document quoted whole in a longer one). Shingles found
in more than `COMMON_DOCUMENTS` distinct vocabulary documents are common phrases and boilerplate:
counted on neither side. A document too short for two sampled shingles is compared by its
fingerprint alone.

The keys: 32 random bytes from the OS (`new_key`), with a personalisation string per use (BLAKE2b's
`person`: words, documents), so that every hash is a keyed PRF (Aumasson et al., "BLAKE2: simpler,
smaller, fast as MD5", 2013). Without the key the files tell nothing about any document; with the
key, whoever holds a candidate text can test whether it was one of the vocabulary's documents, a
membership test the DP vocabulary itself does not allow. So the key and the signatures are written
apart from the vocabulary, in a private folder (`private_dir`: by default `<vocabulary's folder>.private/`,
mode 0700, files mode 0600), never beside the `.model` file a user publishes; the privacy report
names the folder (relative to the vocabulary) and each file's SHA-256, never the key.

Scale: on disk 12 bytes a vocabulary document and 12 bytes a kept shingle (about 6 bytes a word
of the corpus). Sorting holds the documents' fingerprints (8 bytes a document) and one of the
`PARTS` parts of the shingles in memory at a time, the rest spooled on disk. Memory-mapped on lookup, a
chunk of training documents at a time (`Signatures.count_overlaps`).
"""
import dataclasses
import hashlib
import hmac
import os
import tempfile
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import toolz

from private_t5 import shingles
from private_t5.errors import DataError
from private_t5.io import atomic_open, file_sha256

KEY_BYTES = 32
SHINGLE_WORDS = 7
SAMPLE_ONE_IN = 2
MIN_SHARED = 2
SHARED_FRACTION = 0.5
COMMON_DOCUMENTS = 256
SCHEME = (f"keyed blake2b-64 of the content words (NFKC, format characters removed, case folded, "
          f"punctuation and symbols as breaks) and of every {SHINGLE_WORDS}-word shingle, one in "
          f"{SAMPLE_ONE_IN} kept; overlap: the same words, or >= {MIN_SHARED} shared shingles making "
          f">= {SHARED_FRACTION:g} of the smaller sample; shingles of > {COMMON_DOCUMENTS} documents not counted")
FORMAT = 2
# The private folder of a vocabulary and the files in it.
PRIVATE_DIR_SUFFIX = ".private"
KEY_FILE = "fingerprint_key"
FILES = {  # kind: file name
    "documents": "documents.npy",                    # uint64, sorted: the documents' fingerprints
    "document_shingles": "document_shingles.npy",    # uint32: each one's counted shingles
    "shingles": "shingles.npy",                      # uint64, sorted: the counted shingles
    "shingle_documents": "shingle_documents.npy",    # uint32: the document (index) of each
    "common_shingles": "common_shingles.npy",        # uint64, sorted: shingles not counted
}
# The files an older dp-spm wrote beside the vocabulary (exact fingerprints only): still named so
# that a folder holding them can be recognised as private (`private-t5 export` warns).
FINGERPRINTS_SUFFIX = ".doc_fingerprints.npy"
KEY_SUFFIX = ".fingerprint_key"
# What the key check value is the keyed hash of (`key_check`).
_KEY_CHECK_MESSAGE = b"private_t5 document fingerprint key check"
# Texts signed or looked up at a time.
CHUNK = 4096
# A text given in pieces that were not adjacent (e.g. the runs of text between a span-corrupted
# example's sentinels): no shingle crosses the end of a piece.
Segments = Tuple[str, ...]
Text = Union[str, Segments]


def normalise(text: str) -> str:
  """The words that identify a document's content, joined by single spaces."""
  return " ".join(shingles.content_words(text))


def new_key() -> bytes:
  """A fresh secret key from the OS's entropy."""
  return os.urandom(KEY_BYTES)


def _keyed(data: bytes, key: bytes, person: bytes) -> int:
  return int.from_bytes(hashlib.blake2b(data, key=key, person=person, digest_size=8).digest(), "little")


def fingerprint(text: str, key: bytes) -> int:
  """The keyed 64-bit fingerprint of one document's content words."""
  return _keyed(normalise(text).encode("utf-8"), key, b"document")


class _Signer:
  """Fingerprints and sampled shingles of texts under one key (word hashes cached per signer)."""

  def __init__(self, key: bytes):
    self.key = key
    self._words: Dict[str, int] = {}

  def _word(self, word: str) -> int:
    value = self._words.get(word)
    if value is None:
      if len(self._words) > 1_000_000:
        self._words.clear()
      value = self._words[word] = _keyed(word.encode("utf-8"), self.key, b"word")
    return value

  def sign(self, text: Text) -> Tuple[int, np.ndarray]:
    """(fingerprint, sorted unique sampled shingles) of `text` (a string, or `Segments`)."""
    segments = [shingles.content_words(t) for t in ((text,) if isinstance(text, str) else text)]
    hashes = []
    for words in segments:
      ids = np.fromiter((self._word(w) for w in words), dtype=np.uint64, count=len(words))
      hashes.append(shingles.window_hashes(ids, SHINGLE_WORDS))
    sampled = shingles.sample_one_in(np.concatenate(hashes) if hashes else np.zeros(0, np.uint64), SAMPLE_ONE_IN)
    words = [w for segment in segments for w in segment]
    return _keyed(" ".join(words).encode("utf-8"), self.key, b"document"), sampled


def signatures(texts: Sequence[Text], key: bytes) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(fingerprints uint64 [n], shingles uint64 [k], the text (0..n-1) of each shingle int64 [k])."""
  signer = _Signer(key)
  prints = np.zeros(len(texts), np.uint64)
  parts, owners = [], []
  for i, text in enumerate(texts):
    prints[i], sampled = signer.sign(text)
    parts.append(sampled)
    owners.append(np.full(len(sampled), i, np.int64))
  if not parts:
    return prints, np.zeros(0, np.uint64), np.zeros(0, np.int64)
  return prints, np.concatenate(parts), np.concatenate(owners)


def key_check(key: bytes) -> str:
  """A keyed hash of a fixed message (hex): tells whether a key file is the one the signatures were
  made with, and reveals neither the key nor anything about a document."""
  return hashlib.blake2b(_KEY_CHECK_MESSAGE, key=key, digest_size=16).hexdigest()


def same_key(key: bytes, check: str) -> bool:
  """Whether `key` is the key whose `key_check` is `check`."""
  return hmac.compare_digest(key_check(key), str(check))


def private_dir(vocab_path: str, directory: Optional[str] = None) -> str:
  """The private folder of a vocabulary's signatures and key: `directory`, else the vocabulary's
  folder with `.private` appended, then the vocabulary's file name (never inside its folder)."""
  if directory:
    return os.path.join(os.path.abspath(directory), os.path.basename(vocab_path))
  folder = os.path.dirname(os.path.abspath(vocab_path))
  return os.path.join(folder + PRIVATE_DIR_SUFFIX, os.path.basename(vocab_path))


def is_private_file(name: str) -> bool:
  """Whether a file name is one of the private files of a DP vocabulary's signatures (either layout)."""
  return name.endswith((FINGERPRINTS_SUFFIX, KEY_SUFFIX)) or name == KEY_FILE


def write_key(path: str, key: bytes) -> str:
  """Writes `key` to `path` atomically, readable by its owner only (mode 0600)."""
  with atomic_open(path, "wb") as f:
    os.fchmod(f.fileno(), 0o600)
    f.write(key)
  return path


def read_key(path: str) -> bytes:
  """The secret key at `path` (DataError when it is not a key file)."""
  try:
    with open(path, "rb") as f:
      key = f.read(KEY_BYTES + 1)
  except OSError as e:
    raise DataError(f"the fingerprint key {path} cannot be read: {e.strerror or e}") from None
  if len(key) != KEY_BYTES:
    raise DataError(f"{path} is not a fingerprint key ({len(key)} bytes, expected {KEY_BYTES})")
  return key


def _save(path: str, values: np.ndarray) -> str:
  """Writes one array as `.npy` atomically, mode 0600; returns its SHA-256."""
  with atomic_open(path, "wb") as f:
    os.fchmod(f.fileno(), 0o600)
    np.save(f, np.ascontiguousarray(values), allow_pickle=False)
  return file_sha256(path)


class _Spool:
  """Values of one dtype appended to a temporary file (never held in memory), read back memory-mapped."""

  def __init__(self, directory: Optional[str], dtype="<u8"):
    self.file = tempfile.TemporaryFile(dir=directory)  # pylint: disable=consider-using-with
    self.dtype = np.dtype(dtype)
    self.count = 0

  def add(self, values: np.ndarray) -> None:
    self.file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
    self.count += len(values)

  def array(self) -> np.ndarray:
    self.file.flush()
    if not self.count:
      return np.zeros(0, self.dtype)
    return np.memmap(self.file, dtype=self.dtype, mode="r", shape=(self.count,))


# The shingles are spooled in this many parts by their top bits, and each part is sorted alone: in
# order, the parts are the sorted whole, and memory holds one part at a time (1/64 of the shingles).
PARTS = 64
_PART_SHIFT = np.uint64(64 - 6)


class FingerprintWriter:
  """Collects the signatures of a stream of documents (on disk) and writes them, sorted, into the
  vocabulary's private folder.

  Args:
    key: the secret key.
    directory: where the unsorted signatures are spooled (default, or when it does not exist yet:
      the system's temporary folder).
  """

  def __init__(self, key: bytes, directory: Optional[str] = None):
    self.key = key
    self._directory = directory if directory and os.path.isdir(directory) else None
    self._prints = _Spool(self._directory)
    self._parts = [(_Spool(self._directory), _Spool(self._directory)) for _ in range(PARTS)]

  @property
  def count(self) -> int:
    """Documents added."""
    return self._prints.count

  def add(self, prints: np.ndarray, sampled: np.ndarray, owners: np.ndarray) -> None:
    """Appends signatures already computed (`signatures` of a chunk, e.g. by a worker)."""
    prints = np.asarray(prints, np.uint64)
    if len(sampled):
      sampled = np.asarray(sampled, np.uint64)
      # Each shingle's document by its fingerprint (documents are numbered only once sorted).
      owner = prints[np.asarray(owners, np.int64)]
      part = (sampled >> _PART_SHIFT).astype(np.int64)
      order = np.argsort(part, kind="stable")
      bounds = np.searchsorted(part[order], np.arange(PARTS + 1))
      for k in np.flatnonzero(np.diff(bounds)):
        rows = order[bounds[k]:bounds[k + 1]]
        self._parts[k][0].add(sampled[rows])
        self._parts[k][1].add(owner[rows])
    self._prints.add(prints)

  def add_texts(self, texts: Sequence[str]) -> None:
    """Signs and appends `texts`."""
    self.add(*signatures(texts, self.key))

  def write(self, directory: str) -> Dict[str, object]:
    """Writes the sorted signatures and the key into `directory` (mode 0700; files 0600); returns
    the record the privacy report keeps: each file's name and SHA-256, never the key."""
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):  # (the `.private` folder itself, when this makes it: the owner's only)
      os.makedirs(parent, mode=0o700)
      os.chmod(parent, 0o700)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    try:
      documents = np.unique(self._prints.array())
      per_document = np.zeros(len(documents), np.int64)
      kept = (_Spool(self._directory), _Spool(self._directory, "<u4"), _Spool(self._directory))
      for shingles_part, owners_part in self._parts:  # in the order of their top bits
        shingle, owner = np.asarray(shingles_part.array()), np.asarray(owners_part.array())
        order = np.lexsort((owner, shingle))
        shingle, owner = shingle[order], owner[order]
        del order
        if len(shingle):  # a document's shingle once, however often the document occurs
          first = np.ones(len(shingle), bool)
          first[1:] = (shingle[1:] != shingle[:-1]) | (owner[1:] != owner[:-1])
          shingle, owner = shingle[first], owner[first]
        values, counts = np.unique(shingle, return_counts=True)
        counted = np.repeat(counts <= COMMON_DOCUMENTS, counts)
        index = np.searchsorted(documents, owner[counted])
        kept[0].add(shingle[counted])
        kept[1].add(index)
        kept[2].add(values[counts > COMMON_DOCUMENTS])
        per_document += np.bincount(index, minlength=len(documents))
        shingles_part.file.close()
        owners_part.file.close()
      arrays = {"documents": documents, "document_shingles": per_document.astype(np.uint32),
                "shingles": kept[0].array(), "shingle_documents": kept[1].array(),
                "common_shingles": kept[2].array()}
      files = {kind: {"file": FILES[kind], "sha256": _save(os.path.join(directory, FILES[kind]), arrays[kind])}
               for kind in FILES}
      del arrays
      for spool in kept:
        spool.file.close()
      write_key(os.path.join(directory, KEY_FILE), self.key)
    finally:
      self.close()
    return {"format": FORMAT, "files": files, "key_file": KEY_FILE, "key_check": key_check(self.key),
            "scheme": SCHEME, "documents": int(len(documents))}

  def close(self) -> None:
    for spool in (self._prints, *(spool for part in self._parts for spool in part)):
      spool.file.close()


def _load(path: str, dtype) -> np.ndarray:
  try:
    values = np.load(path, mmap_mode="r", allow_pickle=False)
  except (OSError, ValueError, EOFError) as e:
    raise DataError(f"the document signatures {path} cannot be read: {e}") from None
  if values.dtype != np.dtype(dtype) or values.ndim != 1:
    raise DataError(f"{path} holds no document signatures ({values.dtype}, shape {values.shape})")
  return values


@dataclasses.dataclass
class Signatures:
  """The signatures of a vocabulary's documents, memory-mapped, and their key."""
  key: bytes
  documents: np.ndarray
  document_shingles: np.ndarray
  shingles: np.ndarray
  shingle_documents: np.ndarray
  common_shingles: np.ndarray

  @classmethod
  def load(cls, directory: str, key: bytes) -> "Signatures":
    """The files `FingerprintWriter.write` wrote into `directory` (DataError when one is not theirs)."""
    dtypes = {"documents": np.uint64, "document_shingles": np.uint32, "shingles": np.uint64,
              "shingle_documents": np.uint32, "common_shingles": np.uint64}
    arrays = {kind: _load(os.path.join(directory, FILES[kind]), dtypes[kind]) for kind in FILES}
    if len(arrays["documents"]) != len(arrays["document_shingles"]) or (
        len(arrays["shingles"]) != len(arrays["shingle_documents"])):
      raise DataError(f"the document signatures in {directory} do not belong together (lengths differ)")
    return cls(key=key, **arrays)

  def overlaps(self, texts: Sequence[Text]) -> np.ndarray:
    """bool per text: whether it overlaps a vocabulary document (see the module docstring)."""
    prints, sampled, owner = signatures(texts, self.key)
    found = _members(prints, self.documents)
    keep = ~_members(sampled, self.common_shingles)
    sampled, owner = sampled[keep], owner[keep]
    sizes = np.bincount(owner, minlength=len(texts))
    lo = np.searchsorted(self.shingles, sampled, "left")
    hi = np.searchsorted(self.shingles, sampled, "right")
    lengths = hi - lo
    total = int(lengths.sum())
    if total:
      ends = np.cumsum(lengths)
      position = np.arange(total) - np.repeat(ends - lengths, lengths) + np.repeat(lo, lengths)
      vocab_doc = np.asarray(self.shingle_documents[position]).astype(np.int64)
      text = np.repeat(owner, lengths)
      pair, shared = np.unique(text * max(len(self.documents), 1) + vocab_doc, return_counts=True)
      text, vocab_doc = pair // max(len(self.documents), 1), pair % max(len(self.documents), 1)
      smaller = np.minimum(sizes[text], np.asarray(self.document_shingles[vocab_doc]))
      hit = (shared >= MIN_SHARED) & (shared >= SHARED_FRACTION * smaller)
      found[text[hit]] = True
    return found

  def count_overlaps(self, documents: Iterable[Union[Text, List[Text]]],
                     chunk_size: int = CHUNK) -> Tuple[int, int]:
    """(how many of `documents` overlap the vocabulary's, how many documents): streamed. A document
    is a `Text`, or a list of the texts of one example (e.g. its inputs and targets): it overlaps
    when one does."""
    found = total = 0
    for chunk in toolz.partition_all(chunk_size, documents):
      texts: List[Text] = []
      owner: List[int] = []
      for i, doc in enumerate(chunk):
        parts = doc if isinstance(doc, list) else [doc]
        texts += parts
        owner += [i] * len(parts)
      hits = self.overlaps(texts)
      overlapping = np.zeros(len(chunk), bool)
      overlapping[np.asarray(owner, np.int64)[hits]] = True
      found += int(overlapping.sum())
      total += len(chunk)
    return found, total


def _members(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
  """bool per element of `values`: whether it is in `sorted_set` (sorted uint64, memory-mapped or not)."""
  if not len(sorted_set) or not len(values):
    return np.zeros(len(values), dtype=bool)
  at = np.searchsorted(sorted_set, values)
  return np.asarray(sorted_set[np.minimum(at, len(sorted_set) - 1)]) == values
