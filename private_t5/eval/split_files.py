"""The split file: its key (corpus contents, settings, tokenizer), its JSON format, reading and writing.

A split file holds a bit a document (format 2); a file of the older format (id lists, no
"format" field) is not read but rebuilt by the caller.
"""
import base64
import hashlib
import json
import logging
import os
from typing import Iterable, Optional

import numpy as np

from private_t5.eval.split_types import SplitConfig, Splits
from private_t5.io import write_json_atomic

# The splits' log lines keep one logger name, whichever module writes them.
logger = logging.getLogger("private_t5.eval.splits")

SPLITS_FORMAT_VERSION = 1  # of the results: part of the split file's key
SPLIT_FILE_FORMAT = 2  # of the file: 2 = a bit a document; 1 (no "format" field) = id lists


def corpus_fingerprint(docs: Iterable) -> str:
  """SHA-256 over document ids and texts: identifies the corpus content."""
  h = hashlib.sha256()
  for d in docs:
    h.update(d.id.encode("utf-8") + b"\0" + d.text.encode("utf-8") + b"\1")
  return h.hexdigest()


def splits_key(train_docs, valid_docs, cfg: SplitConfig, tokenizer_id: Optional[str]) -> str:
  """Cache key of a split file: corpus contents + settings + the tokenizer used."""
  return splits_key_from_fingerprints(corpus_fingerprint(train_docs), corpus_fingerprint(valid_docs), cfg,
                                      tokenizer_id)


def splits_key_from_fingerprints(train_fingerprint: str, valid_fingerprint: str, cfg: SplitConfig,
                                 tokenizer_id: Optional[str]) -> str:
  """`splits_key` from the two `corpus_fingerprint`s (computed while streaming a corpus)."""
  payload = json.dumps({
      "version": SPLITS_FORMAT_VERSION,
      "train": train_fingerprint,
      "valid": valid_fingerprint,
      "config": cfg.key_fields(),
      "tokenizer": tokenizer_id,
  }, sort_keys=True)
  return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def split_file_path(out_dir: str, key: str) -> str:
  """Where `load_or_build_splits` (and the memorization stage) look for the split file of `key`."""
  return os.path.join(out_dir, f"splits_{key}.json")


def load_split_file(path: str, key: str, verbose: bool = False) -> Optional[Splits]:
  """The splits stored at `path` for `key`, or None (no file, another key, unreadable, or the
  old format of id lists, which is rebuilt: one log line says so)."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    if data.get("key") != key:
      return None
    if data.get("format") != SPLIT_FILE_FORMAT:
      logger.info("splits: %s lists document ids (an older format); rebuilding it as a flag a document", path)
      return None
    flags = [_unpack_flags(data["flags"][side]) for side in ("train", "valid")]
  except (OSError, ValueError, KeyError, TypeError):
    return None  # unreadable: rebuilt by the caller
  if verbose:
    logger.info("splits: reusing %s", path)
  return Splits(train_dup=flags[0], valid_dup=flags[1], stats=data.get("stats", {}))


def write_split_file(path: str, splits: Splits, key: str, cfg: SplitConfig, tokenizer_id: Optional[str],
                     specs: Optional[dict] = None) -> str:
  """Writes `splits_file_content` atomically; returns the path."""
  return write_json_atomic(path, splits_file_content(splits, key, cfg, tokenizer_id, specs), indent=None,
                           sort_keys=False)


def splits_file_content(splits: Splits, key: str, cfg: SplitConfig, tokenizer_id: Optional[str],
                        specs: Optional[dict] = None) -> dict:
  """The JSON object of a split file (what `load_split_file` reads back).

  `flags.train` / `flags.valid`: `count` documents and `dup`, the base64 of their flags packed
  8 a byte (`numpy.packbits`, first document in the high bit): 1 for train dup / valid in
  train, 0 for train unique / valid unique. A split's documents are then named by their number
  in the corpus (0-based, in the order the corpus is read), which the key pins down.
  """
  return {"key": key, "format": SPLIT_FILE_FORMAT, "specs": specs or {}, "config": cfg.key_fields(),
          "tokenizer": tokenizer_id, "sizes": splits.sizes(), "stats": splits.stats,
          "flags": {"train": _pack_flags(splits.train_dup), "valid": _pack_flags(splits.valid_dup)}}


def _pack_flags(flags: np.ndarray) -> dict:
  return {"count": int(len(flags)), "dup": base64.b64encode(np.packbits(flags.astype(bool))).decode("ascii")}


def _unpack_flags(packed: dict) -> np.ndarray:
  count = int(packed["count"])
  bits = np.unpackbits(np.frombuffer(base64.b64decode(packed["dup"]), dtype=np.uint8), count=count)
  if bits.size != count:
    raise ValueError("flag count mismatch")
  return bits.astype(bool)

