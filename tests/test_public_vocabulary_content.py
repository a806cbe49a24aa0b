"""A DP vocabulary declared public (VOCAB_IS_PUBLIC) is checked against the training documents by content.

One tiny dp-spm vocabulary is built per module from the first fortunes; training corpora made of
its documents in another file (re-compressed, decompressed, a subset, a superset re-ordered, a
seqio Task over them) compose its ε, exactly as without the declaration; a disjoint corpus keeps
it public; an overlap that cannot be checked is refused in one line unless overridden; and
nothing released (the report, the model) holds the key or a fingerprint.
"""
import gzip
import json
import os
import random
import stat
import types

import pytest

from private_t5 import doc_fingerprints
from private_t5.data import source as source_lib
from private_t5.dp.mechanism import DPConfig, ExecutionSettings, build_mechanism
from private_t5.errors import PrivacyError
from private_t5.tokenizer import dp_spm
from private_t5.tokenizer import public_declaration

from conftest import shared_or_fixture

VOCAB_DOCS, OTHER_DOCS = 120, 60
PUBLIC = DPConfig(noise_multiplier=1.0, expected_batch_size=4, vocab_is_public=True)
PRIVATE = DPConfig(noise_multiplier=1.0, expected_batch_size=4)


def _texts():
  with gzip.open(shared_or_fixture("pretrain/fortunes.jsonl.gz"), "rt", encoding="utf-8") as f:
    return [json.loads(line)["text"] for _, line in zip(range(VOCAB_DOCS + OTHER_DOCS), f)]


def _write_jsonl(path, texts, trailing=""):
  data = "".join(json.dumps({"text": t}) + "\n" for t in texts) + trailing
  if str(path).endswith(".gz"):
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
      f.write(data)
  else:
    path.write_text(data, encoding="utf-8")
  return str(path)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """(folder, vocabulary, its report, the vocabulary's texts, other texts)."""
  root = tmp_path_factory.mktemp("public_vocabulary")
  texts = _texts()
  corpus = _write_jsonl(root / "vocab_docs.jsonl.gz", texts[:VOCAB_DOCS])
  vocab = str(root / "vocab" / "spm.model")
  report = dp_spm.train_dp_vocabulary(corpus, vocab, vocab_size=400, delta=1e-4, target_epsilon=5.0,
                                      max_words_per_document=16, insecure_seed=3, num_workers=1,
                                      eval_documents=0, verbose=False)
  return root, vocab, report, texts[:VOCAB_DOCS], texts[VOCAB_DOCS:]


def _store_source(root, corpus, vocab, **kwargs):
  return source_lib.make_source(corpus, vocab, cache_dir=str(root / "cache"), progress=False,
                                feature_lengths={"inputs": 32, "targets": 8}, **kwargs)


def _run(dp, vocab, train_data, unit="document", allow_unchecked=False, log=None):
  """What `train.main.train` does with the declaration: check it, build the mechanism, confirm."""
  log = log if log is not None else (lambda _: None)
  declaration = public_declaration.check_declaration(dp, vocab, train_data, allow_unchecked=allow_unchecked, log=log)
  setup = build_mechanism(declaration.dp, ExecutionSettings(), loss_fn=lambda *a: 0.0, num_examples=1000,
                          privacy_unit=unit, batch_size=32, train_steps=10, sampler_seed=3, vocab_path=vocab, log=log)
  declaration.confirm(setup.ledger)
  setup.ledger.record_steps(10)
  return setup.ledger


def _composed(vocab):
  return _run(PRIVATE, vocab, None).total_epsilon()


def _seqio_description(name):
  return types.SimpleNamespace(describe=lambda: {"corpus": f"seqio:{name}", "tasks": [name], "split": "train"})


def test_the_vocabularys_documents_in_any_file_compose_its_epsilon(built, tmp_path):
  root, vocab, report, mine, others = built
  expected = _composed(vocab)
  ledger = _run(PRIVATE, vocab, None)
  # The composition without the declaration: more than training's ε, at most the sum of the two.
  assert ledger.vocabulary_status() == "dp"
  assert ledger.training_epsilon() < expected <= ledger.training_epsilon() + report["epsilon"] + 1e-9
  shuffled = mine + others
  random.Random(0).shuffle(shuffled)
  corpora = {
      "re-compressed": _write_jsonl(tmp_path / "recompressed.jsonl.gz", mine),
      "decompressed, trailing newline": _write_jsonl(tmp_path / "plain.jsonl", mine, trailing="\n"),
      "subset": _write_jsonl(tmp_path / "subset.jsonl", mine[:25]),
      "superset, re-ordered": _write_jsonl(tmp_path / "superset.jsonl.gz", shuffled),
  }
  overlaps = {"subset": 25}
  for what, corpus in corpora.items():
    logs = []
    ledger = _run(PUBLIC, vocab, _store_source(root, corpus, vocab), log=logs.append)
    assert ledger.vocabulary_status() == "dp", what
    assert ledger.total_epsilon() == pytest.approx(expected), what
    n = overlaps.get(what, VOCAB_DOCS)
    m = VOCAB_DOCS + OTHER_DOCS if "superset" in what else n
    assert any(f"{n} of {m} training documents are documents the vocabulary" in line and "its ε is composed" in line
               for line in logs), (what, logs)
  # Only the training split counts: the documents of the validation split are not trained on.
  split = _store_source(root, corpora["subset"], vocab, validation_fraction=0.5)
  declaration = public_declaration.check_declaration(PUBLIC, vocab, split, log=lambda _: None)
  assert declaration.documents == split.describe()["num_documents"]
  assert 0 < declaration.documents < 25 and declaration.overlap == declaration.documents


def test_a_seqio_task_over_the_vocabularys_documents_composes_its_epsilon(built, tmp_path):
  pytest.importorskip("seqio")
  pytest.importorskip("t5")
  import seqio_tasks  # pylint: disable=g-import-not-at-top
  root, vocab, _, mine, others = built
  lines = _write_jsonl(tmp_path / "task.jsonl", others[:10] + mine[:30])
  seqio_tasks.register_text_file(lines, vocab, name="test_public_vocabulary_task")
  logs = []
  ledger = _run(PUBLIC, vocab, _seqio_description("test_public_vocabulary_task"), log=logs.append)
  assert ledger.vocabulary_status() == "dp" and ledger.total_epsilon() == pytest.approx(_composed(vocab))
  assert any("30 of 40 training documents" in line for line in logs)
  # A Task whose source cannot be read: refused in one line, unless the user accepts it unchecked.
  seqio_tasks.register(_write_jsonl(tmp_path / "fortunes.jsonl", others), vocab)
  broken = _seqio_description(seqio_tasks.BROKEN_SOURCE_TASK)
  with pytest.raises(PrivacyError) as error:
    _run(PUBLIC, vocab, broken)
  assert "cannot be checked: the training documents cannot be read" in str(error.value)
  assert "\n" not in str(error.value) and "VOCAB_PUBLIC_UNCHECKED=True" in str(error.value)
  logs = []
  ledger = _run(PUBLIC, vocab, broken, allow_unchecked=True, log=logs.append)
  assert ledger.vocabulary_status() == "public"
  assert ledger.components[0]["public_check"].startswith("NOT checked against the training documents")
  assert any("WARNING" in line and "VOCAB_PUBLIC_UNCHECKED=True" in line for line in logs)


def test_a_disjoint_corpus_keeps_the_vocabulary_public(built, tmp_path):
  root, vocab, _, _, others = built
  logs = []
  ledger = _run(PUBLIC, vocab, _store_source(root, _write_jsonl(tmp_path / "other.jsonl", others), vocab),
                log=logs.append)
  assert ledger.vocabulary_status() == "public"
  assert ledger.total_epsilon() == pytest.approx(ledger.training_epsilon())
  check = ledger.components[0]["public_check"]
  assert check.startswith(f"checked by content: none of the {OTHER_DOCS} training documents is one of the "
                          f"{VOCAB_DOCS} documents")
  assert any(check.split(";")[0] in line for line in logs)


def test_an_overlap_that_cannot_be_checked_is_refused_unless_overridden(built, tmp_path):
  root, vocab, report, _, others = built
  source = _store_source(root, _write_jsonl(tmp_path / "other.jsonl", others), vocab)
  # An older DP vocabulary: its report records no fingerprints.
  old = tmp_path / "old"
  old.mkdir()
  old_vocab = old / "spm.model"
  old_vocab.write_bytes(open(vocab, "rb").read())
  on_disk = json.load(open(report["report_path"]))
  (old / "privacy_report.json").write_text(json.dumps({k: v for k, v in on_disk.items()
                                                      if k != "document_fingerprints"}))
  with pytest.raises(PrivacyError, match=r"cannot be checked: its DP-SentencePiece report .* records no document "
                     r"fingerprints .*VOCAB_PUBLIC_UNCHECKED=True"):
    _run(PUBLIC, str(old_vocab), source)
  assert _run(PUBLIC, str(old_vocab), source, allow_unchecked=True).vocabulary_status() == "public"
  # The fingerprints or their key gone, or a key of another vocabulary beside them.
  (old / "privacy_report.json").write_text(json.dumps(on_disk))
  with pytest.raises(PrivacyError, match=r"cannot be checked: the fingerprints of the documents .* are not beside it"):
    _run(PUBLIC, str(old_vocab), source)
  for name in ("doc_fingerprints.npy", "fingerprint_key"):
    (old / f"spm.model.{name}").write_bytes(open(f"{vocab}.{name}", "rb").read())
  assert _run(PUBLIC, str(old_vocab), source).vocabulary_status() == "public"
  doc_fingerprints.write_key(str(old / "spm.model.fingerprint_key"), doc_fingerprints.new_key())
  with pytest.raises(PrivacyError, match="is not the key its document fingerprints were made with"):
    _run(PUBLIC, str(old_vocab), source)
  # A source whose documents cannot be read here.
  unknown = types.SimpleNamespace(describe=lambda: {"corpus": "somewhere:else"})
  with pytest.raises(PrivacyError, match="the documents of somewhere:else cannot be read for this check"):
    _run(PUBLIC, vocab, unknown)


def test_a_shared_document_that_cannot_be_composed_is_refused(built, tmp_path):
  root, vocab, _, mine, _ = built
  source = _store_source(root, _write_jsonl(tmp_path / "mine.jsonl", mine[:5]), vocab)
  with pytest.raises(PrivacyError, match="is document-level DP but training is user-level"):
    _run(PUBLIC, vocab, source, unit="user")


def test_nothing_released_holds_the_key_or_a_fingerprint(built):
  _, vocab, report, mine, _ = built
  key_file = doc_fingerprints.key_path(vocab)
  assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
  assert stat.S_IMODE(os.stat(doc_fingerprints.fingerprints_path(vocab)).st_mode) == 0o600
  key = open(key_file, "rb").read()
  values = doc_fingerprints.load(doc_fingerprints.fingerprints_path(vocab))
  assert len(values) == VOCAB_DOCS and doc_fingerprints.fingerprint(mine[0], key) in set(values.tolist())
  released = {"report": open(report["report_path"], "rb").read(), "model": open(vocab, "rb").read()}
  for name, data in released.items():
    assert key not in data and key.hex().encode() not in data, name
    for text in mine[:20]:
      value = doc_fingerprints.fingerprint(text, key)
      for form in (value.to_bytes(8, "little"), value.to_bytes(8, "big"), b"%016x" % value, str(value).encode()):
        assert form not in data, name
  recorded = json.loads(released["report"])["document_fingerprints"]
  assert set(recorded) == {"file", "sha256", "scheme", "key_file", "key_check", "note"}
  assert recorded["file"] == os.path.basename(doc_fingerprints.fingerprints_path(vocab))
  # The same documents are the same whatever the file's line endings, spacing or normal form.
  assert doc_fingerprints.fingerprint("caf\u00e9  au\r\nlait \n", key) == doc_fingerprints.fingerprint(
      "cafe\u0301 au lait", key)


def test_beam_fingerprints_the_documents_as_the_local_pass_does(built, tmp_path):
  pytest.importorskip("apache_beam")
  from private_t5.tokenizer import dp_spm_beam  # pylint: disable=g-import-not-at-top
  _, _, _, mine, _ = built
  corpus = _write_jsonl(tmp_path / "docs.jsonl", mine[:40])
  key = doc_fingerprints.new_key()
  on_beam, local = doc_fingerprints.FingerprintWriter(key), doc_fingerprints.FingerprintWriter(key)
  dp_spm_beam.beam_histogram(corpus, dp_spm.ContributionBound(), fingerprints=on_beam)
  dp_spm.build_histogram(mine[:40], dp_spm.ContributionBound(), num_workers=1, fingerprints=local)
  on_beam.write(str(tmp_path / "beam.npy"))
  local.write(str(tmp_path / "local.npy"))
  assert doc_fingerprints.load(str(tmp_path / "beam.npy")).tolist() == doc_fingerprints.load(
      str(tmp_path / "local.npy")).tolist()
  assert on_beam.count == 40


def test_glue_style_examples_are_checked_by_their_input_text(built):
  _, vocab, _, mine, others = built
  examples = lambda texts: types.SimpleNamespace(describe=lambda: {"corpus": "glue:x"}, inputs_text=list(texts))
  logs = []
  assert _run(PUBLIC, vocab, examples(others[:5] + mine[:2]), log=logs.append).vocabulary_status() == "dp"
  assert any("2 of 7 training documents" in line for line in logs)
  assert _run(PUBLIC, vocab, examples(others[:5])).vocabulary_status() == "public"
