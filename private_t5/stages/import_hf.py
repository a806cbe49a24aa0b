"""`private-t5 import`: a Hugging Face T5 directory becomes a model directory.

  private-t5 import --hf_dir=/path/to/t5-small --model_dir=/tmp/t5_small_init

The HF directory must hold `config.json` and `model.safetensors` (as written by
`save_pretrained`, or a downloaded snapshot); nothing is fetched from the network. The output
is `MODEL_DIR/checkpoints/0/` (parameters and metadata: model config, vocabulary), which
`private-t5 export`, `train` (`--initial_checkpoint=MODEL_DIR`), `evaluate` and `memorization`
(`--model_dir=MODEL_DIR`) accept. Prints the model's Gin settings.
"""
import dataclasses
import logging
import os
import shutil
import sys
from typing import List, Optional

from private_t5.stages import flags
from private_t5 import io as io_lib
from private_t5.errors import CheckpointError

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".import_hf_t5_"


def gin_lines(config) -> str:
  """`T5Config.NAME = VALUE` lines of a model config."""
  return "\n".join(f"T5Config.{k} = {v!r}".replace("'", '"') for k, v in dataclasses.asdict(config).items())


def import_to_model_dir(hf_dir: str, model_dir: str, vocab_path: Optional[str] = None):
  """Writes the checkpoint of the HF model in `hf_dir` to `model_dir`; returns its T5Config.

  Raises:
    CheckpointError: `model_dir` already holds checkpoints, or `hf_dir` is not a T5 directory.
  """
  from private_t5.models import hf_convert  # pylint: disable=g-import-not-at-top
  from private_t5.models import checkpoints, run_dir  # pylint: disable=g-import-not-at-top

  if run_dir.has_checkpoints(model_dir):
    raise CheckpointError(f"{model_dir!r} already holds checkpoints; choose a new --model_dir")
  params, config = hf_convert.import_hf_t5(hf_dir)
  vocab_path = vocab_path or hf_convert.hf_vocabulary_path(hf_dir)
  if vocab_path:
    if not os.path.isfile(vocab_path):
      raise CheckpointError(f"vocabulary {vocab_path!r} does not exist")
    vocab_path = os.path.abspath(vocab_path)
  metadata = {"model_config": dataclasses.asdict(config), "vocab_path": vocab_path,
              "privacy_report": None, "feature_lengths": None,
              "imported_from": {"format": "huggingface", "path": os.path.abspath(hf_dir)}}
  # Write into a temporary sibling, then rename: a killed import leaves nothing behind.
  parent = os.path.dirname(os.path.abspath(model_dir)) or "."
  os.makedirs(parent, exist_ok=True)
  io_lib.remove_stale_temp_dirs(parent, TEMP_PREFIX)
  tmp_dir = io_lib.make_temp_dir(parent, TEMP_PREFIX)
  try:
    manager = checkpoints.CheckpointManager(tmp_dir, keep=1, async_save=False)
    manager.save(0, {"step": 0, "params": params}, metadata)
    manager.close()
    if os.path.isdir(model_dir) and not os.listdir(model_dir):
      os.rmdir(model_dir)
    if os.path.exists(model_dir):
      shutil.move(run_dir.checkpoints_dir(tmp_dir), model_dir)
    else:
      os.replace(tmp_dir, model_dir)
  finally:
    if os.path.isdir(tmp_dir):
      shutil.rmtree(tmp_dir, ignore_errors=True)
  logger.info("wrote %s", os.path.join(run_dir.checkpoints_dir(model_dir), "0"))
  if not vocab_path:
    logger.warning("no spiece.model in %s and no --vocab_path: the model directory records no vocabulary",
                   hf_dir)
  return config


def _parser() -> flags.StageParser:
  p = flags.StageParser("import", __doc__.split("\n\n")[0])
  p.add_flag("hf_dir", help="Hugging Face T5 directory (config.json + model.safetensors) (required)")
  p.add_flag("model_dir", help="output model directory (must not hold checkpoints) (required)")
  p.add_flag("vocab_path", help="SentencePiece model to record (default: HF_DIR/spiece.model if present)")
  return p


def main(argv: Optional[List[str]] = None) -> int:
  parser = _parser()
  args = parser.parse_stage_args(sys.argv[1:] if argv is None else argv).args
  flags.check_required(parser, args, ("hf_dir", "model_dir"))
  config = import_to_model_dir(args.hf_dir, args.model_dir, args.vocab_path)
  print(gin_lines(config))
  return 0


if __name__ == "__main__":
  sys.exit(main())
