#!/usr/bin/env python
"""Start-up of `private-t5` with and without TensorFlow: `train --help`, and a tiny training's
time to its first step (process start to the end of step 1, compilation included) and the CPU
seconds of that one-step run.

  .venv/bin/python benchmarks/bench_startup.py [--baseline=DIR] [--repeats=3] [--skip_bench] [--output=startup.json]

Each setup runs the same command in a fresh process, interleaved with the others:
  no_tensorflow  this tree in a Python where TensorFlow, seqio and t5 are not found
                 (scripts/no_tensorflow, as on a machine with only JAX installed);
  tensorflow     this tree with TensorFlow installed and findable;
  baseline       (with --baseline=DIR) the package of another checkout, e.g. one from before
                 training stopped importing TensorFlow, with TensorFlow installed.
The training is `configs/experiments/quickstart.gin` (T5 v1.0 tiny) for one non-private step of
batch 8 at 32/8 tokens on tests/data's fortunes, with a 300-piece vocabulary; a first untimed run
of each setup builds the token store and warms the file cache. Medians are printed and written
to --output; `bench` is run once per setup too, to show it starts without TensorFlow.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDE_TENSORFLOW = os.path.join(ROOT, "scripts", "no_tensorflow")
CORPUS = os.path.join(ROOT, "tests", "data", "pretrain", "fortunes.jsonl.gz")
FIRST_STEP_LINE = "first step (compilation included)"


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--baseline", default=None, help="another checkout whose package to time as well")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--skip_bench", action="store_true", help="do not run `bench` once per setup")
  p.add_argument("--output", default=None)
  return p.parse_args(argv)


def _setups(baseline):
  setups = {"no_tensorflow": [HIDE_TENSORFLOW, ROOT], "tensorflow": [ROOT]}
  if baseline:
    setups["baseline"] = [os.path.abspath(baseline)]
  return setups


def _children_cpu_s() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _timed(cmd, pythonpath, marker=None):
  """(wall seconds from launch to the line holding `marker`, or to the exit; CPU seconds of the
  whole process); raises on failure. CPU time depends far less on other load than wall time.

  The command runs in the last folder of `pythonpath` (the tree whose package it times:
  `python -m` puts the working directory first on the path).
  """
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath), TF_CPP_MIN_LOG_LEVEL="2")
  start, cpu = time.perf_counter(), _children_cpu_s()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=pythonpath[-1])
  seen, lines = None, []
  for line in proc.stdout:
    lines.append(line)
    if seen is None and marker and marker in line:
      seen = time.perf_counter() - start
  if proc.wait() != 0 or (marker and seen is None):
    raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{''.join(lines[-20:])}")
  return (seen if marker else time.perf_counter() - start), _children_cpu_s() - cpu


def _train_command(model_dir, vocab, cache):
  return [sys.executable, "-m", "private_t5.stages.cli", "train", "--gin_file=configs/experiments/quickstart.gin",
          f"--gin.MODEL_DIR={model_dir}", f"--gin.CORPUS={CORPUS}", f"--gin.VOCAB_PATH={vocab}",
          f"--gin.DATA_CACHE_DIR={cache}", "--gin.DP=None", "--gin.TRAIN_STEPS=1", "--gin.BATCH_SIZE=8",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.make_source.max_documents=300",
          "--gin.train.eval_examples=8", "--gin.train.mesh_shape=(1, 1)"]


def _bench_command(output_dir):
  return [sys.executable, "-m", "private_t5.stages.cli", "bench", "--gin_file=configs/bench/quick.gin",
          f"--gin.benchmark.output_dir={output_dir}", "--gin.benchmark.shapes=[(16, 4, 2)]",
          '--gin.benchmark.methods=["nondp"]', "--gin.benchmark.warmup=0", "--gin.benchmark.isolate=False",
          "--gin.benchmark.memory_budget_gb=None"]


def main(argv=None):
  args = _parse_args(argv)
  setups = _setups(args.baseline)
  times = {name: {"train_help_s": [], "train_help_cpu_s": [], "first_step_s": [], "train_cpu_s": [],
                  "bench_s": []} for name in setups}
  with tempfile.TemporaryDirectory() as tmp:
    from private_t5.data import corpora  # pylint: disable=g-import-not-at-top
    from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
    texts = [d.text for d in corpora.iter_documents(CORPUS, max_documents=2000)]
    vocab = os.path.join(tmp, "spm.model")
    spm.train_from_sentences(texts, vocab, vocab_size=300)
    run = 0
    for name, path in setups.items():  # untimed: builds the stores, warms the file cache
      _timed(_train_command(os.path.join(tmp, f"warm_{name}"), vocab, os.path.join(tmp, f"cache_{name}")), path,
             FIRST_STEP_LINE)
      if not args.skip_bench:
        times[name]["bench_s"].append(_timed(_bench_command(os.path.join(tmp, f"bench_{name}")), path)[0])
    for _ in range(args.repeats):
      for name, path in setups.items():
        run += 1
        help_cmd = [sys.executable, "-m", "private_t5.stages.cli", "train", "--help"]
        for key, value in zip(("train_help_s", "train_help_cpu_s"), _timed(help_cmd, path)):
          times[name][key].append(value)
        model_dir = os.path.join(tmp, f"run_{run}")
        train = _timed(_train_command(model_dir, vocab, os.path.join(tmp, f"cache_{name}")), path, FIRST_STEP_LINE)
        for key, value in zip(("first_step_s", "train_cpu_s"), train):
          times[name][key].append(value)
        print(name, {k: round(v[-1], 2) for k, v in times[name].items() if v}, flush=True)
  result = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "repeats": args.repeats,
            "median": {name: {k: statistics.median(v) for k, v in t.items() if v} for name, t in times.items()},
            "all": times}
  for other in [n for n in setups if n != "no_tensorflow"]:
    result[f"no_tensorflow/{other}"] = {
        k: result["median"]["no_tensorflow"][k] / result["median"][other][k]
        for k in ("train_help_s", "train_help_cpu_s", "first_step_s", "train_cpu_s")}
  print(json.dumps({k: v for k, v in result.items() if k != "all"}, indent=1))
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
