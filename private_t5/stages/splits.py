"""`private-t5 splits`: the four memorization splits of a train/validation corpus pair.

  private-t5 splits --train_corpus=train.jsonl.gz --valid_corpus=valid.jsonl.gz \\
      --output=runs/mem/ [--vocab_path=vocab/spm.model] [--runner=local]
  private-t5 splits --train_corpus='gs://B/c4/train-*.jsonl.gz' --valid_corpus='gs://B/c4/valid-*.jsonl.gz' \\
      --vocab_path=gs://B/vocab/spm.model --output=runs/mem/ --runner=DataflowRunner \\
      --beam_options="--project=P --region=R --temp_location=gs://B/tmp"
  private-t5 splits --train_corpus='/shared/c4/train-*.jsonl.gz' --valid_corpus='/shared/c4/valid-*.jsonl.gz' \
      --output=runs/mem/ --runner=DaskRunner \
      --beam_options="--dask_client_address=HOST:8786 --temp_location=/shared/tmp"

Finds near-duplicates (MinHash LSH + edit similarity, and shared 50-token windows; see
`private_t5.eval.splits`) with the in-process path (`--runner=local`) or on Apache Beam
(`private_t5.eval.splits_beam`); both write the same split file. `--output` is a `.json`
path, or a folder that receives `splits_<key>.json`: the name the memorization stage looks
for, so `private-t5 memorization` with that folder as its output_dir and the same corpora,
settings and vocabulary reuses the file instead of recomputing it. Prints a JSON summary.
"""
import json
import os
import sys
from typing import List, Optional

from private_t5.stages import flags, gin_utils
from private_t5.data import beam_io
from private_t5.data import beam_runner
from private_t5.data import beam_pipeline
from private_t5.documents import Document
from private_t5.errors import ConfigError
from private_t5.eval import split_types
from private_t5.eval import split_files
from private_t5.eval import split_search
from private_t5.io import check_output_file, file_sha256



def _parser() -> flags.StageParser:
  p = flags.StageParser("splits", __doc__.split("\n\n")[0], epilog=(
      "With --gin_file (e.g. runs/memorization.gin) the corpora and vocabulary default to its "
      "TRAIN_CORPUS, VALID_CORPUS and VOCAB_PATH, and its SplitConfig bindings apply; "
      "--gin.SplitConfig.NAME=VALUE sets one detection setting."),
      macro_entry="run_memorization", macros_from_bindings=True)
  # The Gin macros of configs/runs/memorization.gin give the defaults of the corpora and vocabulary.
  p.add_flag("train_corpus", action="append", help="training corpus (pattern or spec; repeatable)")
  p.add_flag("valid_corpus", action="append", help="validation corpus (pattern or spec; repeatable)")
  p.add_flag("output", macro=False, help="split file (.json) or folder for splits_<key>.json")
  p.add_flag("vocab_path", aliases=("vocab",),
             help="SentencePiece model for the exact-substring test (default: words)")
  p.add_flag("text_field", default="text", macro=False)
  for name in ("ngram", "num_perm", "num_bands", "exact_substring_tokens", "seed", "max_candidates_per_doc",
               "num_workers"):
    p.add_flag(name, type=int, gin=f"SplitConfig.{name}")
  p.add_flag("min_edit_similarity", type=float, gin="SplitConfig.min_edit_similarity")
  beam_runner.add_runner_flags(p.flag_group)
  return p


def _settings(argv: List[str]):
  """(args, SplitConfig): plain flags, then Gin files and bindings for what they leave unset."""
  args, files, bindings = _parser().parse_stage_args(argv)
  cfg = split_types.SplitConfig()
  if files or bindings:  # parsed by parse_stage_args (the plain flags' macros)
    cfg = gin_utils.configured("SplitConfig")()
  flags.check_required(_parser(), args, ("train_corpus", "valid_corpus", "output"))
  return args, cfg.validate()


def _fingerprint(pairs) -> str:
  return split_files.corpus_fingerprint(Document(id=i, text=t) for i, t in pairs)


def main(argv: Optional[List[str]] = None) -> int:
  args, cfg = _settings(list(sys.argv[1:] if argv is None else argv))
  to_folder = args.output.endswith(os.sep) or os.path.isdir(args.output)
  if not to_folder and not args.output.endswith(".json"):
    raise ConfigError(f"--output must be a .json file or a folder, got {args.output!r}")
  check_output_file(os.path.join(args.output, "splits_<key>.json") if to_folder else args.output)
  beam = beam_runner.is_beam(args.runner)
  if args.vocab_path and not os.path.isfile(args.vocab_path) and "://" not in args.vocab_path:
    raise ConfigError(f"vocabulary not found: {args.vocab_path}")
  tokenizer_id = file_sha256(args.vocab_path) if args.vocab_path and os.path.isfile(args.vocab_path) else args.vocab_path
  specs = {"train": _one(args.train_corpus), "valid": _one(args.valid_corpus)}
  if beam:
    from private_t5.eval import splits_beam  # pylint: disable=g-import-not-at-top
    beam_pipeline.log_to_stderr_once()
    splits = splits_beam.build_splits_beam(args.train_corpus, args.valid_corpus, cfg, runner=args.runner,
                                           beam_options=args.beam_options, vocab_path=args.vocab_path,
                                           text_field=args.text_field, skip_bad_lines=args.skip_bad_lines)
    # The cache key names the corpus contents: one streaming pass here, in corpus order.
    read = dict(text_field=args.text_field, skip_bad_lines=args.skip_bad_lines)
    train_fp = _fingerprint(beam_io.stream_documents(args.train_corpus, **read))
    valid_fp = _fingerprint(beam_io.stream_documents(args.valid_corpus, **read))
  else:
    from private_t5.data import corpora  # pylint: disable=g-import-not-at-top
    docs = lambda specs: (d for s in specs for d in corpora.iter_documents(s, text_field=args.text_field))
    tokenize = None
    if args.vocab_path:
      import sentencepiece as spm  # pylint: disable=g-import-not-at-top
      sp = spm.SentencePieceProcessor(model_file=args.vocab_path)
      tokenize = lambda text: sp.encode(text)
    # One streaming pass over each corpus (texts and band keys spilled to a temporary folder).
    splits = split_search.build_splits_streaming(docs(args.train_corpus), docs(args.valid_corpus), cfg,
                                               tokenize=tokenize, verbose=True)
    train_fp, valid_fp = splits.fingerprints
  key = split_files.splits_key_from_fingerprints(train_fp, valid_fp, cfg, tokenizer_id if args.vocab_path else None)
  output = split_files.split_file_path(args.output, key) if to_folder else args.output
  split_files.write_split_file(output, splits, key, cfg, tokenizer_id if args.vocab_path else None, specs)
  json.dump({"output": os.path.abspath(output), "key": key, "runner": args.runner, "sizes": splits.sizes(),
             "stats": splits.stats}, sys.stdout, indent=2)
  print()
  return 0


def _one(specs: List[str]):
  return specs[0] if len(specs) == 1 else list(specs)


if __name__ == "__main__":
  sys.exit(main())
