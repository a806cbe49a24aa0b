"""Benchmarks the data layer: corpus reading, tokenization / store build, batch fetch latency.

  .venv/bin/python benchmarks/bench_data.py [--corpus=../shared/data/pretrain/linux_docs.jsonl.gz]
      [--vocab=PATH.model] [--batch_size=128] [--repeats=20] [--output=bench.json] [--examples_only]

Without --vocab, an 8k unigram vocabulary is trained first on the corpus (timed apart).
Prints one JSON object (also written to --output).

`examples` compares (batches of `--example_batch_sizes` rows), on the store built here (document unit, inputs 512 / targets 114, one
thread), the examples a second and the examples per CPU-second (`time.process_time`) of
`CorpusSource.get_batch`, which builds a batch's examples at once (`objective.batch`), with one
example per Python call (a `np.random.Generator` per example, the window drawn and the objective
run one row at a time, as `objective.__call__`). `worker_processes`: whole steps of 256 rows (span
corruption) built in this process and by 1, 2, 4 data worker processes (`train.data_workers`),
in interleaved rounds (medians, and each round's rate), beside 2 processes that build steps on
their own with nothing handed back (`independent_2`, what the cores allow).
`--examples_only` measures only these two (after the vocabulary and the store).
"""
import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from private_t5.data import corpora  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.data import source as source_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.data import store as store_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.dp.config import BatchLayout  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.dp.sampling import ShuffledBatchSampler  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.train import step_rows, worker_pool  # pylint: disable=g-import-not-at-top,wrong-import-position


def _log(msg):
  print(msg, file=sys.stderr, flush=True)


def _fetch_latency(src, batch_size, repeats, seed=0):
  rng = np.random.default_rng(seed)
  times = []
  for step in range(repeats):
    indices = np.sort(rng.choice(src.num_examples, size=min(batch_size, src.num_examples), replace=False))
    start = time.perf_counter()
    src.get_batch(indices, seed=step, batch_size=batch_size)
    times.append(time.perf_counter() - start)
  times = np.asarray(times) * 1000
  return {"median_ms": round(float(np.median(times)), 2), "p90_ms": round(float(np.percentile(times, 90)), 2),
          "batches": repeats, "batch_size": batch_size}


def _one_example_per_call(src, indices, seed):
  """The batch of `indices` (document unit) built one example per call: a Generator per example."""
  raw = src.objective.raw_length
  offsets = src.store.offsets
  enc = np.zeros((len(indices), src.objective.inputs_length), np.int32)
  tgt = np.zeros((len(indices), src.objective.targets_length), np.int32)
  for row, doc in enumerate(indices):
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int(doc)])
    doc_len = int(offsets[doc + 1] - offsets[doc])
    start = int(rng.integers(doc_len - raw + 1)) if doc_len > raw else 0
    tokens = src.store.document_tokens(int(doc))[start:start + min(raw, doc_len)]
    inputs, targets = src.objective(np.asarray(tokens, dtype=np.int32), rng)
    enc[row, :len(inputs)] = inputs
    tgt[row, :len(targets)] = targets
  return source_lib.assemble_batch(enc, tgt, indices)


def _examples_rate(src, batch_size, repeats, seed=0):
  """Examples a second and per CPU-second of both paths over the same random batches."""
  rng = np.random.default_rng(seed)
  batches = [np.sort(rng.choice(src.num_examples, size=min(batch_size, src.num_examples), replace=False))
             for _ in range(repeats)]
  lengths = src.store.lengths()[np.concatenate(batches)]
  result = {"batch_size": batch_size, "batches": repeats,
            "full_windows_fraction": round(float((lengths >= src.objective.raw_length).mean()), 3)}
  for name, build in (("per_example", lambda b, s: _one_example_per_call(src, b, s)),
                      ("batch", lambda b, s: src.get_batch(b, s, batch_size))):
    build(batches[0], 0)  # warm (files mapped, caches filled)
    wall, cpu = time.perf_counter(), time.process_time()
    for step, indices in enumerate(batches):
      build(indices, step)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = sum(len(b) for b in batches)
    result[name] = {"examples_per_s": round(n / wall), "examples_per_cpu_s": round(n / cpu),
                    "ms_per_batch": round(wall / repeats * 1000, 2)}
  result["speedup_per_cpu_s"] = round(result["batch"]["examples_per_cpu_s"] /
                                      result["per_example"]["examples_per_cpu_s"], 2)
  return result


_DIGITS = {"start_s": 2, "main_process_cpu_s_per_1000_examples": 4}  # else whole numbers


def _in_process_rate(build, steps):
  wall, cpu = time.perf_counter(), time.process_time()
  for step in range(steps):
    build(step, step)
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  return {"examples_per_s": steps * build.layout.batch_rows / wall,
          "examples_per_cpu_s": steps * build.layout.batch_rows / cpu}


def _pool_rate(build, workers, steps):
  started = time.perf_counter()
  pool = worker_pool.WorkerPool(build, workers)
  try:
    for step in range(workers):  # started and warm
      pool.submit(step, step)
    for step in range(workers):
      pool.result(step)
    start_s = time.perf_counter() - started
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
      for ahead in range(step, min(step + 2 * workers, steps)):
        pool.submit(workers + ahead, ahead)
      pool.result(workers + step)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  finally:
    pool.close()
  rows = steps * build.layout.batch_rows
  return {"examples_per_s": rows / wall, "main_process_cpu_s_per_1000_examples": cpu / rows * 1000,
          "start_s": start_s}


def _independent_build(build, steps, barrier, results):
  worker_pool._tune_allocator()  # as a worker does
  build(0, 0)
  barrier.wait()
  results.put(_in_process_rate(build, steps)["examples_per_s"])


def _independent_rate(build, processes, steps):
  """Examples a second of `processes` processes each building steps on its own, nothing handed
  back: what the machine's cores allow, the ceiling of a pool of that many workers."""
  context = multiprocessing.get_context("spawn")
  barrier, results = context.Barrier(processes), context.Queue()
  started = [context.Process(target=_independent_build, args=(build, steps, barrier, results))
             for _ in range(processes)]
  for process in started:
    process.start()
  rates = [results.get() for _ in started]
  for process in started:
    process.join()
  return {"examples_per_s": sum(rates)}


def _processes_rate(src, batch_size, workers_list, steps, rounds):
  """Examples a second of whole steps' host rows (`step_rows.HostStepBuilder`: a shuffled fixed
  batch, the batch path) built in this process, then by 1, 2, 4 data worker processes
  (`worker_pool.WorkerPool`, as `train.data_workers`; the arrays handed back in shared memory and
  mapped here), and by 2 processes building on their own (`independent_2`: the cores' ceiling), in
  `rounds` interleaved rounds (each way once a round), with the median of each; the processes'
  start (spawn, imports) is timed apart."""
  build = step_rows.HostStepBuilder(ShuffledBatchSampler(src.num_examples, batch_size, 0), BatchLayout(batch_size),
                                    src, 1, (0, 1), "row_id")
  build(0, 0)
  runs = {"in_process": []}
  runs.update({f"processes_{w}": [] for w in workers_list})
  for _ in range(rounds):
    runs["in_process"].append(_in_process_rate(build, steps))
    for workers in workers_list:
      runs[f"processes_{workers}"].append(_pool_rate(build, workers, steps))
    runs.setdefault("independent_2", []).append(_independent_rate(build, 2, steps))
  out = {"batch_size": batch_size, "steps": steps, "rounds": rounds}
  for name, rows in runs.items():
    out[name] = {key: round(float(np.median([r[key] for r in rows])), _DIGITS.get(key)) for key in rows[0]}
    out[name]["examples_per_s_each_round"] = [round(r["examples_per_s"]) for r in rows]
  base = out["in_process"]["examples_per_s"]
  one = out.get("processes_1", {}).get("examples_per_s")
  out["independent_2"]["over_in_process"] = round(out["independent_2"]["examples_per_s"] / base, 2)
  for workers in workers_list:
    entry = out[f"processes_{workers}"]
    entry["over_in_process"] = round(entry["examples_per_s"] / base, 2)
    if one:
      entry["over_one_process"] = round(entry["examples_per_s"] / one, 2)
  return out


def _t5_span_corruption_ms(src, batch_size, repeats):
  """The same objective through t5.data.preprocessors in a tf.function (for the comparison)."""
  from private_t5 import quiet_tf  # pylint: disable=g-import-not-at-top
  tf = quiet_tf.import_tensorflow()
  from t5.data import preprocessors  # pylint: disable=g-import-not-at-top

  class _Vocab:
    vocab_size = src.objective.vocab_size

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([2, 2], tf.int32)])
  def corrupt(tokens, seeds):
    mask = preprocessors.random_spans_noise_mask(tf.size(tokens), 0.15, seeds, 3.0)
    return (preprocessors.noise_span_to_unique_sentinel(tokens, mask, _Vocab(), None),
            preprocessors.nonnoise_span_to_unique_sentinel(tokens, mask, _Vocab(), None))

  rng = np.random.default_rng(0)
  raw = src.objective.raw_length
  windows = [np.asarray(src.store.document_tokens(i)[:raw]) for i in rng.choice(src.num_examples, batch_size)]
  corrupt(tf.constant(windows[0]), tf.constant([[0, 1], [2, 3]]))  # compile once
  times = []
  for step in range(repeats):
    start = time.perf_counter()
    for i, w in enumerate(windows):
      corrupt(tf.constant(w), tf.constant([[step, i], [i, step]]))
    times.append(time.perf_counter() - start)
  return round(float(np.median(times)) * 1000, 2)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--corpus", default=os.path.join(ROOT, "..", "shared", "data", "pretrain", "linux_docs.jsonl.gz"))
  p.add_argument("--vocab", default=None)
  p.add_argument("--vocab_size", type=int, default=8000)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--output", default=None)
  p.add_argument("--example_batch_sizes", default="32,128,256",
                 help="batch sizes of the examples-a-second comparison")
  p.add_argument("--workers", default="1,2,4", help="data worker processes of the step-building comparison")
  p.add_argument("--worker_steps", type=int, default=200)
  p.add_argument("--worker_rounds", type=int, default=3, help="interleaved rounds of the step-building comparison")
  p.add_argument("--examples_only", action="store_true",
                 help="measure only the examples a second of the two ways of building a batch")
  args = p.parse_args(argv)
  result = {"corpus": os.path.abspath(args.corpus), "cpu_count": os.cpu_count()}
  with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
    _log("reading the corpus ...")
    start = time.perf_counter()
    docs, stats = corpora.read_corpus(args.corpus)
    seconds = time.perf_counter() - start
    result["read"] = {"documents": stats.documents, "characters": stats.characters, "seconds": round(seconds, 2),
                      "documents_per_s": round(stats.documents / seconds, 1),
                      "mb_per_s": round(stats.characters / seconds / 1e6, 2)}
    del docs
    vocab = args.vocab
    if vocab is None:
      from private_t5.stages import spm as spm_stage  # pylint: disable=g-import-not-at-top
      _log(f"training a {args.vocab_size}-piece vocabulary ...")
      vocab = os.path.join(tmp, "bench.model")
      summary = spm_stage.train_vocabulary(args.corpus, vocab, args.vocab_size, input_sentence_size=300_000)
      result["vocab_training_seconds"] = summary["seconds"]
    cache = os.path.join(tmp, "cache")
    _log("building the token store ...")
    start = time.perf_counter()
    store = store_lib.build_store(args.corpus, vocab, cache_dir=cache, progress=True)
    build = time.perf_counter() - start
    m = store.manifest
    result["store_build"] = {
        "seconds": round(build, 2), "documents": m["num_documents"], "tokens": m["num_tokens"],
        "documents_per_s": round(m["num_documents"] / build, 1), "tokens_per_s": round(m["num_tokens"] / build),
        "bytes_on_disk": sum(os.path.getsize(os.path.join(store.path, f)) for f in os.listdir(store.path))}
    result["examples"] = {}
    for objective in ("span_corruption", "prefix_lm"):
      src = source_lib.make_source(args.corpus, vocab, objective=objective, cache_dir=cache, split="all")
      for batch in (int(b) for b in args.example_batch_sizes.split(",")):
        _log(f"examples a second, {objective}, batch {batch}: one per call and a batch at once ...")
        result["examples"][f"{objective}/{batch}"] = _examples_rate(src, batch, args.repeats)
    src = source_lib.make_source(args.corpus, vocab, cache_dir=cache, split="all")
    _log("whole steps by data worker processes ...")
    result["worker_processes"] = _processes_rate(src, 256, [int(w) for w in args.workers.split(",")],
                                                 args.worker_steps, args.worker_rounds)
    if args.examples_only:
      return _emit(result, args.output)
    start = time.perf_counter()
    store_lib.build_store(args.corpus, vocab, cache_dir=cache)
    result["store_reopen_seconds"] = round(time.perf_counter() - start, 3)
    result["fetch"] = {}
    for objective in ("span_corruption", "prefix_lm"):
      for unit in ("document", "example"):
        src = source_lib.make_source(args.corpus, vocab, objective=objective, privacy_unit=unit, cache_dir=cache,
                                     split="all")
        _log(f"fetching {objective} / {unit} (N={src.num_examples}) ...")
        result["fetch"][f"{objective}/{unit}"] = dict(_fetch_latency(src, args.batch_size, args.repeats),
                                                     num_examples=src.num_examples)
    src = source_lib.make_source(args.corpus, vocab, cache_dir=cache, split="all")
    _log("t5 preprocessors in a tf.function, for comparison ...")
    result["t5_tf_function_span_corruption_ms_per_batch"] = _t5_span_corruption_ms(src, args.batch_size,
                                                                                  max(3, args.repeats // 4))
  return _emit(result, args.output)


def _emit(result, output):
  text = json.dumps(result, indent=2)
  print(text)
  if output:
    tmp_out = output + ".tmp"
    with open(tmp_out, "w") as f:
      f.write(text + "\n")
    os.replace(tmp_out, output)
  return 0


if __name__ == "__main__":
  sys.exit(main())
