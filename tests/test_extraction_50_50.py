"""The 50/50 extraction protocol (Carlini et al. 2023): the approximate-match rule, the
Clopper-Pearson intervals of the match rates, the uniform training sample (seeded, streamed),
the report's new columns and the shipped configs/runs/memorization_50_50.gin."""
import gzip
import json

import numpy as np
import pytest
from scipy import stats

from private_t5.documents import Document
from private_t5.errors import ConfigError
from private_t5.eval import extraction_metrics, memorization, memorization_run, report


def _with_errors(target, count, start=0):
  """`target` with `count` tokens replaced (never by EOS or by the token they replace)."""
  pred = np.array(target)
  pred[start:start + count] = 7 + (pred[start:start + count] % 5) + 1000
  return pred


def test_approximate_match_is_edit_distance_over_length_at_most_the_threshold():
  target = np.arange(100, 150)  # 50 tokens
  five, six = _with_errors(target, 5), _with_errors(target, 6, start=20)
  assert extraction_metrics.per_example_scores(five, target)[2] == 5
  assert extraction_metrics.per_example_scores(six, target)[2] == 6
  assert extraction_metrics.is_approximate_match(5, 50, 0.1)
  assert not extraction_metrics.is_approximate_match(6, 50, 0.1)
  assert extraction_metrics.is_approximate_match(3, 30, 0.1)  # 0.1 * 30 is 3.0000000000000004
  assert extraction_metrics.approximate_matches([target, five, six], [target] * 3, 0.1) == [True, True, False]
  # An insertion and a deletion are 2 edits; a generation stopped early at EOS after 46 tokens
  # is 4 deletions.
  shifted = np.concatenate([[999], target[:27], target[28:]])
  early = np.concatenate([target[:46], [1], target[46:]])
  assert extraction_metrics.approximate_matches([shifted, early], [target] * 2, 0.1) == [True, True]
  assert extraction_metrics.approximate_matches([six], [target], 0.12) == [True]
  m = extraction_metrics.aggregate([target, five, six, early], [target] * 4, skipped=3, threshold=0.1)
  assert (m.n, m.skipped, m.exact_matches, m.approximate_matches) == (4, 3, 1, 3)
  assert m.exact_match == 0.25 and m.approximate_match == 0.75
  assert m.exact_match_ci == pytest.approx(extraction_metrics.clopper_pearson(1, 4))
  assert m.approximate_match_ci == pytest.approx(extraction_metrics.clopper_pearson(3, 4))
  d = m.as_dict()
  for key in ("n", "skipped", "exact_match", "token_accuracy", "median_edit_distance", "mean_edit_distance"):
    assert key in d  # the fields readers already use are kept
  assert d["approximate_threshold"] == 0.1 and d["confidence"] == 0.95 and len(d["exact_match_ci"]) == 2


def test_clopper_pearson_against_known_values():
  assert extraction_metrics.clopper_pearson(0, 10) == pytest.approx((0.0, 0.30850), abs=1e-5)
  assert extraction_metrics.clopper_pearson(5, 10) == pytest.approx((0.18709, 0.81291), abs=1e-5)
  assert extraction_metrics.clopper_pearson(10, 10) == pytest.approx((0.69150, 1.0), abs=1e-5)
  # The "rule of three": 0 of n bounds the rate by about 3 / n at 95% (one-sided), 3.69 / n two-sided.
  assert extraction_metrics.clopper_pearson(0, 10_000)[1] == pytest.approx(3.689e-4, rel=1e-3)
  for k, n, conf in ((0, 10, 0.95), (5, 10, 0.95), (3, 1000, 0.99), (49, 50, 0.9)):
    want = stats.binomtest(k, n).proportion_ci(conf, method="exact")
    assert extraction_metrics.clopper_pearson(k, n, conf) == pytest.approx((want.low, want.high), abs=1e-9)
  assert all(np.isnan(extraction_metrics.clopper_pearson(0, 0)))
  with pytest.raises(ValueError):
    extraction_metrics.clopper_pearson(11, 10)


def test_pooled_metrics_sum_counts_and_recompute_intervals():
  a = extraction_metrics.aggregate([[5, 6]], [[5, 6]]).as_dict()
  b = extraction_metrics.aggregate([[5, 6], [2, 2], [5, 7]], [[5, 6]] * 3).as_dict()
  empty = extraction_metrics.aggregate([], []).as_dict()
  pooled = extraction_metrics.pool([a, b, empty])
  assert pooled["n"] == 4 and pooled["exact_matches"] == 2 and pooled["exact_match"] == 0.5
  assert pooled["exact_match_ci"] == pytest.approx(list(extraction_metrics.clopper_pearson(2, 4)))
  assert pooled["token_accuracy"] == pytest.approx((1 + 1 + 0 + 0.5) / 4)
  assert np.isnan(pooled["median_edit_distance"])


def test_train_sample_is_uniform_seeded_and_deterministic():
  rng = np.random.default_rng(1)
  lengths = rng.integers(50, 150, size=400).astype(np.uint32)
  eligible = np.flatnonzero(lengths >= 100)
  numbers, count = memorization_run.sample_documents(lengths, 100, 50, seed=3)
  assert count == len(eligible) and len(numbers) == 50 and len(set(numbers.tolist())) == 50
  assert np.all(lengths[numbers] >= 100) and np.all(np.diff(numbers) > 0)  # long enough, in corpus order
  np.testing.assert_array_equal(numbers, memorization_run.sample_documents(lengths, 100, 50, seed=3)[0])
  assert not np.array_equal(numbers, memorization_run.sample_documents(lengths, 100, 50, seed=4)[0])
  every, _ = memorization_run.sample_documents(lengths, 100, 10_000, seed=3)
  np.testing.assert_array_equal(every, eligible)  # fewer than asked: all of them
  # Uniform: over many seeds each eligible document is drawn about size / eligible of the time.
  hits = np.zeros(len(lengths))
  for seed in range(400):
    hits[memorization_run.sample_documents(lengths, 100, 50, seed=seed)[0]] += 1
  assert hits[lengths < 100].sum() == 0
  expected = 400 * 50 / len(eligible)
  chi2 = ((hits[eligible] - expected) ** 2 / expected).sum()
  assert stats.chi2.sf(chi2, len(eligible) - 1) > 1e-4, chi2


def test_train_sample_is_streamed_in_chunks(tmp_path):
  path = tmp_path / "train.jsonl.gz"
  with gzip.open(path, "wt", encoding="utf-8") as f:
    for i in range(30):
      f.write(json.dumps({"id": f"d{i}", "text": f"document {i}"}) + "\n")
    f.write("not json: the pass stops before it\n")
  docs = memorization_run.iter_documents_by_number(str(path), np.array([2, 3, 17, 29]), "text")
  assert not isinstance(docs, (list, tuple))  # a generator
  assert [d.id for d in docs] == ["d2", "d3", "d17", "d29"]

  class Vocab:
    class tokenizer:
      @staticmethod
      def encode(texts):
        return [[10 + len(t)] * 8 for t in texts]

  cfg = memorization.ExtractionConfig(prompt_length=5, generation_length=3)
  chunks = list(memorization_run.iter_prefix_chunks(Vocab, (Document(f"x{i}", "a" * i) for i in range(7)), cfg, 3))
  assert [c.ids for c in chunks] == [["x0", "x1", "x2"], ["x3", "x4", "x5"], ["x6"]]
  assert chunks[0].inputs.shape == (3, 6) and chunks[2].targets[0].tolist() == [16, 16, 16]


def test_streaming_evaluation_equals_one_pass():
  """Chunks decoded one after another score as the whole split decoded at once."""

  class Inference:
    def decode(self, inputs, max_decode_length, *, batch_size, method, on_batch, **options):
      on_batch(len(inputs), 0.5)
      return np.where(inputs[:, :max_decode_length] % 3 == 0, 0, inputs[:, :max_decode_length])

  rng = np.random.default_rng(0)
  cfg = memorization.ExtractionConfig(prompt_length=6, generation_length=4, approximate_threshold=0.25)
  toks = [np.concatenate([t[:6], t[:4]]) for t in (rng.integers(2, 9, size=6).astype(np.int32) for _ in range(9))]
  whole = memorization.prefix_examples([f"d{i}" for i in range(9)], toks, cfg)
  want, _, preds = memorization.evaluate_split(None, None, whole, cfg, verbose=False, inference=Inference())
  chunks = [memorization.prefix_examples([f"d{i}" for i in range(k, min(k + 4, 9))], toks[k:k + 4], cfg)
            for k in range(0, 9, 4)]
  got, dstats, ids, exact, approx = memorization.evaluate_streaming(None, None, iter(chunks), cfg, verbose=False,
                                                                     inference=Inference())
  assert got.as_dict() == want.as_dict() and ids == whole.ids
  assert exact == extraction_metrics.exact_matches(list(preds), whole.targets)
  assert approx == extraction_metrics.approximate_matches(list(preds), whole.targets, 0.25)
  assert 0 < sum(approx) and sum(exact) < 9
  assert (dstats.prompts, dstats.seconds, dstats.generated_tokens) == (9, 1.5, 36)
  assert dstats.prompts_per_second == pytest.approx(6.0)


def test_generated_tokens_count_what_each_row_generated_through_its_eos():
  eos = memorization.EOS_ID
  predictions = np.array([[5, eos, 0, 0], [5, 6, 7, 8], [eos, 0, 0, 0]], np.int32)

  class Inference:  # two batches of 2 rows, as the mesh decodes them
    def decode(self, inputs, max_decode_length, *, batch_size, method, on_batch, **options):
      on_batch(2, 0.5)
      on_batch(1, 0.25)
      return predictions

  cfg = memorization.ExtractionConfig(prompt_length=3, generation_length=4, batch_size=2)
  out, dstats = memorization.generate(None, None, np.zeros((3, 4), np.int32), 4, cfg, inference=Inference())
  assert memorization.generated_lengths(out).tolist() == [2, 4, 1]
  assert (dstats.generated_tokens, dstats.first_batch_tokens) == (7, 6)  # not 3 rows x 4
  assert dstats.tokens_per_second == pytest.approx(1 / 0.25)  # after the first batch
  assert dstats.prompts_per_second == pytest.approx(3 / 0.75)


def test_bad_match_settings_are_config_errors():
  with pytest.raises(ConfigError, match="approximate_threshold must be in"):
    memorization.ExtractionConfig(approximate_threshold=1.5).validate()
  with pytest.raises(ConfigError, match="confidence must be in"):
    memorization.ExtractionConfig(confidence=1.0).validate()


def test_bad_train_sample_size_is_refused_before_any_pass(tmp_path, capsys):
  from private_t5.stages import cli
  args = ["memorization", "--gin_file=configs/runs/memorization_50_50.gin", f"--gin.MODEL_DIR={tmp_path}",
          "--gin.TRAIN_CORPUS=a.jsonl", "--gin.VALID_CORPUS=b.jsonl", f"--gin.OUTPUT_DIR={tmp_path}/out"]
  assert cli.main(args + ["--gin.TRAIN_SAMPLE_SIZE=-1"]) == 2
  assert "train_sample_size must be an integer >= 0" in capsys.readouterr().err
  assert cli.main(args + ["--gin.APPROXIMATE_THRESHOLD=1.5"]) == 2
  assert "approximate_threshold must be in [0, 1)" in capsys.readouterr().err


def test_shipped_50_50_config_parses_to_the_protocol():
  import gin
  from private_t5.stages import gin_utils
  gin_utils.parse(["configs/runs/memorization_50_50.gin"],
                  ["MODEL_DIR=m", "TRAIN_CORPUS=t", "VALID_CORPUS=v", "OUTPUT_DIR=o"], entry="run_memorization")
  values = {k: gin.query_parameter("%" + k) for k in (
      "PROMPT_LENGTH", "GENERATION_LENGTH", "BEAM_SIZE", "TRAIN_SAMPLE_SIZE", "APPROXIMATE_THRESHOLD",
      "MATCH_CONFIDENCE", "MAX_EXAMPLES_PER_SPLIT")}
  assert values == {"PROMPT_LENGTH": 50, "GENERATION_LENGTH": 50, "BEAM_SIZE": 0, "TRAIN_SAMPLE_SIZE": 10000,
                    "APPROXIMATE_THRESHOLD": 0.1, "MATCH_CONFIDENCE": 0.95, "MAX_EXAMPLES_PER_SPLIT": 1000}
  bound = gin.config_str()
  for name in ("train_sample_size", "approximate_threshold", "match_confidence", "prompt_length"):
    assert f"run_memorization.{name}" in bound
  gin.clear_config()


def test_report_has_the_match_rates_intervals_and_throughput(tmp_path):
  ex = lambda preds, n: extraction_metrics.aggregate(preds, [[5, 6, 7, 8]] * n).as_dict()
  splits = {"train_dup": ex([[5, 6, 7, 8]] * 5 + [[5, 6, 7, 9]] * 5, 10),
            "train_unique": ex([[2, 2, 2, 2]] * 4, 4), "valid_in_train": ex([], 0),
            "valid_unique": ex([[5, 6, 7, 9]] + [[2, 2, 2, 2]] * 3, 4)}
  splits["overall"] = extraction_metrics.pool(list(splits.values()))
  splits["train_sample"] = ex([[5, 6, 7, 8]] + [[2, 2, 2, 2]] * 9, 10)
  rep = {"checkpoint": {"model_dir": "/m", "step": 1}, "epsilon_text": "ε = ∞",
         "settings": {"prompt_length": 50, "generation_length": 50}, "extraction": {"greedy": splits},
         "train_sample": {"size": 10, "eligible": 40, "documents": 55, "evaluated": 10, "min_length": 100, "seed": 0},
         "decoding": {"greedy/train_sample": {"prompts": 10, "seconds": 4.0, "prompts_per_second": 2.5}},
         "throughput": {"tokens_per_second_steady": 10.0, "generated_tokens": 40, "seconds": 4.0, "prompts": 10,
                        "prompts_per_second": 2.5}}
  report.write_report(rep, str(tmp_path))
  md = (tmp_path / "report.md").read_text()
  assert "| Train dup | 10 | 0 | 50.00 | 87.50 | 0.5 | 18.71–81.29 | 50.00 | 18.71–81.29 | – |" in md
  assert "| Train sample (uniform) | 10 | 0 | 10.00 |" in md and "| 0.25–44.50 | 2.5 |" in md
  assert "| All four splits | 18 |" in md and "approx. % (≤ 0.1)" in md and "EM 95% CI" in md
  assert "10 documents drawn uniformly (seed 0) from the 40 of 55" in md and "2.5 prompts/s" in md
  data = json.loads((tmp_path / "report.json").read_text())
  assert data["extraction"]["greedy"]["valid_in_train"]["exact_match_ci"] == [None, None]
