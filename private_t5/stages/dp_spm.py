"""`private-t5 dp-spm`: trains a differentially private SentencePiece vocabulary.

  private-t5 dp-spm --gin_file=configs/runs/dp_spm.gin \\
      --gin.CORPUS=corpus.jsonl.gz --gin.OUTPUT=vocab/dp_spm.model [--gin.NAME=VALUE ...]
  private-t5 dp-spm --gin_file=configs/runs/dp_spm.gin --corpus=a.jsonl.gz --corpus=b.jsonl.gz \\
      --output=vocab/dp_spm.model --target_epsilon=3.37 --delta=1e-8 --sensitivity=capped \\
      [--public_corpus=public.jsonl.gz] [--eval_corpus=heldout.jsonl.gz] [--strict_vocab_size]
  private-t5 dp-spm --gin_file=configs/runs/dp_spm.gin --corpus='c4/train-*.jsonl.gz' \\
      --output=vocab/dp_spm.model --runner=DataflowRunner --beam_options="--project=P --region=R \\
      --temp_location=gs://B/tmp"
  private-t5 dp-spm --gin_file=configs/runs/dp_spm.gin --corpus='/shared/c4/train-*.jsonl.gz' \
      --output=vocab/dp_spm.model --runner=DaskRunner --beam_options="--dask_client_address=HOST:8786"

`--runner` other than `local` builds the noiseless histogram on Apache Beam (see
`private_t5.data.beam_io`; on a Dask cluster the corpus and the temporary folder, `--temp_location`,
must be on storage every worker reads: docs/scaling.md); noise and threshold are applied once,
here, either way.

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
from private_t5.stages import gin_args
from private_t5.data import beam_runner
from private_t5.data import beam_pipeline
from private_t5.tokenizer import dp_spm_train
from private_t5.tokenizer import dp_spm_histogram

_GIN_NAME = "train_dp_vocabulary"


def _parser() -> argparse.ArgumentParser:
  p = flags.StageParser("dp-spm", __doc__.split("\n\n")[0])
  # Each flag sets one parameter of train_dp_vocabulary (a Gin binding, after the files').
  def flag(name, param=None, **kwargs):
    p.add_flag(name, gin=f"{_GIN_NAME}.{param or name}", **kwargs)
  flag("corpus", action="append", help="corpus spec (repeat for several corpora)")
  flag("output", help="path of the .model file to write")
  flag("private_dir", help=("where the private folder of the documents' signatures and key goes (default: the "
                            "output's folder with .private appended; never inside the output's folder)"))
  flag("vocab_size", type=int)
  flag("model_type", choices=dp_spm_train.MODEL_TYPES)
  flag("target_epsilon", aliases=("epsilon",), type=float,
       help="target ε (σ calibrated); exclusive with --noise_std")
  flag("noise_std", type=float, help="σ of the count noise; exclusive with --epsilon")
  flag("delta", type=float, help="total δ (<< 1/number of documents)")
  flag("sensitivity", choices=dp_spm_histogram.SENSITIVITY_MODES)
  flag("max_words", "max_words_per_document", type=int, help="N (paper) or W (capped) words per document")
  flag("insecure_seed", type=int, help="fixed noise seed: deterministic tests only, NOT private")
  flag("num_workers", type=int, help="histogram processes (default: all cores)")
  flag("max_documents", type=int, help="read at most this many documents per corpus")
  flag("public_corpus", action="append",
       help="public corpus spec whose exact word counts join the private noisy histogram (repeatable)")
  flag("extra_characters", help="characters added to the base set (printable ASCII) of every vocabulary")
  flag("strict_vocab_size", action="store_true", default=None,
       help="fail (exit 2) when the kept words support fewer pieces than --vocab_size")
  flag("eval_corpus", action="append",
       help="corpus spec for the utility sample (default: the training corpus, a non-private statistic)")
  flag("eval_documents", type=int, help="documents in the utility sample (0: none)")
  beam_runner.add_runner_flags(p)
  return p


def main(argv: Optional[List[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args, gin_files, bindings = _parser().parse_stage_args(argv)
  # One of target_epsilon and noise_std: the flag given replaces the Gin files' other one.
  if args.target_epsilon is not None and args.noise_std is None:
    bindings.append(gin_args.Binding(f"{_GIN_NAME}.noise_std=None", "--target_epsilon"))
  elif args.noise_std is not None and args.target_epsilon is None:
    bindings.append(gin_args.Binding(f"{_GIN_NAME}.target_epsilon=None", "--noise_std"))
  # Flags such as --corpus/--output may fill the Gin file's required macros: checked below.
  gin_utils.parse(gin_files, bindings, check_required=False, entry=_GIN_NAME)
  overrides = {}
  if beam_runner.is_beam(args.runner):
    from private_t5.tokenizer import dp_spm_beam  # pylint: disable=g-import-not-at-top
    beam_pipeline.log_to_stderr_once()
    overrides["histogram_fn"] = dp_spm_beam.beam_histogram_fn(args.runner, args.beam_options,
                                                              skip_bad_lines=args.skip_bad_lines)
  fn = gin_utils.configured(_GIN_NAME)
  report = gin_utils.call_configured(fn, **overrides)
  json.dump(report, sys.stdout, indent=2)
  print()
  return 0


if __name__ == "__main__":
  sys.exit(main())
