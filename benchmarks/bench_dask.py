#!/usr/bin/env python
"""The corpus stages on Beam's DirectRunner against its DaskRunner: wall time, CPU time and memory
a worker of `private-t5 store` and `private-t5 splits`, at N documents, with 2 and 4 workers.

  .venv/bin/python benchmarks/bench_dask.py --work=/tmp/bench_dask --stages=store --sizes=100000,1000000 \
      --output=dask.jsonl
  .venv/bin/python benchmarks/bench_dask.py --work=/tmp/bench_dask --stages=splits --sizes=10000,100000 \
      --output=dask.jsonl
  .venv/bin/python benchmarks/bench_dask.py --table=dask.jsonl

Fills docs/scaling.md, "On a real cluster: Dask and the other runners" (measured). The corpora are
benchmarks/scale.py's (C4-shaped: one JSON line a document, 12 words from a 2,000-word lexicon),
in 8 files, with its 500-piece vocabulary; `splits` also reads a 1% validation corpus and finds
exact substrings in the vocabulary's tokens. Each (stage, N, runner, workers) runs the stage as a
user runs it, in a fresh process:

  direct  `--runner=DirectRunner --beam_options="--direct_num_workers=W --direct_running_mode=multi_processing"`
  dask    `--runner=DaskRunner --beam_options=--dask_client_address=ADDRESS` against a fresh
          `distributed.LocalCluster(n_workers=W, processes=True, threads_per_worker=1)` started by
          this program before the stage (its start is not timed) and closed after it

Wall time is the stage's process, start to exit. CPU time is the stage's processes (`os.wait4`:
the launcher and, for DirectRunner, its workers) plus, for Dask, what the cluster's worker
processes spent during the stage (`psutil`). Memory: the peak resident memory of the largest
worker (DirectRunner: the largest process of the stage; Dask: the largest worker process's VmHWM,
each worker fresh) and the launching process's own peak (VmHWM). Each result is one JSON line.
The machine's load (`uptime`) is recorded with each line: on a shared machine compare CPU times.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # pylint: disable=g-import-not-at-top,wrong-import-position

STAGES = ("store", "splits")
RUNNERS = ("direct", "dask")


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--work", default="/tmp/private_t5_bench_dask", help="folder for corpora, stores and splits")
  p.add_argument("--sizes", default="100000,1000000", help="document counts, comma-separated")
  p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
  p.add_argument("--runners", default=",".join(RUNNERS), help=f"comma-separated, of {', '.join(RUNNERS)}")
  p.add_argument("--workers", default="2,4", help="worker counts, comma-separated")
  p.add_argument("--output", default=None, help="JSON lines file (appended to)")
  p.add_argument("--table", default=None, metavar="JSONL", help="print the markdown table of a results file")
  args = p.parse_args(argv)
  args.sizes = [int(float(s)) for s in args.sizes.split(",") if s]
  args.stages = [s for s in args.stages.split(",") if s]
  args.runners = [s for s in args.runners.split(",") if s]
  args.workers = [int(s) for s in args.workers.split(",") if s]
  if set(args.stages) - set(STAGES) or set(args.runners) - set(RUNNERS):
    p.error(f"stages are {STAGES}, runners {RUNNERS}")
  return args


def _vm_hwm(pid=None) -> int:
  """Peak resident bytes of a process (VmHWM), 0 when unreadable."""
  try:
    with open(f"/proc/{pid or os.getpid()}/status", encoding="utf-8") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError):
    pass
  return 0


def _worker_usage():
  """(CPU seconds, peak resident bytes) of the calling Dask worker process."""
  import psutil  # pylint: disable=g-import-not-at-top
  t = psutil.Process().cpu_times()
  return t.user + t.system, _vm_hwm()


def _stage_command(stage: str, n: int, work: str, files: str, vocab: str, valid: str) -> list:
  tag = f"{n}-{time.time_ns()}"
  if stage == "store":
    return scale.PRIVATE_T5 + ["store", f"--corpus={files}", f"--vocab_path={vocab}",
                               f"--cache_dir={os.path.join(work, 'stores', tag)}", "-q"]
  return scale.PRIVATE_T5 + ["splits", f"--train_corpus={files}", f"--valid_corpus={valid}",
                             f"--output={os.path.join(work, 'splits', tag + '.json')}", f"--vocab_path={vocab}", "-q"]


def measure(stage: str, n: int, runner: str, workers: int, work: str) -> dict:
  corpus = scale.write_corpus(os.path.join(work, f"corpus-{n}.jsonl"), n, 12)
  files = scale.write_corpus(os.path.join(work, f"corpus-{n}-parts", "part"), n, 12, num_files=8)
  valid = scale.write_corpus(os.path.join(work, f"valid-{n}.jsonl"), max(1000, n // 100), 12, seed=1)
  vocab = scale.vocabulary(work, corpus)
  cmd = _stage_command(stage, n, work, files, vocab, valid)
  launcher = {}
  if runner == "direct":
    cmd += ["--runner=DirectRunner",
            f"--beam_options=--direct_num_workers={workers} --direct_running_mode=multi_processing"]
    wall, cpu, peak, _ = scale.run(cmd, scale._env(), launcher=launcher)  # pylint: disable=protected-access
    return {"wall_s": wall, "cpu_s": cpu, "worker_peak_rss_bytes": peak,
            "launcher_peak_rss_bytes": launcher.get("bytes")}
  import logging  # pylint: disable=g-import-not-at-top
  import distributed  # pylint: disable=g-import-not-at-top
  with distributed.LocalCluster(n_workers=workers, processes=True, threads_per_worker=1, dashboard_address=":0",
                                silence_logs=logging.ERROR) as cluster, distributed.Client(cluster) as client:
    before = client.run(_worker_usage)
    cmd += ["--runner=DaskRunner", f"--beam_options=--dask_client_address={cluster.scheduler_address}"]
    wall, cpu, _, _ = scale.run(cmd, scale._env(), launcher=launcher)  # pylint: disable=protected-access
    after = client.run(_worker_usage)
    executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
  worker_cpu = sum(after[w][0] - before[w][0] for w in after)
  return {"wall_s": wall, "cpu_s": cpu + worker_cpu, "worker_cpu_s": worker_cpu,
          "worker_peak_rss_bytes": max(u[1] for u in after.values()),
          "launcher_peak_rss_bytes": launcher.get("bytes"), "tasks_by_worker": sorted(executed.values())}


def _mib(b) -> str:
  return f"{b / 2**20:.0f} MiB" if b else "—"


def table(path: str) -> str:
  rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
  out = ["| stage | N | runner | workers | wall s | CPU s | peak memory a worker | launcher | load (1 min) |",
         "|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r["stage"], r["n"], r["workers"], r["runner"])):
    name = "DirectRunner" if r["runner"] == "direct" else "DaskRunner"
    out.append(f"| {r['stage']} | {r['n']:,} | {name} | {r['workers']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
               f"{_mib(r['worker_peak_rss_bytes'])} | {_mib(r.get('launcher_peak_rss_bytes'))} | {r['load']} |")
  return "\n".join(out)


def main(argv=None) -> int:
  args = _args(argv)
  if args.table:
    print(table(args.table))
    return 0
  os.makedirs(args.work, exist_ok=True)
  for n in args.sizes:
    for stage in args.stages:
      for workers in args.workers:
        for runner in args.runners:
          load = os.getloadavg()[0]
          result = {"stage": stage, "n": n, "runner": runner, "workers": workers, "load": round(load, 2),
                    "uptime": subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip(),
                    **measure(stage, n, runner, workers, args.work)}
          print(json.dumps(result), flush=True)
          if args.output:
            with open(args.output, "a", encoding="utf-8") as f:
              f.write(json.dumps(result) + "\n")
  return 0


if __name__ == "__main__":
  threading.current_thread().name = "bench_dask"
  sys.exit(main())
