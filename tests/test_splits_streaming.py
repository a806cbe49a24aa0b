"""The streaming split search (texts, band keys and window hashes on disk) against the in-memory
search it replaced, and the split file's formats."""
import collections
import gzip
import json
import logging
import os
import random
import socket
import subprocess
import sys
from typing import Dict

import numpy as np
import pytest

from private_t5.eval import split_search, splits
from private_t5.eval import near_dup
from private_t5.eval import split_types
from private_t5.eval import lsh_pairs
from private_t5.eval import split_files
from private_t5 import shingles
from conftest import shared_or_fixture

Doc = collections.namedtuple("Doc", "id text")


def _read(name, limit):
  out = []
  with gzip.open(shared_or_fixture(f"pretrain/{name}"), "rt", encoding="utf-8") as f:
    for line in f:
      d = json.loads(line)
      out.append(Doc(d["id"], d["text"]))
      if len(out) >= limit:
        break
  return out


# --- The in-memory search (all band keys of all documents grouped at once), for reference. ---

def _reference_within(keys, texts, threshold, k):
  n, bands = keys.shape
  found = np.zeros(n, dtype=bool)
  flat = keys.reshape(-1)
  docs = np.repeat(np.arange(n), bands)
  order = np.argsort(flat)
  flat, docs = flat[order], docs[order]
  starts = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
  ends = np.r_[starts[1:], len(flat)]
  shared: Dict[int, Dict[int, int]] = {}
  for s, e in zip(starts, ends):
    members = np.unique(docs[s:e])
    if len(members) < 2:
      continue
    for i, j in lsh_pairs.bucket_candidates(members.tolist(), k):
      shared.setdefault(i, {})
      shared[i][j] = shared[i].get(j, 0) + 1
  checked = 0
  for i in sorted(shared):
    for j in lsh_pairs.rank_candidates(shared[i], k):
      did, dup = near_dup.check_pair(near_dup.words(texts[i]), near_dup.words(texts[j]), threshold)
      checked += did
      if dup:
        found[i] = found[j] = True
        break
  return found, checked


def _reference_across(qkeys, ikeys, qtexts, itexts, threshold, k):
  found = np.zeros(qkeys.shape[0], dtype=bool)
  index = collections.defaultdict(list)
  for j, row in enumerate(ikeys):
    for key in row.tolist():
      index[key].append(j)
  checked = 0
  for i, row in enumerate(qkeys):
    parts = [index[key] for key in row.tolist() if key in index]
    if not parts:
      continue
    docs, counts = np.unique(np.concatenate(parts), return_counts=True)
    for j in docs[np.argsort(-counts, kind="stable")][:k]:
      did, dup = near_dup.check_pair(near_dup.words(qtexts[i]), near_dup.words(itexts[j]), threshold)
      checked += did
      if dup:
        found[i] = True
        break
  return found, checked


def _reference_exact(train, valid, window):
  tf, vf = np.zeros(len(train), bool), np.zeros(len(valid), bool)
  owners = collections.defaultdict(set)
  for i, t in enumerate(train):
    for h in shingles.window_hashes(near_dup.word_token_ids(t), window).tolist():
      owners[h].add(i)
  for ids in owners.values():
    if len(ids) > 1:
      tf[list(ids)] = True
  for i, t in enumerate(valid):
    vf[i] = any(h in owners for h in shingles.window_hashes(near_dup.word_token_ids(t), window).tolist())
  return tf, vf


def _reference(train_docs, valid_docs, cfg):
  tt, vt = [d.text for d in train_docs], [d.text for d in valid_docs]
  keys = near_dup.compute_band_keys(tt + vt, cfg)
  nt = len(tt)
  near_t, c1 = _reference_within(keys[:nt], tt, cfg.min_edit_similarity, cfg.max_candidates_per_doc)
  near_v, c2 = _reference_across(keys[nt:], keys[:nt], vt, tt, cfg.min_edit_similarity, cfg.max_candidates_per_doc)
  ex_t, ex_v = _reference_exact(tt, vt, cfg.exact_substring_tokens)
  return near_t | ex_t, near_v | ex_v, c1 + c2, near_t.sum(), ex_t.sum()


def _edit(text, rng, fraction=0.05):
  words = text.split()
  for _ in range(max(1, int(len(words) * fraction))):
    i = rng.randrange(len(words))
    words[i] = "EDITED" if rng.random() < 0.5 else words[i] + "s"
  return " ".join(words)


def _corpora():
  """Real text with natural duplicates (fortunes), planted near-copies and a 60-word quote."""
  rng = random.Random(0)
  fortunes = _read("fortunes.jsonl.gz", 1500)
  linux = [d for d in _read("linux_docs.jsonl.gz", 300) if 80 <= len(d.text.split()) <= 2000][:60]
  train = fortunes[:1300] + linux[:40] + [Doc(d.id + "#copy", _edit(d.text, rng)) for d in linux[:12]]
  train.append(Doc("quoting", " ".join(f"q{i}" for i in range(200)) + " " + " ".join(linux[20].text.split()[:60])))
  valid = fortunes[1300:] + linux[40:] + [Doc(d.id + "#valid", _edit(d.text, rng)) for d in linux[25:30]]
  return train, valid


@pytest.mark.parametrize("max_candidates", [50, 1])
def test_streaming_search_equals_the_in_memory_search(max_candidates):
  train, valid = _corpora()
  cfg = split_types.SplitConfig(num_perm=1280, num_bands=128, num_workers=1, max_candidates_per_doc=max_candidates)
  got = split_search.build_splits(train, valid, cfg)
  want_t, want_v, checked, near, exact = _reference(train, valid, cfg)
  assert want_t.sum() >= 25 and want_v.sum() >= 5 and exact >= 2  # the corpus exercises every path
  np.testing.assert_array_equal(got.train_dup, want_t)
  np.testing.assert_array_equal(got.valid_dup, want_v)
  assert got.stats["verified_pairs"] == checked
  assert got.stats["train_near_dup_minhash"] == near and got.stats["train_exact_substring"] == exact
  assert got.ids["train_dup"] == [d.id for d, f in zip(train, want_t) if f]
  assert "quoting" in got.ids["train_dup"]


def test_worker_processes_and_key_blocks_give_the_same_splits(monkeypatch):
  train, valid = _corpora()
  cfg = split_types.SplitConfig(num_perm=640, num_bands=64, num_workers=1)
  one = split_search.build_splits(train, valid, cfg)
  monkeypatch.setattr(split_search, "KEY_BLOCK", 100)  # many blocks, the last one partial
  two = split_search.build_splits_streaming(iter(train), iter(valid), split_types.SplitConfig(num_perm=640, num_bands=64,
                                                                                    num_workers=2))
  np.testing.assert_array_equal(one.train_dup, two.train_dup)
  np.testing.assert_array_equal(one.valid_dup, two.valid_dup)
  assert two.fingerprints == (split_files.corpus_fingerprint(train), split_files.corpus_fingerprint(valid))


def test_split_file_holds_a_bit_a_document_and_old_files_are_rebuilt(tmp_path, caplog):
  train, valid = _corpora()
  train, valid = train[:300], valid[:37]
  cfg = split_types.SplitConfig(num_perm=640, num_bands=64, num_workers=1)
  first, path, reused = splits.load_or_build_splits(str(tmp_path), train, valid, cfg)
  data = json.load(open(path))
  assert not reused and data["format"] == 2 and "splits" not in data
  assert data["flags"]["train"]["count"] == 300 and data["flags"]["valid"]["count"] == 37
  again, _, reused = splits.load_or_build_splits(str(tmp_path), train, valid, cfg)
  assert reused and again.ids == first.ids
  np.testing.assert_array_equal(again.valid_dup, first.valid_dup)
  assert list(again.indices("train_dup")) == [i for i, d in enumerate(train) if d.id in set(first.ids["train_dup"])]
  # A file of the previous format (id lists) under the same key is rebuilt, with one line saying so.
  old = {k: v for k, v in data.items() if k not in ("format", "flags")}
  old["splits"] = first.ids
  open(path, "w").write(json.dumps(old))
  with caplog.at_level(logging.INFO, logger="private_t5.eval.splits"):
    rebuilt, path2, reused = splits.load_or_build_splits(str(tmp_path), train, valid, cfg)
  assert not reused and path2 == path and rebuilt.ids == first.ids
  assert sum("older format" in r.getMessage() for r in caplog.records) == 1
  assert json.load(open(path))["format"] == 2


def test_beam_pipeline_on_several_files_and_a_folder_equals_the_local_search(tmp_path, monkeypatch):
  """Files (one of them blank) numbered in reading order, a folder streamed into the work folder,
  band and partition workers: the local path's flags and statistics."""
  monkeypatch.setattr(split_search, "KEY_BLOCK", 64)  # band keys in several blocks a file, the last partial
  from private_t5.data import corpora
  from private_t5.eval import splits_beam
  train, valid = _corpora()
  train, valid = train[:200] + train[1300:], valid[:30] + valid[-25:]
  parts = [train[:150], [], train[150:]]
  for k, part in enumerate(parts):
    with open(tmp_path / f"train-{k}.jsonl", "w", encoding="utf-8") as f:
      f.write("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in part) or "\n")
  folder = tmp_path / "valid"
  folder.mkdir()
  for k, d in enumerate(valid):
    (folder / f"{k:03d}.txt").write_text(d.text, encoding="utf-8")
  cfg = split_types.SplitConfig(num_perm=640, num_bands=64, num_workers=1)
  local_train = [d for k in range(3) for d in corpora.iter_documents(str(tmp_path / f"train-{k}.jsonl"),
                                                                       allow_empty=True)]
  local = split_search.build_splits(local_train, corpora.read_corpus(str(folder))[0], cfg)
  beam = splits_beam.build_splits_beam(str(tmp_path / "train-*.jsonl"), str(folder), cfg,
                                       work_dir=str(tmp_path / "work"))
  assert local.sizes()["train_dup"] >= 10 and local.sizes()["valid_in_train"] >= 3
  np.testing.assert_array_equal(beam.train_dup, local.train_dup)
  np.testing.assert_array_equal(beam.valid_dup, local.valid_dup)
  local.stats.pop("seconds"), beam.stats.pop("seconds")
  assert beam.stats == local.stats


def test_the_work_folders_of_killed_searches_are_removed_by_the_next_one(tmp_path):
  """A search's temporary folder is named after its process: a killed run's (its process gone) is
  removed when the next search starts; a running one's is kept; the search removes its own."""
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                        check=True).stdout.strip()
  host = socket.gethostname()
  killed = tmp_path / f"{split_search.WORK_DIR_PREFIX}{host}-{dead}-0a1b2c"
  running = tmp_path / f"{split_search.WORK_DIR_PREFIX}{host}-{os.getpid()}-3d4e5f"
  for folder in (killed, running):
    folder.mkdir()
    (folder / "texts.bin").write_bytes(b"x" * 1000)
  docs = [Doc(str(i), f"document number {i} with some words in it") for i in range(6)]
  cfg = split_types.SplitConfig(num_perm=8, num_bands=4, exact_substring_tokens=0, num_workers=1)
  split_search.build_splits_streaming(docs[:4], docs[4:], cfg, work_dir=str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == [running.name]
