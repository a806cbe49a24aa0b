"""The public-vocabulary check on real text: what it catches, what it misses, its false positives.

  .venv/bin/python benchmarks/bench_public_declaration.py --data_dir=../shared/data/pretrain \
      --output=benchmarks/results/public-declaration-2026-12.json

Fills docs/privacy.md, "Near-copies: measured". The vocabulary's documents are signed with a fresh
secret key as `private-t5 dp-spm` signs them (`doc_fingerprints.FingerprintWriter`), and training
documents are looked up as a run's are (`Signatures.count_overlaps`):

* false positives: every document of one corpus against the signatures of another, for the
  pairs of the three corpora (linux_docs, python_docs, fortunes: a disjoint pair should give 0;
  a document found is printed, so that real shared text, e.g. a quotation, can be told apart),
  and one half of fortunes against the other half (natural near-duplicates of short texts);
* detection: the first --documents documents of each corpus, edited as a user's copy might be
  (a word changed, a trailing period, invisible characters, lower-cased, merged in pairs, split in
  halves), the fraction of the edited documents found, overall and by length in words.

Every figure is repeated with --keys fresh keys (the sample of shingles depends on the key).
"""
import argparse
import gzip
import json
import os
import random
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

from private_t5 import doc_fingerprints
from private_t5.shingles import content_words

CORPORA = ("linux_docs", "python_docs", "fortunes")
LENGTH_BUCKETS = ((0, 10), (10, 20), (20, 40), (40, 80), (80, 10 ** 9))


def _load(data_dir: str, name: str) -> List[str]:
  with gzip.open(os.path.join(data_dir, f"{name}.jsonl.gz"), "rt", encoding="utf-8") as f:
    return [json.loads(line)["text"] for line in f]


def _signatures(texts: List[str], key: bytes, root: str) -> doc_fingerprints.Signatures:
  writer = doc_fingerprints.FingerprintWriter(key)
  for start in range(0, len(texts), doc_fingerprints.CHUNK):
    writer.add_texts(texts[start:start + doc_fingerprints.CHUNK])
  folder = tempfile.mkdtemp(dir=root)
  writer.write(folder)
  return doc_fingerprints.Signatures.load(folder, key)


def _edits(seed: int):
  rng = random.Random(seed)

  def one_word(text):
    words = text.split(" ")
    words[rng.randrange(len(words))] = "zqxjv"
    return " ".join(words)

  def halves(text):
    words = text.split(" ")
    return [" ".join(words[:len(words) // 2]), " ".join(words[len(words) // 2:])]

  return {
      "a word changed": lambda ts: [(t, one_word(t)) for t in ts],
      "a trailing period": lambda ts: [(t, t + ".") for t in ts],
      "invisible characters": lambda ts: [(t, "\ufeff" + t.replace(" ", " \u200b", 3).replace("e", "e\u00ad", 2)
                                           .replace("a", "a\u200d", 1)) for t in ts],
      "lower-cased": lambda ts: [(t, t.lower()) for t in ts],
      "merged in pairs": lambda ts: [(ts[i], ts[i] + "\n" + ts[i + 1]) for i in range(0, len(ts) - 1, 2)],
      "split in halves (first)": lambda ts: [(t, halves(t)[0]) for t in ts],
      "split in halves (second)": lambda ts: [(t, halves(t)[1]) for t in ts],
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data_dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                                         "pretrain"))
  parser.add_argument("--documents", type=int, default=2000, help="documents of each corpus edited")
  parser.add_argument("--keys", type=int, default=2, help="fresh keys each figure is repeated with")
  parser.add_argument("--output", default=None, help="JSON results (default: stdout only)")
  args = parser.parse_args(argv)
  if not os.path.isdir(args.data_dir):
    print(f"error: --data_dir {args.data_dir} is not a folder", file=sys.stderr)
    return 2
  texts = {name: _load(args.data_dir, name) for name in CORPORA}
  half = len(texts["fortunes"]) // 2
  results: Dict[str, object] = {"settings": {"shingle_words": doc_fingerprints.SHINGLE_WORDS,
                                             "sample_one_in": doc_fingerprints.SAMPLE_ONE_IN,
                                             "min_shared": doc_fingerprints.MIN_SHARED,
                                             "shared_fraction": doc_fingerprints.SHARED_FRACTION,
                                             "common_documents": doc_fingerprints.COMMON_DOCUMENTS},
                                "documents": {n: len(t) for n, t in texts.items()},
                                "false_positives": [], "detection": {}, "seconds": {}}
  with tempfile.TemporaryDirectory() as root:
    for k in range(args.keys):
      key = doc_fingerprints.new_key()
      start = time.time()
      signed = {name: _signatures(t, key, root) for name, t in texts.items()}
      signed["fortunes (first half)"] = _signatures(texts["fortunes"][:half], key, root)
      results["seconds"].setdefault("sign", []).append(round(time.time() - start, 1))
      pairs = [(v, t) for v in CORPORA for t in CORPORA if v != t] + [("fortunes (first half)", "fortunes (second half)")]
      start = time.time()
      for vocab, train in pairs:
        training = texts["fortunes"][half:] if train == "fortunes (second half)" else texts[train]
        hits = np.concatenate([signed[vocab].overlaps(training[i:i + 4096]) for i in range(0, len(training), 4096)])
        results["false_positives"].append({"key": k, "vocabulary": vocab, "training": train,
                                           "found": int(hits.sum()), "of": len(training),
                                           "examples": [training[i][:120] for i in np.nonzero(hits)[0][:3]]})
      results["seconds"].setdefault("look_up", []).append(round(time.time() - start, 1))
      for name in CORPORA:
        sample = texts[name][:args.documents]
        for edit, make in _edits(k).items():
          cases = make(sample)
          hits = signed[name].overlaps([edited for _, edited in cases])
          lengths = np.array([len(content_words(original)) for original, _ in cases])
          entry = results["detection"].setdefault(f"{name}: {edit}", {"found": [], "by_length": {}})
          entry["found"].append(round(float(hits.mean()), 4))
          for lo, hi in LENGTH_BUCKETS:
            mask = (lengths >= lo) & (lengths < hi)
            if mask.any():
              entry["by_length"].setdefault(f"{lo}-{hi if hi < 10 ** 9 else ''} words", []).append(
                  [int(hits[mask].sum()), int(mask.sum())])
  for row in results["false_positives"]:
    print(f"key {row['key']}: {row['training']} against the signatures of {row['vocabulary']}: "
          f"{row['found']} of {row['of']} found")
  for case, entry in results["detection"].items():
    print(f"{case}: found {entry['found']}")
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
