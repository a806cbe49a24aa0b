"""The T5 network: config and presets, Flax module, parameter helpers, per-example loss."""
from private_t5.models.config import PRESETS, T5Config, load_preset
from private_t5.models.losses import example_loss_fn, per_example_loss, token_accuracy
from private_t5.models.network import (Transformer, init_params, num_params, param_logical_axes,
                                       param_shapes)

__all__ = [
    "PRESETS", "T5Config", "load_preset", "Transformer", "init_params", "num_params",
    "param_logical_axes", "param_shapes", "per_example_loss", "example_loss_fn", "token_accuracy",
]
