"""The real `private-t5 train` loop against its bare compiled step, and the input pipeline alone.

Runs `private-t5 train` in this process with the train stage's flags (`--gin_file`,
`--gin.NAME=VALUE`; default: the quickstart with a micro model, see `MICRO`), then times the
compiled step the loop ran, called back to back on one batch of the same shapes already on the
devices (the bare step), and writes JSON with `loop_step_s` and `bare_step_s` (seconds per step
after compilation, steady state: the loop's from its own clock over the steps after the first
`--skip_steps`, to the last step's completion), their ratio `bare_over_loop` (1.0: the loop adds nothing around the step), the
CPU seconds of each (a shared machine's wall time says little) and the load; beside them the
same microbatches dispatched one by one from the host (`bare_host_dispatched_step_s`, the step
before it was one dispatch). Also the input
pipeline alone: examples/s of span corruption at `--pipeline_lengths` (512/114) built by 1, 2, 4
worker threads and processes (`--pipeline_workers`).

  .venv/bin/python benchmarks/bench_loop.py --vocab=VOCAB --corpus=CORPUS --out=/tmp/bench_loop.json
  .venv/bin/python benchmarks/bench_loop.py --vocab=VOCAB --corpus=CORPUS --gin.DP=None --out=/tmp/nondp.json

Table: docs/performance.md, "The training loop".
"""
import argparse
import concurrent.futures
import json
import os
import resource
import sys
import tempfile
import time

import jax
import numpy as np

from private_t5.data import source as source_lib
from private_t5.stages import train as train_stage
from private_t5.train import host_microbatches
from private_t5.train import loop as loop_lib
from private_t5.train import step_data
from private_t5.train.trainer import Trainer

# The quickstart's shapes (DP-ghost, expected batch 32 in microbatches of 8, 128/32 tokens) on a
# micro model (d_model 16): what the loop costs around a step that costs a few milliseconds.
MICRO = ["--gin_file=configs/experiments/quickstart.gin", "--gin.T5Config.d_model=16",
         "--gin.T5Config.num_heads=2", "--gin.T5Config.d_ff=32", "--gin.train.eval_every=0",
         "--gin.train.checkpoint_every=100000", "--gin.train.log_every=100000"]


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def loop_and_bare(train_args, steps: int, skip: int, bare_steps: int):
  """(loop seconds/step, its CPU seconds/step, bare seconds/step, its CPU s/step, info).

  The loop is timed from the moment it asks for step `skip`'s batch to the moment the last
  step's result is on the devices (the loop dispatches ahead of the device: the time of the
  last dispatch would flatter it). The bare step runs on the batches of the same steps, built
  and placed beforehand, back to back."""
  captured = {}
  real_run, real_get = loop_lib.run, step_data.Prefetcher.get
  real_steps = {name: getattr(Trainer, name) for name in ("train_step", "train_step_stacked")}
  clock, end = [], []

  def spy_run(**kwargs):
    captured.update(kwargs)
    return real_run(**kwargs)

  def timed_get(self, step):
    clock.append((step, time.perf_counter(), _cpu()))
    return real_get(self, step)

  def finishing(name):
    def step(self, state, *rest):
      out = real_steps[name](self, state, *rest)
      if clock and clock[-1][0] == steps - 1 and not end:  # the last step: wait for it
        jax.block_until_ready(out)
        end.append((time.perf_counter(), _cpu()))
      return out
    return step

  loop_lib.run, step_data.Prefetcher.get = spy_run, timed_get
  for name in real_steps:
    setattr(Trainer, name, finishing(name))
  try:
    summary = train_stage.run_from_args(list(train_args) + [f"--gin.TRAIN_STEPS={steps}"])
  finally:
    loop_lib.run, step_data.Prefetcher.get = real_run, real_get
    for name, fn in real_steps.items():
      setattr(Trainer, name, fn)
  (s0, t0, c0), (t1, c1) = clock[skip], end[0]
  timed = steps - s0
  loop_s, loop_cpu = (t1 - t0) / timed, (c1 - c0) / timed

  trainer, privacy, layout = captured["trainer"], captured["privacy"], captured["layout"]
  builder = step_data.StepBatchBuilder(privacy=privacy, layout=layout, source=captured["source"],
                                       seeds=captured["seeds"], trainer=trainer)
  batches = [builder(t) for t in range(s0, min(s0 + bare_steps, steps))]
  state = trainer.init_state(captured["seeds"].init_key)
  keys = captured["seeds"].dropout_base_key, captured["seeds"].noise_base_key

  def step(state, data):
    if data.count is None:
      return trainer.train_step(state, data.placed, *keys)
    return trainer.train_step_stacked(state, data.placed, data.count, *keys)

  for data in batches[:2]:  # compiled already; warm
    state, _ = step(state, data)
  jax.block_until_ready(state)
  t, c = time.perf_counter(), _cpu()
  for data in batches:
    state, metrics = step(state, data)
  jax.block_until_ready((state, metrics))
  bare_s, bare_cpu = (time.perf_counter() - t) / len(batches), (_cpu() - c) / len(batches)
  host_s = host_cpu = None
  if batches[0].count is not None:  # the same microbatches dispatched one by one from the host
    placed = [[trainer.place_batch(micro) for micro in data.host] for data in batches]
    for micro in placed[:2]:
      state, _ = host_microbatches.train_step_on_microbatches(trainer, state, micro, *keys)
    jax.block_until_ready(state)
    t, c = time.perf_counter(), _cpu()
    for micro in placed:
      state, metrics = host_microbatches.train_step_on_microbatches(trainer, state, micro, *keys)
    jax.block_until_ready((state, metrics))
    host_s, host_cpu = (time.perf_counter() - t) / len(batches), (_cpu() - c) / len(batches)
  info = {"bare_host_dispatched_step_s": host_s, "bare_host_dispatched_cpu_s_per_step": host_cpu,
          "mean_rows_per_step": float(np.mean([b.rows for b in batches])),
          "mean_microbatches": None if batches[0].count is None else float(np.mean([b.count for b in batches])),
          "compiled_shapes": sorted({str(b.shape) for b in batches}),
          "expected_batch": float(privacy.sampler.expected_batch_size), "private": privacy.private,
          "steps": steps, "timed_loop_steps": timed, "bare_steps": len(batches),
          "steps_per_second_summary": summary.get("steps_per_second")}
  return loop_s, loop_cpu, bare_s, bare_cpu, info


def _build(args):
  source, seed, indices, batch = args
  return source.get_batch(indices, seed, batch)


_PROCESS_SOURCE = None


def _process_init(corpus, vocab, lengths):
  global _PROCESS_SOURCE
  _PROCESS_SOURCE = source_lib.make_source(corpus, vocab, feature_lengths=lengths, progress=False)


def _process_build(args):
  seed, indices, batch = args
  return _PROCESS_SOURCE.get_batch(indices, seed, batch)["encoder_input_tokens"].shape[0]


def pipeline(corpus: str, vocab: str, lengths, workers_list, batches: int, batch: int):
  """Examples/s of `get_batch` (span corruption) by 1..n threads and processes."""
  source = source_lib.make_source(corpus, vocab, feature_lengths=lengths, progress=False)
  rng = np.random.default_rng(0)
  jobs = [(seed, rng.integers(0, source.num_examples, batch), batch) for seed in range(batches)]
  out = {"feature_lengths": dict(lengths), "batch": batch, "batches": batches}
  t = time.perf_counter()
  for seed, idx, b in jobs[:max(batches // 4, 1)]:
    source.get_batch(idx, seed, b)
  out["one_thread_examples_per_s"] = max(batches // 4, 1) * batch / (time.perf_counter() - t)
  for kind in ("threads", "processes"):
    for workers in workers_list:
      if kind == "threads":
        pool = concurrent.futures.ThreadPoolExecutor(workers)
        work = [(source,) + job for job in jobs]
        fn = _build
      else:
        pool = concurrent.futures.ProcessPoolExecutor(workers, initializer=_process_init,
                                                      initargs=(corpus, vocab, dict(lengths)))
        list(pool.map(_process_build, jobs[:workers]))  # started and warm
        work, fn = jobs, _process_build
      with pool:
        t = time.perf_counter()
        list(pool.map(fn, work))
        out[f"{kind}_{workers}_examples_per_s"] = len(jobs) * batch / (time.perf_counter() - t)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--vocab", required=True, help="SentencePiece model of the corpus")
  p.add_argument("--corpus", required=True)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--skip_steps", type=int, default=20, help="steps left out of the loop's timing (compile, warm-up)")
  p.add_argument("--bare_steps", type=int, default=100)
  p.add_argument("--no_micro", action="store_true", help="do not start from the micro quickstart flags")
  p.add_argument("--pipeline_lengths", default="512:114")
  p.add_argument("--pipeline_workers", default="1,2,4")
  p.add_argument("--pipeline_batches", type=int, default=32)
  p.add_argument("--skip_pipeline", action="store_true")
  p.add_argument("--out", help="JSON file (default: stdout only)")
  args, train_flags = p.parse_known_args(argv)
  with tempfile.TemporaryDirectory() as work:
    train_args = ([] if args.no_micro else MICRO) + [
        f"--gin.MODEL_DIR={os.path.join(work, 'run')}", f"--gin.CORPUS={args.corpus}",
        f"--gin.VOCAB_PATH={args.vocab}", "--gin.VOCAB_IS_PUBLIC=True"] + train_flags
    loop_s, loop_cpu, bare_s, bare_cpu, info = loop_and_bare(train_args, args.steps, args.skip_steps,
                                                             args.bare_steps)
  result = {"loop_step_s": loop_s, "bare_step_s": bare_s, "bare_over_loop": bare_s / loop_s,
            "loop_cpu_s_per_step": loop_cpu, "bare_cpu_s_per_step": bare_cpu,
            "bare_over_loop_cpu": bare_cpu / loop_cpu if loop_cpu else None, **info,
            "train_flags": train_args[len([] if args.no_micro else MICRO):],
            "devices": jax.device_count(), "platform": jax.devices()[0].platform,
            "load_average": os.getloadavg()}
  if not args.skip_pipeline:
    inputs, targets = (int(x) for x in args.pipeline_lengths.split(":"))
    result["pipeline"] = pipeline(args.corpus, args.vocab, {"inputs": inputs, "targets": targets},
                                  [int(w) for w in args.pipeline_workers.split(",")], args.pipeline_batches, 32)
  text = json.dumps(result, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
