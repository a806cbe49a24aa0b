"""Writing a token store: a shard tokenized from documents, and the manifest of all shards.

`ShardWriter` writes one shard (tokens, offsets and its index of ids and users), each file complete
or absent; `finish_store` checks the ids over every shard and returns the manifest. The local build
(`store.build_store`) and the Beam build (`store_beam`) write through both.
"""
import array
import os
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from private_t5.data import store_index
from private_t5.data.store_files import FORMAT_VERSION, shard_file_names
from private_t5.documents import Document
from private_t5.errors import DataError
from private_t5.io import atomic_open

_ENCODE_CHUNK = 512  # documents per batched SentencePiece call


class ShardWriter:
  """Writes one shard (tokens + offsets, and its index: ids, id hashes, users) from documents,
  tokenizing them in batches.

  Files are written through `atomic_open`, so a shard file is complete or absent (a retried
  Beam bundle overwrites it whole). Memory: one batch of texts, the offsets and the shard's
  distinct users; no string per document.
  """

  def __init__(self, out_dir: str, index: int, num_shards: int, proc, num_threads: int = 1,
               with_users: bool = False):
    self.proc, self.num_threads = proc, max(1, int(num_threads))
    self.tokens_file, self.offsets_file = shard_file_names(index, num_shards)
    self._out_dir = out_dir
    self.index = store_index.IndexWriter(out_dir, index, num_shards, with_users)
    self.offsets = array.array("q", [0])  # 8 bytes a document
    self.text_bytes = 0
    self._batch: List[str] = []
    self._ctx = atomic_open(os.path.join(out_dir, self.tokens_file), "wb")
    self._f = self._ctx.__enter__()
    self._open = True

  @property
  def documents(self) -> int:
    return self.index.documents

  def add(self, doc: Document) -> int:
    """Adds a document; returns how many documents were tokenized by this call (0 or a batch)."""
    self.index.add(doc.id, doc.user)
    self._batch.append(doc.text)
    if len(self._batch) == _ENCODE_CHUNK:
      return self._flush()
    return 0

  def _flush(self) -> int:
    texts = self._batch
    # SentencePiece's batched encode tokenizes on `num_threads` native threads.
    for tokens in self.proc.encode(texts, num_threads=self.num_threads):
      arr = np.asarray(tokens, dtype=np.int32)
      arr.tofile(self._f)
      self.offsets.append(self.offsets[-1] + len(arr))
    self.text_bytes += sum(len(t.encode("utf-8")) for t in texts)
    n, self._batch = len(self._batch), []
    return n

  def close(self) -> Dict[str, object]:
    """Finishes every file; returns the shard's entry of the manifest index."""
    self._flush()
    self._open = False
    self._ctx.__exit__(None, None, None)
    with atomic_open(os.path.join(self._out_dir, self.offsets_file), "wb") as f:
      np.frombuffer(self.offsets, dtype=np.int64).tofile(f)
    return {"tokens": self.tokens_file, "offsets": self.offsets_file, "documents": self.documents,
            "num_tokens": int(self.offsets[-1]), **self.index.close()}

  def abort(self) -> None:
    """Removes the unfinished files (after an error)."""
    self.index.abort()
    if self._open:
      self._open = False
      error = DataError("shard aborted")
      try:
        self._ctx.__exit__(DataError, error, None)
      except DataError:
        pass


def finish_store(out_dir: str, corpus: str, reader_options, shards: List[Dict[str, object]],
                 stats: Dict[str, int], start: float, sources: Optional[Sequence[str]] = None) -> Dict[str, object]:
  """Checks the ids over all shards, merges the users; returns the manifest.

  Raises:
    DataError: a document id used twice (in one shard or two), or an empty corpus.
  """
  num_documents = sum(int(sh["documents"]) for sh in shards)
  if not num_documents:
    raise DataError(f"corpus {corpus} is empty ({stats.get('blank_skipped', 0)} blank documents skipped)")
  store_index.check_unique_ids(out_dir, shards, corpus, sources)
  has_users = reader_options["user_field"] is not None
  num_users = store_index.merge_users(out_dir, shards) if has_users else None
  starts = [0]
  for sh in shards:
    starts.append(starts[-1] + int(sh["documents"]))
  seconds = time.time() - start
  return {
      "format_version": FORMAT_VERSION,
      "corpus": corpus,
      "reader": reader_options,
      "num_documents": num_documents,
      "num_tokens": int(sum(int(sh["num_tokens"]) for sh in shards)),
      "num_users": num_users,
      "blank_skipped": int(stats.get("blank_skipped", 0)),
      "replaced_lines": int(stats.get("replaced_lines", 0)),
      "characters": int(stats.get("characters", 0)),
      "text_bytes": int(stats.get("text_bytes", 0)),
      "num_shards": len(shards),
      "shards": list(shards),
      "shard_starts": starts,
      "build_seconds": round(seconds, 3),
      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }
