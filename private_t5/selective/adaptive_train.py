"""Adaptive-DP-Adafactor training (seed 004): the trainer with the adaptive aggregator.

The run is the ordinary DP-Adafactor run of `train.main.train` (same Poisson sampler, clip,
divisor q N, Adafactor, checkpoints and resume) with two swaps: batches carry each row's
privacy probability (`AdaptiveSource`) and the aggregator scales the noise by gamma_B
(`AdaptiveDPAggregator`). Because that breaks the formal guarantee, the ledger in every
checkpoint records epsilon = infinity, and `adaptive_dp_report.json` beside it gives the
implied-epsilon number of the seed with its caveat.
"""
import dataclasses
import os
from typing import Callable, Optional, Sequence

from private_t5.errors import ConfigError
from private_t5.selective import adaptive


def train_adaptive(*, reference_model_dir: Optional[str], model_config, train_data, model_dir: str,
                   train_steps: int, batch_size: int, dp, validation_data=None,
                   normalization: str = "max", microbatch_size: Optional[int] = None,
                   learning_rate=None, vocab_path: Optional[str] = None, checkpoint_every: int = 1000,
                   keep_checkpoints: int = 3, eval_every: int = 0, eval_examples: int = 256,
                   log_every: int = 50, mesh_shape: Sequence[int] = (-1, 1), z_loss: float = 0.0,
                   initial_checkpoint: Optional[str] = None,
                   insecure_deterministic_seed: Optional[int] = None, probability_batch_size: int = 64,
                   log: Callable[[str], None] = print) -> dict:
  """Trains with Adaptive-DP-Adafactor; returns the summary (with the `adaptive_dp` report).

  Args mirror `train.main.train`, plus:
    reference_model_dir: MODEL_DIR of the public reference model whose perplexities give rho.
    normalization: how perplexities become rho in [0, 1] (`adaptive.normalize`).
    dp: the `DPConfig` whose sigma is scaled by gamma_B (a target epsilon is calibrated for the
      non-adaptive mechanism, which this run does not achieve).
    probability_batch_size: batch size of the perplexity scoring pass.

  Raises:
    ConfigError: no reference checkpoint, or `dp` is None.
  """
  from private_t5 import models  # pylint: disable=g-import-not-at-top
  from private_t5.dp.ledger import PrivacyLedger  # pylint: disable=g-import-not-at-top
  from private_t5.train import checkpoints, loop, optimizers, partitioning, privacy  # pylint: disable=g-import-not-at-top
  from private_t5.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from private_t5.train.state import RunSeeds  # pylint: disable=g-import-not-at-top
  from private_t5.train.trainer import Trainer, make_loss_fn  # pylint: disable=g-import-not-at-top

  if not reference_model_dir:
    raise ConfigError("adaptive DP needs a public reference model checkpoint (reference_model_dir) to "
                      "estimate privacy probabilities; none was given")
  if dp is None:
    raise ConfigError("adaptive DP scales the DP noise: give a DPConfig (dp), not None")
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
  source = adaptive.AdaptiveSource(train_data, probabilities.rho)

  manager = checkpoints.CheckpointManager(model_dir, keep=keep_checkpoints)
  saved = checkpoints.saved_seeds(manager)
  seeds = RunSeeds.from_dict(saved) if saved else RunSeeds.create(insecure_deterministic_seed)
  mesh = partitioning.create_mesh(mesh_shape)
  partitioning.check_batch_divisible(batch_size, mesh)
  dp_setup = privacy.setup_privacy(
      dp, loss_fn=make_loss_fn(model_config, z_loss), num_examples=train_data.num_examples,
      privacy_unit=train_data.privacy_unit, batch_size=batch_size, train_steps=train_steps,
      microbatch_size=microbatch_size, sampler_seed=seeds.sampler_seed, vocab_path=vocab_path,
      spmd_axis_name=partitioning.DATA_AXIS if mesh.shape[partitioning.DATA_AXIS] > 1 else None, log=log)
  nominal = dp_setup.ledger
  # No formal guarantee: the ledger that travels with the checkpoints says epsilon = infinity.
  setup = privacy.PrivacySetup(
      aggregator=adaptive.AdaptiveDPAggregator(dp_setup.aggregator), sampler=dp_setup.sampler,
      ledger=PrivacyLedger.non_private_baseline(num_examples=train_data.num_examples,
                                                privacy_unit=train_data.privacy_unit, batch_size=batch_size),
      private=False, noise_multiplier=dp_setup.noise_multiplier)
  model_dict = dataclasses.asdict(model_config)
  fingerprint = {"model_config": model_dict, "data": {k: train_data.describe().get(k) for k in
                                                      ("corpus", "vocab_sha256", "objective", "feature_lengths",
                                                       "privacy_unit", "num_examples", "split")},
                 "privacy": dict(dp_setup.mechanism(), adaptive=True, normalization=probabilities.normalization),
                 "initial_checkpoint": os.path.abspath(initial_checkpoint) if initial_checkpoint else None}
  manager.fingerprint = fingerprint
  manager.check_compatible(fingerprint)
  lr = optimizers.rsqrt_schedule(base_learning_rate=0.5, warmup_steps=1000) if learning_rate is None else learning_rate
  trainer = Trainer(model_config, setup.aggregator, optimizers.adafactor(lr), mesh,
                    learning_rate_fn=lr if callable(lr) else None)
  log(f"[train] Adaptive-DP-Adafactor: {models.num_params(model_config) / 1e6:.2f}M parameters, "
      f"{train_data.num_examples} examples, batch {batch_size}, nominal σ={dp_setup.noise_multiplier:.4f} "
      f"scaled by γ_B each step (NOT a formal DP guarantee)")
  metadata = {"model_config": model_dict, "vocab_path": os.path.abspath(vocab_path) if vocab_path else None,
              "feature_lengths": dict(train_data.feature_lengths), "data": train_data.describe(),
              "num_params": models.num_params(model_config), "batch_size": batch_size, "adaptive_dp": True}
  initial_params_fn = None
  if initial_checkpoint:
    from private_t5.train import initial_checkpoint as initial_lib  # pylint: disable=g-import-not-at-top
    initial_params_fn = lambda: initial_lib.load_initial_params(initial_checkpoint, model_config)
  summary = loop.run(
      trainer=trainer, privacy=setup, source=source, validation_source=validation_data, seeds=seeds,
      manager=manager,
      config=loop.LoopConfig(model_dir=model_dir, train_steps=train_steps, checkpoint_every=checkpoint_every,
                             eval_every=eval_every, eval_examples=eval_examples, log_every=log_every),
      metadata=metadata, initial_params_fn=initial_params_fn, log=log)
  manager.close()
  gammas = adaptive.step_privacy_weights(dp_setup.sampler, probabilities.rho, summary["final_step"])
  report = adaptive.adaptive_report(
      noise_multiplier=dp_setup.noise_multiplier, clip_norm=nominal.clip_norm, sampling_rate=nominal.sampling_rate,
      delta=nominal.delta, accountant=nominal.accountant, gammas=gammas, probabilities=probabilities,
      privacy_unit=train_data.privacy_unit, num_examples=train_data.num_examples)
  checkpoints.write_json_atomic(os.path.join(model_dir, adaptive.REPORT_FILENAME), report)
  summary.update(adaptive_dp=report, noise_multiplier=dp_setup.noise_multiplier,
                 adaptive_dp_report=os.path.abspath(os.path.join(model_dir, adaptive.REPORT_FILENAME)))
  metrics_lib.write_summary(model_dir, summary)
  implied = report["implied_epsilon"]
  log(f"[train] done: step {summary['final_step']} in {summary['model_dir']}")
  log(f"  privacy: ADAPTIVE DP — no formal (ε, δ) guarantee (ledger: ε = ∞); mean γ_B "
      f"{report['privacy_weight']['mean']:.3f}; the per-step effective noise σ·γ_t would imply ε ≈ "
      f"{implied if implied is not None else float('inf'):.4g} at δ = {report['delta']:.3g} (not a guarantee); "
      f"report: {summary['adaptive_dp_report']}")
  return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
  """`private-t5 adaptive --gin_file=... [--gin.NAME=VALUE ...]` (see configs/runs/adaptive.gin)."""
  import sys  # pylint: disable=g-import-not-at-top
  from private_t5.selective import jft  # pylint: disable=g-import-not-at-top (registers train_adaptive)
  from private_t5.train import main as train_main  # pylint: disable=g-import-not-at-top
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__ + "\nusage: private-t5 adaptive --gin_file=configs/models/... "
          "--gin_file=configs/runs/pretrain.gin --gin_file=configs/runs/adaptive.gin [--gin.NAME=VALUE ...]")
    return 0
  jft._register()  # pylint: disable=protected-access
  train_main.run_from_args(argv, entry="train_adaptive")
  return 0
