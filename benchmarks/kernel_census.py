"""Kernel census: the device kernels one train (or decode) step launches on an H100/H200.

Compiles the step of T5 v1.1 small (`t5_1_1_small`, 512 input / 114 target tokens, bfloat16
activations) for a compile-only NVIDIA H100 or H200 on a machine without a GPU (the CUDA
plugin's compiler with a target description of the card, nothing is run), and counts the
kernels of XLA:GPU's thunk sequence (`private_t5.train.thunk_census`).

  scripts/install_kernel_census.sh            # once: a venv with the CUDA plugin
  $HOME/.cache/private_t5/venv-census/bin/python benchmarks/kernel_census.py \
      [--cases=h100_nondp_b32,h100_ghost_b32] [--out=/tmp/kernel_census] [--keep_dumps] [--list] [--fewer_kernels] [--scan_layers] [--remat_policy=none|minimal|full]

Cases:

* `{h100|h200}_{nondp|vmap|ghost}_{b32|b256}[_cudnn]`: the train step
  (`benchmark_case.make_trainer`) on a batch of 32 or 256 rows.
* `{h100|h200}_{nondp|ghost}_stacked_256x{32|64|128}[_cudnn]`: the stacked-microbatch step
  (`Trainer._train_step_stacked`): expected 256 rows in K = 8, 4 or 2 microbatches of 32, 64 or
  128 rows, a count of K (the loop over the microbatches runs K times: its body counts K times).
* `{h100|h200}_decode_b32`: memorization's greedy decode (`MeshInference.lower_decode`) of 32
  prompts of 512 tokens, 114 generated tokens.

`_cudnn` compiles with `attention="cudnn"` (default: the preset's "einsum", our einsums and softmax). Each case compiles in a subprocess
and writes `--out/NAME.json`: kernels_per_step, the counts by kind and by fusion family,
command buffers, while loops, temp/argument/output bytes (`memory_analysis`), compile seconds,
the top 15 kernel families and the jax/jaxlib/plugin versions. `--keep_dumps` keeps XLA's dump
under `--out/dumps/NAME`.
"""
import argparse
import glob
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from private_t5.train import thunk_census  # pylint: disable=wrong-import-position

PRESET = "t5_1_1_small"
INPUTS, TARGETS = 512, 114
DTYPE = "bfloat16"
MICROBATCH, STACKED = 32, 8
XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false"
PLUGIN = "jax-cuda12-plugin"
INSTALL_HINT = "scripts/install_kernel_census.sh"
TARGETS_ = ("h100", "h200")
CASE_RE = re.compile(r"^(h100|h200)_(?:(nondp|vmap|ghost)_b(32|256)|(nondp|ghost)_stacked_256x(32|64|128)"
                     r"|(decode)_b32)(_cudnn)?$")

# -- target descriptions (hardware facts of the cards) -----------------------------------------

# Per card: marketing name, HBM bandwidth (bytes/s), memory (bytes), memory clock (kHz).
CARDS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", bandwidth=3352320000000, memory=84942979072,
                 memory_clock_khz=2619000),
    "h200": dict(name="NVIDIA H200 141GB HBM3e", bandwidth=4800000000000, memory=151397597184,
                 memory_clock_khz=3750000),
}
# Scalar units of an SM 9.0 core: (data type key, units per core, ops per clock).
SCALAR_RATES = ((4, 64, 1), (8, 64, 1), (10, 128, 2), (11, 128, 1), (12, 64, 1), (16, 128, 2))
# Tensor cores (4 per core): (data type key, ops per clock).
MATRIX_RATES = ((2, 1024), (6, 1024), (10, 512), (11, 256), (12, 32), (16, 512)) + tuple(
    (k, 1024) for k in (19, 20, 23, 24, 25, 28, 29, 33, 35, 36))
CORE_CLOCK_GHZ = 1.98
TENSOR_CLOCK_GHZ = 1.8295201


def _rates(rows, matrix: bool) -> str:
  out = []
  for row in rows:
    if matrix:
      key, units, ops = row[0], 4, row[1]
      clock = CORE_CLOCK_GHZ if key == 12 else TENSOR_CLOCK_GHZ
    else:
      key, units, ops = row
      clock = CORE_CLOCK_GHZ
    out.append("    rate_infos {\n      key: %d\n      value {\n        clock_rate_ghz: %s\n"
               "        units_per_core: %d\n        ops_per_clock: %d\n      }\n    }"
               % (key, clock, units, ops))
  return "\n".join(out)


def target_spec(name: str) -> str:
  """The GpuTargetConfigProto text of card `name` ("h100" or "h200") for a compile-only device."""
  if name not in CARDS:
    raise ValueError("unknown target %r (one of %s)" % (name, ", ".join(CARDS)))
  card = CARDS[name]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {card['bandwidth']}
  l2_cache_size: 52428800
  clock_rate_ghz: {CORE_CLOCK_GHZ}
  device_memory_size: {card['memory']}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
    feature_extension: ACCELERATED_FEATURES
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  scalar_unit_description {{
{_rates(SCALAR_RATES, False)}
  }}
  matrix_unit_description {{
{_rates(MATRIX_RATES, True)}
  }}
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  model_str: "sm_9.0a with {card['memory']}B RAM, 132 cores, 1980000KHz clock, {card['memory_clock_khz']}KHz mem clock, 52428800B L2$"
  device_address_bits: 64
  pcie_bandwidth: 34359738368
  ecc_enabled: true
  name: "{card['name']}"
  driver_version: "13.0.0"
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0"
  cub_version: "3.1.2"
  device_interconnect_info {{
    active_links: 18
  }}
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
  patch: 0
}}
device_description_str: "{card['name']}"
"""


# -- cases -----------------------------------------------------------------------------------


def all_cases():
  """Every case name, in run order."""
  names = []
  for target in TARGETS_:
    for method in ("nondp", "vmap", "ghost"):
      for batch in (32, 256):
        names += ["%s_%s_b%d" % (target, method, batch), "%s_%s_b%d_cudnn" % (target, method, batch)]
    for method in ("nondp", "ghost"):
      names += ["%s_%s_stacked_256x32" % (target, method), "%s_%s_stacked_256x32_cudnn" % (target, method)]
    names.append("%s_decode_b32" % target)
  return names


def parse_case(name: str) -> dict:
  """target, method, batch, stacked, attention of a case name; ValueError if unknown."""
  m = CASE_RE.match(name)
  if m is None:
    raise ValueError(name)
  target, method, batch, stacked_method, micro, decode, cudnn = m.groups()
  if decode and cudnn:
    raise ValueError(name)
  if decode:
    return dict(case=name, target=target, method="decode", batch=32, stacked=False,
                attention="einsum")
  if stacked_method:
    return dict(case=name, target=target, method=stacked_method, batch=MICROBATCH * STACKED,
                microbatch=int(micro), stacked=MICROBATCH * STACKED // int(micro),
                attention="cudnn" if cudnn else "einsum")
  return dict(case=name, target=target, method=method, batch=int(batch), stacked=False,
              attention="cudnn" if cudnn else "einsum")


def plugin_version():
  """The installed CUDA plugin's version, None without it."""
  try:
    return importlib.metadata.version(PLUGIN)
  except importlib.metadata.PackageNotFoundError:
    return None


def _lower(case: dict, device, fewer_kernels: bool = False, scan_layers: bool = False, remat_policy: str = "none"):
  """The lowered step of a case for the compile-only `device`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case  # pylint: disable=g-import-not-at-top
  from private_t5.models import mesh_inference  # pylint: disable=g-import-not-at-top
  from private_t5.train import optimizers, partitioning, trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from private_t5.models import sharding  # pylint: disable=g-import-not-at-top

  mesh = sharding.create_mesh((1, 1), [device])
  if case["method"] == "decode":
    config = config_lib.load_preset(PRESET, dtype=DTYPE, scan_layers=scan_layers, remat_policy=remat_policy)
    inference = mesh_inference.MeshInference(config, mesh)
    return inference.lower_decode(case["batch"], INPUTS, TARGETS, use_cache=True)
  _, trainer = benchmark_case.make_trainer(
      PRESET, case["method"], case["batch"], clip_norm=1.0, noise_multiplier=1.0,
      dropout_rate=None, dtype=DTYPE, attention=None if case["attention"] == "einsum" else case["attention"],
      devices=[device], stack_layers=fewer_kernels, overrides=dict(scan_layers=scan_layers, remat_policy=remat_policy),
      optimizer=optimizers.adafactor(learning_rate=1e-3, batched_over_shapes=fewer_kernels))
  state = trainer.abstract_state()
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
  rows = case.get("microbatch") or case["batch"]
  host = trainer_lib.device_features(
      benchmark_case.random_batch(trainer.model_config.vocab_size, rows, INPUTS, TARGETS, 0))
  if not case["stacked"]:
    rows_sharding = sharding.batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows_sharding)
             for k, v in host.items()}
    return trainer.lower_train_step(state, batch, key, key)
  stacked_sharding = partitioning.stacked_batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct((case["stacked"],) + v.shape, v.dtype, sharding=stacked_sharding)
           for k, v in host.items()}
  count = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
  with trainer._mesh_context():  # pylint: disable=protected-access
    traced = trainer._train_step_stacked.trace(  # pylint: disable=protected-access
        state, trainer._base, batch, count, key, key)  # pylint: disable=protected-access
    return traced.lower()


def _read(pattern: str) -> str:
  files = sorted(glob.glob(pattern))
  if not files:
    raise FileNotFoundError("no dump file %s" % pattern)
  # The module of the step is the largest one (the dump may hold small helper modules).
  return open(max(files, key=os.path.getsize)).read()


def _dump_module(dump: str) -> str:
  """The prefix of the step's module in the dump (the module with the longest thunk sequence)."""
  files = [f for f in glob.glob(os.path.join(dump, "*thunk_sequence.txt"))]
  if not files:
    raise FileNotFoundError("no *thunk_sequence.txt in %s" % dump)
  return max(files, key=os.path.getsize)[:-len("thunk_sequence.txt")]


def run_case(name: str, out: str, keep_dumps: bool, fewer_kernels: bool = False, scan_layers: bool = False,
             remat_policy: str = "none") -> dict:
  """Compiles one case, counts its kernels and writes `out/NAME.json` (in this process)."""
  case = parse_case(name)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topology = topologies.get_topology_desc(platform="cuda", target_config=target_spec(case["target"]),
                                          topology="1x1x1")
  device = topology.devices[0]
  dump = tempfile.mkdtemp(prefix="kernel_census_%s_" % name)
  start = time.perf_counter()
  compiled = _lower(case, device, fewer_kernels, scan_layers, remat_policy).compile({"xla_dump_to": dump})
  compile_s = time.perf_counter() - start
  prefix = _dump_module(dump)
  names = thunk_census.while_names(_read(prefix + "thunk_metadata.txt"))
  trips = thunk_census.known_trip_counts(_read(prefix + "*after_optimizations.txt"))
  known = set(trips)
  # A loop the compiler cannot count: the stacked step's loop over `count` microbatches, the
  # decode's loop over generated tokens.
  trips["default"] = case["stacked"] or (TARGETS if case["method"] == "decode" else 1)
  result = thunk_census.census(open(prefix + "thunk_sequence.txt").read(), trips=trips, names=names)
  after = None
  if os.path.exists(prefix + "thunk_sequence_after_thunk_passes.txt"):
    after = thunk_census.census(open(prefix + "thunk_sequence_after_thunk_passes.txt").read(),
                                trips=trips, names=names)
  for loop in result["loops"]:
    loop["trips_from"] = "hlo" if loop["name"] in known else "default"
  memory = compiled.memory_analysis()
  row = dict(case)
  row.update(
      kernels_per_step=result["kernels_per_step"],
      kernels_static=result["kernels_static"],
      counts=result["counts"], counts_per_step=result["counts_per_step"],
      fusion_families=result["fusion_families"],
      command_buffers=result["command_buffers"], while_loops=result["while_loops"],
      loops=result["loops"],
      temp_bytes=int(memory.temp_size_in_bytes), argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes), alias_bytes=int(memory.alias_size_in_bytes),
      compile_s=round(compile_s, 2),
      top_families=[list(kv) for kv in thunk_census.top_families(result, 15)],
      dump_module=os.path.basename(prefix.rstrip(".")),
      versions=dict(jax=jax.__version__, jaxlib=importlib.metadata.version("jaxlib"),
                    plugin=plugin_version(), pjrt=_version("jax-cuda12-pjrt")),
      xla_flags=os.environ.get("XLA_FLAGS", ""), fewer_kernels=bool(fewer_kernels),
      scan_layers=bool(scan_layers), remat_policy=remat_policy)
  if after is not None:
    row["after_thunk_passes"] = dict(command_buffers=after["command_buffers"],
                                     kernels_per_step=after["kernels_per_step"])
    if after["kernels_per_step"] != result["kernels_per_step"]:
      row["after_thunk_passes_kernels_differ"] = True
  if keep_dumps:
    target = os.path.join(out, "dumps", name)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(dump, target)
  shutil.rmtree(dump, ignore_errors=True)
  with open(os.path.join(out, name + ".json"), "w") as f:
    json.dump(row, f, indent=1)
  return row


def _version(package: str):
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _environment() -> dict:
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "")
  if XLA_FLAGS not in flags.split():
    env["XLA_FLAGS"] = (flags + " " + XLA_FLAGS).strip()
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


def _known(name: str) -> bool:
  try:
    parse_case(name)
  except ValueError:
    return False
  return True


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", default="", help="comma-separated case names (default: all; --list)")
  p.add_argument("--out", default="/tmp/kernel_census", help="folder of the NAME.json results")
  p.add_argument("--keep_dumps", action="store_true", help="keep XLA's dump under OUT/dumps/NAME")
  p.add_argument("--list", action="store_true", help="print the case names and exit")
  p.add_argument("--fewer_kernels", action="store_true",
                 help="train steps with Adafactor batched over parameter shapes "
                      "(optimizers.adafactor(batched_over_shapes=True)) and, for DP-ghost, the layers of one "
                      "shape stacked (GhostDPAggregator(stack_layers=True))")
  p.add_argument("--scan_layers", action="store_true",
                 help="the network's layers as one scanned stack a side (T5Config.scan_layers: stacked parameters, "
                      "Adafactor and ghost norms over the layer axis)")
  p.add_argument("--remat_policy", default="none", choices=("none", "minimal", "full"),
                 help="T5Config.remat_policy of the network (with --scan_layers for DP-ghost)")
  p.add_argument("--run_one", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _parse_args(argv)
  if args.list:
    print("\n".join(all_cases()))
    return 0
  names = [c for c in args.cases.split(",") if c] or all_cases()
  unknown = [c for c in names if not _known(c)]
  if unknown:
    print("kernel_census: unknown case %s (see --list)" % ", ".join(unknown), file=sys.stderr)
    return 2
  if plugin_version() is None:
    print("kernel_census: the CUDA plugin (%s) is not installed in %s; run %s and use its venv's "
          "python" % (PLUGIN, sys.prefix, INSTALL_HINT), file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  if args.run_one:
    os.environ.update(_environment())  # before JAX is imported
    run_case(args.run_one, args.out, args.keep_dumps, args.fewer_kernels, args.scan_layers, args.remat_policy)
    return 0
  failed = 0
  for name in names:
    cmd = [sys.executable, os.path.abspath(__file__), "--run_one=" + name, "--out=" + args.out]
    if args.keep_dumps:
      cmd.append("--keep_dumps")
    if args.fewer_kernels:
      cmd.append("--fewer_kernels")
    if args.scan_layers:
      cmd.append("--scan_layers")
    cmd.append("--remat_policy=" + args.remat_policy)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=_environment(), capture_output=True, text=True, check=False)
    path = os.path.join(args.out, name + ".json")
    if proc.returncode != 0:
      failed += 1
      tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
      print("%-32s FAILED (%.0f s): %s" % (name, time.perf_counter() - start, tail[0]), flush=True)
      continue
    with open(path) as f:
      row = json.load(f)
    print("%-32s kernels/step %6d  gemm %5d  memcpy %5d  temp %6.2f GiB  compile %5.1f s"
          % (name, row["kernels_per_step"], row["counts_per_step"].get("gemm", 0),
             row["counts_per_step"].get("memcpy", 0), row["temp_bytes"] / 2**30, row["compile_s"]),
          flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
