"""Rebuilds the small real-text fixtures in tests/data from the full data set (../shared/data).

  PYTHONPATH=. python tests/data/make_fixtures.py [--source=../shared/data]

Deterministic: the same source gives byte-identical files (gzip without a timestamp).
"""
import argparse
import collections
import gzip
import io
import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NUM_FORTUNES = 1600
NUM_DOC_CHUNKS = 130
CHUNK_CHARS = 3500
# Rows per split (train, validation, test), taken evenly across each file (files are sorted by label).
GLUE_ROWS = {"rotten_tomatoes": (3000, 300, 200), "bible_paraphrase": (300, 120, 120), "bbc_news": (30, 15, 15)}


def _read(path):
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _write_jsonl_gz(path, docs):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  buf = io.BytesIO()
  with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as f:
    for d in docs:
      f.write((json.dumps({"id": d["id"], "text": d["text"]}, ensure_ascii=False) + "\n").encode("utf-8"))
  with open(path, "wb") as f:
    f.write(buf.getvalue())


def _words(text):
  return " ".join(re.findall(r"\w+", text.lower()))


def fortunes(source):
  """The first fortunes plus every member of an exact-duplicate group (for the dedup tests)."""
  docs = _read(os.path.join(source, "pretrain", "fortunes.jsonl.gz"))
  groups = collections.Counter(_words(d["text"]) for d in docs)
  keep = [d for k, d in enumerate(docs) if k < NUM_FORTUNES or groups[_words(d["text"])] > 1]
  return keep


def python_docs(source):
  """Chunks of about CHUNK_CHARS characters (paragraph boundaries) of the Python documentation."""
  docs = _read(os.path.join(source, "pretrain", "python_docs.jsonl.gz"))
  out = []
  for d in docs:
    # One chunk a document, from its body (the second chunk): headers and reST boilerplate
    # at the top of pages would make the chunks near-duplicates of each other.
    chunk, n = [], 0
    for para in d["text"].split("\n\n"):
      chunk.append(para)
      if sum(len(p) + 2 for p in chunk) >= CHUNK_CHARS:
        if n == 1:
          out.append({"id": f"{d['id']}#{n}", "text": "\n\n".join(chunk)})
          break
        chunk, n = [], n + 1
  # No near-duplicates among the chunks (the tests plant their own): drop every flagged one.
  from private_t5.documents import Document  # pylint: disable=g-import-not-at-top
  from private_t5.eval import split_search  # pylint: disable=g-import-not-at-top
  from private_t5.eval import split_types  # pylint: disable=g-import-not-at-top
  result = split_search.build_splits([Document(d["id"], d["text"]) for d in out], [], split_types.SplitConfig(num_workers=1))
  flagged = set(result.ids["train_dup"])
  return [d for d in out if d["id"] not in flagged][:NUM_DOC_CHUNKS]


def glue(source, task, split, rows):
  with open(os.path.join(source, "glue_like", task, f"{split}.tsv"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  header, body = lines[0], lines[1:]
  step = len(body) / rows
  picked = [body[int(k * step)] for k in range(rows)]
  path = os.path.join(HERE, "glue_like", task, f"{split}.tsv")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8", newline="") as f:
    f.write("\n".join([header] + picked) + "\n")


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--source", default=os.path.join(os.path.dirname(ROOT), "shared", "data"))
  args = p.parse_args()
  _write_jsonl_gz(os.path.join(HERE, "pretrain", "fortunes.jsonl.gz"), fortunes(args.source))
  _write_jsonl_gz(os.path.join(HERE, "pretrain", "python_docs.jsonl.gz"), python_docs(args.source))
  for task, sizes in GLUE_ROWS.items():
    for split, rows in zip(("train", "validation", "test"), sizes):
      glue(args.source, task, split, rows)


if __name__ == "__main__":
  main()
