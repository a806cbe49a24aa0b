#!/usr/bin/env python
"""The accelerator check: non-DP against DP-ghost training steps on one device, in one process,
each phase timed and written down as it ends, within a time budget.

  python benchmarks/accelerator_check.py --out=runs/accelerator_check [--budget_s=450]
  python benchmarks/accelerator_check.py --smoke --out=/tmp/smoke     # CPU: tiny preset, seconds

(`benchmarks/accelerator_check.sh` installs the wheels a bare accelerator image lacks, then runs
this.) The cases run in priority order, until the budget is spent:

  1. T5 v1.1 small, 512/114, bfloat16: non-DP and DP-ghost at batch 32,
  2. the same at a large batch (--large_batch, 256),
  3. T5 v1.1 base at batch 32, non-DP and DP-ghost,
  4. a short `private-t5 train` run (DP-SentencePiece vocabulary, then DP-Adafactor, tiny T5),
  5. the sensitivity of the clipped sums on this device: removing one example moves the
     noiseless sum by at most C (vmap and ghost, float32 and bfloat16; tiny T5),
  6. the first preset at batch 32 and the large batch again with the attention as one fused
     `jax.nn.dot_product_attention` call (--attention_variants: cuDNN's kernel on a GPU, XLA's
     elsewhere; `T5Config.attention`), non-DP and DP-ghost: the settings search for the best throughput,
  7. the largest batch whose compiled peak fits the device, non-DP and DP-ghost (only if time
     is left: compilations only).

Each case goes through build, init (trace, lower, compile, run), the train step's trace,
lower, compile, first step and steady steps (then, for the first preset at batch 32, a
`jax.profiler` trace of --profile_steps steps: device time by HLO op and by kind of op, the
DP-ghost step's extra over non-DP in the summary, the traces under OUT/profiles); each phase appends one JSON line to
OUT/phases.jsonl (wall and CPU seconds, the program's size, memory, throughput, MFU) before the
next begins, and OUT/accelerator_check.md is rewritten from that file after every case. A
watchdog ends the process at the budget (exit 3) after writing the summary, so a run cut short
still says where its time went. A case that fails (out of memory, say) is written down and
the next one runs; the check then exits 1 after writing the summary. JAX's persistent
compilation cache (OUT/jax_cache, or --cache_dir) makes a second run skip the compilations the
first one finished.

Every flag is checked before anything is written (a bad value: one error line, exit 2), the
preset, dtype and attention variants together included. --smoke only changes the defaults:
--presets, --inputs, --targets, --batch, --large_batch, --steps and --train_steps given
explicitly keep their values.

MFU is the analytic training FLOPs (`train.step_profile.analytic_train_flops`) times the
sequences per second, over the device's dense bf16 peak (--peak_tflops, or the data-sheet value
for known devices).
"""
import argparse
import json
import math
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


# The flags --smoke sets, and their values without it; a flag given explicitly keeps its value.
DEFAULTS = dict(presets=["t5_1_1_small", "t5_1_1_base"], inputs=512, targets=114, batch=32, large_batch=256,
                steps=8, train_steps=60)
SMOKE = dict(presets=["t5_1_1_tiny"], inputs=32, targets=8, batch=4, large_batch=8, steps=2, train_steps=3)


class _Parser(argparse.ArgumentParser):
  """An argparse parser whose errors are one line on stderr (exit status 2), without the usage."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(low):
  def parse(text):
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
    if value < low:
      raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
    return value
  return parse


def _positive_float(text):
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
  if not math.isfinite(value) or value <= 0:
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
  return value


def _names(valid, allow_empty):
  """A comma-separated list of names out of `valid`."""
  def parse(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names and not allow_empty:
      raise argparse.ArgumentTypeError(f"must name at least one of {', '.join(valid)}")
    unknown = [n for n in names if n not in valid]
    if unknown:
      raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    return names
  return parse


def _check_folder(parser, flag, path):
  """One-line error unless files can be written in the folder `path` (created later, if missing)."""
  from private_t5.io import check_writable_file  # pylint: disable=g-import-not-at-top
  try:
    check_writable_file(os.path.join(os.path.abspath(path), "phases.jsonl"))
  except OSError as e:
    where = f" ({e.filename})" if e.filename and os.path.abspath(e.filename) != os.path.abspath(path) else ""
    parser.error(f"argument {flag}: {path!r} cannot be written: {e.strerror or e}{where}")


def parse_args(argv):
  from private_t5.experiments.benchmark_case import METHODS  # pylint: disable=g-import-not-at-top
  from private_t5.models import config as model_config  # pylint: disable=g-import-not-at-top
  presets = sorted(model_config.PRESETS)
  p = _Parser(prog=os.path.basename(__file__), description=__doc__.splitlines()[0],
              epilog="Every flag is checked before any work: a bad value is one error line, exit status 2. "
                     "Exit status: 0 when every case ran, 1 when a case failed (the summary says which), "
                     "3 when the budget ran out.")
  p.add_argument("--out", default=os.path.join(ROOT, "runs", "accelerator_check"),
                 help="folder of phases.jsonl and accelerator_check.md (created; must be writable)")
  p.add_argument("--budget_s", type=_positive_float, default=450.0,
                 help="wall-clock budget of the whole check in seconds, start-up included (default 7.5 min)")
  p.add_argument("--smoke", action="store_true",
                 help="a CPU smoke run: the defaults become tiny preset, 32/8 tokens, batches 4 and 8, 2 steps, "
                      "3 training steps; --presets, --inputs, --targets, --batch, --large_batch, --steps and "
                      "--train_steps given explicitly keep their values")
  p.add_argument("--presets", type=_names(presets, allow_empty=False), default=None,
                 help="comma-separated model presets (default t5_1_1_small,t5_1_1_base): the first at batch 32 "
                      "and the large batch, the others at batch 32 only")
  p.add_argument("--inputs", type=_int_at_least(1), default=None, help="input tokens per sequence (default 512)")
  p.add_argument("--targets", type=_int_at_least(1), default=None, help="target tokens per sequence (default 114)")
  p.add_argument("--batch", type=_int_at_least(1), default=None, help="batch size (default 32)")
  p.add_argument("--large_batch", type=_int_at_least(0), default=None,
                 help="the large batch size (default 256; 0: skip the large-batch cases)")
  p.add_argument("--methods", type=_names(METHODS, allow_empty=False), default=[NONDP, GHOST],
                 help=f"comma-separated train-step methods, of {', '.join(METHODS)} (default {NONDP},{GHOST})")
  p.add_argument("--dtype", choices=model_config.DTYPES, default="bfloat16", help="activation dtype (T5Config.dtype)")
  p.add_argument("--attention_variants", type=_names(model_config.ATTENTION_IMPLEMENTATIONS, allow_empty=True),
                 default=None,
                 help="T5Config.attention values for the cases of step 6, comma-separated ('' to skip; default "
                      "cudnn on a GPU, xla elsewhere, when the first preset can run it); cudnn needs a GPU")
  p.add_argument("--steps", type=_int_at_least(1), default=None, help="steady steps timed per case (default 8)")
  p.add_argument("--train_steps", type=_int_at_least(0), default=None,
                 help="steps of the short training run (default 60; 0: skip)")
  p.add_argument("--no_sensitivity", dest="sensitivity", action="store_false",
                 help="skip the sensitivity of the clipped sums (step 5)")
  p.add_argument("--max_batch", action="store_true", default=True,
                 help="search the largest batch that fits the device's memory, if time is left (default)")
  p.add_argument("--no_max_batch", dest="max_batch", action="store_false", help="no max-batch search")
  p.add_argument("--profile_steps", type=_int_at_least(0), default=3,
                 help="steps traced with jax.profiler after the first case's steady steps, non-DP and DP-ghost "
                      "alike: device time by HLO op and kind of op, in the summary (default 3; 0: no profile)")
  p.add_argument("--compile_only", action="store_true",
                 help="stop each case after compiling its step (CPU measurements of program size and "
                      "compile time); no training run, no max-batch search")
  p.add_argument("--peak_tflops", type=_positive_float, default=None, help="device's dense bf16 peak, for MFU")
  p.add_argument("--cache_dir", default=None, help="JAX's persistent compilation cache (default OUT/jax_cache)")
  args = p.parse_args(argv)
  for name, value in (SMOKE if args.smoke else DEFAULTS).items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  _check_folder(p, "--out", args.out)
  if args.cache_dir is not None:
    _check_folder(p, "--cache_dir", args.cache_dir)
  return args


def check_configs(args, backend, memory_bytes=0):
  """ConfigError (one line) for a preset and dtype that do not go together, an attention variant
  of --attention_variants that the first preset or this backend cannot run, or a case that cannot
  fit the device's `memory_bytes` (one array of its step alone is larger:
  `benchmark_case.step_memory_floor`). Without --attention_variants: cudnn on a GPU, xla
  elsewhere, if the first preset can run it (the fused call has no attention dropout), else none."""
  from private_t5.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case as bench  # pylint: disable=g-import-not-at-top
  from private_t5.models import config as model_config  # pylint: disable=g-import-not-at-top
  from private_t5.train.main import check_attention_backend  # pylint: disable=g-import-not-at-top
  for preset in args.presets:
    model_config.load_preset(preset, dtype=args.dtype)

  def check(attention):
    check_attention_backend(model_config.load_preset(args.presets[0], dtype=args.dtype, attention=attention))

  if args.attention_variants is None:
    args.attention_variants = []
    try:
      check("cudnn" if backend == "gpu" else "xla")
      args.attention_variants = ["cudnn" if backend == "gpu" else "xla"]
    except ConfigError:
      pass
  for attention in args.attention_variants:
    try:
      check(attention)
    except ConfigError as e:
      raise ConfigError(f"argument --attention_variants: {e}") from None
  if not memory_bytes:
    return
  for preset, batch in plan(args):
    config = model_config.load_preset(preset, dtype=args.dtype)
    for method in args.methods:
      floor, what = bench.step_memory_floor(config, args.inputs, args.targets, batch, method)
      if floor > memory_bytes:
        alone = bench.step_memory_floor(config, args.inputs, args.targets, 1, method)[0] > memory_bytes
        flag = "--inputs/--targets" if alone else "--batch" if batch == args.batch else "--large_batch"
        raise ConfigError(f"argument {flag}: {preset} {method} at {args.inputs}/{args.targets} tokens, batch {batch}, "
                          f"cannot fit in the device's memory ({memory_bytes / GIB:,.1f} GiB): one array of its "
                          f"step, the {what}, is {floor / GIB:,.1f} GiB")


# --- the plan -------------------------------------------------------------------------------------

def plan(args):
  """[(preset, batch)] in priority order."""
  presets = args.presets
  cases = [(presets[0], args.batch)]
  if args.large_batch:
    cases.append((presets[0], args.large_batch))
  cases += [(p, args.batch) for p in presets[1:]]
  return cases


def case_name(preset, inputs, targets, batch, method, attention=None):
  return f"{preset} {inputs}/{targets} b{batch} {method}" + (f" attention={attention}" if attention else "")


# --- one case -------------------------------------------------------------------------------------

def run_case(log, args, preset, batch_size, method, peak, attention=None, profile_dir=None):
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
  if profile_dir and args.profile_steps:
    from private_t5.train import kernel_profile  # pylint: disable=g-import-not-at-top
    holder = [state]

    def one_step():
      holder[0], _ = run(holder[0])

    log.time(name, "profile", lambda: kernel_profile.profile_steps(
        one_step, args.profile_steps, os.path.join(profile_dir, name.replace(" ", "_").replace("/", "-"))),
             stats=lambda r: r, **info)


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
  lines += profile_lines(records)
  other = [r for r in records if r.get("case") == "train"
           or r.get("phase") in ("sensitivity", "max_batch", "stopped", "error")]
  for r in other:
    lines.append("")
    lines.append(f"- {r.get('case', '')} {r['phase']}: " + ", ".join(
        f"{k}={v}" for k, v in sorted(r.items()) if k not in ("case", "phase", "time_utc")))
  return "\n".join(lines) + "\n"


def profile_lines(records):
  """Markdown of the profiled cases: device ms per step by kind of op (and DP-ghost's extra over
  non-DP), then each case's costliest ops."""
  profiles = [r for r in records if r.get("phase") == "profile" and "by_kind" in r]
  if not profiles:
    return []
  kinds = sorted({k for r in profiles for k in r["by_kind"]}, key=lambda k: -max(r["by_kind"].get(k, 0) for r in profiles))
  lines = ["", f"Device time by kind of op, ms per step (`jax.profiler`, {profiles[0]['steps']} steps; traces under "
               "OUT/profiles):", "", "| case | all | " + " | ".join(kinds) + " |", "|" + "---|" * (len(kinds) + 2)]
  row = lambda name, total, by: (f"| {name} | {total:.2f} | " + " | ".join(f"{by.get(k, 0):.2f}" for k in kinds) + " |")
  named = {r["case"]: r for r in profiles}
  for r in profiles:
    lines.append(row(r["case"], r["ms_per_step"], r["by_kind"]))
    base = named.get(r["case"][:-len(GHOST)] + NONDP) if r["case"].endswith(f" {GHOST}") else None
    if base:
      extra = {k: r["by_kind"].get(k, 0) - base["by_kind"].get(k, 0) for k in kinds}
      lines.append(row("DP-ghost − non-DP", r["ms_per_step"] - base["ms_per_step"], extra))
  for r in profiles:
    lines += ["", f"Costliest ops of {r['case']} (ms per step): " + ", ".join(
        f"`{op}` ({kind}) {ms:.2f}" for op, kind, ms in r["top_ops"])]
  return lines


# --- main -----------------------------------------------------------------------------------------

def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  start = time.monotonic()
  deadline = start + args.budget_s
  out = os.path.abspath(args.out)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from private_t5.experiments.benchmark_case import machine_memory_bytes  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  try:  # before anything is written
    check_configs(args, jax.default_backend(), stats.get("bytes_limit") or machine_memory_bytes())
  except ConfigError as e:
    print(f"{os.path.basename(__file__)}: error: {e}", file=sys.stderr)
    return 2
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(args.cache_dir or os.path.join(out, "jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  os.makedirs(out, exist_ok=True)
  os.chdir(ROOT)  # Gin files are named relative to the checkout
  phases_path = os.path.join(out, "phases.jsonl")
  if os.path.exists(phases_path):
    os.replace(phases_path, os.path.join(out, "phases.previous.jsonl"))
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

  peak = args.peak_tflops * 1e12 if args.peak_tflops else step_profile.peak_flops(device.device_kind)
  log.write({"phase": "devices", "backend": jax.default_backend(), "jax": jax.__version__,
             "count": jax.device_count(), "kind": device.device_kind, "bytes_limit": stats.get("bytes_limit"),
             "peak_flops": peak, "startup_s": round(time.monotonic() - start, 2)})
  methods = args.methods
  left = lambda: deadline - time.monotonic()

  def cases(preset_batches, attention=None):
    for index, (preset, batch) in enumerate(preset_batches):
      for method in methods:
        name = case_name(preset, args.inputs, args.targets, batch, method, attention)
        print(f"[accelerator] {name} ({left():.0f} s left)", flush=True)
        profile_dir = os.path.join(out, "profiles") if index == 0 and attention is None else None
        try:
          run_case(log, args, preset, batch, method, peak, attention, profile_dir)
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
  if args.sensitivity and not args.compile_only:
    print(f"[accelerator] sensitivity of the clipped sums ({left():.0f} s left)", flush=True)
    try:
      run_sensitivity(log, args)
    except Exception as e:  # pylint: disable=broad-except
      log.write({"case": "sensitivity", "phase": "error", "error": f"{type(e).__name__}: {e}"[:2000]})
    write_summary()
  first = plan(args)[0][0]
  large = [(first, args.large_batch)] if args.large_batch and not args.smoke else []  # smoke: one batch
  for attention in args.attention_variants:
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
  failed = [r.get("case", "?") for r in step_profile.read_phases(phases_path) if r.get("phase") == "error"]
  if failed:
    print(f"[accelerator] {len(failed)} case(s) failed ({'; '.join(failed)}): see {summary_path}",
          file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
