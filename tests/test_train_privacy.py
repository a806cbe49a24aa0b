"""The trainer's privacy setup: one config swaps aggregator, sampler and ledger."""
import json
import math

import pytest

from private_t5.dp import accounting
from private_t5.dp.aggregator import DPAggregator, MeanAggregator
from private_t5.dp.sampling import PoissonSampler, ShuffledBatchSampler
from private_t5.errors import ConfigError, PrivacyError
from private_t5.train import privacy
from private_t5.train.privacy import DPConfig


def _loss_fn(params, batch, dropout_rng=None):
  raise AssertionError("not called here")


def _setup(dp, **overrides):
  kwargs = dict(loss_fn=_loss_fn, num_examples=1000, privacy_unit="document", batch_size=32, train_steps=100,
                microbatch_size=None, sampler_seed=3, log=lambda _: None)
  kwargs.update(overrides)
  return privacy.setup_privacy(dp, **kwargs)


def test_non_private_baseline():
  setup = _setup(None)
  assert isinstance(setup.aggregator, MeanAggregator) and isinstance(setup.sampler, ShuffledBatchSampler)
  assert not setup.private and setup.ledger.non_private and math.isinf(setup.ledger.training_epsilon())
  with pytest.raises(ConfigError, match="larger than the dataset"):
    _setup(None, num_examples=10)


def test_dp_pieces_share_one_mechanism():
  setup = _setup(DPConfig(clip_norm=0.5, noise_multiplier=1.1, expected_batch_size=4, delta=1e-5))
  assert setup.private
  agg, sampler, ledger = setup.aggregator, setup.sampler, setup.ledger
  assert isinstance(agg, DPAggregator) and isinstance(sampler, PoissonSampler)
  assert agg.clip_norm == 0.5 and agg.noise_multiplier == 1.1 and agg.expected_batch_size == pytest.approx(4)
  assert agg.spmd_axis_name == "data"
  assert sampler.sampling_rate == pytest.approx(0.004) and sampler.padded_batch_size == 32
  assert ledger.sampling_rate == sampler.sampling_rate and ledger.noise_multiplier == 1.1
  assert ledger.max_batch_size == 32 and ledger.truncation_probability == pytest.approx(
      accounting.truncation_probability(1000, 0.004, 32))
  assert setup.mechanism()["noise_multiplier"] == 1.1 and setup.mechanism()["non_private"] is False


def test_default_expected_batch_size_bounds_truncation():
  e = accounting.max_expected_batch_size_for(1000, 32, 1e-6)
  assert accounting.truncation_probability(1000, e / 1000, 32) <= 1e-6
  assert accounting.truncation_probability(1000, (e + 1) / 1000, 32) > 1e-6
  setup = _setup(DPConfig(noise_multiplier=1.0))
  assert setup.sampler.expected_batch_size <= e
  assert setup.ledger.delta == pytest.approx(1e-5)  # default δ = min(1e-5, 1 / N^1.1)
  # The derived batch keeps the truncation term (1 + e^ε)·T·p of δ within 10% of δ.
  for dp in (DPConfig(noise_multiplier=1.0), DPConfig(target_epsilon=10.0)):
    setup = _setup(dp)
    ledger = setup.ledger
    ledger.record_steps(100)
    assert ledger.training_delta() - ledger.delta <= 0.1 * ledger.delta * (1 + 1e-9)
    assert ledger.training_epsilon() <= (dp.target_epsilon or math.inf) + 1e-6
    assert setup.sampler.expected_batch_size >= 1


def test_target_epsilon_calibrates_sigma_before_training():
  setup = _setup(DPConfig(target_epsilon=3.0, expected_batch_size=4, delta=1e-5))
  sigma = setup.noise_multiplier
  assert accounting.compute_epsilon(sigma, 0.004, 100, 1e-5) <= 3.0 + 1e-6
  assert accounting.compute_epsilon(sigma * 0.98, 0.004, 100, 1e-5) > 3.0


def test_dp_sentencepiece_report_beside_vocab_is_composed(tmp_path):
  vocab = tmp_path / "spm.model"
  vocab.write_bytes(b"")
  (tmp_path / "privacy_report.json").write_text(json.dumps(
      {"epsilon": 0.17, "delta": 1e-9, "mechanism": "dp_sentencepiece"}))
  setup = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4), vocab_path=str(vocab))
  assert setup.dp_spm_report == str(tmp_path / "privacy_report.json")
  ledger = setup.ledger
  ledger.record_steps(10)
  assert [c["name"] for c in ledger.components] == ["dp_sentencepiece"]
  assert ledger.total_epsilon() == pytest.approx(ledger.training_epsilon() + 0.17)
  assert privacy.dp_spm_report_path(str(tmp_path / "other" / "spm.model")) is None


@pytest.mark.parametrize("num_examples, want", [
    (1000, 1e-5), (10**4, 1e-5), (10**5, 10 ** -5.5), (10**9, 1e-9 ** 1.1), (50, 1e-5)])
def test_default_delta_is_well_below_one_over_n(num_examples, want):
  assert privacy.default_delta(num_examples) == pytest.approx(want)
  assert privacy.default_delta(num_examples) < 1 / num_examples


def test_expected_batch_size_whose_truncation_breaks_delta_is_refused():
  # q·N = 16 capped at 32 rows: p_trunc ≈ 1e-4 per step, far above 10% of δ = 1e-5 over 100 steps.
  with pytest.raises(PrivacyError, match=r"batch truncation breaks δ: expected_batch_size=16 capped at "
                                         r"batch_size=32 .*lower expected_batch_size"):
    _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=16))
  with pytest.raises(PrivacyError, match="batch truncation breaks δ"):
    _setup(DPConfig(target_epsilon=3.0, expected_batch_size=16, delta=1e-5))
  # The same batch with room to spare, or a smaller one, is accepted.
  assert _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=16), batch_size=64).private
  setup = _setup(DPConfig(noise_multiplier=1.0, expected_batch_size=4))
  ledger = setup.ledger
  ledger.record_steps(100)
  assert ledger.training_delta() - ledger.delta <= 0.1 * ledger.delta


@pytest.mark.parametrize("dp, match", [
    (DPConfig(noise_multiplier=0.0), "noise_multiplier"),
    (DPConfig(noise_multiplier=1.0, clip_norm=0.0), "clip_norm"),
    (DPConfig(noise_multiplier=1.0, target_epsilon=2.0), "exactly one"),
    (DPConfig(), "exactly one"),
    (DPConfig(noise_multiplier=1.0, sampling="fixed"), "poisson"),
    (DPConfig(noise_multiplier=1.0, expected_batch_size=64), "exceeds the padded batch_size"),
    (DPConfig(noise_multiplier=1.0, expected_batch_size=5000), "larger than the dataset"),
    (DPConfig(noise_multiplier=1.0, delta=1.5), "delta"),
    (DPConfig(target_epsilon=1e-9, expected_batch_size=16, delta=1e-6), "unreachable"),
])
def test_bad_privacy_parameters(dp, match):
  with pytest.raises(PrivacyError, match=match):
    _setup(dp)
