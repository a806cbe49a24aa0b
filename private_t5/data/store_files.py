"""The files of a token store entry: their names, format versions and integrity.

What `store.py`'s docstring describes on disk: the names of an entry's files (`shard_file_names`),
the format versions that still open, the `checksums` record of the manifest (size and SHA-256 of
every other file, `entry_checksums`) and the checks made when an entry is opened (`check_entry`,
`check_tokens_file`: a damaged entry is one `DamagedStoreError`), and the digest of what training
reads from it (`tokens_digest`).
"""
import hashlib
import os
from typing import Dict, Mapping, Optional

import numpy as np

from private_t5.data import store_index
from private_t5.errors import DataError

FORMAT_VERSION = 3
JSON_INDEX_FORMAT_VERSION = 2   # shards, with every id and user in documents.json
LEGACY_FORMAT_VERSION = 1
TOKENS_FILE = "tokens.int32"    # version 1 (single file)
OFFSETS_FILE = "offsets.int64"  # version 1 (single file)
DOCUMENTS_FILE = "documents.json"  # versions 1 and 2
MANIFEST_FILE = "manifest.json"
CHECKSUMS_KEY = "checksums"  # manifest: file name -> {"size", "sha256"} of every other file of an entry
_HASH_BLOCK = 1 << 22  # bytes read at a time when a file is hashed


def shard_file_names(index: int, num_shards: int):
  """(tokens file, offsets file) of shard `index` of `num_shards`."""
  suffix = f"{index:05d}-of-{num_shards:05d}"
  return f"tokens-{suffix}.int32", f"offsets-{suffix}.int64"


class DamagedStoreError(DataError):
  """A cache entry whose files no longer match what was written: a file missing, truncated or altered.

  `reason` names the file (and its expected and actual size); the message says how to rebuild it.
  """

  def __init__(self, path: str, reason: str):
    self.path, self.reason = path, reason
    super().__init__(f"store {path} is damaged: {reason}; run `private-t5 store` with the same settings "
                     f"to rebuild it (or delete that folder)")


def file_checksum(path: str) -> Dict[str, object]:
  """{"size", "sha256"} of a file, read in blocks (never held whole)."""
  h, size = hashlib.sha256(), 0
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(_HASH_BLOCK), b""):
      h.update(block)
      size += len(block)
  return {"size": size, "sha256": h.hexdigest()}


def entry_checksums(path: str, known: Optional[Mapping[str, Mapping[str, object]]] = None
                    ) -> Dict[str, Dict[str, object]]:
  """The manifest's `checksums` record of an entry folder: size and SHA-256 of each of its files
  (the manifest and hidden temporary files aside). Files in `known` (hashed while they were
  written) keep their record when their size still matches; the others are read once, in blocks."""
  out = {}
  for name in sorted(os.listdir(path)):
    full = os.path.join(path, name)
    if name == MANIFEST_FILE or name.startswith(".") or not os.path.isfile(full):
      continue
    rec = (known or {}).get(name)
    if rec is not None and int(rec["size"]) == os.path.getsize(full):
      out[name] = {"size": int(rec["size"]), "sha256": str(rec["sha256"])}
    else:
      out[name] = file_checksum(full)
  return out


def check_entry(path: str, manifest: Mapping[str, object], checksum: bool = False) -> bool:
  """Compares the files of an entry with its `checksums` record: each file's size (one `stat`),
  and with `checksum` its SHA-256 (every file read, in blocks). Returns False for an entry written
  without the record (its caller checks what its index implies).

  Raises:
    DamagedStoreError: a recorded file is missing, of another size, or of another SHA-256.
  """
  record = manifest.get(CHECKSUMS_KEY)
  if not isinstance(record, dict):
    return False
  for name, rec in sorted(record.items()):
    try:
      size = os.path.getsize(os.path.join(path, name))
    except OSError:
      raise DamagedStoreError(path, f"{name} is missing (expected {int(rec['size'])} bytes)") from None
    if size != int(rec["size"]):
      raise DamagedStoreError(path, f"{name} holds {size} bytes, expected {int(rec['size'])}")
  if checksum:
    for name, rec in sorted(record.items()):
      if file_checksum(os.path.join(path, name))["sha256"] != rec["sha256"]:
        raise DamagedStoreError(path, f"{name} has the expected size ({int(rec['size'])} bytes) but not "
                                      f"the SHA-256 recorded when it was built")
  return True


def check_tokens_file(path: str, tokens_file: str, offsets_file: str, itemsize: int = 4) -> None:
  """An entry without a `checksums` record: the tokens file must be as long as its offsets'
  last value says (one 8-byte read).

  Raises:
    DamagedStoreError: the tokens file is missing or of another size.
  """
  offsets_path = os.path.join(path, offsets_file)
  try:
    n = os.path.getsize(offsets_path) // 8
    last = int(np.fromfile(offsets_path, dtype="<i8", count=1, offset=8 * (n - 1))[0]) if n else 0
  except (OSError, ValueError, IndexError):
    raise DamagedStoreError(path, f"{offsets_file} cannot be read") from None
  expected = last * itemsize
  try:
    size = os.path.getsize(os.path.join(path, tokens_file))
  except OSError:
    if not expected:
      return
    raise DamagedStoreError(path, f"{tokens_file} is missing (expected {expected} bytes)") from None
  if size != expected:
    raise DamagedStoreError(path, f"{tokens_file} holds {size} bytes, expected {expected}")



def tokens_digest(path: str, manifest: Dict[str, object],
                  checksums: Optional[Dict[str, Dict[str, object]]] = None) -> str:
  """SHA-256 of what training reads from a store: its token stream, each document's length and
  its users, whatever the sharding and wherever the corpus lay (a corpus moved to another path
  gives the same digest). Written into the manifest when the store is built. `checksums`, when
  given, receives each token file's own record (`file_checksum`) from the same read."""
  h = hashlib.sha256()
  for shard in manifest["shards"]:
    own, size = hashlib.sha256(), 0
    with open(os.path.join(path, shard["tokens"]), "rb") as f:
      for chunk in iter(lambda: f.read(_HASH_BLOCK), b""):
        h.update(chunk)
        own.update(chunk)
        size += len(chunk)
    if checksums is not None:
      checksums[shard["tokens"]] = {"size": size, "sha256": own.hexdigest()}
  for shard in manifest["shards"]:
    h.update(np.diff(np.fromfile(os.path.join(path, shard["offsets"]), dtype=np.int64)).astype("<i8").tobytes())
  users = None
  if manifest.get("num_users") is not None:
    users = store_index.UserColumn(*store_index.user_columns(path, int(manifest["num_users"])))
  store_index.users_json_digest(h, users)  # the same bytes as the JSON list of an older store
  return h.hexdigest()
