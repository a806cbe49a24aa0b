"""A cache entry is checked before it is reused: a truncated, missing or altered file is refused in
one line when training opens it, and rebuilt (said so in the log and the summary) by `private-t5
store`; the SHA-256 of the offsets and index is compared on open, and `--verify` compares the token
files' too; an entry written before the record is checked on what its offsets imply; a cache folder
inside an entry is refused."""
import json
import logging
import os

import pytest

from private_t5.data import store as store_lib
from private_t5.data import store_files
from private_t5.data import store_reader
from private_t5.stages import cli
from test_bad_inputs import files_under, one_error_line
from test_data_vocab import vocab_path  # pylint: disable=unused-import
from test_store_beam import _fortunes, _write_parts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_data):
  return _write_parts(str(tmp_path_factory.mktemp("integrity") / "corpus"), _fortunes(shared_data, 60), 1)


def _store(argv, capsys) -> dict:
  assert cli.main(["store", *argv]) == 0
  return json.loads(capsys.readouterr().out)


def _truncate(path, size):
  with open(path, "r+b") as f:
    f.truncate(size)


def test_a_truncated_entry_is_refused_for_training_and_rebuilt_by_the_stage(tmp_path, corpus, vocab_path, capsys,
                                                                           caplog):
  argv = [f"--corpus={corpus}", f"--vocab_path={vocab_path}", f"--cache_dir={tmp_path}/cache"]
  built = _store(argv, capsys)
  assert not built["reused"] and built["rebuilt"] is None
  record = store_reader.DocumentStore(built["path"]).manifest[store_files.CHECKSUMS_KEY]
  tokens = store_files.shard_file_names(0, 1)[0]
  assert set(record) == set(os.listdir(built["path"])) - {store_files.MANIFEST_FILE}
  size = record[tokens]["size"]
  _truncate(os.path.join(built["path"], tokens), size // 2)
  # Training opens the entry (store.build_store, as data.source does): one line naming the file.
  with pytest.raises(store_files.DamagedStoreError) as e:
    store_lib.build_store(corpus, vocab_path, cache_dir=str(tmp_path / "cache"), progress=False)
  assert str(e.value) == (f"store {built['path']} is damaged: {tokens} holds {size // 2} bytes, expected {size}; "
                          "run `private-t5 store` with the same settings to rebuild it (or delete that folder)")
  with caplog.at_level(logging.WARNING, logger="private_t5.data.store"):
    rebuilt = _store(argv, capsys)
  assert not rebuilt["reused"] and rebuilt["rebuilt"] == f"{tokens} holds {size // 2} bytes, expected {size}"
  assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
      f"[store] rebuilding the damaged entry {built['path']}: {rebuilt['rebuilt']}"]
  assert rebuilt["path"] == built["path"] and rebuilt["tokens"] == built["tokens"]
  assert sorted(os.listdir(tmp_path / "cache")) == [os.path.basename(built["path"])]  # nothing set aside left
  again = _store(argv, capsys)
  assert again["reused"] and again["rebuilt"] is None
  # A missing file: the same.
  os.remove(os.path.join(built["path"], tokens))
  assert _store(argv, capsys)["rebuilt"].endswith("is missing (expected %d bytes)" % size)


def test_verify_reads_the_token_files_and_rebuilds_an_altered_one(tmp_path, corpus, vocab_path, capsys):
  argv = [f"--corpus={corpus}", f"--vocab_path={vocab_path}", f"--cache_dir={tmp_path}/cache"]
  path = _store(argv, capsys)["path"]
  tokens = store_reader.DocumentStore(path).manifest["shards"][0]["tokens"]
  with open(os.path.join(path, tokens), "r+b") as f:  # one byte changed, the size kept
    first = f.read(1)
    f.seek(0)
    f.write(b"#" if first != b"#" else b"$")
  assert _store(argv, capsys)["reused"]  # the token files' sizes only: the cheap check on open
  verified = _store([*argv, "--verify"], capsys)
  assert not verified["reused"]
  assert verified["rebuilt"].startswith(f"{tokens} has the expected size") and "SHA-256" in verified["rebuilt"]
  assert _store([*argv, "--verify"], capsys)["reused"]
  # The index is compared without --verify (tests/test_store_damage.py: the offsets).
  ids = store_reader.DocumentStore(path).manifest["shards"][0]["ids"]
  with open(os.path.join(path, ids), "r+b") as f:
    first = f.read(1)
    f.seek(0)
    f.write(b"#" if first != b"#" else b"$")
  assert _store(argv, capsys)["rebuilt"].startswith(f"{ids} has the expected size")


def test_an_entry_without_the_record_is_checked_on_its_offsets(tmp_path, corpus, vocab_path, caplog):
  store = store_lib.build_store(corpus, vocab_path, cache_dir=str(tmp_path / "cache"), progress=False)
  manifest = dict(store.manifest)
  del manifest[store_files.CHECKSUMS_KEY]  # as an entry built before the record
  with open(os.path.join(store.path, store_files.MANIFEST_FILE), "w") as f:
    json.dump(manifest, f)
  assert store_reader.DocumentStore(store.path).num_tokens == store.num_tokens
  with caplog.at_level(logging.WARNING, logger="private_t5.data.store"):
    assert store_lib.build_store(corpus, vocab_path, cache_dir=str(tmp_path / "cache"), verify=True).reused
  assert "built without a checksums record: only the sizes its index implies were checked" in caplog.text
  tokens = store_files.shard_file_names(0, 1)[0]
  _truncate(os.path.join(store.path, tokens), 12)
  with pytest.raises(store_files.DamagedStoreError, match=f"{tokens} holds 12 bytes, expected {4 * store.num_tokens};"):
    store_reader.DocumentStore(store.path)


def test_a_cache_dir_inside_an_entry_is_refused(tmp_path, corpus, vocab_path, capsys):
  path = store_lib.build_store(corpus, vocab_path, cache_dir=str(tmp_path / "cache"), progress=False).path
  before = files_under(tmp_path)
  for inside in (path, os.path.join(path, "sub")):
    line = one_error_line(["store", f"--corpus={corpus}", f"--vocab_path={vocab_path}", f"--cache_dir={inside}"],
                          capsys)
    assert line == (f"error: store cache_dir {inside!r} is inside the store {path}; give the cache folder that "
                    f"holds it ({tmp_path / 'cache'})")
  assert files_under(tmp_path) == before


@pytest.mark.parametrize("flag", ["--max_documents=0", "--max_documents=-3"])
def test_a_count_that_is_not_positive_is_refused_as_such(tmp_path, corpus, vocab_path, capsys, flag):
  line = one_error_line(["store", f"--corpus={corpus}", f"--vocab_path={vocab_path}", f"--cache_dir={tmp_path}/c",
                         flag], capsys)
  assert line == f"error: --max_documents must be a positive integer (or None for all), got {flag.split('=')[1]}"
  assert files_under(tmp_path) == []
