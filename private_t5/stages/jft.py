"""`private-t5 jft`: Just Fine-tune Twice (Shi et al. 2022), selective DP in two training phases.

  private-t5 jft --gin_file=configs/models/t5_1_0_tiny.gin \
      --gin_file=configs/runs/pretrain.gin --gin_file=configs/runs/jft.gin \
      --gin.MODEL_DIR=/tmp/jft --gin.CORPUS=/data/train.jsonl.gz \
      --gin.REDACTED_CORPUS=/data/train_redacted.jsonl.gz --gin.VOCAB_PATH=/data/spm.model \
      --gin.TASK_FEATURE_LENGTHS="{'inputs': 128, 'targets': 32}" --gin.TRAIN_STEPS=1000

Phase 1 trains on the redacted corpus D' (`private-t5 redact`), phase 2 with DP on the full
data D from phase 1's checkpoint; MODEL_DIR/jft_privacy_report.json states the selective
guarantee and its assumption (Gin: `just_fine_tune_twice`, `private_t5.selective.jft`).
"""
import sys
from typing import Any, Dict, Optional, Sequence

from private_t5.stages import train as train_stage


def run_from_args(argv: Sequence[str]) -> Dict[str, Any]:
  """Parses Gin flags (layered like `private-t5 train`) and runs the configured JFT."""
  return train_stage.run_from_args(argv, entry="just_fine_tune_twice", stage="jft", description=__doc__)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv:
    print(__doc__)
    return 0
  run_from_args(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
