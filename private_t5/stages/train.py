"""`private-t5 train`: pretrain (or fine-tune) a T5 model from layered Gin files.

  private-t5 train --gin_file=configs/models/t5_1_0_tiny.gin \
      --gin_file=configs/runs/pretrain.gin \
      --gin.MODEL_DIR=/tmp/run --gin.TRAIN_STEPS=1000 --gin.CORPUS=builtin:python_docs \
      --gin.VOCAB_PATH=/tmp/vocab/spm.model --gin.DP=None

Gin binds only this stage's entry point (`train`, the library's `train.main.train`) and the
factories it is given; the library below is plain Python. Re-running the same command resumes
from the latest checkpoint in MODEL_DIR.
"""
import sys
from typing import Optional, Sequence

from private_t5.errors import ConfigError
from private_t5.stages import flags
from private_t5.stages import verbosity
from private_t5.stages import gin_utils
from private_t5.stages import gin_queries
from private_t5.stages import gin_args

USAGE = """usage: private-t5 train --gin_file=FILE [--gin_file=FILE ...] [--gin.NAME=VALUE ...]

Layered Gin files: a model (configs/models/*.gin), then a run (configs/runs/pretrain.gin), then
experiments (configs/experiments/*.gin); --gin.NAME=VALUE overrides come last.
Required macros of configs/runs/pretrain.gin: MODEL_DIR, TRAIN_STEPS, TASK_FEATURE_LENGTHS,
CORPUS, VOCAB_PATH. Non-private baseline: --gin.DP=None. See docs/training.md.
A registered seqio Task or Mixture instead of CORPUS, as in T5X: --gin.MIXTURE_OR_TASK_NAME=NAME
--gin.MIXTURE_OR_TASK_MODULE=my.tasks (configs/runs/seqio.gin is then layered last; docs/data.md).
Fine-tuning (configs/runs/finetune*.gin) on your own task folder: --task_dir=DIR, described by
DIR/task.json or --text_fields=a,b --label_field=L --label_names=x,y [--metric=M]; tasks registered
in code: --gin.TASK_MODULE=my.tasks. See docs/finetuning.md, "Your own task".
"""
SEQIO_GIN = "runs/seqio.gin"
SEQIO_MODULE_MACRO = "MIXTURE_OR_TASK_MODULE"
TASK_NAME_MACRO = "MIXTURE_OR_TASK_NAME"
TASK_DIR_MACRO = "TASK_DIR"


def with_seqio_layer(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> list:
  """The Gin files, with configs/runs/seqio.gin last when a binding names MIXTURE_OR_TASK_MODULE.

  A T5X command line gives its Task by MIXTURE_OR_TASK_NAME and the module registering it;
  that module is the sign that the data is a seqio Task, not one of our corpora (GLUE fine-tuning
  names its own tasks by MIXTURE_OR_TASK_NAME alone).
  """
  files = list(gin_files)
  seqio = any(b.split("=", 1)[0].strip() == SEQIO_MODULE_MACRO for b in gin_bindings)
  if seqio and not any(f.replace("\\", "/").endswith(SEQIO_GIN) for f in files):
    files.append(SEQIO_GIN)
  return files


def _bound(bindings: Sequence[str], name: str) -> bool:
  return any(b.split("=", 1)[0].strip() == name for b in bindings)


def with_task_dir_name(gin_bindings: Sequence[str]) -> list:
  """The bindings, plus MIXTURE_OR_TASK_NAME=None when a TASK_DIR is given without a name: the
  folder then names its task (its task.json's "name", else the folder's name)."""
  bindings = list(gin_bindings)
  if _bound(bindings, TASK_DIR_MACRO) and not _bound(bindings, TASK_NAME_MACRO):
    bindings.append(gin_args.Binding(f"{TASK_NAME_MACRO}=None", "--task_dir"))
  return bindings


# The macros of a task folder's description, and their flags.
_DESCRIPTION_MACROS = (("TASK_TEXT_FIELDS", "--text_fields"), ("TASK_LABEL_FIELD", "--label_field"),
                       ("TASK_LABEL_NAMES", "--label_names"), ("TASK_METRIC", "--metric"))


def check_task_description(gin_files: Sequence[str], gin_bindings: Sequence[str], entry: str) -> None:
  """ConfigError when a task folder's description (--label_names, ...) is given without a folder:
  neither --task_dir nor the Gin files' TASK_DIR (read only in that case) names one. Checked before
  the required macros, whose message would name another problem."""
  given = [flag for macro, flag in _DESCRIPTION_MACROS
           if any(b.split("=", 1)[0].strip() == macro and b.split("=", 1)[1].strip() != "None" for b in gin_bindings)]
  if not given or _bound(gin_bindings, TASK_DIR_MACRO):
    return
  gin_utils.parse(gin_files, gin_bindings, check_required=False, entry=entry)
  if gin_queries.macro_value(TASK_DIR_MACRO) is None:
    raise ConfigError(f"{', '.join(given)} {'describes' if len(given) == 1 else 'describe'} the task of a "
                      "folder: give --task_dir=DIR too")


def add_task_flags(parser: flags.StageParser, task: bool = True) -> None:
  """The flags of a GLUE-style task (fine-tuning and evaluation): a task folder and its description."""
  if task:
    parser.add_flag("task", gin=TASK_NAME_MACRO, help="task or mixture (with --task_dir: the folder's task's name)")
  parser.add_flag("task_dir", gin=TASK_DIR_MACRO, help="your own task folder (train.tsv, validation.tsv with a "
                  "header; DIR/task.json or the flags below describe it)")
  parser.add_flag("text_fields", gin="TASK_TEXT_FIELDS", help="text columns of --task_dir, in input order (a,b)")
  parser.add_flag("label_field", gin="TASK_LABEL_FIELD", help="label column of --task_dir")
  parser.add_flag("label_names", gin="TASK_LABEL_NAMES", help="class names of --task_dir in index order (x,y)")
  parser.add_flag("metric", gin="TASK_METRIC", help="metric of --task_dir (default accuracy; e.g. mrpc, cola)")
  parser.add_flag("task_module", gin="TASK_MODULE", help="module(s) imported first, registering tasks in code")


def add_training_flags(parser: flags.StageParser) -> None:
  """The plain flags of every training stage (train, jft, adaptive); each sets a Gin macro/binding."""
  parser.add_flag("model_dir", gin="MODEL_DIR", help="run directory (checkpoints, summary)")
  parser.add_flag("corpus", gin="CORPUS", help="training corpus spec (pretraining)")
  parser.add_flag("vocab_path", gin="VOCAB_PATH", help="SentencePiece model")
  parser.add_flag("train_steps", gin="TRAIN_STEPS", type=int, help="number of training steps")
  parser.add_flag("batch_size", gin="BATCH_SIZE", type=int, help="batch size")
  parser.add_flag("initial_checkpoint", gin="INITIAL_CHECKPOINT",
                  help="model directory to start from (fine-tuning; e.g. from `private-t5 import`)")
  parser.add_flag("target_epsilon", gin="DPConfig.target_epsilon", type=float,
                  help="ε the DP run ends at (σ calibrated)")
  parser.add_flag("noise_multiplier", gin="DPConfig.noise_multiplier", type=float,
                  help="σ instead of --target_epsilon")
  parser.add_flag("delta", gin="DPConfig.delta", type=float, help="δ of the DP run")


def run_from_args(argv: Sequence[str], entry: str = "train", stage: str = "train",
                  description: str = USAGE) -> dict:
  """Parses the stage's flags and runs the configured `entry` (default `train()`); returns its result.

  The other training stages (`just_fine_tune_twice`, `train_adaptive`) come through here, so
  they parse and check Gin exactly as `train` does; each run writes Gin's operative config to
  MODEL_DIR/config.gin.
  """
  parser = flags.StageParser(stage, description, gin_required=True)
  add_training_flags(parser)
  if stage == "train":
    add_task_flags(parser)
  parsed = parser.parse_stage_args(argv)
  if parsed.args.noise_multiplier is not None and parsed.args.target_epsilon is None:
    parsed.gin_bindings.append(gin_args.Binding("DPConfig.target_epsilon=None", "--noise_multiplier"))
  bindings = with_task_dir_name(parsed.gin_bindings)
  if stage == "train":
    check_task_description(with_seqio_layer(parsed.gin_files, bindings), bindings, entry)
  return gin_utils.run_stage(with_seqio_layer(parsed.gin_files, bindings), bindings, entry,
                             operative_config=gin_utils.operative_config, log=verbosity.stage_print)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv:
    print(USAGE)
    return 0
  run_from_args(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
