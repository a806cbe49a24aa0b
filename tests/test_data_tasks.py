"""seqio Tasks built from t5.data.preprocessors, on real kernel documentation."""
import os

import numpy as np
import pytest

from private_t5.data import corpora
from private_t5.data import tasks
from private_t5.errors import ConfigError
from private_t5.tokenizer import spm as spm_lib
from test_data_vocab import LINUX_DOCS, small_vocab_path
from conftest import shared_or_fixture

LENGTHS = {"inputs": 512, "targets": 114}


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory, shared_data):
  return small_vocab_path(tmp_path_factory, shared_data)


def _examples(task, split="train", seed=1):
  ds = task.get_dataset(sequence_length=LENGTHS, split=split, shuffle=False, seed=seed)
  return list(ds.as_numpy_iterator())


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["span_corruption", "prefix_lm"])
def test_document_mode_one_example_per_document(shared_data, vocab_path, objective):
  corpus = shared_or_fixture(LINUX_DOCS)
  task = tasks.register_pretrain_task(f"test_{objective}", corpus, vocab_path, objective, LENGTHS, "document",
                                      max_documents=12)
  docs, _ = corpora.read_corpus(corpus, max_documents=12)
  examples = _examples(task)
  assert [e["id"].decode() for e in examples] == [d.id for d in docs]
  vocab = spm_lib.load_vocabulary(vocab_path)
  for ex, doc in zip(examples, docs):
    assert 1 <= len(ex["inputs"]) <= 512 and 2 <= len(ex["targets"]) <= 114
    assert ex["inputs"][-1] == ex["targets"][-1] == 1
    doc_len = len(vocab.encode(doc.text))
    if doc_len >= 624:
      assert (len(ex["inputs"]), len(ex["targets"])) == (512, 114)
    if objective == "span_corruption":
      sentinels = ex["inputs"][ex["inputs"] >= vocab.vocab_size - 100]
      assert len(sentinels) and sentinels[0] == vocab.vocab_size - 1
      np.testing.assert_array_equal(sentinels, ex["targets"][ex["targets"] >= vocab.vocab_size - 100])
  # A new seed draws a new noise mask / window.
  again = _examples(task, seed=2)
  assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(examples, again))


@pytest.mark.slow
def test_example_mode_and_splits(shared_data, vocab_path):
  corpus = shared_or_fixture(LINUX_DOCS)
  task = tasks.register_pretrain_task("test_chunks", corpus, vocab_path, "prefix_lm", LENGTHS, "example",
                                      max_documents=6, validation_fraction=0.5)
  train, val = _examples(task, "train"), _examples(task, "validation")
  train_ids = {e["id"] for e in train}
  val_ids = {e["id"] for e in val}
  assert len(train) > len(train_ids)  # long documents give several chunks
  assert not train_ids & val_ids and len(train_ids | val_ids) == 6


def test_user_unit_is_refused(shared_data, tmp_path):
  with pytest.raises(ConfigError, match="make_source"):
    tasks.register_pretrain_task("test_users", shared_or_fixture(LINUX_DOCS), str(tmp_path / "v.model"),
                                 privacy_unit="user")
