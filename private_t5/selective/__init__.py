"""Selective DP (Just Fine-tune Twice, Shi et al. 2022) and Adaptive DP (Wu et al. 2022)."""
