"""Adaptive-DP-Adafactor training (Wu et al. 2022): the trainer with the adaptive clipped sum.

The run is the ordinary DP-Adafactor run of `train.main.train` (same Poisson sampler, clip,
divisor q N, Adafactor, checkpoints and resume) with two swaps: batches carry each row's
privacy probability (`AdaptiveSource`) and the clipped sum reports gamma_B, by which the run's
noise transform scales the noise (`AdaptiveDPAggregator`). Because that breaks the formal guarantee, the ledger in every
checkpoint records epsilon = infinity, and `adaptive_dp_report.json` beside it gives the
implied-epsilon number of Wu et al. 2022 with its caveat.
"""
import dataclasses
import functools
import os
from typing import Callable, Optional

from private_t5 import io as io_lib
from private_t5.dp import ledger as ledger_lib
from private_t5.dp import privacy_report
from private_t5.dp.config import require_gaussian
from private_t5.errors import ConfigError
from private_t5.selective import adaptive
from private_t5.train import main as train_main


def train_adaptive(*, reference_model_dir: Optional[str], normalization: str = "max",
                   probability_batch_size: int = 64, log: Callable[[str], None] = print,
                   **train_kwargs) -> dict:
  """Trains with Adaptive-DP-Adafactor; returns the summary (with the `adaptive_dp` report).

  Args:
    reference_model_dir: MODEL_DIR of the public reference model whose perplexities give rho.
    normalization: how perplexities become rho in [0, 1] (`adaptive.normalize`).
    probability_batch_size: batch size of the perplexity scoring pass.
    log: progress output.
    **train_kwargs: the arguments of `train.main.train` (model_config, train_data, model_dir,
      train_steps, batch_size, dp, ...; Gin: `train_adaptive.NAME`). `dp` is the `DPConfig`
      whose sigma is scaled by gamma_B (a target epsilon is calibrated for the non-adaptive
      mechanism, which this run does not achieve).

  Raises:
    ConfigError: no reference checkpoint, `dp` is None, or an argument `train` does not take.
  """

  if not reference_model_dir:
    raise ConfigError("adaptive DP needs a public reference model checkpoint (reference_model_dir) to "
                      "estimate privacy probabilities; none was given")
  train_main.check_train_kwargs(train_kwargs, "train_adaptive")
  if "privacy_hook" in train_kwargs:
    raise ConfigError("train_adaptive sets train's privacy_hook itself; do not pass one")
  missing = [k for k in ("model_config", "train_data", "model_dir", "train_steps", "batch_size")
             if train_kwargs.get(k) is None]
  if missing:
    raise ConfigError(f"train_adaptive needs {', '.join(missing)} (Gin: train_adaptive.NAME = ...)")
  dp = train_kwargs.get("dp")
  if dp is None:
    raise ConfigError("adaptive DP scales the DP noise: give a DPConfig (dp), not None")
  require_gaussian(dp, "adaptive DP (a per-step noise scale)")
  train_data, model_dir, batch_size = train_kwargs["train_data"], train_kwargs["model_dir"], train_kwargs["batch_size"]
  train_main.validate_train_args(**{k: train_kwargs[k] for k in (
      "model_config", "train_data", "train_steps", "batch_size", "dp", "checkpoint_every", "keep_checkpoints",
      "eval_every", "eval_examples", "log_every") if k in train_kwargs})
  os.makedirs(model_dir, exist_ok=True)
  prob_path = os.path.join(model_dir, adaptive.PROBABILITIES_FILENAME)
  if os.path.isfile(prob_path):  # resumed run: the same rho as before
    probabilities = adaptive.PrivacyProbabilities.load(prob_path)
  else:
    probabilities = adaptive.estimate_privacy_probabilities(
        reference_model_dir, train_data, normalization=normalization, batch_size=probability_batch_size, log=log)
    probabilities.save(prob_path)
  summary_rho = probabilities.summary()
  log(f"[adaptive] privacy probabilities: mean {summary_rho['rho_mean']:.3f} (min {summary_rho['rho_min']:.3f}, "
      f"max {summary_rho['rho_max']:.3f}), normalization {probabilities.normalization}")

  def make_adaptive(dp_setup, data) -> train_main.PrivacyOverride:
    # The DP setup (sampler, clip, divisor, nominal σ, noise transform) is kept; the noise is
    # scaled by γ_B, and since that breaks the formal guarantee the ledger that travels with the
    # checkpoints says ε = ∞.
    log(f"[adaptive] nominal σ={dp_setup.noise_multiplier:.4f} scaled by γ_B each step "
        "(NOT a formal DP guarantee)")
    # The same sampler, layout and noise transform; the clipped sum reports γ_B, which scales the noise.
    setup = dataclasses.replace(
        dp_setup, clipped_sum=adaptive.AdaptiveDPAggregator(dp_setup.clipped_sum), dp_event=None,
        ledger=ledger_lib.PrivacyLedger.non_private_baseline(num_examples=data.num_examples,
                                                             privacy_unit=data.privacy_unit, batch_size=batch_size),
        dp_spm_report=None)
    extra = {"adaptive_dp": True, "normalization": probabilities.normalization,
             "optimizer": "Adaptive-DP-Adafactor"}
    return train_main.PrivacyOverride(mechanism=setup, source=adaptive.AdaptiveSource(data, probabilities.rho),
                                      extra=extra, summarize=functools.partial(adaptive_summary, dp_setup))

  def adaptive_summary(dp_setup, summary):
    # The adaptive report, from the γ_t of the steps taken under the nominal DP setup, goes into
    # the run's one summary.json.
    ledger = dp_setup.ledger
    gammas = adaptive.step_privacy_weights(dp_setup.sampler, probabilities.rho, summary["final_step"])
    report = adaptive.adaptive_report(
        noise_multiplier=dp_setup.noise_multiplier, clip_norm=ledger.clip_norm, sampling_rate=ledger.sampling_rate,
        delta=ledger.delta, accountant=ledger.accountant, gammas=gammas, probabilities=probabilities,
        privacy_unit=train_data.privacy_unit, num_examples=train_data.num_examples)
    report_path = os.path.join(model_dir, privacy_report.ADAPTIVE_REPORT_FILENAME)
    io_lib.write_json_atomic(report_path, report)
    return {"adaptive_dp": report, "noise_multiplier": dp_setup.noise_multiplier,
            "adaptive_dp_report": os.path.abspath(report_path)}

  summary = train_main.train(log=log, privacy_hook=make_adaptive, **train_kwargs)
  report = summary["adaptive_dp"]
  implied = report["implied_epsilon"]
  log(f"[adaptive] privacy: ADAPTIVE DP — no formal (ε, δ) guarantee (ledger: ε = ∞); mean γ_B "
      f"{report['privacy_weight']['mean']:.3f}; the per-step effective noise σ·γ_t would imply ε ≈ "
      f"{implied if implied is not None else float('inf'):.4g} at δ = {report['delta']:.3g} (not a guarantee); "
      f"report: {summary['adaptive_dp_report']}")
  return summary
