"""Model scale: compile time, compiled memory per device and the largest batch that fits, for
T5 v1.1 small to XXL, unrolled or scanned (`T5Config.scan_layers`), under each remat policy.

Nothing runs and nothing is allocated: each row lowers and compiles the real train step
(`Trainer.lower_train_step`, Adafactor, bfloat16 activations, 512 input / 114 target tokens) on
abstract shapes, for this CPU (`--target=cpu`, a (data, model) mesh of fake host devices with
`--mesh`) or for a compile-only NVIDIA H100/H200 (`--target=h100|h200`, the kernel census's route:
run it with the census venv of scripts/install_kernel_census.sh), and reads XLA's memory analysis.

  python benchmarks/bench_model_scale.py --presets=t5_1_1_small,t5_1_1_xl --methods=nondp,vmap \\
      --scan_layers=both --remat_policies=none,full --out=/tmp/scale.json
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false $HOME/.cache/private_t5/venv-census/bin/python \\
      benchmarks/bench_model_scale.py --target=h100 --presets=t5_1_1_base --remat_policies=none,minimal,full

Per row (`--out`: a JSON list): `preset`, `method`, `scan_layers`, `remat_policy`, `target`, `mesh`,
`compile_s` (lower + compile of the step at the first batch), `temp_bytes_per_device` (XLA's temporary
buffers at that batch), `argument_bytes_per_device`, `activation_bytes_per_example` (the growth of the
temporaries per example between the two batches of `--batches`), `peak_bytes_per_device` (arguments +
outputs + temporaries - aliased) and `max_batch_per_device`: the largest batch per data-axis position
whose peak fits `--memory_gib` (default 80), from the linear fit of the peak over the two batches
(the step's memory grows linearly in its rows; one batch in `--batches`: no fit). A method that cannot run a setting (ghost clipping
inside scan or remat) gives a row with `skipped` and the one-line reason.
"""
import argparse
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

GIB = 1 << 30
PRESETS = ("t5_1_1_small", "t5_1_1_base", "t5_1_1_large", "t5_1_1_xl", "t5_1_1_xxl")
METHODS = ("nondp", "vmap", "ghost", "ghost_layerwise")
TARGETS = ("cpu", "h100", "h200")


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--presets", default="t5_1_1_small,t5_1_1_base")
  parser.add_argument("--methods", default="nondp,vmap,ghost")
  parser.add_argument("--scan_layers", default="both", choices=("true", "false", "both"))
  parser.add_argument("--remat_policies", default="none,minimal,full")
  parser.add_argument("--target", default="cpu", choices=TARGETS)
  parser.add_argument("--mesh", default="1,1", help="(data, model) mesh, e.g. 1,8 (cpu target: fake devices)")
  parser.add_argument("--batches", default="4,8", help="two batch sizes (global rows) the fit uses")
  parser.add_argument("--inputs", type=int, default=512)
  parser.add_argument("--targets", type=int, default=114)
  parser.add_argument("--memory_gib", type=float, default=80.0)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                      help="the activations' dtype (T5Config.dtype; ghost_layerwise runs in float32 only)")
  parser.add_argument("--out", default=None, help="write the rows as a JSON list here")
  args = parser.parse_args(argv)
  args.presets = _names(args.presets, PRESETS, "--presets")
  args.methods = _names(args.methods, METHODS, "--methods")
  from private_t5.models.config import REMAT_POLICIES  # pylint: disable=g-import-not-at-top
  args.remat_policies = _names(args.remat_policies, REMAT_POLICIES, "--remat_policies")
  args.scans = {"true": (True,), "false": (False,), "both": (False, True)}[args.scan_layers]
  try:
    args.mesh = tuple(int(x) for x in args.mesh.split(","))
    args.batches = tuple(int(x) for x in args.batches.split(","))
  except ValueError:
    parser.error("--mesh and --batches are integers joined by commas")
  if len(args.mesh) != 2 or min(args.mesh) < 1:
    parser.error(f"--mesh must be two positive integers (data, model), got {args.mesh}")
  if (len(args.batches) not in (1, 2) or args.batches[0] < 1
      or (len(args.batches) == 2 and args.batches[0] >= args.batches[1])):
    parser.error(f"--batches must be one positive integer or two increasing ones, got {args.batches}")
  if any(b % args.mesh[0] for b in args.batches):
    parser.error(f"--batches must be multiples of the data axis ({args.mesh[0]})")
  if args.target != "cpu" and args.mesh != (1, 1):
    parser.error("a compile-only GPU target is one device: --mesh=1,1")
  return args


def _names(value: str, allowed, flag: str):
  names = tuple(v for v in value.split(",") if v)
  unknown = [n for n in names if n not in allowed]
  if unknown or not names:
    raise SystemExit(f"{flag}: unknown {unknown or value!r}; one or more of {', '.join(allowed)}")
  return names


def _devices(args):
  import jax  # pylint: disable=g-import-not-at-top
  if args.target == "cpu":
    return jax.devices("cpu")
  jax.config.update("jax_platforms", "cpu")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  import kernel_census  # pylint: disable=g-import-not-at-top
  topology = topologies.get_topology_desc(platform="cuda", target_config=kernel_census.target_spec(args.target),
                                          topology="1x1x1")
  return list(topology.devices)


def _compile(trainer, rows: int, args):
  """(compiled, seconds) of the train step on `rows` abstract rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case  # pylint: disable=g-import-not-at-top
  from private_t5.train import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from private_t5.models import sharding  # pylint: disable=g-import-not-at-top
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(trainer.mesh))
  host = trainer_lib.device_features(benchmark_case.random_batch(trainer.model_config.vocab_size, rows, args.inputs,
                                                                 args.targets, 0))
  rows_sharding = sharding.batch_sharding(trainer.mesh)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows_sharding) for k, v in host.items()}
  start = time.perf_counter()
  compiled = trainer.lower_train_step(trainer.abstract_state(), batch, key, key).compile()
  return compiled, time.perf_counter() - start


def run_row(preset: str, method: str, scan: bool, policy: str, devices, args) -> dict:
  """One row (see the module docstring)."""
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case  # pylint: disable=g-import-not-at-top
  row = dict(preset=preset, method=method, scan_layers=scan, remat_policy=policy, target=args.target, dtype=args.dtype,
             mesh=list(args.mesh), inputs=args.inputs, targets=args.targets, batches=list(args.batches),
             memory_gib=args.memory_gib)
  memories = []
  try:
    for i, rows in enumerate(args.batches):
      _, trainer = benchmark_case.make_trainer(
          preset, method, rows, clip_norm=1.0, noise_multiplier=1.0, dropout_rate=0.0, dtype=args.dtype,
          devices=devices, overrides=dict(scan_layers=scan, remat_policy=policy), mesh_shape=args.mesh)
      compiled, seconds = _compile(trainer, rows, args)
      if i == 0:
        row["compile_s"] = round(seconds, 2)
      memories.append(benchmark_case.compiled_memory(compiled))
      del compiled, trainer
      jax.clear_caches()
  except ConfigError as e:
    row["skipped"] = str(e)
    return row
  m1 = memories[0]
  row.update(temp_bytes_per_device=m1["temp_size_in_bytes"], argument_bytes_per_device=m1["argument_size_in_bytes"],
             peak_bytes_per_device=m1["peak_bytes"])
  if len(memories) == 1:  # compile time and memory at one batch: no fit
    return row
  (b1, b2), m2 = args.batches, memories[1]
  per_position = lambda b: b // args.mesh[0]
  slope = (m2["peak_bytes"] - m1["peak_bytes"]) / (per_position(b2) - per_position(b1))
  fixed = m1["peak_bytes"] - slope * per_position(b1)
  budget = args.memory_gib * GIB
  fits = 0 if fixed > budget else (10 ** 9 if slope <= 0 else int((budget - fixed) // slope))
  row.update(activation_bytes_per_example=int((m2["temp_size_in_bytes"] - m1["temp_size_in_bytes"])
                                              / (per_position(b2) - per_position(b1))),
             fixed_bytes_per_device=int(fixed), max_batch_per_device=fits)
  return row


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  if args.target == "cpu" and math.prod(args.mesh) > 1 and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={math.prod(args.mesh)}").strip()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  devices = _devices(args)
  if len(devices) < math.prod(args.mesh):
    raise SystemExit(f"--mesh={args.mesh} needs {math.prod(args.mesh)} devices, {len(devices)} are there")
  rows = []
  for preset in args.presets:
    for method in args.methods:
      for scan in args.scans:
        for policy in args.remat_policies:
          row = run_row(preset, method, scan, policy, devices, args)
          rows.append(row)
          if "skipped" in row:
            print(f"{preset} {method} scan={scan} remat={policy}: skipped ({row['skipped'][:90]}...)", flush=True)
          else:
            fit = ("" if "max_batch_per_device" not in row else
                   f", {row['activation_bytes_per_example'] / 2**20:.1f} MiB an example, max batch "
                   f"{row['max_batch_per_device']} a device in {args.memory_gib:g} GiB")
            print(f"{preset} {method} scan={scan} remat={policy}: compile {row['compile_s']:.1f}s, temp "
                  f"{row['temp_bytes_per_device'] / GIB:.2f} GiB at batch {args.batches[0]}{fit}", flush=True)
          if args.out:
            with open(args.out, "w") as f:
              json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
