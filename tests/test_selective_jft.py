"""Just Fine-tune Twice: one Gin command runs both phases; phase 2's ledger and the JFT report."""
import json
import os
import types

import numpy as np

import pytest

from private_t5.data import corpora
from private_t5.dp import accounting
from private_t5.dp.ledger import PrivacyLedger
from private_t5.errors import ConfigError, DataError
from private_t5.selective import jft, redaction
from private_t5.stages import jft as jft_stage
from private_t5.tokenizer import spm
from private_t5 import vocabulary

from micro_run import MICRO_TRAIN_ARGS


HAND_CHECKED = [
    {"text": "Call me at (212) 555-0123 after lunch.", "secrets": ["(212) 555-0123"]},
    {"text": "My account number is 88121937, Lucy.", "secrets": ["88121937", "Lucy"]},
    {"text": "Write to jd@example.org or ring 555-0199.", "secrets": ["jd@example.org", "555-0199"]},
    {"text": "Bartholomew lives at 12 Elm Street.", "secrets": ["Bartholomew", "12 Elm Street"]},
]


def test_miss_rate_on_a_hand_checked_sample():
  result = jft.measure_miss_rate("entity", HAND_CHECKED, backend="heuristic")
  # The entity heuristic knows neither the rare first name nor street addresses.
  assert result["secrets"] == 7 and result["missed"] == 2
  assert result["miss_rate"] == pytest.approx(2 / 7)
  lo, hi = result["miss_rate_95ci"]
  assert 0 < lo < 2 / 7 < hi < 1
  assert set(result["examples_missed"]) == {"Bartholomew", "12 Elm Street"}
  with pytest.raises(DataError, match="does not occur"):
    jft.measure_miss_rate("pattern", [{"text": "abc", "secrets": ["xyz"]}])


def _ledger_report(sigma, steps, non_private=False):
  if non_private:
    ledger = PrivacyLedger.non_private_baseline(num_examples=1000, batch_size=10)
  else:
    ledger = PrivacyLedger.create(noise_multiplier=sigma, clip_norm=1.0, delta=1e-5, num_examples=1000,
                                  sampling_rate=0.01)
  ledger.record_steps(steps)
  return ledger.report()


def test_report_composes_light_noise_phase1():
  phase1, phase2 = _ledger_report(4.0, 50), _ledger_report(1.0, 100)
  report = jft.jft_privacy_report(phase1, phase2, detector_level="entity")
  assert report["epsilon_s"] == pytest.approx(phase2["epsilon"])
  assert report["epsilon_if_detector_missed"] == pytest.approx(phase1["epsilon"] + phase2["epsilon"])
  assert report["delta_if_detector_missed"] == pytest.approx(phase1["delta"] + phase2["delta"])
  assert "ASSUMPTION" in report["statement"] and "selective DP" in report["statement"]
  ordinary = jft.jft_privacy_report(_ledger_report(0, 50, non_private=True), phase2, detector_level="entity")
  assert ordinary["epsilon_if_detector_missed"] is None and "NO formal protection" in ordinary["statement"]
  with pytest.raises(ConfigError, match="phase 2 must be differentially private"):
    jft.jft_privacy_report(phase1, _ledger_report(0, 5, non_private=True), detector_level="entity")


def test_phase2_report_records_phase1_and_is_not_the_full_guarantee(tmp_path):
  def phase2_after(phase1_report):
    setup = types.SimpleNamespace(ledger=PrivacyLedger.create(
        noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, num_examples=1000, sampling_rate=0.01))
    hook = jft.phase1_in_ledger(phase1_report, str(tmp_path / jft.PHASE1_DIR))
    override = hook(setup, "data")
    assert override.mechanism is setup and override.source == "data" and override.extra == {}
    assert override.summarize is None
    setup.ledger.record_steps(100)
    return setup.ledger
  ordinary = _ledger_report(0, 50, non_private=True)
  ledger = phase2_after(ordinary)
  phase2 = ledger.report()
  # Phase 1 trained without DP on the redacted copy of the same data: phase 2's report says so
  # and its ε, the release's ordinary guarantee, is ∞; its own (ε₂, δ₂) is labelled as such.
  assert phase2["epsilon"] is None and phase2["training_epsilon"] > 0
  assert [c["name"] for c in phase2["components"]] == ["initial_checkpoint"]
  assert any("WITHOUT DP on a redacted copy" in w and jft.REPORT_FILENAME in w for w in phase2["warnings"])
  assert phase2["epsilon_without_initial_checkpoint"] == pytest.approx(ledger.training_epsilon())
  report = jft.jft_privacy_report(ordinary, phase2, detector_level="entity")
  assert report["epsilon_s"] == pytest.approx(ledger.training_epsilon())
  assert report["epsilon_if_detector_missed"] is None
  # A light-noise phase 1 is composed: phase 2's ε is the guarantee when the detector missed.
  light = _ledger_report(4.0, 50)
  phase2 = phase2_after(light).report()
  report = jft.jft_privacy_report(light, phase2, detector_level="entity")
  assert phase2["epsilon"] == pytest.approx(report["epsilon_if_detector_missed"])
  assert report["epsilon_s"] == pytest.approx(phase2["training_epsilon"]) and phase2["warnings"] == []


@pytest.mark.slow
def test_one_gin_command_runs_both_phases(shared_data, tmp_path, capsys):
  corpus = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  docs = list(corpora.iter_documents(corpus, max_documents=300))
  redacted = str(tmp_path / "redacted.jsonl")
  red = redaction.redact_corpus(docs, redacted, level="entity", backend="heuristic", progress_every=0,
                                log=lambda _: None)
  # The vocabulary comes from the redacted corpus D', which phase 1 already trains on without DP
  # under the detector assumption: declared public, so phase 2's ε is its own.
  vocab = str(tmp_path / "spm.model")
  spm.train_from_sentences([d.text for d in corpora.iter_documents(redacted)], vocab, vocab_size=300)
  sample = tmp_path / "hand_checked.jsonl"
  sample.write_text("".join(json.dumps(r) + "\n" for r in HAND_CHECKED))
  model_dir = str(tmp_path / "jft")
  report = jft_stage.run_from_args([
      "--gin_file=configs/experiments/quickstart.gin", "--gin_file=configs/runs/jft.gin",
      f"--gin.MODEL_DIR={model_dir}", f"--gin.CORPUS={corpus}", f"--gin.VOCAB_PATH={vocab}",
      f"--gin.REDACTED_CORPUS={redacted}", f"--gin.REDACTION_REPORT={red['report_path']}",
      f"--gin.MISS_RATE_SAMPLE={sample}", "--gin.TRAIN_STEPS=2", "--gin.PHASE1_STEPS=2",
      f"--gin.DATA_CACHE_DIR={tmp_path}/cache", "--gin.VOCAB_IS_PUBLIC=True", *MICRO_TRAIN_ARGS])
  out = capsys.readouterr().out
  assert "initial parameters from" in out and jft.PHASE1_DIR in out
  with open(os.path.join(model_dir, jft.PHASE1_DIR, "privacy_report.json")) as f:
    phase1 = json.load(f)
  with open(os.path.join(model_dir, jft.PHASE2_DIR, "privacy_report.json")) as f:
    phase2 = json.load(f)
  assert phase1["dp"] is False and phase1["steps"] == 2
  # Phase 2's ledger covers phase 2 only: its own steps, sigma and q, epsilon from the accountant.
  assert phase2["dp"] is True and phase2["steps"] == 2 and phase2["noise_multiplier"] == 1.0
  q = phase2["sampling_rate"]
  assert q == pytest.approx(0.5 / phase2["num_examples"])
  assert phase2["training_epsilon"] == pytest.approx(
      min(accounting.compute_epsilon(1.0, q, 2, phase2["accounting_delta"], a) for a in ("rdp", "pld")),
      rel=1e-9)
  assert {k: phase2["components"][0][k] for k in ("name", "private", "public", "source")} == {
      "name": "vocabulary", "private": False, "public": True, "source": os.path.abspath(vocab)}
  # Phase 1 trained without DP on the redacted copy: phase 2's report records it, its ε is ∞ and
  # its own (ε₂, δ₂) is the selective share only.
  assert [c["name"] for c in phase2["components"]] == ["vocabulary", "initial_checkpoint"]
  assert phase2["epsilon"] is None and any("JFT phase 1" in w for w in phase2["warnings"])
  assert "WARNING: the initial parameters were trained WITHOUT DP" in out
  with open(os.path.join(model_dir, jft.REPORT_FILENAME)) as f:
    saved = json.load(f)
  assert saved["epsilon_s"] == pytest.approx(phase2["epsilon_without_initial_checkpoint"])
  assert saved["epsilon_s"] == pytest.approx(report["epsilon_s"]) == pytest.approx(phase2["training_epsilon"])
  assert saved["phase2_validation"]["examples"] > 0 and "phase2_validation" in saved["not_dp"]
  assert saved["epsilon_if_detector_missed"] is None  # ordinary phase 1
  assert saved["detector_level"] == "entity" and saved["miss_rate"]["secrets"] == 7
  assert saved["private_token_fraction"] == pytest.approx(red["levels"]["entity"]["pct"])
  assert "ASSUMPTION" in saved["statement"]


@pytest.mark.slow
def test_canary_masked_by_the_detector_is_not_memorized_in_phase1(shared_data, tmp_path):
  from private_t5.data import source as source_lib  # pylint: disable=g-import-not-at-top
  from private_t5.eval import canaries as canaries_lib, exposure, memorization  # pylint: disable=g-import-not-at-top
  from private_t5.models.config import T5Config  # pylint: disable=g-import-not-at-top
  from private_t5.models import checkpoint_read  # pylint: disable=g-import-not-at-top
  from private_t5.train import main as train_main, optimizers  # pylint: disable=g-import-not-at-top
  corpus = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  docs = list(corpora.iter_documents(corpus, max_documents=200))
  vocab_path = str(tmp_path / "spm.model")
  spm.train_from_sentences([d.text for d in docs] + ["My ID is 0123456789"], vocab_path, vocab_size=300)
  fmt = canaries_lib.CanaryFormat(template="My ID is {secret}", length=3).validate()
  canaries, seed = canaries_lib.make_canaries(fmt, (25,), per_repetition=4, num_reference=0, seed=7)
  raw, _, _ = canaries_lib.write_canary_corpus(docs, str(tmp_path / "raw.jsonl"), fmt, canaries, seed)
  redacted = str(tmp_path / "redacted.jsonl")
  redaction.redact_corpus(corpora.iter_documents(raw), redacted, level="pattern", progress_every=0,
                          log=lambda _: None)
  assert not any(c.text in r["text"] for c in canaries for r in redaction.read_redacted(redacted))
  vocab = vocabulary.load_vocabulary(vocab_path)
  config = T5Config(vocab_size=512, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                    num_decoder_layers=1, dropout_rate=0.0)
  result = {}
  for name, path in (("raw", raw), ("redacted", redacted)):
    data = source_lib.make_source(path, vocab_path, objective="prefix_lm", feature_lengths={"inputs": 16, "targets": 8},
                                  split="all", cache_dir=str(tmp_path / "cache"), progress=False)
    model_dir = str(tmp_path / name)
    train_main.train(model_config=config, train_data=data, model_dir=model_dir, train_steps=80, batch_size=16,
                     learning_rate=optimizers.constant_schedule(0.02), mesh_shape=(1, 1),
                     insecure_deterministic_seed=3, log=lambda _: None)
    params, cfg, _ = checkpoint_read.restore_for_inference(model_dir)
    evaluator = exposure.ExposureEvaluator(memorization.make_scorer(params, cfg),
                                           exposure.CandidateEncoder(vocab, fmt, exposure.PREFIX_SCORING),
                                           batch_size=500)
    result[name] = float(np.mean([r.exposure for r in evaluator.evaluate(canaries)]))
  # Trained on the raw corpus the canaries are memorized; phase 1 on D' never saw their secrets, so
  # their mean exposure stays near chance (E[exposure] = 1/ln 2 = 1.44 bits for an unseen secret).
  print(f"mean canary exposure: {result}")
  assert result["raw"] > 5.0, result
  assert result["redacted"] < 3.0, result
