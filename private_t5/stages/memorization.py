"""`private-t5 memorization`: does this checkpoint leak its training data?

  private-t5 memorization --gin_file=configs/runs/memorization.gin \
      --gin.MODEL_DIR=/path/run --gin.TRAIN_CORPUS=/path/train.jsonl.gz \
      --gin.VALID_CORPUS=/path/valid.jsonl.gz --gin.OUTPUT_DIR=/path/memorization

Runs `eval.memorization_run.run_memorization` (extraction on the four splits, canary exposure,
the one-run privacy audit) and writes report.json, report.md and plots to OUTPUT_DIR. Gin
binds only `run_memorization` and `SplitConfig`.
"""
import argparse
import sys

from private_t5.stages import flags
from private_t5.stages import verbosity
from private_t5.stages import gin_utils

USAGE = """usage: private-t5 memorization --gin_file=configs/runs/memorization.gin [--gin.NAME=VALUE ...]

Required macros: MODEL_DIR (a training run's directory), TRAIN_CORPUS and VALID_CORPUS (corpus
specs: .jsonl[.gz], .txt, folder, .tsv, tfds:NAME[:SPLIT]), OUTPUT_DIR. Common overrides:
PROMPT_LENGTH (512), GENERATION_LENGTH (114), MAX_EXAMPLES_PER_SPLIT, BATCH_SIZE (global, over
all devices), BEAM_SIZE (0 = greedy only), MESH_SHAPE ((-1, 1): every device on the data axis;
(2, 4) also splits the parameters over 4 devices), VOCAB_PATH (default: the checkpoint's),
CANARIES (a .canaries.json record written by `private-t5 canaries`), AUDIT (a .audit.json
membership record written by `private-t5 canaries --audit`). See docs/memorization.md.
"""


def parse_mesh_shape(text: str):
  """`--mesh_shape=DATA,MODEL` (one may be -1) as the tuple Gin binds."""
  try:
    shape = tuple(int(s) for s in text.strip("()[] ").split(","))
  except ValueError:
    shape = ()
  if len(shape) != 2:
    raise argparse.ArgumentTypeError(f"expected DATA,MODEL (two integers, one may be -1), got {text!r}")
  return shape


def _parser():
  p = flags.StageParser("memorization", "Measure training-data extraction and canary exposure.",
                        epilog=USAGE, gin_required=True)
  p.add_flag("model_dir", gin="MODEL_DIR", help="model directory (a training run or `private-t5 import`)")
  p.add_flag("train_corpus", gin="TRAIN_CORPUS", help="corpus the model was trained on")
  p.add_flag("valid_corpus", gin="VALID_CORPUS", help="held-out corpus of the same distribution")
  p.add_flag("output", gin="OUTPUT_DIR", help="report directory")
  p.add_flag("vocab_path", gin="VOCAB_PATH", help="SentencePiece model (default: the checkpoint's)")
  p.add_flag("canaries", gin="CANARIES", help="canary record written by `private-t5 canaries`")
  p.add_flag("audit", gin="AUDIT", help="audit membership record written by `private-t5 canaries --audit`")
  p.add_flag("batch_size", gin="BATCH_SIZE", type=int, help="decoding batch size (global, over all devices)")
  p.add_flag("mesh_shape", gin="MESH_SHAPE", type=parse_mesh_shape, metavar="DATA,MODEL",
             help="device mesh of the decoding (default -1,1: every device on the data axis)")
  return p


def main(argv) -> int:
  if not argv:
    print(USAGE, file=sys.stderr)
    return 2
  parsed = _parser().parse_stage_args(argv)
  gin_utils.run_stage(parsed.gin_files, parsed.gin_bindings, "run_memorization", log=verbosity.stage_print)
  return 0
