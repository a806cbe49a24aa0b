#!/usr/bin/env python
"""Converts a Hugging Face T5 directory into a private_t5 checkpoint a fine-tuning run loads.

  python scripts/convert_hf_t5.py --hf_dir=/path/to/t5-small --model_dir=/tmp/t5_small_init

The HF directory must hold `config.json` and `model.safetensors` (as written by
`save_pretrained`, or a downloaded snapshot); nothing is fetched from the network. The
output is `MODEL_DIR/checkpoints/0/` (parameters and metadata: model config, vocabulary),
readable by `checkpoints.restore_for_inference` and usable as
`--gin.INITIAL_CHECKPOINT=MODEL_DIR`. It also prints the model gin settings of the import.
"""
import argparse
import dataclasses
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hf_dir", required=True, help="Hugging Face T5 directory")
  parser.add_argument("--model_dir", required=True, help="output directory (must not hold checkpoints)")
  parser.add_argument("--vocab_path", default=None,
                      help="SentencePiece model to record (default: HF_DIR/spiece.model if present)")
  return parser.parse_args(argv)


def _gin_lines(config) -> str:
  lines = [f"T5Config.{k} = {v!r}".replace("'", '"') for k, v in dataclasses.asdict(config).items()]
  return "\n".join(lines)


def convert(hf_dir: str, model_dir: str, vocab_path=None) -> str:
  """Writes the checkpoint and returns the path of its step directory."""
  from private_t5.errors import CheckpointError  # pylint: disable=g-import-not-at-top
  from private_t5.models import hf_convert  # pylint: disable=g-import-not-at-top
  from private_t5.train import checkpoints  # pylint: disable=g-import-not-at-top

  if os.path.isdir(os.path.join(model_dir, checkpoints.CHECKPOINT_SUBDIR)):
    raise CheckpointError(f"{model_dir!r} already holds checkpoints; choose a new --model_dir")
  params, config = hf_convert.import_hf_t5(hf_dir)
  vocab_path = vocab_path or hf_convert.hf_vocabulary_path(hf_dir)
  if vocab_path:
    vocab_path = os.path.abspath(vocab_path)
  metadata = {"model_config": dataclasses.asdict(config), "vocab_path": vocab_path,
              "privacy_report": None, "feature_lengths": None,
              "imported_from": {"format": "huggingface", "path": os.path.abspath(hf_dir)}}
  # Write into a temporary sibling, then rename: a killed conversion leaves nothing behind.
  parent = os.path.dirname(os.path.abspath(model_dir)) or "."
  os.makedirs(parent, exist_ok=True)
  tmp_dir = tempfile.mkdtemp(dir=parent, prefix=".convert_hf_t5_")
  try:
    manager = checkpoints.CheckpointManager(tmp_dir, keep=1, async_save=False)
    manager.save(0, {"step": 0, "params": params}, metadata)
    manager.close()
    if os.path.isdir(model_dir) and not os.listdir(model_dir):
      os.rmdir(model_dir)
    if os.path.exists(model_dir):
      shutil.move(os.path.join(tmp_dir, checkpoints.CHECKPOINT_SUBDIR), model_dir)
    else:
      os.replace(tmp_dir, model_dir)
  finally:
    if os.path.isdir(tmp_dir):
      shutil.rmtree(tmp_dir, ignore_errors=True)
  print(f"wrote {os.path.join(model_dir, checkpoints.CHECKPOINT_SUBDIR, '0')}", file=sys.stderr)
  print(_gin_lines(config))
  return model_dir


def main(argv=None) -> int:
  from private_t5.errors import PrivateT5Error  # pylint: disable=g-import-not-at-top
  args = _parse(sys.argv[1:] if argv is None else argv)
  try:
    convert(args.hf_dir, args.model_dir, args.vocab_path)
  except PrivateT5Error as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
