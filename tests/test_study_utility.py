"""`private-t5 study --part=utility`: the bootstrap interval, bad input, and a smoke run whose
every ledger is checked against the table."""
import json
import shutil

import jax
import numpy as np
import pytest
from sklearn import metrics as sk_metrics

from private_t5.dp import privacy_report
from private_t5.eval import glue_metrics
from private_t5.stages import cli

from conftest import shared_or_fixture

# A micro T5 and a handful of steps (as tests/test_study.py): the smoke run checks the plumbing,
# the files and the privacy bookkeeping, not the numbers.
MICRO_ARGS = ["--gin.VOCAB_SIZE=512", "--gin.T5Config.d_model=32", "--gin.T5Config.num_heads=2",
              "--gin.T5Config.d_ff=64", "--gin.T5Config.num_encoder_layers=1", "--gin.T5Config.num_decoder_layers=1",
              "--gin.BATCH_SIZE=8", "--gin.train.microbatch_size=8", "--gin.TRAIN_STEPS=2",
              "--gin.train.eval_examples=16", "--gin.train.mesh_shape=(1, 1)",
              "--gin.train.insecure_deterministic_seed=1234", "--gin.TASK_FEATURE_LENGTHS={'inputs': 9, 'targets': 9}",
              # 1,800 training documents: enough words survive DP-SentencePiece at ε = 8.
              "--gin.run_utility_study.max_documents=2000", "--gin.run_utility_study.vocab_size=400",
              "--gin.run_utility_study.dp_vocab_epsilon=8.0", "--gin.run_utility_study.finetune_steps=2",
              "--gin.run_utility_study.finetune_batch_size=8", "--gin.run_utility_study.finetune_dp_batch_size=16",
              "--gin.run_utility_study.finetune_dp_steps=2",
              "--gin.run_utility_study.finetune_microbatch_size=8",
              "--gin.run_utility_study.finetune_feature_lengths={'inputs': 32, 'targets': 12}",
              "--gin.run_utility_study.max_eval_examples=24", "--gin.run_utility_study.bootstrap_samples=50",
              "--gin.run_utility_study.batch_sweep_sizes=[4, 8]", "--gin.run_utility_study.batch_sweep_examples=16",
              "--gin.run_utility_study.batch_sweep_microbatch_size=4"]
MODELS = ("nondp_span", "dp_span", "fulldp_span", "scratch")


def _direct_bootstrap(score, targets, predictions, num_samples, confidence, seed):
  rng = np.random.default_rng(seed)
  t, p = np.asarray(targets), np.asarray(predictions)
  scores = []
  for _ in range(num_samples):
    rows = rng.integers(0, len(t), len(t))
    scores.append(score(t[rows], p[rows]))
  tail = 100 * (1 - confidence) / 2
  return np.percentile(scores, [tail, 100 - tail])


@pytest.mark.parametrize("metric,score", [
    ("sst2", lambda t, p: 100 * np.mean(t == p)),
    # MRPC's headline: the mean of F1 (of class 1) and accuracy.
    ("mrpc", lambda t, p: (100 * sk_metrics.f1_score(t, p) + 100 * np.mean(t == p)) / 2),
])
def test_bootstrap_interval_equals_a_direct_bootstrap(metric, score):
  rng = np.random.default_rng(7)
  targets = rng.integers(0, 2, 120)
  predictions = np.where(rng.random(120) < 0.7, targets, 1 - targets)
  got = glue_metrics.bootstrap_interval(metric, targets, predictions, num_samples=200, confidence=0.9, seed=3)
  want = _direct_bootstrap(score, targets, predictions, 200, 0.9, 3)
  np.testing.assert_allclose(got, want, rtol=1e-9)
  point = glue_metrics.headline(glue_metrics.compute_metrics(metric, targets.tolist(), predictions.tolist()))
  assert got[0] <= point <= got[1]


def test_bootstrap_interval_narrows_with_more_examples():
  rng = np.random.default_rng(0)

  def width(n):
    t = rng.integers(0, 2, n)
    p = np.where(rng.random(n) < 0.75, t, 1 - t)
    low, high = glue_metrics.bootstrap_interval("accuracy", t, p, num_samples=300, seed=1)
    return high - low

  assert width(1600) < width(100) / 2  # about 1/sqrt(16) of it


@pytest.mark.parametrize("argv,message", [
    (["--part=utility", "--corpus=x", "--output={out}"], "give one of --task_dir"),
    (["--part=utility", "--corpus=x", "--output={out}", "--task_dir={tmp}"],
     "no task.json and no --text_fields, --label_field, --label_names describe task"),
    (["--part=utility", "--corpus=x", "--output={out}", "--task_dir={tmp}", "--label_names=a,b"],
     "missing text_fields, label_field"),
    (["--corpus=x", "--output={out}", "--label_names=a,b"], "--label_names is for --part=utility"),
    (["--part=utility", "--corpus=x", "--output={out}", "--task=glue"], "unknown task 'glue'"),
    (["--part=utility", "--corpus=x", "--output={out}", "--task_dir=/no/such/dir"], "task directory not found"),
    (["--corpus=x", "--output={out}", "--task_dir={tmp}"], "--task_dir is for --part=utility"),
    (["--part=utility", "--corpus=x", "--output={out}", "--task_dir={task}",
      "--gin.run_utility_study.models=['nondp_prefix']"], "models must be"),
    (["--part=utility", "--corpus=x", "--output={out}", "--task_dir={task}",
      "--gin.run_utility_study.batch_sweep_sizes=[6]", "--gin.run_utility_study.batch_sweep_microbatch_size=4"],
     "not a multiple"),
    (["--part=utility", "--corpus=x", "--output={out}", "--task_dir={task}",
      "--gin.run_utility_study.finetune_dp_batch_size=48", "--gin.run_utility_study.finetune_microbatch_size=32"],
     "must divide the DP fine-tuning batch 48"),
    (["--part=utility", "--corpus=x", "--output={out}", "--task_dir={task}",
      "--gin.run_utility_study.finetune_learning_rate=0"], "finetune_learning_rate must be a positive number"),
])
def test_bad_input_is_one_line(argv, message, tmp_path, capsys):
  out = tmp_path / "study"
  task = shared_or_fixture("glue_like/rotten_tomatoes")
  assert cli.main(["study"] + [a.format(out=out, tmp=tmp_path, task=task) for a in argv]) == 2
  err = [l for l in capsys.readouterr().err.strip().splitlines() if "[study] phase" not in l]
  assert len(err) == 1 and err[0].startswith("error:") and message in err[0]
  assert not out.exists()


def test_a_malformed_task_file_is_refused_before_the_first_phase(tmp_path, capsys):
  task = tmp_path / "rotten_tomatoes"
  shutil.copytree(shared_or_fixture("glue_like/rotten_tomatoes"), task)
  with open(task / "validation.tsv", "a", encoding="utf-8") as f:
    f.write("a review with a label that is no label\tmaybe\n")
  out = tmp_path / "study"
  assert cli.main(["study", "--part=utility", f"--corpus={tmp_path}/no_corpus.jsonl", f"--output={out}",
                   f"--task_dir={task}"]) == 2
  err = [l for l in capsys.readouterr().err.strip().splitlines() if l.startswith("error:")]
  assert len(err) == 1 and "validation.tsv" in err[0] and "invalid label 'maybe'" in err[0]
  assert not out.exists()


# The study's task: rotten_tomatoes's rows in a folder of another name, described by its task.json
# (a user's own task; a folder named like the built-in task is read without one).
TASK_NAME = "my_reviews"
TASK_JSON = {"text_fields": ["sentence"], "label_field": "label", "label_names": ["negative", "positive"],
             "metric": "sst2"}


@pytest.fixture(scope="module")
def utility_study(tmp_path_factory):
  # The fine-tuning runs of the four models share their shapes: one compilation serves them
  # all through JAX's persistent cache (in a temporary folder; the settings are restored after).
  saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                "jax_persistent_cache_min_compile_time_secs")}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  out = tmp_path_factory.mktemp("utility") / "study"
  task = out.parent / TASK_NAME
  task.mkdir()
  for split in ("train", "validation"):
    shutil.copy(shared_or_fixture(f"glue_like/rotten_tomatoes/{split}.tsv"), task / f"{split}.tsv")
  (task / "task.json").write_text(json.dumps(TASK_JSON))
  argv = ["study", "--part=utility", f"--corpus={shared_or_fixture('pretrain/fortunes.jsonl.gz')}",
          f"--task_dir={task}", f"--output={out}", *MICRO_ARGS]
  try:
    assert cli.main(argv) == 0
    yield out, argv
  finally:
    for key, value in saved.items():
      jax.config.update(key, value)


def test_utility_smoke_writes_the_table_and_resumes(utility_study, capsys):
  out, argv = utility_study
  results = json.loads((out / "results.json").read_text())["utility"]
  assert results["task"] == TASK_NAME and set(results["models"]) == set(MODELS)
  settings = json.loads((out / "utility_settings.json").read_text())
  assert settings["task_layout"] == {"name": TASK_NAME, "text_fields": {"sentence": "sentence"}, "label_field": "label",
                                     "label_names": ["negative", "positive"], "metric": "sst2"}
  for name, m in results["models"].items():
    assert {"private", "epsilon", "delta", "pretrain_validation_token_accuracy", "finetuned", "finetuned_dp"} <= set(m)
    for key in ("finetuned", "finetuned_dp"):
      f = m[key]
      assert f["metric"] == "sst2" and f["num_examples"] == 24
      assert f["ci"][0] <= f["value"] <= f["ci"][1] or f["ci"][0] == f["ci"][1] == f["value"]
    if name == "scratch":
      assert m["pretrain_validation_token_accuracy"] is None and not m["private"]
    else:
      assert 0.0 <= m["pretrain_validation_token_accuracy"] <= 1.0
  sweep = results["batch_sweep"]
  assert [(r["expected_batch_size"], r["private"], r["steps"]) for r in sweep] == [
      (4, True, 4), (4, False, 4), (8, True, 2), (8, False, 2)]
  for r in sweep:
    assert set(r) >= {"expected_batch_size", "noise_multiplier", "epsilon", "private", "validation_token_accuracy"}
    if r["private"]:
      assert r["epsilon"] == pytest.approx(8.0, rel=1e-3) and r["noise_batch_ratio"] == pytest.approx(
          r["noise_multiplier"] / r["expected_batch_size"])
  md = (out / "results.md").read_text()
  assert "Tables 1 and 2" in md and "Batch size at a fixed ε" in md and "What the numbers show" in md
  assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # A second run trains nothing and reproduces the table.
  assert cli.main(argv) == 0
  assert json.loads((out / "results.json").read_text())["utility"]["models"] == results["models"]
  # Other fine-tuning settings in the same folder: one error line, the finished runs untouched.
  assert cli.main(argv + ["--gin.run_utility_study.finetune_steps=3"]) == 2
  assert "other task, fine-tuning or batch-sweep settings" in capsys.readouterr().err
  # Another description of the task (a flag over task.json): the same refusal.
  assert cli.main(argv + ["--metric=accuracy"]) == 2
  assert "other task, fine-tuning or batch-sweep settings" in capsys.readouterr().err
  assert json.loads((out / "results.json").read_text())["utility"]["models"] == results["models"]


def test_every_ledger_is_what_the_table_says(utility_study):
  out, _ = utility_study
  results = json.loads((out / "results.json").read_text())["utility"]
  for name, m in results["models"].items():
    if name != "scratch":
      report = privacy_report.read_report(privacy_report.report_path(out / "models" / name / "run"))
      assert report["dp"] == m["private"]
      if not m["private"]:
        assert m["epsilon"] is None and report["total_epsilon"] is None
      elif m["epsilon_scope"] == "training + vocabulary":  # fulldp_span: DP-SentencePiece composed in
        assert report["vocabulary"] == "dp" and m["epsilon"] == pytest.approx(report["total_epsilon"])
        assert m["epsilon"] > report["training_epsilon"] and m["delta"] == pytest.approx(report["total_delta"])
      else:  # dp_span: a non-private vocabulary, the ledger's total is ∞; the table states training alone
        assert report["total_epsilon"] is None and m["epsilon"] == pytest.approx(report["training_epsilon"])
    public = privacy_report.read_report(privacy_report.report_path(out / "models" / name / "finetune_public" / "run"))
    assert not public["dp"] and m["finetuned"]["epsilon"] is None
    dp = privacy_report.read_report(privacy_report.report_path(out / "models" / name / "finetune_dp" / "run"))
    f = m["finetuned_dp"]
    assert dp["dp"] and dp["privacy_unit"] == "example"
    assert f["epsilon"] == pytest.approx(dp["training_epsilon"]) == pytest.approx(8.0, rel=1e-3)
    assert f["noise_multiplier"] == pytest.approx(dp["noise_multiplier"])
    assert f["expected_batch_size"] == 16 and dp["expected_batch_size"] == pytest.approx(16) and dp["steps"] == 2
    # The fine-tune's ledger covers the task's examples only: the vocabulary (DP-SentencePiece for
    # fulldp_span, of the corpus) is public for them, its report named but not composed.
    assert dp["vocabulary"] == "public" and f["ledger_epsilon"] == pytest.approx(dp["training_epsilon"])
    vocab = next(c for c in dp["components"] if c["name"] == "vocabulary")
    assert ("dp_report" in vocab) == (m["vocabulary"] == "dp_spm")
  for r in results["batch_sweep"]:
    report = privacy_report.read_report(privacy_report.report_path(r["run_dir"]))
    assert report["dp"] == r["private"] and report["steps"] == r["steps"]
    if r["private"]:
      assert report["training_epsilon"] == pytest.approx(r["epsilon"])
      assert report["noise_multiplier"] == pytest.approx(r["noise_multiplier"])
      assert report["expected_batch_size"] == pytest.approx(r["expected_batch_size"])
