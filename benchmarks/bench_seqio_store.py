"""`private-t5 store` of a seqio Task: peak memory at two Task sizes, and throughput against seqio.

  .venv/bin/python benchmarks/bench_seqio_store.py [--sizes=20000,200000] [--lengths=512,114]
      [--work_dir=DIR] [--output=bench.json]

A synthetic text-line Task (`seqio.TextLineDataSource` over N lines of random words, one example a
line: inputs and targets are the line, tokenized with a 2000-piece SentencePiece vocabulary trained
on the first lines, EOS appended, trimmed to --lengths) is read four ways, each in a fresh process:

* iterate: plain seqio, `task.get_dataset(lengths, split="train", shuffle=False)` iterated to the
  end (`as_numpy_iterator`), nothing kept: the cost of the Task itself;
* store: `private-t5 store --mixture_or_task_name=... --runner=local` (the CLI, in-process), which
  writes the example store into a fresh cache folder;
* reread: the same command again (the store found in the cache), then 200 batches of 128 random
  examples read from it (`seqio_store.ExampleStore`), as DP sampling reads them;
* memory: `seqio_source.SeqioSource`, the split held in memory (4 bytes a token, padded).

Each process reports its wall seconds and its peak resident memory (`ru_maxrss`), the peak after
importing TensorFlow and seqio and registering the Task (`base`), and their difference (`growth`):
the memory the read itself needed; and, at its end, how much its anonymous and its file-backed
resident memory grew (`rssanon_growth_mb`, `rssfile_growth_mb`: a memory-mapped store's pages are
file-backed, page cache the kernel reclaims). Prints one JSON object (also written to --output).
"""
import argparse
import contextlib
import io
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "bench_seqio_store_lines"
MODULE = "bench_seqio_store_tasks"
# The module a run imports by MIXTURE_OR_TASK_MODULE: it registers TASK from two environment variables.
MODULE_TEXT = f'''"""Registers {TASK!r} over the lines of $BENCH_LINES, tokenized with $BENCH_VOCAB."""
import os

import seqio

vocab = seqio.SentencePieceVocabulary(os.environ["BENCH_VOCAB"], extra_ids=100)
seqio.TaskRegistry.remove({TASK!r})
seqio.TaskRegistry.add(
    {TASK!r}, source=seqio.TextLineDataSource({{"train": os.environ["BENCH_LINES"]}}),
    preprocessors=[lambda ds: ds.map(lambda line: {{"inputs": line, "targets": line}}),
                   seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
    output_features={{"inputs": seqio.Feature(vocab, add_eos=True), "targets": seqio.Feature(vocab, add_eos=True)}},
    metric_fns=[])
'''


def _peak_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kilobytes on Linux


def _resident_mb() -> dict:
  """This process's resident memory now, split into anonymous (its own) and file-backed pages (a
  memory-mapped store's pages: page cache, shared and reclaimable), from /proc/self/status."""
  out = {}
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(("RssAnon:", "RssFile:")):
          out[line.split(":")[0].lower() + "_mb"] = round(int(line.split()[1]) / 1024.0, 1)
  except OSError:
    pass
  return out


def _child(mode: str, lengths, cache: str) -> dict:
  """One measurement, in this (fresh) process."""
  sys.path.insert(0, ROOT)
  from private_t5 import quiet_tf  # pylint: disable=g-import-not-at-top
  quiet_tf.import_tensorflow()
  from private_t5.data import seqio_source  # pylint: disable=g-import-not-at-top
  from private_t5.data import seqio_lookup  # pylint: disable=g-import-not-at-top
  task = seqio_lookup.get_mixture_or_task(TASK, MODULE)
  base, base_resident = _peak_mb(), _resident_mb()
  start = time.perf_counter()
  out = {"mode": mode}
  if mode == "iterate":
    n = 0
    for _ in task.get_dataset(lengths, split="train", shuffle=False, seed=0, num_epochs=1).as_numpy_iterator():
      n += 1
    out["examples"] = n
  elif mode in ("store", "reread"):
    from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
    argv = ["store", f"--mixture_or_task_name={TASK}", f"--mixture_or_task_module={MODULE}",
            f"--task_feature_lengths={lengths!r}", f"--cache_dir={cache}", "-q"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      if cli.main(argv) != 0:
        raise SystemExit("private-t5 store failed")
    summary = json.loads(printed.getvalue())
    out.update(examples=summary["examples"], tokens=summary["tokens"], reused=summary["reused"],
               build_seconds=summary["build_seconds"], store_mb=round(sum(
                   os.path.getsize(os.path.join(summary["path"], f)) for f in os.listdir(summary["path"])) / 1e6, 1))
    if mode == "reread":
      import numpy as np  # pylint: disable=g-import-not-at-top
      from private_t5.data import seqio_store  # pylint: disable=g-import-not-at-top
      store = seqio_store.ExampleStore(summary["path"])
      rng = np.random.default_rng(0)
      times = []
      for _ in range(200):
        indices = np.sort(rng.choice(store.num_examples, size=128, replace=False))
        t = time.perf_counter()
        store.examples(indices, lengths)
        times.append(time.perf_counter() - t)
      out["batch_128_ms_median"] = round(1000 * float(np.median(times)), 3)
  elif mode == "memory":
    src = seqio_source.SeqioSource(TASK, "train", lengths, module=MODULE)
    out["examples"] = src.num_examples
  else:
    raise SystemExit(f"unknown mode {mode!r}")
  out["seconds"] = round(time.perf_counter() - start, 2)
  peak = _peak_mb()
  out.update(peak_mb=round(peak, 1), base_mb=round(base, 1), growth_mb=round(peak - base, 1))
  resident = _resident_mb()
  out.update({f"{k[:-3]}_growth_mb": round(v - base_resident.get(k, 0.0), 1) for k, v in resident.items()})
  if out.get("examples") and mode != "reread":
    out["examples_per_s"] = round(out["examples"] / out["seconds"], 1)
  return out


def _lines(path: str, n: int, seed: int = 0) -> None:
  """N lines of 10-60 random words from a 5000-word synthetic vocabulary."""
  rng = random.Random(seed)
  words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(n):
      f.write(" ".join(rng.choice(words) for _ in range(rng.randint(10, 60))) + "\n")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="20000,200000")
  parser.add_argument("--lengths", default="512,114")
  parser.add_argument("--modes", default="iterate,store,reread,memory")
  parser.add_argument("--work_dir", default=None)
  parser.add_argument("--output", default=None)
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  li, lt = (int(x) for x in args.lengths.split(","))
  lengths = {"inputs": li, "targets": lt}
  if args.child:
    print(json.dumps(_child(args.child, lengths, args.cache)))
    return
  work = args.work_dir or tempfile.mkdtemp(prefix="bench_seqio_store_")
  os.makedirs(work, exist_ok=True)
  with open(os.path.join(work, MODULE + ".py"), "w", encoding="utf-8") as f:
    f.write(MODULE_TEXT)
  sizes = [int(s) for s in args.sizes.split(",")]
  biggest = os.path.join(work, f"lines-{max(sizes)}.txt")
  _lines(biggest, max(sizes))
  vocab = os.path.join(work, "spm2000.model")
  if not os.path.exists(vocab):
    sys.path.insert(0, ROOT)
    from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
    with open(biggest, encoding="utf-8") as f:
      spm.train_from_sentences([next(f) for _ in range(5000)], vocab, vocab_size=2000)
  results = []
  for n in sizes:
    lines = os.path.join(work, f"lines-{n}.txt")
    if not os.path.exists(lines):
      with open(biggest, encoding="utf-8") as src, open(lines, "w", encoding="utf-8") as dst:
        for _, line in zip(range(n), src):
          dst.write(line)
    cache = os.path.join(work, f"cache-{n}")
    env = dict(os.environ, BENCH_LINES=lines, BENCH_VOCAB=vocab, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([work, ROOT, os.environ.get("PYTHONPATH", "")]))
    for mode in args.modes.split(","):
      done = subprocess.run([sys.executable, os.path.abspath(__file__), f"--child={mode}", f"--cache={cache}",
                             f"--lengths={args.lengths}"], env=env, capture_output=True, text=True, check=False)
      if done.returncode:
        raise SystemExit(f"{mode} on {n} lines failed:\n{done.stderr[-3000:]}")
      row = dict(json.loads(done.stdout.strip().splitlines()[-1]), lines=n)
      print(json.dumps(row), file=sys.stderr, flush=True)
      results.append(row)
  report = {"lengths": lengths, "cpus": os.cpu_count(), "load_average": os.getloadavg(), "results": results}
  print(json.dumps(report, indent=2))
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  main()
