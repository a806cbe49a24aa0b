"""`private-t5 train`: Gin layering, required macros, a real DP run end to end, resume,
the one-flag non-private baseline, and refusal of a MODEL_DIR holding another model."""
import gzip
import json
import os
import shutil

import gin
import jax
import numpy as np
import pytest

from private_t5.stages import cli, gin_utils
from private_t5.dp import accounting
from private_t5.errors import CheckpointError, ConfigError, PrivacyError
from private_t5.dp import mechanism as privacy
from private_t5.dp import config as config_lib
from private_t5.models import checkpoint_read, checkpoints
from private_t5.stages import train as train_stage
from private_t5.train import main, metrics

from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab

QUICKSTART = "configs/experiments/quickstart.gin"


@pytest.fixture(scope="module")
def corpus_and_vocab(shared_data, tmp_path_factory):
  return fortunes_corpus_and_vocab(shared_data, str(tmp_path_factory.mktemp("vocab")))


def _args(model_dir, corpus, vocab, steps, *extra):
  return ["--gin_file=" + QUICKSTART, f"--gin.MODEL_DIR={model_dir}", f"--gin.CORPUS={corpus}",
          f"--gin.VOCAB_PATH={vocab}", f"--gin.TRAIN_STEPS={steps}",
          f"--gin.DATA_CACHE_DIR={os.path.dirname(vocab)}/cache", *MICRO_TRAIN_ARGS, *extra]


def test_missing_required_macro_is_named():
  with pytest.raises(ConfigError, match=r"CORPUS, MODEL_DIR, VOCAB_PATH"):
    train_stage.run_from_args(["--gin_file=" + QUICKSTART])
  with pytest.raises(ConfigError, match=r"missing required Gin macro\(s\): VOCAB_PATH"):
    train_stage.run_from_args(["--gin_file=" + QUICKSTART, "--gin.MODEL_DIR=/tmp/x", "--gin.CORPUS=x"])


@pytest.mark.parametrize("stage,gin_files,missing", [
    ("memorization", ["configs/runs/memorization.gin"], "MODEL_DIR, OUTPUT_DIR, TRAIN_CORPUS, VALID_CORPUS"),
    ("evaluate", ["configs/runs/eval.gin"], "MIXTURE_OR_TASK_NAME, MODEL_DIR"),
    ("jft", [QUICKSTART, "configs/runs/jft.gin"], "CORPUS, MODEL_DIR, REDACTED_CORPUS, VOCAB_PATH"),
    ("adaptive", [QUICKSTART, "configs/runs/adaptive.gin"],
     "CORPUS, MODEL_DIR, REFERENCE_MODEL_DIR, VOCAB_PATH"),
])
def test_every_gin_stage_names_missing_macros(stage, gin_files, missing, capsys):
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  assert cli.main([stage] + [f"--gin_file={f}" for f in gin_files]) == 2
  assert f"missing required Gin macro(s): {missing}" in capsys.readouterr().err


def test_unknown_gin_name_is_named():
  with pytest.raises(ConfigError, match="'train' doesn't have a parameter named 'bogus_steps'"):
    train_stage.run_from_args(["--gin_file=" + QUICKSTART, "--gin.train.bogus_steps=3"])
  with pytest.raises(ConfigError, match="No configurable matching 'NoSuchThing'"):
    train_stage.run_from_args(["--gin_file=" + QUICKSTART, "--gin.NoSuchThing.x=3"])
  with pytest.raises(ConfigError, match="unknown flag"):
    train_stage.run_from_args(["--gin_file=" + QUICKSTART, "--steps=3"])


@pytest.mark.parametrize("stage,args", [
    ("train", ["--gin_file=" + QUICKSTART, "--gin.CORPUS=missing.jsonl", "--gin.VOCAB_PATH=missing.model"]),
    ("evaluate", ["--gin_file=configs/runs/eval.gin", "--gin.MIXTURE_OR_TASK_NAME=sst2"]),
    ("memorization", ["--gin_file=configs/runs/memorization.gin", "--gin.TRAIN_CORPUS=missing.jsonl",
                      "--gin.VALID_CORPUS=missing.jsonl", "--gin.OUTPUT_DIR=out"]),
    ("study", ["--corpus=missing.jsonl", "--output=study"]),
])
def test_gin_stages_keep_tensorflow_off_the_accelerators(stage, args, tmp_path, monkeypatch):
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  from private_t5.train import partitioning  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(partitioning, "hide_accelerators_from_tensorflow", lambda: calls.append(stage))
  monkeypatch.chdir(tmp_path)
  # The stage starts (its Gin parses) and then stops at the missing input, with TF's GPUs hidden first.
  model_dir = [] if stage == "study" else [f"--gin.MODEL_DIR={tmp_path / 'model'}"]
  assert cli.main([stage, *args, *model_dir]) != 0
  assert calls == [stage]


def test_layering_and_overrides():
  # model file -> run file -> experiment -> flags: later layers win.
  gin_utils.parse(["configs/models/t5_1_0_tiny.gin", "configs/runs/pretrain.gin"], ["MODEL_DIR=/tmp/a"], check_required=False)
  assert gin.query_parameter("BATCH_SIZE/macro.value") == 128
  assert gin.query_parameter("VOCAB_SIZE/macro.value") == 8320
  gin_utils.parse([QUICKSTART], ["BATCH_SIZE=16", "DP=None", "T5Config.d_model=64"], check_required=False)
  assert gin.query_parameter("BATCH_SIZE/macro.value") == 16  # flag over experiment over run
  assert gin.query_parameter("VOCAB_SIZE/macro.value") == 2176  # experiment over model file
  assert gin.query_parameter("T5Config.d_model") == 64
  assert gin.query_parameter("DP/macro.value") is None
  assert gin.query_parameter("training/make_source.split") == "train"
  assert gin.query_parameter("validation/make_source.split") == "validation"
  gin.clear_config()


def test_console_and_summary_label_private_statistics_and_insecure_noise():
  printer = metrics.ProgressPrinter(10)
  printer.add_examples(8)
  assert "ex/s (not DP)" in printer.line(1, 2.0, 0.5, epsilon=1.0, private=True)
  # A total ε with a DP vocabulary composed in says so; training's own ε alone is shown as is.
  assert printer.line(1, 2.0, 0.5, epsilon=10.12, training_epsilon=0.12).endswith(
      "ε 10.12 (total; training alone 0.12)")
  assert printer.line(1, 2.0, 0.5, epsilon=0.12, training_epsilon=0.12).endswith("ε 0.12")
  assert printer.line(1, 2.0, 0.5, epsilon=float("inf"), training_epsilon=0.12).endswith(
      "ε ∞ (total; training alone 0.12)")
  assert "(not DP)" not in printer.line(2, 2.0, 0.5, private=False).split("ex/s")[1]
  # The first step of a session (mostly compilation) counts neither in the rates nor in the ETA.
  printer.restart(3)
  assert "ETA" not in printer.line(3, 2.0, 0.5) and "steps/s" not in printer.line(3, 2.0, 0.5)
  assert "ETA " in printer.line(4, 2.0, 0.5)
  assert {"examples_per_second", "real_row_fraction"} <= set(metrics.NOT_DP_SUMMARY_KEYS)
  from private_t5.dp.ledger import PrivacyLedger  # pylint: disable=g-import-not-at-top
  ledger = PrivacyLedger.create(noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, num_examples=1000,
                                sampling_rate=0.01, noise_secret=False)
  ledger.record_steps(10)
  summary = {"final_step": 10, "model_dir": "run", "checkpoint_dir": "run/checkpoints", "config_gin": "run/config.gin",
             "tensorboard_dir": "run/tensorboard", "privacy_report": "run/privacy_report.json",
             "real_row_fraction": 0.25, "private": True, "epsilon": ledger.total_epsilon(),
             "delta": ledger.total_delta()}
  lines = []
  main.print_final(summary, ledger, lines.append)
  assert any(line.startswith("  real rows:") and line.endswith("(not DP)") for line in lines)
  assert any(line.startswith("  WARNING: NO PRIVACY GUARANTEE") for line in lines)
  lines.clear()
  main.print_final(dict(summary, private=False), PrivacyLedger.non_private_baseline(), lines.append)
  assert not any("not DP" in line or "WARNING" in line for line in lines)
  # A DP vocabulary composed by events: the total, and both numbers it is checked against.
  from private_t5.dp import accounting  # pylint: disable=g-import-not-at-top
  params = accounting.thresholded_gaussian_parameters(1e-8, l2=8.0, linf=1.0, max_distinct=64, target_epsilon=3.0)
  event = {k: params[k] for k in ("noise_multiplier", "delta_gaussian", "delta_threshold")}
  ledger.add_component("dp_sentencepiece", params["epsilon"], params["delta"], "vocab/privacy_report.json",
                       details={"event": event})
  lines.clear()
  main.print_final(dict(summary, epsilon=ledger.total_epsilon(), delta=ledger.total_delta()), ledger, lines.append)
  composed = [line for line in lines if line.startswith("  ε composed by events: ε = ")]
  assert len(composed) == 1 and f"= {ledger.epsilon_by_addition():.4g}" in composed[0]
  assert f"training {ledger.training_epsilon():.4g} + dp_sentencepiece 3" in composed[0]
  assert any(line.startswith(f"  privacy: ε = {ledger.epsilon_by_events():.4g} at δ") for line in lines)


@pytest.mark.slow
def test_dp_run_end_to_end_then_resume(corpus_and_vocab, tmp_path, monkeypatch, capsys):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  summary = train_stage.run_from_args(_args(model_dir, corpus, vocab, 4, "--gin.train.checkpoint_every=2",
                                     "--gin.train.log_every=2", "--gin.train.eval_every=2"))
  assert summary["final_step"] == 4 and summary["private"]
  for name in ("config.gin", "summary.json", "privacy_report.json"):
    assert os.path.isfile(os.path.join(model_dir, name)), name
  assert "train.batch_size = %BATCH_SIZE" in open(os.path.join(model_dir, "config.gin")).read()
  report = json.load(open(os.path.join(model_dir, "privacy_report.json")))
  assert report["steps"] == 4 and report["privacy_unit"] == "document" and report["noise_multiplier"] == 1.0
  q = report["sampling_rate"]
  assert q == pytest.approx(0.5 / report["num_examples"])
  mechanism_delta = config_lib.default_delta(report["num_examples"])  # min(1e-5, 1 / N^1.1)
  expected_eps = accounting.compute_epsilon(1.0, q, 4, mechanism_delta, "auto")
  assert report["accountant_used"] in ("rdp", "pld")
  assert expected_eps == pytest.approx(min(report["epsilon_rdp"], report["epsilon_pld"]))
  assert report["training_epsilon"] == pytest.approx(expected_eps)
  assert summary["training_epsilon"] == pytest.approx(expected_eps)
  # The vocabulary was trained on the same private corpus without DP: the total ε is ∞.
  assert summary["epsilon"] is None and report["epsilon"] is None and summary["vocabulary"] == "not private"
  assert {"name": "vocabulary", "private": False} in [
      {k: c[k] for k in ("name", "private")} for c in report["components"]]
  out = capsys.readouterr().out
  assert "privacy: ε = ∞ (vocabulary NOT private" in out and "DP-Adafactor ε = " in out
  assert "validation token accuracy" in out and "not DP" in out
  assert summary["validation_not_dp"]["examples"] > 0 and "validation" not in summary
  # Throughput counts private examples: labelled; the fixed test seed makes the report no guarantee.
  assert "ex/s (not DP)" in out and "padding, not DP)" in out
  assert {"examples_per_second", "real_row_fraction", "validation_not_dp"} <= set(summary["not_dp"])
  assert summary["examples_per_second"] > 0 and json.load(open(os.path.join(model_dir, "summary.json")))["not_dp"]
  assert report["noise_secret"] is False and report["warnings"][0].startswith("NO PRIVACY GUARANTEE")
  assert "WARNING: NO PRIVACY GUARANTEE" in out
  # Untruncated Poisson sampling by default: no cap, no truncation term in δ.
  assert report["truncation_probability"] == 0 and report["max_batch_size"] is None
  assert report["truncation_delta"] == 0 and report["batch_size"] == 8
  assert report["clipping_method"] == "ghost"
  # TensorBoard: private-batch and validation metrics carry the not-DP label, ε is logged.
  train_tags = metrics.read_scalars(os.path.join(model_dir, "tensorboard", "train"))
  assert {"nondp/loss", "nondp/token_accuracy", "privacy/training_epsilon"} <= set(train_tags)
  assert "privacy/epsilon" not in train_tags  # ∞ with a non-private vocabulary
  assert "loss" not in train_tags
  val_tags = metrics.read_scalars(os.path.join(model_dir, "tensorboard", "validation"))
  assert [s for s, _ in val_tags["nondp/token_accuracy"]] == [2, 4]
  assert "token_accuracy" not in val_tags and "loss" not in val_tags
  # Every checkpoint holds the ledger of exactly its step.
  manager = checkpoints.CheckpointManager(model_dir)
  assert manager.all_steps() == [2, 4]
  assert manager.read_metadata(2)["ledger"]["steps"] == 2
  assert manager.read_metadata(4)["ledger"]["delta"] == pytest.approx(mechanism_delta)
  manager.close()
  params, config, info = checkpoint_read.restore_for_inference(model_dir)
  assert config.d_model == 32 and info["step"] == 4 and info["vocab_path"] == os.path.abspath(vocab)
  assert info["privacy_report"]["steps"] == 4
  assert params["token_embedder"]["embedding"].shape == (512, 32)

  # Same command with more steps: resumes at 4, continues the ledger to 6.
  resumed = train_stage.run_from_args(_args(model_dir, corpus, vocab, 6, "--gin.train.checkpoint_every=2"))
  assert resumed["resumed_from_step"] == 4 and resumed["steps_this_run"] == 2 and resumed["final_step"] == 6
  report = json.load(open(os.path.join(model_dir, "privacy_report.json")))
  assert report["steps"] == 6
  assert report["training_epsilon"] == pytest.approx(accounting.compute_epsilon(1.0, q, 6, mechanism_delta, "auto"))

  # Another model in the same MODEL_DIR is refused, naming the difference.
  with pytest.raises(CheckpointError, match=r"another run \(first difference: .model_config\.d_"):
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 8, "--gin.T5Config.d_model=64"))
  # Fine-tuning style: a new run starting from this run's parameters (fresh optimizer and ledger).
  finetuned_dir = str(tmp_path / "from_initial")
  reads = []
  restore = checkpoint_read.restore_for_inference
  monkeypatch.setattr(checkpoint_read, "restore_for_inference", lambda *a, **k: reads.append(a) or restore(*a, **k))
  finetuned = train_stage.run_from_args(_args(finetuned_dir, corpus, vocab, 1, f"--gin.train.initial_checkpoint={model_dir}"))
  assert finetuned["final_step"] == 1
  assert len(reads) == 1  # the initial checkpoint's weights are read once
  monkeypatch.undo()
  manager = checkpoints.CheckpointManager(finetuned_dir)
  assert manager.read_metadata(1)["initial_checkpoint"]["step"] == 6
  assert manager.read_metadata(1)["ledger"]["steps"] == 1
  manager.close()
  # So is another privacy mechanism.
  with pytest.raises(CheckpointError, match="privacy.noise_multiplier"):
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 8, "--gin.DPConfig.noise_multiplier=2.0"))


@pytest.mark.slow
def test_ghost_switch_trains_like_vmap(corpus_and_vocab, tmp_path):
  """DPConfig.method="ghost": same sampler, keys, clip and noise, so the same parameters."""
  corpus, vocab = corpus_and_vocab
  runs = {}
  for method in ("vmap", "ghost"):
    model_dir = str(tmp_path / method)
    summary = train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, f"--gin.DPConfig.method='{method}'",
                                       "--gin.train.eval_every=0", "--gin.train.checkpoint_every=2"))
    params, _, info = checkpoint_read.restore_for_inference(model_dir)
    runs[method] = (summary, params, info)
  (s_v, p_v, info_v), (s_g, p_g, info_g) = runs["vmap"], runs["ghost"]
  assert s_g["training_epsilon"] == s_v["training_epsilon"] and s_g["delta"] == s_v["delta"]
  for a, b in zip(jax.tree.leaves(p_v), jax.tree.leaves(p_g)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert info_g["objective"] == "span_corruption" and info_g["privacy_unit"] == "document"
  assert info_g["vocab_sha256"] == info_v["vocab_sha256"] and len(info_g["vocab_sha256"]) == 64
  with pytest.raises(ConfigError, match="method must be one of"):
    train_stage.run_from_args(_args(str(tmp_path / "bad"), corpus, vocab, 1, "--gin.DPConfig.method='loop'"))


@pytest.mark.slow
def test_non_private_baseline_is_one_flag(corpus_and_vocab, tmp_path):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "baseline")
  summary = train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, "--gin.DP=None"))
  assert summary["private"] is False and summary["epsilon"] is None
  report = json.load(open(os.path.join(model_dir, "privacy_report.json")))
  assert report["dp"] is False and report["epsilon"] is None and report["steps"] == 2
  assert summary["validation"]["examples"] > 0


def test_invalid_privacy_parameters_fail_before_compute(corpus_and_vocab, tmp_path):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "bad")
  with pytest.raises(PrivacyError, match="noise_multiplier"):
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, "--gin.DPConfig.noise_multiplier=0.0"))
  with pytest.raises(PrivacyError, match="clip_norm"):
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, "--gin.DPConfig.clip_norm=-1.0"))
  with pytest.raises(PrivacyError, match="larger than the dataset"):
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, "--gin.DPConfig.expected_batch_size=100000"))
  with pytest.raises(PrivacyError, match="exactly one"):
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, "--gin.DPConfig.target_epsilon=3.0"))
  assert not os.path.exists(os.path.join(model_dir, "checkpoints", "0"))


def test_resume_with_another_length_under_target_epsilon_says_how_to_extend_and_keeps_the_summary(corpus_and_vocab, tmp_path):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  target = ("--gin.DPConfig.noise_multiplier=None", "--gin.DPConfig.target_epsilon=100.0")
  train_stage.run_from_args(_args(model_dir, corpus, vocab, 1, *target))
  sigma = json.load(open(os.path.join(model_dir, "privacy_report.json")))["noise_multiplier"]
  # σ was calibrated for 1 step: 2 steps calibrate another σ, and the run cannot resume as it is.
  with pytest.raises(CheckpointError, match=r"first difference: 'privacy.noise_multiplier'.*σ was calibrated for "
                     r"target_epsilon=100 over the checkpoint run's own TRAIN_STEPS.*keep the original TRAIN_STEPS.*"
                     r"--gin.DPConfig.noise_multiplier=<the checkpoint's σ> --gin.DPConfig.target_epsilon=None"):
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, *target))
  # Extended with σ fixed at the checkpoint's: it resumes, and ε grows past the target.
  extended = train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, f"--gin.DPConfig.noise_multiplier={sigma!r}"))
  report = json.load(open(os.path.join(model_dir, "privacy_report.json")))
  assert extended["final_step"] == 2 and report["steps"] == 2 and report["noise_multiplier"] == sigma
  # Started again once finished: nothing to train, and summary.json keeps the run's figures.
  before = open(os.path.join(model_dir, "summary.json")).read()
  config_gin = os.path.join(model_dir, "config.gin")
  os.utime(config_gin, (1, 1))
  files = sorted(os.path.join(d, f) for d, _, fs in os.walk(model_dir) for f in fs)
  again = train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, f"--gin.DPConfig.noise_multiplier={sigma!r}"))
  assert again["steps_this_run"] == 0 and open(os.path.join(model_dir, "summary.json")).read() == before
  recorded = json.loads(before)  # what it returns keeps the validation figures it recorded, too
  key = next(k for k in ("validation", "validation_not_dp") if recorded.get(k))
  assert again[key] == recorded[key]
  # ... and writes nothing: config.gin is not rewritten, no TensorBoard file is added.
  assert os.path.getmtime(config_gin) == 1
  assert sorted(os.path.join(d, f) for d, _, fs in os.walk(model_dir) for f in fs) == files
  assert json.loads(before)["steps_this_run"] == 1 and json.loads(before)["examples_per_second"] > 0


def test_a_run_resumes_from_its_corpus_moved_to_another_path(corpus_and_vocab, tmp_path):
  """The checkpoint names the data by its token store's digest: the same bytes at a new path resume;
  other bytes at that path are refused."""
  corpus, vocab = corpus_and_vocab
  old = tmp_path / "disk1" / "train.jsonl.gz"
  old.parent.mkdir()
  shutil.copyfile(corpus, old)
  model_dir = str(tmp_path / "run")
  train_stage.run_from_args(_args(model_dir, str(old), vocab, 1))
  new = tmp_path / "disk2" / "train.jsonl.gz"
  new.parent.mkdir()
  os.rename(old, new)
  with gzip.open(new, "rt") as f:
    rows = f.readlines()
  other = tmp_path / "disk3" / "train.jsonl.gz"
  other.parent.mkdir()
  with gzip.open(other, "wt") as f:
    f.writelines(rows[1:] + rows[:1])  # the same documents in another order
  with pytest.raises(CheckpointError, match="first difference: 'data.corpus'"):
    train_stage.run_from_args(_args(model_dir, str(other), vocab, 2))
  summary = train_stage.run_from_args(_args(model_dir, str(new), vocab, 2))
  assert summary["resumed_from_step"] == 1 and summary["final_step"] == 2


@pytest.mark.parametrize("bindings, expected", [
    (["--gin.ACTIVATION_DTYPE='float16'"], ["'float16' is not supported for training", "'bfloat16'"]),
    (["--gin.ACTIVATION_DTYPE='bfloat16'", "--gin.T5Config.dropout_rate=0.0", "--gin.T5Config.attention='cudnn'"],
     ["'cudnn' is NVIDIA's fused attention kernel and needs a GPU", "backend is 'cpu'"]),
], ids=["float16", "cudnn_attention_on_cpu"])
def test_settings_this_machine_cannot_train_are_one_line(bindings, expected, corpus_and_vocab, tmp_path, capsys):
  corpus, vocab = corpus_and_vocab
  model_dir = tmp_path / "run"
  assert cli.main(["train", *_args(str(model_dir), corpus, vocab, 2), *bindings]) == 2
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
  assert len(err) == 1 and all(e in err[0] for e in expected), err
  assert not model_dir.exists()


@pytest.mark.parametrize("mesh", ["'(1, 1)'", "1", "(1.5, 1)"])
def test_mesh_shape_not_two_integers_is_one_line(mesh, corpus_and_vocab, tmp_path, capsys):
  corpus, vocab = corpus_and_vocab
  model_dir = tmp_path / "run"
  assert cli.main(["train", *_args(str(model_dir), corpus, vocab, 2), f"--gin.train.mesh_shape={mesh}"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err and [l for l in err.splitlines() if l.startswith("error:")] == [
      next(l for l in err.splitlines() if "mesh_shape must be (data, model), two integers" in l)]
  assert not model_dir.exists()


def test_error_found_after_model_dir_is_locked_leaves_nothing(corpus_and_vocab, tmp_path, monkeypatch):
  """An error only σ calibration can find (an unreachable target ε) undoes the failed start."""
  from private_t5.dp import mechanism as privacy  # pylint: disable=g-import-not-at-top
  from private_t5.dp import config as config_lib  # pylint: disable=g-import-not-at-top
  corpus, vocab = corpus_and_vocab

  def unreachable(*args, **kwargs):
    raise PrivacyError("target_epsilon=0.001 is unreachable")

  monkeypatch.setattr(privacy, "build_mechanism", unreachable)
  model_dir = tmp_path / "run"
  with pytest.raises(PrivacyError, match="unreachable"):
    train_stage.run_from_args(_args(str(model_dir), corpus, vocab, 2))
  assert not model_dir.exists()
  existing = tmp_path / "existing"  # a directory that held something before is kept as it was
  existing.mkdir()
  (existing / "notes.txt").write_text("mine")
  with pytest.raises(PrivacyError, match="unreachable"):
    train_stage.run_from_args(_args(str(existing), corpus, vocab, 2))
  assert sorted(os.listdir(existing)) == [".lock", "notes.txt"]


def test_truncated_gzip_corpus_is_one_line_and_leaves_nothing(corpus_and_vocab, tmp_path, capsys):
  """A corpus cut short fails while its store is built: one line naming it, no run, no cache entry."""
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  _, vocab = corpus_and_vocab
  data = gzip.compress("".join(f"line {i} of a corpus cut short\n" for i in range(200)).encode())
  corpus = tmp_path / "cut.txt.gz"
  corpus.write_bytes(data[:len(data) // 2])
  model_dir, cache = tmp_path / "run", tmp_path / "cache"
  assert cli.main(["train", *_args(str(model_dir), str(corpus), vocab, 2), f"--gin.DATA_CACHE_DIR={cache}"]) == 2
  err = capsys.readouterr().err
  assert [l for l in err.splitlines() if l.startswith("error:")] == [
      f"error: cannot read {corpus}: Compressed file ended before the end-of-stream marker was reached"], err
  assert "Traceback" not in err and not model_dir.exists()
  assert not cache.exists()  # nor the cache folder the failed build created


def test_read_only_data_cache_dir_is_one_line(corpus_and_vocab, tmp_path, capsys, read_only):
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  corpus, vocab = corpus_and_vocab
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  model_dir, cache = tmp_path / "run", str(tmp_path / "ro" / "cache")
  assert cli.main(["train", *_args(str(model_dir), corpus, vocab, 2), f"--gin.DATA_CACHE_DIR={cache}"]) == 2
  err = capsys.readouterr().err
  assert [l for l in err.splitlines() if l.startswith("error:")] == [
      f"error: store cache_dir {cache!r} is not writable: Read-only file system"], err
  assert "Traceback" not in err and not model_dir.exists() and not os.listdir(tmp_path / "ro")


def _cli_train(args, cwd):
  """`python -m private_t5.stages.cli train ARGS` in a fresh process: (exit code, stderr)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, PYTHONPATH=cwd, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run([sys.executable, "-m", "private_t5.stages.cli", "train", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)
  return proc.returncode, proc.stderr


@pytest.mark.parametrize("binding,message", [
    ("--gin.DPConfig.clip_norm=0.0", "clip_norm"),
    pytest.param("--gin.DPConfig.noise_multiplier=-1.0", "noise_multiplier", marks=pytest.mark.slow),
    pytest.param("--gin.DPConfig.delta=1.0", "delta", marks=pytest.mark.slow),
    pytest.param("--gin.DPConfig.target_epsilon=0.0", "target_epsilon", marks=pytest.mark.slow),
    pytest.param("--gin.DPConfig.target_epsilon=3.0", "exactly one", marks=pytest.mark.slow),
    pytest.param("--gin.DPConfig.accountant='bogus'", "accountant", marks=pytest.mark.slow),
    pytest.param("--gin.DPConfig.method='bogus'", "method", marks=pytest.mark.slow),
])
def test_cli_invalid_privacy_parameter_writes_nothing(corpus_and_vocab, tmp_path, binding, message):
  """Exit 2, one error line, no traceback, and no checkpoints/ left in MODEL_DIR."""
  corpus, vocab = corpus_and_vocab
  model_dir = tmp_path / "run"
  extra = ["--gin.DPConfig.noise_multiplier=None"] if "target_epsilon=0" in binding else []
  rc, err = _cli_train(_args(str(model_dir), corpus, vocab, 2, *extra, binding),
                       os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert rc == 2, err
  errors = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and message in errors[0], err
  assert "Traceback" not in err, err
  assert not (model_dir / "checkpoints").exists()
  assert not model_dir.exists() or not os.listdir(model_dir)


@pytest.mark.slow
def test_quiet_run_prints_nothing_but_keeps_everything(corpus_and_vocab, tmp_path, capsys):
  # -q: no [train] / [privacy] / progress lines on stdout; the run's files are written as usual.
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "quiet")
  assert cli.main(["train", "-q", *_args(model_dir, corpus, vocab, 2, "--gin.train.log_every=1")]) == 0
  captured = capsys.readouterr()
  assert captured.out == "", captured.out[:2000]
  assert "Traceback" not in captured.err
  assert json.load(open(os.path.join(model_dir, "summary.json")))["final_step"] == 2
  assert cli.main(["train", *_args(model_dir + "_loud", corpus, vocab, 1)]) == 0  # the default prints
  assert "[train]" in capsys.readouterr().out


def test_a_run_resumes_with_another_attention_and_layer_layout(corpus_and_vocab, tmp_path, capsys):
  """How attention and the layers are computed is not the model: it stays out of the run's
  fingerprint, a run resumes with other settings (a checkpoint of unrolled layers read into a
  scanned, rematerialised network, and back), and a checkpoint read for inference takes the
  defaults, whatever the run that wrote it used. The run ends where an unrolled run ends."""
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  no_dropout = "--gin.T5Config.dropout_rate=0.0"
  train_stage.run_from_args(_args(model_dir, corpus, vocab, 1, no_dropout))
  capsys.readouterr()
  summary = train_stage.run_from_args(_args(model_dir, corpus, vocab, 2, no_dropout, "--gin.T5Config.attention='xla'",
                                            "--gin.SCAN_LAYERS=True", "--gin.REMAT_POLICY='full'"))
  assert summary["resumed_from_step"] == 1 and summary["final_step"] == 2
  said = capsys.readouterr().out
  assert "converted to the scanned layout" in said and "clipped sum by ghost" in said
  params, config, _ = checkpoint_read.restore_for_inference(model_dir)
  assert config.attention == "einsum" and config.dropout_rate == 0.0 and not config.scan_layers
  assert "layers_0" in params["encoder"]
  train_stage.run_from_args(_args(model_dir, corpus, vocab, 3, no_dropout))
  assert "converted to the unrolled layout" in capsys.readouterr().out
  straight = str(tmp_path / "straight")
  train_stage.run_from_args(_args(straight, corpus, vocab, 3, no_dropout))
  for a, b in zip(jax.tree.leaves(checkpoint_read.restore_for_inference(model_dir)[0]),
                  jax.tree.leaves(checkpoint_read.restore_for_inference(straight)[0])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
