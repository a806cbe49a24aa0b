#!/usr/bin/env python
"""How each stage's time and memory grow with the corpus: C4-shaped synthetic corpora of 10^5,
10^6 and 10^7 documents, each stage run as a user runs it, in a fresh process.

  .venv/bin/python benchmarks/scale.py --work=/tmp/scale --sizes=100000,1000000,10000000 \
      [--stages=store,store_beam,train,poisson,dp_spm,splits] [--long] [--output=scale.jsonl]

A corpus of N documents is one JSON line a document, an id like `c4-train.000000123` and 12
words of text drawn from a fixed 2,000-word lexicon (C4's median document is ~400 words; the
per-document costs measured here are per document, not per word); `--long` adds a corpus of
N/100 documents of 1,200 words (the long-document variant). Every stage runs in a child process;
its wall time, CPU time (user + system) and peak resident memory (`os.wait4`'s ru_maxrss, the
largest process of the stage, Beam workers included) are written as one JSON line a
(stage, N). `--table` prints the markdown table of docs/scaling.md from such a file: per stage,
the measured values, the per-document memory slope between the two largest N, and its
extrapolation to C4 (365 M documents).

Stages:
  store        `private-t5 store` (local, one shard)
  store_beam   `private-t5 store --runner=DirectRunner`, 2 worker processes, the corpus in 8 files
  train        `private-t5 train`: DP T5 v1.0 tiny, 2 steps, on the store built above; time to the
               first step (process start to the end of step 1) and the run's peak memory
  poisson      one Poisson draw at N (q·N = 4,096), in process: ms a step and bytes allocated
  dp_spm       `private-t5 dp-spm` (500 pieces, one worker)
  splits       `private-t5 splits` on the corpus and a 1% validation corpus (exact substrings in the
               500-piece vocabulary's tokens), into the folder the memorization stage reads
  splits_beam  the same on `--runner=DirectRunner`, 2 worker processes, the corpus in 8 files; also
               the launching process's own peak (`launcher_peak_rss_bytes`, /proc VmHWM)
  memorization `private-t5 memorization` of a tiny checkpoint (DP T5 v1.0 tiny, 2 steps, trained once
               per work folder, not timed) on 1,000 prompts a split (P = 8, T = 4 tokens), reusing
               the split file `splits` wrote (run `splits` first; else it builds it and that is timed)
  canaries     `private-t5 canaries` (1, 10 and 100 copies of a canary and a reference; the corpus
               read twice, counted then copied)
  canaries_audit `private-t5 canaries --audit`, 1,000 canaries of random corpus words
  shuffle      the non-private `ShuffledBatchSampler` at N (B = 4,096), in process: the epoch's
               permutation (first batch) and a later batch, in ms, and bytes allocated; beside it the
               int64 `rng.permutation(N)` it replaced (`int64_*`)
  ledger       the privacy ledger's ε at N (q·N = 4,096, σ = 1, 10,000 steps, δ = 1/N^1.1), in
               process: RDP Poisson, RDP fixed batches, PLD truncated Poisson; ms and bytes allocated
  study_data   the data phase of `private-t5 study` (`experiments/study.prepare_data`: the corpus read
               whole, 10% validation, 10% of the training documents repeated 2, 5, 10 times) in a
               fresh process
A seqio Task written into a store is measured by benchmarks/bench_seqio_store.py.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIVATE_T5 = [sys.executable, "-m", "private_t5.stages.cli"]
STAGES = ("store", "store_beam", "train", "poisson", "dp_spm", "splits", "splits_beam", "memorization", "canaries",
          "canaries_audit", "shuffle", "ledger", "study_data")
IN_PROCESS = ("poisson", "shuffle", "ledger")  # measured in this process (ms, bytes allocated); no corpus
C4_DOCUMENTS = 365_000_000
LEXICON_SIZE = 2000
FIRST_STEP_LINE = "first step (compilation included)"


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--work", default="/tmp/private_t5_scale", help="folder for corpora, stores and runs")
  p.add_argument("--sizes", default="100000,1000000", help="document counts, comma-separated")
  p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
  p.add_argument("--long", action="store_true", help="also a corpus of N/100 documents of 1,200 words")
  p.add_argument("--output", default=None, help="JSON lines file (appended to)")
  p.add_argument("--table", default=None, metavar="JSONL", help="print the markdown table of a results file")
  args = p.parse_args(argv)
  args.sizes = [int(float(s)) for s in args.sizes.split(",") if s]
  args.stages = [s for s in args.stages.split(",") if s]
  unknown = sorted(set(args.stages) - set(STAGES))
  if unknown or any(n < 1000 for n in args.sizes):
    p.error(f"unknown stage(s) {unknown}" if unknown else "sizes must be >= 1000")
  return args


def _words():
  rng = random.Random(0)
  letters = "etaoinshrdlucmfwypvbgkjqxz"
  return ["".join(rng.choice(letters[:12 + k % 14]) for _ in range(2 + k % 9)) for k in range(LEXICON_SIZE)]


def write_corpus(path: str, n: int, words_per_document: int, num_files: int = 1, seed: int = 0) -> str:
  """A C4-shaped corpus of `n` documents in `num_files` files; returns its spec (file or pattern)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  names = [path] if num_files == 1 else [f"{path}-{k:05d}.jsonl" for k in range(num_files)]
  spec = path if num_files == 1 else f"{path}-*.jsonl"
  if all(os.path.exists(x) for x in names):
    return spec
  lexicon, rng = _words(), random.Random(seed)
  per_file = -(-n // num_files)
  for k, name in enumerate(names):
    with open(name + ".tmp", "w", encoding="utf-8") as f:
      for i in range(k * per_file, min(n, (k + 1) * per_file)):
        text = " ".join(rng.choices(lexicon, k=words_per_document))
        f.write(json.dumps({"id": f"c4-train.{i:09d}", "text": text}) + "\n")
    os.rename(name + ".tmp", name)
  return spec


def _launcher_peak(pid: int, out: dict) -> None:
  """Polls the launching process's own peak resident memory (VmHWM) until it exits."""
  while True:
    try:
      with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
          if line.startswith("VmHWM:"):
            out["bytes"] = max(out.get("bytes", 0), int(line.split()[1]) * 1024)
    except (OSError, ValueError):
      return
    time.sleep(0.2)


def run(cmd, env=None, marker=None, cwd=ROOT, launcher=None):
  """(wall s, CPU s, peak RSS bytes, wall s to the line holding `marker` or None) of `cmd`; with a
  dict `launcher`, its "bytes" is the peak of the command's own process (Beam workers excluded)."""
  start = time.time()
  proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  if launcher is not None:
    threading.Thread(target=_launcher_peak, args=(proc.pid, launcher), daemon=True).start()
  marked, lines = None, []
  for line in proc.stdout:
    lines.append(line)
    if marker and marked is None and marker in line:
      marked = time.time() - start
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  wall = time.time() - start
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{''.join(lines[-20:])}")
  return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, marked


def _env():
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", PRIVATE_T5_QUIET="1")  # progress.QUIET_ENV: no bars
  env.setdefault("KERAS_HOME", "/tmp/keras")
  return env


def vocabulary(work: str, corpus: str) -> str:
  path = os.path.join(work, "spm500.model")
  if not os.path.exists(path):
    run(PRIVATE_T5 + ["spm", f"--corpus={corpus}", f"--output={path}", "--vocab_size=500",
                      "--max_documents=20000", "-q"], env=_env())
  return path


def poisson(n: int) -> dict:
  from private_t5.dp import sampling  # pylint: disable=g-import-not-at-top
  sampler = sampling.PoissonSampler(n, min(1.0, 4096 / n), None, seed=1)
  sampler.indices_for_step(0)
  tracemalloc.start()
  start, cpu = time.perf_counter(), time.process_time()
  steps = 20
  for step in range(1, steps + 1):
    sampler.indices_for_step(step)
  wall, cpu = (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  return {"wall_s": wall, "cpu_s": cpu, "peak_alloc_bytes": peak}


def _traced(fn) -> dict:
  """Wall and CPU seconds of `fn()` and the bytes it allocated at its peak (tracemalloc)."""
  tracemalloc.start()
  start, cpu = time.perf_counter(), time.process_time()
  fn()
  wall, cpu = time.perf_counter() - start, time.process_time() - cpu
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  return {"wall_s": wall, "cpu_s": cpu, "peak_alloc_bytes": peak}


def shuffle(n: int) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from private_t5.dp import sampling  # pylint: disable=g-import-not-at-top
  batch = min(4096, n)
  sampler = sampling.ShuffledBatchSampler(n, batch, seed=1)
  first = _traced(lambda: sampler.indices_for_step(0))  # draws the epoch's permutation
  later = _traced(lambda: sampler.indices_for_step(sampler.steps_per_epoch - 1))
  del sampler
  before = _traced(lambda: np.random.default_rng([sampling._SHUFFLE_STREAM, 1, 0]).permutation(n)[:batch])  # pylint: disable=protected-access
  return {**first, "step_wall_s": later["wall_s"], "step_cpu_s": later["cpu_s"],
          **{f"int64_{k}": v for k, v in before.items()}}


def ledger(n: int) -> dict:
  from private_t5.dp import accounting  # pylint: disable=g-import-not-at-top
  q, steps, delta = min(1.0, 4096 / n), 10_000, n ** -1.1
  cases = {"rdp_poisson": dict(accountant="rdp"), "rdp_fixed": dict(accountant="rdp", sampling="fixed", num_examples=n),
           "pld_truncated": dict(accountant="pld", num_examples=n, max_batch_size=int(4096 * 1.2))}
  out = {}
  for name, kwargs in cases.items():
    eps = {}
    timing = _traced(lambda kw=kwargs, e=eps: e.update(value=accounting.compute_epsilon(1.0, q, steps, delta, **kw)))
    out.update({f"{name}_{k}": v for k, v in timing.items()}, **{f"{name}_epsilon": eps["value"]})
  out.update(wall_s=sum(out[f"{c}_wall_s"] for c in cases), cpu_s=sum(out[f"{c}_cpu_s"] for c in cases),
             peak_alloc_bytes=max(out[f"{c}_peak_alloc_bytes"] for c in cases))
  return out


STUDY_DATA = """
import sys
from private_t5.data import duplication
from private_t5.experiments import study
record = study.prepare_data(sys.argv[1], sys.argv[2], duplication.DuplicationConfig().validate())
print(record["stats"])
"""


def measure(stage: str, n: int, work: str, corpus: str, long_variant: bool) -> dict:
  if stage in IN_PROCESS:
    return {"poisson": poisson, "shuffle": shuffle, "ledger": ledger}[stage](n)
  env = _env()
  tag = f"{n}{'_long' if long_variant else ''}"
  vocab = vocabulary(work, corpus)
  cache = os.path.join(work, f"cache-{tag}")
  if stage == "store":
    cmd = PRIVATE_T5 + ["store", f"--corpus={corpus}", f"--vocab_path={vocab}", f"--cache_dir={cache}", "-q"]
    wall, cpu, rss, _ = run(cmd, env)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": rss}
  if stage == "store_beam":
    words = 1200 if long_variant else 12
    files = write_corpus(os.path.join(work, f"corpus-{tag}-parts", "part"), n, words, num_files=8)
    cmd = PRIVATE_T5 + ["store", f"--corpus={files}", f"--vocab_path={vocab}", f"--cache_dir={cache}-beam", "-q",
                        "--runner=DirectRunner",
                        "--beam_options=--direct_num_workers=2 --direct_running_mode=multi_processing"]
    wall, cpu, rss, _ = run(cmd, env)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": rss}
  if stage == "train":
    model_dir = os.path.join(work, f"run-{tag}-{time.time_ns()}")
    cmd = PRIVATE_T5 + ["train", "--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
                        f"--gin.CORPUS={corpus}", f"--gin.VOCAB_PATH={vocab}", f"--gin.DATA_CACHE_DIR={cache}",
                        "--gin.VOCAB_SIZE=640", "--gin.TRAIN_STEPS=2",
                        "--gin.VALIDATION_FRACTION=0.01", "--gin.train.eval_examples=8", "--gin.VOCAB_IS_PUBLIC=True",
                        "--gin.DPConfig.target_epsilon=None", "--gin.DPConfig.noise_multiplier=1.0"]
    wall, cpu, rss, first = run(cmd, env, marker=FIRST_STEP_LINE)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": rss, "first_step_s": first}
  if stage in ("canaries", "canaries_audit"):
    out = os.path.join(work, f"{stage}-{tag}-{time.time_ns()}.jsonl")
    cmd = PRIVATE_T5 + ["canaries", f"--corpus={corpus}", f"--output={out}", "--seed=1"]
    if stage == "canaries_audit":
      cmd += ["--audit", "--num_canaries=1000"]
    wall, cpu, rss, _ = run(cmd, env)
    for name in os.listdir(work):  # the corpus with canaries and its record: not kept
      if name.startswith(os.path.basename(out)[:-6]):
        os.remove(os.path.join(work, name))
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": rss}
  if stage == "study_data":
    out = os.path.join(work, f"study-{tag}-{time.time_ns()}")
    wall, cpu, rss, _ = run([sys.executable, "-c", STUDY_DATA, corpus, out], env)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": rss}
  if stage == "dp_spm":
    out = os.path.join(work, f"dpspm-{tag}-{time.time_ns()}", "dp.model")
    cmd = PRIVATE_T5 + ["dp-spm", "--gin_file=configs/runs/dp_spm.gin", f"--corpus={corpus}", f"--output={out}",
                        "--vocab_size=500", "--target_epsilon=8", "--gin.train_dp_vocabulary.num_workers=1", "-q"]
    wall, cpu, rss, _ = run(cmd, env)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": rss}
  words = 1200 if long_variant else 12
  valid = write_corpus(os.path.join(work, f"valid-{tag}.jsonl"), max(1000, n // 100), words, seed=1)
  memorization_dir = os.path.join(work, f"memorization-{tag}")
  if stage == "memorization":
    model_dir = os.path.join(work, "memorization-model")
    if not os.path.isdir(os.path.join(model_dir, "checkpoints")):
      run(PRIVATE_T5 + ["train", "--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
                        f"--gin.CORPUS={corpus}", f"--gin.VOCAB_PATH={vocab}", f"--gin.DATA_CACHE_DIR={cache}",
                        "--gin.VOCAB_SIZE=640", "--gin.TRAIN_STEPS=2", "--gin.VOCAB_IS_PUBLIC=True",
                        "--gin.DPConfig.target_epsilon=None", "--gin.DPConfig.noise_multiplier=1.0"], env)
    out = os.path.join(memorization_dir, f"report-{time.time_ns()}")
    os.makedirs(out)
    for name in os.listdir(memorization_dir):  # the split file of `splits`, where the stage looks for it
      if name.startswith("splits_") and name.endswith(".json"):
        os.link(os.path.join(memorization_dir, name), os.path.join(out, name))
    cmd = PRIVATE_T5 + ["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={model_dir}",
                        f"--gin.TRAIN_CORPUS={corpus}", f"--gin.VALID_CORPUS={valid}", f"--gin.OUTPUT_DIR={out}",
                        "--gin.PROMPT_LENGTH=8", "--gin.GENERATION_LENGTH=4", "--gin.MAX_EXAMPLES_PER_SPLIT=1000",
                        "--gin.BATCH_SIZE=250"]
    wall, cpu, rss, _ = run(cmd, env)
    with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
      report = json.load(f)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": rss, "splits_reused": report["splits"]["reused"],
            "evaluated": report["splits"]["evaluated"]}
  if stage in ("splits", "splits_beam"):
    os.makedirs(memorization_dir, exist_ok=True)
    out = memorization_dir + os.sep if stage == "splits" else os.path.join(work, f"{stage}-{tag}-{time.time_ns()}.json")
    train = corpus if stage == "splits" else write_corpus(os.path.join(work, f"corpus-{tag}-parts", "part"), n,
                                                          words, num_files=8)
    cmd = PRIVATE_T5 + ["splits", f"--train_corpus={train}", f"--valid_corpus={valid}", f"--output={out}",
                        f"--vocab_path={vocab}", "-q"]
    launcher = None
    if stage == "splits_beam":
      cmd += ["--runner=DirectRunner", "--beam_options=--direct_num_workers=2 --direct_running_mode=multi_processing"]
      launcher = {}
    wall, cpu, rss, _ = run(cmd, env, launcher=launcher)
    with open(out if out.endswith(".json") else max(
        (os.path.join(out, x) for x in os.listdir(out) if x.startswith("splits_")), key=os.path.getmtime)) as f:
      sizes = json.load(f)["sizes"]
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": rss, "sizes": sizes,
            **({"launcher_peak_rss_bytes": launcher.get("bytes")} if launcher is not None else {})}
  raise ValueError(stage)


def table(path: str) -> str:
  """The markdown table of a results file: per stage and N, and the per-document slope."""
  rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
  out = ["| stage | N | wall s | CPU s | peak memory | memory slope (bytes/document) | at C4 (365 M) |",
         "|---|---|---|---|---|---|---|"]
  for stage in STAGES:
    for variant in (False, True):
      mine = sorted((r for r in rows if r["stage"] == stage and r.get("long", False) == variant),
                    key=lambda r: r["n"])
      key = "peak_rss_bytes" if stage not in IN_PROCESS else "peak_alloc_bytes"
      slope = None
      if len(mine) >= 2 and mine[-1]["n"] > mine[-2]["n"]:
        slope = (mine[-1][key] - mine[-2][key]) / (mine[-1]["n"] - mine[-2]["n"])
      for k, r in enumerate(mine):
        last = k == len(mine) - 1
        extra = f", first step {r['first_step_s']:.1f} s" if r.get("first_step_s") else ""
        at_c4 = (f"{(r[key] + slope * (C4_DOCUMENTS - r['n'])) / 2**30:.1f} GiB" if last and slope is not None
                 else "")
        wall = f"{r['wall_s'] * 1e3:.2f} ms" if stage in IN_PROCESS else f"{r['wall_s']:.1f}{extra}"
        cpu = f"{r['cpu_s'] * 1e3:.2f} ms" if stage in IN_PROCESS else f"{r['cpu_s']:.3g}"
        out.append(f"| {stage}{' (long)' if variant else ''} | {r['n']:,} | {wall} | {cpu} | "
                   + ((f"{r[key] / 2**10:.0f} KiB allocated" if r[key] < 2**24 else f"{r[key] / 2**20:.0f} MiB allocated")
                      if stage in IN_PROCESS else f"{r[key] / 2**20:.0f} MiB")
                   + (f" (launcher {r['launcher_peak_rss_bytes'] / 2**20:.0f} MiB)"
                      if r.get("launcher_peak_rss_bytes") else "")
                   + " | "
                   f"{f'{slope:.1f}' if last and slope is not None else ''} | {at_c4} |")
  return "\n".join(out)


def main(argv=None) -> int:
  args = _args(sys.argv[1:] if argv is None else argv)
  if args.table:
    print(table(args.table))
    return 0
  os.makedirs(args.work, exist_ok=True)
  variants = [False, True] if args.long else [False]
  for n in args.sizes:
    for long_variant in variants:
      size = n // 100 if long_variant else n
      corpus = None
      if set(args.stages) - set(IN_PROCESS):  # these need no corpus (e.g. N = 365,000,000)
        corpus = write_corpus(os.path.join(args.work, f"corpus-{size}{'_long' if long_variant else ''}.jsonl"),
                              size, 1200 if long_variant else 12)
      for stage in args.stages:
        result = {"stage": stage, "n": size, "long": long_variant, "uptime": os.getloadavg()[0],
                  **measure(stage, size, args.work, corpus, long_variant)}
        line = json.dumps(result)
        print(line, flush=True)
        if args.output:
          with open(args.output, "a", encoding="utf-8") as f:
            f.write(line + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
