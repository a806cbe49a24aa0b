"""The T5 network: config and presets, Flax module, parameter helpers, the model object."""
from private_t5.models.config import PRESETS, T5Config, load_preset
from private_t5.models.losses import per_example_loss, sequence_log_likelihood, token_accuracy
from private_t5.models.model import EncoderDecoderModel, example_loss_fn
from private_t5.models.network import (Transformer, adapter_logical_axes, init_adapters, init_params,
                                       num_params, param_logical_axes, param_shapes)

__all__ = [
    "PRESETS", "T5Config", "load_preset", "Transformer", "init_params", "num_params",
    "param_logical_axes", "param_shapes", "per_example_loss", "example_loss_fn", "token_accuracy",
    "sequence_log_likelihood", "EncoderDecoderModel", "init_adapters", "adapter_logical_axes",
]
