"""The T5 network: config and presets (`config`), Flax module and parameter helpers (`network`), the
model object (`model`), losses (`losses`); import each name from the module that defines it."""
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.models.config': ('load_preset',),
    'private_t5.models.model': ('EncoderDecoderModel', 'example_loss_fn'),
    'private_t5.models.network': ('Transformer', 'init_params'),
})

