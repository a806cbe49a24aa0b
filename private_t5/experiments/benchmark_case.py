"""One case of the benchmark: a model's full train step, built, compiled, timed and measured.

`run_case` runs in a fresh process (`experiments.benchmark`) so that its peak RSS is its own;
`make_trainer`, `random_batch`, `compiled_memory` and `max_batch_search` are also the
accelerator check's building blocks.
"""
import logging
import math
import os
import resource
import statistics
import time
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from private_t5.dp import config as dp_config
from private_t5.dp import ghost, mechanism
from private_t5.dp.privacy_params import NoisySum
from private_t5.models import config as config_lib
from private_t5.models import network, sharding
from private_t5.train import host_microbatches, optimizers, trainer as trainer_lib

logger = logging.getLogger(__name__)

NONDP, VMAP, GHOST = "nondp", "vmap", "ghost"
# Ghost variants: book-keeping without reusing instantiated per-example kernel gradients, and
# ghost clipping with a second backward pass.
GHOST_RECOMPUTE, GHOST_SECOND_PASS = "ghost_recompute", "ghost_second_pass"
GHOST_LAYERWISE = "ghost_layerwise"
METHODS = (NONDP, VMAP, GHOST, GHOST_RECOMPUTE, GHOST_SECOND_PASS, GHOST_LAYERWISE)
GIB = 1024 ** 3


def _log(message: str) -> None:
  logger.info("%s", message)


# --- what a case cannot do without --------------------------------------------------------------

def machine_memory_bytes() -> int:
  """Physical memory of this machine (0 where the OS does not say). An accelerator's memory is
  not read here: that would initialize its backend in the process that spawns the cases."""
  try:
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
  except (AttributeError, ValueError, OSError):
    return 0


def step_memory_floor(config, inputs: int, targets: int, rows: int, method: str):
  """(bytes, what): the largest single array a train step of `rows` examples at `inputs` /
  `targets` tokens must hold, a lower bound of its peak memory (the compiled peak also holds the
  parameters, the optimizer state and every other activation). The arrays are the model's:
  the output logits, the relative position bias, the attention weights (materialized unless
  `attention='cudnn'` fuses them), the feed-forward hidden units and, for DP-vmap, the
  per-example gradients of the largest parameter."""
  act = 2 if config.dtype in ("bfloat16", "float16") else 4
  longest = max(inputs, targets)
  floors = [
      (rows * targets * config.vocab_size * act,
       f"output logits [batch {rows}, targets {targets}, vocab {config.vocab_size}] in {config.dtype}"),
      (config.num_heads * inputs * inputs * act,
       f"relative position bias [heads {config.num_heads}, inputs {inputs}, inputs {inputs}] in {config.dtype}"),
      (rows * longest * config.d_ff * act,
       f"feed-forward activations [batch {rows}, length {longest}, d_ff {config.d_ff}] in {config.dtype}"),
  ]
  if config.attention != "cudnn":
    floors.append((rows * config.num_heads * longest * longest * act,
                   f"attention weights [batch {rows}, heads {config.num_heads}, length {longest}, "
                   f"length {longest}] in {config.dtype}"))
  if method == VMAP:
    largest = max(config.vocab_size * config.d_model, config.d_model * config.d_ff,
                  config.d_model * config.num_heads * config.d_kv)
    floors.append((rows * largest * 4, f"per-example gradients of the largest parameter "
                                       f"[batch {rows}, {largest:,}] in float32"))
  return max(floors)


# --- one case, in its own process ---------------------------------------------------------------

def random_batch(vocab_size: int, batch_size: int, inputs: int, targets: int, seed: int):
  """Full-length rows of random token ids: the step's cost does not depend on the ids."""
  rng = np.random.default_rng(seed)
  enc = rng.integers(3, vocab_size, size=(batch_size, inputs), dtype=np.int32)
  tgt = rng.integers(3, vocab_size, size=(batch_size, targets), dtype=np.int32)
  dec = np.concatenate([np.zeros((batch_size, 1), np.int32), tgt[:, :-1]], axis=1)
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=tgt,
              decoder_loss_weights=np.ones((batch_size, targets), np.float32),
              example_weight=np.ones((batch_size,), np.float32))


def make_trainer(preset: str, method: str, batch_size: int, clip_norm: float,
                 noise_multiplier: float, dropout_rate: Optional[float], dtype: Optional[str] = None,
                 attention: Optional[str] = None, devices=None, optimizer=None, stack_layers: bool = False,
                 overrides: Optional[Dict[str, Any]] = None, mesh_shape: Tuple[int, int] = (1, 1)):
  """(config, Trainer) of one benchmark case (on `devices[:1]`, default this process's first
  device; `optimizer` default `optimizers.adafactor(learning_rate=1e-3)`; `stack_layers`: the
  ghost option); the step's clipped sum and noise transform come
  from the mechanism builder (`dp.mechanism.step_parts`), with q·N = `batch_size`; `dtype` and
  `attention` override the preset's `T5Config` fields when given, and so do `overrides`
  (e.g. `scan_layers`, `remat_policy`); `mesh_shape` (data, model) takes the first devices."""
  overrides = dict(overrides or {})
  if dropout_rate is not None:
    overrides["dropout_rate"] = dropout_rate
  if dtype is not None:
    overrides["dtype"] = dtype
  if attention is not None:
    overrides["attention"] = attention
  config = config_lib.load_preset(preset, **overrides)
  loss_fn = trainer_lib.make_loss_fn(config)
  noisy_sum = None if method == NONDP else NoisySum(clip_norm, noise_multiplier, batch_size)
  options = {} if method in (NONDP, VMAP) else dict(
      clipped_sum_method={GHOST_SECOND_PASS: dp_config.SECOND_PASS,
                          GHOST_LAYERWISE: dp_config.LAYERWISE}.get(method, dp_config.BOOKKEEPING),
      reuse_instantiated=method == GHOST, stack_layers=stack_layers)
  clipped_sum, noise = mechanism.step_parts(noisy_sum, VMAP if method == VMAP else dp_config.GHOST, loss_fn,
                                            **options)
  mesh = sharding.create_mesh(tuple(mesh_shape), list(devices or jax.devices())[:math.prod(mesh_shape)])
  optimizer = optimizer or optimizers.adafactor(learning_rate=1e-3)
  return config, trainer_lib.Trainer(config, clipped_sum, optimizer, mesh, noise=noise)


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
  params = network.param_shapes(config)
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
  # memory of the host-dispatched accumulate loop, which runs `batch_size / micro` such calls).
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
      state, metrics = host_microbatches.train_step_microbatched(trainer, state, batch, micro, *keys)
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
  if case["method"] in (GHOST, GHOST_RECOMPUTE, GHOST_SECOND_PASS, GHOST_LAYERWISE):
    result["ghost_breakdown"] = _ghost_breakdown(config, trainer, shape)
  if case.get("memory_budget_gb"):
    result["max_batch"] = max_batch_search(
        trainer, state, shape, compiled_rows, int(case["memory_budget_gb"] * GIB),
        case["max_batch_cap"], case["max_batch_resolution"],
        {compiled_rows: memory.get("peak_bytes", 0)})
  return result
