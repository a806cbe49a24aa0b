"""Where DP-ghost's extra compile time goes: the train step, or its finalize program alone (noise
and Adafactor), compiled with the noise made in other ways (a probe for the docs' "Compile time
and program size"; not a product path).

  python benchmarks/noise_compile_probe.py [--program=step|finalize] [--preset=t5_1_1_small]
      [--batch=32] [--dtype=bfloat16] [--variants=current,none,...] [--count_kernels]

For T5 v1.1 small at 512/114 (by default) it prints the trace + lower and compile CPU seconds and the
compiled program's temporaries (and with --count_kernels the number of kernels XLA's CPU compiler built: one per distinct fused
computation, so the identical fusions of same-shaped parameters share one) of the non-DP program and
of the DP-ghost program with its noise
  current  as it is (`noise.gaussian_like`: on a CPU, one threefry loop per parameter shape);
  batched  the draw of an accelerator (`noise.normal_rows(..., loop=False)`: each shape's rows
           vmapped into one draw, the same normals) compiled for this CPU;
  none     a broadcast constant (the program without noise);
  iota     a cheap non-random tensor per parameter;
  bits     raw threefry bits, without the normal transform;
  rbg      XLA's RngBitGenerator instead of threefry;
  input    (finalize only) no draw: one program input per parameter;
  stacked  (finalize only) no draw: one program input per parameter shape, sliced per parameter.
Each case runs in a fresh process. With --gram_loop the DP-ghost programs compute the Gram norms
of sequences longer than 128 positions in a `fori_loop` over blocks of rows (how it was done
before) instead of the unrolled chain of `ghost_norms.gram_sq_norms` (same memory, no device loop;
T5 v1.1 base at 512 inputs has 36 such layers, small none).
"""
import argparse
import glob
import json
import os
import resource
import subprocess
import sys
import tempfile

STEP_VARIANTS = ("current", "batched", "none", "iota", "bits", "rbg")
FINALIZE_VARIANTS = STEP_VARIANTS + ("input", "stacked")


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _groups(leaves):
  out = {}
  for i, leaf in enumerate(leaves):
    out.setdefault(tuple(leaf.shape), []).append(i)
  return out


def _patch(variant: str, given: dict) -> None:
  """Replaces `noise.gaussian_like` (the draw) for one probe variant; `input` and `stacked`
  return the arrays the probed program receives (`given["noise"]`)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from private_t5.dp import noise as noise_lib  # pylint: disable=g-import-not-at-top

  def per_group(draw_fn):
    def gaussian_like(key, leaves):
      out = [None] * len(leaves)
      for g, (shape, members) in enumerate(_groups(leaves).items()):
        draw = draw_fn(jax.random.fold_in(key, g), (len(members),) + shape)
        for row, i in enumerate(members):
          out[i] = draw[row]
      return out
    return gaussian_like

  def rbg(key, shape):
    _, bits = jax.lax.rng_bit_generator(jnp.concatenate([key, key]).astype(jnp.uint32), shape, dtype=jnp.uint32)
    u = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    return jnp.sqrt(2.0) * jax.lax.erf_inv(2 * jnp.clip(u, 1e-7, 1 - 1e-7) - 1)

  def stacked(key, leaves):
    del key
    out = [None] * len(leaves)
    for draw, members in zip(given["noise"], _groups(leaves).values()):
      for row, i in enumerate(members):
        out[i] = draw[row]
    return out

  def batched(key, leaves):
    out = [None] * len(leaves)
    for g, (shape, members) in enumerate(_groups(leaves).items()):
      draw = noise_lib.normal_rows(jax.random.fold_in(key, g), len(members), shape, loop=False)
      for row, i in enumerate(members):
        out[i] = draw[row]
    return out

  if variant == "batched":
    noise_lib.gaussian_like = batched
  elif variant == "none":
    noise_lib.gaussian_like = lambda key, leaves: [jnp.zeros(l.shape, jnp.float32) + key[0].astype(jnp.float32)
                                                   for l in leaves]
  elif variant == "iota":
    noise_lib.gaussian_like = lambda key, leaves: [
        ((jax.lax.iota(jnp.uint32, int(l.size)).reshape(l.shape) * (key[0] + i)) >> 9).astype(jnp.float32)
        for i, l in enumerate(leaves)]
  elif variant == "bits":
    noise_lib.gaussian_like = per_group(lambda k, shape: jax.random.bits(k, shape, jnp.uint32).astype(jnp.float32))
  elif variant == "rbg":
    noise_lib.gaussian_like = per_group(rbg)
  elif variant == "input":
    noise_lib.gaussian_like = lambda key, leaves: list(given["noise"])
  elif variant == "stacked":
    noise_lib.gaussian_like = stacked


def _patch_gram_loop() -> None:
  """The Gram norms in a device loop over blocks of rows, the last block shifted back and masked."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from private_t5.dp import ghost_norms as gn  # pylint: disable=g-import-not-at-top
  unrolled = gn.gram_sq_norms

  def gram_sq_norms(a, g, block=gn.GRAM_BLOCK):
    a, g = gn.as_sequence(a, None), gn.as_sequence(g, None)
    seq = a.shape[1]
    if seq <= block:
      return unrolled(a, g, block)

    def body(j, total):
      start = jnp.minimum(j * block, seq - block)
      rows = lambda x: jax.lax.dynamic_slice_in_dim(x, start, block, axis=1)
      aa = gn.contract("bsi,bti->bst", rows(a), a)
      gg = gn.contract("bso,bto->bst", rows(g), g)
      new = (start + jnp.arange(block)) >= j * block
      return total + jnp.sum(jnp.where(new[None, :, None], aa * gg, 0.0), axis=(1, 2))

    return jax.lax.fori_loop(0, -(-seq // block), body, jnp.zeros((a.shape[0],), jnp.float32))

  gn.gram_sq_norms = gram_sq_norms


def _lowered(args, given):
  """The probed program, lowered: the fused train step, or the finalize program (noise and
  Adafactor on a finished clipped sum), with the noise as an input for `input`/`stacked`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case  # pylint: disable=g-import-not-at-top
  config, trainer = benchmark_case.make_trainer(args.preset, args.method, args.batch, 1.0, 1.0, None, args.dtype)
  key = jax.random.PRNGKey(0)
  state = trainer.abstract_state()
  if args.program == "step":
    batch = benchmark_case.random_batch(config.vocab_size, args.batch, args.inputs, args.targets, 0)
    return trainer.lower_train_step(state, batch, key, key)
  acc = jax.eval_shape(trainer.aggregator.zero_sum, state.params)
  leaves = jax.tree.leaves(state.params)
  if args.variant == "input":
    noise = [jax.ShapeDtypeStruct(l.shape, jnp.float32) for l in leaves]
  elif args.variant == "stacked":
    noise = [jax.ShapeDtypeStruct((len(m),) + s, jnp.float32) for s, m in _groups(leaves).items()]
  else:
    noise = []

  def finalize(state, acc, key, noise):
    given["noise"] = noise
    return trainer._apply_fn(state, None, acc, key)  # pylint: disable=protected-access

  with trainer._mesh_context():  # pylint: disable=protected-access
    return jax.jit(finalize, donate_argnums=(0,)).lower(state, acc, key, noise)


def _one(args) -> dict:
  given = {}
  _patch(args.variant, given)
  if args.gram_loop:
    _patch_gram_loop()
  c0 = _cpu()
  lowered = _lowered(args, given)
  c1 = _cpu()
  compiled = lowered.compile()
  c2 = _cpu()
  memory = compiled.memory_analysis()
  kernels = len(glob.glob(os.path.join(args.dump_dir, "*ir-no-opt.ll"))) if args.dump_dir else None
  return {"program": args.program, "method": args.method, "variant": args.variant,
          "trace_lower_cpu_s": round(c1 - c0, 2), "compile_cpu_s": round(c2 - c1, 2), "kernels": kernels,
          "temp_mib": None if memory is None else round(memory.temp_size_in_bytes / 2 ** 20, 1)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--program", choices=("step", "finalize"), default="step")
  p.add_argument("--preset", default="t5_1_1_small")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--inputs", type=int, default=512)
  p.add_argument("--targets", type=int, default=114)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--variants", default=None, help="comma-separated (default: all of the program's)")
  p.add_argument("--gram_loop", action="store_true",
                 help="DP-ghost's Gram norms in a device loop over blocks of rows (as before), not unrolled")
  p.add_argument("--count_kernels", action="store_true",
                 help="dump the kernels' LLVM IR to count them (the compile times then include the dump)")
  p.add_argument("--method", default=None, help=argparse.SUPPRESS)
  p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
  p.add_argument("--dump_dir", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.method:
    print(json.dumps(_one(args)), flush=True)
    return 0
  known = STEP_VARIANTS if args.program == "step" else FINALIZE_VARIANTS
  variants = known if args.variants is None else tuple(args.variants.split(","))
  unknown = sorted(set(variants) - set(known))
  if unknown:
    p.error(f"unknown variants for --program={args.program}: {', '.join(unknown)} (known: {', '.join(known)})")
  common = [f"--program={args.program}", f"--preset={args.preset}", f"--batch={args.batch}",
            f"--inputs={args.inputs}", f"--targets={args.targets}", f"--dtype={args.dtype}"]
  common += ["--gram_loop"] if args.gram_loop else []
  rows = []
  for method, variant in [("nondp", "current")] + [("ghost", v) for v in variants]:
    with tempfile.TemporaryDirectory() as dump:
      env = dict(os.environ)
      extra = [f"--dump_dir={dump}"] if args.count_kernels else []
      if args.count_kernels:  # the kernels' IR, one file each
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                            " --xla_dump_hlo_module_re=.*(train_step|finalize).*").strip()
      out = subprocess.run([sys.executable, __file__, *common, f"--method={method}", f"--variant={variant}", *extra],
                           check=True, capture_output=True, text=True, env=env).stdout
    rows.append(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]["compile_cpu_s"]
  for r in rows[1:]:
    kernels = "" if r["kernels"] is None else f"; {r['kernels']} kernels (non-DP {rows[0]['kernels']})"
    print(f"{args.program}, ghost, noise {r['variant']:8s}: compile {r['compile_cpu_s']:6.1f} CPU s = "
          f"{r['compile_cpu_s'] / base:.2f}x non-DP ({base:.1f}); temporaries {r['temp_mib']} MiB "
          f"(non-DP {rows[0]['temp_mib']}){kernels}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
