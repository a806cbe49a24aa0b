"""`private-t5 spm`: trains a public (non-private) SentencePiece vocabulary from a corpus.

  private-t5 spm --corpus=builtin:python_docs --vocab_size=8000 --model_type=unigram \\
      --output=/tmp/vocab.model

Documents are fed line by line (SentencePiece skips "sentences" longer than its
`max_sentence_length`, so whole long documents would be lost; a longer line is skipped,
`--max_sentence_length` raises the limit). Prints a JSON summary.
The output is written atomically; `private_t5.tokenizer.spm.load_vocabulary` reads it with
T5's 100 sentinels.
"""
import json
import os
import sys
import time
from typing import Iterator, List, Optional

from private_t5 import io as io_lib
from private_t5.data import corpora
from private_t5 import documents
from private_t5.errors import ConfigError
from private_t5.tokenizer import spm as spm_lib
from private_t5 import vocabulary
from private_t5.stages import flags


def document_lines(docs: Iterator[documents.Document], counts: dict) -> Iterator[str]:
  """The non-blank lines of every document (counted in `counts["lines"]`)."""
  for doc in docs:
    for line in doc.text.splitlines():
      if line.strip():
        counts["lines"] += 1
        yield line


def train_vocabulary(corpus: str, output: str, vocab_size: int, model_type: str = "unigram", *,
                     max_documents: Optional[int] = None, text_field: str = "text", errors: str = "strict",
                     data_dir: Optional[str] = None, character_coverage: float = 0.9995,
                     input_sentence_size: int = 2_000_000,
                     max_sentence_length: int = spm_lib.DEFAULT_MAX_SENTENCE_LENGTH) -> dict:
  """Trains `output` from `corpus`; returns the JSON-able summary."""
  start = time.time()
  stats = documents.CorpusStats()
  counts = {"lines": 0}
  docs = corpora.iter_documents(corpus, text_field=text_field, errors=errors, data_dir=data_dir,
                                stats=stats, max_documents=max_documents)
  spm_lib.train_from_sentences(document_lines(docs, counts), output, vocab_size, model_type=model_type,
                               character_coverage=character_coverage, input_sentence_size=input_sentence_size,
                               max_sentence_length=max_sentence_length)
  vocab = vocabulary.load_vocabulary(output)
  return {
      "output": os.path.abspath(output),
      "corpus": corpus,
      "model_type": model_type,
      "requested_pieces": vocab_size,
      "pieces": int(vocab.vocab_size) - vocabulary.NUM_EXTRA_IDS,  # char models stop at the alphabet
      "vocab_size_with_sentinels": int(vocab.vocab_size),
      "extra_ids": vocabulary.NUM_EXTRA_IDS,
      "documents": stats.documents,
      "blank_documents_skipped": stats.blank_skipped,
      "lines": counts["lines"],
      "characters": stats.characters,
      "seconds": round(time.time() - start, 2),
      "private": False,
  }


def check_output(output: str) -> None:
  """ConfigError unless `output` names a .model file that can be written (before any training)."""
  if not output.endswith(".model"):
    raise ConfigError(f"--output must end with .model, got {output!r}")
  io_lib.check_output_file(output)


def _parser():
  p = flags.StageParser("spm", __doc__.split("\n\n")[0])
  p.add_flag("corpus", aliases=("input",), help="corpus spec: file.txt, folder, file.jsonl[.gz], file.tsv, "
             "tfds:NAME[:SPLIT], builtin:python_docs")
  p.add_flag("vocab_size", type=int, help="number of SentencePiece pieces (sentinels extra)")
  p.add_flag("model_type", default="unigram", choices=("unigram", "bpe", "char", "word"))
  p.add_flag("output", help="path of the .model file to write")
  p.add_flag("max_documents", type=int, default=None)
  p.add_flag("text_field", default="text")
  p.add_flag("errors", default="strict", choices=corpora.ERROR_MODES)
  p.add_flag("data_dir", default=None, help="TFDS data dir for tfds: corpora")
  p.add_flag("character_coverage", type=float, default=0.9995)
  p.add_flag("input_sentence_size", type=int, default=2_000_000,
             help="lines SentencePiece samples for training")
  p.add_flag("max_sentence_length", type=int, default=spm_lib.DEFAULT_MAX_SENTENCE_LENGTH,
             help="longest line in bytes used for training; longer lines are skipped (default %(default)s)")
  return p


def main(argv: List[str]) -> int:
  parser = _parser()
  args = parser.parse_stage_args(argv).args
  flags.check_required(parser, args, ("corpus", "vocab_size", "output"))
  check_output(args.output)
  summary = train_vocabulary(args.corpus, args.output, args.vocab_size, args.model_type,
                             max_documents=args.max_documents, text_field=args.text_field, errors=args.errors,
                             data_dir=args.data_dir, character_coverage=args.character_coverage,
                             input_sentence_size=args.input_sentence_size,
                             max_sentence_length=args.max_sentence_length)
  json.dump(summary, sys.stdout, indent=2)
  print()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
