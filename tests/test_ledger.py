"""The privacy ledger: JSON round trip, resume composition, components, inconsistent resume."""
import json
import math
import os

import dp_accounting
import pytest

from private_t5.dp import accounting
from private_t5.dp import truncation
from private_t5.dp import privacy_report
from private_t5.dp.ledger import PrivacyLedger
from private_t5.errors import DataError, PrivacyError


def _ledger(**overrides):
  kw = dict(noise_multiplier=1.1, clip_norm=1.0, delta=1e-6, num_examples=50_000, batch_size=500,
            max_batch_size=600)
  kw.update(overrides)
  return PrivacyLedger.create(**kw)


def test_json_round_trip(tmp_path):
  ledger = _ledger()
  ledger.record_steps(120)
  ledger.add_component("dp_sentencepiece", 0.5, 1e-7, "vocab/privacy_report.json")
  path = ledger.save(str(tmp_path / "privacy_report.json"))
  assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
  loaded = PrivacyLedger.load(path)
  assert loaded == ledger
  assert PrivacyLedger.from_dict(ledger.to_dict()) == ledger
  report = json.loads(open(path).read())
  for key in ("epsilon", "delta", "noise_multiplier", "sampling_rate", "steps", "clip_norm", "accountant",
              "privacy_unit", "components", "training_epsilon", "total_epsilon", "total_delta",
              "truncation_probability"):
    assert key in report, key
  assert report["sampling_rate"] == pytest.approx(0.01)
  assert report["expected_batch_size"] == pytest.approx(500)


def test_training_epsilon_matches_accounting():
  ledger = _ledger()
  assert ledger.training_epsilon() == 0.0
  ledger.record_steps(300)
  assert ledger.training_epsilon() == pytest.approx(accounting.compute_epsilon(1.1, 0.01, 300, 1e-6))
  p = truncation.truncation_probability(50_000, 0.01, 600)
  assert ledger.truncation_probability == pytest.approx(p)
  eps = ledger.training_epsilon()
  assert ledger.training_delta() == pytest.approx(1e-6 + (1 + math.exp(eps)) * 300 * p)


def test_resume_in_two_halves_equals_one_run(tmp_path):
  whole = _ledger()
  whole.record_steps(400)
  first = _ledger()
  first.record_steps(200)
  first.save(str(tmp_path / "ckpt.json"))
  second = _ledger().resume_from(PrivacyLedger.load(str(tmp_path / "ckpt.json")))
  second.record_steps(200)
  assert second == whole
  assert second.report() == whole.report()


def test_components_compose_by_summation(tmp_path):
  report_path = tmp_path / "privacy_report.json"
  report_path.write_text(json.dumps({"mechanism": "dp_sentencepiece", "epsilon": 0.17, "delta": 1e-8,
                                     "threshold": 123.0}))
  ledger = _ledger()
  ledger.record_steps(100)
  comp = ledger.add_component_from_report(str(report_path))
  assert comp["name"] == "dp_sentencepiece" and comp["source"] == str(report_path)
  ledger.add_component_from_report(str(report_path))  # idempotent
  assert len(ledger.components) == 1
  assert ledger.total_epsilon() == pytest.approx(ledger.training_epsilon() + 0.17)
  assert ledger.total_delta() == pytest.approx(ledger.training_delta() + 1e-8)
  rep = ledger.report()
  assert rep["epsilon"] == pytest.approx(rep["training_epsilon"] + 0.17)
  with pytest.raises(PrivacyError, match="already"):
    ledger.add_component("dp_sentencepiece", 0.3, 1e-8, str(report_path))
  # Components survive resume and are not double counted.
  resumed = _ledger().resume_from(ledger)
  resumed.add_component_from_report(str(report_path))
  assert resumed.total_epsilon() == pytest.approx(ledger.total_epsilon())


def test_a_moved_dp_vocabulary_is_composed_once_on_resume(tmp_path):
  """A run directory and its DP vocabulary copied elsewhere (another mount, a copy of the
  study): the vocabulary is the same release, known by its content hash, not by its path."""
  from private_t5.io import file_sha256  # pylint: disable=g-import-not-at-top
  for where in ("first", "moved"):
    (tmp_path / where).mkdir()
    (tmp_path / where / "dp_spm.model").write_bytes(b"the same vocabulary")
    (tmp_path / where / "privacy_report.json").write_text(json.dumps(
        {"mechanism": "dp_sentencepiece", "epsilon": 3.37, "delta": 1e-8, "privacy_unit": "document",
         "vocab_sha256": file_sha256(str(tmp_path / where / "dp_spm.model"))}))
  ledger = _ledger()
  ledger.add_vocabulary(str(tmp_path / "first" / "dp_spm.model"), str(tmp_path / "first" / "privacy_report.json"))
  ledger.record_steps(100)
  saved = PrivacyLedger.load(ledger.save(str(tmp_path / "ckpt.json")))
  fresh = _ledger()
  fresh.add_vocabulary(str(tmp_path / "moved" / "dp_spm.model"), str(tmp_path / "moved" / "privacy_report.json"))
  resumed = fresh.resume_from(saved)
  assert len(resumed.components) == 1
  assert resumed.total_epsilon() == pytest.approx(ledger.total_epsilon())
  assert resumed.total_delta() == pytest.approx(ledger.total_delta())
  # Another vocabulary is another release: both count.
  (tmp_path / "moved" / "dp_spm.model").write_bytes(b"another vocabulary")
  (tmp_path / "moved" / "privacy_report.json").write_text(json.dumps(
      {"mechanism": "dp_sentencepiece", "epsilon": 3.37, "delta": 1e-8, "privacy_unit": "document",
       "vocab_sha256": file_sha256(str(tmp_path / "moved" / "dp_spm.model"))}))
  other = _ledger()
  other.add_vocabulary(str(tmp_path / "moved" / "dp_spm.model"), str(tmp_path / "moved" / "privacy_report.json"))
  assert len(other.resume_from(saved).components) == 2


@pytest.mark.parametrize("change", [dict(noise_multiplier=1.2), dict(batch_size=600, max_batch_size=700),
                                    dict(clip_norm=0.5), dict(delta=1e-7), dict(max_batch_size=650)])
def test_inconsistent_resume_is_refused(change):
  saved = _ledger()
  saved.record_steps(10)
  with pytest.raises(PrivacyError, match="cannot resume"):
    _ledger(**change).resume_from(saved)


def test_privacy_unit_change_refused():
  saved = _ledger(privacy_unit="user")
  with pytest.raises(PrivacyError, match="privacy_unit"):
    _ledger().resume_from(saved)


def test_non_private_baseline(tmp_path):
  ledger = PrivacyLedger.non_private_baseline(num_examples=1000, batch_size=10)
  ledger.record_steps(5)
  assert math.isinf(ledger.training_epsilon())
  rep = ledger.report()
  assert rep["epsilon"] is None and rep["dp"] is False
  loaded = PrivacyLedger.load(ledger.save(str(tmp_path / "r.json")))
  assert loaded.non_private and loaded.steps == 5
  with pytest.raises(PrivacyError):
    _ledger().resume_from(loaded)


def test_bad_inputs(tmp_path):
  with pytest.raises(PrivacyError):
    _ledger(noise_multiplier=0.0)
  with pytest.raises(PrivacyError):
    _ledger(clip_norm=-1.0)
  with pytest.raises(PrivacyError, match="larger than the dataset"):
    _ledger(batch_size=60_000)
  with pytest.raises(PrivacyError, match="privacy_unit"):
    _ledger(privacy_unit="sentence")
  with pytest.raises(DataError):
    PrivacyLedger.load(str(tmp_path / "missing.json"))
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(DataError):
    PrivacyLedger.load(str(tmp_path / "bad.json"))
  with pytest.raises(DataError, match="epsilon"):
    (tmp_path / "noeps.json").write_text("{}")
    _ledger().add_component_from_report(str(tmp_path / "noeps.json"))


def test_component_at_a_weaker_privacy_unit_is_refused(tmp_path):
  report_path = tmp_path / "privacy_report.json"
  report_path.write_text(json.dumps({"mechanism": "dp_sentencepiece", "epsilon": 0.17, "delta": 1e-8,
                                     "privacy_unit": "document"}))
  with pytest.raises(PrivacyError, match="document-level DP but training is user-level"):
    _ledger(privacy_unit="user").add_component_from_report(str(report_path))
  ledger = _ledger(privacy_unit="document")
  ledger.add_component_from_report(str(report_path))
  assert [(c["epsilon"], c["delta"]) for c in ledger.components] == [(0.17, 1e-8)]


def test_component_at_a_stronger_privacy_unit_is_composed_by_group_privacy(tmp_path):
  # Removing one chunk of a multi-chunk document changes that document: for a document-level
  # vocabulary a substitution (remove, then add), so its (ε, δ) counts as (2ε, (1 + e^ε)·δ).
  report_path = tmp_path / "privacy_report.json"
  report_path.write_text(json.dumps({"mechanism": "dp_sentencepiece", "epsilon": 0.17, "delta": 1e-8,
                                     "privacy_unit": "document"}))
  ledger = _ledger(privacy_unit="example")
  ledger.record_steps(10)
  component = ledger.add_component_from_report(str(report_path))
  assert component["epsilon"] == pytest.approx(0.34)
  assert component["delta"] == pytest.approx(1e-8 * (1 + math.exp(0.17)))
  assert component["group_privacy"] == {"size": 2, "privacy_unit": "document", "epsilon": 0.17, "delta": 1e-8}
  assert ledger.total_epsilon() == pytest.approx(ledger.training_epsilon() + 0.34)
  assert ledger.report()["epsilon"] == pytest.approx(ledger.training_epsilon() + 0.34)
  # Re-composed on resume without counting it twice.
  resumed = _ledger(privacy_unit="example")
  resumed.add_component_from_report(str(report_path))
  assert resumed.resume_from(ledger).components == ledger.components
  # A user-level release under document-level training: the same substitution argument.
  report_path.write_text(json.dumps({"mechanism": "dp_sentencepiece", "epsilon": 0.5, "delta": 1e-8,
                                     "privacy_unit": "user"}))
  assert _ledger(privacy_unit="document").add_component_from_report(str(report_path))["epsilon"] == 1.0
  # A δ that group privacy takes past 1 is no guarantee: refused in one line.
  report_path.write_text(json.dumps({"mechanism": "dp_sentencepiece", "epsilon": 40.0, "delta": 1e-8,
                                     "privacy_unit": "document"}))
  with pytest.raises(PrivacyError, match="group privacy.*>= 1: no guarantee"):
    _ledger(privacy_unit="example").add_component_from_report(str(report_path))


def test_insecure_noise_is_recorded_and_the_report_says_it_is_no_guarantee(tmp_path):
  ledger = _ledger(noise_secret=False)
  ledger.record_steps(100)
  report = ledger.report()
  assert report["noise_secret"] is False and math.isfinite(report["epsilon"])
  assert len(report["warnings"]) == 1 and report["warnings"][0].startswith("NO PRIVACY GUARANTEE")
  assert "insecure_deterministic_seed" in report["warnings"][0]
  secure = _ledger()
  assert secure.report()["noise_secret"] is True and secure.report()["warnings"] == []
  # Once the noise was predictable, a resumed run's report still says so.
  loaded = PrivacyLedger.load(ledger.save(str(tmp_path / "r.json")))
  assert loaded.noise_secret is False and secure.resume_from(loaded).report()["noise_secret"] is False
  # A DP vocabulary made with a fixed seed is composed, but recorded and said to be insecure.
  vocab_report = tmp_path / "privacy_report.json"
  for fields in ({"noise_secret": False}, {"noise_seed": "insecure_fixed_seed", "insecure_seed": 0}):
    vocab_report.write_text(json.dumps({"mechanism": "dp_sentencepiece", "epsilon": 0.17, "delta": 1e-8,
                                        "privacy_unit": "document", **fields}))
    composed = _ledger()
    component = composed.add_component_from_report(str(vocab_report))
    assert component["noise_secret"] is False
    report = composed.report()
    assert report["noise_secret"] is False and report["vocabulary"] == "dp"
    assert len(report["warnings"]) == 1 and "dp_sentencepiece" in report["warnings"][0]
    assert "NO PRIVACY GUARANTEE" in report["warnings"][0]
    fresh = _ledger()
    fresh.add_component_from_report(str(vocab_report))
    assert fresh.resume_from(PrivacyLedger.from_dict(report)).report()["noise_secret"] is False


def test_initial_checkpoint_trained_on_the_private_data_is_in_the_guarantee(tmp_path):
  vocab = tmp_path / "spm.model"
  vocab.write_bytes(b"vocabulary")
  phase1 = PrivacyLedger.non_private_baseline(num_examples=50_000, batch_size=500)
  phase1.record_steps(10)
  ledger = _ledger()
  ledger.record_steps(100)
  ledger.add_vocabulary(str(vocab), public=True)
  note = "trained WITHOUT DP on a redacted copy of this data (JFT phase 1)"
  component = ledger.add_initial_checkpoint(phase1.report(), str(tmp_path / "phase1"), note)
  assert component["private"] is False and note in component["reason"]
  report = ledger.report()
  # The release's ordinary guarantee is ∞; phase 2's own share stays visible, labelled as such.
  assert report["epsilon"] is None and report["vocabulary"] == "public"
  assert report["epsilon_without_initial_checkpoint"] == pytest.approx(ledger.training_epsilon())
  assert report["delta_without_initial_checkpoint"] == pytest.approx(ledger.training_delta())
  assert any(note in line for line in report["warnings"])
  resumed = _ledger()
  resumed.add_initial_checkpoint(phase1.report(), str(tmp_path / "phase1"), note)
  assert resumed.resume_from(PrivacyLedger.from_dict(report)).report()["epsilon"] is None
  # A light-noise DP initial checkpoint is composed at its (ε, δ).
  dp_phase1 = _ledger(noise_multiplier=4.0)
  dp_phase1.record_steps(50)
  composed = _ledger()
  composed.record_steps(100)
  composed.add_initial_checkpoint(dp_phase1.report(), str(tmp_path / "phase1"), note)
  assert composed.total_epsilon() == pytest.approx(dp_phase1.total_epsilon() + composed.training_epsilon())
  assert composed.report()["epsilon_without_initial_checkpoint"] == pytest.approx(composed.training_epsilon())
  assert composed.vocabulary_status() is None and composed.report()["warnings"] == []


def test_non_private_vocabulary_makes_the_total_infinite_and_survives_resume(tmp_path):
  vocab = tmp_path / "spm.model"
  vocab.write_bytes(b"vocabulary")
  ledger = _ledger()
  ledger.record_steps(100)
  component = ledger.add_vocabulary(str(vocab))
  assert component["private"] is False and not component["public"]
  assert math.isinf(ledger.total_epsilon()) and math.isfinite(ledger.training_epsilon())
  rep = ledger.report()
  assert rep["epsilon"] is None and rep["total_epsilon"] is None and rep["training_epsilon"] > 0
  assert rep["dp"] is True and rep["vocabulary"] == "not private"
  loaded = PrivacyLedger.load(ledger.save(str(tmp_path / "r.json")))
  assert loaded == ledger and math.isinf(loaded.total_epsilon())
  fresh = _ledger()
  fresh.add_vocabulary(str(vocab))
  resumed = fresh.resume_from(loaded)
  assert len(resumed.components) == 1 and math.isinf(resumed.total_epsilon())
  public = _ledger()
  public.record_steps(100)
  public.add_vocabulary(str(vocab), public=True)
  assert public.total_epsilon() == public.training_epsilon() and public.report()["vocabulary"] == "public"


def test_auto_ledger_reports_both_and_the_smaller(tmp_path):
  ledger = PrivacyLedger.create(noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, num_examples=10_000,
                                batch_size=100, accountant="auto", configured_batch_size=64,
                                clipping_method="ghost")
  ledger.record_steps(300)
  report = ledger.report()
  assert report["epsilon_rdp"] == pytest.approx(accounting.compute_epsilon(1.0, 0.01, 300, 1e-6, "rdp"))
  assert report["epsilon_pld"] == pytest.approx(accounting.compute_epsilon(1.0, 0.01, 300, 1e-6, "pld"))
  assert report["training_epsilon"] == min(report["epsilon_rdp"], report["epsilon_pld"])
  used = report["accountant_used"]
  assert report["training_epsilon"] == report[f"epsilon_{used}"]
  assert report["truncation_delta"] == 0.0 and report["batch_size"] == 64
  assert report["expected_batch_size"] == pytest.approx(100) and report["clipping_method"] == "ghost"
  path = str(tmp_path / "privacy_report.json")
  ledger.save(path)
  assert PrivacyLedger.load(path) == ledger


def _vocabulary_with_report(tmp_path, epsilon=3.0, delta=1e-8, unit="document"):
  """A vocabulary and its DP-SentencePiece report (the privacy fields dp-spm writes)."""
  vocab = tmp_path / "dp.model"
  vocab.write_bytes(b"a dp vocabulary")
  params = accounting.thresholded_gaussian_parameters(delta, l2=8.0, linf=1.0, max_distinct=64,
                                                      target_epsilon=epsilon)
  report = privacy_report.vocabulary_report(params, model_bytes=b"a dp vocabulary", insecure_seed=None)
  report["privacy_unit"] = unit
  path = privacy_report.write_report(privacy_report.vocabulary_report_path(str(vocab)), report)
  return str(vocab), path, params


def _by_hand(accountant, delta, *events):
  """ε of `events` composed by dp_accounting directly (not through private_t5's helpers)."""
  if accountant == "auto":
    return min(_by_hand(name, delta, *events) for name in ("rdp", "pld"))
  acc = (dp_accounting.rdp.RdpAccountant() if accountant == "rdp"
         else dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3))
  for event in events:
    acc.compose(event)
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld", "auto"])
def test_training_and_vocabulary_compose_by_events_at_the_same_delta(tmp_path, accountant):
  vocab, path, params = _vocabulary_with_report(tmp_path)
  assert privacy_report.find_vocabulary_report(vocab) == path
  ledger = _ledger(accountant=accountant, max_batch_size=None, delta=1e-8)
  ledger.add_vocabulary(vocab, path)
  assert ledger.epsilon_by_events() is None  # before the first step
  assert "no step taken yet" in ledger.composition()
  ledger.record_steps(500)
  report = ledger.report()
  by_events = report["epsilon_by_events"]
  # Both bound the same release at the same total δ: training δ + δ_g + δ_t.
  assert report["delta"] == pytest.approx(1e-8 + params["delta_gaussian"] + params["delta_threshold"])
  assert report["epsilon_by_addition"] == pytest.approx(ledger.training_epsilon() + params["epsilon"])
  # The reported ε is the composition by events: at least each part, below the sum.
  assert max(ledger.training_epsilon(), params["epsilon"]) < by_events < report["epsilon_by_addition"]
  assert report["epsilon"] == report["total_epsilon"] == by_events == ledger.total_epsilon()
  # dp_accounting's own composition of the same two events, built here from their parameters.
  events = (dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1)), 500),
            dp_accounting.GaussianDpEvent(params["noise_multiplier"]))
  assert by_events == pytest.approx(_by_hand(accountant, 1e-8 + params["delta_gaussian"], *events), rel=1e-9)
  assert report["composition"].startswith(f"by events: ε = {by_events:.4g}")
  assert f"= {report['epsilon_by_addition']:.4g}" in report["composition"]
  # The event travels with the ledger (checkpoints, resume).
  resumed = _ledger(accountant=accountant, max_batch_size=None, delta=1e-8).resume_from(
      PrivacyLedger.from_dict(json.loads(json.dumps(report))))
  assert resumed.epsilon_by_events() == pytest.approx(by_events) == resumed.total_epsilon()


def test_quickstart_vocabulary_and_training_compose_below_their_sum(tmp_path):
  """The quickstart's numbers: a vocabulary at ε 8 (δ 1e-8, capped at 64 words a document) and
  training at ε 10 (466 documents, expected batch 32, 200 steps, δ 1e-5, σ calibrated by PLD)."""
  vocab, path, params = _vocabulary_with_report(tmp_path, epsilon=8.0)
  ledger = _ledger(noise_multiplier=0.8202, delta=1e-5, num_examples=466, batch_size=32, max_batch_size=None,
                   accountant="auto")
  ledger.add_vocabulary(vocab, path)
  ledger.record_steps(200)
  assert ledger.training_epsilon() == pytest.approx(10.0, abs=0.01)
  assert params["epsilon"] == pytest.approx(8.0, rel=1e-5)
  report = ledger.report()
  assert report["epsilon_by_addition"] == pytest.approx(18.0, abs=0.01)
  assert report["epsilon"] == pytest.approx(12.17, abs=0.01)  # PLD (RDP gives 13.47)
  assert report["delta"] == pytest.approx(1e-5 + 1e-8)
  # Each of the two numbers is named, in the report and on the console.
  assert "by events: ε = 12.17" in report["composition"] and "= 18" in report["composition"]
  assert "training 10 + dp_sentencepiece 8" in report["composition"]


def test_composition_by_events_needs_every_component_s_event(tmp_path):
  old = tmp_path / "old_report.json"  # an older report: no σ/k or δ split
  old.write_text(json.dumps({"mechanism": "dp_sentencepiece", "epsilon": 0.17, "delta": 1e-8}))
  ledger = _ledger(max_batch_size=None)
  ledger.add_component_from_report(str(old))
  ledger.record_steps(10)
  report = ledger.report()
  assert report["epsilon_by_events"] is None
  assert report["epsilon"] == report["epsilon_by_addition"] == pytest.approx(ledger.training_epsilon() + 0.17)
  assert report["composition"].startswith("by addition:") and "records no Gaussian event" in report["composition"]
  # A document-level vocabulary in example-level training composes by group privacy only.
  vocab, path, _ = _vocabulary_with_report(tmp_path)
  grouped = _ledger(max_batch_size=None, privacy_unit="example")
  grouped.add_vocabulary(vocab, path)
  grouped.record_steps(10)
  assert "event" not in grouped.components[0] and grouped.epsilon_by_events() is None
  assert grouped.total_epsilon() == grouped.epsilon_by_addition() and "group privacy" in grouped.composition()
  # A public vocabulary costs nothing: there is nothing to compose.
  public = _ledger(max_batch_size=None, accountant="rdp")
  public.add_vocabulary(str(tmp_path / "public.model"), None, public=True)
  public.record_steps(10)
  assert public.epsilon_by_events() is None and public.composition() is None
  assert public.total_epsilon() == public.training_epsilon()
  # Truncated sampling under RDP alone, and fixed batches: the sum.
  truncated = _ledger(accountant="rdp", max_batch_size=520)
  truncated.add_vocabulary(vocab, path)
  truncated.record_steps(10)
  assert truncated.epsilon_by_events() is None and "PLD accountant only" in truncated.composition()
  fixed = _ledger(accountant="rdp", max_batch_size=None, sampling="fixed")
  fixed.add_vocabulary(vocab, path)
  fixed.record_steps(10)
  assert fixed.total_epsilon() == fixed.epsilon_by_addition() and "fixed batches" in fixed.composition()


def test_report_files_have_one_rule(tmp_path):
  """The vocabulary's report is found where dp-spm writes it, and at the older names."""
  vocab = tmp_path / "v" / "spm.model"
  assert privacy_report.vocabulary_report_path(str(vocab)) == str(tmp_path / "v" / "privacy_report.json")
  assert privacy_report.report_path("run") == "run/privacy_report.json"
  assert privacy_report.summary_path("run") == "run/summary.json"
  assert privacy_report.find_vocabulary_report(str(vocab)) is None
  vocab.parent.mkdir()
  vocab.write_bytes(b"v")
  legacy = tmp_path / "v" / "spm.model.privacy_report.json"
  report = privacy_report.vocabulary_report(
      accounting.thresholded_gaussian_parameters(1e-8, l2=4.0, linf=1.0, max_distinct=16, sigma=10.0),
      model_bytes=b"v", insecure_seed=7)
  privacy_report.write_report(str(legacy), report)
  assert privacy_report.find_vocabulary_report(str(vocab)) == str(legacy)
  assert report["noise_secret"] is False and report["warnings"] and report["insecure_seed"] == 7
  privacy_report.write_summary(str(tmp_path), {"final_step": 3})
  assert json.load(open(tmp_path / "summary.json")) == {"final_step": 3}


def test_public_dp_vocabulary_is_not_composed_into_a_run_on_other_data(tmp_path):
  """A DP vocabulary of a pretraining corpus, declared public for a fine-tuning set it never saw:
  its report's guarantee is over that corpus, so this run's ε is its own training ε, at any
  vocabulary ε (group privacy would refuse this one: δ (1 + e^ε) >= 1)."""
  vocab, path, _ = _vocabulary_with_report(tmp_path, epsilon=30.0)
  declared = _ledger(max_batch_size=None, privacy_unit="example")
  component = declared.add_vocabulary(vocab, path, public=True)
  assert component["public"] and component["dp_report"] == os.path.abspath(path) and "epsilon" not in component
  declared.record_steps(100)
  assert declared.total_epsilon() == declared.training_epsilon()
  assert declared.report()["vocabulary"] == "public"
  # Not declared public: the same report is composed, and at this ε it is refused.
  with pytest.raises(PrivacyError, match="no guarantee"):
    _ledger(max_batch_size=None, privacy_unit="example").add_vocabulary(vocab, path)
  (tmp_path / "modest").mkdir()
  modest, modest_path, _ = _vocabulary_with_report(tmp_path / "modest")
  composed = _ledger(max_batch_size=None)
  composed.add_vocabulary(modest, modest_path)
  composed.record_steps(100)
  assert composed.total_epsilon() > composed.training_epsilon()


def test_step_event_is_one_step_of_the_ledger_s_mechanism():
  plain = _ledger(max_batch_size=None)
  assert plain.step_event() == dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1))
  # `steps` of them are the event the ledger's ε is accounted from.
  plain.record_steps(30)
  composed = dp_accounting.SelfComposedDpEvent(plain.step_event(), 30)
  assert composed == accounting.make_dp_event(1.1, 0.01, 30)
  assert accounting.composed_epsilon([composed], plain.delta, "rdp") == pytest.approx(plain.training_epsilon())
  truncated = _ledger(max_batch_size=510)
  assert truncated.truncation_probability > 0
  assert isinstance(truncated.step_event(), dp_accounting.TruncatedSubsampledGaussianDpEvent)
  fixed = _ledger(max_batch_size=None, sampling="fixed")
  assert isinstance(fixed.step_event(), dp_accounting.SampledWithoutReplacementDpEvent)
  assert PrivacyLedger.non_private_baseline(num_examples=100, batch_size=10).step_event() is None


def test_a_document_level_vocabulary_composes_by_the_documents_one_example_holds(tmp_path):
  # An example that joins pieces of k documents changes k documents: group privacy of 2k. Where k
  # is not bounded (a seqio Task at the example unit, none declared), no group size holds: the
  # vocabulary counts as not private (ε = ∞), never as group privacy of 2.
  vocab, report, _ = _vocabulary_with_report(tmp_path, epsilon=0.5)
  delta = privacy_report.read_report(report)["delta"]
  unbounded = _ledger(privacy_unit="example", population={"documents_per_example": None})
  unbounded.record_steps(10)
  component = unbounded.add_vocabulary(vocab, report)
  assert component["private"] is False and "DOCUMENTS_PER_EXAMPLE" in component["reason"]
  assert unbounded.total_epsilon() == math.inf and unbounded.report()["epsilon"] is None
  declared = _ledger(privacy_unit="example", population={"documents_per_example": 3})
  component = declared.add_vocabulary(vocab, report)
  assert component["group_privacy"]["size"] == 6 and component["epsilon"] == pytest.approx(3.0)
  assert component["delta"] == pytest.approx(delta * sum(math.exp(i * 0.5) for i in range(6)))
  # A store's example (a chunk of one document) and the document unit are as before.
  assert _ledger(privacy_unit="example").add_vocabulary(vocab, report)["group_privacy"]["size"] == 2
  assert "group_privacy" not in _ledger(privacy_unit="document", population={"documents_per_example": None}
                                        ).add_vocabulary(vocab, report)
  # The initial checkpoint's DP training at the document unit: the same rule.
  initial = unbounded.add_initial_checkpoint({"dp": True, "epsilon": 1.0, "delta": 1e-8, "privacy_unit": "document"},
                                             str(tmp_path / "pretrained"), "trained with DP")
  assert initial["private"] is False and "DOCUMENTS_PER_EXAMPLE" in initial["reason"]


def test_a_public_vocabulary_moved_between_resumptions_is_listed_once(tmp_path):
  first = tmp_path / "a" / "vocab.model"
  first.parent.mkdir()
  first.write_bytes(b"public vocabulary")
  moved = tmp_path / "b.model"
  moved.write_bytes(first.read_bytes())
  saved = _ledger()
  saved.add_vocabulary(str(first), public=True)
  saved.record_steps(5)
  resumed = _ledger()
  resumed.add_vocabulary(str(moved), public=True)
  components = resumed.resume_from(saved).components
  assert [c["source"] for c in components] == [str(moved)]
