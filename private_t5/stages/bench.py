"""`private-t5 bench`: non-DP, DP-vmap and DP-ghost training steps measured side by side.

  private-t5 bench --gin_file=configs/bench/small.gin --gin.benchmark.output_dir=/tmp/bench

For every model preset and (inputs, targets, batch) shape, each method's full train step
(gradient aggregation + Adafactor, `train.trainer.Trainer`) runs in a fresh process so that
its peak RSS is its own. Per method it records:

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
`benchmark.dtypes` (e.g. ["float32", "bfloat16"]) every case runs once per activation dtype
and the report adds each dtype's ratio to the float32 step of the same method. For the
ghost step the Markdown also breaks down the per-layer cost of the norm computation.
"""
import concurrent.futures
import json
import logging
import multiprocessing
import os
import platform
import resource
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

from private_t5.stages import gin_utils
from private_t5.errors import ConfigError
from private_t5.io import check_output_file, write_text_atomic
from private_t5.stages import flags

logger = logging.getLogger(__name__)

USAGE = """usage: private-t5 bench --gin_file=configs/bench/<name>.gin [--gin.benchmark.NAME=VALUE ...]

Measures non-DP, DP-vmap and DP-ghost train steps side by side; writes bench.json and bench.md
to benchmark.output_dir. Configs: configs/bench/{quick,tiny,small}.gin.
"""

NONDP, VMAP, GHOST = "nondp", "vmap", "ghost"
# Ghost variants: book-keeping without reusing instantiated per-example kernel gradients, and
# ghost clipping with a second backward pass.
GHOST_RECOMPUTE, GHOST_SECOND_PASS = "ghost_recompute", "ghost_second_pass"
METHODS = (NONDP, VMAP, GHOST, GHOST_RECOMPUTE, GHOST_SECOND_PASS)
GIB = 1024 ** 3


def _log(message: str) -> None:
  logger.info("%s", message)


# --- one case, in its own process ---------------------------------------------------------------

def random_batch(vocab_size: int, batch_size: int, inputs: int, targets: int, seed: int):
  """Full-length rows of random token ids: the step's cost does not depend on the ids."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  enc = rng.integers(3, vocab_size, size=(batch_size, inputs), dtype=np.int32)
  tgt = rng.integers(3, vocab_size, size=(batch_size, targets), dtype=np.int32)
  dec = np.concatenate([np.zeros((batch_size, 1), np.int32), tgt[:, :-1]], axis=1)
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=tgt,
              decoder_loss_weights=np.ones((batch_size, targets), np.float32),
              example_weight=np.ones((batch_size,), np.float32))


def make_trainer(preset: str, method: str, batch_size: int, clip_norm: float,
                  noise_multiplier: float, dropout_rate: Optional[float], dtype: Optional[str] = None):
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5 import models  # pylint: disable=g-import-not-at-top
  from private_t5.dp import aggregator as aggregator_lib, ghost  # pylint: disable=g-import-not-at-top
  from private_t5.dp.accounting import NoisySum  # pylint: disable=g-import-not-at-top
  from private_t5.train import optimizers, partitioning, trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  overrides = {} if dropout_rate is None else {"dropout_rate": dropout_rate}
  if dtype is not None:
    overrides["dtype"] = dtype
  config = models.load_preset(preset, **overrides)
  loss_fn = trainer_lib.make_loss_fn(config)
  if method == NONDP:
    aggregator = aggregator_lib.MeanAggregator(loss_fn)
  elif method == VMAP:
    aggregator = aggregator_lib.DPAggregator(loss_fn, NoisySum(clip_norm, noise_multiplier, batch_size))
  else:
    aggregator = ghost.GhostDPAggregator(
        loss_fn, NoisySum(clip_norm, noise_multiplier, batch_size),
        clipped_sum_method=ghost.SECOND_PASS if method == GHOST_SECOND_PASS else ghost.BOOKKEEPING,
        reuse_instantiated=method == GHOST)
  mesh = partitioning.create_mesh((1, 1), jax.devices()[:1])
  optimizer = optimizers.adafactor(learning_rate=1e-3)
  return config, trainer_lib.Trainer(config, aggregator, optimizer, mesh)


def compiled_memory(compiled) -> Dict[str, Any]:
  """The memory analysis of a compiled step; `peak_bytes` = arguments + outputs + temporaries - aliased."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")
  out = {f: int(getattr(analysis, f, 0) or 0) for f in fields}
  out["peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                       + out["temp_size_in_bytes"] - out["alias_size_in_bytes"])
  return out


def _flops(compiled) -> Optional[float]:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost["flops"]) if cost and "flops" in cost else None


def _compile(trainer, state, batch_size, shape, seed):
  import jax  # pylint: disable=g-import-not-at-top
  batch = random_batch(trainer.model_config.vocab_size, batch_size, shape[0], shape[1], seed)
  keys = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))
  start = time.perf_counter()
  compiled = trainer.compile_train_step(state, batch, *keys)
  return compiled, time.perf_counter() - start, batch, keys


def max_batch_search(trainer, state, shape, start_batch: int, budget_bytes: int, cap: int,
               resolution: float, known: Optional[Dict[int, int]] = None,
               multiple: int = 1) -> Dict[str, Any]:
  """Largest batch (within `resolution`, a multiple of `multiple`) whose compiled peak fits."""
  peaks = dict(known or {})

  def peak(b: int) -> int:
    if b not in peaks:
      compiled, seconds, _, _ = _compile(trainer, state, b, shape, 0)
      peaks[b] = compiled_memory(compiled).get("peak_bytes", 0)
      _log(f"    batch {b}: compiled peak {peaks[b] / GIB:.2f} GiB ({seconds:.0f}s to compile)")
    return peaks[b]

  lo, hi = 0, None
  b = max(1, start_batch)
  while b <= cap:  # grow geometrically to bracket the budget
    if peak(b) <= budget_bytes:
      lo, b = b, b * 2
    else:
      hi = b
      break
  if lo == 0:
    b = (start_batch // 2) // multiple * multiple
    while b >= multiple:  # shrink until it fits
      if peak(b) <= budget_bytes:
        lo = b
        break
      hi, b = b, (b // 2) // multiple * multiple
  while hi is not None and lo > 0 and hi - lo > max(multiple, int(lo * resolution)):
    mid = (lo + hi) // 2 // multiple * multiple
    if mid <= lo:
      break
    if peak(mid) <= budget_bytes:
      lo = mid
    else:
      hi = mid
  return {"max_batch": lo, "first_over_budget": hi, "capped": hi is None,
          "compiled_peaks": {str(k): v for k, v in sorted(peaks.items())}}


def _ghost_breakdown(config, trainer, shape) -> Dict[str, Any]:
  """Per-layer multiply-adds of the ghost norms for one example (Gram vs instantiated)."""
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5 import models  # pylint: disable=g-import-not-at-top
  from private_t5.dp import ghost  # pylint: disable=g-import-not-at-top
  params = models.param_shapes(config)
  example = jax.tree.map(lambda x: x[0], random_batch(config.vocab_size, 1, shape[0], shape[1], 0))
  recording = ghost.record_layer_uses(trainer.aggregator.loss_fn, params, example, None)
  rows = ghost.cost_breakdown(recording)
  chosen = sum(min(r["gram_cost"], r["instantiate_cost"]) for r in rows)
  weight_grads = sum(r["seq_len"] * r["d_in"] * r["d_out"] for r in rows)
  return {"layers": rows, "norm_macs_per_example": chosen,
          "weight_grad_macs_per_example": weight_grads}


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
  """Compiles, times and measures one (preset, shape, batch, method); runs in a child process."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import jax  # pylint: disable=g-import-not-at-top
  shape = (case["inputs"], case["targets"])
  config, trainer = make_trainer(case["preset"], case["method"], case["batch_size"],
                                  case["clip_norm"], case["noise_multiplier"], case["dropout_rate"],
                                  case.get("dtype"))
  batch_size, micro = case["batch_size"], case.get("microbatch_size")
  if micro is not None and micro >= batch_size:
    micro = None
  if micro is not None and batch_size % micro:
    raise ValueError(f"microbatch_size={micro} must divide batch_size={batch_size}")
  state = trainer.init_state(jax.random.PRNGKey(0))
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  # The compiled call measured: the fused step on the whole batch, or on one microbatch (the
  # memory of the trainer's accumulate loop, which runs `batch_size / micro` such calls).
  compiled_rows = micro or batch_size
  compiled, compile_s, _, keys = _compile(trainer, state, compiled_rows, shape, 0)
  batch = random_batch(config.vocab_size, batch_size, shape[0], shape[1], 0)
  memory = compiled_memory(compiled)
  result = dict(case, compile_s=compile_s, memory=memory, flops=_flops(compiled), compiled_rows=compiled_rows,
                activation_dtype=config.dtype,
                num_params=sum(int(x.size) for x in jax.tree.leaves(state.params)))
  placed = trainer.place_batch(batch) if micro is None else None
  times, cpu_times = [], []
  for step in range(case["warmup"] + case["steps"]):
    start, cpu_start = time.perf_counter(), time.process_time()
    if micro is None:
      state, metrics = compiled(state, placed, *keys)
    else:
      state, metrics = trainer.train_step_microbatched(state, batch, micro, *keys)
    jax.block_until_ready((state, metrics))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if step >= case["warmup"]:
      times.append(wall)
      cpu_times.append(cpu)
    _log(f"    step {step + 1}/{case['warmup'] + case['steps']}: {wall:.2f}s ({cpu:.1f} CPU s)")
  result["step_times_s"] = times
  result["step_s"] = statistics.median(times)
  # CPU seconds of all threads of this process: on a machine shared with other jobs it
  # measures the step's work rather than the time spent waiting for a core.
  result["step_cpu_times_s"] = cpu_times
  result["step_cpu_s"] = statistics.median(cpu_times)
  result["examples_per_s"] = case["batch_size"] / result["step_s"]
  result["loss"] = float(metrics["nondp/loss"])
  result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  result["rss_before_compile_bytes"] = rss_before
  if case["method"] in (GHOST, GHOST_RECOMPUTE, GHOST_SECOND_PASS):
    result["ghost_breakdown"] = _ghost_breakdown(config, trainer, shape)
  if case.get("memory_budget_gb"):
    result["max_batch"] = max_batch_search(
        trainer, state, shape, compiled_rows, int(case["memory_budget_gb"] * GIB),
        case["max_batch_cap"], case["max_batch_resolution"],
        {compiled_rows: memory.get("peak_bytes", 0)})
  return result


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
    if not (value is None and name == "microbatch_size") and (
        not isinstance(value, int) or isinstance(value, bool) or value < low):
      raise ConfigError(f"benchmark.{name} must be an integer >= {low}, got {value!r}")
  if not isinstance(shapes, (list, tuple)) or not shapes:
    raise ConfigError(f"benchmark.shapes must be a non-empty list of (inputs, targets, batch_size), got {shapes!r}")
  for shape in shapes:
    if (not isinstance(shape, (list, tuple)) or len(shape) != 3
        or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shape)):
      raise ConfigError(f"benchmark.shapes entries must be (inputs, targets, batch_size) of integers >= 1, "
                        f"got {shape!r}")
    if shape[2] * (shape[0] + shape[1]) > MAX_TOKENS:
      raise ConfigError(f"benchmark.shapes entry {tuple(shape)} is {shape[2] * (shape[0] + shape[1]):,} tokens "
                        f"per step; the most a benchmark takes is {MAX_TOKENS:,}")
  from private_t5.dp.accounting import NoisySum  # pylint: disable=g-import-not-at-top
  NoisySum(clip_norm, noise_multiplier, 1.0)  # C > 0 and σ >= 0, finite
  check_output_file(os.path.join(output_dir, "bench.json"), "benchmark.output_dir")
  return [tuple(shape) for shape in shapes]


def benchmark(*, presets: Sequence[str], shapes: Sequence[Sequence[int]], output_dir: str,
              methods: Sequence[str] = (NONDP, VMAP, GHOST), steps: int = 3, warmup: int = 1,
              clip_norm: float = 1.0, noise_multiplier: float = 1.0,
              dropout_rate: Optional[float] = None, microbatch_size: Optional[int] = None,
              memory_budget_gb: Optional[float] = None,
              max_batch_shapes: Optional[Sequence[Sequence[int]]] = None,
              max_batch_cap: int = 1024, max_batch_resolution: float = 0.125,
              dtypes: Optional[Sequence[str]] = None, isolate: bool = True) -> Dict[str, Any]:
  """Runs every (preset, shape, method) and writes bench.json and bench.md to `output_dir`.

  Args:
    presets: model presets (e.g. "t5_1_0_small").
    shapes: `(inputs, targets, batch_size)` triples; every method runs at the same batch.
    output_dir: where bench.json and bench.md go.
    methods: subset of "nondp", "vmap", "ghost" (book-keeping, reusing instantiated
      per-example kernel gradients), "ghost_recompute" (book-keeping, recomputing them) and
      "ghost_second_pass" (ghost clipping with a second backward pass).
    steps, warmup: timed steps and untimed warm-up steps per case.
    clip_norm, noise_multiplier: DP parameters (they do not change the cost).
    dropout_rate: overrides the preset's dropout (None keeps it).
    microbatch_size: examples per accumulation step of every method (None: the whole batch
      in one fused step); it must divide every batch size measured. A microbatched step runs
      through the trainer's accumulate loop; memory and flops are those of one microbatch's
      compiled call, and the max-batch search then finds the largest microbatch that fits.
    memory_budget_gb: when set, also searches the largest batch whose compiled peak memory
      fits this budget (compilations only).
    max_batch_shapes: `(inputs, targets)` pairs the search runs for (None: all shapes).
    max_batch_cap, max_batch_resolution: search limit, and relative precision of the search.
    dtypes: activation dtypes (`T5Config.dtype`) each case runs with, e.g. ["float32",
      "bfloat16"]; None keeps each preset's own. Each non-float32 case is also reported as a
      ratio to the float32 case of the same method (`dtype_ratios`).
    isolate: run each case in a fresh process (clean peak RSS); False runs in this process.
  """
  unknown = [m for m in methods if m not in METHODS]
  if unknown or not methods:
    raise ConfigError(f"benchmark.methods must be a non-empty subset of {METHODS}, got {list(methods)}")
  parsed = _check_inputs(shapes, output_dir, clip_norm, noise_multiplier, steps, warmup, microbatch_size)
  from private_t5.models import config as model_config  # pylint: disable=g-import-not-at-top
  for preset in presets:
    model_config.load_preset(preset)  # ConfigError for an unknown preset, before any work
  if dtypes is not None and (not dtypes or any(d not in model_config.DTYPES for d in dtypes)):
    raise ConfigError(f"benchmark.dtypes must be a non-empty list of {model_config.DTYPES} (or "
                      f"None for each preset's own), got {dtypes!r}")
  search_for = None if max_batch_shapes is None else {tuple(int(v) for v in s) for s in max_batch_shapes}

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
                memory_budget_gb=search, max_batch_cap=max_batch_cap,
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
  import jax  # pylint: disable=g-import-not-at-top
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


def main(argv: Sequence[str]) -> int:
  """`private-t5 bench --gin_file=... [--gin.benchmark.NAME=VALUE ...]`."""
  parser = flags.StageParser("bench", USAGE.split("\n\n", 1)[1].strip(), epilog=USAGE.split("\n")[0],
                             gin_required=True)
  parser.add_flag("output", gin="benchmark.output_dir", help="directory of bench.json and bench.md")
  parser.add_flag("steps", gin="benchmark.steps", type=int, help="measured steps per method")
  parser.add_flag("noise_multiplier", gin="benchmark.noise_multiplier", type=float, help="σ of the DP steps")
  parsed = parser.parse_stage_args(argv)
  gin_utils.parse(parsed.gin_files, parsed.gin_bindings, entry="benchmark")
  report = gin_utils.call_configured(gin_utils.configured("benchmark"))
  print(markdown(report))
  return 0
