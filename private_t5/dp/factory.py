"""`make_dp_aggregator`: the one switch between the two DP clipped-sum implementations."""
from typing import Optional

from private_t5.dp.aggregator import DPAggregator
from private_t5.dp.clipping import LossFn
from private_t5.dp.ghost import GhostDPAggregator
from private_t5.errors import ConfigError

DP_METHODS = ("vmap", "ghost")


def make_dp_aggregator(loss_fn: LossFn, clip_norm: float, noise_multiplier: float,
                       expected_batch_size: float, spmd_axis_name: Optional[str] = None, method: str = "vmap") -> DPAggregator:
  """The DP aggregator for `method`.

  "vmap": `aggregator.DPAggregator` (per-example gradients under `jax.vmap`). "ghost":
  `ghost.GhostDPAggregator` (ghost norms and book-keeping, no per-example gradients; see
  docs/ghost_clipping.md). Both clip, noise and divide identically: same privacy, same ledger.
  """
  args = (loss_fn, clip_norm, noise_multiplier, expected_batch_size, spmd_axis_name)
  if method == "vmap":
    return DPAggregator(*args)
  if method == "ghost":
    return GhostDPAggregator(*args)
  raise ConfigError(f"DP aggregator method must be one of {DP_METHODS}, got {method!r}")
