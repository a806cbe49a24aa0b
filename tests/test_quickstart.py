"""The quickstart main job: scripts/quickstart.sh trains a DP vocabulary, then runs the quickstart
config (tiny T5, span corruption, DP by default) for a few steps on real text."""
import gzip
import json
import os
import subprocess

import gin
import pytest

from private_t5.stages import gin_utils

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(PROJECT_ROOT, "scripts", "quickstart.sh")


def test_script_is_valid_bash_and_config_is_private_by_default():
  subprocess.run(["bash", "-n", SCRIPT], check=True)
  gin_utils.parse(["configs/experiments/quickstart.gin"], [], check_required=False)
  assert gin.query_parameter("DP/macro.value") is not None  # DP-Adafactor unless --gin.DP=None
  assert gin.query_parameter("OBJECTIVE/macro.value") == "span_corruption"
  assert gin.query_parameter("TASK_FEATURE_LENGTHS/macro.value") == {"inputs": 128, "targets": 32}
  gin.clear_config()


@pytest.mark.slow
def test_quickstart_script_runs_a_few_steps(shared_data, tmp_path):
  # A small real corpus (the default embedded one needs a minute more for its vocabulary).
  corpus = tmp_path / "fortunes_small.jsonl"
  with gzip.open(os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz"), "rt") as src, \
      open(corpus, "w") as dst:
    for _, line in zip(range(600), src):
      dst.write(line)
  env = dict(os.environ, QUICKSTART_DIR=str(tmp_path / "qs"), QUICKSTART_VOCAB_SIZE="400",
             TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run(
      ["bash", SCRIPT, str(corpus), "--gin.TRAIN_STEPS=3", "--gin.train.log_every=1",
       "--gin.train.eval_examples=32", "--gin.train.mesh_shape=(1, 1)",
       f"--gin.DATA_CACHE_DIR={tmp_path / 'cache'}"],
      cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  out = done.stdout
  assert "training a 400-piece SentencePiece vocabulary" in out
  assert "(train batch, not DP)" in out and "privacy: ε = " in out
  model_dirs = [os.path.join(r, d) for r, ds, _ in os.walk(tmp_path / "qs") for d in ds if d == "model"]
  assert len(model_dirs) == 1
  summary = json.load(open(os.path.join(model_dirs[0], "summary.json")))
  assert summary["final_step"] == 3 and summary["private"] and summary["epsilon"] > 0
  assert summary["validation_not_dp"]["examples"] > 0
  assert summary["model_config"]["vocab_size"] == 512  # 400 + 100 sentinels, rounded up to 128
  report = json.load(open(os.path.join(model_dirs[0], "privacy_report.json")))
  assert report["steps"] == 3 and report["dp"] is True
  # The DP-SentencePiece vocabulary is composed with training by their DP events, below their sum.
  assert report["vocabulary"] == "dp" and [c["name"] for c in report["components"]] == ["dp_sentencepiece"]
  vocabulary_epsilon = report["components"][0]["epsilon"]
  assert report["epsilon_by_addition"] == pytest.approx(report["training_epsilon"] + vocabulary_epsilon)
  assert report["epsilon"] == report["epsilon_by_events"] < report["epsilon_by_addition"]
  assert report["training_epsilon"] < report["epsilon"]
  assert "DP vocabulary included" in out and "ε composed by events: ε = " in out
  # The next step it prints runs as printed (from any folder): the memorization stage on the
  # documents training read and those it held out, which the script wrote.
  lines = out.splitlines()
  i = next(k for k, line in enumerate(lines) if "[quickstart] next, how much training text" in line)
  assert "docs/memorization.md" in lines[i]
  command = " ".join(line.strip().rstrip("\\") for line in lines[i + 1:i + 4])
  assert command.split()[1] == "memorization"
  run_dir = os.path.dirname(model_dirs[0])
  counts = {name: sum(1 for _ in open(os.path.join(run_dir, "corpus", f"{name}.jsonl"))) for name in ("train", "valid")}
  assert counts["train"] + counts["valid"] == 600 and counts["valid"] > 0
  done = subprocess.run(["bash", "-c", command], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  report = json.load(open(os.path.join(run_dir, "memorization", "report.json")))
  sizes = report["splits"]["sizes"]
  assert sizes["train_dup"] + sizes["train_unique"] == counts["train"]
  assert sizes["valid_in_train"] + sizes["valid_unique"] == counts["valid"]
