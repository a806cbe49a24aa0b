"""Where DP-ghost's extra compile time goes: the train step compiled with the noise drawn in
other ways (a probe for the docs' "Compile time and program size"; not a product path).

  python scripts/noise_compile_probe.py [--preset=t5_1_1_small] [--batch=32] [--dtype=bfloat16]

Prints, for T5 v1.1 small at 512/114 (by default), the trace + lower and compile CPU seconds of
the non-DP step and of the DP-ghost step with its noise as it is (`current`), replaced by a
broadcast constant (`none`: the step without noise), by a cheap non-random tensor per parameter
(`iota`), by raw threefry bits without the normal transform (`bits`), and by XLA's
RngBitGenerator (`rbg`). Each case runs in a fresh process.
"""
import argparse
import json
import resource
import subprocess
import sys

VARIANTS = ("current", "none", "iota", "bits", "rbg")


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _patch(variant: str) -> None:
  """Replaces `noise.gaussian_like` (the draw) for one probe variant."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from private_t5.dp import noise as noise_lib  # pylint: disable=g-import-not-at-top

  def groups(leaves):
    out = {}
    for i, leaf in enumerate(leaves):
      out.setdefault(tuple(leaf.shape), []).append(i)
    return out.items()

  def per_group(draw_fn):
    def gaussian_like(key, leaves):
      out = [None] * len(leaves)
      for g, (shape, members) in enumerate(groups(leaves)):
        draw = draw_fn(jax.random.fold_in(key, g), (len(members),) + shape)
        for row, i in enumerate(members):
          out[i] = draw[row]
      return out
    return gaussian_like

  def rbg(key, shape):
    _, bits = jax.lax.rng_bit_generator(jnp.concatenate([key, key]).astype(jnp.uint32), shape, dtype=jnp.uint32)
    u = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    return jnp.sqrt(2.0) * jax.lax.erf_inv(2 * jnp.clip(u, 1e-7, 1 - 1e-7) - 1)

  if variant == "none":
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


def _one(args) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case  # pylint: disable=g-import-not-at-top
  _patch(args.variant)
  config, trainer = benchmark_case.make_trainer(args.preset, args.method, args.batch, 1.0, 1.0, None, args.dtype)
  batch = benchmark_case.random_batch(config.vocab_size, args.batch, args.inputs, args.targets, 0)
  key = jax.random.PRNGKey(0)
  c0 = _cpu()
  lowered = trainer.lower_train_step(trainer.abstract_state(), batch, key, key)
  c1 = _cpu()
  lowered.compile()
  c2 = _cpu()
  return {"method": args.method, "variant": args.variant, "trace_lower_cpu_s": round(c1 - c0, 2),
          "compile_cpu_s": round(c2 - c1, 2)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="t5_1_1_small")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--inputs", type=int, default=512)
  p.add_argument("--targets", type=int, default=114)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--method", default=None, help=argparse.SUPPRESS)
  p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.method:
    print(json.dumps(_one(args)), flush=True)
    return 0
  common = [f"--preset={args.preset}", f"--batch={args.batch}", f"--inputs={args.inputs}",
            f"--targets={args.targets}", f"--dtype={args.dtype}"]
  cases = [("nondp", "current")] + [("ghost", v) for v in VARIANTS]
  rows = []
  for method, variant in cases:
    out = subprocess.run([sys.executable, __file__, *common, f"--method={method}", f"--variant={variant}"],
                         check=True, capture_output=True, text=True).stdout
    rows.append(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]["compile_cpu_s"]
  for r in rows[1:]:
    print(f"ghost, noise {r['variant']:8s}: compile {r['compile_cpu_s']:6.1f} CPU s = "
          f"{r['compile_cpu_s'] / base:.2f}x non-DP ({base:.1f})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
