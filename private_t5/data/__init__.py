"""The data layer: corpora -> token store -> random-access examples (see docs/data.md).

Import the submodules directly (`from private_t5.data import source`); this package imports
nothing heavy so that readers stay usable without TensorFlow.
"""
