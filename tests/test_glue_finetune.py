"""Fine-tuning on a GLUE-layout task through the trainer, evaluation, and DP fine-tuning."""
import json
import math
import os

import numpy as np
import pytest

from private_t5.models import config as config_lib
from private_t5.data import glue_tasks
from private_t5.stages import evaluate as evaluate_stage
from private_t5.train import main as train_main
from private_t5.train import optimizers
from private_t5.dp import config as dp_config

from test_glue_tasks import train_test_vocab  # pylint: disable=g-bad-import-order
from conftest import expected

# Short inputs and a small vocabulary keep the run within a few minutes on 2 CPU cores.
LENGTHS = {"inputs": 32, "targets": 4}
VOCAB_SIZE = 1024


@pytest.fixture(scope="module")
def vocab(shared_data, tmp_path_factory):
  return train_test_vocab(shared_data, tmp_path_factory.mktemp("vocab") / "glue.model")


@pytest.fixture(scope="module")
def rotten_tomatoes(vocab):
  train = glue_tasks.GlueSource("rotten_tomatoes", "train", vocab, LENGTHS, vocab_size=VOCAB_SIZE)
  validation = glue_tasks.GlueSource("rotten_tomatoes", "validation", vocab, LENGTHS, vocab_size=VOCAB_SIZE)
  return train, validation


def _tiny_config():
  return config_lib.load_preset("t5_1_0_tiny", vocab_size=VOCAB_SIZE, dropout_rate=0.0)


@pytest.mark.slow
def test_finetuned_tiny_model_beats_majority_class(tmp_path, vocab, rotten_tomatoes):
  train, validation = rotten_tomatoes
  model_dir = str(tmp_path / "ft")
  # From random initialisation, so a larger constant rate than T5's 1e-3 for pretrained weights.
  summary = train_main.train(
      model_config=_tiny_config(), train_data=train, validation_data=validation, model_dir=model_dir,
      train_steps=400, batch_size=32, learning_rate=optimizers.constant_schedule(1e-2), dp=None,
      vocab_path=vocab, checkpoint_every=400, eval_every=0, eval_examples=64, log_every=50,
      mesh_shape=(1, 1), insecure_deterministic_seed=3)
  assert summary["final_step"] == 400
  rc = evaluate_stage.main(["--gin_file=configs/runs/eval.gin", f"--gin.MODEL_DIR={model_dir}",
                          "--gin.MIXTURE_OR_TASK_NAME=rotten_tomatoes",
                          f"--gin.TASK_FEATURE_LENGTHS={LENGTHS!r}", "--gin.evaluate.batch_size=256"])
  assert rc == 0
  with open(os.path.join(model_dir, "eval", "results.json")) as f:
    results = json.load(f)
  task = results["tasks"]["rotten_tomatoes"]
  assert task["num_examples"] == expected(1366, 300)
  assert task["majority_baseline"]["prediction"] == "positive"
  majority = task["majority_baseline"]["metrics"]["accuracy"]
  assert 50.0 < majority < 60.0
  # Beyond the noise of 1366 examples (one standard error is about 1.3 points).
  assert task["metrics"]["accuracy"] > majority + 3.0, task
  assert results["average"] == pytest.approx(task["score"])
  with open(os.path.join(model_dir, "eval", "results.md")) as f:
    table = f.read()
  assert "| majority class |" in table and "rotten_tomatoes" in table


@pytest.mark.slow
def test_dp_finetuning_writes_a_ledger_over_the_finetuning_set(tmp_path, vocab, rotten_tomatoes):
  train, validation = rotten_tomatoes
  model_dir = str(tmp_path / "ft_dp")
  dp = dp_config.DPConfig(clip_norm=1.0, noise_multiplier=1.0)
  summary = train_main.train(
      model_config=_tiny_config(), train_data=train, validation_data=validation, model_dir=model_dir,
      train_steps=4, batch_size=32, learning_rate=optimizers.constant_schedule(1e-3), dp=dp,
      vocab_path=vocab, checkpoint_every=4, eval_every=0, eval_examples=32, log_every=2,
      mesh_shape=(1, 1), insecure_deterministic_seed=4)
  assert summary["private"]
  with open(os.path.join(model_dir, "privacy_report.json")) as f:
    report = json.load(f)
  assert report["privacy_unit"] == "example"
  assert report["num_examples"] == train.num_examples == expected(10028, 3000)
  assert report["steps"] == 4
  # The test vocabulary is trained on the fine-tuning set itself, without DP: total ε = ∞, and
  # DP-Adafactor's own ε is reported beside it.
  assert report["epsilon"] is None and report["vocabulary"] == "not private"
  assert math.isfinite(report["training_epsilon"]) and report["training_epsilon"] > 0
  assert report["delta"] <= 1.0 / train.num_examples
  # The ledger is stored in the checkpoint too (restore_for_inference returns its report).
  from private_t5.models import checkpoint_read  # pylint: disable=g-import-not-at-top
  params, config, info = checkpoint_read.restore_for_inference(model_dir)
  assert info["privacy_report"]["training_epsilon"] == pytest.approx(report["training_epsilon"])
  assert info["vocab_path"] == os.path.abspath(vocab)
  assert np.all(np.isfinite(params["token_embedder"]["embedding"]))
  assert config.vocab_size == VOCAB_SIZE


@pytest.mark.slow
def test_dp_finetune_gin_from_imported_hf_weights(tmp_path, vocab):
  """`private-t5 train` + finetune_dp.gin starts from a Hugging Face T5 directory."""
  import shutil  # pylint: disable=g-import-not-at-top
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  from private_t5.models import checkpoint_read  # pylint: disable=g-import-not-at-top
  from private_t5.models import hf_convert  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  # The shapes of configs/models/t5_1_0_tiny.gin with VOCAB_SIZE=1024.
  hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
      vocab_size=VOCAB_SIZE, d_model=128, d_kv=32, d_ff=512, num_layers=2, num_heads=4,
      feed_forward_proj="relu"))
  hf_dir = str(tmp_path / "hf_t5")
  hf.save_pretrained(hf_dir)
  shutil.copy(vocab, os.path.join(hf_dir, "spiece.model"))  # the vocabulary travels with the weights
  model_dir = str(tmp_path / "ft_dp_gin")
  rc = cli.main(["train", "--gin_file=configs/models/t5_1_0_tiny.gin", "--gin_file=configs/runs/finetune_dp.gin",
                 f"--gin.MODEL_DIR={model_dir}", f"--gin.INITIAL_CHECKPOINT={hf_dir}",
                 "--gin.MIXTURE_OR_TASK_NAME=rotten_tomatoes", f"--gin.VOCAB_SIZE={VOCAB_SIZE}",
                 "--gin.TRAIN_STEPS=2", "--gin.BATCH_SIZE=32", f"--gin.TASK_FEATURE_LENGTHS={LENGTHS!r}",
                 "--gin.train.mesh_shape=(1, 1)", "--gin.train.eval_examples=32", "--gin.train.log_every=1",
                 "--gin.train.insecure_deterministic_seed=5"])
  assert rc == 0
  with open(os.path.join(model_dir, "privacy_report.json")) as f:
    report = json.load(f)
  assert report["dp"] and report["privacy_unit"] == "example" and report["num_examples"] == expected(10028, 3000)
  assert report["epsilon"] is None  # the vocabulary comes from the fine-tuning set, without DP
  assert math.isfinite(report["training_epsilon"]) and report["training_epsilon"] <= 8.0 + 1e-6
  params, _, info = checkpoint_read.restore_for_inference(model_dir)
  assert info["vocab_path"] == os.path.abspath(os.path.join(hf_dir, "spiece.model"))
  # Two small steps from the imported weights stay near them (a random init would be far).
  start, _ = hf_convert.import_hf_t5(hf_dir)
  moved = np.linalg.norm(params["encoder"]["layers_0"]["mlp"]["wi"]["kernel"]
                         - start["encoder"]["layers_0"]["mlp"]["wi"]["kernel"])
  assert moved < 0.1 * np.linalg.norm(start["encoder"]["layers_0"]["mlp"]["wi"]["kernel"])
  # A model gin file of other shapes is refused with a clear error (exit 2).
  rc = cli.main(["train", "--gin_file=configs/models/t5_1_1_tiny.gin", "--gin_file=configs/runs/finetune.gin",
                 f"--gin.MODEL_DIR={tmp_path / 'other'}", f"--gin.INITIAL_CHECKPOINT={hf_dir}",
                 "--gin.MIXTURE_OR_TASK_NAME=rotten_tomatoes", f"--gin.VOCAB_SIZE={VOCAB_SIZE}",
                 "--gin.TRAIN_STEPS=2", "--gin.BATCH_SIZE=32", f"--gin.TASK_FEATURE_LENGTHS={LENGTHS!r}",
                 "--gin.train.mesh_shape=(1, 1)"])
  assert rc == 2
