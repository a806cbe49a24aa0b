"""Experiments built on the training and evaluation layers: the end-to-end study and the benchmark.

Plain Python that Gin never sees: whatever a Gin-configured run needs (training one model with
the study's Gin files) comes in as a callable from the stage that calls it (`stages/study.py`,
`stages/bench.py`).
"""
