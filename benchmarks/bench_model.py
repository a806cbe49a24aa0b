"""Benchmarks the T5 network on this machine: a training step and decoding throughput.

  .venv/bin/python benchmarks/bench_model.py --output /tmp/bench_model.json

1. Forward+backward step (mean per-example loss, `jax.value_and_grad`) of T5 v1.0 small at
   inputs 512 / targets 114, batch 8 (the DP paper's shapes); compile time is reported
   separately from the steady-state step time.
2. Greedy decoding throughput (generated tokens/s) with and without the KV cache, for the
   tiny and small presets. EOS is disabled so that every row decodes the full length.

Prints a Markdown table and writes the numbers as JSON (atomically) to --output.
"""
import argparse
import json
import os
import platform
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from private_t5.models import decoding  # pylint: disable=g-import-not-at-top
from private_t5.models.model import example_loss_fn  # pylint: disable=g-import-not-at-top
from private_t5.models.network import init_params, num_params  # pylint: disable=g-import-not-at-top
from private_t5.models.config import load_preset  # pylint: disable=g-import-not-at-top


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _random_batch(rng: np.random.Generator, vocab: int, batch: int, inputs: int, targets: int):
  enc = rng.integers(3, vocab, size=(batch, inputs), dtype=np.int32)
  tgt = rng.integers(3, vocab, size=(batch, targets), dtype=np.int32)
  tgt[:, -1] = decoding.EOS_ID
  dec = np.concatenate([np.zeros((batch, 1), np.int32), tgt[:, :-1]], axis=1)
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=tgt,
              decoder_loss_weights=np.ones((batch, targets), np.float32))


def bench_train_step(preset: str, batch: int, inputs: int, targets: int, steps: int) -> dict:
  config = load_preset(preset)
  params = init_params(config, jax.random.PRNGKey(0))
  data = _random_batch(np.random.default_rng(0), config.vocab_size, batch, inputs, targets)
  dropout_rng = jax.random.PRNGKey(1)

  def loss_and_grads(params, batch, dropout_rng):
    return jax.value_and_grad(lambda p: example_loss_fn(p, batch, config, dropout_rng).mean())(params)

  start = time.perf_counter()
  compiled = jax.jit(loss_and_grads).lower(params, data, dropout_rng).compile()
  compile_s = time.perf_counter() - start
  _log(f"[train] {preset} compiled in {compile_s:.1f}s")
  jax.block_until_ready(compiled(params, data, dropout_rng))  # warm-up
  times = []
  for i in range(steps):
    start = time.perf_counter()
    loss, grads = compiled(params, data, jax.random.fold_in(dropout_rng, i))
    jax.block_until_ready((loss, grads))
    times.append(time.perf_counter() - start)
    _log(f"[train] step {i + 1}/{steps}: {times[-1]:.2f}s (loss {float(loss):.3f})")
  return dict(preset=preset, num_params=num_params(config), batch=batch, inputs=inputs, targets=targets,
              compile_s=compile_s, step_s_median=float(np.median(times)), step_s_min=float(np.min(times)),
              steps=steps, examples_per_s=batch / float(np.median(times)))


def bench_decode(preset: str, batch: int, inputs: int, length: int, use_cache: bool, repeats: int) -> dict:
  config = load_preset(preset)
  params = init_params(config, jax.random.PRNGKey(0))
  enc = jnp.asarray(np.random.default_rng(1).integers(3, config.vocab_size, size=(batch, inputs),
                                                      dtype=np.int32))
  # eos_id=-1 never matches, so every row generates exactly `length` tokens.
  run = lambda: decoding.greedy_decode(params, config, enc, max_decode_length=length, eos_id=-1,
                                       use_cache=use_cache)
  start = time.perf_counter()
  jax.block_until_ready(run())
  first_s = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  seconds = float(np.median(times))
  _log(f"[decode] {preset} cache={use_cache}: {batch * length / seconds:.1f} tokens/s")
  return dict(preset=preset, batch=batch, inputs=inputs, generated=length, use_cache=use_cache,
              compile_and_first_run_s=first_s, seconds=seconds, tokens_per_s=batch * length / seconds)


def _markdown(results: dict) -> str:
  lines = [
      f"Device: {results['device']} ({results['cpu_count']} visible CPU cores, shared: noisy numbers)",
      "",
      "| benchmark | setting | compile (s) | time (s) | throughput |",
      "|---|---|---|---|---|",
  ]
  if "train_step" in results:
    t = results["train_step"]
    lines.append(
        f"| fwd+bwd step | {t['preset']} ({t['num_params']:,} params), batch {t['batch']}, "
        f"{t['inputs']}/{t['targets']} tokens | {t['compile_s']:.1f} | {t['step_s_median']:.2f} "
        f"(min {t['step_s_min']:.2f}) | {t['examples_per_s']:.2f} examples/s |")
  for d in results["decode"]:
    lines.append(
        f"| greedy decode | {d['preset']}, cache={'on' if d['use_cache'] else 'off'}, batch {d['batch']}, "
        f"inputs {d['inputs']}, {d['generated']} new tokens | {d['compile_and_first_run_s']:.1f} (incl. 1st run) "
        f"| {d['seconds']:.2f} | {d['tokens_per_s']:.1f} tokens/s |")
  lines.append(f"\nPeak resident memory of the process: {results['max_rss_gib']:.2f} GiB")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output", required=True, help="where to write the JSON results")
  parser.add_argument("--train_preset", default="t5_1_0_small")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--inputs", type=int, default=512)
  parser.add_argument("--targets", type=int, default=114)
  parser.add_argument("--train_steps", type=int, default=2, help="0 skips the training step")
  parser.add_argument("--tiny_decode", default="16,64,64", help="batch,inputs,new tokens for tiny")
  parser.add_argument("--small_decode", default="4,512,16", help="batch,inputs,new tokens for small")
  parser.add_argument("--decode_repeats", type=int, default=2)
  args = parser.parse_args(argv)

  results = dict(device=f"{jax.devices()[0].platform} / {platform.processor() or platform.machine()}",
                 cpu_count=os.cpu_count(), jax_version=jax.__version__)
  if args.train_steps > 0:
    results["train_step"] = bench_train_step(args.train_preset, args.batch, args.inputs, args.targets,
                                             args.train_steps)
  results["decode"] = []
  for preset, spec in (("t5_1_0_tiny", args.tiny_decode), ("t5_1_0_small", args.small_decode)):
    batch, inputs, length = (int(x) for x in spec.split(","))
    for use_cache in (True, False):
      results["decode"].append(bench_decode(preset, batch, inputs, length, use_cache, args.decode_repeats))
  results["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  for cached, uncached in zip(results["decode"][::2], results["decode"][1::2]):
    cached["speedup_vs_uncached"] = cached["tokens_per_s"] / uncached["tokens_per_s"]

  table = _markdown(results)
  print(table)
  results["markdown"] = table
  tmp = args.output + ".tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=2)
  os.replace(tmp, args.output)
  return 0


if __name__ == "__main__":
  sys.exit(main())
