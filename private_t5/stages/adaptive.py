"""`private-t5 adaptive`: Adaptive-DP-Adafactor training (Wu et al. 2022), no formal guarantee.

The ordinary DP-Adafactor run with the noise scaled by each batch's privacy weight; the ledger
records ε = ∞ and adaptive_dp_report.json gives the implied ε with its caveat (Gin:
`train_adaptive`, `private_t5.selective.adaptive_train`; configs/runs/adaptive.gin).
"""
import sys
from typing import Optional, Sequence

from private_t5.stages import train as train_stage

USAGE = ("usage: private-t5 adaptive --gin_file=configs/models/... --gin_file=configs/runs/pretrain.gin "
         "--gin_file=configs/runs/adaptive.gin [--gin.NAME=VALUE ...]")


def main(argv: Optional[Sequence[str]] = None) -> int:
  """`private-t5 adaptive --gin_file=... [--gin.NAME=VALUE ...]` (see configs/runs/adaptive.gin)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv:
    print(__doc__ + "\n" + USAGE)
    return 0
  train_stage.run_from_args(argv, entry="train_adaptive", stage="adaptive", description=__doc__ + "\n" + USAGE)
  return 0


if __name__ == "__main__":
  sys.exit(main())
