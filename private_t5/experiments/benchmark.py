"""Non-DP, DP-vmap and DP-ghost training steps measured side by side: the suite and its report.

For every model preset and (inputs, targets, batch) shape, each method's full train step
(gradient aggregation + Adafactor, `train.trainer.Trainer`) runs in a fresh process so that
its peak RSS is its own (`experiments.benchmark_case.run_case`). Per method it records:

* compile time of the step (`jit(...).lower(...).compile()`),
* time per step (median over the timed steps, after warm-up), examples/s, and the process
  CPU time per step (all threads; on a shared machine it measures the work, not the wait),
* peak memory: XLA's compiled `memory_analysis()` (arguments + outputs + temporaries -
  aliased) and the process's peak RSS,
* XLA's FLOP estimate of the step (`cost_analysis()`),
* optionally, the largest batch whose compiled peak memory fits a budget (binary search over
  compilations only; nothing is run).

Results go to OUTPUT_DIR/bench.json and OUTPUT_DIR/bench.md; the headline is the ratio of
each DP method to the non-DP step measured in the same run (these machines are noisy). With
`dtypes` (e.g. ["float32", "bfloat16"]) every case runs once per activation dtype and the
report adds each dtype's ratio to the float32 step of the same method. For the ghost step the
Markdown also breaks down the per-layer cost of the norm computation.
"""
import concurrent.futures
import json
import logging
import multiprocessing
import os
import platform
import time
from typing import Any, Dict, List, Optional, Sequence

import jax

from private_t5 import checks
from private_t5.dp.privacy_params import NoisySum
from private_t5.errors import ConfigError
from private_t5.experiments.benchmark_case import (GHOST, GIB, METHODS, NONDP, VMAP, machine_memory_bytes,
                                                   run_case, step_memory_floor)
from private_t5.io import check_output_file, write_text_atomic
from private_t5.models import config as model_config

logger = logging.getLogger(__name__)


def _log(message: str) -> None:
  logger.info("%s", message)


def _child_logging(level: int) -> None:
  """The spawned case process logs its progress to stderr at the parent's level."""
  logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                      datefmt="%H:%M:%S")


def _run_isolated(case: Dict[str, Any]) -> Dict[str, Any]:
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_child_logging,
                                              initargs=(logging.getLogger().getEffectiveLevel(),)) as pool:
    return pool.submit(run_case, case).result()


# --- the suite -----------------------------------------------------------------------------------

MAX_TOKENS = 2 ** 31  # batch_size * (inputs + targets) above this is no benchmark any machine runs


def _check_inputs(shapes, output_dir: str, clip_norm, noise_multiplier, steps, warmup, microbatch_size) -> List[tuple]:
  """The (inputs, targets, batch_size) triples as ints; ConfigError for a bad input, before any work."""
  for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0), ("microbatch_size", microbatch_size, 1)):
    if not (value is None and name == "microbatch_size") and (not checks.is_integer(value) or value < low):
      raise ConfigError(f"benchmark.{name} must be an integer >= {low}, got {value!r}")
  if not isinstance(shapes, (list, tuple)) or not shapes:
    raise ConfigError(f"benchmark.shapes must be a non-empty list of (inputs, targets, batch_size), got {shapes!r}")
  for shape in shapes:
    if (not isinstance(shape, (list, tuple)) or len(shape) != 3
        or any(not checks.is_integer(s) or s < 1 for s in shape)):
      raise ConfigError(f"benchmark.shapes entries must be (inputs, targets, batch_size) of integers >= 1, "
                        f"got {shape!r}")
    if shape[2] * (shape[0] + shape[1]) > MAX_TOKENS:
      raise ConfigError(f"benchmark.shapes entry {tuple(shape)} is {shape[2] * (shape[0] + shape[1]):,} tokens "
                        f"per step; the most a benchmark takes is {MAX_TOKENS:,}")
    if microbatch_size is not None and microbatch_size < shape[2] and shape[2] % microbatch_size:
      raise ConfigError(f"benchmark.microbatch_size={microbatch_size} must divide the batch size of every "
                        f"benchmark.shapes entry, got {tuple(shape)}")
  NoisySum(clip_norm, noise_multiplier, 1.0)  # C > 0 and σ >= 0, finite
  check_output_file(os.path.join(output_dir, "bench.json"), "benchmark.output_dir")
  return [tuple(shape) for shape in shapes]


def _check_search(memory_budget_gb, max_batch_shapes, max_batch_cap, max_batch_resolution) -> Optional[set]:
  """The settings of the max-batch search; returns the (inputs, targets) it runs for (None: all)."""
  if memory_budget_gb is not None and (not checks.is_finite_number(memory_budget_gb) or memory_budget_gb <= 0):
    raise ConfigError(f"benchmark.memory_budget_gb must be a finite number > 0 (or None: no max-batch search), "
                      f"got {memory_budget_gb!r}")
  if max_batch_cap is not None and (not checks.is_integer(max_batch_cap) or max_batch_cap < 1):
    raise ConfigError(f"benchmark.max_batch_cap must be an integer >= 1 (or None: no cap but the "
                      f"benchmark's limit of {MAX_TOKENS:,} tokens per step), got {max_batch_cap!r}")
  if not checks.is_finite_number(max_batch_resolution) or not 0 <= max_batch_resolution < 1:
    raise ConfigError(f"benchmark.max_batch_resolution must be a number in [0, 1) (relative precision of the "
                      f"max-batch search; 0: exact), got {max_batch_resolution!r}")
  if max_batch_shapes is None:
    return None
  if not isinstance(max_batch_shapes, (list, tuple)) or any(
      not isinstance(s, (list, tuple)) or len(s) != 2 or any(not checks.is_integer(v) or v < 1 for v in s)
      for s in max_batch_shapes):
    raise ConfigError(f"benchmark.max_batch_shapes must be a list of (inputs, targets) of integers >= 1 (or None: "
                      f"every shape), got {max_batch_shapes!r}")
  return {tuple(s) for s in max_batch_shapes}


def _check_memory(configs, shapes, methods, microbatch_size) -> None:
  """ConfigError for a shape whose step cannot fit this machine's memory: one of its arrays alone
  (`benchmark_case.step_memory_floor`, a lower bound of the step's peak) is larger."""
  limit = machine_memory_bytes()
  if not limit:
    return
  for inputs, targets, batch_size in shapes:
    rows = batch_size if microbatch_size is None else min(batch_size, microbatch_size)
    for preset, config in configs:
      floor, what = max(step_memory_floor(config, inputs, targets, rows, m) for m in methods)
      if floor > limit:
        raise ConfigError(f"benchmark.shapes entry {(inputs, targets, batch_size)} cannot fit in this machine's "
                          f"memory ({limit / GIB:,.1f} GiB): one array of its step, {preset}'s {what}, is "
                          f"{floor / GIB:,.1f} GiB")


def benchmark(*, presets: Sequence[str], shapes: Sequence[Sequence[int]], output_dir: str,
              methods: Sequence[str] = (NONDP, VMAP, GHOST), steps: int = 3, warmup: int = 1,
              clip_norm: float = 1.0, noise_multiplier: float = 1.0,
              dropout_rate: Optional[float] = None, microbatch_size: Optional[int] = None,
              memory_budget_gb: Optional[float] = None,
              max_batch_shapes: Optional[Sequence[Sequence[int]]] = None,
              max_batch_cap: Optional[int] = 1024, max_batch_resolution: float = 0.125,
              dtypes: Optional[Sequence[str]] = None, isolate: bool = True) -> Dict[str, Any]:
  """Runs every (preset, shape, method) and writes bench.json and bench.md to `output_dir`.

  Args:
    presets: model presets (e.g. "t5_1_0_small").
    shapes: `(inputs, targets, batch_size)` triples; every method runs at the same batch. A
      shape is refused before any work when one array of its step alone
      (`benchmark_case.step_memory_floor`) is larger than this machine's physical memory.
    output_dir: where bench.json and bench.md go.
    methods: subset of "nondp", "vmap", "ghost" (book-keeping, reusing instantiated
      per-example kernel gradients), "ghost_recompute" (book-keeping, recomputing them) and
      "ghost_second_pass" (ghost clipping with a second backward pass).
    steps, warmup: timed steps and untimed warm-up steps per case.
    clip_norm, noise_multiplier: DP parameters (they do not change the cost).
    dropout_rate: overrides the preset's dropout (None keeps it).
    microbatch_size: examples per accumulation step of every method (None: the whole batch
      in one fused step); it must divide every batch size measured. A microbatched step runs
      through the host-dispatched accumulate loop; memory and flops are those of one microbatch's
      compiled call, and the max-batch search then finds the largest microbatch that fits.
    memory_budget_gb: when set, also searches the largest batch whose compiled peak memory
      fits this budget (compilations only).
    max_batch_shapes: `(inputs, targets)` pairs the search runs for (None: all shapes).
    max_batch_cap, max_batch_resolution: search limit (None: no cap other than the benchmark's
      `MAX_TOKENS` per step; the budget still ends the search), and relative precision of the
      search (in [0, 1); 0: exact).
    dtypes: activation dtypes (`T5Config.dtype`) each case runs with, e.g. ["float32",
      "bfloat16"]; None keeps each preset's own. Each non-float32 case is also reported as a
      ratio to the float32 case of the same method (`dtype_ratios`).
    isolate: run each case in a fresh process (clean peak RSS); False runs in this process.
  """
  if isinstance(methods, str) or not isinstance(methods, (list, tuple)) or not methods or any(
      m not in METHODS for m in methods):
    raise ConfigError(f"benchmark.methods must be a non-empty subset of {METHODS}, got {methods!r}")
  parsed = _check_inputs(shapes, output_dir, clip_norm, noise_multiplier, steps, warmup, microbatch_size)
  search_for = _check_search(memory_budget_gb, max_batch_shapes, max_batch_cap, max_batch_resolution)
  if isinstance(presets, str) or not isinstance(presets, (list, tuple)) or not presets:
    raise ConfigError(f"benchmark.presets must be a non-empty list of model presets, got {presets!r}")
  if dtypes is not None and (isinstance(dtypes, str) or not isinstance(dtypes, (list, tuple)) or not dtypes
                             or any(d not in model_config.DTYPES for d in dtypes)):
    raise ConfigError(f"benchmark.dtypes must be a non-empty list of {model_config.DTYPES} (or "
                      f"None for each preset's own), got {dtypes!r}")
  overrides = {} if dropout_rate is None else {"dropout_rate": dropout_rate}
  # ConfigError for an unknown preset or a bad override, before any work.
  configs = [(preset, model_config.load_preset(preset, **overrides, **({} if d is None else {"dtype": d})))
             for preset in presets for d in (dtypes or [None])]
  _check_memory(configs, parsed, methods, microbatch_size)

  results = []
  dtype_list = [None] if dtypes is None else list(dtypes)
  cases = [(preset, shape, method, dtype) for preset in presets for shape in parsed
           for method in methods for dtype in dtype_list]
  for preset, (inputs, targets, batch_size), method, dtype in cases:
    search = memory_budget_gb if (search_for is None or (inputs, targets) in search_for) else None
    case = dict(preset=preset, inputs=inputs, targets=targets, batch_size=batch_size,
                method=method, steps=steps, warmup=warmup, clip_norm=clip_norm,
                noise_multiplier=noise_multiplier, dropout_rate=dropout_rate,
                microbatch_size=microbatch_size, dtype=dtype,
                memory_budget_gb=search,
                max_batch_cap=MAX_TOKENS // (inputs + targets) if max_batch_cap is None else max_batch_cap,
                max_batch_resolution=max_batch_resolution)
    _log(f"[bench] {len(results) + 1}/{len(cases)}: {preset} {inputs}/{targets} batch {batch_size} "
         f"{method}{'' if dtype is None else ' ' + dtype}")
    result = _run_isolated(case) if isolate else run_case(case)
    _log(f"[bench]   {result['step_s']:.3f} s/step, {result['examples_per_s']:.2f} ex/s, "
         f"compiled peak {result['memory'].get('peak_bytes', 0) / GIB:.2f} GiB, "
         f"RSS {result['peak_rss_bytes'] / GIB:.2f} GiB, compile {result['compile_s']:.1f}s")
    results.append(result)
    report = {"machine": _machine(), "results": results, "ratios": _ratios(results),
              "dtype_ratios": _dtype_ratios(results)}
    _write(output_dir, report)  # after every case: a long run keeps what it measured
  return report


def _machine() -> Dict[str, Any]:
  return {"platform": platform.platform(), "python": platform.python_version(),
          "jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
          "load_average": os.getloadavg(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _case_key(r: Dict[str, Any]) -> tuple:
  return r["preset"], r["inputs"], r["targets"], r["batch_size"], r.get("dtype")


def _model_label(r: Dict[str, Any]) -> str:
  """The preset, with its activation dtype when the run sets one (`benchmark.dtypes`)."""
  return r["preset"] if r.get("dtype") is None else f"{r['preset']} {r['dtype']}"


def _ratios(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """Each DP method against the non-DP step of the same preset, shape and dtype."""
  base = {_case_key(r): r for r in results if r["method"] == NONDP}
  rows = []
  for r in results:
    b = base.get(_case_key(r))
    if r["method"] == NONDP or b is None:
      continue
    row = dict(preset=r["preset"], dtype=r.get("dtype"), activation_dtype=r.get("activation_dtype"),
               inputs=r["inputs"], targets=r["targets"],
               batch_size=r["batch_size"], method=r["method"],
               throughput=r["examples_per_s"] / b["examples_per_s"],
               cpu_throughput=_safe_div(b.get("step_cpu_s"), r.get("step_cpu_s")),
               compiled_memory=_safe_div(r["memory"].get("peak_bytes"), b["memory"].get("peak_bytes")),
               rss=_safe_div(r["peak_rss_bytes"], b["peak_rss_bytes"]),
               flops=_safe_div(r.get("flops"), b.get("flops")))
    if "max_batch" in r and "max_batch" in b:
      row["max_batch"] = _safe_div(r["max_batch"]["max_batch"], b["max_batch"]["max_batch"])
    rows.append(row)
  return rows


def _dtype_ratios(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """Each non-float32 case against the float32 case of the same preset, shape and method:
  step time (wall and CPU) and compiled peak memory, dtype ÷ float32."""
  base = {_case_key(dict(r, dtype=None)) + (r["method"],): r
          for r in results if r.get("dtype") == "float32"}
  rows = []
  for r in results:
    b = base.get(_case_key(dict(r, dtype=None)) + (r["method"],))
    if r.get("dtype") in (None, "float32") or b is None:
      continue
    rows.append(dict(preset=r["preset"], inputs=r["inputs"], targets=r["targets"],
                     batch_size=r["batch_size"], method=r["method"], dtype=r["dtype"],
                     step_time=_safe_div(r["step_s"], b["step_s"]),
                     cpu_time=_safe_div(r.get("step_cpu_s"), b.get("step_cpu_s")),
                     compiled_memory=_safe_div(r["memory"].get("peak_bytes"), b["memory"].get("peak_bytes")),
                     rss=_safe_div(r["peak_rss_bytes"], b["peak_rss_bytes"])))
  return rows


def _safe_div(a, b):
  return None if not a or not b else a / b


def _fmt(value, spec=".2f", suffix=""):
  return "–" if value is None else f"{value:{spec}}{suffix}"


def markdown(report: Dict[str, Any]) -> str:
  """The report as Markdown: the DP/non-DP ratios first, then the absolute numbers."""
  lines = ["# DP training step benchmark", "",
           f"{report['machine']['platform']}, {report['machine']['cpu_count']} CPUs, jax "
           f"{report['machine']['jax']} ({report['machine']['backend']}), load average "
           f"{', '.join(f'{x:.1f}' for x in report['machine']['load_average'])}, "
           f"{report['machine']['time_utc']}.", "",
           "## DP / non-DP ratios (same run)", "",
           "Throughput from wall time and from process CPU time (robust to other jobs on the "
           "machine); memory from XLA's compiled memory analysis and from peak RSS.", "",
           "| model | inputs/targets | batch | method | throughput × (wall) | throughput × (CPU) "
           "| compiled peak memory × | peak RSS × | XLA FLOPs × | max batch × |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["ratios"]:
    lines.append(f"| {_model_label(r)} | {r['inputs']}/{r['targets']} | {r['batch_size']} | {r['method']} "
                 f"| {_fmt(r['throughput'])} | {_fmt(r.get('cpu_throughput'))} "
                 f"| {_fmt(r['compiled_memory'])} | {_fmt(r['rss'])} "
                 f"| {_fmt(r['flops'])} | {_fmt(r.get('max_batch'))} |")
  if report.get("dtype_ratios"):
    lines += ["", "## Activation dtype / float32 (same run)", "",
              "| model | inputs/targets | batch | method | dtype | step time × (wall) | step time × (CPU) "
              "| compiled peak memory × | peak RSS × |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["dtype_ratios"]:
      lines.append(f"| {r['preset']} | {r['inputs']}/{r['targets']} | {r['batch_size']} | {r['method']} "
                   f"| {r['dtype']} | {_fmt(r['step_time'])} | {_fmt(r['cpu_time'])} "
                   f"| {_fmt(r['compiled_memory'])} | {_fmt(r['rss'])} |")
  lines += ["", "## Absolute numbers", "",
            "| model | inputs/targets | batch | method | s/step | CPU s/step | examples/s "
            "| compiled peak GiB | peak RSS GiB | compile s | GFLOPs/step | max batch (budget) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["results"]:
    mb = r.get("max_batch")
    max_batch = "–" if not mb else (f"{mb['max_batch']}{'+' if mb['capped'] else ''} "
                                    f"({r['memory_budget_gb']:g} GiB)")
    lines.append(
        f"| {_model_label(r)} | {r['inputs']}/{r['targets']} | {r['batch_size']} | {r['method']} "
        f"| {r['step_s']:.3f} | {_fmt(r.get('step_cpu_s'), '.1f')} | {r['examples_per_s']:.2f} "
        f"| {_fmt(r['memory'].get('peak_bytes', 0) / GIB)} | {r['peak_rss_bytes'] / GIB:.2f} "
        f"| {r['compile_s']:.1f} | {_fmt(r['flops'] and r['flops'] / 1e9, '.1f')} | {max_batch} |")
  for r in report["results"]:
    if "ghost_breakdown" not in r:
      continue
    g = r["ghost_breakdown"]
    lines += ["", f"## Ghost norm cost per layer: {_model_label(r)} {r['inputs']}/{r['targets']} "
              f"({r['method']})", "",
              f"Norm multiply-adds per example: {g['norm_macs_per_example'] / 1e9:.3f} G "
              f"(the layers' weight gradients: {g['weight_grad_macs_per_example'] / 1e9:.3f} G).", "",
              "| layer | T | d_in | d_out | Gram MACs | instantiated MACs | chosen |",
              "|---|---|---|---|---|---|---|"]
    for row in g["layers"]:
      lines.append(f"| {row['layer']} | {row['seq_len']} | {row['d_in']} | {row['d_out']} "
                   f"| {row['gram_cost'] / 1e6:.1f} M | {row['instantiate_cost'] / 1e6:.1f} M "
                   f"| {row['method']} |")
  return "\n".join(lines) + "\n"


def _write(output_dir: str, report: Dict[str, Any]) -> None:
  for name, text in (("bench.json", json.dumps(report, indent=2, sort_keys=True)),
                     ("bench.md", markdown(report))):
    write_text_atomic(os.path.join(output_dir, name), text)
  _log(f"[bench] wrote {os.path.join(output_dir, 'bench.json')} and bench.md")
