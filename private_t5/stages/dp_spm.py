"""`private-t5 dp-spm`: trains a differentially private SentencePiece vocabulary.

  private-t5 dp-spm --gin_file=configs/runs/dp_spm.gin \\
      --gin.CORPUS=corpus.jsonl.gz --gin.OUTPUT=vocab/dp_spm.model [--gin.NAME=VALUE ...]
  private-t5 dp-spm --gin_file=configs/runs/dp_spm.gin --corpus=a.jsonl.gz --corpus=b.jsonl.gz \\
      --output=vocab/dp_spm.model --target_epsilon=3.37 --delta=1e-8 --sensitivity=capped \\
      [--public_corpus=public.jsonl.gz] [--eval_corpus=heldout.jsonl.gz] [--strict_vocab_size]
  private-t5 dp-spm --gin_file=configs/runs/dp_spm.gin --corpus='c4/train-*.jsonl.gz' \\
      --output=vocab/dp_spm.model --runner=DataflowRunner --beam_options="--project=P --region=R \\
      --temp_location=gs://B/tmp"

`--runner` other than `local` builds the noiseless histogram on Apache Beam (see
`private_t5.data.beam_io`); noise and threshold are applied once, here, either way.

Plain flags override the Gin values. Writes the model and `privacy_report.json` beside it
as one unit (the report first, naming the model by its hash; then the model) and prints the
report as JSON.
"""
import argparse
import json
import sys
from typing import List, Optional

from private_t5.stages import flags
from private_t5.stages import gin_utils
from private_t5.data import beam_io
from private_t5.tokenizer import dp_spm

_GIN_NAME = "train_dp_vocabulary"

# flag -> (parameter of train_dp_vocabulary, type)
_FLAGS = {
    "corpus": ("corpus", str), "output": ("output", str), "vocab_size": ("vocab_size", int),
    "model_type": ("model_type", str), "target_epsilon": ("target_epsilon", float), "noise_std": ("noise_std", float),
    "delta": ("delta", float), "sensitivity": ("sensitivity", str), "max_words": ("max_words_per_document", int),
    "insecure_seed": ("insecure_seed", int), "num_workers": ("num_workers", int),
    "max_documents": ("max_documents", int), "public_corpus": ("public_corpus", str),
    "extra_characters": ("extra_characters", str), "strict_vocab_size": ("strict_vocab_size", bool),
    "eval_corpus": ("eval_corpus", str), "eval_documents": ("eval_documents", int),
}


def _parser() -> argparse.ArgumentParser:
  p = flags.StageParser("dp-spm", __doc__.split("\n\n")[0])
  p.add_argument("--corpus", action="append", help="corpus spec (repeat for several corpora)")
  p.add_argument("--output", help="path of the .model file to write")
  p.add_argument("--vocab_size", type=int)
  p.add_argument("--model_type", choices=dp_spm.MODEL_TYPES)
  p.add_flag("target_epsilon", aliases=("epsilon",), macro=False, type=float,
             help="target ε (σ calibrated); exclusive with --noise_std")
  p.add_argument("--noise_std", type=float, help="σ of the count noise; exclusive with --epsilon")
  p.add_argument("--delta", type=float, help="total δ (<< 1/number of documents)")
  p.add_argument("--sensitivity", choices=dp_spm.SENSITIVITY_MODES)
  p.add_argument("--max_words", type=int, help="N (paper) or W (capped) words per document")
  p.add_argument("--insecure_seed", type=int, help="fixed noise seed: deterministic tests only, NOT private")
  p.add_argument("--num_workers", type=int, help="histogram processes (default: all cores)")
  p.add_argument("--max_documents", type=int, help="read at most this many documents per corpus")
  p.add_argument("--public_corpus", action="append",
                 help="public corpus spec whose exact word counts join the private noisy histogram (repeatable)")
  p.add_argument("--extra_characters", help="characters added to the base set (printable ASCII) of every vocabulary")
  p.add_argument("--strict_vocab_size", action="store_true", default=None,
                 help="fail (exit 2) when the kept words support fewer pieces than --vocab_size")
  p.add_argument("--eval_corpus", action="append",
                 help="corpus spec for the utility sample (default: the training corpus, a non-private statistic)")
  p.add_argument("--eval_documents", type=int, help="documents in the utility sample (0: none)")
  beam_io.add_runner_flags(p)
  return p


def main(argv: Optional[List[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args, gin_files, bindings = _parser().parse_stage_args(argv)
  # Flags such as --corpus/--output may fill the Gin file's required macros: checked below.
  gin_utils.parse(gin_files, bindings, check_required=False, entry=_GIN_NAME)
  overrides = {}
  for flag, (param, _) in _FLAGS.items():
    value = getattr(args, flag)
    if value is None:
      continue
    if flag in ("corpus", "public_corpus", "eval_corpus"):
      value = value[0] if len(value) == 1 else value
    overrides[param] = value
  if "target_epsilon" in overrides:
    overrides.setdefault("noise_std", None)
  elif "noise_std" in overrides:
    overrides["target_epsilon"] = None
  if beam_io.is_beam(args.runner):
    from private_t5.tokenizer import dp_spm_beam  # pylint: disable=g-import-not-at-top
    beam_io.log_to_stderr_once()
    overrides["histogram_fn"] = dp_spm_beam.beam_histogram_fn(args.runner, args.beam_options,
                                                              skip_bad_lines=args.skip_bad_lines)
  fn = gin_utils.configured(_GIN_NAME)
  report = gin_utils.call_configured(fn, **overrides)
  json.dump(report, sys.stdout, indent=2)
  print()
  return 0


if __name__ == "__main__":
  sys.exit(main())
