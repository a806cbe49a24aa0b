"""`private-t5 canaries` reads its corpus, never holds it: the same records as the in-memory
insertion it replaced (same seed), on real text, for the plain and the `--audit` canaries."""
import gzip
import json
import os

import numpy as np
import pytest

from private_t5.errors import DataError
from private_t5.eval import canaries as canaries_lib


def _in_memory_insertion(documents, canaries, seed):
  """The insertion as it was: every document in a list, a position drawn for each copy."""
  docs = [{"id": d.id, "text": d.text} for d in documents]
  copies = [{"id": f"{c.id}/copy-{r}", "text": c.text} for c in canaries for r in range(c.repetitions)]
  rng = np.random.default_rng([seed, 1])
  positions = rng.integers(0, len(docs) + 1, size=len(copies))
  order = np.argsort(positions, kind="stable")
  c = 0
  for i in range(len(docs) + 1):
    while c < len(order) and positions[order[c]] == i:
      yield copies[order[c]]
      c += 1
    if i < len(docs):
      yield docs[i]


def _rows(path):
  with (gzip.open(path, "rt") if path.endswith(".gz") else open(path, encoding="utf-8")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(name="corpus")
def _corpus(tmp_path, shared_data):
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  small = tmp_path / "small.jsonl"
  with gzip.open(src, "rt") as f:
    small.write_text("".join(next(f) for _ in range(300)))
  return str(small)


def test_plain_cli_writes_what_the_in_memory_insertion_wrote(tmp_path, corpus):
  from private_t5.data import corpora
  from private_t5.stages import cli
  out = str(tmp_path / "with.jsonl.gz")
  assert cli.main(["canaries", f"--corpus={corpus}", f"--output={out}", "--repetitions=1,10,50",
                   "--per_repetition=2", "--seed=7"]) == 0
  fmt, cans = canaries_lib.load_canaries(canaries_lib.record_path(out))
  expected = list(_in_memory_insertion(corpora.iter_documents(corpus), cans, seed=7))
  assert _rows(out) == expected and len(expected) == 300 + 2 * 61
  again, _ = canaries_lib.make_canaries(fmt, (1, 10, 50), per_repetition=2, num_reference=1, seed=7)
  assert again == cans


def test_audit_cli_writes_what_the_in_memory_planting_wrote(tmp_path, corpus):
  from private_t5.data import corpora
  from private_t5.eval import audit
  from private_t5.stages import cli
  out = str(tmp_path / "audit.jsonl")
  assert cli.main(["canaries", "--audit", f"--corpus={corpus}", f"--output={out}", "--num_canaries=50",
                   "--canary_length=5", "--repetitions=3", "--seed=11"]) == 0
  rec = audit.load_record(audit.record_path(out))
  docs = list(corpora.iter_documents(corpus))
  assert rec.texts == audit.make_texts("words", 50, 5, 11, words=audit.corpus_words(d.text for d in docs))
  planted = [canaries_lib.Canary(id=f"audit-{k}", secret="", text=t, repetitions=3 if inc else 0)
             for k, (t, inc) in enumerate(zip(rec.texts, rec.included))]
  assert _rows(out) == list(_in_memory_insertion(docs, planted, rec.seed))


def test_a_corpus_function_is_read_one_document_at_a_time(corpus):
  from private_t5.data import corpora
  cans, seed = canaries_lib.make_canaries(canaries_lib.CanaryFormat(), (1, 10, 100), seed=3)
  progress = {"read": 0, "opened": 0}

  def open_docs():
    progress["opened"] += 1
    for d in corpora.iter_documents(corpus):
      progress["read"] += 1
      yield d

  n = canaries_lib.count_documents(open_docs)
  progress["read"] = 0
  rows = canaries_lib.insert_canaries(open_docs, cans, seed, num_documents=n)
  for k, row in enumerate(rows, 1):
    assert progress["read"] <= k  # nothing read ahead of what was yielded
  assert progress["opened"] == 2 and k == n + 111
  # The count is taken in a first pass when not given; a sequence gives the same records.
  docs = list(corpora.iter_documents(corpus))
  assert list(canaries_lib.insert_canaries(open_docs, cans, seed)) == list(canaries_lib.insert_canaries(docs, cans, seed))


def test_a_corpus_that_changes_between_the_passes_is_refused(corpus):
  from private_t5.data import corpora
  cans, seed = canaries_lib.make_canaries(canaries_lib.CanaryFormat(), (2,), seed=3)
  open_docs = lambda: corpora.iter_documents(corpus)
  with pytest.raises(DataError, match="changed while it was read: 301 documents counted, 300 read"):
    list(canaries_lib.insert_canaries(open_docs, cans, seed, num_documents=301))
