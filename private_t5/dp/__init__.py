"""The privacy layer: the mechanism (clipped sum, noise transform, sampler, DP event), sampling,
accounting, ledger. Import each name from the module that defines it (`private_t5.dp.aggregator`,
`private_t5.dp.config`, ...): this package imports nothing, so `private-t5 epsilon` (accounting
only) does not pay for importing JAX.
"""
