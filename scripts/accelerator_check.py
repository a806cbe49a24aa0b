#!/usr/bin/env python
"""The accelerator check: non-DP against DP-ghost training steps on one device, in one process,
each phase timed and written down as it ends, within a time budget.

  python scripts/accelerator_check.py --out=runs/accelerator_check [--budget_s=450]
  python scripts/accelerator_check.py --smoke --out=/tmp/smoke     # CPU: tiny preset, seconds

(`scripts/accelerator_check.sh` installs the wheels a bare accelerator image lacks, then runs
this.) The cases run in priority order, until the budget is spent:

  1. T5 v1.1 small, 512/114, bfloat16: non-DP and DP-ghost at batch 32,
  2. the same at a large batch (--large_batch, 256),
  3. T5 v1.1 base at batch 32, non-DP and DP-ghost,
  4. a short `private-t5 train` run (DP-SentencePiece vocabulary, then DP-Adafactor, tiny T5),
  5. the sensitivity of the clipped sums on this device: removing one example moves the
     noiseless sum by at most C (vmap and ghost, float32 and bfloat16; tiny T5),
  6. the first preset at batch 32 and the large batch again with the attention as one fused
     `jax.nn.dot_product_attention` call (--attention_variants: cuDNN's kernel; `T5Config.attention`),
     non-DP and DP-ghost: the settings search for the best throughput,
  7. the largest batch whose compiled peak fits the device, non-DP and DP-ghost (only if time
     is left: compilations only).

Each case goes through build, init (trace, lower, compile, run), the train step's trace,
lower, compile, first step and steady steps; each phase appends one JSON line to
OUT/phases.jsonl (wall and CPU seconds, the program's size, memory, throughput, MFU) before the
next begins, and OUT/accelerator_check.md is rewritten from that file after every case. A
watchdog ends the process at the budget (exit 3) after writing the summary, so a run cut short
still says where its time went. JAX's persistent compilation cache (OUT/jax_cache, or
--cache_dir) makes a second run skip the compilations the first one finished.

MFU is the analytic training FLOPs (`train.step_profile.analytic_train_flops`) times the
sequences per second, over the device's dense bf16 peak (--peak_tflops, or the data-sheet value
for known devices).
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

NONDP, GHOST = "nondp", "ghost"
GIB = 2 ** 30


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "accelerator_check"))
  p.add_argument("--budget_s", type=float, default=450.0,
                 help="wall-clock budget of the whole check, start-up included (default 7.5 min)")
  p.add_argument("--smoke", action="store_true",
                 help="a CPU smoke run: tiny preset, 32/8 tokens, batches 4 and 8, 2 steps")
  p.add_argument("--presets", default="t5_1_1_small,t5_1_1_base",
                 help="first preset: batch 32 and the large batch; the others: batch 32 only")
  p.add_argument("--inputs", type=int, default=512)
  p.add_argument("--targets", type=int, default=114)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--large_batch", type=int, default=256, help="0: skip the large-batch cases")
  p.add_argument("--methods", default=f"{NONDP},{GHOST}")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--attention_variants", default="cudnn",
                 help="T5Config.attention values for the cases of step 6, comma-separated ('' to skip)")
  p.add_argument("--steps", type=int, default=8, help="steady steps timed per case")
  p.add_argument("--train_steps", type=int, default=60, help="steps of the short training run (0: skip)")
  p.add_argument("--max_batch", action="store_true", default=True)
  p.add_argument("--no_max_batch", dest="max_batch", action="store_false")
  p.add_argument("--compile_only", action="store_true",
                 help="stop each case after compiling its step (CPU measurements of program size and "
                      "compile time); no training run, no max-batch search")
  p.add_argument("--peak_tflops", type=float, default=None, help="device's dense bf16 peak, for MFU")
  p.add_argument("--cache_dir", default=None, help="JAX's persistent compilation cache (default OUT/jax_cache)")
  args = p.parse_args(argv)
  if args.smoke:
    args.presets, args.inputs, args.targets = "t5_1_1_tiny", 32, 8
    args.batch, args.large_batch, args.steps = 4, 8, 2
    args.train_steps = min(args.train_steps, 3)
    args.attention_variants = "xla" if args.attention_variants == "cudnn" else args.attention_variants
  return args


# --- the plan -------------------------------------------------------------------------------------

def plan(args):
  """[(preset, batch)] in priority order."""
  presets = [p for p in args.presets.split(",") if p]
  cases = [(presets[0], args.batch)]
  if args.large_batch:
    cases.append((presets[0], args.large_batch))
  cases += [(p, args.batch) for p in presets[1:]]
  return cases


def case_name(preset, inputs, targets, batch, method, attention=None):
  return f"{preset} {inputs}/{targets} b{batch} {method}" + (f" attention={attention}" if attention else "")


# --- one case -------------------------------------------------------------------------------------

def run_case(log, args, preset, batch_size, method, peak, attention=None):
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case as bench  # pylint: disable=g-import-not-at-top
  from private_t5.train import step_profile  # pylint: disable=g-import-not-at-top
  name = case_name(preset, args.inputs, args.targets, batch_size, method, attention)
  info = dict(preset=preset, inputs=args.inputs, targets=args.targets, batch=batch_size, method=method)
  if attention:
    info["attention"] = attention
  config, trainer = log.time(name, "build", lambda: bench.make_trainer(
      preset, method, batch_size, 1.0, 1.0, None, args.dtype, attention=attention), **info)
  rng = jax.random.PRNGKey(0)
  traced = log.time(name, "init_trace", lambda: trainer.trace_init(rng), **info)
  lowered = log.time(name, "init_lower", traced.lower, **info)
  compiled = log.time(name, "init_compile", lowered.compile, **info)
  state = log.time(name, "init_run", lambda: jax.block_until_ready(compiled(rng)), **info)
  batch = bench.random_batch(config.vocab_size, batch_size, args.inputs, args.targets, 0)
  keys = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))
  traced = log.time(name, "trace", lambda: trainer.trace_train_step(state, batch, *keys), **info)
  lowered = log.time(name, "lower", traced.lower,
                     stats=lambda low: step_profile.lowered_stats(low.as_text()), **info)

  def compiled_info(c):
    return dict(step_profile.compiled_stats(c.as_text()), memory=bench.compiled_memory(c))

  step = log.time(name, "compile", lowered.compile, stats=compiled_info, **info)
  if args.compile_only:
    return
  placed = trainer.place_batch(batch)
  run = lambda s: jax.block_until_ready(step(s, None, placed, *keys))
  state, _ = log.time(name, "first_step", lambda: run(state), **info)
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    state, metrics = run(state)
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  flops = step_profile.analytic_train_flops(config, args.inputs, args.targets) * batch_size
  log.write(dict(info, case=name, phase="steady", wall_s=round(sum(times), 4), step_times_s=times,
                 step_s=step_s, sequences_per_s=batch_size / step_s, analytic_flops_per_step=flops,
                 tflops_per_s=flops / step_s / 1e12, mfu=None if not peak else flops / step_s / peak,
                 loss=float(metrics["nondp/loss"])))


def run_sensitivity(log, args):
  """DP's one assumption about the implementation, checked on this device: removing one example
  moves the noiseless clipped sum by at most C (`dp.auditing.sensitivity_ratios`), for vmap and
  ghost clipping in float32 and bfloat16 activations (a matrix unit that rounds float32 operands,
  such as TF32, would show here as ratios above 1)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from private_t5.dp import auditing  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case as bench  # pylint: disable=g-import-not-at-top
  clip, rows = 1e-4, 8  # every example's gradient norm is far above C: each is clipped
  inputs, targets = (args.inputs, args.targets) if args.smoke else (64, 16)
  for dtype in ("float32", "bfloat16"):
    for method in (bench.VMAP, bench.GHOST):
      name = f"sensitivity t5_1_1_tiny {inputs}/{targets} b{rows} {method} {dtype}"

      def measure(dtype=dtype, method=method):
        _, trainer = bench.make_trainer("t5_1_1_tiny", method, rows, clip, 1.0, 0.0, dtype)
        params = trainer.init_state(jax.random.PRNGKey(0)).params
        batch = bench.random_batch(trainer.model_config.vocab_size, rows, inputs, targets, 0)
        fn = jax.jit(lambda b: trainer.aggregator.clipped_sum(params, b, None)[0])
        ratios = auditing.sensitivity_ratios(fn, batch, clip)
        return {"max_ratio": float(np.max(ratios)), "min_ratio": float(np.min(ratios)),
                "over_1e-5": int(np.sum(ratios > 1 + 1e-5))}

      log.time(name, "sensitivity", measure, stats=lambda r: r, method=method, dtype=dtype)


def run_max_batch(log, args, preset, method, budget_bytes):
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case as bench  # pylint: disable=g-import-not-at-top
  name = case_name(preset, args.inputs, args.targets, "max", method)
  _, trainer = bench.make_trainer(preset, method, args.batch, 1.0, 1.0, None, args.dtype)
  state = trainer.abstract_state()
  del jax
  log.time(name, "max_batch", lambda: bench.max_batch_search(
      trainer, state, (args.inputs, args.targets), args.batch, budget_bytes, 8192, 0.125, multiple=8),
      stats=lambda r: {"max_batch": r["max_batch"], "first_over_budget": r["first_over_budget"]},
      preset=preset, method=method, budget_gib=budget_bytes / GIB)


def run_training(log, args, out):
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  vocab = os.path.join(out, "train", "vocab", "dp_spm.model")
  model_dir = os.path.join(out, "train", "model")
  if not os.path.exists(vocab):
    log.time("train", "dp_spm", lambda: _check(cli.main([
        "dp-spm", "--gin_file=configs/runs/dp_spm.gin", "--corpus=builtin:python_docs",
        "--vocab_size=2000", f"--output={vocab}", "--target_epsilon=8", "--sensitivity=capped",
        "--max_words=64"])))
  log.time("train", "train", lambda: _check(cli.main([
      "train", "--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR='{model_dir}'",
      "--gin.CORPUS='builtin:python_docs'", f"--gin.VOCAB_PATH='{vocab}'",
      f"--gin.TRAIN_STEPS={args.train_steps}", "--gin.ACTIVATION_DTYPE='bfloat16'",
      "--gin.train.mesh_shape=(-1, 1)", "--gin.train.eval_every=0",
      "--gin.train.checkpoint_every=1000000"])),
      stats=lambda _: _train_summary(model_dir))


def _check(rc):
  if rc:
    raise RuntimeError(f"stage exited with {rc}")
  return rc


def _train_summary(model_dir):
  path = os.path.join(model_dir, "summary.json")
  if not os.path.exists(path):
    return {}
  s = json.load(open(path, encoding="utf-8"))
  return {k: s.get(k) for k in ("final_step", "steps_per_second", "epsilon", "training_epsilon", "delta")}


# --- the summary ----------------------------------------------------------------------------------

def summarize(records):
  """Markdown from the phase records (complete or cut short)."""
  head = next((r for r in records if r.get("phase") == "devices"), {})
  cases, order = {}, []
  for r in records:
    if ("case" not in r or r["case"] in ("train", "sensitivity") or r["case"].startswith("max batch")
        or r["phase"] in ("sensitivity", "max_batch")):
      continue
    if r["case"] not in cases:
      order.append(r["case"])
    cases.setdefault(r["case"], {})[r["phase"]] = r
  lines = [f"# Accelerator check: {head.get('count', '?')} x {head.get('kind', '?')} "
           f"({head.get('backend', '?')}, jax {head.get('jax', '?')})", "",
           "Seconds are wall time of each phase (`phases.jsonl` has CPU time too); "
           "to first step = build + init + trace + lower + compile + first step.", "",
           "| case | init compile s | trace s | lower s | compile s | first step s | to first step s "
           "| s/step | sequences/s | MFU | compiled peak GiB | lowered MB | largest constant | while loops "
           "| matmul shapes |", "|" + "---|" * 15]
  fmt = lambda v, spec=".2f": "–" if v is None else f"{v:{spec}}"
  for name in order:
    p = cases[name]
    get = lambda phase, key="wall_s": p.get(phase, {}).get(key)
    first = None
    if "first_step" in p:
      first = sum(get(ph) or 0 for ph in ("build", "init_trace", "init_lower", "init_compile", "init_run",
                                          "trace", "lower", "compile", "first_step"))
    mem = (p.get("compile", {}).get("memory") or {}).get("peak_bytes")
    lowered = get("lower", "lowered_bytes")
    const = get("lower", "largest_constant_bytes")
    lines.append(
        f"| {name} | {fmt(get('init_compile'), '.1f')} | {fmt(get('trace'), '.1f')} | {fmt(get('lower'), '.1f')} "
        f"| {fmt(get('compile'), '.1f')} | {fmt(get('first_step'), '.1f')} | {fmt(first, '.1f')} "
        f"| {fmt(get('steady', 'step_s'), '.4f')} | {fmt(get('steady', 'sequences_per_s'), '.1f')} "
        f"| {fmt(get('steady', 'mfu') and 100 * get('steady', 'mfu'), '.1f')}{'%' if get('steady', 'mfu') else ''} "
        f"| {fmt(mem and mem / GIB)} | {fmt(lowered and lowered / 1e6)} "
        f"| {'–' if const is None else f'{const / 2 ** 10:.1f} KiB'} | {fmt(get('compile', 'while_loops'), 'd')} "
        f"| {fmt(get('compile', 'distinct_matmul_shapes'), 'd')} |")
    if "error" in p:
      lines.append(f"| {name}: **{p['error'].get('error', '')[:200]}** |" + " |" * 14)
  ratios = []
  for name in order:
    if not name.endswith(f" {GHOST}"):
      continue
    base = cases.get(name[:-len(GHOST)] + NONDP, {})
    dp = cases[name]
    if "steady" in dp and "steady" in base:
      tput = dp["steady"]["sequences_per_s"] / base["steady"]["sequences_per_s"]
      t_first = lambda c: sum(c.get(ph, {}).get("wall_s") or 0 for ph in (
          "build", "init_trace", "init_lower", "init_compile", "init_run", "trace", "lower", "compile",
          "first_step"))
      ratios.append(f"| {name[:-len(GHOST)].strip()} | {tput:.2f} | {t_first(dp) / t_first(base):.2f} "
                    f"| {dp['compile']['wall_s'] / base['compile']['wall_s']:.2f} |")
  if ratios:
    lines += ["", "| case | DP-ghost ÷ non-DP throughput | time to first step × | compile time × |",
              "|---|---|---|---|"] + ratios
  other = [r for r in records if r.get("case") == "train"
           or r.get("phase") in ("sensitivity", "max_batch", "stopped", "error")]
  for r in other:
    lines.append("")
    lines.append(f"- {r.get('case', '')} {r['phase']}: " + ", ".join(
        f"{k}={v}" for k, v in sorted(r.items()) if k not in ("case", "phase", "time_utc")))
  return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------------------

def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  start = time.monotonic()
  deadline = start + args.budget_s
  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  os.chdir(ROOT)  # Gin files are named relative to the checkout
  phases_path = os.path.join(out, "phases.jsonl")
  if os.path.exists(phases_path):
    os.replace(phases_path, os.path.join(out, "phases.previous.jsonl"))
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_compilation_cache_dir", args.cache_dir or os.path.join(out, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  from private_t5.io import write_text_atomic  # pylint: disable=g-import-not-at-top
  from private_t5.train import step_profile  # pylint: disable=g-import-not-at-top
  log = step_profile.PhaseLog(phases_path)
  summary_path = os.path.join(out, "accelerator_check.md")
  lock = threading.Lock()

  def write_summary():
    with lock:
      write_text_atomic(summary_path, summarize(step_profile.read_phases(phases_path)))

  def stop():
    log.write({"phase": "stopped", "reason": f"budget of {args.budget_s:g} s spent",
               "elapsed_s": round(time.monotonic() - start, 1)}, last=True)
    write_summary()
    print(f"[accelerator] budget spent; partial results in {summary_path}", flush=True)
    os._exit(3)  # pylint: disable=protected-access

  watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), stop)
  watchdog.daemon = True
  watchdog.start()

  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  peak = args.peak_tflops * 1e12 if args.peak_tflops else step_profile.peak_flops(device.device_kind)
  log.write({"phase": "devices", "backend": jax.default_backend(), "jax": jax.__version__,
             "count": jax.device_count(), "kind": device.device_kind, "bytes_limit": stats.get("bytes_limit"),
             "peak_flops": peak, "startup_s": round(time.monotonic() - start, 2)})
  methods = [m for m in args.methods.split(",") if m]
  left = lambda: deadline - time.monotonic()

  def cases(preset_batches, attention=None):
    for preset, batch in preset_batches:
      for method in methods:
        name = case_name(preset, args.inputs, args.targets, batch, method, attention)
        print(f"[accelerator] {name} ({left():.0f} s left)", flush=True)
        try:
          run_case(log, args, preset, batch, method, peak, attention)
        except Exception as e:  # pylint: disable=broad-except
          # An out-of-memory batch or a failed compilation ends this case, not the check.
          log.write({"case": name, "phase": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                     "traceback": traceback.format_exc()[-4000:]})
        write_summary()

  cases(plan(args))
  if args.train_steps and not args.compile_only:
    print(f"[accelerator] short DP training ({left():.0f} s left)", flush=True)
    try:
      run_training(log, args, out)
    except Exception as e:  # pylint: disable=broad-except
      log.write({"case": "train", "phase": "error", "error": f"{type(e).__name__}: {e}"[:2000]})
    write_summary()
  if not args.compile_only:
    print(f"[accelerator] sensitivity of the clipped sums ({left():.0f} s left)", flush=True)
    try:
      run_sensitivity(log, args)
    except Exception as e:  # pylint: disable=broad-except
      log.write({"case": "sensitivity", "phase": "error", "error": f"{type(e).__name__}: {e}"[:2000]})
    write_summary()
  first = plan(args)[0][0]
  large = [(first, args.large_batch)] if args.large_batch and not args.smoke else []  # smoke: one batch
  for attention in [a for a in args.attention_variants.split(",") if a]:
    cases([(first, args.batch)] + large, attention)
  budget_bytes = stats.get("bytes_limit")
  if args.max_batch and budget_bytes and not args.compile_only:
    for method in methods:
      print(f"[accelerator] max batch, {method} ({left():.0f} s left)", flush=True)
      try:
        run_max_batch(log, args, plan(args)[0][0], method, int(0.95 * budget_bytes))
      except Exception as e:  # pylint: disable=broad-except
        log.write({"case": f"max batch {method}", "phase": "error", "error": f"{type(e).__name__}: {e}"[:2000]})
      write_summary()
  watchdog.cancel()
  log.write({"phase": "done", "elapsed_s": round(time.monotonic() - start, 1)})
  write_summary()
  print(open(summary_path, encoding="utf-8").read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
