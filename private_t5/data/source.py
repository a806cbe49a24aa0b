"""Random-access training examples with an explicit privacy unit.

DP rules "privacy unit is explicit" and "sampling matches accounting" (docs/privacy.md).

`CorpusSource`, the `train.main.ExampleSource` of a token store:
`CorpusSource.get_batch(indices, seed, batch_size)` builds the fixed-shape batch of the
trainer contract (docs/architecture.md) for an arbitrary set of example indices, drawing the
objective's randomness (window position, span-corruption noise, prefix split) fresh from
`(seed, example index)`: the same (indices, seed) gives the same batch, a new seed new noise.

Privacy units (N = `num_examples`, the population that DP sampling draws from):

* `document`: example i is document i. Each draw yields exactly one row for it: one window of
  the objective's raw length at a random position when the document is longer, the whole
  document (padded) when shorter. Rows never mix documents.
* `example`: documents are cut into consecutive raw-length chunks (never across documents, no
  packing); example i is chunk i. This is what the paper did; a document then feeds several
  examples, so the guarantee is per chunk, not per document.
* `user`: example i is user i. A draw picks one of the user's documents at random, then one
  window, so one user feeds at most one row per batch (user-level DP).

Window positions (`document` and `user` units): by default a longer document's window starts at
any token. With `max_windows_per_document` = K, windows lie on a fixed grid instead: a draw
takes one of the document's first K full raw-length windows [k·raw, (k+1)·raw), uniformly, so
K = 1 trains on each document's opening window only. The memorization stage prompts with a
document's first P tokens, window 0 of that grid: with K = 1 every draw of a document trains on
the text its prompt and continuation come from (random positions would almost never do so on a
long document). Text past the first K windows is not trained on.
"""
import functools
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from private_t5.data import objectives as objectives_lib
from private_t5.data import row_random
from private_t5.data import shared_arrays
from private_t5.data import store as store_lib
from private_t5.data import store_reader
from private_t5.data import store_index
from private_t5.errors import ConfigError, DataError

PRIVACY_UNITS = ("document", "example", "user")
SPLITS = ("train", "validation", "all")
BATCH_KEYS = ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens",
              "decoder_loss_weights", "example_weight", "is_padding", "example_index")


def in_validation(doc_id: str, validation_fraction: float) -> bool:
  """Public, data-independent split rule: the SHA-256 of the document id decides."""
  if validation_fraction <= 0.0:
    return False
  return store_index.id_hash(doc_id) / 2.0**64 < validation_fraction


def split_documents(store: store_reader.DocumentStore, validation: bool, validation_fraction: float) -> np.ndarray:
  """int64: the documents of the validation split (`validation`) or of the training split, by
  `in_validation`; read a block of id hashes at a time, so the only array as long as the corpus
  is the result (8 bytes a document)."""
  docs = np.empty(store.num_documents, dtype=np.int64)
  count = 0
  for start, hashes in store.id_hash_blocks():
    chosen = np.flatnonzero(validation_mask(hashes, validation_fraction) == validation) + start
    docs[count:count + len(chosen)] = chosen
    count += len(chosen)
  return docs[:count].copy() if count < len(docs) // 2 else docs[:count]  # a small split keeps no large buffer


def validation_mask(id_hashes: np.ndarray, validation_fraction: float) -> np.ndarray:
  """`in_validation` of every document at once, from the store's id hashes (uint64[N])."""
  if validation_fraction <= 0.0:
    return np.zeros(len(id_hashes), dtype=bool)
  # uint64 -> float64 rounds to nearest as Python's int -> float does: the same decision.
  return np.asarray(id_hashes).astype(np.float64) / 2.0**64 < validation_fraction



def assemble_batch(enc: np.ndarray, tgt: np.ndarray, indices: np.ndarray) -> Dict[str, np.ndarray]:
  """The trainer's batch dict from padded encoder inputs and targets [batch_size, length].

  Rows past len(indices) are padding: example_weight 0 (they contribute nothing to any
  aggregator) and example_index -1. Decoder inputs are the targets shifted right (T5).
  """
  batch_size = enc.shape[0]
  dec_in = np.zeros_like(tgt)
  dec_in[:, 1:] = tgt[:, :-1]
  n = len(indices)
  example_index = np.full((batch_size,), -1, np.int64)
  example_index[:n] = indices
  is_padding = np.arange(batch_size) >= n
  return {
      "encoder_input_tokens": enc,
      "decoder_input_tokens": dec_in,
      "decoder_target_tokens": tgt,
      "decoder_loss_weights": (tgt != 0).astype(np.float32),
      "example_weight": (~is_padding).astype(np.float32),
      "is_padding": is_padding,
      "example_index": example_index,
  }

def batch_indices(indices: Sequence[int], batch_size: int, num_examples: Optional[int] = None) -> np.ndarray:
  """`indices` as int64 [n]; ValueError when n > `batch_size`, IndexError when one falls outside
  [0, `num_examples`) (not checked when None)."""
  indices = np.asarray(indices, dtype=np.int64).reshape(-1)
  if len(indices) > batch_size:
    raise ValueError(f"{len(indices)} indices do not fit a batch of {batch_size}")
  if num_examples is not None and len(indices) and (indices.min() < 0 or indices.max() >= num_examples):
    raise IndexError(f"example index out of range [0, {num_examples})")
  return indices


def gather_batch(inputs: np.ndarray, targets: np.ndarray, indices: Sequence[int],
                 batch_size: int) -> Dict[str, np.ndarray]:
  """The trainer's batch of rows `indices` of examples held in memory, padded to `batch_size` rows.

  `inputs` [N, Li] and `targets` [N, Lt] are the zero-padded token ids of all N examples.

  Raises:
    ValueError: more indices than `batch_size`.
    IndexError: an index outside [0, N).
  """
  indices = batch_indices(indices, batch_size, len(inputs))
  n = len(indices)
  enc = np.zeros((batch_size, inputs.shape[1]), np.int32)
  tgt = np.zeros((batch_size, targets.shape[1]), np.int32)
  enc[:n] = inputs[indices]
  tgt[:n] = targets[indices]
  return assemble_batch(enc, tgt, indices)


# The arrays of a CorpusSource as long as its documents, chunks or users.
_PER_DOCUMENT_ARRAYS = ("_docs", "_chunk_doc", "_chunk_start", "_user_index", "_user_order", "_user_count",
                        "_user_first")


class CorpusSource:
  """Examples of one objective over one store, addressed by index in [0, num_examples).

  A `train.main.ExampleSource`.
  """

  def __init__(self, store: store_reader.DocumentStore, objective, privacy_unit: str = "document",
               document_indices: Optional[np.ndarray] = None, split: str = "all",
               validation_fraction: float = 0.0, max_windows_per_document: Optional[int] = None):
    if privacy_unit not in PRIVACY_UNITS:
      raise ConfigError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
    k = max_windows_per_document
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
      raise ConfigError(f"max_windows_per_document must be a positive integer or None, got {k!r}")
    if k is not None and privacy_unit == "example":
      raise ConfigError("max_windows_per_document applies to the document and user units (the example "
                        "unit already trains every chunk of the grid)")
    self.max_windows_per_document = k
    self.store = store
    self.objective = objective
    self._privacy_unit = privacy_unit
    self.split = split
    self.validation_fraction = validation_fraction
    docs = np.arange(store.num_documents) if document_indices is None else np.asarray(document_indices, np.int64)
    if len(docs) == 0:
      raise DataError(f"split {split!r} of {store.manifest['corpus']} has no documents "
                      f"(validation_fraction={validation_fraction})")
    self._docs = docs
    raw = objective.raw_length
    if privacy_unit == "document":
      self._num_examples = len(docs)
    elif privacy_unit == "example":
      # Chunk c of a document: tokens [c*raw, (c+1)*raw); every document has >= 1 chunk.
      chunks = np.empty(len(docs), dtype=np.int64)
      for positions, lengths in store.lengths_of(docs):
        chunks[positions] = np.maximum(1, -(-lengths // raw))
      self._chunk_doc = np.repeat(np.arange(len(docs)), chunks)
      first = np.concatenate([[0], np.cumsum(chunks)[:-1]])
      self._chunk_start = (np.arange(len(self._chunk_doc)) - np.repeat(first, chunks)) * raw
      self._num_examples = len(self._chunk_doc)
    else:
      if store.user_index is None:
        raise ConfigError("privacy_unit='user' needs a user_field naming each document's owner")
      # Users as integers (the store's user index), never a string per document.
      users, inverse = np.unique(np.asarray(store.user_index[docs]), return_inverse=True)
      order = np.argsort(inverse, kind="stable")
      counts = np.bincount(inverse, minlength=len(users))
      self._user_index = users  # example i is the store's user users[i]
      # User i's documents: positions into self._docs, _user_order[_user_first[i]:][:_user_count[i]].
      self._user_order = order.astype(np.int64)
      self._user_count = counts.astype(np.int64)
      self._user_first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
      self._num_examples = len(users)

  def __getstate__(self):
    # To a data worker process: the per-document arrays as shared memory, not copies.
    return shared_arrays.pickled_state(self, _PER_DOCUMENT_ARRAYS)

  def __setstate__(self, state):
    self.__dict__.update(shared_arrays.unpickled_state(state))

  @property
  def num_examples(self) -> int:
    """N, the sampling population (documents, chunks or users)."""
    return self._num_examples

  @property
  def privacy_unit(self) -> str:
    return self._privacy_unit

  @functools.cached_property
  def num_tokens(self) -> int:
    """Tokens of the source's documents (read a block of offsets at a time)."""
    if len(self._docs) == self.store.num_documents:
      return int(self.store.num_tokens)
    return int(sum(int(lengths.sum()) for _, lengths in self.store.lengths_of(self._docs)))

  @property
  def feature_lengths(self) -> Dict[str, int]:
    return {"inputs": self.objective.inputs_length, "targets": self.objective.targets_length}

  @property
  def vocab_size(self) -> int:
    """Token ids the store's vocabulary uses, sentinels included (its manifest; 0 if unrecorded)."""
    return int(self.store.manifest.get("vocab_size", 0))

  def user_ids(self) -> np.ndarray:
    """int64[N]: the group of each example for user-level DP.

    The user index of the example's owner when the corpus names users, else the document
    index (so chunks of one document share a group in `example` mode).
    """
    if self._privacy_unit == "user":
      return np.arange(self._num_examples, dtype=np.int64)
    doc_pos = self._chunk_doc if self._privacy_unit == "example" else np.arange(len(self._docs))
    if self.store.user_index is None:
      return doc_pos.astype(np.int64)
    _, inverse = np.unique(np.asarray(self.store.user_index[self._docs]), return_inverse=True)
    return inverse[doc_pos].astype(np.int64)

  def document_ids(self, indices: Sequence[int], seed: int) -> list:
    """The id of the document each example index draws from under `seed`."""
    indices = np.asarray(list(indices), dtype=np.int64).reshape(-1)
    indices = batch_indices(indices, len(indices), self._num_examples)
    pos, _, _ = self._draw_windows(indices, row_random.row_keys(seed, indices))
    return [self.store.ids[int(d)] for d in self._docs[pos]]

  def _check_index(self, index: int) -> None:
    if not 0 <= index < self._num_examples:
      raise IndexError(f"example index {index} out of range [0, {self._num_examples})")

  def _draw_windows(self, indices: np.ndarray, keys: np.ndarray):
    """(document positions, starts, lengths), int64 [n]: the raw window of each draw.

    Draw 0 of a row's key picks a user's document, draw 1 the window's start (`row_random`).
    """
    raw = self.objective.raw_length
    offsets = self.store.offsets
    if self._privacy_unit == "example":
      pos = self._chunk_doc[indices]
      start = self._chunk_start[indices]
      doc = self._docs[pos]
      doc_len = np.asarray(offsets[doc + 1] - offsets[doc], dtype=np.int64)
      return pos, start, np.minimum(raw, doc_len - start)
    if self._privacy_unit == "user":
      first, count = self._user_first[indices], self._user_count[indices]
      pos = self._user_order[first + row_random.below(row_random.bits(keys, 0), count)]
    else:
      pos = indices
    doc = self._docs[pos]
    doc_len = np.asarray(offsets[doc + 1] - offsets[doc], dtype=np.int64)
    draw = row_random.bits(keys, 1)
    if self.max_windows_per_document is not None:  # one of the first K full windows of the grid
      start = raw * row_random.below(draw, np.minimum(self.max_windows_per_document, doc_len // raw))
    else:
      start = row_random.below(draw, doc_len - raw + 1)
    longer = doc_len > raw
    return pos, np.where(longer, start, 0), np.where(longer, raw, doc_len)

  def _examples(self, indices: np.ndarray, seed: int):
    """`objective.batch` of the draws of `indices` under `seed` (indices already checked)."""
    keys = row_random.row_keys(seed, indices)
    pos, start, length = self._draw_windows(indices, keys)
    windows = self.store.windows(self._docs[pos], start, length, self.objective.raw_length)
    # The objective's own draws come from draw 2 of the row's key.
    return self.objective.batch(windows, length, row_random.bits(keys, 2))

  def example(self, index: int, seed: int):
    """(inputs, targets) int32 arrays (with EOS, unpadded) of one draw of example `index`: row
    `index` of any `get_batch` under `seed` that holds it."""
    self._check_index(index)
    inputs, targets, li, lt = self._examples(np.array([index], np.int64), seed)
    return inputs[0, :li[0]], targets[0, :lt[0]]

  def get_batch(self, indices: Sequence[int], seed: int, batch_size: int) -> Dict[str, np.ndarray]:
    """The batch dict of the trainer contract for `indices`, padded to `batch_size` rows.

    The examples are built for all rows at once (`objective.batch`); a row depends on (seed,
    its index) only.

    Raises:
      ValueError: more indices than `batch_size`.
      IndexError: an index outside [0, num_examples).
    """
    indices = batch_indices(indices, batch_size, self._num_examples)
    li, lt = self.objective.inputs_length, self.objective.targets_length
    enc = np.zeros((batch_size, li), np.int32)
    tgt = np.zeros((batch_size, lt), np.int32)
    n = len(indices)
    if n:
      # Only a document shorter than the window's context can overflow (prefix LM keeps the
      # split within bounds; span corruption fits by construction): `batch` truncates defensively.
      enc[:n], tgt[:n], _, _ = self._examples(indices, seed)
    return assemble_batch(enc, tgt, indices)

  def describe(self) -> Dict[str, object]:
    """What this source is, for logs and privacy reports (public facts only)."""
    m = self.store.manifest
    grid = ({} if self.max_windows_per_document is None  # (absent: the fingerprints of earlier runs hold)
            else {"max_windows_per_document": self.max_windows_per_document})
    return {
        **grid,
        "corpus": m["corpus"],
        "store": self.store.path,
        "vocab_path": m.get("vocab_path"),
        "vocab_sha256": m.get("vocab_sha256"),
        "tokens_sha256": m.get("tokens_sha256"),
        "objective": self.objective.name,
        "feature_lengths": self.feature_lengths,
        "raw_window_length": self.objective.raw_length,
        "privacy_unit": self._privacy_unit,
        "num_examples": self._num_examples,
        "num_documents": int(len(self._docs)),
        "num_users": int(len(self._user_index)) if self._privacy_unit == "user" else m.get("num_users"),
        "num_tokens": self.num_tokens,
        "split": self.split,
        "validation_fraction": self.validation_fraction,
        "blank_documents_skipped": m.get("blank_skipped"),
    }


def make_source(corpus: str, vocab_path: str, objective: str = "span_corruption",
                feature_lengths: Optional[Mapping[str, int]] = None, privacy_unit: str = "document",
                split: str = "train", validation_fraction: float = 0.0, cache_dir: Optional[str] = None,
                max_documents: Optional[int] = None, text_field: str = "text", id_field: str = "id",
                user_field: Optional[str] = None, errors: str = "strict", data_dir: Optional[str] = None,
                noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                max_windows_per_document: Optional[int] = None, progress: bool = True) -> CorpusSource:
  """Builds (or reuses) the token store of `corpus` and returns its `CorpusSource`.

  Args:
    corpus: corpus spec (see `corpora.iter_documents`).
    vocab_path: SentencePiece model (T5 layout); the vocabulary adds 100 sentinels.
    objective: "span_corruption" or "prefix_lm".
    feature_lengths: {"inputs": Li, "targets": Lt}; default 512/114.
    privacy_unit: "document", "example" or "user" (see the module docstring).
    split: "train", "validation" or "all"; a document is in validation when the hash of its
      id falls below `validation_fraction`.
    validation_fraction: in [0, 1).
    cache_dir: where stores are cached (default `store.default_cache_dir()`).
    max_documents: read at most this many documents of the corpus.
    text_field, id_field, user_field, errors, data_dir: corpus reader options.
    noise_density, mean_noise_span_length: span-corruption settings (0.15 and 3 as in T5).
    max_windows_per_document: None: a longer document's window starts anywhere; K: one of its
      first K grid windows (see the module docstring; K = 1: the opening window only).
    progress: print tokenization progress to stderr while building the store.
  """
  feature_lengths = dict(feature_lengths or {"inputs": 512, "targets": 114})
  if split not in SPLITS:
    raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
  if not 0.0 <= validation_fraction < 1.0:
    raise ConfigError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
  if privacy_unit not in PRIVACY_UNITS:
    raise ConfigError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
  if privacy_unit == "user" and not user_field:
    raise ConfigError("privacy_unit='user' needs user_field (the field naming each document's owner)")
  if split == "validation" and validation_fraction <= 0.0:
    raise ConfigError("split='validation' needs validation_fraction > 0")
  # Validate lengths before the (possibly long) store build; vocab size is filled in below.
  objectives_lib.make_objective(objective, feature_lengths, 0, noise_density=noise_density,
                                mean_noise_span_length=mean_noise_span_length)
  store = store_lib.build_store(corpus, vocab_path, cache_dir=cache_dir, text_field=text_field, id_field=id_field,
                                user_field=user_field, errors=errors, max_documents=max_documents,
                                data_dir=data_dir, progress=progress)
  obj = objectives_lib.make_objective(objective, feature_lengths, int(store.manifest["vocab_size"]),
                                      noise_density=noise_density, mean_noise_span_length=mean_noise_span_length)
  docs = None if split == "all" else split_documents(store, split == "validation", validation_fraction)
  return CorpusSource(store, obj, privacy_unit, docs, split, validation_fraction, max_windows_per_document)
