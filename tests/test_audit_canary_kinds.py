"""The audit canaries' kinds: `rare_tokens` drawn from the corpus's least frequent SentencePiece
pieces and `rare_words` from its least frequent words (crafted canaries, Panda et al. 2025),
beside `words` and `tokens`; their pools, their draws, the record and `private-t5 canaries --audit`."""
import gzip
import json
import os

import numpy as np
import pytest

from private_t5.data import corpora
from private_t5.errors import ConfigError, DataError
from private_t5.eval import audit
from private_t5.stages import cli


class _WordTokenizer:
  """One piece a word: 0 <pad>, 1 </s>, 2 <unk>, 3 an unused piece, then w0 ... w199."""

  def __init__(self):
    self.pieces = ["<pad>", "</s>", "<unk>", "unused"] + [f"w{i}" for i in range(200)]
    self.ids = {p: i for i, p in enumerate(self.pieces)}
    self.batches = []

  def get_piece_size(self):
    return len(self.pieces)

  def is_control(self, i):
    return i in (0, 1)

  def is_unknown(self, i):
    return i == 2

  def is_byte(self, i):
    return False

  def is_unused(self, i):
    return i == 3

  def encode(self, texts):
    self.batches.append(len(texts))
    return [[self.ids.get(w, 2) for w in t.split()] for t in texts]

  def decode(self, ids):
    return " ".join(self.pieces[i] for i in ids)


class _WordVocab:

  def __init__(self):
    self.tokenizer = _WordTokenizer()


def _hand_made_corpus():
  """w_i occurs i + 1 times (w0 once, ..., w199 200 times), w20 as often as w19; the unused and the
  unknown pieces once, control pieces never; w200 is not in the vocabulary (unknown)."""
  words = [f"w{i}" for i in range(200) for _ in range(i + 1 if i != 20 else 20)] + ["unused", "w200"]
  rng = np.random.default_rng(0)
  rng.shuffle(words)
  return [" ".join(words[k:k + 50]) for k in range(0, len(words), 50)]


@pytest.fixture(name="spm_vocab", scope="module")
def _spm_vocab(tmp_path_factory, shared_data):
  from micro_run import fortunes_corpus_and_vocab
  from private_t5 import vocabulary
  _, path = fortunes_corpus_and_vocab(shared_data, str(tmp_path_factory.mktemp("vocab")))
  return path, vocabulary.load_vocabulary(path)


@pytest.fixture(name="small_corpus")
def _small_corpus(tmp_path, shared_data):
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  small = tmp_path / "small.jsonl"
  with gzip.open(src, "rt") as f:
    small.write_text("".join(next(f) for _ in range(300)))
  return str(small)


def test_the_rare_piece_pool_is_the_least_frequent_pieces_of_a_hand_made_corpus():
  vocab = _WordVocab()
  texts = _hand_made_corpus()
  read = []

  def stream():
    for t in texts:
      read.append(t)
      yield t

  counts = audit.piece_counts(stream(), vocab, batch_size=7)
  assert max(vocab.tokenizer.batches) == 7 and len(read) == len(texts)  # encoded a batch at a time
  assert counts[4:].tolist() == [i + 1 if i != 20 else 20 for i in range(200)]
  assert counts[2] == counts[3] == 1 and counts[0] == counts[1] == 0
  ids = lambda names: [vocab.tokenizer.ids[n] for n in names]
  # The rarest 10% of the 200 occurring ordinary pieces, at least 10: w0 ... w19, and w20 (tied with w19).
  assert audit.rare_pieces(counts, vocab, fraction=0.1, minimum=10) == ids(f"w{i}" for i in range(21))
  assert audit.rare_pieces(counts, vocab, fraction=0.05, minimum=5) == ids(f"w{i}" for i in range(10))
  # The default: at least 100 pieces; never the unknown, unused or control pieces, never a piece that does not occur.
  assert audit.rare_pieces(counts, vocab) == ids(f"w{i}" for i in range(100))
  counts[4:14] = 0
  assert audit.rare_pieces(counts, vocab, fraction=0.05, minimum=10) == ids(f"w{i}" for i in range(10, 21))
  with pytest.raises(DataError, match="the corpus has 190 distinct ordinary pieces of the vocabulary; rare-token "
                     "canaries need at least 200"):
    audit.rare_pieces(counts, vocab, minimum=200)
  # Words: the same rule on the corpus's word counts.
  words = audit.rare_words(audit.word_counts(["Alpha beta beta gamma gamma gamma", "delta delta delta delta"]),
                           fraction=0.25, minimum=2)
  assert words == ["alpha", "beta"]


def test_rare_token_canaries_on_a_sentencepiece_vocabulary(spm_vocab, shared_data):
  _, vocab = spm_vocab
  sp = vocab.tokenizer
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  texts = [d.text for d in corpora.iter_documents(src, max_documents=300)]
  counts = audit.piece_counts(iter(texts), vocab)
  assert counts.tolist() == np.bincount([i for t in texts for i in sp.encode(t)],
                                        minlength=sp.get_piece_size()).tolist()
  pool = audit.rare_pieces(counts, vocab)
  ordinary = set(audit.ordinary_pieces(vocab))
  rest = [i for i in ordinary - set(pool) if counts[i] > 0]
  assert len(pool) >= audit.MIN_POOL and set(pool) <= ordinary and counts[pool].min() >= 1
  assert counts[pool].max() < counts[rest].min()  # the least frequent pieces, ties kept together
  canaries = audit.make_texts("rare_tokens", 50, 8, seed=5, vocab=vocab, pieces=pool)
  assert len(set(canaries)) == 50 and all(canaries)
  assert canaries == audit.make_texts("rare_tokens", 50, 8, seed=5, vocab=vocab, pieces=pool)
  assert canaries != audit.make_texts("rare_tokens", 50, 8, seed=6, vocab=vocab, pieces=pool)
  assert canaries != audit.make_texts("tokens", 50, 8, seed=5, vocab=vocab)
  # What the model reads: the text encodes back mostly to pieces of the pool, and decodes to itself.
  encoded = [sp.encode(t) for t in canaries]
  assert all(sp.decode(ids) == t for ids, t in zip(encoded, canaries))
  assert np.mean([i in set(pool) for ids in encoded for i in ids]) > 0.8
  with pytest.raises(ConfigError, match="'rare_tokens' need a SentencePiece vocabulary"):
    audit.make_texts("rare_tokens", 5, 8, seed=5, pieces=pool)
  with pytest.raises(DataError, match="pool of rare pieces has 10 ordinary pieces; rare-token canaries need at least"):
    audit.make_texts("rare_tokens", 5, 8, seed=5, vocab=vocab, pieces=pool[:10])


def test_plant_records_the_kind_and_load_record_accepts_it(tmp_path, spm_vocab, small_corpus):
  _, vocab = spm_vocab
  open_docs = lambda: corpora.iter_documents(small_corpus)
  for kind in ("rare_tokens", "rare_words", "tokens", "words"):
    out = str(tmp_path / f"{kind}.jsonl")
    _, path, _, rec = audit.plant(open_docs, out, num_canaries=40, kind=kind, length=6, seed=3, vocab=vocab)
    again = audit.load_record(path)
    assert rec.kind == again.kind == kind and again.texts == rec.texts and len(set(rec.texts)) == 40
  words = audit.rare_words(audit.word_counts(d.text for d in open_docs()))
  assert all(w in words for t in audit.load_record(str(tmp_path / "rare_words.audit.json")).texts for w in t.split())
  with open(path, encoding="utf-8") as f:
    rec = json.load(f)
  (tmp_path / "bad.audit.json").write_text(json.dumps(dict(rec, canary_kind="chars")))
  with pytest.raises(DataError, match="'canary_kind' must be one of words, tokens, rare_tokens, rare_words"):
    audit.load_record(str(tmp_path / "bad.audit.json"))
  with pytest.raises(ConfigError, match="'rare_tokens' need a SentencePiece vocabulary"):
    audit.plant(open_docs, str(tmp_path / "x.jsonl"), num_canaries=40, kind="rare_tokens", seed=3)


def test_several_kinds_share_one_record_each_with_canaries_in_and_out(tmp_path, spm_vocab, small_corpus):
  _, vocab = spm_vocab
  open_docs = lambda: corpora.iter_documents(small_corpus)
  out = str(tmp_path / "two.jsonl")
  _, path, _, rec = audit.plant(open_docs, out, num_canaries=40, kind="words,rare_tokens", length=6, seed=3,
                                vocab=vocab)
  again = audit.load_record(path)
  assert again.kind == rec.kind == "words,rare_tokens" and again.kinds == ("words", "rare_tokens")
  assert again.canary_kinds == rec.canary_kinds == ("words", "rare_tokens") * 20  # in turn
  assert again.texts == rec.texts and len(set(rec.texts)) == 40
  kinds = np.asarray(rec.canary_kinds)
  for name in rec.kinds:
    bits = rec.included[kinds == name]
    assert 0 < bits.sum() < len(bits)
  # The words canaries are those a words-only record of the same seed draws first.
  _, _, _, words_only = audit.plant(open_docs, str(tmp_path / "w.jsonl"), num_canaries=20, kind="words", length=6,
                                    seed=3)
  assert [t for t, k in zip(rec.texts, rec.canary_kinds) if k == "words"] == words_only.texts
  with open(path, encoding="utf-8") as f:
    stored = json.load(f)
  stored["canaries"][1]["canary_kind"] = "tokens"
  (tmp_path / "bad.audit.json").write_text(json.dumps(stored))
  with pytest.raises(DataError, match="each canary needs a 'canary_kind' among words, rare_tokens"):
    audit.load_record(str(tmp_path / "bad.audit.json"))
  for bad in ("words,words", "words,", "words,chars"):
    with pytest.raises(ConfigError, match="or several of them distinct"):
      audit.plant(open_docs, str(tmp_path / "x.jsonl"), num_canaries=40, kind=bad, seed=3)


def test_canaries_cli_rare_kinds(tmp_path, spm_vocab, small_corpus, capsys):
  vocab_path, _ = spm_vocab
  out = tmp_path / "audit.jsonl"
  base = ["canaries", "--audit", "--num_canaries=40", "--canary_length=6", "--seed=3"]
  assert cli.main([*base, f"--corpus={small_corpus}", f"--output={out}", "--canary_kind=rare_tokens",
                   f"--vocab_path={vocab_path}"]) == 0
  rec = audit.load_record(audit.record_path(str(out)))
  assert rec.kind == "rare_tokens" and rec.num_canaries == 40
  assert len(out.read_text().splitlines()) == 300 + int(rec.included.sum())
  capsys.readouterr()
  tiny = tmp_path / "tiny.jsonl"
  tiny.write_text(json.dumps({"id": "a", "text": "just a few words here"}) + "\n")
  for bad, message in (([f"--corpus={small_corpus}", "--canary_kind=rare_tokens"],
                        "--canary_kind=rare_tokens needs --vocab_path"),
                       ([f"--corpus={tiny}", "--canary_kind=rare_tokens", f"--vocab_path={vocab_path}"],
                        "rare-token canaries need at least 100"),
                       ([f"--corpus={tiny}", "--canary_kind=rare_words"], "rare-word canaries need at least 100"),
                       ([f"--corpus={small_corpus}", "--canary_kind=rare"], "--canary_kind must be one of")):
    assert cli.main([*base, f"--output={tmp_path / 'b.jsonl'}", *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "b.jsonl").exists()
