#!/usr/bin/env python
"""Training throughput on this machine: steps/s, examples/s and compile time of the train
step for T5 presets, and the checkpoint save/restore time (batches of real text).

  .venv/bin/python benchmarks/bench_train.py --vocab=VOCAB.model \
      [--corpus=builtin:python_docs] [--presets=t5_1_0_tiny:128:32,t5_1_0_small:512:114] \
      [--batch_size=8] [--steps=3] [--dp] [--output=bench_out/train.json]

Each entry of --presets is PRESET:INPUT_LENGTH:TARGET_LENGTH. The model's vocabulary is the
preset's (32128 for small; token ids of the smaller vocabulary fit inside it).
"""
import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--vocab", required=True, help="SentencePiece model used to tokenize the corpus")
  p.add_argument("--corpus", default="builtin:python_docs")
  p.add_argument("--presets", default="t5_1_0_tiny:128:32,t5_1_0_tiny:512:114,t5_1_0_small:512:114")
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--steps", type=int, default=3, help="timed steps after the first (compiling) one")
  p.add_argument("--dp", action="store_true", help="also time the DP step (clip + noise)")
  p.add_argument("--checkpoint_preset", default="t5_1_0_small")
  p.add_argument("--cache_dir", default=None)
  p.add_argument("--output", default=None)
  return p.parse_args(argv)


def _time_steps(trainer, batch, seeds, steps):
  import jax  # pylint: disable=g-import-not-at-top
  state = trainer.init_state(seeds.init_key)
  device_batch = trainer.place_batch(batch)
  t0 = time.time()
  state, _ = trainer.train_step(state, device_batch, seeds.dropout_base_key, seeds.noise_base_key)
  jax.block_until_ready(state)
  first = time.time() - t0
  times = []
  cpu0 = time.process_time()
  for _ in range(steps):
    t0 = time.time()
    state, _ = trainer.train_step(state, device_batch, seeds.dropout_base_key, seeds.noise_base_key)
    jax.block_until_ready(state)
    times.append(time.time() - t0)
  cpu_per_step = (time.process_time() - cpu0) / max(steps, 1)
  step_s = sorted(times)[len(times) // 2]
  # CPU seconds per step do not depend on other load on the machine; wall time does.
  return state, {"first_step_s": first, "compile_s_estimate": max(first - step_s, 0.0),
                 "median_step_s": step_s, "cpu_s_per_step": cpu_per_step,
                 "load_average_1min": os.getloadavg()[0], "steps_per_s": 1.0 / step_s,
                 "examples_per_s": float(batch["example_weight"].sum()) / step_s, "timed_steps": steps}


def main(argv=None):
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from private_t5.models import network  # pylint: disable=g-import-not-at-top
  from private_t5.data.source import make_source  # pylint: disable=g-import-not-at-top
  from private_t5.dp.privacy_params import NoisySum  # pylint: disable=g-import-not-at-top
  from private_t5.dp.aggregator import DPAggregator, MeanAggregator  # pylint: disable=g-import-not-at-top
  from private_t5.io import write_json_atomic  # pylint: disable=g-import-not-at-top
  from private_t5.models import checkpoints  # pylint: disable=g-import-not-at-top
  from private_t5.train import optimizers  # pylint: disable=g-import-not-at-top
  from private_t5.models import sharding  # pylint: disable=g-import-not-at-top
  from private_t5.train.state import RunSeeds  # pylint: disable=g-import-not-at-top
  from private_t5.train.trainer import Trainer, make_loss_fn  # pylint: disable=g-import-not-at-top

  mesh = sharding.create_mesh((1, 1), jax.devices()[:1])
  seeds = RunSeeds.create(insecure_deterministic_seed=0)
  results = {"device": f"{jax.devices()[0].platform} ({os.cpu_count()} cores)", "batch_size": args.batch_size,
             "runs": []}
  states = {}
  for entry in args.presets.split(","):
    preset, li, lt = entry.split(":")
    lengths = {"inputs": int(li), "targets": int(lt)}
    source = make_source(args.corpus, args.vocab, feature_lengths=lengths, split="train",
                         cache_dir=args.cache_dir)
    batch = source.get_batch(np.arange(args.batch_size), seed=0, batch_size=args.batch_size)
    config = config_lib.load_preset(preset)
    if source.store.manifest["vocab_size"] > config.vocab_size:
      config = config.replace(vocab_size=-(-int(source.store.manifest["vocab_size"]) // 128) * 128)
    loss_fn = make_loss_fn(config)
    kinds = [("non_private", MeanAggregator(loss_fn))]
    if args.dp:
      kinds.append(("dp", DPAggregator(loss_fn, NoisySum(1.0, 1.0, args.batch_size))))
    for kind, aggregator in kinds:
      trainer = Trainer(config, aggregator, optimizers.adafactor(), mesh)
      print(f"[bench] {preset} {lengths} batch {args.batch_size} {kind} ...", file=sys.stderr, flush=True)
      state, timing = _time_steps(trainer, batch, seeds, args.steps)
      row = {"preset": preset, "feature_lengths": lengths, "kind": kind,
             "num_params": network.num_params(config), **timing}
      results["runs"].append(row)
      print(json.dumps(row), flush=True)
      if preset == args.checkpoint_preset and kind == "non_private":
        states[preset] = (trainer, state)
  if args.checkpoint_preset in states:
    trainer, state = states[args.checkpoint_preset]
    with tempfile.TemporaryDirectory() as tmp:
      manager = checkpoints.CheckpointManager(tmp, keep=1)
      t0 = time.time()
      manager.save(1, state, {"bench": True})
      manager.wait()
      save_s = time.time() - t0
      t0 = time.time()
      restored, _ = manager.restore(trainer.abstract_state())
      jax.block_until_ready(restored)
      restore_s = time.time() - t0
      size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmp) for f in fs)
      manager.close()
    results["checkpoint"] = {"preset": args.checkpoint_preset, "save_s": save_s, "restore_s": restore_s,
                             "bytes": size}
    print(json.dumps(results["checkpoint"]), flush=True)
  if args.output:
    write_json_atomic(args.output, results)
  return 0


if __name__ == "__main__":
  sys.exit(main())
