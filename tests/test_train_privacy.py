"""The DP mechanism: one config, validated once, builds the aggregator, the sampler and the ledger."""
import json
import math

import numpy as np
import pytest

from private_t5.dp import accounting
from private_t5.dp import truncation
from private_t5.dp import privacy_report
from private_t5.dp.aggregator import DPAggregator, MeanAggregator
from private_t5.dp.sampling import PoissonSampler, ShuffledBatchSampler
from private_t5.errors import ConfigError, DataError, PrivacyError
from private_t5.io import file_sha256
from private_t5.dp import mechanism as privacy
from private_t5.dp import config as config_lib
from private_t5.dp.config import DPConfig, ExecutionSettings


def _loss_fn(params, batch, dropout_rng=None):
  raise AssertionError("not called here")


def _setup(dp, **overrides):
  kwargs = dict(loss_fn=_loss_fn, num_examples=1000, privacy_unit="document", batch_size=32, train_steps=100,
                microbatch_size=None, sampler_seed=3, log=lambda _: None)
  kwargs.update(overrides)
  execution = ExecutionSettings(microbatch_size=kwargs.pop("microbatch_size"))
  return privacy.build_mechanism(dp, execution, **kwargs)


def _layout(dp, microbatch_size=None, batch_size=32):
  return config_lib.BatchLayout.for_run(dp, ExecutionSettings(microbatch_size=microbatch_size), batch_size)


def test_non_private_baseline():
  setup = _setup(None)
  assert isinstance(setup.clipped_sum, MeanAggregator) and isinstance(setup.sampler, ShuffledBatchSampler)
  assert setup.dp_event is None
  assert not setup.private and setup.ledger.non_private and math.isinf(setup.ledger.training_epsilon())
  with pytest.raises(ConfigError, match="larger than the dataset"):
    _setup(None, num_examples=10)


TRUNCATED = "poisson_truncated"


def test_dp_pieces_share_one_mechanism():
  setup = _setup(DPConfig(clip_norm=0.5, noise_multiplier=1.1, expected_batch_size=4, delta=1e-5,
                          sampling=TRUNCATED))
  assert setup.private
  agg, sampler, ledger = setup.clipped_sum, setup.sampler, setup.ledger
  assert isinstance(agg, DPAggregator) and isinstance(sampler, PoissonSampler)
  assert agg.clip_norm == 0.5 and agg.noisy_sum.noise_multiplier == 1.1 and agg.expected_batch_size == pytest.approx(4)
  assert setup.noise_multiplier == 1.1 and agg.sensitivity == pytest.approx(0.5 / 4)
  assert setup.dp_event == accounting.step_dp_event(1.1, 0.004, num_examples=1000, max_batch_size=32)
  assert setup.dp_event == ledger.step_event()  # the event the ledger composes per step
  assert agg.spmd_axis_name == "data"
  assert sampler.sampling_rate == pytest.approx(0.004) and sampler.padded_batch_size == 32
  assert ledger.sampling_rate == sampler.sampling_rate and ledger.noise_multiplier == 1.1
  assert ledger.max_batch_size == 32 and ledger.truncation_probability == pytest.approx(
      truncation.truncation_probability(1000, 0.004, 32))
  assert setup.fingerprint()["noise_multiplier"] == 1.1 and setup.fingerprint()["non_private"] is False
  assert _layout(DPConfig(noise_multiplier=1.1, sampling=TRUNCATED)).microbatch_size is None


def test_untruncated_poisson_is_the_default():
  setup = _setup(DPConfig(noise_multiplier=1.1, delta=1e-5), microbatch_size=8)
  sampler, ledger = setup.sampler, setup.ledger
  layout = _layout(DPConfig(noise_multiplier=1.1), microbatch_size=8)
  assert not sampler.truncated and layout.microbatch_size == 8 and layout.batch_rows == 8
  assert sampler.padded_batch_size is None  # a step's rows follow its sample
  # The expected batch defaults to the configured batch size; no cap, no truncation term.
  assert sampler.expected_batch_size == pytest.approx(32) and setup.aggregator.expected_batch_size == 32
  assert ledger.max_batch_size is None and ledger.truncation_probability == 0.0
  assert setup.aggregator.__class__.__name__ == "GhostDPAggregator" and ledger.accountant == "auto"
  ledger.record_steps(100)
  report = ledger.report()
  assert report["truncation_delta"] == 0.0 and report["batch_size"] == 32
  assert report["expected_batch_size"] == pytest.approx(32) and report["clipping_method"] == "ghost"
  assert report["training_epsilon"] == pytest.approx(min(report["epsilon_rdp"], report["epsilon_pld"]))
  assert report["accountant_used"] in ("rdp", "pld")
  # An expected batch above the configured batch size is a free choice when untruncated.
  assert _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=64)).sampler.expected_batch_size == 64
  assert _layout(DPConfig(noise_multiplier=1.0)).microbatch_size == 32  # m defaults to batch_size


def test_default_expected_batch_size_bounds_truncation():
  e = truncation.max_expected_batch_size_for(1000, 32, 1e-6)
  assert truncation.truncation_probability(1000, e / 1000, 32) <= 1e-6
  assert truncation.truncation_probability(1000, (e + 1) / 1000, 32) > 1e-6
  setup = _setup(DPConfig(noise_multiplier=1.0, sampling=TRUNCATED))
  assert setup.sampler.expected_batch_size <= e
  assert setup.ledger.delta == pytest.approx(1e-5)  # default δ = min(1e-5, 1 / N^1.1)
  # The derived batch keeps the truncation term (1 + e^ε)·T·p of δ within 10% of δ.
  for dp in (DPConfig(noise_multiplier=1.0, sampling=TRUNCATED, accountant="rdp"),
             DPConfig(target_epsilon=10.0, sampling=TRUNCATED, accountant="rdp")):
    setup = _setup(dp)
    ledger = setup.ledger
    ledger.record_steps(100)
    assert ledger.training_delta() - ledger.delta <= 0.1 * ledger.delta * (1 + 1e-9)
    assert ledger.training_epsilon() <= (dp.target_epsilon or math.inf) + 1e-6
    assert setup.sampler.expected_batch_size >= 1


def test_target_epsilon_calibrates_sigma_before_training():
  for name in ("rdp", "auto"):
    setup = _setup(DPConfig(target_epsilon=3.0, expected_batch_size=4, delta=1e-5, accountant=name))
    sigma = setup.noise_multiplier
    assert accounting.compute_epsilon(sigma, 0.004, 100, 1e-5, name) <= 3.0 + 1e-6
    assert accounting.compute_epsilon(sigma * 0.98, 0.004, 100, 1e-5, name) > 3.0


def _vocab_and_report(directory, content=b"a vocabulary", report_name="privacy_report.json", **fields):
  """A stand-in `.model` file and a DP-SentencePiece report beside it (naming it by hash)."""
  directory.mkdir(parents=True, exist_ok=True)
  vocab = directory / "spm.model"
  vocab.write_bytes(content)
  report = {"epsilon": 0.17, "delta": 1e-9, "mechanism": "dp_sentencepiece", "privacy_unit": "document",
            "vocab_sha256": file_sha256(str(vocab))}
  report.update(fields)
  (directory / report_name).write_text(json.dumps({k: v for k, v in report.items() if v is not None}))
  return str(vocab), str(directory / report_name)


def test_dp_sentencepiece_report_beside_vocab_is_composed(tmp_path):
  vocab, report = _vocab_and_report(tmp_path)
  lines = []
  setup = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4), vocab_path=vocab, log=lines.append)
  assert setup.dp_spm_report == report
  ledger = setup.ledger
  ledger.record_steps(10)
  assert [c["name"] for c in ledger.components] == ["dp_sentencepiece"]
  # An older report (no σ/k, no δ split): its ε is added to training's, and the log says why.
  assert ledger.total_epsilon() == pytest.approx(ledger.training_epsilon() + 0.17)
  assert any("added to training's (the report records no Gaussian event" in line for line in lines)
  assert ledger.report()["vocabulary"] == "dp"
  assert privacy_report.find_vocabulary_report(str(tmp_path / "other" / "spm.model")) is None


def _assert_not_private_vocabulary(setup, reason):
  ledger = setup.ledger
  ledger.record_steps(10)
  assert setup.dp_spm_report is None
  [component] = ledger.components
  assert component["name"] == "vocabulary" and component["private"] is False and not component["public"]
  assert reason in component["reason"]
  assert math.isinf(ledger.total_epsilon()) and 0 < ledger.training_epsilon() < math.inf
  report = ledger.report()
  assert report["epsilon"] is None and report["training_epsilon"] > 0 and report["vocabulary"] == "not private"


def test_report_of_another_vocabulary_is_not_credited(tmp_path):
  """A non-private vocabulary beside another vocabulary's DP report gets no ε from it."""
  _, report = _vocab_and_report(tmp_path, content=b"the dp vocabulary")
  nondp = tmp_path / "nondp_spm.model"
  nondp.write_bytes(b"a vocabulary trained without DP")
  assert privacy_report.find_vocabulary_report(str(nondp)) == report  # found by location ...
  setup = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4), vocab_path=str(nondp))
  _assert_not_private_vocabulary(setup, "another vocabulary")  # ... but not composed


def test_report_without_hash_is_not_credited(tmp_path):
  vocab, _ = _vocab_and_report(tmp_path, vocab_sha256=None)
  logs = []
  setup = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4), vocab_path=vocab, log=logs.append)
  _assert_not_private_vocabulary(setup, "re-run `private-t5 dp-spm`")
  assert any("WARNING" in line and "ε is ∞" in line for line in logs)


def test_matching_report_is_preferred_over_a_folder_report(tmp_path):
  vocab, own = _vocab_and_report(tmp_path, report_name="spm.privacy_report.json")
  (tmp_path / "privacy_report.json").write_text(json.dumps({"epsilon": 0.1, "delta": 1e-9, "vocab_sha256": "0" * 64}))
  assert privacy_report.find_vocabulary_report(vocab) == own


def test_vocabulary_without_report_is_not_private_unless_declared_public(tmp_path):
  vocab = tmp_path / "spm.model"
  vocab.write_bytes(b"x")
  setup = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4), vocab_path=str(vocab))
  _assert_not_private_vocabulary(setup, "no DP-SentencePiece privacy report")
  public = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4, vocab_is_public=True),
                  vocab_path=str(vocab)).ledger
  public.record_steps(10)
  assert public.components == [{"name": "vocabulary", "private": False, "public": True,
                                 "source": str(vocab), "vocab_sha256": file_sha256(str(vocab)),
                                 "public_check": public.components[0]["public_check"]}]
  assert public.total_epsilon() == public.training_epsilon() and public.report()["vocabulary"] == "public"
  assert math.isfinite(public.report()["epsilon"])


def test_public_declaration_contradicted_by_the_vocabularys_own_report_is_refused(tmp_path):
  corpus = tmp_path / "data" / "train.jsonl"
  corpus.parent.mkdir()
  corpus.write_text('{"text": "a"}\n')
  other = tmp_path / "data" / "public.jsonl"
  other.write_text('{"text": "b"}\n')
  public = DPConfig(noise_multiplier=1.0, expected_batch_size=4, vocab_is_public=True)
  # Built from the training corpus (named as dp-spm wrote it, or by a pattern or folder that overlaps it).
  for built_from in ({"corpus": str(corpus)}, {"corpus": [str(other), str(tmp_path / "data" / "*.jsonl")]},
                     {"corpus_files": [str(corpus)], "corpus": "moved/train.jsonl"}):
    vocab, report = _vocab_and_report(tmp_path / "vocab", **built_from)
    for training in (str(corpus), str(tmp_path / "data")):
      with pytest.raises(PrivacyError, match=r"declared public \(VOCAB_IS_PUBLIC=True\), but its DP-SentencePiece "
                         r"report .* says it was built from .*\.jsonl.*, which this run trains on"):
        _setup(public, vocab_path=vocab, corpus=training)
  # Built from other data: the user's declaration stands, and the log says it is theirs.
  vocab, report = _vocab_and_report(tmp_path / "vocab", corpus=str(other))
  logs = []
  ledger = _setup(public, vocab_path=vocab, corpus=str(corpus), log=logs.append).ledger
  assert ledger.components[0]["public"] and ledger.components[0]["dp_report"] == report
  assert any("declared public by the user" in line and "by that declaration" in line for line in logs)
  # A damaged report beside a declared-public vocabulary is one DataError, not a traceback.
  open(report, "w").write("{")
  with pytest.raises(DataError, match="not valid JSON"):
    _setup(public, vocab_path=vocab, corpus=str(corpus))
  vocab, report = _vocab_and_report(tmp_path / "vocab", corpus=str(other))
  # Without the declaration the same vocabulary is composed as before.
  composed = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4), vocab_path=vocab, corpus=str(corpus))
  assert [c["name"] for c in composed.ledger.components] == ["dp_sentencepiece"]


def test_public_declaration_is_checked_by_content_not_by_path(tmp_path):
  from private_t5.dp import public_vocabulary  # pylint: disable=g-import-not-at-top
  from private_t5.tokenizer import spm as spm_lib  # pylint: disable=g-import-not-at-top
  corpus = tmp_path / "private" / "train.jsonl"
  corpus.parent.mkdir()
  corpus.write_text('{"text": "private words"}\n')
  public = DPConfig(noise_multiplier=1.0, expected_batch_size=4, vocab_is_public=True)
  digests = public_vocabulary.file_digests([str(corpus)])
  vocab, report = _vocab_and_report(tmp_path / "vocab", corpus=str(corpus), corpus_files=[str(corpus)],
                                    corpus_file_digests=digests)
  # A byte-identical copy of the corpus the vocabulary was built from, under another name, or a
  # seqio Task's data file that is that copy: not public.
  copy = tmp_path / "copy" / "renamed.jsonl"
  copy.parent.mkdir()
  copy.write_bytes(corpus.read_bytes())
  with pytest.raises(PrivacyError, match="which this run trains on by content"):
    _setup(public, vocab_path=vocab, corpus=str(copy))
  with pytest.raises(PrivacyError, match="which this run trains on by content"):
    _setup(public, vocab_path=vocab, corpus="seqio:my_task", data_files=[str(copy)])
  # An older report (paths only) whose file is still there is compared by the file's content now.
  old_vocab, _ = _vocab_and_report(tmp_path / "old", corpus_files=[str(corpus)])
  with pytest.raises(PrivacyError, match="by content"):
    _setup(public, vocab_path=old_vocab, corpus=str(copy))
  # Other data: accepted, and the log and the report's entry say what was and was not checked.
  other = tmp_path / "other.jsonl"
  other.write_text('{"text": "public words!"}\n')
  logs = []
  ledger = _setup(public, vocab_path=vocab, corpus=str(other), data_files=None,
                  unknown_files="the files of seqio Task t are not known", log=logs.append).ledger
  check = ledger.components[0]["public_check"]
  assert check.startswith("checked by file") and "not checked: the files of seqio Task t" in check
  assert any(check in line for line in logs)
  # A DP-SentencePiece vocabulary (trained from a word histogram) copied without its report: refused
  # by the check a training run makes first (`tokenizer.public_declaration`).
  from private_t5.tokenizer import public_declaration  # pylint: disable=g-import-not-at-top
  dp_vocab = tmp_path / "copied" / "dp.model"
  dp_vocab.parent.mkdir()
  dp_vocab.write_bytes(spm_lib.model_from_word_counts([("private", 5), ("words", 3)], 16))
  with pytest.raises(PrivacyError, match="written by `private-t5 dp-spm`.*privacy report naming it is not beside it"):
    public_declaration.check_declaration(public, str(dp_vocab), None)
  # Any other vocabulary without a report: the user's word, and the report says so.
  plain = tmp_path / "plain.model"
  plain.write_bytes(b"a vocabulary trained on public text")
  entry = _setup(public, vocab_path=str(plain), corpus=str(other)).ledger.components[0]
  assert entry["public"] and entry["public_check"].startswith("not checked") and "user's word" in entry["public_check"]


def test_document_level_vocabulary_needs_document_or_example_level_training(tmp_path):
  vocab, _ = _vocab_and_report(tmp_path)
  dp = DPConfig(noise_multiplier=1.0, expected_batch_size=4)
  # Removing one example (a chunk) changes its document: a substitution for the document-level
  # vocabulary, composed by group privacy as (2ε, (1 + e^ε)·δ), never as (ε, δ).
  lines = []
  example = _setup(dp, vocab_path=vocab, privacy_unit="example", log=lines.append).ledger
  assert [c["name"] for c in example.components] == ["dp_sentencepiece"]
  assert example.components[0]["epsilon"] == pytest.approx(2 * 0.17)
  assert example.components[0]["delta"] == pytest.approx(1e-9 * (1 + math.exp(0.17)))
  assert any("for example-level training by group privacy of 2" in line for line in lines)
  document = _setup(dp, vocab_path=vocab).ledger
  assert document.components[0]["epsilon"] == pytest.approx(0.17)
  # A user with K documents costs up to K·ε of a document-level vocabulary: refused.
  with pytest.raises(PrivacyError, match="document-level DP but training is user-level.*group privacy"):
    _setup(dp, vocab_path=vocab, privacy_unit="user")
  user_vocab, _ = _vocab_and_report(tmp_path / "user", privacy_unit="user")
  user = _setup(dp, vocab_path=user_vocab, privacy_unit="user").ledger
  assert [c["name"] for c in user.components] == ["dp_sentencepiece"]


def test_fixed_seeds_and_an_insecure_vocabulary_are_recorded(tmp_path):
  dp = DPConfig(noise_multiplier=1.0, expected_batch_size=4)
  ledger = _setup(dp, noise_secret=False).ledger
  ledger.record_steps(10)
  assert ledger.report()["noise_secret"] is False and "NO PRIVACY GUARANTEE" in ledger.report()["warnings"][0]
  assert _setup(None, noise_secret=False).ledger.noise_secret is False
  vocab, _ = _vocab_and_report(tmp_path, noise_seed="insecure_fixed_seed", insecure_seed=0, noise_secret=False)
  lines = []
  ledger = _setup(dp, vocab_path=vocab, log=lines.append).ledger
  assert ledger.components[0]["noise_secret"] is False and ledger.report()["noise_secret"] is False
  assert any("WARNING: NO PRIVACY GUARANTEE" in line and vocab in line for line in lines)


@pytest.mark.parametrize("num_examples, want", [
    (1000, 1e-5), (10**4, 1e-5), (10**5, 10 ** -5.5), (10**9, 1e-9 ** 1.1), (50, 1e-5)])
def test_default_delta_is_well_below_one_over_n(num_examples, want):
  assert config_lib.default_delta(num_examples) == pytest.approx(want)
  assert config_lib.default_delta(num_examples) < 1 / num_examples


def test_expected_batch_size_whose_truncation_breaks_delta_is_refused():
  # q·N = 16 capped at 32 rows: p_trunc ≈ 1e-4 per step, far above 10% of δ = 1e-5 over 100 steps.
  with pytest.raises(PrivacyError, match=r"batch truncation breaks δ: expected_batch_size=16 capped at "
                                         r"batch_size=32 .*lower expected_batch_size"):
    _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=16, sampling=TRUNCATED))
  with pytest.raises(PrivacyError, match="batch truncation breaks δ"):
    _setup(DPConfig(target_epsilon=3.0, expected_batch_size=16, delta=1e-5, sampling=TRUNCATED))
  # The same batch with room to spare, or a smaller one, is accepted; untruncated, always.
  assert _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=16, sampling=TRUNCATED), batch_size=64).private
  assert _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=16)).private
  setup = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4, sampling=TRUNCATED, accountant="rdp"))
  ledger = setup.ledger
  ledger.record_steps(100)
  assert ledger.training_delta() - ledger.delta <= 0.1 * ledger.delta


@pytest.mark.parametrize("config, match", [
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(noise_multiplier=1.0, clip_norm=0.0), "clip_norm"),
    (dict(noise_multiplier=1.0, target_epsilon=2.0), "exactly one"),
    (dict(), "exactly one"),
    (dict(noise_multiplier=1.0, sampling="fixed"), "poisson"),
    (dict(noise_multiplier=1.0, expected_batch_size=64, sampling="poisson_truncated"),
     "exceeds the padded batch_size"),
    (dict(noise_multiplier=1.0, expected_batch_size=5000), "larger than the dataset"),
    (dict(noise_multiplier=1.0, delta=1.5), "delta"),
    (dict(target_epsilon=1e-9, expected_batch_size=16, delta=1e-6), "unreachable"),
])
def test_bad_privacy_parameters(config, match):
  with pytest.raises(PrivacyError, match=match):
    _setup(DPConfig(**config))


@pytest.mark.parametrize("config, match", [
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(noise_multiplier=float("nan")), "noise_multiplier"),
    (dict(noise_multiplier=1.0, clip_norm=0.0), "clip_norm"),
    (dict(noise_multiplier=1.0, clip_norm=float("inf")), "clip_norm"),
    (dict(noise_multiplier=1.0, target_epsilon=2.0), "exactly one"),
    (dict(), "exactly one"),
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_epsilon=float("inf")), "target_epsilon"),
    (dict(noise_multiplier=1.0, delta=0.0), "delta"),
    (dict(noise_multiplier=1.0, delta=1.0), "delta"),
    (dict(noise_multiplier=1.0, accountant="bogus"), "accountant"),
    (dict(noise_multiplier=1.0, sampling="fixed"), "sampling"),
    (dict(noise_multiplier=1.0, expected_batch_size=0), "expected_batch_size"),
])
def test_bad_config_values_fail_when_the_config_is_made(config, match):
  """Each value is checked once, by DPConfig itself, in one line: nothing else is needed."""
  with pytest.raises(PrivacyError, match=match) as error:
    DPConfig(**config)
  assert len(str(error.value).splitlines()) == 1


def test_speed_settings_are_apart_from_the_privacy_config():
  assert ExecutionSettings() == ExecutionSettings(method="ghost", microbatch_size=None)
  with pytest.raises(ConfigError, match="method must be one of"):
    ExecutionSettings(method="loop")
  with pytest.raises(ConfigError, match="microbatch_size"):
    ExecutionSettings(microbatch_size=0)
  with pytest.raises(ConfigError, match="method must be one of"):
    DPConfig(noise_multiplier=1.0, method="loop")
  # The deprecated DPConfig.method feeds the speed settings, with a warning; it never changes
  # the mechanism.
  lines = []
  legacy = DPConfig(noise_multiplier=1.0, expected_batch_size=4, method="vmap")
  execution = ExecutionSettings.for_run(legacy, None, 8, log=lines.append)
  assert execution == ExecutionSettings(method="vmap", microbatch_size=8)
  assert any("deprecated" in line and "train.clipping_method" in line for line in lines)
  assert ExecutionSettings.for_run(legacy, "vmap", None, log=lines.append).method == "vmap"
  with pytest.raises(ConfigError, match="disagree"):
    ExecutionSettings.for_run(legacy, "ghost", None, log=lines.append)
  assert ExecutionSettings.for_run(DPConfig(noise_multiplier=1.0), None, None).method == "ghost"
  vmap = privacy.build_mechanism(legacy, execution, loss_fn=_loss_fn, num_examples=1000, privacy_unit="document",
                                 batch_size=32, train_steps=100, sampler_seed=3, log=lambda _: None)
  ghost = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4), microbatch_size=8)
  assert isinstance(vmap.aggregator, DPAggregator) and type(ghost.aggregator).__name__ == "GhostDPAggregator"
  assert vmap.fingerprint() == ghost.fingerprint()
  assert vmap.ledger.report()["clipping_method"] == "vmap"
  # Stacking ghost clipping's layers is a speed setting too: same mechanism, ghost only.
  stacked = privacy.build_mechanism(DPConfig(noise_multiplier=1.0, expected_batch_size=4),
                                    ExecutionSettings.for_run(None, "ghost", 8, stack_layers=True),
                                    loss_fn=_loss_fn, num_examples=1000, privacy_unit="document", batch_size=32,
                                    train_steps=100, sampler_seed=3, log=lambda _: None)
  assert stacked.aggregator.stack_layers and not ghost.aggregator.stack_layers
  assert stacked.fingerprint() == ghost.fingerprint()
  with pytest.raises(ConfigError, match="ghost_stack_layers=True stacks ghost clipping's layers"):
    ExecutionSettings(method="vmap", stack_layers=True)
  with pytest.raises(ConfigError, match="ghost_stack_layers must be True or False"):
    ExecutionSettings(stack_layers="yes")


def test_layout_gives_the_rows_of_each_step():
  """The loop asks the batch layout (an execution setting), not the sampler, how many rows a
  step's sample runs on."""
  truncated_dp = DPConfig(noise_multiplier=1.0, expected_batch_size=4, sampling=TRUNCATED)
  fixed = _layout(None)
  assert (fixed.batch_rows, fixed.variable_rows, fixed.microbatch_size) == (32, False, None)
  assert fixed.rows_for_step(32, microbatched=False) == 32
  truncated = _layout(truncated_dp)
  assert (truncated.batch_rows, truncated.variable_rows, truncated.microbatch_size) == (32, False, None)
  assert truncated.rows_for_step(3, microbatched=False) == 32
  # A fixed batch larger than the microbatch size runs through the trainer's accumulate loop.
  assert _layout(None, microbatch_size=8).microbatch_size == 8
  assert _layout(None, microbatch_size=64).microbatch_size is None  # one fused step
  micro_truncated = _layout(truncated_dp, microbatch_size=16)
  assert (micro_truncated.batch_rows, micro_truncated.variable_rows, micro_truncated.microbatch_size) == \
      (32, False, 16)
  with pytest.raises(ConfigError, match="microbatch_size=12 must divide batch_size=32"):
    _layout(None, microbatch_size=12)
  whole_dp = DPConfig(noise_multiplier=1.0, expected_batch_size=20)
  whole = _layout(whole_dp, microbatch_size=8)
  assert (whole.batch_rows, whole.variable_rows, whole.microbatch_size) == (8, True, 8)
  for n, microbatched, want in ((0, True, 0), (0, False, 8), (1, True, 8), (8, True, 8), (9, True, 16),
                                (17, False, 24)):
    assert whole.rows_for_step(n, microbatched=microbatched) == want
  mechanism = _setup(whole_dp, microbatch_size=8)
  for step in range(5):  # the indices are the sampler's, step by step
    n = len(mechanism.indices_for_step(step))
    np.testing.assert_array_equal(mechanism.indices_for_step(step), mechanism.sampler.indices_for_step(step))
    assert 0 <= whole.rows_for_step(n) - n <= 7 and whole.rows_for_step(n) % 8 == 0
