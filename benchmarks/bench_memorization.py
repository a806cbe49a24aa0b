"""Benchmarks of the memorization stage on the real text in ../shared/data.

  .venv/bin/python benchmarks/bench_memorization.py [--sections=splits,decode,stage] [--out=DIR]

* splits: split-building time (MinHash LSH + verification + exact substrings) on linux_docs +
  fortunes (90% of each as "training", 10% as "validation"), Lee et al.'s settings by default.
* decode: greedy generation tokens/s of the tiny and small presets with and without the KV
  cache (EOS disabled so that every row generates all T tokens), and the cache speed-up.
* stage: wall time of the whole `private-t5 memorization` stage for 1,000 prompts with the
  tiny model (a checkpoint of freshly initialised parameters written in the train stage's
  layout, a 2,000-piece vocabulary trained here), P = 512, T = 114.

Results are printed and written to OUT/bench_memorization.json.
"""
import argparse
import gzip
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_HOME", tempfile.mkdtemp(prefix="keras_home_"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.abspath(os.path.join(ROOT, "..", "shared", "data", "pretrain"))


def _read(name, limit=None):
  from private_t5.data import corpora
  return list(corpora.iter_documents(os.path.join(DATA, name), max_documents=limit))


def bench_splits(args):
  from private_t5.eval import split_types
  from private_t5.eval import split_search
  linux, fortunes = _read("linux_docs.jsonl.gz"), _read("fortunes.jsonl.gz")
  cut_l, cut_f = int(0.9 * len(linux)), int(0.9 * len(fortunes))
  train, valid = linux[:cut_l] + fortunes[:cut_f], linux[cut_l:] + fortunes[cut_f:]
  cfg = split_types.SplitConfig(num_perm=args.num_perm, num_bands=args.num_bands, num_workers=args.workers)
  t0 = time.time()
  result = split_search.build_splits(train, valid, cfg, verbose=True)
  wall = time.time() - t0
  out = {"train_documents": len(train), "valid_documents": len(valid),
         "characters": sum(len(d.text) for d in train + valid), "num_perm": cfg.num_perm,
         "num_bands": cfg.num_bands, "workers": cfg.num_workers or os.cpu_count(), "sizes": result.sizes(),
         "stats": result.stats, "wall_seconds": round(wall, 2)}
  print(json.dumps(out, indent=2))
  return out


def _decode_rate(config, batch, prompt_length, gen_length, use_cache, repeats=2):
  import jax
  import numpy as np
  from private_t5.models import network
  from private_t5.models import config as config_lib
  from private_t5.models import decoding
  params = network.init_params(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  inputs = rng.integers(3, min(config.vocab_size, 2000), size=(batch, prompt_length)).astype(np.int32)
  run = lambda: decoding.greedy_decode(params, config, inputs, max_decode_length=gen_length, eos_id=-1,
                                       use_cache=use_cache).block_until_ready()
  t0 = time.time()
  run()
  compile_s = time.time() - t0
  t0 = time.time()
  for _ in range(repeats):
    run()
  seconds = (time.time() - t0) / repeats
  return {"tokens_per_second": round(batch * gen_length / seconds, 1), "seconds_per_batch": round(seconds, 3),
          "first_call_seconds": round(compile_s, 2)}


def bench_decode(args):
  from private_t5.models import network
  from private_t5.models import config as config_lib
  out = {}
  for preset, batch, p, t in (("t5_1_0_tiny", 32, 512, 114), ("t5_1_0_small", 8, args.small_prompt,
                                                              args.small_generation)):
    config = config_lib.load_preset(preset, dropout_rate=0.0)
    row = {"batch": batch, "prompt_length": p, "generation_length": t}
    for use_cache in (True, False):
      row["cache" if use_cache else "no_cache"] = _decode_rate(config, batch, p, t, use_cache)
      print(preset, "cache" if use_cache else "no cache", row["cache" if use_cache else "no_cache"], flush=True)
    row["cache_speedup"] = round(row["cache"]["tokens_per_second"] / row["no_cache"]["tokens_per_second"], 2)
    out[preset] = row
  print(json.dumps(out, indent=2))
  return out


def bench_stage(args):
  import dataclasses
  import jax
  from private_t5.stages import cli
  from private_t5.dp.ledger import PrivacyLedger
  from private_t5.tokenizer import spm
  from private_t5 import vocabulary
  from private_t5.models import checkpoints
  work = tempfile.mkdtemp(prefix="bench_memorization_")
  linux = _read("linux_docs.jsonl.gz")
  vocab_path = spm.train_from_sentences((d.text for d in linux[:1500]), os.path.join(work, "spm.model"),
                                        vocab_size=2000, input_sentence_size=200_000)
  vocab = vocabulary.load_vocabulary(vocab_path)
  config = config_lib.load_preset("t5_1_0_tiny", vocab_size=-(-vocab.vocab_size // 128) * 128, dropout_rate=0.0)
  model_dir = os.path.join(work, "run")
  manager = checkpoints.CheckpointManager(model_dir, async_save=False)
  manager.save(1, {"params": network.init_params(config, jax.random.PRNGKey(0))}, {
      "model_config": dataclasses.asdict(config), "vocab_path": vocab_path,
      "privacy_report": PrivacyLedger.non_private_baseline(num_examples=4000, batch_size=128).report()})
  manager.close()
  paths = {}
  for name, docs in (("train", linux[:4000]), ("valid", linux[4000:])):
    paths[name] = os.path.join(work, f"{name}.jsonl.gz")
    with gzip.open(paths[name], "wt") as f:
      for d in docs:
        f.write(json.dumps({"id": d.id, "text": d.text}) + "\n")
  out_dir = os.path.join(work, "memorization")
  argv = ["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.TRAIN_CORPUS={paths['train']}", f"--gin.VALID_CORPUS={paths['valid']}",
          f"--gin.OUTPUT_DIR={out_dir}", "--gin.MAX_EXAMPLES_PER_SPLIT=312", "--gin.BATCH_SIZE=50",
          f"--gin.SplitConfig.num_perm={args.num_perm}", f"--gin.SplitConfig.num_bands={args.num_bands}"]
  t0 = time.time()
  rc = cli.main(argv)
  first = time.time() - t0
  t0 = time.time()
  rc2 = cli.main(argv)  # splits reused, decoding compiled
  second = time.time() - t0
  report = json.load(open(os.path.join(out_dir, "report.json")))
  prompts = sum(m["n"] for m in report["extraction"]["greedy"].values())
  out = {"rc": [rc, rc2], "prompts": prompts, "wall_seconds_first_run": round(first, 1),
         "wall_seconds_second_run_splits_reused": round(second, 1), "throughput": report["throughput"],
         "split_seconds": report["splits"]["stats"].get("seconds"), "sizes": report["splits"]["sizes"],
         "work_dir": work}
  print(json.dumps(out, indent=2))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sections", default="splits,decode,stage")
  parser.add_argument("--num_perm", type=int, default=9000)
  parser.add_argument("--num_bands", type=int, default=450)
  parser.add_argument("--workers", type=int, default=None)
  parser.add_argument("--small_prompt", type=int, default=128)
  parser.add_argument("--small_generation", type=int, default=32)
  parser.add_argument("--out", default=tempfile.gettempdir())
  args = parser.parse_args()
  sys.path.insert(0, ROOT)
  results = {}
  for section in args.sections.split(","):
    results[section] = {"splits": bench_splits, "decode": bench_decode, "stage": bench_stage}[section](args)
  path = os.path.join(args.out, "bench_memorization.json")
  with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=2)
  os.replace(path + ".tmp", path)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
