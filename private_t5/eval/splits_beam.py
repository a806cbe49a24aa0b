"""The four memorization splits (eval/splits.py) as an Apache Beam pipeline (any runner).

  documents (train and validation)                      beam_io.read_documents
    -> MinHash band keys per document                   splits.compute_band_keys, in batches
    -> GroupByKey on the band key -> candidate pairs    splits.bucket_candidates (train x train),
                                                        every train member (validation x train)
    -> GroupByKey on the query document -> ranked      splits.rank_candidates
    -> join the candidates' texts -> edit-similarity   splits.check_pair, first hit wins
    -> flagged documents (near duplicates)
  documents -> 50-token window hashes                   splits.window_hashes
    -> GroupByKey on the hash -> flagged documents      (shared by 2 train documents, or by a
                                                        validation and a train document)

No process holds more than one bucket, one candidate list or one window's documents. The
functions are the local path's, and the local near-duplicate search is order-independent,
so the split file equals the local one for the same corpora and settings (only the timings
differ). The launching process reads back one line per document (its id and two flags) to
write the id lists in corpus order.
"""
import dataclasses
import json
import logging
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import sentencepiece as spm

from private_t5.data import beam_io
from private_t5.errors import ConfigError
from private_t5.eval import splits as splits_lib

logger = logging.getLogger(__name__)

TRAIN, VALID = "t", "v"

_SENTENCEPIECE = {}


def _tokenizer(vocab_path: Optional[str]):
  """text -> token ids: the SentencePiece model at vocab_path (loaded once per worker) or words."""
  if not vocab_path:
    return splits_lib.word_token_ids
  if vocab_path not in _SENTENCEPIECE:
    # Lazy: Apache Beam is optional (`data.beam_io.import_beam`).
    from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
    with FileSystems.open(vocab_path) as f:
      _SENTENCEPIECE[vocab_path] = spm.SentencePieceProcessor(model_proto=f.read())
  sp = _SENTENCEPIECE[vocab_path]
  return lambda text: sp.encode(text)


def _band_keys(batch: List[Tuple[Any, str]], cfg: splits_lib.SplitConfig) -> Iterator[Tuple[int, Any]]:
  """A batch of (ref, text) -> (band key, ref) for every band of every document."""
  keys = splits_lib.compute_band_keys([text for _, text in batch], dataclasses.replace(cfg, num_workers=1))
  beam_io.counter("documents_minhashed").inc(len(batch))
  for (ref, _), row in zip(batch, keys):
    for key in row.view(np.int64).tolist():  # signed: Beam's integer coder is 64-bit signed
      yield key, ref


def _bucket_pairs(element, max_candidates: int) -> Iterator[Tuple[Any, Any]]:
  """One bucket -> (query ref, candidate train ref) pairs, as the local path forms them."""
  _, refs = element
  train = sorted({r for r in refs if r[0] == TRAIN})
  if not train:
    return
  if len(train) >= 2:
    yield from splits_lib.bucket_candidates(train, max_candidates)
  for q in sorted({r for r in refs if r[0] == VALID}):
    for j in train:
      yield q, j


def _ranked(element, max_candidates: int) -> Iterator[Tuple[Any, Tuple[Any, int]]]:
  """(query, [candidates with repeats]) -> (candidate, (query, rank)) for the top candidates."""
  q, cands = element
  shared: Dict[Any, int] = {}
  for j in cands:
    shared[j] = shared.get(j, 0) + 1
  for rank, j in enumerate(splits_lib.rank_candidates(shared, max_candidates)):
    yield j, (q, rank)


def _attach_text(element) -> Iterator[Tuple[Any, Tuple[int, Any, str]]]:
  j, groups = element
  texts = list(groups["text"])
  if not texts:
    return
  for q, rank in groups["cand"]:
    yield q, (rank, j, texts[0])


def _verify(element, threshold: float):
  """(query, {text, cands}) -> flagged refs (first verified candidate wins); checks on 'checked'."""
  # Lazy: Apache Beam is optional (`data.beam_io.import_beam`).
  from apache_beam import pvalue  # pylint: disable=g-import-not-at-top
  q, groups = element
  texts = list(groups["text"])
  cands = sorted(groups["cand"], key=lambda c: c[0])
  if not texts or not cands:
    return
  a = splits_lib.words(texts[0])
  checked = 0
  for _, j, text_j in cands:
    did_check, dup = splits_lib.check_pair(a, splits_lib.words(text_j), threshold)
    checked += did_check
    if dup:
      yield q
      if q[0] == TRAIN:
        yield j
      break
  beam_io.counter("pairs_checked").inc(checked)
  yield pvalue.TaggedOutput("checked", checked)


def _windows(element, window: int, vocab_path: Optional[str]) -> Iterator[Tuple[int, Any]]:
  ref, text = element
  for h in splits_lib.window_hashes(_tokenizer(vocab_path)(text), window).view(np.int64).tolist():
    yield h, ref


def _shared_windows(element) -> Iterator[Any]:
  """One window hash -> the documents it flags (2+ train documents; validation beside train)."""
  _, refs = element
  refs = set(refs)
  train = [r for r in refs if r[0] == TRAIN]
  if len(train) >= 2:
    yield from train
  if train:
    yield from (r for r in refs if r[0] == VALID)


def _record(element) -> str:
  ref, groups = element
  ids = list(groups["id"])
  return json.dumps([ref[0], list(ref[1]), ids[0], bool(list(groups["near"])), bool(list(groups["exact"]))],
                    ensure_ascii=False)


def build_splits_beam(train_corpus: Union[str, Sequence[str]], valid_corpus: Union[str, Sequence[str]],
                      cfg: splits_lib.SplitConfig = splits_lib.SplitConfig(), *, runner: str = "DirectRunner",
                      beam_options: Union[str, Sequence[str]] = "", vocab_path: Optional[str] = None,
                      text_field: str = "text", errors: str = "strict", data_dir: Optional[str] = None,
                      skip_bad_lines: bool = False, work_dir: Optional[str] = None) -> splits_lib.Splits:
  """`splits.build_splits` on a Beam runner, reading the corpora itself.

  Args:
    train_corpus, valid_corpus: file pattern(s) / corpus spec(s) (see `beam_io.read_documents`).
    cfg: detection settings (`num_workers` is ignored: the runner decides).
    vocab_path: SentencePiece model for the exact-substring test (readable by the workers);
      None uses words.
    work_dir: where workers write the per-document result (default: the options'
      `temp_location`, else a local temporary folder, removed afterwards).

  Returns:
    `Splits`, equal to the local path's (timings aside).
  """
  cfg.validate()
  if not beam_io.is_beam(runner):
    raise ConfigError("build_splits_beam needs a Beam runner, not 'local'")
  beam = beam_io.import_beam()
  options = beam_io.pipeline_options(runner, beam_options)
  start = time.time()
  read = dict(text_field=text_field, errors=errors, data_dir=data_dir, skip_bad_lines=skip_bad_lines)
  with beam_io.output_dir(options, work_dir, "splits") as out_dir:
    p = beam.Pipeline(options=options)
    train = (beam_io.read_documents(p, train_corpus, label="train", **read)
             | "train refs" >> beam.Map(lambda kv: ((TRAIN, kv[0]), kv[1])))
    valid = (beam_io.read_documents(p, valid_corpus, label="valid", **read)
             | "valid refs" >> beam.Map(lambda kv: ((VALID, kv[0]), kv[1])))
    docs = (train, valid) | "all documents" >> beam.Flatten()
    texts = docs | "texts" >> beam.Map(lambda kv: (kv[0], kv[1][1]))
    train_texts = train | "train texts" >> beam.Map(lambda kv: (kv[0], kv[1][1]))

    # NearDup: MinHash LSH buckets -> ranked candidates -> edit similarity.
    cands = (texts
             | "batch" >> beam.BatchElements(min_batch_size=1, max_batch_size=64)
             | "band keys" >> beam.FlatMap(_band_keys, cfg)
             | "group bands" >> beam.GroupByKey()
             | "bucket pairs" >> beam.FlatMap(_bucket_pairs, cfg.max_candidates_per_doc)
             | "group queries" >> beam.GroupByKey()
             | "rank" >> beam.FlatMap(_ranked, cfg.max_candidates_per_doc))
    with_text = ({"cand": cands, "text": train_texts} | "join candidates" >> beam.CoGroupByKey()
                 | "candidate texts" >> beam.FlatMap(_attach_text))
    verified = ({"cand": with_text, "text": texts} | "join queries" >> beam.CoGroupByKey()
                | "verify" >> beam.FlatMap(_verify, cfg.min_edit_similarity).with_outputs("checked", main="near"))
    near = (verified.near | "distinct near" >> beam.Distinct()
            | "near flags" >> beam.Map(lambda r: (r, True)))
    (verified.checked | "sum checks" >> beam.CombineGlobally(sum)
     | "write checks" >> beam.io.WriteToText(out_dir + "/checked"))

    # ExactSubstr: shared windows of `exact_substring_tokens` tokens.
    if cfg.exact_substring_tokens:
      exact = (texts
               | "windows" >> beam.FlatMap(_windows, cfg.exact_substring_tokens, vocab_path)
               | "group windows" >> beam.GroupByKey()
               | "shared windows" >> beam.FlatMap(_shared_windows)
               | "distinct exact" >> beam.Distinct()
               | "exact flags" >> beam.Map(lambda r: (r, True)))
    else:
      exact = p | "no exact" >> beam.Create([])
    ids = docs | "ids" >> beam.Map(lambda kv: (kv[0], kv[1][0]))
    ({"id": ids, "near": near, "exact": exact} | "join flags" >> beam.CoGroupByKey()
     | "records" >> beam.Map(_record)
     | "write records" >> beam.io.WriteToText(out_dir + "/records"))
    beam_io.run_pipeline(p)
    records = list(beam_io.read_json_lines(out_dir + "/records"))
    checked = sum(int(c) for c in beam_io.read_json_lines(out_dir + "/checked"))
  return _assemble(records, checked, cfg, vocab_path, time.time() - start)


def _assemble(records, checked: int, cfg: splits_lib.SplitConfig, vocab_path: Optional[str],
              seconds: float) -> splits_lib.Splits:
  """Per-document records -> `Splits` with the ids in corpus order and the local path's stats."""
  by_side = {TRAIN: [], VALID: []}
  for side, order, doc_id, is_near, is_exact in records:
    by_side[side].append((order, doc_id, is_near, is_exact))
  for rows in by_side.values():
    rows.sort(key=lambda r: r[0])
  train, valid = by_side[TRAIN], by_side[VALID]
  ids = {
      "train_dup": [r[1] for r in train if r[2] or r[3]],
      "train_unique": [r[1] for r in train if not (r[2] or r[3])],
      "valid_in_train": [r[1] for r in valid if r[2] or r[3]],
      "valid_unique": [r[1] for r in valid if not (r[2] or r[3])],
  }
  stats = {
      "train_documents": len(train),
      "valid_documents": len(valid),
      "train_near_dup_minhash": sum(1 for r in train if r[2]),
      "train_exact_substring": sum(1 for r in train if r[3]),
      "valid_near_dup_minhash": sum(1 for r in valid if r[2]),
      "valid_exact_substring": sum(1 for r in valid if r[3]),
      "verified_pairs": checked,
      "exact_substring_unit": "tokens" if vocab_path else "words",
      "seconds": {"total": round(seconds, 2)},
  }
  logger.info("splits: %s", ", ".join(f"{k} {len(v)}" for k, v in ids.items()))
  return splits_lib.Splits(ids=ids, stats=stats)
