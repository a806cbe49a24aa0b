"""The four memorization splits: planted near-duplicates, natural duplicates in fortunes, reuse."""
import collections
import gzip
import json
import os
import random

import numpy as np
import pytest

from private_t5.errors import ConfigError
from private_t5.eval import splits
from private_t5.eval import split_types
from private_t5.eval import split_search
from private_t5 import shingles
from private_t5.eval import near_dup
from conftest import shared_or_fixture

Doc = collections.namedtuple("Doc", "id text")
# Fast settings for tests: 1,280 permutations in 128 bands of 10 rows detect a pair of Jaccard
# similarity 0.8 with probability 1 - (1 - 0.8^10)^128 > 0.9999.
FAST = split_types.SplitConfig(num_perm=1280, num_bands=128, num_workers=1)


def _read(shared_data, name, limit=None):
  out = []
  with gzip.open(shared_or_fixture(f"pretrain/{name}"), "rt", encoding="utf-8") as f:
    for line in f:
      d = json.loads(line)
      out.append(Doc(d["id"], d["text"]))
      if limit and len(out) >= limit:
        break
  return out


def _edit(text, rng, fraction=0.03):
  """A near-duplicate: ~3% of the words replaced or deleted."""
  words = text.split()
  for _ in range(max(1, int(len(words) * fraction))):
    i = rng.randrange(len(words))
    if rng.random() < 0.5:
      words[i] = "EDITED"
    else:
      del words[i]
  return " ".join(words)


def test_window_hashes_find_shared_substrings_only():
  a = list(range(100))
  b = [1000 + i for i in range(30)] + list(range(40, 100))  # shares a 60-token run with a
  c = [2000 + i for i in range(100)]
  ha, hb, hc = (shingles.window_hashes(x, 50) for x in (a, b, c))
  assert len(ha) == 51 and len(hb) == 41
  assert len(np.intersect1d(ha, hb)) == 11  # windows starting at 40..50 of a
  assert len(np.intersect1d(ha, hc)) == 0
  assert shingles.window_hashes(list(range(49)), 50).size == 0
  # Identical windows give identical hashes wherever they occur.
  assert np.isin(shingles.window_hashes(a[10:60], 50), shingles.window_hashes([7] + a[10:60], 50)).all()


def test_edit_similarity_and_shingles():
  assert near_dup.edit_similarity("a b c d".split(), "a b x d".split()) == pytest.approx(0.75)
  assert near_dup.edit_similarity([], []) == 1.0
  assert near_dup.word_shingles("One two three", 5) == {"one two three"}
  assert len(near_dup.word_shingles("a b c d e f g", 5)) == 3


def test_config_is_validated():
  with pytest.raises(ConfigError, match="multiple of num_bands"):
    split_types.SplitConfig(num_perm=100, num_bands=30).validate()
  with pytest.raises(ConfigError, match="min_edit_similarity"):
    split_types.SplitConfig(min_edit_similarity=1.5).validate()


def test_planted_near_duplicates_are_found(shared_data):
  docs = _read(shared_data, "linux_docs.jsonl.gz", 400)
  docs = [d for d in docs if 80 <= len(d.text.split()) <= 3000][:160]
  base = split_search.build_splits(docs[:120], docs[120:], FAST)
  natural_train = set(base.ids["train_dup"])
  natural_valid = set(base.ids["valid_in_train"])

  rng = random.Random(0)
  planted = docs[:20]
  copies = [Doc(f"{d.id}#copy", _edit(d.text, rng)) for d in planted]
  # Validation: near-copies of 10 other training documents + the held-out documents.
  valid_copies = [Doc(f"{d.id}#valid", _edit(d.text, rng)) for d in docs[30:40]]
  result = split_search.build_splits(docs[:120] + copies, docs[120:] + valid_copies, FAST)
  flagged = set(result.ids["train_dup"])
  expected = {d.id for d in planted} | {d.id for d in copies}
  recall = len(flagged & expected) / len(expected)
  false_positives = flagged - expected - natural_train
  precision = len(flagged & (expected | natural_train)) / len(flagged)
  assert recall == 1.0, sorted(expected - flagged)
  assert precision == 1.0, sorted(false_positives)
  flagged_valid = set(result.ids["valid_in_train"])
  assert {d.id for d in valid_copies} <= flagged_valid
  assert flagged_valid - {d.id for d in valid_copies} <= natural_valid
  assert result.sizes()["train_dup"] + result.sizes()["train_unique"] == 140
  assert result.stats["train_near_dup_minhash"] >= 40


def test_exact_substring_of_50_tokens_marks_a_duplicate(shared_data):
  docs = [d for d in _read(shared_data, "linux_docs.jsonl.gz", 300) if len(d.text.split()) > 400][:30]
  base = split_search.build_splits(docs, [], FAST)
  # A new document that quotes 60 words of docs[0] inside 600 unrelated words: far from a
  # near-duplicate, but it shares a 50-word substring.
  quote = " ".join(docs[0].text.split()[100:160])
  filler = " ".join(docs[1].text.split()[:300]).replace("the", "a")
  other = " ".join(f"w{i}" for i in range(300))
  quoted = Doc("quoting", other + " " + quote + " " + filler[:50])
  result = split_search.build_splits(docs + [quoted], [], FAST)
  assert "quoting" in result.ids["train_dup"] and docs[0].id in result.ids["train_dup"]
  assert result.stats["train_exact_substring"] >= 2
  off = split_types.SplitConfig(num_perm=1280, num_bands=128, num_workers=1, exact_substring_tokens=0)
  assert "quoting" not in split_search.build_splits(docs + [quoted], [], off).ids["train_dup"]
  assert set(base.ids["train_dup"]) <= set(result.ids["train_dup"])


@pytest.mark.slow
def test_natural_duplicates_in_fortunes(shared_data):
  docs = _read(shared_data, "fortunes.jsonl.gz")
  cfg = split_types.SplitConfig(num_perm=1280, num_bands=128, num_workers=2)
  result = split_search.build_splits(docs, [], cfg)
  flagged = set(result.ids["train_dup"])
  # Recall on exact duplicates (same words after lower-casing): all of them.
  by_text = collections.defaultdict(list)
  for d in docs:
    by_text[" ".join(near_dup.words(d.text))].append(d.id)
  exact = {i for ids in by_text.values() if len(ids) > 1 for i in ids}
  assert len(exact) > 200
  assert exact <= flagged
  assert len(flagged) > len(exact)  # near-duplicates beyond the exact ones
  # Precision and recall against brute force on samples: a flagged document has a partner
  # with edit similarity >= 0.8 (or a shared 50-word run); an unflagged one has none.
  rng = random.Random(1)
  tokens = [near_dup.words(d.text) for d in docs]
  ids = [d.id for d in docs]
  index = {i: k for k, i in enumerate(ids)}

  def has_partner(k):
    a = tokens[k]
    for j, b in enumerate(tokens):
      if j != k and min(len(a), len(b)) >= 0.8 * max(len(a), len(b)) and \
          near_dup.edit_similarity(a, b) >= 0.8:
        return True
    return False

  flagged_sample = rng.sample(sorted(flagged - exact), 25)
  precision = np.mean([has_partner(index[i]) for i in flagged_sample])
  unflagged_sample = rng.sample(sorted(set(ids) - flagged), 60)
  missed = np.mean([has_partner(index[i]) for i in unflagged_sample])
  assert precision >= 0.9, precision
  assert missed <= 0.02, missed


def test_splits_are_written_and_reused(tmp_path, shared_data):
  docs = _read(shared_data, "fortunes.jsonl.gz", 300)
  train, valid = docs[:250], docs[250:]
  first, path, reused = splits.load_or_build_splits(str(tmp_path), train, valid, FAST)
  assert not reused and os.path.isfile(path)
  data = json.loads(open(path).read())
  assert data["sizes"] == first.sizes() and sum(first.sizes().values()) == 300
  again, path2, reused2 = splits.load_or_build_splits(str(tmp_path), train, valid, FAST)
  assert reused2 and path2 == path and again.ids == first.ids
  # Other settings or another corpus: another file.
  other_cfg = split_types.SplitConfig(num_perm=1280, num_bands=128, num_workers=1, ngram=3)
  _, path3, reused3 = splits.load_or_build_splits(str(tmp_path), train, valid, other_cfg)
  assert not reused3 and path3 != path
  _, path4, reused4 = splits.load_or_build_splits(str(tmp_path), train[:-1], valid, FAST)
  assert not reused4 and path4 != path


def test_empty_validation_corpus_gives_empty_splits_with_warning(shared_data):
  docs = _read(shared_data, "fortunes.jsonl.gz", 50)
  result = split_search.build_splits(docs, [], FAST)
  assert result.sizes()["valid_in_train"] == 0 and result.sizes()["valid_unique"] == 0
  warnings = split_types.check_nonempty(result)
  assert any("valid_unique" in w for w in warnings)
