"""Adaptive DP (Wu et al. 2022): rho normalisation, gamma_B, the adaptive noise, the honest report."""
import gzip
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5.data import source as source_lib
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp import accounting
from private_t5.dp import aggregator as aggregator_lib
from private_t5.dp import noise as noise_lib
from private_t5.errors import CheckpointError, ConfigError
from private_t5.models.config import T5Config
from private_t5.selective import adaptive, adaptive_train
from private_t5.tokenizer import spm
from private_t5.train import main as train_main
from private_t5.dp import config

MICRO = T5Config(vocab_size=384, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                 num_decoder_layers=1, dropout_rate=0.0)
LENGTHS = {"inputs": 32, "targets": 8}


def test_normalize_lies_in_unit_interval():
  p = np.array([2.0, 4.0, 8.0, 16.0])
  np.testing.assert_allclose(adaptive.normalize(p, "max"), p / 16.0)
  np.testing.assert_allclose(adaptive.normalize(p, "minmax"), [0.0, 2 / 14, 6 / 14, 1.0], rtol=1e-6)
  np.testing.assert_allclose(adaptive.normalize(p[::-1], "rank"), [1.0, 0.75, 0.5, 0.25])
  with pytest.raises(ConfigError, match="normalization"):
    adaptive.normalize(p, "softmax")


def test_privacy_weight_is_the_mean_over_real_rows():
  rho = jnp.array([0.2, 0.6, 0.9, 0.0])
  weight = jnp.array([1.0, 1.0, 0.0, 0.0])  # two real rows, two padding rows
  assert float(adaptive.privacy_weight(rho, weight)) == pytest.approx(0.4)
  assert float(adaptive.privacy_weight(rho, jnp.zeros(4))) == 1.0  # empty batch: full noise
  rng = np.random.default_rng(0)
  for _ in range(20):
    g = float(adaptive.privacy_weight(jnp.asarray(rng.random(8)), jnp.asarray(rng.integers(0, 2, 8))))
    assert 0.0 <= g <= 1.0


def _zero_grad_loss(params, batch, dropout_rng=None):
  del dropout_rng
  # Gradient exactly zero: the aggregated output is the noise divided by q N.
  return jnp.sum(params["w"] * 0.0) + batch["example_weight"] * 0.0


@pytest.mark.parametrize("rho_value", [0.25, 0.5, 1.0])
def test_gamma_scales_the_measured_noise_std(rho_value):
  sigma, clip, expected_batch = 2.0, 0.5, 4.0
  dp = aggregator_lib.DPAggregator(_zero_grad_loss, NoisySum(clip, sigma, expected_batch))
  agg = adaptive.AdaptiveDPAggregator(dp)
  params = {"w": jnp.zeros((200_000,), jnp.float32)}
  batch = {"example_weight": jnp.array([1.0, 1.0, 1.0, 0.0]),
           adaptive.PRIVACY_PROBABILITY: jnp.array([rho_value] * 3 + [0.0])}
  grads, metrics = noise_lib.privatize(agg, params, batch, noise_rng=jax.random.PRNGKey(3))
  measured = float(jnp.std(grads["w"]))
  assert float(metrics[adaptive.METRIC_PRIVACY_WEIGHT]) == pytest.approx(rho_value)
  assert measured == pytest.approx(rho_value * sigma * clip / expected_batch, rel=0.01)
  # gamma = 1 is exactly the DP aggregator with the same key.
  if rho_value == 1.0:
    plain, _ = noise_lib.privatize(dp, params, {"example_weight": batch["example_weight"]},
                                   noise_rng=jax.random.PRNGKey(3))
    np.testing.assert_allclose(grads["w"], plain["w"], rtol=1e-6)


def test_aggregator_needs_privacy_probabilities():
  dp = aggregator_lib.DPAggregator(_zero_grad_loss, NoisySum(1.0, 1.0, 2.0))
  with pytest.raises(ConfigError, match="privacy_probability"):
    adaptive.AdaptiveDPAggregator(dp)({"w": jnp.zeros(3)}, {"example_weight": jnp.ones(2)})


def test_implied_epsilon_matches_dp_at_gamma_one_and_grows_below():
  q, steps, delta = 0.01, 200, 1e-5
  eps = accounting.compute_epsilon(1.0, q, steps, delta)
  assert adaptive.implied_epsilon(1.0, np.ones(steps), q, delta) == pytest.approx(eps, rel=1e-6)
  assert adaptive.implied_epsilon(1.0, np.full(steps, 0.5), q, delta) > eps
  assert math.isinf(adaptive.implied_epsilon(1.0, [0.5, 0.0], q, delta))


def test_adaptive_dp_without_reference_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(ConfigError, match="reference model checkpoint"):
    adaptive.estimate_privacy_probabilities(None, source=None)
  with pytest.raises(CheckpointError, match="not found"):
    adaptive.estimate_privacy_probabilities(str(tmp_path / "missing"), source=None)
  with pytest.raises(ConfigError, match="reference model checkpoint"):
    adaptive_train.train_adaptive(reference_model_dir=None, model_config=MICRO, train_data=None,
                                  model_dir=str(tmp_path / "run"), train_steps=1, batch_size=4,
                                  dp=config.DPConfig(noise_multiplier=1.0))


@pytest.fixture(scope="module")
def sources(shared_data, tmp_path_factory):
  corpus = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  with gzip.open(corpus, "rt") as f:
    texts = [json.loads(line)["text"] for _, line in zip(range(1500), f)]
  root = tmp_path_factory.mktemp("adaptive")
  vocab = str(root / "spm.model")
  spm.train_from_sentences(texts, vocab, vocab_size=256)
  make = lambda n: source_lib.make_source(corpus, vocab, feature_lengths=LENGTHS, max_documents=n,
                                          split="all", cache_dir=str(root / "cache"), progress=False)
  return make(200), make(120), vocab, root


@pytest.mark.slow
def test_adaptive_run_end_to_end_reports_no_formal_guarantee(sources):
  public, private_data, vocab, root = sources
  logs = []
  ref_dir = str(root / "reference")
  train_main.train(model_config=MICRO, train_data=public, model_dir=ref_dir, train_steps=3, batch_size=8,
                   vocab_path=vocab, mesh_shape=(1, 1), insecure_deterministic_seed=1, log=logs.append)
  model_dir = str(root / "adp")
  summary = adaptive_train.train_adaptive(
      reference_model_dir=ref_dir, model_config=MICRO, train_data=private_data, model_dir=model_dir,
      train_steps=3, batch_size=8, dp=config.DPConfig(noise_multiplier=1.0, expected_batch_size=0.5),
      vocab_path=vocab, mesh_shape=(1, 1), insecure_deterministic_seed=2, log=logs.append)
  probs = adaptive.PrivacyProbabilities.load(os.path.join(model_dir, adaptive.PROBABILITIES_FILENAME))
  assert probs.rho.shape == (private_data.num_examples,)
  assert probs.rho.max() == pytest.approx(1.0) and probs.rho.min() > 0.0
  assert np.all(probs.perplexity > 1.0)
  with open(os.path.join(model_dir, adaptive.REPORT_FILENAME)) as f:
    report = json.load(f)
  assert report["dp"] is False and report["epsilon"] is None and "does not hold" in report["formal_guarantee"]
  assert report["steps"] == 3 and 0 < report["privacy_weight"]["mean"] <= 1
  q = 0.5 / private_data.num_examples
  assert report["epsilon_of_nominal_sigma_not_achieved"] == pytest.approx(
      min(accounting.compute_epsilon(1.0, q, 3, report["delta"], a) for a in ("rdp", "pld")), rel=1e-6)
  assert report["implied_epsilon"] >= report["epsilon_of_nominal_sigma_not_achieved"]
  with open(summary["privacy_report"]) as f:
    ledger = json.load(f)
  assert ledger["dp"] is False and ledger["epsilon"] is None  # never presented as plain DP
  assert any("NOT a formal DP guarantee" in line for line in logs)


@pytest.mark.slow
def test_adaptive_stage_runs_from_gin(sources, shared_data, capsys):
  """`private-t5 adaptive` with configs/runs/adaptive.gin layered on the quickstart config."""
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  public, _, vocab, root = sources
  ref_dir = str(root / "reference_for_cli")
  train_main.train(model_config=MICRO, train_data=public, model_dir=ref_dir, train_steps=2, batch_size=8,
                   vocab_path=vocab, mesh_shape=(1, 1), insecure_deterministic_seed=1, log=lambda _: None)
  model_dir = str(root / "adp_cli")
  corpus = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  argv = ["adaptive", "--gin_file=configs/experiments/quickstart.gin", "--gin_file=configs/runs/adaptive.gin",
          f"--gin.MODEL_DIR={model_dir}", f"--gin.REFERENCE_MODEL_DIR={ref_dir}", f"--gin.CORPUS={corpus}",
          f"--gin.VOCAB_PATH={vocab}", "--gin.TRAIN_STEPS=2", "--gin.VOCAB_SIZE=384",
          "--gin.T5Config.d_model=32", "--gin.T5Config.num_heads=2", "--gin.T5Config.d_ff=64",
          "--gin.T5Config.num_encoder_layers=1", "--gin.T5Config.num_decoder_layers=1",
          "--gin.BATCH_SIZE=8", "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
          "--gin.make_source.max_documents=120", f"--gin.DATA_CACHE_DIR={root}/cache_cli",
          "--gin.train_adaptive.mesh_shape=(1, 1)", "--gin.train_adaptive.eval_every=0",
          "--gin.train_adaptive.insecure_deterministic_seed=3", "--gin.DPConfig.target_epsilon=None",
          "--gin.DPConfig.noise_multiplier=1.0", "--gin.DPConfig.expected_batch_size=0.5"]
  assert cli.main(argv) == 0
  with open(os.path.join(model_dir, adaptive.REPORT_FILENAME)) as f:
    report = json.load(f)
  assert report["dp"] is False and report["steps"] == 2
  assert "ADAPTIVE DP" in capsys.readouterr().out
