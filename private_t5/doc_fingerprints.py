"""Keyed fingerprints of documents: which documents a DP vocabulary was built from, kept private.

A vocabulary declared public (not counted in ε) must not have been built from the documents a
run trains on. Comparing files decides nothing once the same documents are re-compressed,
decompressed, re-ordered, subsetted or read through a seqio Task; comparing the documents does.
`private-t5 dp-spm` therefore records, while it reads every document anyway, one 8-byte keyed
fingerprint per document, and training looks its own documents up in that set.

What identifies a document (`normalise`): its text in Unicode NFKC (the normalisation
SentencePiece applies before it sees any text), with every run of whitespace read as one space
and none at either end. DP-SentencePiece sees a document only as its whitespace-separated words,
so two texts with the same words in the same order are the same document to the vocabulary, and
a copy of a corpus in another file format, compression, line ending or trailing newline gives the
same fingerprints.

The fingerprint (`fingerprints`): keyed BLAKE2b of the normalised UTF-8 text, 64 bits
(Aumasson et al., "BLAKE2: simpler, smaller, fast as MD5", 2013; keyed BLAKE2b is a PRF). The
key is 32 random bytes from the OS (`new_key`), written beside the vocabulary in a file of mode
0600 (`write_key`) and nowhere else: not in the privacy report, not in the training report. Without
the key a fingerprint is indistinguishable from a random number, so the fingerprint file alone
tells nothing about any document (not even whether a guessed text is in the set); with the key,
whoever holds a candidate text can test whether it was one of the vocabulary's documents, a
membership test that the DP vocabulary itself does not allow. Both files stay with the data owner,
beside the vocabulary, and are never released; the released artifact is the `.model` file (and the
privacy report without its not-DP fields). Two documents share a fingerprint by chance with
probability 2^-64 per pair: a false match only composes a vocabulary's ε that need not be.

Scale: 8 bytes a document, as numpy arrays (`FingerprintWriter` appends chunks to a file, then
sorts the array in place, memory-mapped); a lookup (`count_members`) reads a chunk of texts at a
time and binary-searches the sorted, memory-mapped array.
"""
import contextlib
import hashlib
import hmac
import os
import socket
import tempfile
import unicodedata
from typing import Iterable, Optional, Tuple

import numpy as np
import toolz

from private_t5 import io as io_lib
from private_t5.errors import DataError
from private_t5.io import atomic_open, file_sha256

KEY_BYTES = 32
FINGERPRINT_BYTES = 8
SCHEME = "blake2b-64, keyed (32-byte secret key), of the NFKC text with whitespace runs as one space, trimmed"
FINGERPRINTS_SUFFIX = ".doc_fingerprints.npy"
KEY_SUFFIX = ".fingerprint_key"
# What the key check value is the keyed hash of (`key_check`).
_KEY_CHECK_MESSAGE = b"private_t5 document fingerprint key check"
# Texts fingerprinted and looked up at a time.
CHUNK = 65536


def normalise(text: str) -> str:
  """The text that identifies a document: NFKC, whitespace runs as one space, trimmed."""
  return " ".join(unicodedata.normalize("NFKC", text).split())


def new_key() -> bytes:
  """A fresh secret key from the OS's entropy."""
  return os.urandom(KEY_BYTES)


def fingerprint(text: str, key: bytes) -> int:
  """The keyed 64-bit fingerprint of one document (`normalise`d first)."""
  digest = hashlib.blake2b(normalise(text).encode("utf-8"), key=key, digest_size=FINGERPRINT_BYTES).digest()
  return int.from_bytes(digest, "little")


def fingerprints(texts: Iterable[str], key: bytes) -> np.ndarray:
  """uint64: the fingerprint of each text, in order."""
  return np.fromiter((fingerprint(t, key) for t in texts), dtype=np.uint64)


def key_check(key: bytes) -> str:
  """A keyed hash of a fixed message (hex): tells whether a key file is the one the fingerprints were
  made with, and reveals neither the key nor anything about a document."""
  return hashlib.blake2b(_KEY_CHECK_MESSAGE, key=key, digest_size=16).hexdigest()


def fingerprints_path(vocab_path: str) -> str:
  """Where the fingerprints of a vocabulary's documents are kept: beside it."""
  return vocab_path + FINGERPRINTS_SUFFIX


def key_path(vocab_path: str) -> str:
  """Where the secret key of a vocabulary's fingerprints is kept: beside it, mode 0600."""
  return vocab_path + KEY_SUFFIX


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


class FingerprintWriter:
  """Collects the fingerprints of a stream of documents (8 bytes each, on disk) and writes them,
  sorted, as one `.npy` array.

  Args:
    key: the secret key.
    directory: where the unsorted fingerprints are spooled (default, or when it does not exist yet:
      the system's temporary folder).
  """

  def __init__(self, key: bytes, directory: Optional[str] = None):
    self.key = key
    self.count = 0
    directory = directory if directory and os.path.isdir(directory) else None
    self._spool = tempfile.TemporaryFile(dir=directory)  # pylint: disable=consider-using-with

  def add(self, values: np.ndarray) -> None:
    """Appends fingerprints (uint64) already computed, e.g. by a worker."""
    values = np.ascontiguousarray(values, dtype=np.uint64)
    self._spool.write(values.tobytes())
    self.count += len(values)

  def add_texts(self, texts: Iterable[str]) -> None:
    """Fingerprints and appends `texts`."""
    self.add(fingerprints(texts, self.key))

  def write(self, path: str) -> str:
    """Writes the sorted fingerprints to `path` (a `.npy` file, atomically); returns its SHA-256."""
    self._spool.flush()
    self._spool.seek(0)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    prefix = "." + os.path.basename(path) + "."
    io_lib.remove_stale_temp_files(directory, prefix, ".tmp")  # of writers of `path` that were killed
    fd, tmp = io_lib.make_temp_file(directory, f"{prefix}{socket.gethostname()}-{os.getpid()}-", ".tmp")
    os.fchmod(fd, 0o600)
    os.close(fd)
    try:
      if self.count:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint64, shape=(self.count,))
        for start in range(0, self.count, CHUNK):
          block = np.frombuffer(self._spool.read(FINGERPRINT_BYTES * min(CHUNK, self.count - start)), np.uint64)
          out[start:start + len(block)] = block
        out.sort()
        out.flush()
        del out
      else:  # (a memory map cannot be empty)
        with open(tmp, "wb") as f:
          np.save(f, np.zeros(0, np.uint64), allow_pickle=False)
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise
    finally:
      self._spool.close()
    return file_sha256(path)

  def close(self) -> None:
    self._spool.close()


def load(path: str) -> np.ndarray:
  """The sorted fingerprints at `path`, memory-mapped (DataError when the file is not theirs)."""
  try:
    values = np.load(path, mmap_mode="r", allow_pickle=False)
  except (OSError, ValueError, EOFError) as e:
    raise DataError(f"the document fingerprints {path} cannot be read: {e}") from None
  if values.dtype != np.uint64 or values.ndim != 1:
    raise DataError(f"{path} holds no document fingerprints ({values.dtype}, shape {values.shape})")
  return values


def is_member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
  """bool per element of `values`: whether it is in `sorted_set` (sorted uint64, memory-mapped or not)."""
  if not len(sorted_set):
    return np.zeros(len(values), dtype=bool)
  at = np.searchsorted(sorted_set, values)
  return np.asarray(sorted_set[np.minimum(at, len(sorted_set) - 1)]) == values


def count_members(texts: Iterable[str], key: bytes, sorted_set: np.ndarray,
                  chunk_size: int = CHUNK) -> Tuple[int, int]:
  """(how many of `texts` are in the set, how many texts): streamed, a chunk at a time."""
  found = total = 0
  for chunk in toolz.partition_all(chunk_size, texts):
    found += int(is_member(fingerprints(chunk, key), sorted_set).sum())
    total += len(chunk)
  return found, total


def same_key(key: bytes, check: str) -> bool:
  """Whether `key` is the key whose `key_check` is `check`."""
  return hmac.compare_digest(key_check(key), str(check))
