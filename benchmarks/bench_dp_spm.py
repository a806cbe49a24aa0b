"""Measures DP-SentencePiece: histogram throughput, words kept per ε and sensitivity, stage time.

  .venv/bin/python benchmarks/bench_dp_spm.py --output_dir=/tmp/bench_dp_spm \\
      [--corpus=../shared/data/pretrain/linux_docs.jsonl.gz --corpus=...python_docs.jsonl.gz]

1. For each sensitivity setting ("paper": k = m = N = 256; "capped": k = √W = 16, m = 1) the
   bounded histogram is built once (MB/s over the corpus' UTF-8 bytes, all cores), then for
   each ε ∈ {0.17, 3.37, 33.7} σ is calibrated (tight Gaussian accounting, δ split in half)
   and the noisy threshold applied: words kept, fraction dropped, and the share of word
   occurrences the kept words cover.
2. The whole stage (`train_dp_vocabulary`: read, histogram, noise, SentencePiece, report) is
   timed at each vocabulary size.
Writes `results.json` in the output folder and prints it.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from private_t5.data import corpora  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.tokenizer import dp_spm  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.tokenizer import dp_spm_histogram  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.tokenizer import dp_spm_release  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top,wrong-import-position

DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "pretrain")
DEFAULT_CORPORA = [os.path.join(DATA, "linux_docs.jsonl.gz"), os.path.join(DATA, "python_docs.jsonl.gz")]


def _texts(specs):
  for spec in specs:
    for doc in corpora.iter_documents(spec):
      yield doc.text


def words_kept(histogram, bound, epsilon, delta, rng):
  params = dp_spm_release.privacy_parameters(delta, bound, target_epsilon=epsilon)
  kept = dp_spm_release.private_histogram(histogram, params["noise_std"], params["threshold"], rng)
  total_occurrences = sum(histogram.values())
  return {
      "sensitivity": bound.mode, "epsilon": params["epsilon"], "target_epsilon": epsilon,
      "epsilon_paper_formula": params["epsilon_paper_formula"], "noise_std": params["noise_std"],
      "threshold": params["threshold"], "words_total": len(histogram), "words_kept": len(kept),
      "words_dropped_fraction": 1 - len(kept) / len(histogram),
      "occurrences_covered_fraction": sum(histogram[w] for w in kept) / total_occurrences,
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--corpus", action="append", help="corpus spec(s); default linux_docs + python_docs")
  p.add_argument("--output_dir", default="/tmp/bench_dp_spm")
  p.add_argument("--delta", type=float, default=1e-8)
  p.add_argument("--epsilons", default="0.17,3.37,33.7")
  p.add_argument("--vocab_sizes", default="8000,32000")
  p.add_argument("--max_words", type=int, default=256)
  p.add_argument("--num_workers", type=int, default=None)
  p.add_argument("--stage_epsilon", type=float, default=33.7, help="ε of the timed full-stage runs")
  p.add_argument("--stage_sensitivity", default="capped", choices=dp_spm_histogram.SENSITIVITY_MODES)
  p.add_argument("--skip_stage", action="store_true", help="only the histogram part")
  args = p.parse_args(argv)
  specs = args.corpus or DEFAULT_CORPORA
  os.makedirs(args.output_dir, exist_ok=True)
  results = {"corpora": specs, "delta": args.delta, "cpu_count": os.cpu_count(), "histograms": [],
             "words_kept": [], "stage": [], "sentencepiece_builtin_dp_ignored": spm.builtin_dp_is_ignored()}
  rng = dp_spm_release.noise_generator()
  for mode in dp_spm_histogram.SENSITIVITY_MODES:
    bound = dp_spm_histogram.ContributionBound(mode, args.max_words)
    histogram, stats = dp_spm_histogram.build_histogram(_texts(specs), bound, num_workers=args.num_workers)
    row = {"sensitivity": mode, **stats.as_dict(), "distinct_words": len(histogram)}
    results["histograms"].append(row)
    print(f"histogram [{mode}]: {stats.documents} docs, {stats.bytes / 1e6:.1f} MB in {stats.seconds:.1f} s = "
          f"{row['megabytes_per_second']:.2f} MB/s, {len(histogram)} distinct words", flush=True)
    for eps in (float(e) for e in args.epsilons.split(",")):
      r = words_kept(histogram, bound, eps, args.delta, rng)
      results["words_kept"].append(r)
      print(f"  ε={eps:<6} σ={r['noise_std']:9.2f} T={r['threshold']:10.1f} kept {r['words_kept']:6d} / "
            f"{r['words_total']} words ({100 * r['words_dropped_fraction']:.2f}% dropped, "
            f"{100 * r['occurrences_covered_fraction']:.1f}% of occurrences covered)", flush=True)
    del histogram
  if not args.skip_stage:
    for vocab in (int(v) for v in args.vocab_sizes.split(",")):
      out = os.path.join(args.output_dir, f"v{vocab}", "dp_spm.model")
      start = time.time()
      report = dp_spm.train_dp_vocabulary(specs, out, vocab_size=vocab, delta=args.delta,
                                          target_epsilon=args.stage_epsilon, sensitivity=args.stage_sensitivity,
                                          max_words_per_document=args.max_words, num_workers=args.num_workers)
      row = {"vocab_size_requested": vocab, "vocab_size": report["vocab_size"],
             "vocab_size_capped": report["vocab_size_capped"], "seconds": round(time.time() - start, 1),
             "histogram_seconds": round(report["histogram"]["seconds"], 1),
             "histogram_mb_per_s": report["histogram"]["megabytes_per_second"],
             "words_kept": report["words_kept"], "epsilon": report["epsilon"],
             "sensitivity": args.stage_sensitivity}
      results["stage"].append(row)
      print(f"stage vocab {vocab}: {row}", flush=True)
  path = os.path.join(args.output_dir, "results.json")
  with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=2)
  os.replace(path + ".tmp", path)
  print(json.dumps(results, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
