"""GLUE tasks in text-to-text form, their sources, errors, and the GLUE metric functions."""
import csv
import os

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

from private_t5.data import glue_readers, glue_tasks
from private_t5.data import glue_rows
from private_t5.data import glue_registry
from private_t5.errors import ConfigError, DataError
from private_t5.eval import glue_metrics
from conftest import expected

LABEL_WORDS = ("positive negative equivalent not_equivalent acceptable unacceptable entailment "
               "not_entailment neutral contradiction business entertainment politics sports tech")


def train_test_vocab(shared_data, path, vocab_size=800):
  """A small SentencePiece model on rotten_tomatoes + bible_paraphrase text and the labels."""
  from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
  lines = []
  with open(os.path.join(shared_data, "glue_like", "rotten_tomatoes", "train.tsv")) as f:
    lines += [row.split("\t")[0] for row in f][1:4000]
  with open(os.path.join(shared_data, "glue_like", "bible_paraphrase", "train.tsv")) as f:
    lines += [row.rstrip("\n").split("\t")[3] for row in f][1:1000]
  lines += [LABEL_WORDS] * 500 + ["sentence1: sentence2: sentence: rotten_tomatoes bible_paraphrase"] * 200
  return spm.train_from_sentences(lines, str(path), vocab_size)


@pytest.fixture(scope="module")
def vocab(shared_data, tmp_path_factory):
  return train_test_vocab(shared_data, tmp_path_factory.mktemp("vocab") / "glue.model")


def _write_tsv(path, rows, header=None):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", newline="") as f:
    writer = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
    if header:
      writer.writerow(header)
    writer.writerows(rows)


@pytest.fixture()
def glue_dir(tmp_path):
  """A miniature copy of the official GLUE layout (header rules as in the real files)."""
  root = tmp_path / "glue_data"
  for split in ("train", "dev"):
    _write_tsv(root / "SST-2" / f"{split}.tsv", [["a gem of a film", "1"], ["dull and long", "0"]],
               ["sentence", "label"])
    _write_tsv(root / "CoLA" / f"{split}.tsv", [["gj04", "1", "", "The cat sat."], ["gj04", "0", "*", "Cat the sat."]])
    _write_tsv(root / "STS-B" / f"{split}.tsv",
               [["0", "main", "f", "2012", "0", "a", "b", "A man plays.", "A man is playing.", "3.27"],
                ["1", "main", "f", "2012", "0", "a", "b", "Dogs run.", "Cats sleep.", "1.0"]],
               ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1",
                "sentence2", "score"])
  mnli_header = ["index", "promptID", "pairID", "genre", "s1bp", "s2bp", "s1p", "s2p", "sentence1",
                 "sentence2", "label1", "gold_label"]
  mnli_row = ["0", "1", "1e", "gov", "", "", "", "", "The sky is blue.", "It is night.", "neutral", "neutral"]
  for name in ("train", "dev_matched", "dev_mismatched"):
    _write_tsv(root / "MNLI" / f"{name}.tsv", [mnli_row], mnli_header)
  return str(root)


def test_glue_like_tasks_in_t5_text_to_text_form(shared_data):
  ex = glue_rows.load_examples("rotten_tomatoes", "validation")
  with open(os.path.join(shared_data, "glue_like", "rotten_tomatoes", "validation.tsv")) as f:
    first = f.read().splitlines()[1].split("\t")
  assert ex["inputs"][0] == f"rotten_tomatoes sentence: {first[0]}"
  assert ex["targets"][0] == ("positive" if first[1] == "1" else "negative")
  assert len(ex["inputs"]) == len(ex["labels"]) == expected(1366, 300)
  para = glue_rows.load_examples("bible_paraphrase", "validation")
  assert para["inputs"][0].startswith("bible_paraphrase sentence1: ")
  assert " sentence2: " in para["inputs"][0]
  assert set(para["targets"]) == {"equivalent", "not_equivalent"}
  news = glue_rows.load_examples("bbc_news", "train")
  assert set(news["targets"]) == {"business", "entertainment", "politics", "sports", "tech"}
  assert news["inputs"][0].startswith("bbc_news sentence: ")


def test_official_glue_layout_matches_t5_preprocessing(glue_dir):
  sst2 = glue_rows.load_examples("sst2", "validation", glue_dir=glue_dir)
  assert sst2["inputs"] == ["sst2 sentence: a gem of a film", "sst2 sentence: dull and long"]
  assert sst2["targets"] == ["positive", "negative"]
  cola = glue_rows.load_examples("cola", "train", glue_dir=glue_dir)
  assert cola["inputs"][0] == "cola sentence: The cat sat."
  assert cola["targets"] == ["acceptable", "unacceptable"]
  stsb = glue_rows.load_examples("stsb", "validation", glue_dir=glue_dir)
  assert stsb["inputs"][0] == "stsb sentence1: A man plays. sentence2: A man is playing."
  assert stsb["targets"] == ["3.2", "1.0"]  # rounded to the nearest 0.2 as T5 does
  for task in ("mnli", "mnli_matched", "mnli_mismatched"):
    mnli = glue_rows.load_examples(task, "validation", glue_dir=glue_dir)
    assert mnli["inputs"] == ["mnli hypothesis: It is night. premise: The sky is blue."]
    assert mnli["targets"] == ["neutral"]


def _t5_text_to_text(task, texts, labels):
  """The reference: t5's own GLUE preprocessors over a tf.data dataset of the rows."""
  from private_t5 import quiet_tf  # pylint: disable=g-import-not-at-top
  tf = quiet_tf.import_tensorflow()
  from t5.data import preprocessors  # pylint: disable=g-import-not-at-top
  features = {f: np.asarray(texts[f], dtype=object) for f in task.feature_names}
  features.update(label=labels, idx=np.arange(len(labels), dtype=np.int32))
  ds = tf.data.Dataset.from_tensor_slices(features)
  if task.is_regression:
    ds = preprocessors.stsb(ds)
  else:
    ds = preprocessors.glue(ds, benchmark_name=task.benchmark_name, label_names=list(task.label_names),
                            feature_names=None if task.tfds_name else list(task.feature_names))
  rows = list(ds.as_numpy_iterator())
  return [r["inputs"].decode() for r in rows], [r["targets"].decode() for r in rows]


def test_text_to_text_port_equals_t5_preprocessors(glue_dir):
  """The plain-Python text-to-text form is t5's, byte for byte: local tasks (the user's feature
  order), GLUE tasks (sorted features, unlabelled test rows) and STS-B's rounding (halves to even)."""
  scores = [f"{x:.2f}" for x in np.arange(0, 5.0001, 0.01)] + ["0.1", "0.3", "2.5", "4.9"]
  _write_tsv(os.path.join(glue_dir, "STS-B", "train.tsv"),
             [[str(i), "main", "f", "2012", "0", "a", "b", f"Left {i}.", f"Right {i}.", s]
              for i, s in enumerate(scores)],
             ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1",
              "sentence2", "score"])
  for name, split, root in (("rotten_tomatoes", "validation", None), ("bible_paraphrase", "train", None),
                            ("bbc_news", "test", None), ("mnli", "train", glue_dir), ("stsb", "train", glue_dir),
                            ("sst2", "validation", glue_dir)):
    ex = glue_rows.load_examples(name, split, glue_dir=root)
    texts, labels = glue_rows.read_tsv_rows(ex["task"], ex["source"])
    assert (ex["inputs"], ex["targets"]) == _t5_text_to_text(ex["task"], texts, labels), name
  unlabelled = glue_registry.get_task("sst2")
  texts = {"sentence": ["no label here", "a label"]}
  labels = np.array([-1, 1])
  assert _t5_text_to_text(unlabelled, texts, labels)[1] == ["<unk>", "positive"]
  assert glue_rows.text_to_text(unlabelled, texts, labels) == _t5_text_to_text(unlabelled, texts, labels)


def test_unknown_task_missing_split_and_bad_label(tmp_path, glue_dir):
  with pytest.raises(ConfigError, match=r"unknown task 'sst3'.*sst2"):
    glue_registry.get_task("sst3")
  with pytest.raises(DataError, match="no validation file"):
    glue_rows.load_examples("rte", "validation", glue_dir=glue_dir)
  with pytest.raises(DataError, match="glue_dir"):
    glue_rows.load_examples("qnli", "train", tfds_data_dir=str(tmp_path / "no_tfds"))
  user_dir = tmp_path / "reviews"
  _write_tsv(user_dir / "train.tsv", [["great", "good"], ["awful", "bad"], ["fine", "meh"]], ["text", "stars"])
  glue_registry.register_local_tsv_task("my_reviews", str(user_dir), ["text"], "stars", ["bad", "good"])
  with pytest.raises(DataError, match=r"train.tsv:4: invalid label 'meh', not in the label set"):
    glue_rows.load_examples("my_reviews", "train")
  with pytest.raises(DataError, match="no validation file"):
    glue_rows.load_examples("my_reviews", "validation")


def test_task_files_and_the_row_reader_share_one_tsv_reader(tmp_path):
  user_dir = tmp_path / "bom"
  user_dir.mkdir()
  # A byte-order mark before the header and a whitespace-only line are what spreadsheets write.
  (user_dir / "train.tsv").write_bytes("\ufefftext\tstars\ngreat\tgood\n \t \nawful\t0\n".encode("utf-8"))
  glue_registry.register_local_tsv_task("bom_reviews", str(user_dir), ["text"], "stars", ["bad", "good"])
  examples = glue_rows.load_examples("bom_reviews", "train")
  assert examples["targets"] == ["good", "bad"]
  rows = glue_readers.load_glue(str(user_dir), "train")
  assert [(r["text"], r["stars"]) for r in rows] == [("great", "good"), ("awful", "0")]
  (user_dir / "train.tsv").write_bytes(b"text\tstars\n\xff\tgood\n")
  with pytest.raises(DataError, match=r"train.tsv: invalid UTF-8"):
    glue_rows.read_tsv_rows(glue_registry.get_task("bom_reviews"), str(user_dir / "train.tsv"))


def test_register_local_tsv_task_for_a_user_task(tmp_path, vocab):
  user_dir = tmp_path / "reviews"
  _write_tsv(user_dir / "train.tsv", [["great film", "good"], ["awful plot", "0"], ["nice", "1"]],
             ["review", "stars"])
  _write_tsv(user_dir / "validation.tsv", [["so bad", "bad"]], ["review", "stars"])
  task = glue_registry.register_local_tsv_task("user_reviews", str(user_dir), ["review"], "stars",
                                            ["bad", "good"])
  assert task.metric == "accuracy" and task.label_names == ("bad", "good")
  ex = glue_rows.load_examples("user_reviews", "train")
  assert ex["inputs"][0] == "user_reviews review: great film"
  assert ex["targets"] == ["good", "bad", "good"]
  np.testing.assert_array_equal(ex["labels"], [1, 0, 1])
  src = glue_tasks.GlueSource("user_reviews", "train", vocab, {"inputs": 16, "targets": 4})
  assert src.num_examples == 3 and src.privacy_unit == "example"


def test_source_batches_follow_the_trainer_contract(vocab):
  src = glue_tasks.GlueSource("glue_like", "validation", vocab, {"inputs": 32, "targets": 8},
                              vocab_size=1024)
  sizes = expected(1366, 300), expected(1232, 120), expected(250, 15)
  assert src.num_examples == sum(sizes)
  assert src.task_sizes == list(sizes)
  assert src.describe()["privacy_unit"] == "example"
  assert src.task_slice("bbc_news") == slice(sizes[0] + sizes[1], sum(sizes))
  rows = [0, sizes[0] + 34, sum(sizes) - 1]
  batch = src.get_batch(rows, seed=7, batch_size=4)
  assert batch["encoder_input_tokens"].shape == (4, 32) and batch["encoder_input_tokens"].dtype == np.int32
  assert batch["decoder_target_tokens"].shape == (4, 8)
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 1:], batch["decoder_target_tokens"][:, :-1])
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 0], 0)
  np.testing.assert_array_equal(batch["example_weight"], [1, 1, 1, 0])
  np.testing.assert_array_equal(batch["is_padding"], [False, False, False, True])
  np.testing.assert_array_equal(batch["example_index"], rows + [-1])
  assert np.all(batch["encoder_input_tokens"][3] == 0)
  # Every real row ends with EOS (kept after trimming, as T5's append_eos_after_trim).
  for row in batch["encoder_input_tokens"][:3]:
    assert row[np.nonzero(row)[0][-1]] == glue_tasks.EOS_ID
  np.testing.assert_array_equal(batch["decoder_loss_weights"], batch["decoder_target_tokens"] != 0)
  # The training mixture of GLUE leaves out the evaluation-only MNLI views.
  assert [t.name for t in glue_registry.resolve("glue")] == list(glue_registry.GLUE_TASK_NAMES)
  assert "mnli_mismatched" in [t.name for t in glue_registry.eval_tasks("glue")]
  with pytest.raises(ConfigError, match="targets need up to"):
    glue_tasks.GlueSource("bible_paraphrase", "validation", vocab, {"inputs": 32, "targets": 2})
  with pytest.raises(ConfigError, match="vocab_size is 128"):
    glue_tasks.GlueSource("rotten_tomatoes", "validation", vocab, {"inputs": 32, "targets": 8}, vocab_size=128)


# -- metrics ------------------------------------------------------------------------------------

_TARGETS = [1, 0, 1, 1, 0, 1, 0, 0, 1, 1]
_PREDICTIONS = [1, 0, 0, 1, 1, 1, 0, -1, 1, 0]  # -1: a decoded string that is no label


def test_postprocess_like_t5():
  assert glue_metrics.postprocess("positive", ("negative", "positive")) == 1
  assert glue_metrics.postprocess("negative", ("negative", "positive")) == 0
  assert glue_metrics.postprocess("great", ("negative", "positive")) == -1
  assert glue_metrics.postprocess("3.4", None) == pytest.approx(3.4)
  assert glue_metrics.postprocess("n/a", None) == -1.0


def test_classification_metrics_equal_scikit_learn():
  t, p = np.array(_TARGETS), np.array(_PREDICTIONS)
  acc = sklearn.metrics.accuracy_score(t, p) * 100
  assert glue_metrics.compute_metrics("sst2", t, p) == pytest.approx({"accuracy": acc})
  # An invalid prediction counts as the wrong class for F1 (t5's f1_score_with_invalid).
  p_flipped = np.where(p == -1, 1 - t, p)
  mrpc = glue_metrics.compute_metrics("mrpc", t, p)
  assert mrpc == pytest.approx({"f1": sklearn.metrics.f1_score(t, p_flipped) * 100, "accuracy": acc})
  cola = glue_metrics.compute_metrics("cola", t, p)
  assert cola == pytest.approx({"matthews_corrcoef": sklearn.metrics.matthews_corrcoef(t, p) * 100})
  multi_t, multi_p = [0, 1, 2, 3, 4, 4, 2], [0, 1, 2, 3, 3, 4, 1]
  assert glue_metrics.compute_metrics("accuracy", multi_t, multi_p)["accuracy"] == pytest.approx(
      sklearn.metrics.accuracy_score(multi_t, multi_p) * 100)


def test_metrics_equal_t5s():
  from private_t5 import quiet_tf  # pylint: disable=g-import-not-at-top
  quiet_tf.import_tensorflow()
  from t5.evaluation import metrics as t5_metrics  # pylint: disable=g-import-not-at-top
  t, p = list(_TARGETS), list(_PREDICTIONS)
  assert glue_metrics.compute_metrics("mrpc", t, p) == pytest.approx(
      {**t5_metrics.f1_score_with_invalid(t, p), **t5_metrics.accuracy(t, p)})
  mcc = t5_metrics.sklearn_metrics_wrapper("matthews_corrcoef", metric_post_process_fn=lambda x: 100 * x)
  assert glue_metrics.compute_metrics("cola", t, p) == pytest.approx(mcc(t, p))
  st, sp = [0.0, 1.2, 2.4, 3.0, 4.8], [0.4, 1.0, 2.8, 3.2, -1.0]
  assert glue_metrics.compute_metrics("stsb", st, sp) == pytest.approx(
      {**t5_metrics.pearson_corrcoef(st, sp), **t5_metrics.spearman_corrcoef(st, sp)})


def test_regression_metrics_equal_scipy():
  t = np.array([0.0, 1.2, 2.4, 3.0, 4.8, 5.0, 2.2])
  p = np.array([0.4, 1.0, 2.8, 3.2, 4.0, 4.6, -1.0])
  out = glue_metrics.compute_metrics("stsb", t, p)
  assert out["pearson_corrcoef"] == pytest.approx(scipy.stats.pearsonr(t, p)[0] * 100)
  assert out["spearman_corrcoef"] == pytest.approx(scipy.stats.spearmanr(t, p)[0] * 100)
  assert glue_metrics.compute_metrics("stsb", t, np.full(7, 2.5)) == {"pearson_corrcoef": 0.0,
                                                                      "spearman_corrcoef": 0.0}


def test_majority_baseline_and_table():
  assert glue_metrics.majority_prediction([1, 1, 0, 2, 1], False) == 1
  assert glue_metrics.majority_prediction([1.0, 2.0], True) == pytest.approx(1.5)
  assert glue_metrics.headline({"f1": 80.0, "accuracy": 70.0}) == 75.0
  table = glue_metrics.markdown_table({"model": {"cola": 10.0, "mnli_matched": 50.0}},
                                      ["cola", "mnli_matched"])
  assert "| model | cola | mnli_m | Avg |" in table
  assert "| model | 10.0 | 50.0 | 30.0 |" in table
  with pytest.raises(ValueError, match="unknown GLUE metric"):
    glue_metrics.compute_metrics("bleu", [1], [1])
