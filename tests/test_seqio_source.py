"""A T5X user's seqio Task as `private-t5 train`'s data: a Task registered here (a function source
over real text, t5's span corruption) read as examples, pretrained on with DP then fine-tuned on
without, its population in the ledger; a Mixture whose rates come from the data refused in one line;
Mixtures mixing vocabularies, rates that are not finite numbers >= 0, a module or a Task whose own
code raises: one line each; a task of rate 0 left out."""
import gzip
import importlib
import importlib.util
import json
import logging
import os

import numpy as np
import pytest

from private_t5.data import seqio_source
from private_t5.data import seqio_lookup
from private_t5.data import source as source_lib
from private_t5.dp.ledger import PrivacyLedger
from private_t5.errors import ConfigError, DataError, PrivacyError
from private_t5.io import file_sha256
from private_t5.stages import cli
from private_t5.stages import train as train_stage
from private_t5.tokenizer import spm

from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab, split_corpus

# seqio, t5 and TensorFlow are imported by the fixtures, not when the tests are collected.
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("seqio", "t5")),
                                reason="needs seqio and t5 (private_t5[seqio])")

LENGTHS = {"inputs": 32, "targets": 8}
NUM_PIECES = 300  # the vocabulary's pieces; ids from here up are the 100 sentinels


@pytest.fixture(scope="module")
def seqio_tasks():
  """tests/seqio_tasks.py, the module a run imports by MIXTURE_OR_TASK_MODULE."""
  return importlib.import_module("seqio_tasks")


@pytest.fixture(scope="module")
def task_data(shared_data, tmp_path_factory, seqio_tasks):
  """(the corpus, the first TRAIN rows as JSONL, the vocabulary); the Tasks registered on them."""
  directory = str(tmp_path_factory.mktemp("seqio"))
  corpus, vocab = fortunes_corpus_and_vocab(shared_data, directory)
  train_rows, _ = split_corpus(corpus, directory, seqio_tasks.TRAIN, seqio_tasks.VALIDATION)
  seqio_tasks.register(corpus, vocab)
  return corpus, train_rows, vocab


@pytest.fixture(scope="module")
def other_vocab(task_data, seqio_tasks, shared_data, tmp_path_factory):
  """A second 300-piece vocabulary (trained on other text), and the Tasks and Mixtures using it."""
  corpus, _, vocab = task_data
  path = str(tmp_path_factory.mktemp("other_vocab") / "other.model")
  with gzip.open(os.path.join(shared_data, "pretrain", "python_docs.jsonl.gz"), "rt") as f:
    texts = [json.loads(line)["text"] for _, line in zip(range(300), f)]
  spm.train_from_sentences(texts, path, vocab_size=300)
  seqio_tasks.register_other_vocabulary(corpus, vocab, path)
  return path


@pytest.fixture(scope="module")
def train_source(task_data, seqio_tasks):
  return seqio_source.SeqioSource(seqio_tasks.TASK, "train", LENGTHS, module="seqio_tasks")


def _uncorrupted(inputs: np.ndarray, targets: np.ndarray) -> list:
  """The text tokens of one span-corrupted example: each sentinel of the inputs replaced by the
  span that follows it in the targets (EOS and padding dropped)."""
  spans, sentinel = {}, None
  for token in targets[targets > 1]:
    if token >= NUM_PIECES:
      sentinel = int(token)
      spans[sentinel] = []
    else:
      spans[sentinel].append(int(token))
  out = []
  for token in inputs[inputs > 1]:
    out.extend(spans[int(token)] if token >= NUM_PIECES else [int(token)])
  return out


def test_examples_are_the_same_text_as_our_corpus_reads_it(task_data, train_source):
  _, train_rows, vocab = task_data
  inputs, targets = train_source.examples()
  assert inputs.shape == (train_source.num_examples, 32) and targets.shape[1] == 8
  seen = [token for e, t in zip(inputs, targets) for token in _uncorrupted(e, t)]
  corpus = source_lib.make_source(train_rows, vocab, feature_lengths=LENGTHS, privacy_unit="example", split="all",
                                  cache_dir=os.path.join(os.path.dirname(vocab), "cache"), progress=False)
  ours = [int(token) for doc in range(corpus.store.num_documents) for token in corpus.store.document_tokens(doc)]
  # t5's span corruption joins documents before cutting them: the same ids, in the same order.
  assert seen == ours
  batch = train_source.get_batch([3, 0], seed=0, batch_size=4)
  np.testing.assert_array_equal(batch["encoder_input_tokens"][:2], inputs[[3, 0]])
  assert batch["is_padding"].tolist() == [False, False, True, True]
  assert train_source.vocab_size == NUM_PIECES + 100 and train_source.vocab_path == vocab


def test_unit_is_the_example_unless_one_example_per_document_is_declared(task_data, train_source, seqio_tasks):
  assert train_source.privacy_unit == "example"
  population = train_source.describe()["population"]
  assert population["tasks"] == {seqio_tasks.TASK: train_source.num_examples}
  assert population["privacy_unit_basis"] == seqio_source.EXAMPLE_UNIT_BASIS
  declared = seqio_source.SeqioSource(seqio_tasks.TASK, "validation", LENGTHS, module="seqio_tasks",
                                      one_example_per_document=True)
  assert declared.privacy_unit == "document"
  assert declared.describe()["population"]["privacy_unit_basis"].startswith("declared by the user")


def test_a_document_level_vocabulary_needs_a_declared_bound_on_documents_per_example(task_data, train_source,
                                                                                       seqio_tasks, tmp_path):
  # Span corruption joins documents: one example may change several of them. Without a declared
  # bound, no group size holds and a document-level DP vocabulary counts as not private.
  population = train_source.describe()["population"]
  assert population["documents_per_example"] is None
  assert population["documents_per_example_basis"] == seqio_source.UNBOUNDED_DOCUMENTS_BASIS
  declared = seqio_source.SeqioSource(seqio_tasks.TASK, "validation", LENGTHS, module="seqio_tasks",
                                      documents_per_example=3)
  assert declared.describe()["population"]["documents_per_example"] == 3
  _, _, vocab = task_data
  digest = file_sha256(vocab)
  report = {"mechanism": "dp_sentencepiece", "epsilon": 0.2, "delta": 1e-9, "privacy_unit": "document",
            "vocab_sha256": digest}
  report_path = tmp_path / "privacy_report.json"
  report_path.write_text(json.dumps(report))
  for source, size in ((train_source, None), (declared, 6)):
    ledger = PrivacyLedger.create(noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, num_examples=source.num_examples,
                                  batch_size=4, privacy_unit="example", population=source.describe()["population"])
    component = ledger.add_vocabulary(vocab, str(report_path))
    if size is None:
      assert component["private"] is False and "DOCUMENTS_PER_EXAMPLE" in component["reason"]
    else:
      assert component["group_privacy"]["size"] == size and component["epsilon"] == pytest.approx(1.2)
  with pytest.raises(ConfigError, match="documents_per_example must be >= 1"):
    seqio_source.SeqioSource(seqio_tasks.TASK, "validation", LENGTHS, module="seqio_tasks", documents_per_example=0)


def test_the_files_a_task_reads_are_known_for_the_public_vocabulary_check(task_data, train_source, seqio_tasks,
                                                                          tmp_path):
  corpus, _, vocab = task_data
  lines = tmp_path / "lines.txt"
  lines.write_text("\n".join(seqio_tasks.read_texts(corpus, "train")[:40]) + "\n")
  seqio_tasks.register_text_file(str(lines), vocab)
  text_task = seqio_source.SeqioSource(seqio_tasks.TEXT_FILE_TASK, "train", LENGTHS, module="seqio_tasks")
  described = text_task.describe()
  assert described["data_files"] == [str(lines)] and described["data_files_unknown"] is None
  assert "not known" in train_source.describe()["data_files_unknown"]
  # A DP vocabulary built from a copy of that file, declared public for training on the Task: refused.
  copy = tmp_path / "copy.txt"
  copy.write_bytes(lines.read_bytes())
  from private_t5.dp import public_vocabulary  # pylint: disable=g-import-not-at-top
  (tmp_path / "privacy_report.json").write_text(json.dumps({
      "mechanism": "dp_sentencepiece", "epsilon": 0.2, "delta": 1e-9, "privacy_unit": "document",
      "vocab_sha256": file_sha256(vocab), "corpus_files": [str(copy)],
      "corpus_file_digests": public_vocabulary.file_digests([str(copy)])}))
  with pytest.raises(PrivacyError, match="which this run trains on by content"):
    public_vocabulary.check_public_declaration(vocab, str(tmp_path / "privacy_report.json"), described["corpus"],
                                               described["data_files"], described["data_files_unknown"])


def test_a_fixed_rate_mixture_names_its_tasks_and_a_data_dependent_one_is_refused(task_data, seqio_tasks):
  mixture = seqio_source.SeqioSource(seqio_tasks.FIXED_MIXTURE, "validation", LENGTHS, module="seqio_tasks",
                                     dp=object())
  population = mixture.describe()["population"]
  assert population["tasks"].keys() == {seqio_tasks.TASK, seqio_tasks.OTHER_TASK}
  assert sum(population["tasks"].values()) == mixture.num_examples
  assert population["rates"] == {seqio_tasks.TASK: 1.0, seqio_tasks.OTHER_TASK: 2.0}
  # Without DP the rates are no privacy matter: the same population, the rates left unevaluated.
  non_private = seqio_source.SeqioSource(seqio_tasks.DATA_DEPENDENT_MIXTURE, "validation", LENGTHS,
                                         module="seqio_tasks")
  assert non_private.num_examples == mixture.num_examples and non_private.rates is None
  with pytest.raises(ConfigError, match="computed by mixing_rate_num_examples") as error:
    seqio_source.SeqioSource(seqio_tasks.DATA_DEPENDENT_MIXTURE, "train", LENGTHS, module="seqio_tasks",
                             dp=object())
  assert "\n" not in str(error.value)


def _cache(model_dir) -> str:
  """The store cache of a test run (a Task of undeclared size is read through its example store)."""
  return os.path.join(os.path.dirname(str(model_dir)), "cache")


def _pretrain(model_dir, task, steps, *extra):
  # The T5X command line's data flags: the Task and the module registering it (seqio.gin is layered).
  return ["--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.TRAIN_STEPS={steps}", f"--gin.MIXTURE_OR_TASK_NAME={task}",
          "--gin.MIXTURE_OR_TASK_MODULE=seqio_tasks", f"--gin.DATA_CACHE_DIR={_cache(model_dir)}",
          *MICRO_TRAIN_ARGS, *extra]


@pytest.mark.slow
def test_pretrain_with_dp_then_fine_tune_without_on_a_seqio_task(task_data, train_source, seqio_tasks, tmp_path):
  _, _, vocab = task_data
  private = train_stage.run_from_args(_pretrain(tmp_path / "dp", seqio_tasks.TASK, 2,
                                                "--gin.ONE_EXAMPLE_PER_DOCUMENT=True"))
  assert private["final_step"] == 2 and private["private"] and private["vocab_path"] == vocab
  report = json.loads((tmp_path / "dp" / "privacy_report.json").read_text())
  assert (report["num_examples"], report["privacy_unit"]) == (train_source.num_examples, "document")
  assert report["population"]["privacy_unit_basis"] == seqio_source.DOCUMENT_UNIT_BASIS
  assert report["sampling"] == "poisson" and report["max_batch_size"] is None  # untruncated Poisson
  assert report["sampling_rate"] == pytest.approx(0.5 / train_source.num_examples)

  # Fine-tuning from that checkpoint, non-private, on the same Task: the unit is the example.
  finetuned = train_stage.run_from_args([
      "--gin_file=configs/models/t5_1_0_tiny.gin", "--gin_file=configs/runs/finetune.gin",
      f"--gin.MODEL_DIR={tmp_path / 'ft'}", f"--gin.INITIAL_CHECKPOINT={tmp_path / 'dp'}", "--gin.TRAIN_STEPS=2",
      f"--gin.MIXTURE_OR_TASK_NAME={seqio_tasks.TASK}", "--gin.MIXTURE_OR_TASK_MODULE=seqio_tasks",
      f"--gin.DATA_CACHE_DIR={_cache(tmp_path / 'ft')}", "--gin.T5Config.dropout_rate=0.0",
      *[a for a in MICRO_TRAIN_ARGS if not a.startswith("--gin.make_source")]])
  assert finetuned["final_step"] == 2 and not finetuned["private"]
  report = json.loads((tmp_path / "ft" / "privacy_report.json").read_text())
  assert (report["num_examples"], report["privacy_unit"]) == (train_source.num_examples, "example")
  assert report["population"]["tasks"] == {seqio_tasks.TASK: train_source.num_examples}


def test_dp_run_on_a_mixture_with_a_data_dependent_rate_is_refused(task_data, seqio_tasks, tmp_path):
  with pytest.raises(ConfigError, match="needs every rate fixed in advance") as error:
    train_stage.run_from_args(_pretrain(tmp_path / "run", seqio_tasks.DATA_DEPENDENT_MIXTURE, 2))
  assert "\n" not in str(error.value)
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_the_module_flag_layers_the_seqio_run_file():
  files = ["configs/runs/pretrain.gin"]
  assert train_stage.with_seqio_layer(files, ["MIXTURE_OR_TASK_NAME=sst2"]) == files  # GLUE fine-tuning
  layered = train_stage.with_seqio_layer(files, ["MIXTURE_OR_TASK_MODULE = my.tasks"])
  assert layered == files + [train_stage.SEQIO_GIN]
  assert train_stage.with_seqio_layer(layered, ["MIXTURE_OR_TASK_MODULE=my.tasks"]) == layered


def test_an_unknown_task_or_module_is_named_in_one_line(task_data):
  with pytest.raises(ConfigError, match="no seqio Task or Mixture named 'no_such_task'") as error:
    seqio_source.SeqioSource("no_such_task", "train", LENGTHS, module="seqio_tasks")
  assert "\n" not in str(error.value)
  with pytest.raises(ConfigError, match="cannot import MIXTURE_OR_TASK_MODULE 'no_such.module'"):
    seqio_source.SeqioSource("no_such_task", "train", LENGTHS, module="no_such.module")


def _one_line(error) -> str:
  message = str(error.value)
  assert "\n" not in message and "Traceback" not in message
  return message


def test_every_task_of_a_mixture_must_use_the_vocabulary_training_uses(task_data, other_vocab, seqio_tasks):
  _, _, vocab = task_data
  for name in (seqio_tasks.MIXED_VOCAB_MIXTURE, seqio_tasks.NESTED_MIXED_VOCAB_MIXTURE):  # a sub-mixture's too
    with pytest.raises(ConfigError) as error:
      seqio_lookup.seqio_vocab_path(name, "seqio_tasks")  # the vocabulary training records
    assert _one_line(error) == (
        f"seqio Mixture {name!r}: Task {seqio_tasks.OTHER_VOCAB_TASK!r} tokenizes with {other_vocab}, not with "
        f"{vocab}, the vocabulary training uses (that of Task {seqio_tasks.TASK!r}); every task must use the same "
        "SentencePiece vocabulary")
    with pytest.raises(ConfigError, match=seqio_tasks.OTHER_VOCAB_TASK) as error:  # the examples read
      seqio_source.SeqioSource(name, "validation", LENGTHS, module="seqio_tasks", dp=object(), max_examples=2)
    _one_line(error)
  # One Task whose 'inputs' are tokenized with another vocabulary than its 'targets'.
  with pytest.raises(ConfigError) as error:
    seqio_source.SeqioSource(seqio_tasks.SPLIT_VOCAB_TASK, "validation", LENGTHS, module="seqio_tasks",
                             max_examples=2)
  assert _one_line(error) == (
      f"seqio Task {seqio_tasks.SPLIT_VOCAB_TASK!r} tokenizes 'inputs' with {other_vocab} but 'targets' with "
      f"{vocab}; both features must use the same SentencePiece vocabulary (the one training uses)")
  # VOCAB_PATH must be the file every task uses; a Mixture all on the other vocabulary trains with it.
  with pytest.raises(ConfigError, match=f"VOCAB_PATH {other_vocab} is not the vocabulary"):
    seqio_lookup.seqio_vocab_path(seqio_tasks.FIXED_MIXTURE, "seqio_tasks", vocab_path=other_vocab)
  assert seqio_lookup.seqio_vocab_path(seqio_tasks.FIXED_MIXTURE, "seqio_tasks") == vocab
  assert seqio_lookup.seqio_vocab_path(seqio_tasks.OTHER_VOCAB_MIXTURE, "seqio_tasks") == other_vocab


def test_a_module_that_raises_at_import_is_named_in_one_line(task_data, tmp_path, monkeypatch, capsys):
  monkeypatch.syspath_prepend(str(tmp_path))
  modules = {"t5test_tasks_runtime": "raise RuntimeError('no credentials for the bucket\\nsecond line')\n",
             "t5test_tasks_key": "import os\nos.environ['T5TEST_NO_SUCH_VARIABLE']\n",
             "t5test_tasks_syntax": "x = 1\ndef broken(:\n  pass\n",
             "t5test_tasks_interrupted": "raise KeyboardInterrupt\n"}
  for name, text in modules.items():
    (tmp_path / f"{name}.py").write_text(text)
  expected = {"t5test_tasks_runtime": "RuntimeError: no credentials for the bucket",
              "t5test_tasks_key": "KeyError: 'T5TEST_NO_SUCH_VARIABLE'",
              "t5test_tasks_syntax": f"SyntaxError: invalid syntax ({tmp_path / 't5test_tasks_syntax.py'}, line 2)"}
  for name, what in expected.items():
    with pytest.raises(ConfigError) as error:
      seqio_lookup.get_mixture_or_task("no_such_task", name)
    assert _one_line(error) == f"cannot import MIXTURE_OR_TASK_MODULE {name!r}: {what}"
  with pytest.raises(KeyboardInterrupt):  # Ctrl-C still stops the run
    seqio_lookup.import_task_modules("t5test_tasks_interrupted")
  # The command: exit status 2, one line, nothing written.
  capsys.readouterr()
  argv = [a for a in _pretrain(tmp_path / "run", "no_such_task", 2) if "MIXTURE_OR_TASK_MODULE" not in a]
  assert cli.main(["train", *argv, "--gin.MIXTURE_OR_TASK_MODULE='t5test_tasks_runtime'"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err and [l for l in err.splitlines() if l.startswith("error:")] == [
      "error: cannot import MIXTURE_OR_TASK_MODULE 't5test_tasks_runtime': RuntimeError: no credentials for the "
      "bucket"]
  assert not os.path.exists(tmp_path / "run")


def test_a_task_whose_data_raises_is_named_in_one_line(task_data, seqio_tasks, monkeypatch):
  for task, what in ((seqio_tasks.BROKEN_SOURCE_TASK, "RuntimeError: the corpus of validation is gone"),
                     (seqio_tasks.BROKEN_PREPROCESSOR_TASK, "ValueError: cannot parse this row"),
                     (seqio_tasks.TRACE_BROKEN_PREPROCESSOR_TASK, "KeyError: 'title'")):
    with pytest.raises(DataError) as error:
      seqio_source.SeqioSource(task, "validation", LENGTHS, module="seqio_tasks", max_examples=2)
    message = _one_line(error)
    assert message.startswith(f"seqio Task {task!r} split 'validation': reading its examples failed")
    assert what in message and "second line" not in message
  # Ctrl-C while the examples are read still stops the run.
  seqio = importlib.import_module("seqio")

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(seqio.Task, "get_dataset", interrupted)
  with pytest.raises(KeyboardInterrupt):
    seqio_source.SeqioSource(seqio_tasks.TASK, "validation", LENGTHS, module="seqio_tasks", max_examples=2)


def test_mixture_rates_must_be_finite_numbers_at_least_0(task_data, seqio_tasks):
  for name, shown in ((seqio_tasks.NAN_RATE_MIXTURE, "must be finite, got nan"),
                      (seqio_tasks.NEGATIVE_RATE_MIXTURE, "must be >= 0, got -1")):
    for dp in (object(), None):  # DP or not
      with pytest.raises(ConfigError) as error:
        seqio_source.SeqioSource(name, "validation", LENGTHS, module="seqio_tasks", dp=dp, max_examples=2)
      assert _one_line(error) == f"seqio Mixture {name!r}: the rate of {seqio_tasks.OTHER_TASK!r} {shown}"
  with pytest.raises(ConfigError) as error:
    seqio_source.SeqioSource(seqio_tasks.ALL_ZERO_RATE_MIXTURE, "validation", LENGTHS, module="seqio_tasks")
  assert _one_line(error).startswith(f"seqio Mixture {seqio_tasks.ALL_ZERO_RATE_MIXTURE!r}: every rate is 0")


def test_a_task_of_rate_0_is_left_out_of_the_population(task_data, seqio_tasks, caplog):
  for name in (seqio_tasks.ZERO_RATE_MIXTURE, seqio_tasks.NESTED_ZERO_RATE_MIXTURE):  # directly, or its sub-mixture
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=seqio_source.__name__):
      mixture = seqio_source.SeqioSource(name, "validation", LENGTHS, module="seqio_tasks", dp=object(),
                                         max_examples=3)
    population = mixture.describe()["population"]
    assert population["tasks"] == {seqio_tasks.TASK: 3} and mixture.num_examples == 3
    assert population["rates"] == {seqio_tasks.TASK: 1.0}
    assert population["excluded_tasks"] == {seqio_tasks.OTHER_TASK: seqio_source.ZERO_RATE}
    json.dumps(population, allow_nan=False)
    logged = [r.getMessage() for r in caplog.records if r.name == seqio_source.__name__]
    assert len(logged) == 1 and seqio_tasks.OTHER_TASK in logged[0] and "\n" not in logged[0]
