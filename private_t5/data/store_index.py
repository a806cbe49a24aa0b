"""The per-document index of a token store: ids and users on disk, read on demand.

A corpus of C4's size (365 million documents) cannot hold a Python string per document in every
process (about 180 bytes each). A store therefore keeps, per shard S of K:

  ids-S.utf8      the document ids' UTF-8 bytes back to back
  ids-S.int64     n_S+1 offsets into them: local document j's id is bytes [o[j], o[j+1])
  idhash-S.uint64 the first 8 bytes of each id's SHA-256 (big-endian, as an integer): the public
                  validation split (`source.in_validation`) and the duplicate-id check, as arrays

and, for a corpus with users (user-level DP), over the whole store:

  users.int64       the user index of each document (global document order)
  user-names.utf8   the user names (index order: first appearance), with user-names.int64 offsets

Opening a store reads none of them: `StringColumn` memory-maps a file the first time an id or
name is asked for (the stages that print them), and the arrays a stage needs (`id_hashes`,
`user_index`) are fixed-size integers, 8 bytes a document. Every file is mapped through
`store_files.MappedFile` (its size checked first, and known to the bus-error guard).

Duplicate ids (ids define the privacy unit) are found from the hashes (a sort, 8 bytes a
document), and every hash shared by two documents is checked on the ids themselves, so the check
is exact.
"""
import array
import collections.abc
import hashlib
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from private_t5.data import store_files
from private_t5.errors import DataError
from private_t5.io import atomic_open

USERS_FILE = "users.int64"
USER_NAMES_FILE = "user-names.utf8"
USER_NAME_OFFSETS_FILE = "user-names.int64"


def id_hash(doc_id: str) -> int:
  """The first 8 bytes of the SHA-256 of `doc_id`, as a big-endian unsigned integer."""
  return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")


def index_file_names(index: int, num_shards: int) -> Dict[str, str]:
  """The index files of shard `index` of `num_shards`: ids, their offsets, their hashes."""
  suffix = f"{index:05d}-of-{num_shards:05d}"
  return {"ids": f"ids-{suffix}.utf8", "id_offsets": f"ids-{suffix}.int64", "id_hashes": f"idhash-{suffix}.uint64",
          "users": f"users-{suffix}.int64"}


def _write_strings(path: str, offsets_path: str, strings: Sequence[str]) -> None:
  offsets = [0]
  with atomic_open(path, "wb") as f:
    for s in strings:
      data = s.encode("utf-8")
      f.write(data)
      offsets.append(offsets[-1] + len(data))
  with atomic_open(offsets_path, "wb") as f:
    np.asarray(offsets, dtype=np.int64).tofile(f)


class _Column(collections.abc.Sequence):
  """A read-only sequence equal to any list (or column) of the same items."""

  def __eq__(self, other) -> bool:
    if isinstance(other, (_Column, list, tuple)):
      return len(self) == len(other) and all(a == b for a, b in zip(self, other))
    return NotImplemented

  __hash__ = None


class StringColumn(_Column):
  """Strings stored as UTF-8 bytes plus int64 offsets, in one or more parts (shards), read on
  demand: nothing is loaded until a string is asked for, then only the parts' files are
  memory-mapped. A `Sequence` (len, index, iteration, `in`); equal to a list of the same strings."""

  def __init__(self, parts: Sequence[Tuple[str, str, int]]):
    """`parts`: (bytes file, offsets file, number of strings) in order."""
    self._parts = list(parts)
    self._starts = np.cumsum([0] + [n for _, _, n in self._parts])
    self._maps: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

  def __len__(self) -> int:
    return int(self._starts[-1])

  def _map(self, k: int):
    if k not in self._maps:
      data_path, offsets_path, n = self._parts[k]
      offsets = store_files.MappedFile(offsets_path, np.int64, 8 * (n + 1)).array
      data = store_files.MappedFile(data_path, np.uint8, max(0, int(offsets[-1]))).array
      self._maps[k] = (data, offsets)
    return self._maps[k]

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    i = int(i)
    if i < 0:
      i += len(self)
    if not 0 <= i < len(self):
      raise IndexError(f"index {i} out of range [0, {len(self)})")
    k = int(np.searchsorted(self._starts, i, side="right")) - 1
    data, offsets = self._map(k)
    j = i - int(self._starts[k])
    return bytes(data[offsets[j]:offsets[j + 1]]).decode("utf-8")


class UserColumn(_Column):
  """The user name of each document, from the user index and the names (read on demand)."""

  def __init__(self, index: np.ndarray, names: Sequence[str]):
    self.index, self.names = index, names

  def __len__(self) -> int:
    return len(self.index)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    return self.names[int(self.index[i])]


class IndexWriter:
  """Writes one shard's index while its documents stream by: ids, id hashes, and (with users)
  each document's user as an index into the shard's own list of user names (first appearance);
  `merge_users` makes the store's global user index from the shards'. Memory: the shard's
  distinct users, never a string per document."""

  def __init__(self, out_dir: str, index: int, num_shards: int, with_users: bool):
    self.out_dir = out_dir
    self.files = index_file_names(index, num_shards)
    self.with_users = with_users
    self.documents = 0
    # Machine integers (8 bytes a document), not a Python int per document.
    self._id_offsets = array.array("q", [0])
    self._hashes = array.array("Q")
    self._user_of: Dict[str, int] = {}
    self._users = array.array("q")
    self._ctx = atomic_open(os.path.join(out_dir, self.files["ids"]), "wb")
    self._f = self._ctx.__enter__()
    self._open = True

  def add(self, doc_id: str, user: Optional[str]) -> None:
    data = doc_id.encode("utf-8")
    self._f.write(data)
    self._id_offsets.append(self._id_offsets[-1] + len(data))
    self._hashes.append(int.from_bytes(hashlib.sha256(data).digest()[:8], "big"))
    if self.with_users:
      if user is None:
        raise DataError(f"document {doc_id!r} has no user (its user field is null)")
      self._users.append(self._user_of.setdefault(user, len(self._user_of)))
    self.documents += 1

  def close(self) -> Dict[str, object]:
    """Finishes the files; returns the shard's index entries (file names, and its user names)."""
    self._open = False
    self._ctx.__exit__(None, None, None)
    for name, values, dtype in (("id_offsets", self._id_offsets, np.int64), ("id_hashes", self._hashes, np.uint64),
                                ("users", self._users, np.int64)):
      if name == "users" and not self.with_users:
        continue
      with atomic_open(os.path.join(self.out_dir, self.files[name]), "wb") as f:
        np.frombuffer(values, dtype=dtype).tofile(f)
    entry = {k: v for k, v in self.files.items() if k != "users"}
    if self.with_users:
      entry["local_users"] = self.files["users"]
      entry["user_names"] = list(self._user_of)  # the shard's distinct users, in first-appearance order
    return entry

  def abort(self) -> None:
    if self._open:
      self._open = False
      try:
        self._ctx.__exit__(DataError, DataError("shard aborted"), None)
      except DataError:
        pass


def ids_column(path: str, shards: Sequence[Dict[str, object]]) -> StringColumn:
  return StringColumn([(os.path.join(path, sh["ids"]), os.path.join(path, sh["id_offsets"]), int(sh["documents"]))
                       for sh in shards])


def id_hashes(path: str, shards: Sequence[Dict[str, object]]) -> np.ndarray:
  """uint64[N]: each document's id hash (`id_hash`), in global order (memory-mapped with one shard)."""
  parts = [store_files.MappedFile(os.path.join(path, sh["id_hashes"]), np.uint64, 8 * int(sh["documents"])).array
           for sh in shards]
  return parts[0] if len(parts) == 1 else np.concatenate(parts)


def check_unique_ids(path: str, shards: Sequence[Dict[str, object]], corpus: str,
                     sources: Optional[Sequence[str]] = None) -> None:
  """DataError naming a document id used twice (in one shard or two): exact (hashes, then ids)."""
  hashes = id_hashes(path, shards)
  if len(hashes) < 2:
    return
  order = np.argsort(hashes, kind="stable")
  ordered = hashes[order]
  same = np.flatnonzero(ordered[1:] == ordered[:-1])
  if not len(same):
    return
  ids = ids_column(path, shards)
  starts = np.cumsum([0] + [int(sh["documents"]) for sh in shards])
  for k in same:
    a, b = sorted((int(order[k]), int(order[k + 1])))
    if ids[a] == ids[b]:
      where = ""
      if sources is not None:
        sa, sb = (int(np.searchsorted(starts, x, side="right")) - 1 for x in (a, b))
        where = f" in {sources[sa]}" + (f" and {sources[sb]}" if sb != sa else "")
      raise DataError(f"corpus {corpus}: duplicate document id {ids[a]!r}{where} (ids define the privacy unit)")


def merge_users(path: str, shards: List[Dict[str, object]]) -> int:
  """Writes the store's users.int64 and user names from the shards' own; returns the number of
  users. Each shard's local index file is removed, and its names dropped from its entry."""
  index: Dict[str, int] = {}
  with atomic_open(os.path.join(path, USERS_FILE), "wb") as f:
    for sh in shards:
      remap = np.asarray([index.setdefault(name, len(index)) for name in sh.pop("user_names")], dtype=np.int64)
      local_path = os.path.join(path, sh.pop("local_users"))
      local = np.fromfile(local_path, dtype=np.int64)
      (remap[local] if len(local) else local).astype(np.int64).tofile(f)
      os.remove(local_path)
  _write_strings(os.path.join(path, USER_NAMES_FILE), os.path.join(path, USER_NAME_OFFSETS_FILE), list(index))
  return len(index)


def user_columns(path: str, num_users: int) -> Tuple[np.ndarray, StringColumn]:
  """(user index int64[N] memory-mapped, the user names read on demand) of a store with users."""
  index = store_files.MappedFile(os.path.join(path, USERS_FILE), np.int64).array
  names = StringColumn([(os.path.join(path, USER_NAMES_FILE), os.path.join(path, USER_NAME_OFFSETS_FILE), num_users)])
  return index, names


def users_json_digest(h, users: Optional[Sequence[str]]) -> None:
  """Feeds `json.dumps(list(users))` (or "null") into hash `h`, one name at a time: the bytes the
  digest of a store always covered, without a list of every document's user in memory."""
  if users is None:
    h.update(b"null")
    return
  if isinstance(users, UserColumn):  # each distinct name encoded once (memory: the users, not the documents)
    encoded = [json.dumps(name).encode() for name in users.names]
    names = (encoded[int(i)] for i in users.index)
  else:
    names = (json.dumps(name).encode() for name in users)
  h.update(b"[")
  for k, name in enumerate(names):
    if k:
      h.update(b", ")
    h.update(name)
  h.update(b"]")


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
      for chunk in iter(lambda: f.read(store_files.HASH_BLOCK), b""):
        h.update(chunk)
        own.update(chunk)
        size += len(chunk)
    if checksums is not None:
      checksums[shard["tokens"]] = {"size": size, "sha256": own.hexdigest()}
  for shard in manifest["shards"]:
    h.update(np.diff(np.fromfile(os.path.join(path, shard["offsets"]), dtype=np.int64)).astype("<i8").tobytes())
  users = None
  if manifest.get("num_users") is not None:
    users = UserColumn(*user_columns(path, int(manifest["num_users"])))
  users_json_digest(h, users)  # the same bytes as the JSON list of an older store
  return h.hexdigest()
