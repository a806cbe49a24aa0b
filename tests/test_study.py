"""`private-t5 study`: the planted duplicates, bad input, and a smoke run of every model."""
import json
import os
import shutil

import pytest

from private_t5.stages import cli
from private_t5.data import duplication
from private_t5.documents import Document
from private_t5.errors import ConfigError, DataError
from private_t5.experiments import study

# A micro T5 (one layer each side, d_model 32) and a handful of steps: the smoke run checks
# the plumbing and the output shape, not the numbers.
MICRO_STUDY_ARGS = ["--gin.VOCAB_SIZE=512", "--gin.T5Config.d_model=32", "--gin.T5Config.num_heads=2",
                    "--gin.T5Config.d_ff=64", "--gin.T5Config.num_encoder_layers=1",
                    "--gin.T5Config.num_decoder_layers=1", "--gin.BATCH_SIZE=8", "--gin.train.microbatch_size=8",
                    "--gin.TRAIN_STEPS=2", "--gin.train.eval_examples=16", "--gin.train.mesh_shape=(1, 1)",
                    "--gin.train.insecure_deterministic_seed=1234", "--gin.run_study.max_documents=200",
                    "--gin.run_study.vocab_size=400", "--gin.run_study.prompt_length=8",
                    "--gin.run_study.generation_length=8", "--gin.run_study.max_examples_per_split=8",
                    "--gin.TASK_FEATURE_LENGTHS={'inputs': 9, 'targets': 9}"]


def _docs(n):
  return [Document(f"d{i}", f"document number {i} " * 3) for i in range(n)]


def test_plant_duplicates_is_seeded_and_records_repetitions():
  cfg = duplication.DuplicationConfig(validation_fraction=0.2, fraction=0.3, repetitions=(2, 5, 10), seed=3)
  study = duplication.plant_duplicates(_docs(100), cfg)
  assert len(study.valid) == 20 and study.num_train_original == 80
  assert sorted(study.repeated.values()) == [2] * 8 + [5] * 8 + [10] * 8
  assert len(study.train) == 80 + sum(r - 1 for r in study.repeated.values())
  ids = [d.id for d in study.train]
  assert len(set(ids)) == len(ids)
  valid_ids = {d.id for d in study.valid}
  assert not valid_ids & set(study.repeated)
  texts = [d.text for d in study.train]
  for doc_id, r in study.repeated.items():
    original = next(d for d in study.train if d.id == doc_id)
    assert texts.count(original.text) == r
  again = duplication.plant_duplicates(_docs(100), cfg)
  assert [d.id for d in again.train] == ids and again.repeated == study.repeated


def test_extraction_by_repetitions_counts_each_document_once():
  from private_t5.experiments import study as study_stage  # pylint: disable=g-import-not-at-top
  repeated = {"a": 2, "b": 10, "c": 10}
  per_document = {"ids": ["a", "a#copy1", "b#copy3", "b#copy7", "c#copy2", "n1", "n2"],
                  "exact": [0, 0, 1, 0, 0, 1, 0]}
  assert study_stage.em_by_repetitions(per_document, repeated) == {
      "2": {"em": 0.0, "n": 1}, "10": {"em": 0.5, "n": 2}, "natural": {"em": 0.5, "n": 2}}
  assert study_stage.em_by_repetitions({"ids": [], "exact": []}, repeated) == {}
  assert duplication.original_id("fortune/art/100#copy9") == "fortune/art/100"
  assert duplication.original_id("fortune/art/100") == "fortune/art/100"


@pytest.mark.parametrize("kwargs", [{"validation_fraction": 0.0}, {"fraction": 1.5}, {"repetitions": (1,)},
                                    {"repetitions": ()}, {"max_documents": 1}])
def test_bad_duplication_settings(kwargs):
  with pytest.raises(ConfigError):
    duplication.DuplicationConfig(**kwargs).validate()


def test_too_few_documents():
  with pytest.raises(DataError, match="cannot be split"):
    duplication.plant_duplicates(_docs(3), duplication.DuplicationConfig(validation_fraction=0.1))


@pytest.mark.parametrize("argv,message", [
    ([], "missing --corpus"),
    (["--corpus=/no/such/corpus.jsonl"], "missing --output"),
    (["--corpus=/no/such/corpus.jsonl", "--output={out}"], "/no/such/corpus.jsonl"),
    (["--corpus=x", "--output={out}", "--gin.run_study.models=['bogus']"], "models must be"),
    (["--corpus=x", "--output={out}", "--gin.run_study.duplicate_fraction=2.0"], "duplicate fraction"),
    (["--corpus=x", "--output={out}", "--gin.run_study.audit_canaries=8", "--gin.run_study.audit_canary_kind='tokens'"],
     "needs a SentencePiece vocabulary"),
])
def test_bad_input_is_one_line(argv, message, tmp_path, capsys):
  out = tmp_path / "study"
  assert cli.main(["study"] + [a.format(out=out) for a in argv]) == 2
  err = [l for l in capsys.readouterr().err.strip().splitlines() if "[study] phase" not in l]
  assert len(err) == 1 and err[0].startswith("error:") and message in err[0]
  assert not out.exists()


@pytest.mark.slow
def test_validation_metrics_of_private_documents_are_labelled_not_dp():
  from private_t5.experiments import study as study_stage  # pylint: disable=g-import-not-at-top
  from private_t5.eval import study_report  # pylint: disable=g-import-not-at-top
  split = {"exact_match": 0.0, "token_accuracy": 0.5, "median_edit_distance": 3.0, "n": 4}
  report = {"extraction": {"greedy": {s: split for s in study_report.SPLITS}}}
  summary = {"private": True, "validation_not_dp": {"token_accuracy": 0.25, "loss": 4.0},
             "epsilon": 2.0, "delta": 1e-6, "training_epsilon": 1.5, "training_delta": 1e-6}
  result = study_stage.model_result("dp_prefix", study_stage.MODELS["dp_prefix"], summary, report, {})
  assert result["validation_token_accuracy"] == 0.25
  assert {"validation_token_accuracy", "validation_loss"} <= set(result["not_dp"])
  header = study_report.utility_table({"models": {"dp_prefix": result}})[0]
  assert "validation token accuracy % (not DP)" in header and "validation loss (not DP)" in header
  assert "not covered by ε (not DP)" in study_report.results_markdown({"models": {"dp_prefix": result}})


def test_study_smoke_every_model(shared_data, tmp_path):
  corpus = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  out = tmp_path / "study"
  argv = ["study", f"--corpus={corpus}", f"--output={out}", *MICRO_STUDY_ARGS, "--gin.run_study.audit_canaries=32",
          # a budget at which the DP vocabulary of 180 short documents keeps words for certain (at the
          # default 3.37 its threshold, 177, is near the commonest words' document counts)
          "--gin.run_study.dp_vocab_epsilon=8",
          "--gin.run_study.train_sample_size=24"]
  assert cli.main(argv) == 0
  results = json.loads((out / "results.json").read_text())
  models = results["models"]
  assert set(models) == {"nondp_prefix", "nondp_span", "dp_prefix", "fulldp_prefix"}
  for name, m in models.items():
    assert m["objective"] == ("span_corruption" if name == "nondp_span" else "prefix_lm")
    assert set(m["splits"]) == {"train_dup", "train_unique", "valid_in_train", "valid_unique"}
    for split in m["splits"].values():
      assert {"em", "ta", "med", "n", "am", "em_ci", "am_ci"} <= set(split)
    assert 0.0 <= m["validation_token_accuracy"] <= 1.0
    assert m["privacy_unit"] == "document"
    assert m["groups"]["train_sample"]["n"] == 24 and {"em", "am", "em_ci", "am_ci"} <= set(m["groups"]["train_sample"])
    # The one-run audit of every model (32 canaries, 8 guesses a side): a DP model's bound is at most its ε.
    assert m["audit"]["num_canaries"] == 32 and m["audit"]["guesses"] == 16 and not m["audit"]["violation"]
    assert m["audit"]["epsilon_lower_bound"] <= m["audit"]["max_lower_bound"] and "auroc" in m["audit"]
    if name.startswith(("dp_", "fulldp_")):
      assert m["private"] and 0 < m["epsilon"] < float("inf") and 0 < m["delta"] < 1
      assert m["audit"]["epsilon_lower_bound"] <= m["audit"]["ledger_epsilon"]
    else:
      assert not m["private"] and m["epsilon"] is None and m["delta"] is None
  # The DP vocabulary's ε is composed into the full-DP model's ε.
  assert models["fulldp_prefix"]["epsilon"] > models["dp_prefix"]["epsilon"]
  assert models["fulldp_prefix"]["epsilon_scope"] == "training + vocabulary"
  assert sum(results["data"]["repeated_by_count"].values()) == results["data"]["repeated_documents"] > 0
  for name, m in models.items():
    # Per-document outcomes agree with the split's EM, and the breakdown covers only train dup.
    report = json.loads((out / "models" / name / "memorization" / "report.json").read_text())
    for split, outcome in report["per_document"]["greedy"].items():
      figures = m["splits"][split] if split in m["splits"] else m["groups"][split]
      assert len(outcome["ids"]) == len(outcome["exact"]) == figures["n"]
      if outcome["exact"]:
        assert sum(outcome["exact"]) / len(outcome["exact"]) == pytest.approx(figures["em"])
    by = m["train_dup_by_repetitions"]
    assert set(by) <= {"2", "5", "10", "natural"} and sum(g["n"] for g in by.values()) <= m["splits"]["train_dup"]["n"]
  # Training drew each document's opening window, the one the prompts come from (study.gin).
  assert results["settings"]["training_windows"] == 1
  assert results["settings"]["train_sample_size"] == 24 and "train sample" in (out / "results.md").read_text()
  assert "each document's opening window" in (out / "results.md").read_text()
  assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "Table 3" in (out / "results.md").read_text()
  assert "Extraction by number of repetitions" in (out / "results.md").read_text()
  assert "Privacy audit" in (out / "results.md").read_text()
  assert os.path.isfile(out / "data" / "train.audit.json")
  # A second run reuses every model's result.
  assert cli.main(argv) == 0
  assert json.loads((out / "results.json").read_text())["models"] == models
  # An evaluation interrupted before its result was written (dp_prefix's): the next run evaluates that
  # model again from its finished checkpoint, and the results keep every field and figure.
  os.remove(out / "models" / "dp_prefix" / study.RESULT_FILE)
  shutil.rmtree(out / "models" / "dp_prefix" / "memorization")
  assert cli.main(argv) == 0
  again = json.loads((out / "results.json").read_text())["models"]
  strip = lambda m: {k: v for k, v in m.items() if k != "wall_seconds"}
  assert {n: strip(m) for n, m in again.items()} == {n: strip(m) for n, m in models.items()}
  assert set(again["dp_prefix"]["wall_seconds"]) == set(models["dp_prefix"]["wall_seconds"])


def test_a_corpus_beyond_the_in_memory_bound_is_refused(tmp_path, monkeypatch, shared_data):
  from private_t5.experiments import study
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  monkeypatch.setattr(study, "MAX_DOCUMENTS", 50)
  with pytest.raises(ConfigError, match="max_documents must be <= 50"):
    study.prepare_data(src, str(tmp_path / "a"), duplication.DuplicationConfig(max_documents=51))
  with pytest.raises(ConfigError, match="has more than 50 documents"):
    study.prepare_data(src, str(tmp_path / "b"), duplication.DuplicationConfig())
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
  record = study.prepare_data(src, str(tmp_path / "c"), duplication.DuplicationConfig(max_documents=50))
  assert record["stats"]["train_documents"] + record["stats"]["valid_documents"] == 50


def _new_results():
  """A results dict as `model_result` builds it from a report with today's audit and extraction figures."""
  from private_t5.experiments import study  # pylint: disable=g-import-not-at-top
  split = {"exact_match": 0.25, "token_accuracy": 0.5, "median_edit_distance": 3.0, "n": 4, "skipped": 0,
           "mean_edit_distance": 3.0, "exact_matches": 1, "exact_match_ci": [0.0063, 0.806],
           "approximate_match": 0.5, "approximate_matches": 2, "approximate_match_ci": [0.0676, 0.932],
           "approximate_threshold": 0.1, "confidence": 0.95}
  greedy = {s: split for s in study.SPLIT_NAMES}
  greedy["train_sample"] = dict(split, approximate_match=0.75, n=8)
  greedy["overall"] = dict(split, median_edit_distance=float("nan"), n=16)
  audit = {"epsilon_lower_bound": 0.412, "max_lower_bound": 1.877, "epsilon_lower_bound_fdp": 0.533,
           "max_lower_bound_fdp": 2.951, "method": "CanaryScoreAuditor.epsilon_one_run",
           "method_fdp": "CanaryScoreAuditor.epsilon_one_run_fdp",
           "tpr_at_fpr": [{"fpr": 0.01, "tpr": 0.3, "interval": [0.1, 0.5]}, {"fpr": 0.001, "tpr": 0.2, "interval": None}],
           "auroc": 0.71, "auroc_interval": [0.6, 0.8], "saturated": True, "saturation": "all guesses right: test",
           "steinke": {"epsilon_lower_bound": 0.2}, "guesses": 16, "correct": 12, "confidence": 0.95, "delta": 1e-6,
           "ledger_epsilon": 1.5, "num_canaries": 64, "num_included": 30, "violation": False,
           "fdp_exceeds_ledger": False, "canary_kind": "rare_words"}
  report = {"extraction": {"greedy": greedy}, "audit": audit}
  summary = {"private": True, "validation_not_dp": {"token_accuracy": 0.25, "loss": 4.0},
             "training_epsilon": 1.5, "training_delta": 1e-6}
  return {"models": {"dp_prefix": study.model_result("dp_prefix", study.MODELS["dp_prefix"], summary, report, {})}}


def _old_results():
  """A results dict as the study wrote it before the f-DP audit and the approximate-match rates."""
  split = {"em": 0.0, "ta": 0.5, "med": 3.0, "n": 4}
  return {"models": {"nondp_prefix": {
      "objective": "prefix_lm", "private": False, "vocabulary": "spm", "epsilon": None, "delta": None,
      "validation_token_accuracy": 0.5, "validation_loss": 3.0, "splits": {s: split for s in (
          "train_dup", "train_unique", "valid_in_train", "valid_unique")},
      "audit": {"epsilon_lower_bound": 0.9, "confidence": 0.95, "num_canaries": 32, "guesses": 16, "correct": 15,
                "ledger_epsilon": None, "delta": 1e-5, "violation": False}}}}


def test_results_render_the_audit_and_extraction_figures_and_older_results(tmp_path):
  from private_t5.eval import study_report  # pylint: disable=g-import-not-at-top
  new = _new_results()
  m = new["models"]["dp_prefix"]
  assert m["splits"]["train_dup"]["am"] == 0.5 and m["splits"]["train_dup"]["am_ci"] == [0.0676, 0.932]
  assert m["groups"]["train_sample"]["am"] == 0.75 and m["groups"]["overall"]["med"] is None
  assert m["audit"]["epsilon_lower_bound_fdp"] == 0.533 and m["audit"]["tpr_at_fpr"][0]["tpr"] == 0.3
  md = study_report.results_markdown(new)
  assert "Steinke, Nasr and Jagielski 2023; Mahloujifar, Melis and Chaudhuri 2025" in md
  assert "CanaryScoreAuditor" in md and "EM % / AM % / TA % / MED (n)" in md and "train sample EM" in md
  assert "| 25.00 / 50.00 / 50.00 / 3 (4) |" in md and "25.00 / 75.00 / 50.00 / 3 (8)" in md
  row = next(l for l in md.splitlines() if l.startswith("| dp_prefix | 0.412"))
  assert "| 1.877 | 0.533 (cap 2.951) | 0.3 [0.1, 0.5] | 0.71 [0.6, 0.8] | yes | 95% | 12 / 16 | 64 | 1.5 |" in row
  assert "dp_prefix: saturated: all guesses right: test" in md
  old_md = study_report.results_markdown(_old_results())
  assert "AM %" not in old_md and "train sample" not in old_md
  assert "| nondp_prefix | 0.900 | – | – | – | – | – | 95% | 15 / 16 | 32 | ∞ |" in old_md
  both = {"models": {**_old_results()["models"], **new["models"]}}
  paths = study_report.write_results(both, str(tmp_path))
  assert json.loads((tmp_path / "results.json").read_text())["models"]["dp_prefix"]["groups"]["overall"]["n"] == 16
  for results, name in ((new, "new.png"), (_old_results(), "old.png"), (both, "both.png")):
    assert study_report.write_figure(results, str(tmp_path / name))
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(paths) == 3


def test_audit_canary_kind(tmp_path, shared_data):
  from private_t5.experiments import study  # pylint: disable=g-import-not-at-top
  assert study.check_audit_canary_kind("rare_words") == "rare_words"
  for kind, message in (("tokens", "needs a SentencePiece vocabulary"), ("bogus", "must be one of words, rare_words")):
    with pytest.raises(ConfigError, match=message):
      study.check_audit_canary_kind(kind)
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  cfg = duplication.DuplicationConfig(max_documents=200)
  record = study.prepare_data(src, str(tmp_path), cfg, audit_canaries=32, audit_canary_kind="rare_words")
  assert record["settings"]["audit_canary_kind"] == "rare_words"
  assert json.loads(open(record["audit_record"]).read())["canary_kind"] == "rare_words"
  with pytest.raises(ConfigError, match="other data settings"):
    study.prepare_data(src, str(tmp_path), cfg, audit_canaries=32)
