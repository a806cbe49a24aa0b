"""Input throughput of a seqio Task against our token store on the same text (examples per CPU-second).

  .venv/bin/python benchmarks/bench_seqio.py [--corpus=../shared/data/pretrain/linux_docs.jsonl.gz]
      [--max_documents=1000] [--vocab=PATH.model] [--inputs_length=512] [--batch_size=128]
      [--output=bench.json]

The same documents, vocabulary and lengths both ways, span corruption both ways:

* seqio: a Task over the texts (`seqio.FunctionDataSource`, t5's `span_corruption`, as T5X's C4
  Task) read once into memory by `data.seqio_source.SeqioSource` (what `private-t5 train` does
  with MIXTURE_OR_TASK_NAME); later epochs only gather rows of that read.
* store: our token store built from the texts (`data.store`), read as `source.CorpusSource` with
  the `example` unit (every raw-length chunk an example), the span corruption drawn at every draw.

Rows differ: t5's span corruption joins documents into full raw-length windows, while the store's
`example` unit cuts each document alone (a short document is one short, padded row), so the
tokens per CPU-second (non-padding ids of inputs and targets) are printed too.
"first epoch" is the one-off cost (seqio's read; the store's build) plus drawing every example
once in batches of --batch_size; "later epochs" draws every example once more. CPU seconds are
the process's (`time.process_time`, all threads), so TensorFlow's thread pool counts. Without
--vocab a 2000-piece vocabulary is trained on the documents first (not timed). Prints one JSON
object (also written to --output).
"""
import argparse
import functools
import gzip
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from private_t5 import quiet_tf  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.data import seqio_source  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.data import source as source_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top,wrong-import-position

TASK = "bench_seqio_span_corruption"


def _timed(fn):
  """(result, CPU seconds, wall seconds) of fn()."""
  cpu, wall = time.process_time(), time.perf_counter()
  out = fn()
  return out, time.process_time() - cpu, time.perf_counter() - wall


def _draw_all(src, batch_size: int, seed: int):
  """Draws every example of `src` once, in shuffled batches of `batch_size`; returns (examples,
  tokens): the tokens are the non-padding ids of inputs and targets (sentinels and EOS included)."""
  order = np.random.default_rng(seed).permutation(src.num_examples)
  tokens = 0
  for start in range(0, len(order), batch_size):
    batch = src.get_batch(np.sort(order[start:start + batch_size]), seed=seed, batch_size=batch_size)
    tokens += int(np.count_nonzero(batch["encoder_input_tokens"]) + np.count_nonzero(batch["decoder_target_tokens"]))
  return len(order), tokens


def _register_task(texts, vocab_path):
  tf = quiet_tf.import_tensorflow()
  import seqio  # pylint: disable=g-import-not-at-top
  from t5.data import preprocessors  # pylint: disable=g-import-not-at-top

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({"text": texts})

  vocab = seqio.SentencePieceVocabulary(vocab_path, extra_ids=100)
  seqio.TaskRegistry.remove(TASK)
  seqio.TaskRegistry.add(
      TASK, source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
      preprocessors=[functools.partial(preprocessors.rekey, key_map={"inputs": None, "targets": "text"}),
                     seqio.preprocessors.tokenize, preprocessors.span_corruption,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={"inputs": seqio.Feature(vocab, add_eos=True, required=False),
                       "targets": seqio.Feature(vocab, add_eos=True)},
      metric_fns=[])


def _rates(counts, cpu: float, wall: float) -> dict:
  n, tokens = counts
  return {"examples": n, "tokens": tokens, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
          "examples_per_cpu_s": round(n / cpu, 1) if cpu > 0.01 else None,
          "tokens_per_cpu_s": round(tokens / cpu) if cpu > 0.01 else None}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--corpus", default=os.path.join(os.path.dirname(ROOT), "shared", "data", "pretrain",
                                                       "linux_docs.jsonl.gz"))
  parser.add_argument("--max_documents", type=int, default=1000)
  parser.add_argument("--vocab", default=None)
  parser.add_argument("--inputs_length", type=int, default=512)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--output", default=None)
  args = parser.parse_args()
  if not os.path.exists(args.corpus):
    args.corpus = os.path.join(ROOT, "tests", "data", "pretrain", "python_docs.jsonl.gz")
  work = tempfile.mkdtemp(prefix="bench_seqio_")
  opener = gzip.open if args.corpus.endswith(".gz") else open
  with opener(args.corpus, "rt", encoding="utf-8") as f:
    texts = [t for t in (json.loads(line)["text"] for _, line in zip(range(args.max_documents), f)) if t.strip()]
  corpus = os.path.join(work, "corpus.jsonl")
  with open(corpus, "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
  vocab = args.vocab or os.path.join(work, "spm.model")
  if not args.vocab:
    spm.train_from_sentences(texts, vocab, vocab_size=2000)
  from private_t5.data import objectives  # pylint: disable=g-import-not-at-top
  _, targets_length = objectives.span_corruption_lengths(args.inputs_length)
  lengths = {"inputs": args.inputs_length, "targets": targets_length}

  _, tf_cpu, tf_wall = _timed(lambda: _register_task(texts, vocab))  # TensorFlow, seqio, t5 imports
  seqio_src, read_cpu, read_wall = _timed(lambda: seqio_source.SeqioSource(TASK, "train", lengths))
  n, draw_cpu, draw_wall = _timed(lambda: _draw_all(seqio_src, args.batch_size, 0))
  _, again_cpu, again_wall = _timed(lambda: _draw_all(seqio_src, args.batch_size, 1))
  seqio_result = {"num_examples": seqio_src.num_examples, "imports_cpu_s": round(tf_cpu, 3),
                  "first_epoch": _rates(n, read_cpu + draw_cpu, read_wall + draw_wall),
                  "read_once": _rates(n, read_cpu, read_wall), "later_epochs": _rates(n, again_cpu, again_wall)}

  store_src, build_cpu, build_wall = _timed(lambda: source_lib.make_source(
      corpus, vocab, feature_lengths=lengths, privacy_unit="example", split="all",
      cache_dir=os.path.join(work, "cache"), progress=False))
  n, draw_cpu, draw_wall = _timed(lambda: _draw_all(store_src, args.batch_size, 0))
  _, again_cpu, again_wall = _timed(lambda: _draw_all(store_src, args.batch_size, 1))
  store_result = {"num_examples": store_src.num_examples,
                  "first_epoch": _rates(n, build_cpu + draw_cpu, build_wall + draw_wall),
                  "store_build": _rates(n, build_cpu, build_wall), "later_epochs": _rates(n, again_cpu, again_wall)}

  result = {"corpus": args.corpus, "documents": len(texts), "feature_lengths": lengths,
            "batch_size": args.batch_size, "cpu_count": os.cpu_count(), "load_average": os.getloadavg()[0],
            "seqio_task": seqio_result, "token_store": store_result}
  text = json.dumps(result, indent=2)
  print(text)
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
