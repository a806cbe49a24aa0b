"""The privacy layer: the mechanism (clipped sum, noise transform, sampler, DP event), sampling,
accounting, ledger.

Names are imported lazily so that `private-t5 epsilon` (accounting only) does not pay for
importing JAX.
"""
import importlib

_EXPORTS = {
    "DPAggregator": "private_t5.dp.aggregator",
    "MeanAggregator": "private_t5.dp.aggregator",
    "GhostDPAggregator": "private_t5.dp.ghost",
    "DPConfig": "private_t5.dp.config",
    "ExecutionSettings": "private_t5.dp.config",
    "BatchLayout": "private_t5.dp.config",
    "Sampling": "private_t5.dp.privacy_params",
    "gaussian_noise": "private_t5.dp.noise",
    "no_noise": "private_t5.dp.noise",
    "Mechanism": "private_t5.dp.mechanism",
    "build_mechanism": "private_t5.dp.mechanism",
    "NoisySum": "private_t5.dp.privacy_params",
    "AGGREGATORS": "private_t5.dp.mechanism",
    "PoissonSampler": "private_t5.dp.sampling",
    "CyclicPoissonSampler": "private_t5.dp.sampling",
    "Strategy": "private_t5.dp.strategies",
    "ShuffledBatchSampler": "private_t5.dp.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
