#!/usr/bin/env python
"""Fine-tuning benchmarks on the GLUE-layout data: throughput (public vs DP) and scores.

  # examples/s of the compiled train step, non-private vs DP-Adafactor, per model preset
  python benchmarks/bench_finetune.py throughput --presets=t5_1_0_tiny,t5_1_0_small \
      --batch_size=16 --inputs_length=64 --targets_length=8 --steps=5

  # validation scores on the three glue_like tasks after a fixed budget of fine-tuning
  python benchmarks/bench_finetune.py scores --preset=t5_1_0_tiny --steps=300 --batch_size=32

Both modes use the production path: `GlueSource` batches, the trainer's `Trainer` with the
clipped sum and noise transform `dp.mechanism.build_mechanism` builds (MeanAggregator, or
DPAggregator with Poisson sampling), Adafactor; `scores` runs `private-t5 train`'s `train()` then the
evaluation of `private-t5 evaluate`. Without --vocab_path a small SentencePiece model is
trained on the tasks' training text. Results are printed and written as JSON (--output).
"""
import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLUE_LIKE = ("rotten_tomatoes", "bible_paraphrase", "bbc_news")
LABEL_LINE = ("positive negative equivalent not_equivalent business entertainment politics "
              "sports tech sentence: sentence1: sentence2: rotten_tomatoes bible_paraphrase bbc_news")


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def build_vocab(path: str, vocab_size: int = 2000) -> str:
  """A SentencePiece model on the glue_like training text (labels included)."""
  from private_t5.data import glue_rows  # pylint: disable=g-import-not-at-top
  from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
  from private_t5 import vocabulary  # pylint: disable=g-import-not-at-top
  lines = []
  for task in GLUE_LIKE:
    texts, _ = glue_rows.load_rows(task, "train", None, None)[0]
    for column in texts.values():
      lines += [t[:2000] for t in column[:4000]]
  lines += [LABEL_LINE] * 2000
  _log(f"[bench] training a {vocab_size}-piece vocabulary on {len(lines)} lines")
  return spm.train_from_sentences(lines, path, vocab_size)


def _model_config(preset: str, vocab_path: str, dropout: float):
  from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
  from private_t5 import vocabulary  # pylint: disable=g-import-not-at-top
  ids = vocabulary.load_vocabulary(vocab_path).vocab_size
  config = config_lib.load_preset(preset, dropout_rate=dropout)
  if config.vocab_size < ids or "tiny" in preset:
    config = config.replace(vocab_size=-(-ids // 128) * 128)
  return config


def throughput(args, vocab_path: str) -> dict:
  """Steady-state examples/s of the jit-compiled train step, public vs DP."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from private_t5.data import glue_tasks  # pylint: disable=g-import-not-at-top
  from private_t5.dp import mechanism as privacy  # pylint: disable=g-import-not-at-top
  from private_t5.dp import config as dp_config  # pylint: disable=g-import-not-at-top
  from private_t5.train import host_microbatches, optimizers  # pylint: disable=g-import-not-at-top
  from private_t5.models import sharding  # pylint: disable=g-import-not-at-top
  from private_t5.train.trainer import Trainer, make_loss_fn  # pylint: disable=g-import-not-at-top
  lengths = {"inputs": args.inputs_length, "targets": args.targets_length}
  source = glue_tasks.GlueSource(args.task, "train", vocab_path, lengths)
  mesh = sharding.create_mesh((1, 1), devices=jax.devices()[:1])
  results = {"task": args.task, "feature_lengths": lengths, "batch_size": args.batch_size,
             "steps_timed": args.steps, "device": str(jax.devices()[0].platform), "presets": {}}
  rng = np.random.default_rng(0)
  for preset in args.presets.split(","):
    config = _model_config(preset, vocab_path, dropout=0.1)
    row = {}
    for mode in ("public", "dp"):
      dp = dp_config.DPConfig(clip_norm=1.0, noise_multiplier=1.0) if mode == "dp" else None
      setup = privacy.build_mechanism(dp, dp_config.ExecutionSettings(microbatch_size=args.microbatch_size),
                                      loss_fn=make_loss_fn(config), num_examples=source.num_examples,
                                      privacy_unit=source.privacy_unit, batch_size=args.batch_size,
                                      train_steps=args.steps, sampler_seed=0, spmd_axis_name=None,
                                      log=lambda _: None)
      trainer = Trainer(config, setup.clipped_sum, optimizers.adafactor(optimizers.constant_schedule(1e-3)),
                        mesh, noise=setup.noise)
      state = trainer.init_state(jax.random.PRNGKey(0))
      keys = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))
      # Full batches in both modes so that both time the same number of rows.
      batches = [source.get_batch(rng.choice(source.num_examples, args.batch_size, replace=False), 0,
                                  args.batch_size) for _ in range(args.steps + 1)]
      micro = args.microbatch_size if args.microbatch_size and args.microbatch_size < args.batch_size else None

      def step(state, batch):
        """One step: fused, or in microbatches through the host-dispatched accumulate loop."""
        if micro is None:
          return trainer.train_step(state, batch, *keys)
        return host_microbatches.train_step_microbatched(trainer, state, batch, micro, *keys)

      start = time.perf_counter()
      state, metrics = step(state, batches[0])
      jax.block_until_ready(metrics)
      compile_s = time.perf_counter() - start
      start = time.perf_counter()
      for batch in batches[1:]:
        state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      elapsed = time.perf_counter() - start
      row[mode] = {"examples_per_s": args.batch_size * args.steps / elapsed,
                   "s_per_step": elapsed / args.steps, "first_step_s": compile_s}
      _log(f"[bench] {preset} {mode}: {row[mode]['examples_per_s']:.1f} examples/s "
           f"({row[mode]['s_per_step']:.3f} s/step, first step {compile_s:.1f}s)")
      del state
    row["dp_over_public"] = row["dp"]["examples_per_s"] / row["public"]["examples_per_s"]
    results["presets"][preset] = row
  return results


def scores(args, vocab_path: str) -> dict:
  """Fine-tune each glue_like task for a fixed budget, then evaluate on validation."""
  from private_t5.data import glue_tasks  # pylint: disable=g-import-not-at-top
  from private_t5.eval import glue_eval  # pylint: disable=g-import-not-at-top
  from private_t5.train import main as train_main  # pylint: disable=g-import-not-at-top
  from private_t5.dp import mechanism as privacy  # pylint: disable=g-import-not-at-top
  from private_t5.dp import config as dp_config  # pylint: disable=g-import-not-at-top
  from private_t5.train import optimizers  # pylint: disable=g-import-not-at-top
  lengths = {"inputs": args.inputs_length, "targets": args.targets_length}
  results = {"preset": args.preset, "steps": args.steps, "batch_size": args.batch_size,
             "learning_rate": args.learning_rate, "feature_lengths": lengths, "dp": args.dp, "tasks": {}}
  config = _model_config(args.preset, vocab_path, dropout=0.0)
  work = args.work_dir or tempfile.mkdtemp(prefix="bench_finetune_")
  for task in args.tasks.split(","):
    train = glue_tasks.GlueSource(task, "train", vocab_path, lengths, vocab_size=config.vocab_size)
    validation = glue_tasks.GlueSource(task, "validation", vocab_path, lengths, vocab_size=config.vocab_size)
    dp = dp_config.DPConfig(clip_norm=1.0, target_epsilon=8.0) if args.dp else None
    model_dir = os.path.join(work, f"{task}{'_dp' if args.dp else ''}")
    start = time.perf_counter()
    summary = train_main.train(
        model_config=config, train_data=train, validation_data=validation, model_dir=model_dir,
        train_steps=args.steps, batch_size=args.batch_size,
        learning_rate=optimizers.constant_schedule(args.learning_rate), dp=dp, vocab_path=vocab_path,
        checkpoint_every=args.steps, eval_every=0, eval_examples=64, log_every=100, mesh_shape=(1, 1),
        log=_log)
    train_s = time.perf_counter() - start
    out = glue_eval.evaluate_params(*_restore(model_dir), task, vocab_path, lengths, batch_size=256,
                                       progress=False)["tasks"][task]
    results["tasks"][task] = {"metrics": out["metrics"], "score": out["score"],
                              "majority": out["majority_baseline"]["metrics"],
                              "train_examples": train.num_examples, "train_seconds": train_s,
                              "epsilon": summary.get("epsilon")}
    _log(f"[bench] {task}: {out['metrics']} vs majority {out['majority_baseline']['metrics']} "
         f"({train_s:.0f}s)")
  return results


def _restore(model_dir):
  from private_t5.models import checkpoint_read  # pylint: disable=g-import-not-at-top
  params, config, _ = checkpoint_read.restore_for_inference(model_dir)
  return params, config


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", choices=("throughput", "scores"))
  parser.add_argument("--vocab_path", default=None)
  parser.add_argument("--presets", default="t5_1_0_tiny,t5_1_0_small")
  parser.add_argument("--preset", default="t5_1_0_tiny")
  parser.add_argument("--task", default="rotten_tomatoes")
  parser.add_argument("--tasks", default=",".join(GLUE_LIKE))
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--microbatch_size", type=int, default=None)
  parser.add_argument("--inputs_length", type=int, default=64)
  parser.add_argument("--targets_length", type=int, default=8)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--learning_rate", type=float, default=1e-2)
  parser.add_argument("--dp", action="store_true", help="scores: DP fine-tuning (ε = 8)")
  parser.add_argument("--work_dir", default=None)
  parser.add_argument("--output", default=None, help="write the results as JSON here")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  vocab_path = args.vocab_path or build_vocab(os.path.join(tempfile.mkdtemp(prefix="bench_vocab_"),
                                                           "glue_like.model"))
  results = throughput(args, vocab_path) if args.mode == "throughput" else scores(args, vocab_path)
  results["vocab_path"] = vocab_path
  text = json.dumps(results, indent=2, sort_keys=True)
  print(text)
  if args.output:
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
      f.write(text + "\n")
    os.replace(tmp, args.output)
  return 0


if __name__ == "__main__":
  sys.exit(main())
