"""Decoding on a device mesh: memorization's greedy decode on 1, 2, 4 and 8 devices, and the
per-device memory of a large model's decode program split over a (data, model) mesh.

  .venv/bin/python benchmarks/bench_decode_mesh.py [--devices=1,2,4,8] [--preset=t5_1_0_tiny]
      [--batches=16] [--memory_preset=t5_1_1_xl] [--memory_dtype=float32] [--out=/tmp/bench_decode_mesh.json]

(`--devices= ` skips the throughput runs, `--memory_preset= ` the memory case.)

* throughput: `models.mesh_inference.MeshInference.decode`, the decode of `private-t5
  memorization`, greedy with the KV cache on random parameters of `--preset`, prompts of
  `--prompt_length` tokens (EOS disabled, so every row generates all `--generation_length`
  tokens), a global batch of `--batch_size` rows split over the `data` axis of a (N, 1) mesh of
  N fake CPU devices (`--xla_force_host_platform_device_count=N`). Each N runs in a fresh
  process: one pass compiles, a second is timed (wall and CPU seconds of the process).
* memory: the decode program of `--memory_preset` for one global batch, lowered from shapes
  alone and compiled (never run), on one device and on 8 fake devices with an (8, 1) and a
  (2, 4) mesh (parameters by training's `LOGICAL_AXIS_RULES`): XLA's `memory_analysis` per
  device (arguments, outputs, temporaries) against the one-device program.

* hf (`--case=hf`): the same greedy decode by Hugging Face `generate` (PyTorch, CPU) on the
  weights exported from the same parameters (`models.hf_export`), beside our decode on one
  device in the same process, float32: wall and CPU seconds, and the fraction of tokens that agree.

Fills the tables of docs/performance.md, "Decoding on the mesh". Results are printed and written
as JSON to `--out`.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30


def _child_env(devices: int) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
  return env


def throughput(args) -> dict:
  """One process: tokens/s of the decode on a (devices, 1) mesh."""
  import jax
  import numpy as np
  from private_t5.models import config as config_lib
  from private_t5.models import network
  from private_t5.models import mesh_inference, sharding
  config = config_lib.load_preset(args.preset)
  params = network.init_params(config, jax.random.PRNGKey(0))
  mesh = sharding.create_mesh((args.run_devices, 1))
  inference = mesh_inference.MeshInference(config, mesh, params=params)
  rows = args.batch_size * args.batches
  inputs = np.random.default_rng(0).integers(3, config.vocab_size, (rows, args.prompt_length)).astype(np.int32)
  decode = lambda: inference.decode(inputs, args.generation_length, batch_size=args.batch_size, eos_id=-1)
  t0 = time.time()
  first = decode()  # compiles
  compile_pass = time.time() - t0
  cpu0, t0 = time.process_time(), time.time()
  second = decode()
  wall, cpu = time.time() - t0, time.process_time() - cpu0
  assert (first == second).all()
  tokens = rows * args.generation_length
  return {"devices": args.run_devices, "preset": args.preset, "batch_size": args.batch_size,
          "prompt_length": args.prompt_length, "generation_length": args.generation_length, "prompts": rows,
          "tokens": tokens, "first_pass_seconds": round(compile_pass, 2), "wall_seconds": round(wall, 2),
          "cpu_seconds": round(cpu, 2), "tokens_per_second": round(tokens / wall, 1),
          "tokens_per_cpu_second": round(tokens / cpu, 1)}


def hugging_face(args) -> dict:
  """One process: the same decode (random parameters of `--preset` from the same key, the same
  prompts, greedy, all `--generation_length` tokens) by Hugging Face `generate` on the exported
  weights (`models.hf_export`), PyTorch on the CPU; beside it our decode on one device, in the same
  process, and the fraction of generated tokens that agree (float32 on both sides)."""
  import jax
  import numpy as np
  import torch
  import transformers
  from private_t5.models import config as config_lib
  from private_t5.models import network
  from private_t5.models import hf_export, mesh_inference, sharding
  config = config_lib.load_preset(args.preset, dtype="float32")
  params = jax.tree.map(np.asarray, network.init_params(config, jax.random.PRNGKey(0)))
  tensors, hf = hf_export.export_hf_t5(params, config)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf)).eval()
  model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, strict=False)
  rows = args.batch_size * args.batches
  inputs = np.random.default_rng(0).integers(3, config.vocab_size, (rows, args.prompt_length)).astype(np.int32)
  n = args.generation_length

  def hf_decode():
    out = []
    with torch.no_grad():
      for i in range(0, rows, args.batch_size):
        ids = torch.from_numpy(inputs[i:i + args.batch_size].astype(np.int64))
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, num_beams=1, decoder_start_token_id=0)
        out.append(got[:, 1:1 + n].numpy())
    return np.concatenate(out)

  inference = mesh_inference.MeshInference(config, sharding.create_mesh((1, 1), jax.devices()[:1]), params=params)
  ours_decode = lambda: np.asarray(inference.decode(inputs, n, batch_size=args.batch_size, eos_id=-1))
  out = {"preset": args.preset, "dtype": "float32", "batch_size": args.batch_size, "prompts": rows,
         "prompt_length": args.prompt_length, "generation_length": n, "torch_threads": torch.get_num_threads()}
  results = {}
  for name, fn in (("hugging_face_generate", hf_decode), ("private_t5_one_device", ours_decode)):
    fn()  # warm (and compile)
    cpu0, t0 = time.process_time(), time.time()
    results[name] = fn()
    wall, cpu = time.time() - t0, time.process_time() - cpu0
    out[name] = {"wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
                 "tokens_per_second": round(rows * n / wall, 1), "tokens_per_cpu_second": round(rows * n / cpu, 1)}
  ours, theirs = results["private_t5_one_device"][:, :n], results["hugging_face_generate"]
  out["same_tokens_fraction"] = round(float((ours[:, :theirs.shape[1]] == theirs).mean()), 4)
  return out


def memory(args) -> dict:
  """One process of 8 fake devices: the decode program's per-device memory, compiled only."""
  import jax
  from private_t5.models import config as config_lib
  from private_t5.models import network
  from private_t5.models import mesh_inference, sharding
  config = config_lib.load_preset(args.memory_preset, **({"dtype": args.memory_dtype} if args.memory_dtype else {}))
  out = {"preset": args.memory_preset, "dtype": config.dtype, "parameters": network.num_params(config),
         "batch_size": args.memory_batch_size, "prompt_length": args.prompt_length,
         "generation_length": args.generation_length, "meshes": []}
  for shape in ((1, 1), (8, 1), (2, 4)):
    mesh = sharding.create_mesh(shape, jax.devices()[:shape[0] * shape[1]])
    inference = mesh_inference.MeshInference(config, mesh)
    t0 = time.time()
    compiled = inference.lower_decode(args.memory_batch_size, args.prompt_length, args.generation_length).compile()
    analysis = compiled.memory_analysis()
    parts = {name: int(getattr(analysis, f"{name}_size_in_bytes")) for name in ("argument", "output", "temp")}
    entry = {"mesh_shape": list(shape), "devices": shape[0] * shape[1],
             "compile_seconds": round(time.time() - t0, 1),
             "parameter_bytes_per_device": sharding.bytes_per_device(inference.abstract_params()),
             **{f"{k}_bytes": v for k, v in parts.items()}, "total_bytes": sum(parts.values())}
    out["meshes"].append(entry)
    print(json.dumps(entry), flush=True)
  one = out["meshes"][0]["total_bytes"]
  for entry in out["meshes"]:
    entry["fraction_of_one_device"] = round(entry["total_bytes"] / one, 3)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", default="1,2,4,8", help="device counts of the throughput runs")
  p.add_argument("--preset", default="t5_1_0_tiny")
  p.add_argument("--prompt_length", type=int, default=128)
  p.add_argument("--generation_length", type=int, default=32)
  p.add_argument("--batch_size", type=int, default=32, help="global batch of the throughput runs")
  p.add_argument("--batches", type=int, default=4, help="batches a timed pass decodes")
  p.add_argument("--memory_preset", default="t5_1_1_xl", help="model of the compile-only memory case ('' skips)")
  p.add_argument("--memory_batch_size", type=int, default=32)
  p.add_argument("--memory_dtype", default="", help="activation dtype of the memory case (default: the preset's)")
  p.add_argument("--out", default="/tmp/bench_decode_mesh.json")
  p.add_argument("--case", choices=("all", "throughput", "memory", "hf"), default="all",
                 help="hf: Hugging Face generate against our decode on one device (needs the hf extra)")
  p.add_argument("--run_devices", type=int, default=0, help=argparse.SUPPRESS)  # a child process's N
  args = p.parse_args(argv)
  if args.case == "hf":  # run here, on one device, and written to --out
    result = dict(hugging_face(args), uptime=os.popen("uptime").read().strip())
    print(json.dumps(result, indent=2))
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)
    return 0
  if args.case != "all":  # a child process
    print("RESULT " + json.dumps(throughput(args) if args.case == "throughput" else memory(args)), flush=True)
    return 0
  result = {"uptime_before": os.popen("uptime").read().strip(), "throughput": [], "memory": None}
  common = [f"--preset={args.preset}", f"--prompt_length={args.prompt_length}",
            f"--generation_length={args.generation_length}", f"--batch_size={args.batch_size}",
            f"--batches={args.batches}", f"--memory_preset={args.memory_preset}",
            f"--memory_batch_size={args.memory_batch_size}", f"--memory_dtype={args.memory_dtype}"]
  runs = [("throughput", int(n)) for n in args.devices.split(",") if n]
  if args.memory_preset:
    runs.append(("memory", 8))
  for case, devices in runs:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), f"--case={case}", f"--run_devices={devices}",
                           *common], env=_child_env(devices), cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
      print(done.stdout[-2000:] + done.stderr[-3000:], file=sys.stderr)
      return 1
    entry = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(entry), flush=True)
    if case == "throughput":
      result["throughput"].append(entry)
    else:
      result["memory"] = entry
  result["uptime_after"] = os.popen("uptime").read().strip()
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
