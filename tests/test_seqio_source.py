"""A T5X user's seqio Task as `private-t5 train`'s data: a Task registered here (a function source
over real text, t5's span corruption) read as examples, pretrained on with DP then fine-tuned on
without, its population in the ledger; a Mixture whose rates come from the data refused in one line."""
import importlib
import importlib.util
import json
import os

import numpy as np
import pytest

from private_t5.data import seqio_source
from private_t5.data import source as source_lib
from private_t5.errors import ConfigError
from private_t5.stages import train as train_stage

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


def _pretrain(model_dir, task, steps, *extra):
  # The T5X command line's data flags: the Task and the module registering it (seqio.gin is layered).
  return ["--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.TRAIN_STEPS={steps}", f"--gin.MIXTURE_OR_TASK_NAME={task}",
          "--gin.MIXTURE_OR_TASK_MODULE=seqio_tasks", *MICRO_TRAIN_ARGS, *extra]


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
      "--gin.T5Config.dropout_rate=0.0",
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
