"""DP training step vs non-DP training step, side by side in one run.

  .venv/bin/python scripts/bench_dp.py --output /tmp/bench_dp.json
  .venv/bin/python scripts/bench_dp.py --cases t5_1_0_tiny:128/32:32 --steps 3 --output x.json

For each case `PRESET:INPUTS/TARGETS:BATCH[:DP_MICROBATCH]` it compiles two train steps with the
same batch: non-DP (`MeanAggregator` + Adafactor) and DP-Adafactor (`DPAggregator`: per-example
gradients, clip, sum, noise, divide by q N; then the same Adafactor), and reports

* seconds per step (median of `--steps` timed steps after one warm-up) and the DP / non-DP
  time ratio (throughput ratio = its inverse);
* peak device memory of each compiled step from XLA's memory analysis (arguments + outputs +
  temporaries - donated aliases) and the DP / non-DP ratio;
* the largest batch (without microbatching: all per-example gradients of the batch at once for
  DP) whose compiled step fits in `--memory_budget_gib` (20 GiB), found from the compiled
  memory analysis only: the step is compiled at several batch sizes, never run.

Token ids are random (timing and memory do not depend on the text); dropout is on as in
training. Prints a Markdown table and writes JSON (atomically) to --output. On a shared CPU
the timings are noisy: compare the ratios, not the absolute seconds.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top

from private_t5.dp.aggregator import DPAggregator, MeanAggregator  # pylint: disable=g-import-not-at-top
from private_t5.models import example_loss_fn, init_params, load_preset, num_params  # pylint: disable=g-import-not-at-top
from private_t5.train.optimizers import adafactor  # pylint: disable=g-import-not-at-top

DEFAULT_CASES = ("t5_1_0_tiny:128/32:32", "t5_1_0_tiny:512/114:8",
                 "t5_1_0_small:128/32:32:8", "t5_1_0_small:512/114:8")
GIB = 1024 ** 3


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def parse_case(text: str) -> dict:
  """'t5_1_0_small:512/114:8[:4]' -> preset, lengths, batch, microbatch."""
  parts = text.split(":")
  if len(parts) not in (3, 4):
    raise SystemExit(f"bad --cases entry {text!r}: expected PRESET:INPUTS/TARGETS:BATCH[:MICROBATCH]")
  inputs, targets = (int(x) for x in parts[1].split("/"))
  micro = int(parts[3]) if len(parts) == 4 else None
  return dict(preset=parts[0], inputs=inputs, targets=targets, batch=int(parts[2]),
              microbatch=micro)


def random_batch(rng, vocab, batch, inputs, targets):
  enc = rng.integers(3, vocab, size=(batch, inputs), dtype=np.int32)
  tgt = rng.integers(3, vocab, size=(batch, targets), dtype=np.int32)
  tgt[:, -1] = 1  # EOS
  dec = np.concatenate([np.zeros((batch, 1), np.int32), tgt[:, :-1]], axis=1)
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=tgt,
              decoder_loss_weights=np.ones((batch, targets), np.float32),
              example_weight=np.ones(batch, np.float32))


def make_step(aggregator, optimizer):
  """(params, opt_state, batch, dropout_rng, noise_rng) -> (params, opt_state, metrics)."""
  def step(params, opt_state, batch, dropout_rng, noise_rng):
    grads, metrics = aggregator(params, batch, dropout_rng=dropout_rng, noise_rng=noise_rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics
  return jax.jit(step, donate_argnums=(0, 1))


def peak_bytes(compiled) -> int:
  """Arguments + outputs + temporaries - aliased (donated) bytes, from XLA's analysis."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def abstract_inputs(params, opt_state, batch):
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  key = jax.ShapeDtypeStruct((2,), np.uint32)
  return (jax.tree.map(spec, params), jax.tree.map(spec, opt_state), jax.tree.map(spec, batch),
          key, key)


def compiled_peak(step, params, opt_state, config, case, batch_size) -> int:
  batch = random_batch(np.random.default_rng(0), config.vocab_size, batch_size, case["inputs"],
                       case["targets"])
  return peak_bytes(step.lower(*abstract_inputs(params, opt_state, batch)).compile())


def largest_batch(make, params, opt_state, config, case, budget_bytes, known, max_batch,
                  verify) -> dict:
  """Largest B whose compiled step (no microbatching) fits in `budget_bytes`; compile only.

  Peak memory is affine in B for a fixed program: `known` ({B: bytes}, from the timed compile)
  plus one compile at 2B give the line and its prediction B*. With `verify`, B* and B* + 1 are
  compiled (corrected once along the line if the prediction is off): B* fits, B* + 1 does not.
  """
  cache = dict(known)

  def peak(b):
    if b not in cache:
      t = time.perf_counter()
      cache[b] = compiled_peak(make(b), params, opt_state, config, case, b)
      _log(f"    B={b}: {cache[b] / GIB:.3f} GiB (compiled in {time.perf_counter() - t:.0f}s)")
    return cache[b]

  (b1, p1), = known.items()
  b2 = 2 * b1
  slope = max((peak(b2) - p1) / (b2 - b1), 1.0)
  predict = lambda b0, p0, s: int(max(1, min(max_batch, b0 + (budget_bytes - p0) // s)))
  best = predict(b1, p1, slope)
  verified = False
  if verify:
    for _ in range(2):
      fits, next_fits = peak(best) <= budget_bytes, peak(best + 1) <= budget_bytes
      if fits and not next_fits:
        verified = True
        break
      slope = max((cache[best] - p1) / (best - b1), 1.0) if best != b1 else slope
      best = predict(best, cache[best], slope) - (0 if fits else 1)
  return dict(largest_batch=best, verified=verified, budget_gib=budget_bytes / GIB,
              fit_bytes_per_example=slope, fit_fixed_bytes=p1 - slope * b1,
              compiled_peaks_gib={str(k): v / GIB for k, v in sorted(cache.items())})


def time_step(step, params, opt_state, batch, steps):
  dropout = jax.random.PRNGKey(1)
  noise = jax.random.PRNGKey(2)
  params, opt_state, metrics = step(params, opt_state, batch, dropout, noise)  # warm-up
  jax.block_until_ready(metrics)
  times = []
  for i in range(steps):
    t = time.perf_counter()
    params, opt_state, metrics = step(params, opt_state, batch, jax.random.fold_in(dropout, i),
                                      jax.random.fold_in(noise, i))
    jax.block_until_ready((params, metrics))
    times.append(time.perf_counter() - t)
  return statistics.median(times), times


def bench_case(case, steps, budget_bytes, search, max_batch, verify, max_run_bytes) -> dict:
  config = load_preset(case["preset"])
  loss_fn = lambda p, b, k: example_loss_fn(p, b, config, dropout_rng=k)
  optimizer = adafactor(learning_rate=1e-3)
  batch = random_batch(np.random.default_rng(0), config.vocab_size, case["batch"], case["inputs"],
                       case["targets"])
  result = dict(case, num_params=num_params(config), device=jax.devices()[0].device_kind,
                clip_norm=1.0, noise_multiplier=1.0)
  makers = {
      "nondp": lambda mb: make_step(MeanAggregator(loss_fn, microbatch_size=mb), optimizer),
      "dp": lambda mb: make_step(DPAggregator(loss_fn, clip_norm=1.0, noise_multiplier=1.0,
                                              expected_batch_size=float(case["batch"]),
                                              microbatch_size=mb), optimizer),
  }
  for name, make in makers.items():
    params = init_params(config, jax.random.PRNGKey(0))
    opt_state = optimizer.init(params)
    micro = case["microbatch"] if name == "dp" else None  # the DP memory knob only
    step = make(micro)
    t = time.perf_counter()
    compiled = step.lower(*abstract_inputs(params, opt_state, batch)).compile()
    compile_s = time.perf_counter() - t
    peak = peak_bytes(compiled)
    # Shapes for the compile-only search (timing donates the arrays themselves).
    param_spec, opt_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                        (params, opt_state))
    _log(f"[{case['preset']} {case['inputs']}/{case['targets']} B={case['batch']}] {name}: "
         f"compiled in {compile_s:.1f}s, peak {peak / GIB:.3f} GiB")
    entry = dict(compile_s=compile_s, peak_bytes=peak, seconds_per_step=None, step_times=[])
    if peak <= max_run_bytes:
      median, times = time_step(step, params, opt_state, batch, steps)
      _log(f"    {name}: {median:.3f} s/step ({', '.join(f'{x:.3f}' for x in times)})")
      entry.update(seconds_per_step=median, step_times=times)
    else:
      _log(f"    {name}: not run: needs {peak / GIB:.1f} GiB > --max_run_gib")
    if search:
      _log(f"  largest {name} batch in {budget_bytes / GIB:.0f} GiB (compile only):")
      # The timed compile is the first point of the line when it is not microbatched.
      known = {case["batch"]: peak} if micro in (None, case["batch"]) else {
          case["batch"]: compiled_peak(make(None), param_spec, opt_spec, config, case,
                                       case["batch"])}
      entry["fit"] = largest_batch(lambda b: make(None), param_spec, opt_spec, config, case,
                                   budget_bytes, known, max_batch, verify)
    result[name] = entry
  if result["dp"]["seconds_per_step"] and result["nondp"]["seconds_per_step"]:
    result["time_ratio"] = result["dp"]["seconds_per_step"] / result["nondp"]["seconds_per_step"]
    result["throughput_ratio"] = 1.0 / result["time_ratio"]
  result["memory_ratio"] = result["dp"]["peak_bytes"] / result["nondp"]["peak_bytes"]
  return result


def num(value, fmt, suffix="") -> str:
  return "-" if value is None else f"{value:{fmt}}{suffix}"


def markdown(results) -> str:
  lines = ["| model | in/out | batch | DP microbatch | non-DP s/step | DP s/step | DP/non-DP time | "
           "DP throughput | non-DP peak GiB | DP peak GiB | memory ratio | max batch non-DP | "
           "max batch DP |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    def fit(name):
      found = r[name].get("fit")
      if not found:
        return "-"
      return f"{found['largest_batch']}{'' if found['verified'] else ' (fit)'}"

    lines.append(
        f"| {r['preset']} | {r['inputs']}/{r['targets']} | {r['batch']} | "
        f"{r['microbatch'] or r['batch']} | {num(r['nondp']['seconds_per_step'], '.3f')} | "
        f"{num(r['dp']['seconds_per_step'], '.3f')} | {num(r.get('time_ratio'), '.2f', 'x')} | "
        f"{num(r.get('throughput_ratio'), '.2f', 'x')} | {r['nondp']['peak_bytes'] / GIB:.3f} | "
        f"{r['dp']['peak_bytes'] / GIB:.3f} | {r['memory_ratio']:.2f}x | {fit('nondp')} | "
        f"{fit('dp')} |")
  return "\n".join(lines)


def available_gib() -> float:
  """MemAvailable from /proc/meminfo (GiB); a large number where it cannot be read."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) / 1024 ** 2
  except OSError:
    pass
  return float("inf")


def write_report(results, path) -> str:
  """Writes the JSON report atomically; returns the Markdown table."""
  table = markdown(results)
  report = dict(
      results=results, markdown=table, backend=jax.default_backend(), host=platform.node(),
      cpu_count=os.cpu_count(), jax_version=jax.__version__,
      note=("DP = per-example clip (C=1) + sum + Gaussian noise (sigma=1) + divide by q N, then "
            "the same Adafactor; peak memory from XLA's compiled memory analysis; timings on a "
            "shared machine are noisy."))
  out_dir = os.path.dirname(os.path.abspath(path))
  os.makedirs(out_dir, exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=2)
  os.replace(tmp, path)
  return table


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                      help="PRESET:INPUTS/TARGETS:BATCH[:MICROBATCH] entries")
  parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after 1 warm-up)")
  parser.add_argument("--memory_budget_gib", type=float, default=20.0)
  parser.add_argument("--no_search", action="store_true", help="skip the largest-batch search")
  parser.add_argument("--no_verify", action="store_true",
                      help="trust the affine fit of peak memory in B (skip the check compiles)")
  parser.add_argument("--max_batch", type=int, default=1 << 16)
  parser.add_argument("--max_run_gib", type=float, default=None,
                      help="only time steps whose compiled peak is below this (default: 60%% "
                           "of the memory available now)")
  parser.add_argument("--output", required=True, help="JSON file to write")
  args = parser.parse_args(argv)

  max_run_gib = args.max_run_gib if args.max_run_gib is not None else 0.6 * available_gib()
  results = []
  for text in args.cases:
    results.append(bench_case(parse_case(text), args.steps, args.memory_budget_gib * GIB,
                              not args.no_search, args.max_batch, not args.no_verify,
                              max_run_gib * GIB))
    table = write_report(results, args.output)  # after every case: partial results survive
  print(table)
  _log(f"wrote {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
