"""EM / TA / MED on fixed predictions, example building, report rendering, mismatch checks."""
import io
import json
import math

import numpy as np
import pytest

from private_t5.errors import CheckpointError
from private_t5.eval import extraction_metrics as em
from private_t5.eval import memorization, report


def test_per_example_scores_hand_computed():
  target = [10, 11, 12, 13, 14, 15, 16, 17]
  assert em.per_example_scores(target, target) == (True, 1.0, 0)
  # One substitution.
  assert em.per_example_scores([10, 11, 99, 13, 14, 15, 16, 17], target) == (False, 7 / 8, 1)
  # Stopped early at EOS (1): the 4 missing positions are mismatches and 4 insertions.
  assert em.per_example_scores([10, 11, 12, 13, 1, 0, 0, 0], target) == (False, 4 / 8, 4)
  # Shifted by one: no position matches, but the edit distance is only 2.
  assert em.per_example_scores([11, 12, 13, 14, 15, 16, 17, 18], target) == (False, 0.0, 2)
  # Anything after EOS is ignored.
  assert em.per_example_scores(target + [1, 5, 5], target) == (True, 1.0, 0)


def test_aggregate_hand_computed():
  target = [[1 + 1, 3, 4, 5]] * 4
  preds = [[2, 3, 4, 5], [2, 3, 9, 5], [9, 9, 9, 9], [2, 3, 1, 0]]
  m = em.aggregate(preds, target, skipped=3)
  assert m.n == 4 and m.skipped == 3
  assert m.exact_match == pytest.approx(0.25)
  assert m.token_accuracy == pytest.approx((1 + 0.75 + 0 + 0.5) / 4)
  # Edit distances 0, 1, 4, 2 -> median 1.5, mean 1.75.
  assert m.median_edit_distance == 1.5 and m.mean_edit_distance == 1.75
  empty = em.aggregate([], [], skipped=2)
  assert empty.n == 0 and empty.skipped == 2 and math.isnan(empty.exact_match)
  with pytest.raises(ValueError):
    em.aggregate([[1]], [])


def test_prefix_examples_skip_short_documents_and_end_prompts_with_eos():
  cfg = memorization.ExtractionConfig(prompt_length=4, generation_length=3)
  toks = [np.arange(10, 17), np.arange(20, 26), np.arange(30, 45)]  # lengths 7, 6, 15
  ex = memorization.prefix_examples(["a", "b", "c"], toks, cfg)
  assert ex.ids == ["a", "c"] and ex.skipped == 1
  np.testing.assert_array_equal(ex.inputs, [[10, 11, 12, 13, 1], [30, 31, 32, 33, 1]])
  np.testing.assert_array_equal(ex.targets[0], [14, 15, 16])
  np.testing.assert_array_equal(ex.targets[1], [34, 35, 36])
  no_eos = memorization.prefix_examples(["a"], toks[:1], memorization.ExtractionConfig(
      prompt_length=4, generation_length=3, append_eos_to_prompt=False))
  assert no_eos.inputs.shape == (1, 4)
  # Subsampling keeps corpus order, the skipped count and the row alignment.
  many = memorization.prefix_examples([f"d{i}" for i in range(20)] + ["short"],
                                      [np.arange(i, i + 8) for i in range(20)] + [np.arange(3)], cfg)
  sub = memorization.subsample(many, 5, seed=0)
  assert len(sub.ids) == 5 and sub.skipped == 1 and sub.ids == sorted(sub.ids, key=lambda x: int(x[1:]))
  for doc_id, row, target in zip(sub.ids, sub.inputs, sub.targets):
    assert row[0] == int(doc_id[1:]) and target[0] == int(doc_id[1:]) + 4
  assert memorization.subsample(many, None, 0) is many


def test_span_corruption_examples_mask_and_restore_the_window():
  vocab_size = 600
  cfg = memorization.ExtractionConfig(prompt_length=32, generation_length=8, seed=3)
  rng = np.random.default_rng(0)
  toks = [rng.integers(3, 500, size=60).astype(np.int32), rng.integers(3, 500, size=10).astype(np.int32)]
  ex = memorization.span_corruption_examples(["long", "short"], toks, cfg, vocab_size)
  assert ex.ids == ["long"] and ex.skipped == 1
  inputs, targets = ex.inputs[0], ex.targets[0]
  sentinels = [t for t in inputs if t >= vocab_size - 100]
  assert sentinels and sentinels[0] == vocab_size - 1
  # Filling each sentinel of the inputs with the span that follows it in the targets gives
  # back the document's window.
  spans, current = {}, None
  for t in targets:
    if t >= vocab_size - 100:
      current = int(t)
      spans[current] = []
    else:
      spans[current].append(int(t))
  restored = []
  for t in inputs:
    if t == 1:
      break
    restored += spans.get(int(t), [int(t)]) if t >= vocab_size - 100 else [int(t)]
  raw = len(restored)
  np.testing.assert_array_equal(restored, toks[0][:raw])
  assert ex.max_target_length >= len(targets) + 1
  # Deterministic given the seed.
  again = memorization.span_corruption_examples(["long", "short"], toks, cfg, vocab_size)
  np.testing.assert_array_equal(again.inputs, ex.inputs)


def test_progress_bar_writes_one_line():
  from private_t5 import progress  # pylint: disable=g-import-not-at-top
  buf = io.StringIO()
  bar = progress.bar(total=4, desc="train_dup greedy", unit="prompts", file=buf, disable=False, leave=True)
  bar.update(2)
  bar.set_postfix_str("10 tok/s", refresh=False)
  bar.update(2)
  bar.close()
  out = buf.getvalue()
  assert "4/4" in out and "prompts" in out and "10 tok/s" in out


def test_epsilon_text():
  assert report.epsilon_text(None).startswith("ε unknown")
  assert report.epsilon_text({"epsilon": None, "dp": False}) == "ε = ∞ (non-private baseline)"
  assert report.epsilon_text({"epsilon": 6.0612, "delta": 1e-6, "dp": True}) == "ε = 6.061 (δ = 1e-06)"
  # The reports of real ledgers (what a DP and a non-private checkpoint carry).
  from private_t5.dp.ledger import PrivacyLedger
  ledger = PrivacyLedger.create(noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, num_examples=10_000,
                                batch_size=100)
  ledger.record_steps(100)
  dp_report = ledger.report()
  assert report.epsilon_text(dp_report) == f"ε = {dp_report['epsilon']:.4g} (δ = {dp_report['delta']:.3g})"
  assert 0 < dp_report["epsilon"] < 10
  insecure = dict(dp_report, noise_secret=False)
  assert report.epsilon_text(insecure).endswith("NO GUARANTEE: the noise came from a fixed seed")
  baseline = PrivacyLedger.non_private_baseline(num_examples=100, batch_size=10).report()
  assert report.epsilon_text(baseline) == "ε = ∞ (non-private baseline)"


def _fake_report():
  nan = float("nan")
  metrics = {"train_dup": dict(n=10, skipped=2, exact_match=0.5, token_accuracy=0.75, median_edit_distance=3.0,
                               mean_edit_distance=3.5),
             "train_unique": dict(n=10, skipped=0, exact_match=0.1, token_accuracy=0.2, median_edit_distance=8.0,
                                  mean_edit_distance=8.0),
             "valid_in_train": dict(n=0, skipped=0, exact_match=nan, token_accuracy=nan, median_edit_distance=nan,
                                    mean_edit_distance=nan),
             "valid_unique": dict(n=5, skipped=5, exact_match=0.0, token_accuracy=0.05, median_edit_distance=9.0,
                                  mean_edit_distance=9.0)}
  return {"checkpoint": {"model_dir": "/m", "step": 7}, "epsilon_text": "ε = 6.06 (δ = 1e-06)",
          "settings": {"prompt_length": 512, "generation_length": 114},
          "extraction": {"greedy": metrics, "beam": metrics},
          "canaries": [{"id": "c0", "repetitions": 100, "rank": 1.0, "exposure": 19.9, "method": "skewnorm"},
                       {"id": "c1", "repetitions": 0, "rank": 4.2e5, "exposure": 1.25, "method": "skewnorm"}],
          "canary_format": {"template": "My ID is {secret}"}, "canary_space_size": 10 ** 6,
          "splits": {"sizes": {"train_dup": 12, "train_unique": 10, "valid_in_train": 0, "valid_unique": 10}},
          "throughput": {"tokens_per_second_steady": 1234.0, "generated_tokens": 100, "seconds": 1.0},
          "warnings": ["split 'valid_in_train' is empty"]}


def test_report_files(tmp_path):
  paths = report.write_report(_fake_report(), str(tmp_path))
  assert sorted(p.split("/")[-1] for p in paths) == ["exposure.png", "extraction.png", "report.json", "report.md"]
  data = json.loads((tmp_path / "report.json").read_text())  # NaN became null: valid JSON
  assert data["extraction"]["greedy"]["valid_in_train"]["exact_match"] is None
  md = (tmp_path / "report.md").read_text()
  assert "| Train dup | 10 | 2 | 50.00 | 75.00 | 3 |" in md
  assert "| Valid in train | 0 | 0 | – | – | – |" in md
  assert "| c0 | 100 | 1 | 19.90 | skewnorm |" in md
  assert "ε = 6.06" in md and "1234 generated tokens/s" in md and "valid_in_train' is empty" in md
  for name in ("extraction.png", "exposure.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_mismatch_is_a_checkpoint_error():
  import jax
  from private_t5.models import config as config_lib
  from private_t5.models import network
  config = config_lib.load_preset("t5_1_0_tiny", vocab_size=256, d_model=32, d_ff=64, num_heads=2)
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), network.param_shapes(config))
  memorization.check_model_matches(params, config, vocab_size=200)
  with pytest.raises(CheckpointError, match="vocabulary has 300 ids"):
    memorization.check_model_matches(params, config, vocab_size=300)
  wider = config.replace(d_ff=128)
  with pytest.raises(CheckpointError, match="do not match its model config.*wi"):
    memorization.check_model_matches(params, wider, vocab_size=200)


def test_cli_reports_missing_macros_and_missing_checkpoints(tmp_path, capsys):
  from private_t5.stages import cli
  assert cli.main(["memorization", "--gin_file=configs/runs/memorization.gin"]) == 2
  assert "missing required Gin macro(s): MODEL_DIR, OUTPUT_DIR, TRAIN_CORPUS, VALID_CORPUS" in capsys.readouterr().err
  out_dir = tmp_path / "out"
  assert cli.main(["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={tmp_path}",
                   "--gin.TRAIN_CORPUS=a.jsonl", "--gin.VALID_CORPUS=b.jsonl", f"--gin.OUTPUT_DIR={out_dir}"]) == 2
  assert "no checkpoints" in capsys.readouterr().err
  assert not out_dir.exists()
