"""Throughput of the 50/50 extraction protocol's decode: prompts of P = 50 tokens, T = 50 tokens
generated greedily, through the function `private-t5 memorization` uses for it.

  .venv/bin/python benchmarks/bench_extraction.py [--presets=t5_1_0_tiny,t5_1_0_small]
      [--vocab_size=32128] [--batch_size=32] [--batches=4] [--prompt_length=50]
      [--generation_length=50] [--out=/tmp/bench_extraction.json]

For each preset: random parameters (`models.init_params`, key 0) with `--vocab_size` rows of the
embedding (32,128: T5's), placed on the mesh of every device (`eval.memorization.make_inference`,
the stage's default `(-1, 1)` mesh), and `eval.memorization.generate` (greedy, KV cache) on
`--batches` x `--batch_size` random prompts of `--prompt_length` tokens followed by EOS, as
`prefix_examples` builds them. One call compiles (its batches are not counted); a second call on
the same prompts is timed: prompts/s and generated tokens/s of its whole wall time, and the
steady-state figures `DecodeStats` reports (after its first batch). Tokens count what each row
generated, through its first EOS (`memorization.generated_lengths`), as the stage counts them;
`rows_ended_early` says how many rows emitted EOS before T tokens (the decode loop stops when
every row of a batch has ended).

Fills the decode table of docs/memorization.md, "The 50/50 extraction protocol". Results are
printed and written as JSON to `--out`.
"""
import argparse
import json
import os
import platform
import time


def run_preset(args, preset: str) -> dict:
  import jax
  import numpy as np
  from private_t5.models import config as config_lib
  from private_t5.models import network
  from private_t5.eval import memorization
  config = config_lib.load_preset(preset, vocab_size=args.vocab_size)
  params = network.init_params(config, jax.random.PRNGKey(0))
  num_params = int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
  cfg = memorization.ExtractionConfig(prompt_length=args.prompt_length,
                                      generation_length=args.generation_length,
                                      batch_size=args.batch_size).validate()
  inference = memorization.make_inference(params, config)
  rows = args.batch_size * args.batches
  inputs = np.zeros((rows, args.prompt_length + 1), np.int32)
  inputs[:, :args.prompt_length] = np.random.default_rng(0).integers(
      3, args.vocab_size, (rows, args.prompt_length))
  inputs[:, args.prompt_length] = memorization.EOS_ID
  t0 = time.time()
  first, _ = memorization.generate(params, config, inputs, args.generation_length, cfg, inference=inference)
  compile_call = time.time() - t0
  cpu0, t0 = time.process_time(), time.time()
  out, stats = memorization.generate(params, config, inputs, args.generation_length, cfg, inference=inference)
  wall, cpu = time.time() - t0, time.process_time() - cpu0
  assert (first == out).all()
  ended_early = int((memorization.generated_lengths(out) < args.generation_length).sum())
  tokens = stats.generated_tokens
  steady_rows, steady_seconds = rows - min(rows, cfg.batch_size), stats.seconds - stats.first_batch_seconds
  return {"preset": preset, "parameters": num_params, "vocab_size": args.vocab_size, "dtype": config.dtype,
          "devices": jax.device_count(), "batch_size": args.batch_size, "prompt_length": args.prompt_length,
          "generation_length": args.generation_length, "prompts": rows, "tokens": tokens,
          "compile_call_seconds": round(compile_call, 2), "wall_seconds": round(wall, 3),
          "cpu_seconds": round(cpu, 2), "prompts_per_second": round(rows / wall, 2),
          "tokens_per_second": round(tokens / wall, 1),
          "steady_tokens_per_second": round(stats.tokens_per_second, 1),
          "steady_prompts_per_second": round(steady_rows / steady_seconds, 2) if steady_rows and steady_seconds > 0
                                       else None,
          "rows_ended_early": ended_early}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", default="t5_1_0_tiny,t5_1_0_small")
  parser.add_argument("--vocab_size", type=int, default=32128)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--batches", type=int, default=4, help="batches in the timed call")
  parser.add_argument("--prompt_length", type=int, default=50)
  parser.add_argument("--generation_length", type=int, default=50)
  parser.add_argument("--out", default="/tmp/bench_extraction.json")
  args = parser.parse_args()
  import jax
  results = []
  for preset in [p for p in args.presets.split(",") if p]:
    result = run_preset(args, preset)
    print(json.dumps(result), flush=True)
    results.append(result)
  load = os.getloadavg()
  report = {"benchmark": "bench_extraction", "machine": platform.machine(), "cpus": os.cpu_count(),
            "backend": jax.default_backend(), "jax": jax.__version__,
            "load_average_1_5_15": [round(x, 2) for x in load], "results": results}
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
