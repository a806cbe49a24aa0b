"""Token store and random-access examples on the real corpora in ../shared/data."""
import json
import os

import numpy as np
import pytest

from private_t5.data import source as source_lib
from private_t5.data import store as store_lib
from private_t5.errors import ConfigError, DataError
from private_t5.io import file_sha256
from private_t5 import vocabulary
from test_data_vocab import FORTUNES, LINUX_DOCS, small_vocab_path
from conftest import shared_or_fixture

# Documents read from the kernel docs (the repository's fixture has 130).
NUM_DOCS = 120

BATCH = 16


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory, shared_data):
  return small_vocab_path(tmp_path_factory, shared_data)


@pytest.fixture(scope="module")
def vocab(vocab_path):
  return vocabulary.load_vocabulary(vocab_path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("stores"))


@pytest.fixture(scope="module")
def linux_sources(shared_data, vocab_path, cache_dir):
  """Both objectives over NUM_DOCS kernel documents (long: windows are cut at random)."""
  corpus = shared_or_fixture(LINUX_DOCS)
  return {obj: source_lib.make_source(corpus, vocab_path, objective=obj, cache_dir=cache_dir, max_documents=NUM_DOCS,
                                      split="all")
          for obj in ("span_corruption", "prefix_lm")}


def _unmask(inputs, targets, vocab_size):
  """Rebuilds the raw window of a span-corruption example from its inputs and targets."""
  inputs = [int(t) for t in inputs if t > 1]
  targets = [int(t) for t in targets if t > 1]
  spans, current = {}, None
  for t in targets:
    if t >= vocab_size - vocabulary.NUM_EXTRA_IDS:
      current = t
      spans[current] = []
    else:
      spans[current].append(t)
  out = []
  for t in inputs:
    out.extend(spans[t] if t in spans else [t])
  return out


def _is_contiguous_subsequence(window, tokens):
  n = len(window)
  starts = np.flatnonzero(tokens[:len(tokens) - n + 1] == window[0]) if n else [0]
  return any(np.array_equal(tokens[s:s + n], window) for s in starts)


@pytest.mark.parametrize("objective", ["span_corruption", "prefix_lm"])
def test_shapes_and_padding_rows(linux_sources, objective):
  src = linux_sources[objective]
  assert src.feature_lengths == {"inputs": 512, "targets": 114}
  assert src.privacy_unit == "document" and src.num_examples == NUM_DOCS
  batch = src.get_batch([5, 0, NUM_DOCS - 1], seed=7, batch_size=BATCH)
  assert set(batch) == set(source_lib.BATCH_KEYS)
  assert batch["encoder_input_tokens"].shape == (BATCH, 512) and batch["encoder_input_tokens"].dtype == np.int32
  for key in ("decoder_input_tokens", "decoder_target_tokens"):
    assert batch[key].shape == (BATCH, 114) and batch[key].dtype == np.int32
  assert batch["decoder_loss_weights"].dtype == np.float32
  np.testing.assert_array_equal(batch["example_index"][:4], [5, 0, NUM_DOCS - 1, -1])
  np.testing.assert_array_equal(batch["is_padding"], np.arange(BATCH) >= 3)
  np.testing.assert_array_equal(batch["example_weight"], (np.arange(BATCH) < 3).astype(np.float32))
  for key in ("encoder_input_tokens", "decoder_target_tokens", "decoder_input_tokens", "decoder_loss_weights"):
    assert not batch[key][3:].any(), key
  # Targets shifted right with 0 first; loss on every real target token including EOS.
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 1:], batch["decoder_target_tokens"][:, :-1])
  assert not batch["decoder_input_tokens"][:, 0].any()
  np.testing.assert_array_equal(batch["decoder_loss_weights"], batch["decoder_target_tokens"] > 0)
  lengths = src.store.lengths()
  for row, index in enumerate([5, 0, NUM_DOCS - 1]):
    if lengths[index] >= src.objective.raw_length:  # a full window fills both sides exactly
      assert (batch["encoder_input_tokens"][row] > 0).sum() == 512
      assert (batch["decoder_target_tokens"][row] > 0).sum() == 114
      assert batch["encoder_input_tokens"][row, -1] == 1 and batch["decoder_target_tokens"][row, -1] == 1


def test_span_corruption_sentinels_decodable(linux_sources, vocab):
  src = linux_sources["span_corruption"]
  assert src.objective.raw_length == 568
  batch = src.get_batch(np.arange(8), seed=1, batch_size=8)
  for inputs, targets in zip(batch["encoder_input_tokens"], batch["decoder_target_tokens"]):
    sentinels_in = inputs[inputs >= vocab.vocab_size - vocabulary.NUM_EXTRA_IDS]
    sentinels_out = targets[targets >= vocab.vocab_size - vocabulary.NUM_EXTRA_IDS]
    assert len(sentinels_in) >= 1
    np.testing.assert_array_equal(sentinels_in, sentinels_out)  # same spans, same order
    np.testing.assert_array_equal(sentinels_in, vocab.vocab_size - 1 - np.arange(len(sentinels_in)))
    text = vocab.decode([int(t) for t in inputs if t > 1])
    assert "<extra_id_0>" in text
    assert vocab.decode([int(t) for t in targets if t > 1]).startswith("<extra_id_0>")


@pytest.mark.parametrize("objective", ["span_corruption", "prefix_lm"])
def test_document_mode_rows_come_from_one_document(linux_sources, objective):
  src = linux_sources[objective]
  indices = np.arange(0, NUM_DOCS, 13)
  batch = src.get_batch(indices, seed=3, batch_size=len(indices))
  assert src.document_ids(indices, seed=3) == [src.store.ids[i] for i in indices]
  vocab_size = src.objective.vocab_size
  for row, index in enumerate(indices):
    inputs, targets = batch["encoder_input_tokens"][row], batch["decoder_target_tokens"][row]
    if objective == "span_corruption":
      window = _unmask(inputs, targets, vocab_size)
    else:
      window = [int(t) for t in inputs if t > 1] + [int(t) for t in targets if t > 1]
    assert len(window) == min(src.objective.raw_length, src.store.lengths()[index])
    assert _is_contiguous_subsequence(np.asarray(window), np.asarray(src.store.document_tokens(index)))


def test_same_seed_same_batch_new_seed_new_noise(linux_sources):
  src = linux_sources["span_corruption"]
  indices = [3, 17, 42, 99]
  a = src.get_batch(indices, seed=11, batch_size=8)
  b = src.get_batch(indices, seed=11, batch_size=8)
  c = src.get_batch(indices, seed=12, batch_size=8)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])
  assert not np.array_equal(a["encoder_input_tokens"], c["encoder_input_tokens"])
  # An example's draw depends on (seed, index) only, not on the rest of the batch.
  d = src.get_batch([42], seed=11, batch_size=1)
  np.testing.assert_array_equal(d["encoder_input_tokens"][0], a["encoder_input_tokens"][2])
  # Same window of a short document, different noise mask: the mask is drawn fresh.
  short = int(np.argmin(src.store.lengths()))
  masks = {tuple(src.example(short, seed)[0]) for seed in range(6)}
  assert len(masks) > 1


def test_any_index_set(linux_sources):
  src = linux_sources["prefix_lm"]
  rng = np.random.default_rng(0)
  empty = src.get_batch([], seed=0, batch_size=4)
  assert empty["is_padding"].all() and (empty["example_index"] == -1).all() and not empty["example_weight"].any()
  full = src.get_batch(rng.permutation(NUM_DOCS)[:BATCH], seed=0, batch_size=BATCH)
  assert not full["is_padding"].any()
  with pytest.raises(ValueError, match="do not fit"):
    src.get_batch(np.arange(5), seed=0, batch_size=4)
  with pytest.raises(IndexError):
    src.get_batch([NUM_DOCS], seed=0, batch_size=4)


def test_example_mode_chunks_documents(shared_data, vocab_path, cache_dir):
  corpus = shared_or_fixture(LINUX_DOCS)
  src = source_lib.make_source(corpus, vocab_path, objective="prefix_lm", privacy_unit="example",
                               cache_dir=cache_dir, max_documents=NUM_DOCS, split="all")
  raw = src.objective.raw_length
  lengths = src.store.lengths()
  assert src.num_examples == int(np.maximum(1, -(-lengths // raw)).sum()) > NUM_DOCS
  assert src.describe()["privacy_unit"] == "example"
  groups = src.user_ids()
  assert len(groups) == src.num_examples and groups[-1] == NUM_DOCS - 1
  # Chunk 1 of document 0 is its tokens [raw, 2*raw): deterministic, whatever the seed.
  doc0_chunks = np.flatnonzero(groups == 0)
  if len(doc0_chunks) > 1:
    inputs, targets = src.example(int(doc0_chunks[1]), seed=5)
    np.testing.assert_array_equal(np.concatenate([inputs[:-1], targets[:-1]]),
                                  src.store.document_tokens(0)[raw:2 * raw])


@pytest.mark.parametrize("windows", [1, 3])
def test_grid_windows_train_what_the_memorization_prompts_see(shared_data, vocab_path, cache_dir, windows):
  corpus = shared_or_fixture(LINUX_DOCS)
  src = source_lib.make_source(corpus, vocab_path, objective="prefix_lm", cache_dir=cache_dir, max_documents=NUM_DOCS,
                               split="all", max_windows_per_document=windows)
  raw = src.objective.raw_length
  assert src.describe()["max_windows_per_document"] == windows
  lengths = src.store.lengths()
  long_docs = [i for i in range(NUM_DOCS) if lengths[i] >= 4 * raw][:10]
  assert long_docs
  for index in long_docs:
    tokens = np.asarray(src.store.document_tokens(index))
    starts = set()
    for seed in range(24):
      inputs, targets = src.example(index, seed)
      window = np.concatenate([inputs[:-1], targets[:-1]])
      # A full grid window: the document's tokens [k·raw, (k+1)·raw) for some k < windows.
      matches = [k for k in range(windows) if np.array_equal(tokens[k * raw:(k + 1) * raw], window)]
      assert len(window) == raw and matches
      starts.add(matches[0])
    # K = 1: every draw is the opening, whose first P tokens the memorization stage prompts with.
    assert starts == set(range(windows))
  # The default (None) starts anywhere: not on the grid for most long-document draws.
  free = source_lib.make_source(corpus, vocab_path, objective="prefix_lm", cache_dir=cache_dir,
                                max_documents=NUM_DOCS, split="all")
  assert "max_windows_per_document" not in free.describe()
  off_grid = 0
  for seed in range(8):
    inputs, _ = free.example(long_docs[0], seed)
    off_grid += not np.array_equal(inputs[:-1], np.asarray(free.store.document_tokens(long_docs[0]))[:len(inputs) - 1])
  assert off_grid > 0
  with pytest.raises(ConfigError, match="max_windows_per_document"):
    source_lib.make_source(corpus, vocab_path, objective="prefix_lm", cache_dir=cache_dir, max_documents=NUM_DOCS,
                           split="all", max_windows_per_document=0)
  with pytest.raises(ConfigError, match="document and user units"):
    source_lib.make_source(corpus, vocab_path, objective="prefix_lm", privacy_unit="example", cache_dir=cache_dir,
                           max_documents=NUM_DOCS, split="all", max_windows_per_document=1)


def test_user_mode_and_validation_split(tmp_path, vocab_path, cache_dir):
  corpus = tmp_path / "users.jsonl"
  with open(corpus, "w") as f:
    for i in range(60):
      record = {"id": f"d{i}", "author": f"u{i % 7}", "text": f"Message {i} written by user {i % 7}."}
      f.write(json.dumps(record) + "\n")
  src = source_lib.make_source(str(corpus), vocab_path, objective="prefix_lm", privacy_unit="user",
                               user_field="author", cache_dir=cache_dir, split="all")
  assert src.num_examples == 7 and src.describe()["num_users"] == 7
  np.testing.assert_array_equal(src.user_ids(), np.arange(7))
  drawn = {doc for seed in range(20) for doc in src.document_ids([0], seed)}
  # User 0 is "u0": documents d0, d7, d14, ...; a draw picks one of them at random.
  assert len(drawn) > 1 and all(int(d[1:]) % 7 == 0 for d in drawn)
  doc_mode = source_lib.make_source(str(corpus), vocab_path, objective="prefix_lm", user_field="author",
                                    cache_dir=cache_dir, split="all")
  assert doc_mode.num_examples == 60 and len(set(doc_mode.user_ids())) == 7
  kwargs = dict(objective="prefix_lm", cache_dir=cache_dir, validation_fraction=0.3)
  train = source_lib.make_source(str(corpus), vocab_path, split="train", **kwargs)
  val = source_lib.make_source(str(corpus), vocab_path, split="validation", **kwargs)
  train_ids = set(train.document_ids(range(train.num_examples), 0))
  val_ids = set(val.document_ids(range(val.num_examples), 0))
  assert not train_ids & val_ids and len(train_ids | val_ids) == 60 and 5 < len(val_ids) < 35
  with pytest.raises(ConfigError, match="user_field"):
    source_lib.make_source(str(corpus), vocab_path, privacy_unit="user", cache_dir=cache_dir)


def test_store_is_cached_by_content(shared_data, vocab_path, cache_dir, tmp_path):
  corpus = os.path.join(shared_data, FORTUNES)
  first = store_lib.build_store(corpus, vocab_path, cache_dir=cache_dir, max_documents=50)
  manifest = dict(first.manifest)
  assert manifest["num_documents"] == 50 and manifest["vocab_sha256"] == file_sha256(vocab_path)
  again = store_lib.build_store(corpus, vocab_path, cache_dir=cache_dir, max_documents=50)
  assert again.path == first.path and again.manifest["created"] == manifest["created"]
  other_vocab = tmp_path / "copy.model"
  data = open(vocab_path, "rb").read()
  other_vocab.write_bytes(data)
  assert store_lib.build_store(corpus, str(other_vocab), cache_dir=cache_dir, max_documents=50).path == first.path
  vocab = vocabulary.load_vocabulary(vocab_path)
  np.testing.assert_array_equal(first.document_tokens(3), vocab.encode(_fortune(corpus, 3)))


def _fortune(corpus, i):
  from private_t5.data import corpora  # pylint: disable=g-import-not-at-top
  docs, _ = corpora.read_corpus(corpus, max_documents=i + 1)
  return docs[i].text


def _leftovers(cache_dir):
  return [n for n in os.listdir(cache_dir) if n.startswith(".building-")]


def test_bad_inputs_give_clear_errors_and_leave_nothing(tmp_path, vocab_path, shared_data):
  cache = str(tmp_path / "cache")
  empty = tmp_path / "empty.txt"
  empty.write_text("\n   \n\n")
  bad_vocab = tmp_path / "bad.model"
  bad_vocab.write_bytes(b"\x00not a model")
  dup = tmp_path / "dup.jsonl"
  dup.write_text('{"id": "a", "text": "one"}\n{"id": "a", "text": "two"}\n')
  corpus = os.path.join(shared_data, FORTUNES)
  cases = [
      (dict(corpus=str(tmp_path / "missing.jsonl")), DataError, "not found"),
      (dict(corpus=str(empty)), DataError, "empty"),
      (dict(corpus=str(dup)), DataError, "duplicate document id 'a'"),
      (dict(corpus=corpus, vocab_path=str(bad_vocab)), DataError, "not a SentencePiece model"),
      (dict(corpus=corpus, feature_lengths={"inputs": 512, "targets": 0}), ConfigError, "positive"),
      (dict(corpus=corpus, feature_lengths={"inputs": 1, "targets": 114}), ConfigError, "inputs length >= 2"),
      (dict(corpus=corpus, feature_lengths={"inputs": 512, "targets": 100}), ConfigError, "targets length >= 114"),
      (dict(corpus=corpus, feature_lengths={"inputs": 512}), ConfigError, "feature_lengths"),
      (dict(corpus=corpus, objective="mlm"), ConfigError, "objective"),
      (dict(corpus=corpus, privacy_unit="batch"), ConfigError, "privacy_unit"),
      (dict(corpus=corpus, split="validation"), ConfigError, "validation_fraction"),
  ]
  for kwargs, error, message in cases:
    kwargs.setdefault("vocab_path", vocab_path)
    with pytest.raises(error, match=message):
      source_lib.make_source(cache_dir=cache, max_documents=20, **kwargs)
    assert not os.path.exists(cache), (kwargs, os.listdir(cache))  # not even an empty cache folder


def test_killed_cache_builds_are_removed_on_the_next_build(shared_data, vocab_path, tmp_path):
  import socket  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  cache = tmp_path / "cache"
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                        text=True, check=True)
  host = socket.gethostname()
  names = {"dead": f".building-{host}-{int(dead.stdout)}-abc12", "alive": f".building-{host}-{os.getpid()}-def34",
           "old": ".building-x7yq_2", "recent": ".building-k3j9p1", "other_host": ".building-elsewhere-1-abc"}
  for name in names.values():
    (cache / name).mkdir(parents=True)
    (cache / name / "tokens.bin").write_bytes(b"\0" * 1000)
  day_ago = time.time() - 2 * store_lib.STALE_BUILD_SECONDS
  os.utime(cache / names["old"], (day_ago, day_ago))
  store_lib.build_store(os.path.join(shared_data, FORTUNES), vocab_path, cache_dir=str(cache), max_documents=5)
  left = {n for n in os.listdir(cache) if n.startswith(".building-")}
  assert left == {names["alive"], names["recent"], names["other_host"]}


def test_lengths_are_read_a_block_at_a_time_in_any_order(linux_sources):
  # `lengths_of` (the example unit's chunks, a split's token count) reads ranges of offsets from
  # the files: the same lengths as the store's own, for sorted and unsorted indices, in blocks.
  store = linux_sources["prefix_lm"].store
  for docs in (np.array([3, 0, 2, 7, 5]), np.arange(store.num_documents)):
    got = np.full(len(docs), -1, dtype=np.int64)
    for positions, lengths in store.lengths_of(docs, block=2):
      got[positions] = lengths
    np.testing.assert_array_equal(got, store.lengths()[docs])
