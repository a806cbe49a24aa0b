"""Selective DP (Just Fine-tune Twice, seed 002) and Adaptive DP (seed 004)."""
