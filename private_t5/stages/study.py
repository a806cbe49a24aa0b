"""`private-t5 study`: the findings of Ponomareva et al. 2022 end to end, in one command.

  private-t5 study --corpus=/path/corpus.jsonl.gz --output=/path/study [--gin.NAME=VALUE ...]
  private-t5 study --part=utility --corpus=PATH --task_dir=DIR --output=DIR [--gin.NAME=VALUE ...]

The flags, the Gin files and the call: the memorization part is
`experiments.study.run_study`, the utility part `experiments.study_utility.run_utility_study`;
each training run they ask for (`train_model`, `finetune_model`) is the Gin-configured `train`
with the part's Gin files plus the run's bindings. The default Gin experiment is
configs/experiments/study.gin (a tiny T5 at short lengths).
"""
import logging
import sys
from typing import Callable, List, Optional, Sequence

from private_t5.errors import ConfigError
from private_t5.stages import flags
from private_t5.stages import gin_utils
from private_t5.stages import gin_args
from private_t5.stages import gin_queries
from private_t5 import moved_names

# The library of the study, readable from here for one more release (with a DeprecationWarning;
# imported on first use: JAX and the trainer are not needed for `study --help`).
__getattr__ = moved_names.moved(__name__, {"private_t5.experiments.study": (
    "DEFAULT_MODELS", "MODELS", "NOT_DP_RESULT_KEYS", "RESULT_FILE", "ModelSpec", "cached_json", "check_private",
    "em_by_repetitions", "model_result", "prepare_data", "pretraining_bindings", "privacy_fields", "run_study",
    "train_vocabularies")})

logger = logging.getLogger(__name__)

DEFAULT_GIN_FILE = "experiments/study.gin"
USAGE = """usage: private-t5 study [--part=memorization] --corpus=PATH --output=DIR [--gin_file=FILE ...] [--gin.NAME=VALUE ...]
       private-t5 study --part=utility --corpus=PATH --task_dir=DIR --output=DIR [--gin.NAME=VALUE ...]

--part=utility pretrains non-DP, DP and full-DP span-corruption models, fine-tunes each (and a
model never pretrained) on a GLUE-style task publicly and with DP, sweeps the batch size at a
fixed ε, and writes the same three files (default Gin file: configs/experiments/study_utility.gin).
Its task: a folder DIR (train.tsv, validation.tsv with a header) described by DIR/task.json or by
--text_fields=a,b --label_field=L --label_names=x,y [--metric=M] (docs/finetuning.md, "Your own
task"), or a registered task (--task=NAME; tasks registered in code: --task_module=my.tasks).

Trains four models on one corpus with planted duplicates (non-DP prefix LM, non-DP span
corruption, DP prefix LM, DP-SentencePiece + DP prefix LM), measures their memorization and
validation accuracy, and writes results.json, results.md and figure.png to DIR. Default Gin
file: configs/experiments/study.gin. Re-running with the same DIR resumes. See docs/study.md.
"""


PARTS = {  # --part -> (its Gin entry, its default Gin file)
    "memorization": ("run_study", DEFAULT_GIN_FILE),
    "utility": ("run_utility_study", "experiments/study_utility.gin"),
}


def _parser():
  p = flags.StageParser("study", "Reproduce the findings of Ponomareva et al. 2022 on a corpus: memorization "
                        "(Table 3) or utility (Tables 1 and 2, batch size).", epilog=USAGE)
  p.add_flag("part", macro=False, choices=tuple(PARTS), default="memorization",
             help="memorization (default; Gin entry run_study) or utility (run_utility_study, docs/study.md)")
  p.add_flag("corpus", macro=False, help="corpus spec (.jsonl[.gz], .txt, folder, .tsv, tfds:NAME) "
             "[Gin: run_study.corpus / run_utility_study.corpus]")
  p.add_flag("output", macro=False, help="study directory (resumed when it exists) "
             "[Gin: run_study.output_dir / run_utility_study.output_dir]")
  p.add_flag("task_dir", macro=False, help="--part=utility: a GLUE-layout task folder "
             "(<dir>/{train,validation}.tsv; described by <dir>/task.json, the flags below, or named like a "
             "local task) [Gin: run_utility_study.task_dir]")
  for flag, what in TASK_FLAGS.items():
    p.add_flag(flag, macro=False, help=f"--part=utility: {what} [Gin: run_utility_study.{flag}]")
  return p


TASK_FLAGS = {  # --part=utility only: the task, as `private-t5 train` takes it
    "task": "a registered task (with --task_dir: the folder's task's name)",
    "text_fields": "text columns of --task_dir in input order (a,b)",
    "label_field": "label column of --task_dir", "label_names": "class names of --task_dir (x,y)",
    "metric": "metric of --task_dir (default accuracy)",
    "task_module": "module(s) imported first (and in every worker process), registering tasks in code",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parsed = _parser().parse_stage_args(argv)
  entry, default_file = PARTS[parsed.args.part]
  task_flags = ["task_dir", *TASK_FLAGS]
  given = [f"--{f}" for f in task_flags if getattr(parsed.args, f) is not None]
  if given and entry != "run_utility_study":
    raise ConfigError(f"private-t5 study: {', '.join(given)} {'is' if len(given) == 1 else 'are'} for --part=utility")
  files = parsed.gin_files or [default_file]
  bindings = list(parsed.gin_bindings)
  if entry == "run_utility_study" and any(b.split("=", 1)[0].strip() == "TASK_MODULE" for b in bindings):
    bindings.append(gin_args.Binding("run_utility_study.task_module=%TASK_MODULE", "--gin.TASK_MODULE"))
  for flag, param in (("corpus", "corpus"), ("output", "output_dir"), *((f, f) for f in task_flags)):
    value = getattr(parsed.args, flag)
    if value is not None:
      bindings.append(gin_args.Binding(f"{entry}.{param}={value!r}", f"--{flag}={value}"))
  # The training run's own macros are set per model: check them when each model is trained.
  gin_utils.parse(files, bindings, check_required=False, entry=entry)
  from private_t5.train import partitioning  # pylint: disable=g-import-not-at-top
  partitioning.hide_accelerators_from_tensorflow()

  def trainer(run_files: Sequence[str]) -> Callable[[str, List[str]], dict]:
    def train_model(model_dir: str, extra: List[str]) -> dict:
      gin_utils.parse(run_files, bindings + [gin_args.Binding(b) for b in extra], entry=entry)
      return gin_utils.call_configured(gin_utils.configured("train"), log=logger.info,
                                      operative_config=gin_utils.operative_config)
    return train_model

  if entry == "run_study":
    gin_utils.call_configured(gin_utils.configured(entry), train_model=trainer(files))
  else:
    finetune_files = gin_queries.macro_value("FINETUNE_GIN_FILES") or []
    if not finetune_files:
      raise ConfigError("private-t5 study --part=utility: the Gin files set no FINETUNE_GIN_FILES")
    gin_utils.call_configured(gin_utils.configured(entry), train_model=trainer(files),
                              finetune_model=trainer(list(finetune_files)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
