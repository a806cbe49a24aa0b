"""The sharded token store: the Beam build equals the local build, reads across shards, the stage."""
import gzip
import hashlib
import json
import os

import numpy as np
import pytest

from private_t5.stages import cli
from private_t5.data import objectives
from private_t5.data import source as source_lib
from private_t5.data import store as store_lib
from private_t5.data import store_reader
from private_t5.data import store_files
from private_t5.data import store_beam
from private_t5.errors import DataError
from test_data_vocab import FORTUNES, small_vocab_path

TWO_WORKERS = "--direct_num_workers=2 --direct_running_mode=multi_processing"


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory, shared_data):
  return small_vocab_path(tmp_path_factory, shared_data)


def _fortunes(shared_data, limit):
  records = []
  with gzip.open(os.path.join(shared_data, FORTUNES), "rt", encoding="utf-8") as f:
    for line in f:
      records.append(json.loads(line))
      if len(records) >= limit:
        break
  return records


def _write_parts(folder, records, num_parts):
  """`records` split into `num_parts` files part-K.jsonl(.gz); one blank and one id-less document."""
  os.makedirs(folder, exist_ok=True)
  records = list(records)
  users = [{"user": r["user"]} if "user" in r else {} for r in records[1:3]]
  records[1] = {"text": records[1]["text"], **users[0]}  # id FILE:LINE
  records[2] = {"id": "blank", "text": "   ", **users[1]}
  size = -(-len(records) // num_parts)
  for k in range(num_parts):
    name = os.path.join(folder, f"part-{k}.jsonl" + (".gz" if k % 2 == 0 else ""))
    opener = gzip.open if name.endswith(".gz") else open
    with opener(name, "wt", encoding="utf-8") as f:
      for r in records[k * size:(k + 1) * size]:
        f.write(json.dumps(r) + "\n")
  return os.path.join(folder, "part-*")


def _assert_same_documents(a, b, indices):
  assert a.ids == b.ids and a.users == b.users and a.num_tokens == b.num_tokens
  np.testing.assert_array_equal(a.lengths(), b.lengths())
  for i in indices:
    np.testing.assert_array_equal(a.document_tokens(int(i)), b.document_tokens(int(i)))


@pytest.mark.slow
def test_beam_two_workers_equals_local(tmp_path, shared_data, vocab_path):
  pattern = _write_parts(str(tmp_path / "corpus"), _fortunes(shared_data, 900), 3)
  local = store_lib.build_store(pattern, vocab_path, cache_dir=str(tmp_path / "local"), progress=False)
  beam, counters = store_beam.build_store_beam(pattern, vocab_path, beam_options=TWO_WORKERS,
                                               cache_dir=str(tmp_path / "beam"))
  assert local.num_shards == 1 and beam.num_shards == 3
  assert os.path.basename(beam.path) == os.path.basename(local.path)  # the same cache key
  _assert_same_documents(beam, local, range(local.num_documents))
  assert "part-1.jsonl:1" not in local.ids and "blank" not in local.ids
  assert beam.manifest["blank_skipped"] == local.manifest["blank_skipped"] == 1
  assert counters["documents_tokenized"] == local.num_documents and counters["shards_written"] == 3


def test_two_shard_store_equals_one_shard_store(tmp_path, shared_data, vocab_path):
  pattern = _write_parts(str(tmp_path / "corpus"), _fortunes(shared_data, 300), 2)
  one = store_lib.build_store(pattern, vocab_path, cache_dir=str(tmp_path / "one"), progress=False)
  two, _ = store_beam.build_store_beam(pattern, vocab_path, cache_dir=str(tmp_path / "two"))
  assert two.num_shards == 2 and len(two.shard_starts) == 3
  assert os.path.isfile(os.path.join(two.path, "tokens-00001-of-00002.int32"))
  rng = np.random.default_rng(0)
  fresh = store_reader.DocumentStore(two.path)  # random reads before any global offsets are built
  indices = rng.integers(0, one.num_documents, size=200)
  for i in indices:
    np.testing.assert_array_equal(fresh.document_tokens(int(i)), one.document_tokens(int(i)))
    assert fresh.document_length(int(i)) == len(one.document_tokens(int(i)))
  assert fresh.shard_of(two.shard_starts[1]) == (1, 0)
  _assert_same_documents(two, one, [0, two.shard_starts[1] - 1, two.shard_starts[1], one.num_documents - 1])
  with pytest.raises(IndexError):
    two.document_tokens(one.num_documents)


def test_duplicate_ids_across_files_is_one_error(tmp_path, vocab_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "a.jsonl").write_text(json.dumps({"id": "x", "text": "one"}) + "\n")
  (corpus / "b.jsonl").write_text(json.dumps({"id": "y", "text": "two"}) + "\n" +
                                  json.dumps({"id": "x", "text": "three"}) + "\n")
  cache = tmp_path / "cache"
  with pytest.raises(DataError) as e:
    store_beam.build_store_beam(str(corpus / "*.jsonl"), vocab_path, cache_dir=str(cache))
  message = str(e.value)
  assert "duplicate document id 'x'" in message and "a.jsonl and " in message and "\n" not in message
  assert not os.path.exists(cache) or os.listdir(cache) == []  # nothing half-written (a cache folder it created is removed)
  with pytest.raises(DataError, match="duplicate document id 'x'"):
    store_lib.build_store(str(corpus / "*.jsonl"), vocab_path, cache_dir=str(cache), progress=False)
  with pytest.raises(DataError, match="matches no file"):
    store_beam.build_store_beam(str(corpus / "none-*.jsonl"), vocab_path, cache_dir=str(cache))


def _old_digest(store):
  """The tokens digest as version 2 computed it: tokens, lengths, then the JSON list of users."""
  h = hashlib.sha256()
  for k in range(store.num_shards):
    h.update(np.asarray(store._tokens_of(k)).tobytes())  # pylint: disable=protected-access
  h.update(np.asarray(store.lengths(), dtype="<i8").tobytes())
  h.update(json.dumps(None if store.users is None else list(store.users)).encode())
  return h.hexdigest()


@pytest.mark.parametrize("version", [1, 2])
def test_older_stores_still_open_as_the_same_documents(tmp_path, shared_data, vocab_path, version):
  records = [dict(r, user=f"user-{k % 7}") for k, r in enumerate(_fortunes(shared_data, 40))]
  pattern = _write_parts(str(tmp_path / "corpus"), records, 1)
  new = store_lib.build_store(pattern, vocab_path, cache_dir=str(tmp_path / "c"), progress=False, user_field="user")
  assert new.manifest["format_version"] == 3 and new.num_users == 7
  assert new.manifest["tokens_sha256"] == _old_digest(new)  # a run's fingerprint still matches
  old = tmp_path / "old"
  old.mkdir()
  tokens, offsets = store_files.shard_file_names(0, 1)
  names = (store_files.TOKENS_FILE, store_files.OFFSETS_FILE) if version == 1 else (tokens, offsets)
  os.link(os.path.join(new.path, tokens), old / names[0])
  os.link(os.path.join(new.path, offsets), old / names[1])
  (old / store_files.DOCUMENTS_FILE).write_text(json.dumps({"ids": list(new.ids), "users": list(new.users)}))
  manifest = dict(new.manifest, format_version=version)
  del manifest[store_files.CHECKSUMS_KEY]  # older stores were written without the record
  if version == 1:
    manifest = {k: v for k, v in manifest.items() if k not in ("shards", "shard_starts", "num_shards")}
  else:
    manifest["shards"] = [{k: sh[k] for k in ("tokens", "offsets", "documents", "num_tokens")}
                          for sh in manifest["shards"]]
  (old / store_files.MANIFEST_FILE).write_text(json.dumps(manifest))
  opened = store_reader.DocumentStore(str(old))
  _assert_same_documents(opened, new, range(new.num_documents))
  np.testing.assert_array_equal(opened.id_hashes(), new.id_hashes())
  np.testing.assert_array_equal(opened.user_index, new.user_index)
  assert opened.user_names == new.user_names
  # The same examples and split from either store.
  for split in ("train", "validation"):
    a, b = (source_lib.CorpusSource(st, objectives.make_objective(
        "prefix_lm", {"inputs": 16, "targets": 8}, 400), "user") for st in (opened, new))
    assert a.num_examples == b.num_examples == 7
    np.testing.assert_array_equal(a.user_ids(), b.user_ids())


def test_a_store_is_opened_without_reading_its_ids(tmp_path, shared_data, vocab_path, monkeypatch):
  # Opening a store and building a training source cost fixed-size arrays per document: no
  # documents.json, no string per document (ids and users are read on demand, for printing).
  records = [dict(r, user=f"user-{k % 5}") for k, r in enumerate(_fortunes(shared_data, 60))]
  pattern = _write_parts(str(tmp_path / "corpus"), records, 1)
  built = store_lib.build_store(pattern, vocab_path, cache_dir=str(tmp_path / "c"), progress=False, user_field="user")
  assert not os.path.exists(os.path.join(built.path, store_files.DOCUMENTS_FILE))
  from private_t5.data import store_index  # pylint: disable=g-import-not-at-top
  read = []
  original = store_index.StringColumn.__getitem__
  monkeypatch.setattr(store_index.StringColumn, "__getitem__", lambda self, i: read.append(i) or original(self, i))
  monkeypatch.setattr(json, "load", lambda f, **kw: (read.append(f.name), json.loads(f.read(), **kw))[1])
  for unit in ("document", "example", "user"):
    source = source_lib.make_source(pattern, vocab_path, feature_lengths={"inputs": 32, "targets": 8},
                                    privacy_unit=unit, split="train", validation_fraction=0.2,
                                    cache_dir=str(tmp_path / "c"), user_field="user", progress=False)
    source.get_batch(range(4), seed=0, batch_size=4)
    source.user_ids()
  assert read == [os.path.join(built.path, store_files.MANIFEST_FILE)] * 3  # the manifest, nothing else
  assert source.store.ids[2] == records[3]["id"] and source.store.users[2] == "user-3"  # the blank one is skipped
  expected = [i for i, doc_id in enumerate(built.ids) if not source_lib.in_validation(doc_id, 0.2)]
  np.testing.assert_array_equal(source_lib.make_source(
      pattern, vocab_path, split="train", validation_fraction=0.2, cache_dir=str(tmp_path / "c"),
      user_field="user", progress=False)._docs, expected)  # pylint: disable=protected-access


def test_store_stage_fills_the_training_cache(tmp_path, shared_data, vocab_path, capsys):
  pattern = _write_parts(str(tmp_path / "corpus"), _fortunes(shared_data, 120), 2)
  cache = str(tmp_path / "cache")
  assert cli.main(["store", f"--corpus={pattern}", f"--vocab_path={vocab_path}", f"--cache_dir={cache}",
                   "--runner=DirectRunner"]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["shards"] == 2 and not summary["reused"] and summary["mb_per_s"] > 0
  assert summary["counters"]["shards_written"] == 2
  # What training does (make_source -> build_store) finds the same entry.
  again = store_lib.build_store(pattern, vocab_path, cache_dir=cache)
  assert again.path == summary["path"] and again.num_documents == summary["documents"]
  source = source_lib.make_source(pattern, vocab_path, objective="prefix_lm", cache_dir=cache, split="all",
                                  feature_lengths={"inputs": 32, "targets": 16}, progress=False)
  assert source.store.path == summary["path"] and source.store.num_shards == 2
  batch = source.get_batch([0, again.shard_starts[1], again.num_documents - 1], seed=0, batch_size=4)
  assert batch["example_weight"].tolist() == [1, 1, 1, 0]
  assert cli.main(["store", f"--corpus={pattern}", f"--vocab_path={vocab_path}", f"--cache_dir={cache}"]) == 0
  assert json.loads(capsys.readouterr().out)["reused"]
  assert cli.main(["store", f"--corpus={pattern}", f"--vocab_path={vocab_path}", "--skip_bad_lines"]) == 2
  assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("cache", ["ro", "ro/new/cache"], ids=["existing", "missing"])
def test_store_read_only_cache_dir_is_one_line(tmp_path, shared_data, vocab_path, capsys, read_only, cache):
  pattern = _write_parts(str(tmp_path / "corpus"), _fortunes(shared_data, 20), 1)
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  cache = str(tmp_path / cache)
  assert cli.main(["store", f"--corpus={pattern}", f"--vocab_path={vocab_path}", f"--cache_dir={cache}"]) == 2
  assert capsys.readouterr().err == f"error: store cache_dir {cache!r} is not writable: Read-only file system\n"
  assert not os.listdir(tmp_path / "ro")


@pytest.mark.parametrize("cache", ["file", "file/cache"], ids=["is_a_file", "under_a_file"])
def test_store_cache_dir_that_is_a_file_is_named(tmp_path, shared_data, vocab_path, capsys, cache):
  """A regular file where the cache folder should be is named as such (not 'File exists')."""
  pattern = _write_parts(str(tmp_path / "corpus"), _fortunes(shared_data, 20), 1)
  (tmp_path / "file").write_text("")
  file, cache = str(tmp_path / "file"), str(tmp_path / cache)
  assert cli.main(["store", f"--corpus={pattern}", f"--vocab_path={vocab_path}", f"--cache_dir={cache}"]) == 2
  assert capsys.readouterr().err == (f"error: store cache_dir {cache!r} is not writable: {file!r} is a file, "
                                     "not a folder\n")


@pytest.mark.parametrize("options,reason", [
    ('--direct_num_workers="2', "No closing quotation"),
    ("--direct_num_workers=two", "argument --direct_num_workers: invalid int value: 'two'"),
], ids=["unbalanced_quote", "invalid_value"])
def test_store_bad_beam_options_are_one_line_and_leave_no_cache(tmp_path, shared_data, vocab_path, capsys,
                                                               options, reason):
  pattern = _write_parts(str(tmp_path / "corpus"), _fortunes(shared_data, 20), 1)
  cache = tmp_path / "cache"
  assert cli.main(["store", f"--corpus={pattern}", f"--vocab_path={vocab_path}", f"--cache_dir={cache}",
                   "--runner=DirectRunner", f"--beam_options={options}"]) == 2
  err = capsys.readouterr().err
  assert [l for l in err.splitlines() if l.startswith("error:")] == [f"error: --beam_options={options!r}: {reason}"]
  assert "usage:" not in err and not cache.exists()
