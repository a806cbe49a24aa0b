#!/usr/bin/env python
"""Deprecated: use `private-t5 import --hf_dir=DIR --model_dir=DIR` (same flags, same output).

  python scripts/convert_hf_t5.py --hf_dir=/path/to/t5-small --model_dir=/tmp/t5_small_init

A thin wrapper kept for old command lines: it runs the `import` stage.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def convert(hf_dir: str, model_dir: str, vocab_path=None) -> str:
  """Writes the checkpoint (see `private_t5.stages.import_hf`) and returns `model_dir`."""
  from private_t5.stages import import_hf as import_stage  # pylint: disable=g-import-not-at-top
  import_stage.import_to_model_dir(hf_dir, model_dir, vocab_path)
  return model_dir


def main(argv=None) -> int:
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  print("scripts/convert_hf_t5.py is deprecated; use `private-t5 import --hf_dir=... --model_dir=...`",
        file=sys.stderr)
  return cli.main(["import"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
  sys.exit(main())
