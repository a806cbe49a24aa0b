"""The one-run privacy audit end to end: `canaries --audit` -> `train` -> `memorization --gin.AUDIT`.

A micro T5 (tests/micro_run.py) on 100 fortunes plus 64 random-word audit canaries: without DP,
the included canaries repeated 20 times are memorized and the audit proves a clearly positive ε;
with DP (a few steps, repetitions 1) the audit's bound stays at most the ledger's ε.
"""
import json
import os

import pytest

from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab, split_corpus

QUICKSTART = "configs/experiments/quickstart.gin"
SPLIT_CONFIG_FLAGS = ["--gin.SplitConfig.num_perm=900", "--gin.SplitConfig.num_bands=90",
                      "--gin.SplitConfig.num_workers=1"]


def _run(tmp, name, corpus, valid, vocab, repetitions, train_flags):
  from private_t5.stages import cli
  from private_t5.stages import train as train_stage
  data = tmp / name / "data"
  train = str(data / "train.jsonl")
  assert cli.main(["canaries", "--audit", f"--corpus={corpus}", f"--output={train}", "--num_canaries=64",
                   "--canary_length=6", f"--repetitions={repetitions}", "--seed=1"]) == 0
  record = str(data / "train.audit.json")
  model_dir = tmp / name / "model"
  train_stage.run_from_args([f"--gin_file={QUICKSTART}", f"--gin.MODEL_DIR={model_dir}", f"--gin.CORPUS={train}",
                      f"--gin.VOCAB_PATH={vocab}", f"--gin.DATA_CACHE_DIR={tmp / 'cache'}", *MICRO_TRAIN_ARGS,
                      "--gin.make_source.max_documents=None", "--gin.VOCAB_IS_PUBLIC=True",
                      "--gin.OBJECTIVE='prefix_lm'", "--gin.train.eval_examples=8", *train_flags])
  out = tmp / name / "memorization"
  assert cli.main(["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={model_dir}",
                   f"--gin.TRAIN_CORPUS={train}", f"--gin.VALID_CORPUS={valid}", f"--gin.OUTPUT_DIR={out}",
                   "--gin.PROMPT_LENGTH=4", "--gin.GENERATION_LENGTH=4", "--gin.BATCH_SIZE=4",
                   "--gin.MAX_EXAMPLES_PER_SPLIT=4", f"--gin.AUDIT={record}",
                   "--gin.run_memorization.audit_guesses=16", *SPLIT_CONFIG_FLAGS]) == 0
  assert not any(f.endswith(".audit.json") for _, _, files in os.walk(model_dir) for f in files)
  return json.loads((out / "report.json").read_text()), out


@pytest.mark.slow
def test_audit_separates_a_non_dp_model_and_respects_a_dp_models_epsilon(shared_data, tmp_path):
  corpus, vocab = fortunes_corpus_and_vocab(shared_data, str(tmp_path))
  base, valid = split_corpus(corpus, str(tmp_path), 100, 40)

  # Non-private, each included canary 20 times: memorized, so the guesses are (nearly) all right.
  report, out = _run(tmp_path, "nondp", base, valid, vocab, 20,
                     ["--gin.DP=None", "--gin.BATCH_SIZE=32", "--gin.TRAIN_STEPS=100",
                      "--gin.rsqrt_schedule.warmup_steps=10"])
  audit = report["audit"]
  assert {"epsilon_lower_bound", "confidence", "num_canaries", "guesses", "correct", "ledger_epsilon"} <= set(audit)
  assert audit["num_canaries"] == 64 and audit["guesses"] == 32 and audit["confidence"] == 0.95
  assert audit["ledger_epsilon"] is None and not audit["violation"]
  assert audit["correct"] >= 30 and audit["epsilon_lower_bound"] > 1.5, audit
  assert audit["mean_loss_included"] < audit["mean_loss_excluded"]
  assert "Privacy audit" in (out / "report.md").read_text() and (out / "audit.png").stat().st_size > 0

  # DP (σ = 1, a few steps), each included canary once: the bound is at most the ledger's ε.
  report, out = _run(tmp_path, "dp", base, valid, vocab, 1, ["--gin.TRAIN_STEPS=3"])
  audit = report["audit"]
  assert audit["ledger_epsilon"] == pytest.approx(report["epsilon"]) and audit["ledger_epsilon"] > 0
  assert audit["delta"] == pytest.approx(report["privacy_report"]["delta"])
  assert audit["comparable_with_ledger"] and not audit["violation"]
  assert audit["epsilon_lower_bound"] <= audit["ledger_epsilon"], audit
  assert "PRIVACY AUDIT FAILED" not in (out / "report.md").read_text()
