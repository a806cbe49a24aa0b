"""Corpus-wide stages on Apache Beam: the runner switch, file IO, DP-SentencePiece, memorization splits.

The Beam path must give what the local path gives: the same noiseless histogram, the same
split file. DirectRunner runs in-process here, and with 2 worker processes in the slow tests.
"""
import gzip
import json
import os
import random
import sys

import numpy as np
import pytest

from conftest import shared_or_fixture

from private_t5.stages import cli
from private_t5.data import beam_io, corpora
from private_t5.data import beam_runner
from private_t5.data import beam_files
from private_t5.errors import ConfigError, DataError
from private_t5.eval import splits, splits_beam
from private_t5.eval import split_types
from private_t5.eval import split_search
from private_t5.tokenizer import dp_spm_beam
from private_t5.tokenizer import dp_spm_histogram

TWO_WORKERS = "--direct_num_workers=2 --direct_running_mode=multi_processing"
FAST = split_types.SplitConfig(num_perm=1280, num_bands=128, num_workers=1)


def _write_jsonl(path, records):
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "wt", encoding="utf-8") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def _documents(seed=1, n=60):
  rng = np.random.default_rng(seed)
  vocab = [f"w{i}" for i in range(3000)]
  docs = ["spam " * 2000, " ".join(vocab[:600]), "a b c", "x\ty\nz  x"]
  for _ in range(n):
    docs.append(" ".join(rng.choice(vocab[: int(rng.integers(2, 3000))], size=int(rng.integers(1, 800)))))
  return docs


def _linux(shared_data, limit):
  docs = []
  del shared_data  # the kernel docs, or their stand-in among the repository's fixtures
  with gzip.open(shared_or_fixture("pretrain/linux_docs.jsonl.gz"), "rt", encoding="utf-8") as f:
    for line in f:
      docs.append(json.loads(line))
      if len(docs) >= limit:
        break
  return docs


# ---------------------------------------------------------------------------------------------
# The runner switch and the readers
# ---------------------------------------------------------------------------------------------

def test_runner_switch():
  assert not beam_runner.is_beam("local") and beam_runner.is_beam("DirectRunner")
  with pytest.raises(ConfigError, match="unknown runner 'Nope'"):
    beam_runner.check_runner("Nope")
  options = beam_runner.pipeline_options("DirectRunner", TWO_WORKERS).get_all_options()
  assert options["direct_num_workers"] == 2 and options["runner"] == "DirectRunner"
  with pytest.raises(ConfigError, match="--runner"):
    beam_runner.pipeline_options("DirectRunner", "--runner=FlinkRunner")


def test_beam_not_importable_is_one_line(monkeypatch):
  monkeypatch.setitem(sys.modules, "apache_beam", None)
  with pytest.raises(ConfigError, match="not importable") as e:
    beam_runner.import_beam()
  assert "\n" not in str(e.value)


def test_result_folder_is_fresh_and_only_a_local_one_is_removed(tmp_path):
  options = beam_runner.pipeline_options("DirectRunner", "")
  with beam_files.output_dir(options, None, "stage") as local:
    assert os.path.basename(local).startswith("stage-") and os.path.isdir(local)
    _write_jsonl(os.path.join(local, "rows-00000-of-00002"), ['["a", 1]', "", "2"])
    _write_jsonl(os.path.join(local, "rows-00001-of-00002"), ['{"b": 3}'])
    assert list(beam_files.read_json_lines(os.path.join(local, "rows"))) == [["a", 1], 2, {"b": 3}]
  assert not os.path.exists(local)  # a local temporary folder goes with the pipeline
  shared = tmp_path / "shared"
  with beam_files.output_dir(options, str(shared) + "/", "stage") as first, \
       beam_files.output_dir(beam_runner.pipeline_options("DirectRunner", f"--temp_location={shared}"),
                          None, "stage") as second:
    assert first != second
    assert os.path.dirname(first) == os.path.dirname(second) == str(shared)
    os.makedirs(first)
  assert os.path.isdir(first)  # on the user's storage it is left for the user to manage


def test_file_readers_match_the_local_readers(tmp_path):
  jsonl = _write_jsonl(tmp_path / "a.jsonl.gz", [{"id": "x", "text": "one"}, {"text": "two"}, {"text": "  "},
                                                  {"id": 7, "text": "three"}])
  txt = tmp_path / "b.txt"
  txt.write_text("first line\n\nthird line\n")
  tsv = tmp_path / "c.tsv"
  tsv.write_text("id\ttext\nk1\thello there\n\tno id\n")
  for spec in (jsonl, str(txt), str(tsv)):
    local = [(d.id, d.text) for d in corpora.iter_documents(spec)]
    assert list(beam_io.stream_documents(spec)) == local, spec


def test_bad_input_is_one_clear_line(tmp_path, capsys):
  bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine words"}, {"text": "more words"}, "{not json",
                                               {"text": "last words"}])
  bound = dp_spm_histogram.ContributionBound("capped", 8)
  with pytest.raises(DataError, match=r"bad.jsonl: line 3: not valid JSON .*--skip_bad_lines"):
    dp_spm_beam.beam_histogram(bad, bound)
  hist, stats = dp_spm_beam.beam_histogram(bad, bound, skip_bad_lines=True)
  assert stats.documents == 3 and hist["words"] == 3
  with pytest.raises(DataError, match="matches no file"):
    dp_spm_beam.beam_histogram(str(tmp_path / "none-*.jsonl"), bound)
  rc = cli.main(["dp-spm", "--gin_file=configs/runs/dp_spm.gin", f"--corpus={bad}", f"--output={tmp_path}/v.model",
                 "--runner=Nope"])
  err = capsys.readouterr().err
  assert rc == 2 and [l for l in err.splitlines() if l.startswith("error:")] == [
      "error: unknown runner 'Nope': use one of " + ", ".join(beam_runner.RUNNERS)]


# ---------------------------------------------------------------------------------------------
# DP-SentencePiece
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bound", [dp_spm_histogram.ContributionBound("paper", 64), dp_spm_histogram.ContributionBound("capped", 32)])
def test_dp_spm_histogram_equals_local_and_keeps_the_sensitivity(tmp_path, bound):
  docs = _documents()
  half = len(docs) // 2
  _write_jsonl(tmp_path / "part-0.jsonl", [{"text": t} for t in docs[:half]])
  _write_jsonl(tmp_path / "part-1.jsonl", [{"text": t} for t in docs[half:]])
  pattern = str(tmp_path / "part-*.jsonl")
  local, s1 = dp_spm_histogram.build_histogram(docs, bound, num_workers=1)
  hist, s2 = dp_spm_beam.beam_histogram(pattern, bound)
  assert dict(hist) == dict(local)
  assert (s1.documents, s1.bytes, s1.words_raw, s1.words_counted) == (
      s2.documents, s2.bytes, s2.words_raw, s2.words_counted)
  # Removing one document moves the Beam sum by at most the bound (the sensitivity property).
  for i in (0, 1, 7):
    rest = [t for j, t in enumerate(docs) if j != i]
    _write_jsonl(tmp_path / "part-0.jsonl", [{"text": t} for t in rest[:half]])
    _write_jsonl(tmp_path / "part-1.jsonl", [{"text": t} for t in rest[half:]])
    smaller, _ = dp_spm_beam.beam_histogram(pattern, bound)
    diff = np.array([hist[w] - smaller.get(w, 0) for w in hist], dtype=float)
    assert np.linalg.norm(diff) <= bound.l2 + 1e-9
    assert np.abs(diff).max() <= bound.linf
    assert sum(1 for w in hist if w not in smaller) <= bound.max_distinct


@pytest.mark.slow
def test_dp_spm_two_workers_on_real_text_equals_local(tmp_path, shared_data):
  corpus = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  bound = dp_spm_histogram.ContributionBound("paper", 256)
  local, s1 = dp_spm_histogram.build_histogram((d.text for d in corpora.iter_documents(corpus)), bound, num_workers=1)
  hist, s2 = dp_spm_beam.beam_histogram(corpus, bound, beam_options=TWO_WORKERS)
  assert dict(hist) == dict(local) and s1.documents == s2.documents and s1.bytes == s2.bytes


def test_dp_spm_cli_on_beam(tmp_path, capsys):
  texts = [f"one two three four five six {i % 4}" for i in range(300)]
  corpus = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
  out = str(tmp_path / "v" / "dp.model")
  rc = cli.main(["dp-spm", "--gin_file=configs/runs/dp_spm.gin", f"--corpus={corpus}", f"--output={out}",
                 "--vocab_size=400", "--sensitivity=capped", "--max_words=8", "--delta=1e-4", "--noise_std=2.0",
                 "--runner=DirectRunner"])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  assert report["documents"] == 300 and report["words_total"] == 10 and report["noise_seed"] == "os_entropy"
  assert os.path.isfile(out)


# ---------------------------------------------------------------------------------------------
# Memorization splits
# ---------------------------------------------------------------------------------------------

def _edit(text, rng, fraction=0.03):
  words = text.split()
  for _ in range(max(1, int(len(words) * fraction))):
    i = rng.randrange(len(words))
    if rng.random() < 0.5:
      words[i] = "EDITED"
    else:
      del words[i]
  return " ".join(words)


def _split_corpora(tmp_path, shared_data):
  docs = [d for d in _linux(shared_data, 300) if 80 <= len(d["text"].split()) <= 2000][:70]
  rng = random.Random(0)
  train = docs[:50] + [{"id": d["id"] + "#copy", "text": _edit(d["text"], rng)} for d in docs[:8]]
  quote = " ".join(docs[9]["text"].split()[:60])
  train.append({"id": "quoting", "text": " ".join(f"q{i}" for i in range(200)) + " " + quote})
  valid = docs[50:] + [{"id": d["id"] + "#valid", "text": _edit(d["text"], rng)} for d in docs[20:25]]
  return (_write_jsonl(tmp_path / "train.jsonl.gz", train), _write_jsonl(tmp_path / "valid.jsonl", valid))


def _without_seconds(path):
  data = json.load(open(path))
  data["stats"].pop("seconds")
  return data


def test_splits_equal_local(tmp_path, shared_data):
  train, valid = _split_corpora(tmp_path, shared_data)
  local = split_search.build_splits(corpora.read_corpus(train)[0], corpora.read_corpus(valid)[0], FAST)
  beam = splits_beam.build_splits_beam(train, valid, FAST).with_ids(  # flags in corpus order -> ids
      [d.id for d in corpora.read_corpus(train)[0]], [d.id for d in corpora.read_corpus(valid)[0]])
  assert beam.ids == local.ids
  local.stats.pop("seconds"), beam.stats.pop("seconds")
  assert beam.stats == local.stats
  assert "quoting" in beam.ids["train_dup"] and len(beam.ids["valid_in_train"]) >= 5


@pytest.mark.slow
def test_splits_stage_two_workers_writes_the_local_file(tmp_path, shared_data, capsys):
  train, valid = _split_corpora(tmp_path, shared_data)
  common = [f"--train_corpus={train}", f"--valid_corpus={valid}", "--num_perm=1280", "--num_bands=128"]
  assert cli.main(["splits", *common, f"--output={tmp_path}/local/"]) == 0
  local = json.loads(capsys.readouterr().out)
  assert cli.main(["splits", *common, f"--output={tmp_path}/beam.json", "--runner=DirectRunner",
                   f"--beam_options={TWO_WORKERS}"]) == 0
  beam = json.loads(capsys.readouterr().out)
  assert beam["key"] == local["key"] and os.path.basename(local["output"]) == f"splits_{local['key']}.json"
  assert _without_seconds(beam["output"]) == _without_seconds(local["output"])
  # The memorization stage reuses the file by its key.
  cfg = split_types.SplitConfig(num_perm=1280, num_bands=128)
  reused = splits.load_or_build_splits(os.path.dirname(local["output"]), corpora.read_corpus(train)[0],
                                       corpora.read_corpus(valid)[0], cfg)
  assert reused[2] and reused[1] == local["output"]


def _tiny_tfds_builder():
  """A small TFDS builder (module level, so that workers unpickle it by reference)."""
  global _TINY_BUILDER  # pylint: disable=global-statement
  if _TINY_BUILDER is None:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    class PrivateT5TinyBeamCorpus(tfds.core.GeneratorBasedBuilder):
      """Three documents with a text and a url feature, like C4."""
      VERSION = tfds.core.Version("1.0.0")

      def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "url": tfds.features.Text()}))

      def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(3)}

      def _generate_examples(self, n):
        for i in range(n):
          yield i, {"text": f"Document number {i}." if i != 1 else "  ", "url": f"http://example.org/{i}"}

    _TINY_BUILDER = PrivateT5TinyBeamCorpus
  return _TINY_BUILDER


_TINY_BUILDER = None


@pytest.mark.slow
def test_tfds_dataset_read_on_beam(tmp_path):
  from apache_beam.testing.util import assert_that, equal_to  # pylint: disable=g-import-not-at-top
  builder = _tiny_tfds_builder()(data_dir=str(tmp_path))
  builder.download_and_prepare()
  beam = beam_runner.import_beam()
  with beam.Pipeline(options=beam_runner.pipeline_options("DirectRunner")) as p:
    # A prepared dataset by its folder, as `tfds:c4/en:train` is read by name.
    docs = beam_io.read_documents(p, f"tfds:{builder.data_dir}:train", id_field="url")
    assert_that(docs | beam.Map(lambda kv: kv[1]), equal_to([("http://example.org/0", "Document number 0."),
                                                             ("http://example.org/2", "Document number 2.")]))
