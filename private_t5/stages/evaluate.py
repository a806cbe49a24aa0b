"""`private-t5 evaluate`: GLUE-style evaluation of a checkpoint by greedy decoding.

  private-t5 evaluate --gin_file=configs/runs/eval.gin \
      --gin.MODEL_DIR=/tmp/ft_rt --gin.MIXTURE_OR_TASK_NAME=rotten_tomatoes

Runs `eval.glue_eval.evaluate` (Gin: `evaluate`): writes `MODEL_DIR/eval/results.json` and
`MODEL_DIR/eval/results.md`. Your own task folder: --task_dir=DIR (described by DIR/task.json or
--text_fields, --label_field, --label_names, --metric, as for `private-t5 train`).
"""
import sys

from private_t5.stages import flags
from private_t5.stages import gin_utils
from private_t5.stages import memorization as memorization_stage
from private_t5.stages import train as train_stage


def _parser():
  parser = flags.StageParser(
      "evaluate", "Evaluate a checkpoint on GLUE-style tasks (greedy decoding, GLUE metrics).",
      epilog="Configure with --gin_file=configs/runs/eval.gin and --model_dir=... --task=... "
             "(or --gin.MODEL_DIR=... --gin.MIXTURE_OR_TASK_NAME=...).", gin_required=True)
  parser.add_flag("model_dir", gin="MODEL_DIR", help="model directory (a training run or `private-t5 import`)")
  parser.add_flag("task", gin="MIXTURE_OR_TASK_NAME", help="task or mixture to evaluate "
                  "(with --task_dir: the folder's task's name)")
  train_stage.add_task_flags(parser, task=False)
  parser.add_flag("vocab_path", gin="evaluate.vocab_path", help="SentencePiece model (default: the checkpoint's)")
  parser.add_flag("output", gin="evaluate.output_dir", help="results directory (default: MODEL_DIR/eval)")
  parser.add_flag("batch_size", gin="evaluate.batch_size", type=int,
                  help="decoding batch size (global, over all devices)")
  parser.add_flag("mesh_shape", gin="evaluate.mesh_shape", type=memorization_stage.parse_mesh_shape,
                  metavar="DATA,MODEL", help="device mesh of the decoding (default -1,1: every device on data)")
  parser.add_flag("initial_checkpoint", gin="INITIAL_CHECKPOINT",
                  help="a LoRA run whose base moved: the base's new directory (checked by SHA-256, as for train)")
  return parser


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parsed = _parser().parse_stage_args(argv)
  bindings = train_stage.with_task_dir_name(parsed.gin_bindings)
  train_stage.check_task_description(parsed.gin_files, bindings, "evaluate")
  gin_utils.run_stage(parsed.gin_files, bindings, "evaluate")
  return 0


if __name__ == "__main__":
  sys.exit(main())
