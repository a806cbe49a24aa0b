"""The four memorization splits (eval/splits.py) as an Apache Beam pipeline (any runner).

  corpus files (train, then validation; numbered in reading order)
    -> per file, in a worker: texts + offsets, MinHash band keys   near_dup.compute_band_keys,
       (band-major), 50-token window hashes by hash partition      shingles.window_hashes
    -> per band, in a worker: that band's keys of every document   lsh_pairs.band_pairs
       -> bucket candidate pairs, counted, by query partition
    -> per query partition: ranked candidates -> edit similarity   lsh_pairs.PairCounts.ranked,
       (texts read back by offset), first hit wins                  near_dup.check_pair
    -> per hash partition: documents sharing a window              (2 train documents, or a
                                                                    validation and a train one)
    -> flagged document numbers, one file a partition

Three pipelines, one after another (`beam_io.run_items`: the files; the bands; the query and
hash partitions), each one element a work item: what a step needs from the one before (the
documents of each file) is read back by the launching process between them and handed to the
next as an argument, never as a side input computed in the same pipeline, so every runner (Dask
included) runs each item once, as its own task. Every file is written under a temporary name
and renamed into place (`beam_io.open_atomic`): a retried item rewrites its own files whole.

The documents never pass through the runner: the workers read the corpus files themselves and
hand each other files in the work folder (one element a file, a band or a partition goes through
the runner), so the launching process holds O(1) a document while the pipelines run,
then a few bytes a document (the flags) while it reads the result. A corpus that is not a file
pattern (tfds:, a folder, builtin:) is first streamed by the launching process into one JSON
lines file of the work folder. The functions are the local path's and documents are numbered in
the local path's reading order, so the split file equals the local one for the same corpora and
settings (only the timings differ). A band's worker holds ~25 bytes a document of the corpus
(that band's keys, sorted); the others hold one file or one partition.
"""
import array
import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import sentencepiece as spm

from private_t5.data import beam_io
from private_t5.data import beam_files
from private_t5.data import beam_runner
from private_t5.data import beam_pipeline
from private_t5.data import corpora
from private_t5.errors import ConfigError, DataError
from private_t5.eval import lsh_pairs
from private_t5.eval import near_dup
from private_t5.eval import split_search
from private_t5.eval.split_types import SplitConfig, Splits
from private_t5.lazy_imports import lazy_module
from private_t5 import shingles

logger = logging.getLogger(__name__)

# Apache Beam is optional (`data.beam_io.import_beam`).
filesystems = lazy_module("apache_beam.io.filesystems", needed_for="a Beam runner",
                          install="apache-beam (requirements.txt), or use --runner=local")

TRAIN, VALID = "t", "v"
PAIR_PARTITIONS = 64  # candidate pairs, by query document
HASH_PARTITIONS = 64  # window hashes, by the hash's top bits
_WINDOW_DTYPE = np.dtype([("h", "<u8"), ("r", "<u8")])  # hash, file number << 40 | document in file
_PAIR_DTYPE = np.dtype([("code", "<u8"), ("count", "<i8")])  # lsh_pairs.PairCounts code and count

_SENTENCEPIECE = {}


def _tokenizer(vocab_path: Optional[str]):
  """text -> token ids: the SentencePiece model at vocab_path (loaded once per worker) or words."""
  if not vocab_path:
    return near_dup.word_token_ids
  if vocab_path not in _SENTENCEPIECE:
    with filesystems.FileSystems.open(vocab_path) as f:
      _SENTENCEPIECE[vocab_path] = spm.SentencePieceProcessor(model_proto=f.read())
  sp = _SENTENCEPIECE[vocab_path]
  return lambda text: sp.encode(text)


def _write(path: str, data: bytes) -> None:
  beam_files.write_atomic(path, data)


def _read(path: str) -> bytes:
  return beam_files.read_bytes(path)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Settings every worker needs."""
  root: str
  cfg: SplitConfig
  vocab_path: Optional[str]
  text_field: str
  id_field: str
  errors: str
  skip_bad_lines: bool


class _FileSpill:
  """One corpus file's texts, offsets, band keys and window hashes, written as they come: band keys
  in blocks of `split_search.KEY_BLOCK` documents, band-major; window hashes in chunks of about 2^20
  a hash partition. A worker holds one block and one chunk."""

  def __init__(self, plan: _Plan, number: int, texts, keys):
    self._plan, self._number = plan, number
    self._texts, self._keys = texts, keys  # open_atomic handles of files/NNNNNN.txt and .keys
    self.offsets = array.array("Q", [0])
    self._block = np.zeros((split_search.KEY_BLOCK, plan.cfg.num_bands), dtype=np.uint64)
    self._in_block = 0
    self._windows, self._buffered, self._chunks = [], 0, 0

  def add(self, text: str, windows: np.ndarray) -> None:
    raw = text.encode("utf-8")
    self._texts.write(raw)
    self.offsets.append(self.offsets[-1] + len(raw))
    if windows.size:
      rec = np.empty(windows.size, dtype=_WINDOW_DTYPE)
      rec["h"], rec["r"] = windows, (self._number << 40) | (len(self.offsets) - 2)
      self._windows.append(rec)
      self._buffered += rec.size
      if self._buffered >= 1 << 20:
        self._flush_windows()

  def add_keys(self, keys: np.ndarray) -> None:
    done = 0
    while done < len(keys):
      take = min(len(keys) - done, len(self._block) - self._in_block)
      self._block[self._in_block:self._in_block + take] = keys[done:done + take]
      self._in_block, done = self._in_block + take, done + take
      if self._in_block == len(self._block):
        self._write_block()

  def _write_block(self) -> None:
    self._keys.write(np.ascontiguousarray(self._block.T).tobytes())
    self._block[:] = 0
    self._in_block = 0

  def _flush_windows(self) -> None:
    if not self._windows:
      return
    rec = np.concatenate(self._windows)
    self._windows, self._buffered = [], 0
    part = (rec["h"] >> np.uint64(58)).astype(np.int64)  # HASH_PARTITIONS = 64
    for p in np.unique(part).tolist():
      _write(f"{self._plan.root}/windows/{p:03d}/{self._number:06d}-{self._chunks:05d}", rec[part == p].tobytes())
    self._chunks += 1

  def close(self) -> None:
    if self._in_block:
      self._write_block()
    self._flush_windows()
    _write(f"{self._plan.root}/files/{self._number:06d}.offsets", np.frombuffer(self.offsets, np.uint64).tobytes())


def _spill_file(element, plan: _Plan) -> Dict[str, int]:
  """(file number, path) -> its documents and bad lines: writes the file's texts, offsets, band
  keys and window hashes to the work folder (`_FileSpill`)."""
  number, path = element
  base = f"{plan.root}/files/{number:06d}"
  with contextlib.ExitStack() as stack:
    texts = stack.enter_context(beam_files.open_atomic(base + ".txt"))
    keys = stack.enter_context(beam_files.open_atomic(base + ".keys"))
    return _spill_into(_FileSpill(plan, number, texts, keys), path, plan)


def _spill_into(spill: "_FileSpill", path: str, plan: _Plan) -> Dict[str, int]:
  cfg = dataclasses.replace(plan.cfg, num_workers=1)
  tok = _tokenizer(plan.vocab_path)
  batch, bad = [], 0
  no_windows = np.zeros(0, dtype=np.uint64)
  with filesystems.FileSystems.open(path) as f:
    for _, doc in beam_io.iter_file_documents(path, iter(f.readline, b""), text_field=plan.text_field,
                                              id_field=plan.id_field, errors=plan.errors):
      if isinstance(doc, beam_io.BadLine):
        if not plan.skip_bad_lines:
          raise DataError(f"{doc} (pass --skip_bad_lines to count and skip it)")
        bad += 1
        continue
      text = doc[1]
      spill.add(text, shingles.window_hashes(tok(text), cfg.exact_substring_tokens)
                if cfg.exact_substring_tokens else no_windows)
      batch.append(text)
      if len(batch) >= 256:
        spill.add_keys(near_dup.compute_band_keys(batch, cfg))
        batch = []
  if batch:
    spill.add_keys(near_dup.compute_band_keys(batch, cfg))
  spill.close()
  n = len(spill.offsets) - 1
  beam_pipeline.counter("documents_minhashed").inc(n)
  return {"documents": n, "bad_lines": bad}


def _numbering(counts: Sequence[int], files) -> Tuple[np.ndarray, int]:
  """(first document number of each file, training documents) from the per-file counts."""
  sizes = np.array([int(counts[k]) for k in range(len(files))], dtype=np.int64)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  n_train = int(sum(sizes[k] for k, (side, _) in enumerate(files) if side == TRAIN))
  return starts, n_train


def _band(b: int, plan: _Plan, files, counts):
  """One band: every document's key (in document order) -> bucket pairs, by query partition."""
  starts, n_train = _numbering(counts, files)
  keys = np.empty(int(starts[-1]), dtype=np.uint64)
  block, bands = split_search.KEY_BLOCK, plan.cfg.num_bands
  for k in range(len(files)):
    n = int(starts[k + 1] - starts[k])
    if not n:
      continue
    with filesystems.FileSystems.open(f"{plan.root}/files/{k:06d}.keys") as f:
      for blk in range(-(-n // block)):
        f.seek((blk * bands + b) * block * 8)
        take = min(block, n - blk * block)
        first = int(starts[k]) + blk * block
        keys[first:first + take] = np.frombuffer(f.read(block * 8), dtype=np.uint64)[:take]
  within, across = lsh_pairs.PairCounts(), lsh_pairs.PairCounts()
  lsh_pairs.band_pairs(keys, n_train, plan.cfg.max_candidates_per_doc, within, across)
  for kind, pairs in (("within", within), ("across", across)):
    pairs.compact()
    if pairs.codes.size:
      part = ((pairs.codes >> np.uint64(32)) % np.uint64(PAIR_PARTITIONS)).astype(np.int64)
      for p in np.unique(part).tolist():
        rec = np.empty(int((part == p).sum()), dtype=_PAIR_DTYPE)
        rec["code"], rec["count"] = pairs.codes[part == p], pairs.counts[part == p]
        _write(f"{plan.root}/pairs/{kind}/{p:03d}/{b:05d}", rec.tobytes())
  return b


class _Texts:
  """Document texts by number, read back by offset from the files' spills (offsets cached)."""

  def __init__(self, plan: _Plan, starts: np.ndarray):
    self._plan, self._starts, self._offsets = plan, starts, {}

  def __call__(self, i: int) -> str:
    k = int(np.searchsorted(self._starts, i, side="right") - 1)
    if k not in self._offsets:
      if len(self._offsets) > 64:
        self._offsets.clear()
      self._offsets[k] = np.frombuffer(_read(f"{self._plan.root}/files/{k:06d}.offsets"), dtype=np.uint64)
    local = i - int(self._starts[k])
    start, end = int(self._offsets[k][local]), int(self._offsets[k][local + 1])
    with filesystems.FileSystems.open(f"{self._plan.root}/files/{k:06d}.txt") as f:
      f.seek(start)
      return f.read(end - start).decode("utf-8")


def _partition_files(prefix: str) -> List[str]:
  """The files under `prefix` (none when nothing was written there)."""
  try:
    matched = filesystems.FileSystems.match([prefix + "/*"])
  except Exception:  # pylint: disable=broad-except
    return []  # Beam's file systems raise on a pattern that matches nothing (some of them)
  # A name starting with a dot is a writer's temporary file (`beam_io.open_atomic`).
  return sorted(m.path for r in matched for m in r.metadata_list if not m.path.rsplit("/", 1)[-1].startswith("."))


def _partition(item, plan: _Plan, files, counts) -> int:
  """("verify", p) or ("exact", p) -> that partition's work; the pairs it checked."""
  kind, p = item
  return _verify(p, plan, files, counts) if kind == "verify" else _exact(p, plan, files, counts)


def _verify(p: int, plan: _Plan, files, counts) -> int:
  """One query partition: its pairs of every band, counted and ranked -> verified; returns the
  pairs checked and writes the flagged document numbers."""
  starts, n_train = _numbering(counts, files)
  texts = _Texts(plan, starts)
  cache = {}

  def words(i):
    if i not in cache:
      if len(cache) > 4096:
        cache.clear()
      cache[i] = near_dup.words(texts(i))
    return cache[i]

  flagged, checked = [], 0
  for kind in ("within", "across"):
    pairs = lsh_pairs.PairCounts()
    for path in _partition_files(f"{plan.root}/pairs/{kind}/{p:03d}"):
      rec = np.frombuffer(_read(path), dtype=_PAIR_DTYPE)
      pairs.add_counted(rec["code"], rec["count"])
    for q, cands in pairs.ranked(plan.cfg.max_candidates_per_doc):
      i = int(q) + (0 if kind == "within" else n_train)
      for j in cands.tolist():
        did, dup = near_dup.check_pair(words(i), words(j), plan.cfg.min_edit_similarity)
        checked += did
        if dup:
          flagged += [i, j] if kind == "within" else [i]
          break
  if flagged:
    _write(f"{plan.root}/flags/near/{p:03d}", np.unique(np.asarray(flagged, dtype=np.uint64)).tobytes())
  beam_pipeline.counter("pairs_checked").inc(checked)
  return checked


def _exact(p: int, plan: _Plan, files, counts) -> int:
  """One hash partition -> the documents sharing a window with another training document."""
  starts, n_train = _numbering(counts, files)
  paths = _partition_files(f"{plan.root}/windows/{p:03d}")
  if not paths:
    return 0
  rec = np.concatenate([np.frombuffer(_read(path), dtype=_WINDOW_DTYPE) for path in paths])
  doc = starts[(rec["r"] >> np.uint64(40)).astype(np.int64)] + (rec["r"] & np.uint64((1 << 40) - 1)).astype(np.int64)
  is_train = doc < n_train
  h_train, d_train = rec["h"][is_train], doc[is_train]
  order = np.argsort(h_train, kind="stable")
  h_train, d_train = h_train[order], d_train[order]
  same = h_train[1:] == h_train[:-1]
  flagged = [d_train[1:][same], d_train[:-1][same]]
  if h_train.size:
    flagged.append(doc[~is_train][np.isin(rec["h"][~is_train], h_train)])
  flagged = np.unique(np.concatenate(flagged).astype(np.uint64))
  if flagged.size:
    _write(f"{plan.root}/flags/exact/{p:03d}", flagged.tobytes())
  return 0


def _corpus_files(specs, root: str, side: str, read: dict) -> List[Tuple[str, str]]:
  """(side, path) of each file of `specs` in reading order; a spec that is not a file pattern or
  a file is streamed into a JSON lines file of the work folder first."""
  out = []
  for c, spec in enumerate([specs] if isinstance(specs, str) else list(specs)):
    if not isinstance(spec, str) or not spec:
      raise ConfigError(f"missing corpus: give at least one file pattern or corpus spec, got {spec!r}")
    if beam_io.is_pattern_or_file(spec) and not spec.startswith(corpora.TFDS_PREFIX):
      paths = beam_io.match_files(os.path.expanduser(spec))
      for path in paths:
        beam_io.file_format(path)  # unsupported formats fail before the pipeline starts
      out += [(side, path) for path in paths]
      continue
    path = f"{root}/corpus-{side}{c}.jsonl"
    with beam_files.open_atomic(path) as f:
      for d in corpora.iter_documents(spec, text_field=read["text_field"], id_field=read["id_field"],
                                      errors=read["errors"], data_dir=read["data_dir"]):
        f.write((json.dumps({"id": d.id, read["text_field"]: d.text}, ensure_ascii=False) + "\n").encode("utf-8"))
    out.append((side, path))
  return out


def build_splits_beam(train_corpus: Union[str, Sequence[str]], valid_corpus: Union[str, Sequence[str]],
                      cfg: SplitConfig = SplitConfig(), *, runner: str = "DirectRunner",
                      beam_options: Union[str, Sequence[str]] = "", vocab_path: Optional[str] = None,
                      text_field: str = "text", errors: str = "strict", data_dir: Optional[str] = None,
                      skip_bad_lines: bool = False, work_dir: Optional[str] = None) -> Splits:
  """`split_search.build_splits` on a Beam runner, reading the corpora itself.

  Args:
    train_corpus, valid_corpus: file pattern(s) / corpus spec(s) (see `beam_io.read_documents`).
    cfg: detection settings (`num_workers` is ignored: the runner decides).
    vocab_path: SentencePiece model for the exact-substring test (readable by the workers);
      None uses words.
    work_dir: where workers write their files (default: the options' `temp_location`, else a
      local temporary folder, removed afterwards).

  Returns:
    `Splits` (a flag a document), equal to the local path's (timings aside).
  """
  cfg.validate()
  if not beam_runner.is_beam(runner):
    raise ConfigError("build_splits_beam needs a Beam runner, not 'local'")
  beam_runner.import_beam()
  options = beam_runner.pipeline_options(runner, beam_options)
  start = time.time()
  read = dict(text_field=text_field, id_field="id", errors=errors, data_dir=data_dir)
  with beam_files.output_dir(options, work_dir, "splits") as root:
    files = _corpus_files(train_corpus, root, TRAIN, read) + _corpus_files(valid_corpus, root, VALID, read)
    plan = _Plan(root=root, cfg=cfg, vocab_path=vocab_path, text_field=text_field, id_field="id", errors=errors,
                 skip_bad_lines=skip_bad_lines)
    run = dict(options=options, out_dir=root + "/results", stage="splits", runner=runner)
    spilled = beam_pipeline.run_items([(k, path) for k, (_, path) in enumerate(files)], _spill_file, plan,
                                step="spill files", **run)
    counts = [int(r["documents"]) for r in spilled]
    beam_pipeline.run_items(list(range(cfg.num_bands)), _band, plan, files, counts, step="band pairs", **run)
    parts = [("verify", p) for p in range(PAIR_PARTITIONS)]
    if cfg.exact_substring_tokens:
      parts += [("exact", p) for p in range(HASH_PARTITIONS)]
    checked = sum(int(c) for c in beam_pipeline.run_items(parts, _partition, plan, files, counts, step="partitions",
                                                     **run))
    bad = sum(int(r["bad_lines"]) for r in spilled)
    if bad:
      logger.warning("splits: skipped %d malformed lines", bad)
    starts, n_train = _numbering(counts, files)
    return _assemble(root, int(starts[-1]), n_train, checked, vocab_path, time.time() - start)


def _assemble(root: str, n: int, n_train: int, checked: int, vocab_path: Optional[str],
              seconds: float) -> Splits:
  """The flagged document numbers -> `Splits` (a few bytes a document) and the local path's stats."""
  flags = {}
  for kind in ("near", "exact"):
    found = np.zeros(n, dtype=bool)
    for path in _partition_files(f"{root}/flags/{kind}"):
      found[np.frombuffer(_read(path), dtype=np.uint64).astype(np.int64)] = True
    flags[kind] = found
  near, exact = flags["near"], flags["exact"]
  stats = {
      "train_documents": n_train,
      "valid_documents": n - n_train,
      "train_near_dup_minhash": int(near[:n_train].sum()),
      "train_exact_substring": int(exact[:n_train].sum()),
      "valid_near_dup_minhash": int(near[n_train:].sum()),
      "valid_exact_substring": int(exact[n_train:].sum()),
      "verified_pairs": checked,
      "exact_substring_unit": "tokens" if vocab_path else "words",
      "seconds": {"total": round(seconds, 2)},
  }
  dup = near | exact
  splits = Splits(train_dup=dup[:n_train].copy(), valid_dup=dup[n_train:].copy(), stats=stats)
  logger.info("splits: %s", ", ".join(f"{k} {v}" for k, v in splits.sizes().items()))
  return splits
