#!/usr/bin/env python
"""The train step on a device mesh, compiled only: per-device memory, compile time, sharding.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/bench_mesh.py \
      [--preset=t5_1_1_small] [--dtype=float32|bfloat16] [--lengths=512:114] [--batch_size=8] \
      [--cases=nondp:1x8:replicated,ghost:1x8:replicated,nondp:8x1:replicated,nondp:8x1:fully_sharded] \
      [--output=bench_out/mesh.json]

Each case METHOD:DATAxMODEL:SHARDING (METHOD one of nondp, vmap, ghost, ghost_nonoise: the
ghost step with σ = 0, i.e. without the noise draw) is compiled in a fresh process (the
`XLA_FLAGS` device count is set for it when missing: 8 fake CPU devices). Nothing runs: the
step is lowered from the abstract train state (`Trainer.abstract_state`) and compiled with
full XLA optimization (JAX_DISABLE_MOST_OPTIMIZATIONS is cleared). Per case it records the
wall and CPU seconds of `lower()` and of `compile()`, XLA's per-device compiled memory
(arguments + outputs + temporaries − donated aliases) and the bytes of parameters + optimizer
state one device holds (`partitioning.bytes_per_device`). The ratios printed at the end are
the headline: DP-ghost ÷ non-DP on the first mesh given, fully-sharded ÷ replicated on the
other.
"""
import argparse
import json
import multiprocessing
import os
import sys
import time

from private_t5.io import write_text_atomic

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="t5_1_1_small")
  p.add_argument("--dtype", default=None, help="activation dtype (default: the preset's)")
  p.add_argument("--lengths", default="512:114", help="INPUTS:TARGETS")
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--devices", type=int, default=8, help="fake CPU devices when XLA_FLAGS has none")
  p.add_argument("--cases", default="nondp:1x8:replicated,ghost:1x8:replicated,"
                                    "nondp:8x1:replicated,nondp:8x1:fully_sharded")
  p.add_argument("--output", default=None)
  return p.parse_args(argv)


def _child_env(devices: int) -> None:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)  # measure what real runs compile
  if DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_FLAG}={devices}".strip()


def compile_case(case):
  """Compiles one case (in a fresh process); returns its measurements."""
  _child_env(case["devices"])
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from private_t5.models import network  # pylint: disable=g-import-not-at-top
  from private_t5.dp import aggregator as aggregator_lib, ghost  # pylint: disable=g-import-not-at-top
  from private_t5.dp.privacy_params import NoisySum  # pylint: disable=g-import-not-at-top
  from private_t5.train import optimizers, trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from private_t5.models import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  overrides = {} if case.get("dtype") is None else {"dtype": case["dtype"]}
  config = config_lib.load_preset(case["preset"], dropout_rate=0.0, **overrides)
  loss_fn = trainer_lib.make_loss_fn(config)
  mesh = sharding_lib.create_mesh(case["mesh"])
  spmd = sharding_lib.DATA_AXIS if mesh.shape[sharding_lib.DATA_AXIS] > 1 else None
  b, (inputs, targets) = case["batch_size"], case["lengths"]
  method = case["method"]
  if method == "nondp":
    aggregator = aggregator_lib.MeanAggregator(loss_fn)
  elif method == "vmap":
    aggregator = aggregator_lib.DPAggregator(loss_fn, NoisySum(1.0, 1.0, b), spmd_axis_name=spmd)
  else:
    sigma = 0.0 if method == "ghost_nonoise" else 1.0
    aggregator = ghost.GhostDPAggregator(loss_fn, NoisySum(1.0, sigma, b), spmd_axis_name=spmd)
  trainer = trainer_lib.Trainer(config, aggregator, optimizers.adafactor(learning_rate=1e-3), mesh,
                                rules=sharding_lib.axis_rules(case["sharding"]))
  state = trainer.abstract_state()
  batch = {"encoder_input_tokens": np.ones((b, inputs), np.int32),
           "decoder_input_tokens": np.ones((b, targets), np.int32),
           "decoder_target_tokens": np.ones((b, targets), np.int32),
           "decoder_loss_weights": np.ones((b, targets), np.float32),
           "example_weight": np.ones((b,), np.float32)}
  keys = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))
  batch = trainer.place_batch(batch)
  wall, cpu = time.perf_counter(), time.process_time()
  lowered = trainer.lower_train_step(state, batch, *keys)
  lower_s, lower_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
  wall, cpu = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  compile_s, compile_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
  m = compiled.memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  return dict(case, lower_s=lower_s, lower_cpu_s=lower_cpu_s, compile_s=compile_s, compile_cpu_s=compile_cpu_s,
              peak_bytes=int(peak), temp_bytes=int(m.temp_size_in_bytes),
              param_opt_bytes_per_device=sharding_lib.bytes_per_device((state.params, state.opt_state)),
              num_params=network.num_params(config))


def _parse_case(text, args):
  method, mesh, sharding = text.split(":")
  return dict(method=method, mesh=tuple(int(x) for x in mesh.split("x")), sharding=sharding,
              preset=args.preset, lengths=tuple(int(x) for x in args.lengths.split(":")),
              batch_size=args.batch_size, devices=args.devices, dtype=args.dtype)


def _find(results, method, mesh, sharding):
  for r in results:
    if (r["method"], tuple(r["mesh"]), r["sharding"]) == (method, mesh, sharding):
      return r
  return None


def ratios(results):
  """DP ÷ non-DP (peak, compile CPU) per mesh and sharding; fully-sharded ÷ replicated
  (parameter + optimizer bytes per device, peak) per mesh and method."""
  out = {}
  for r in results:
    mesh, name = tuple(r["mesh"]), "x".join(map(str, r["mesh"]))
    base = _find(results, "nondp", mesh, r["sharding"])
    if r["method"] != "nondp" and base:
      out[f"{r['method']}/nondp {name} {r['sharding']}"] = dict(
          peak=r["peak_bytes"] / base["peak_bytes"], compile_cpu=r["compile_cpu_s"] / base["compile_cpu_s"],
          lower_cpu=r["lower_cpu_s"] / base["lower_cpu_s"])
    repl = _find(results, r["method"], mesh, "replicated")
    if r["sharding"] == "fully_sharded" and repl:
      out[f"fully_sharded/replicated {r['method']} {name}"] = dict(
          param_opt_bytes=r["param_opt_bytes_per_device"] / repl["param_opt_bytes_per_device"],
          peak=r["peak_bytes"] / repl["peak_bytes"])
  return out


def main(argv=None):
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  cases = [_parse_case(c, args) for c in args.cases.split(",")]
  results = []
  ctx = multiprocessing.get_context("spawn")
  for case in cases:
    with ctx.Pool(1) as pool:
      r = pool.apply(compile_case, (case,))
    results.append(r)
    print(f"{r['method']:>13} {r['mesh']} {r['sharding']:>13}: peak {r['peak_bytes'] / 2**20:.2f} MiB/device, "
          f"params+opt {r['param_opt_bytes_per_device'] / 2**20:.1f} MiB/device, lower {r['lower_cpu_s']:.1f} "
          f"CPU s, compile {r['compile_cpu_s']:.1f} CPU s ({r['compile_s']:.1f} s)", flush=True)
    report = dict(results=results, ratios=ratios(results))
    if args.output:  # after every case: a long run that is stopped keeps what it measured
      write_text_atomic(args.output, json.dumps(report, indent=1))
  for name, values in report["ratios"].items():
    print(name, " ".join(f"{k} {v:.3f}x" for k, v in values.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
