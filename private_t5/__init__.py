"""private_t5: differentially private pretraining and fine-tuning of T5 in JAX/Flax."""

__version__ = "0.1.0"
