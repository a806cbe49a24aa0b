"""A DP vocabulary declared public (VOCAB_IS_PUBLIC) is checked against the training documents by content.

One tiny dp-spm vocabulary is built per module from the first fortunes; training corpora made of
its documents in another file (re-compressed, decompressed, a subset, a superset re-ordered, a
seqio Task over them, a Task that reads another field through `rekey`), or of near-copies of them
(a word changed, a trailing period, invisible characters, lower-cased, merged in pairs, split in
halves) compose its ε, exactly as without the declaration; a disjoint corpus keeps it public; an
overlap that cannot be checked is refused in one line unless overridden; and nothing released
(the report, the model, the vocabulary's folder) holds the key or a signature.
"""
import gzip
import json
import os
import random
import shutil
import stat
import types

import numpy as np
import pytest

from private_t5 import doc_fingerprints
from private_t5.data import source as source_lib
from private_t5.dp.config import DPConfig, ExecutionSettings
from private_t5.dp.mechanism import build_mechanism
from private_t5.errors import ConfigError, PrivacyError
from private_t5.tokenizer import dp_spm
from private_t5.tokenizer import dp_spm_histogram
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
    assert any(f"{n} of {m} training documents overlap documents the vocabulary" in line and "its ε is composed" in line
               for line in logs), (what, logs)
  # Only the training split counts: the documents of the validation split are not trained on.
  split = _store_source(root, corpora["subset"], vocab, validation_fraction=0.5)
  declaration = public_declaration.check_declaration(PUBLIC, vocab, split, log=lambda _: None)
  assert declaration.documents == split.describe()["num_documents"]
  assert 0 < declaration.documents < 25 and declaration.overlap == declaration.documents


def _near_copies(mine):
  rng = random.Random(1)

  def one_word(text):
    words = text.split(" ")
    words[rng.randrange(len(words))] = "zqxjv"
    return " ".join(words)

  def halves(text):
    words = text.split(" ")
    return [" ".join(words[:len(words) // 2]), " ".join(words[len(words) // 2:])]

  return {
      "a word changed": [one_word(t) for t in mine],
      "a trailing period": [t + "." for t in mine],
      "invisible characters": ["\ufeff" + t.replace(" ", " \u200b", 2).replace("e", "e\u00ad", 2).replace(
          "a", "a\u200d", 1) for t in mine],
      "lower-cased": [t.lower() for t in mine],
      "merged in pairs": [mine[i] + "\n" + mine[i + 1] for i in range(0, len(mine) - 1, 2)],
      "split in halves": [half for t in mine for half in halves(t)],
  }


def test_near_copies_merged_and_split_documents_compose_its_epsilon(built, tmp_path):
  root, vocab, _, mine, others = built
  expected = _composed(vocab)
  for what, texts in _near_copies(mine).items():
    logs = []
    corpus = _write_jsonl(tmp_path / f"{what.replace(' ', '_')}.jsonl", texts + others)
    ledger = _run(PUBLIC, vocab, _store_source(root, corpus, vocab), log=logs.append)
    assert ledger.vocabulary_status() == "dp" and ledger.total_epsilon() == pytest.approx(expected), what
    line = next(line for line in logs if "training documents overlap" in line)
    found = int(line.split("[privacy] ")[1].split(" of ")[0])
    # Invisible characters, case and punctuation never hide a document; edits of short texts can.
    exact = what in ("a trailing period", "invisible characters", "lower-cased")
    assert found >= (len(texts) if exact else len(texts) // 4), (what, found)
  # A vocabulary document quoted whole inside a longer, otherwise new text.
  quoted = " ".join(others[:6]) + "\n" + max(mine, key=len) + "\n" + " ".join(others[6:12])
  ledger = _run(PUBLIC, vocab, _store_source(root, _write_jsonl(tmp_path / "quoted.jsonl", [quoted]), vocab))
  assert ledger.vocabulary_status() == "dp"


def _rekeyed_task(name, texts, vocab):
  """A seqio Task whose source yields {"body", "id"}, moved to 'targets' by `rekey`, span-corrupted."""
  import functools  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from t5.data import preprocessors as t5_preprocessors  # pylint: disable=g-import-not-at-top
  spm_vocab = seqio.SentencePieceVocabulary(vocab, extra_ids=100)

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({"body": list(texts), "id": [str(i) for i in range(len(texts))]})

  seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
      preprocessors=[functools.partial(t5_preprocessors.rekey, key_map={"inputs": None, "targets": "body"}),
                     seqio.preprocessors.tokenize, t5_preprocessors.span_corruption,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={"inputs": seqio.Feature(spm_vocab, add_eos=True, required=False),
                       "targets": seqio.Feature(spm_vocab, add_eos=True)},
      metric_fns=[])


def test_a_seqio_task_over_the_vocabularys_documents_composes_its_epsilon(built, tmp_path):
  pytest.importorskip("seqio")
  pytest.importorskip("t5")
  import seqio_tasks  # pylint: disable=g-import-not-at-top
  from private_t5.data import seqio_source  # pylint: disable=g-import-not-at-top
  root, vocab, _, mine, others = built
  lengths = {"inputs": 128, "targets": 32}
  # A text file's lines (JSON, read whole by the Task), span-corrupted: the examples as the model reads them.
  lines = _write_jsonl(tmp_path / "task.jsonl", others[:10] + mine[:30])
  seqio_tasks.register_text_file(lines, vocab, name="test_public_vocabulary_task")
  logs = []
  source = seqio_source.SeqioSource("test_public_vocabulary_task", "train", lengths)
  ledger = _run(PUBLIC, vocab, source, log=logs.append)
  assert ledger.vocabulary_status() == "dp" and ledger.total_epsilon() == pytest.approx(_composed(vocab))
  # (Span corruption packs the lines into examples and, with this tiny vocabulary, cuts words apart:
  # a part of the examples is found, which is enough to compose.)
  line = next(line for line in logs if "training documents overlap" in line)
  assert f" of {source.num_examples} training documents" in line and int(line.split("[privacy] ")[1].split()[0]) >= 3
  # The text in another field, read through `rekey`: checked on what the preprocessors produce.
  _rekeyed_task("test_public_vocabulary_rekeyed", mine, vocab)
  ledger = _run(PUBLIC, vocab, seqio_source.SeqioSource("test_public_vocabulary_rekeyed", "train", lengths))
  assert ledger.vocabulary_status() == "dp"
  _rekeyed_task("test_public_vocabulary_rekeyed_other", others, vocab)
  ledger = _run(PUBLIC, vocab, seqio_source.SeqioSource("test_public_vocabulary_rekeyed_other", "train", lengths))
  assert ledger.vocabulary_status() == "public"
  # A Task whose examples cannot be read: refused in one line, unless the user accepts it unchecked.
  broken = types.SimpleNamespace(describe=lambda: {"corpus": "seqio:broken", "tasks": ["broken"]},
                                 vocab_path=vocab, num_examples=3,
                                 get_batch=lambda *a: (_ for _ in ()).throw(RuntimeError("the corpus is gone\nmore")))
  with pytest.raises(PrivacyError) as error:
    _run(PUBLIC, vocab, broken)
  assert "cannot be checked: the training documents cannot be read: the corpus is gone" in str(error.value)
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
  assert check.startswith(f"checked by content: none of the {OTHER_DOCS} training documents overlaps the "
                          f"{VOCAB_DOCS} distinct documents")
  assert any(check.split(";")[0] in line for line in logs)


def test_an_overlap_that_cannot_be_checked_is_refused_unless_overridden(built, tmp_path):
  root, vocab, report, _, others = built
  source = _store_source(root, _write_jsonl(tmp_path / "other.jsonl", others), vocab)
  # An older DP vocabulary: its report records no signatures, or exact fingerprints only.
  old = tmp_path / "old"
  old.mkdir()
  old_vocab = old / "spm.model"
  old_vocab.write_bytes(open(vocab, "rb").read())
  on_disk = json.load(open(report["report_path"]))
  (old / "privacy_report.json").write_text(json.dumps({k: v for k, v in on_disk.items()
                                                      if k != "document_fingerprints"}))
  with pytest.raises(PrivacyError, match=r"cannot be checked: its DP-SentencePiece report .* records no document "
                     r"signatures .*VOCAB_PUBLIC_UNCHECKED=True"):
    _run(PUBLIC, str(old_vocab), source)
  assert _run(PUBLIC, str(old_vocab), source, allow_unchecked=True).vocabulary_status() == "public"
  exact_only = {"file": "spm.model.doc_fingerprints.npy", "sha256": "0" * 64, "key_file": "spm.model.fingerprint_key",
                "key_check": "0" * 32, "scheme": "blake2b-64"}
  (old / "privacy_report.json").write_text(json.dumps(dict(on_disk, document_fingerprints=exact_only)))
  with pytest.raises(PrivacyError, match=r"records only exact document fingerprints .* miss near-copies"):
    _run(PUBLIC, str(old_vocab), source)
  # The private folder gone, a file of it altered, or a key of another vocabulary in it.
  (old / "privacy_report.json").write_text(json.dumps(on_disk))
  with pytest.raises(PrivacyError, match=r"cannot be checked: the private folder of the signatures .* is not there"):
    _run(PUBLIC, str(old_vocab), source)
  private = doc_fingerprints.private_dir(vocab)
  shutil.copytree(private, doc_fingerprints.private_dir(str(old_vocab)))
  assert _run(PUBLIC, str(old_vocab), source).vocabulary_status() == "public"
  copied = doc_fingerprints.private_dir(str(old_vocab))
  doc_fingerprints.write_key(os.path.join(copied, doc_fingerprints.KEY_FILE), doc_fingerprints.new_key())
  with pytest.raises(PrivacyError, match="is not the key its document signatures were made with"):
    _run(PUBLIC, str(old_vocab), source)
  common = os.path.join(copied, doc_fingerprints.FILES["common_shingles"])
  np.save(common, np.arange(3, dtype=np.uint64))
  with pytest.raises(PrivacyError, match="common_shingles.npy are not those its report names"):
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


def test_nothing_released_holds_the_key_or_a_signature(built):
  _, vocab, report, mine, _ = built
  private = doc_fingerprints.private_dir(vocab)
  # Apart from the vocabulary's folder (what a user ships with the .model file), owner-only.
  assert os.path.dirname(private) == os.path.dirname(vocab) + ".private"
  assert sorted(os.listdir(os.path.dirname(vocab))) == ["privacy_report.json", "spm.model"]
  assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
  for name in os.listdir(private):
    assert stat.S_IMODE(os.stat(os.path.join(private, name)).st_mode) == 0o600, name
  key = doc_fingerprints.read_key(os.path.join(private, doc_fingerprints.KEY_FILE))
  signed = doc_fingerprints.Signatures.load(private, key)
  assert len(signed.documents) == len(set(map(doc_fingerprints.normalise, mine)))
  assert doc_fingerprints.fingerprint(mine[0], key) in set(signed.documents.tolist())
  released = {"report": open(report["report_path"], "rb").read(), "model": open(vocab, "rb").read()}
  for name, data in released.items():
    assert key not in data and key.hex().encode() not in data, name
    for value in signed.documents[:20].tolist() + signed.shingles[:20].tolist():
      for form in (value.to_bytes(8, "little"), value.to_bytes(8, "big"), b"%016x" % value, str(value).encode()):
        assert form not in data, name
  recorded = json.loads(released["report"])["document_fingerprints"]
  assert set(recorded) == {"directory", "format", "files", "key_file", "key_check", "scheme", "documents", "note"}
  assert recorded["directory"] == os.path.join("..", "vocab.private", "spm.model")
  # The same content whatever the line endings, spacing, normal form, case, punctuation or format characters.
  assert doc_fingerprints.fingerprint("Caf\u00e9  au\r\nlait! \n", key) == doc_fingerprints.fingerprint(
      "\ufeffcafe\u0301 au la\u00adit", key)


def test_a_private_folder_inside_the_vocabularys_folder_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="is inside the folder of the vocabulary"):
    dp_spm.train_dp_vocabulary("builtin:python_docs", str(tmp_path / "v" / "dp.model"),
                               private_dir=str(tmp_path / "v" / "secret"), verbose=False)


def test_beam_signs_the_documents_as_the_local_pass_does(built, tmp_path):
  pytest.importorskip("apache_beam")
  from private_t5.tokenizer import dp_spm_beam  # pylint: disable=g-import-not-at-top
  _, _, _, mine, _ = built
  corpus = _write_jsonl(tmp_path / "docs.jsonl", mine[:40])
  key = doc_fingerprints.new_key()
  on_beam, local = doc_fingerprints.FingerprintWriter(key), doc_fingerprints.FingerprintWriter(key)
  dp_spm_beam.beam_histogram(corpus, dp_spm_histogram.ContributionBound(), fingerprints=on_beam)
  dp_spm_histogram.build_histogram(mine[:40], dp_spm_histogram.ContributionBound(), num_workers=1, fingerprints=local)
  assert on_beam.count == 40
  beam_record, local_record = on_beam.write(str(tmp_path / "beam")), local.write(str(tmp_path / "local"))
  assert beam_record["files"] == local_record["files"]


def test_glue_style_examples_are_checked_by_their_input_text(built):
  _, vocab, _, mine, others = built
  examples = lambda texts: types.SimpleNamespace(describe=lambda: {"corpus": "glue:x"}, inputs_text=list(texts))
  logs = []
  assert _run(PUBLIC, vocab, examples(others[:5] + mine[:2]), log=logs.append).vocabulary_status() == "dp"
  assert any("2 of 7 training documents" in line for line in logs)
  assert _run(PUBLIC, vocab, examples(others[:5])).vocabulary_status() == "public"
