"""Export our T5 parameters to the Hugging Face layout (`config.json` + safetensors tensors).

The inverse of `hf_convert` (see its module doc for the name mapping): our `[in, out]` kernels
become `nn.Linear.weight` `[out, in]` (hence `.T`), the relative position biases go back to
`[buckets, heads]`, and the output layer is written as `transformers` reads it:

  * `tie_embeddings=True` (T5 v1.0): `shared.weight` only, `tie_word_embeddings: true` and
    `scale_decoder_outputs: true` (HF multiplies the decoder output by `d_model**-0.5`);
  * `tie_embeddings=False` (T5 v1.1): `lm_head.weight` = `logits_dense/kernel.T` beside
    `shared.weight`, `tie_word_embeddings: false` and `scale_decoder_outputs: false`.

Pure conversion: no files are written here (the `export` stage writes them).
"""
from typing import Any, Dict, Mapping, Tuple

import numpy as np

from private_t5.errors import CheckpointError
from private_t5.models import hf_convert
from private_t5.models.config import T5Config

Params = Mapping[str, Any]
_LAYER_NORM_EPSILON = 1e-6


def hf_config(config: T5Config) -> Dict[str, Any]:
  """The `config.json` dict of a `transformers.T5ForConditionalGeneration` equal to `config`."""
  if config.feed_forward not in ("relu", "gated-gelu"):
    raise CheckpointError(f"feed_forward={config.feed_forward!r} has no Hugging Face T5 equivalent")
  tied = bool(config.tie_embeddings)
  return {
      "architectures": ["T5ForConditionalGeneration"],
      "model_type": "t5",
      "vocab_size": int(config.vocab_size),
      "d_model": int(config.d_model),
      "d_kv": int(config.d_kv or config.d_model // config.num_heads),
      "d_ff": int(config.d_ff),
      "num_layers": int(config.num_encoder_layers),
      "num_decoder_layers": int(config.num_decoder_layers),
      "num_heads": int(config.num_heads),
      "relative_attention_num_buckets": int(config.relative_attention_num_buckets),
      "relative_attention_max_distance": int(config.relative_attention_max_distance),
      "dropout_rate": float(config.dropout_rate),
      "layer_norm_epsilon": _LAYER_NORM_EPSILON,
      "initializer_factor": 1.0,
      "feed_forward_proj": config.feed_forward,
      "tie_word_embeddings": tied,
      "scale_decoder_outputs": tied,
      "is_encoder_decoder": True,
      "use_cache": True,
      "pad_token_id": 0,
      "eos_token_id": 1,
      "decoder_start_token_id": 0,
  }


def _f32(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def _linear(kernel) -> np.ndarray:
  return _f32(np.asarray(kernel, dtype=np.float32).T)


def _attention(out: Dict[str, np.ndarray], prefix: str, params: Params) -> None:
  for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
    out[f"{prefix}.{theirs}.weight"] = _linear(params[ours]["kernel"])


def _mlp(out: Dict[str, np.ndarray], prefix: str, params: Params, feed_forward: str) -> None:
  names = ("wi",) if feed_forward == "relu" else ("wi_0", "wi_1")
  for name in names + ("wo",):
    out[f"{prefix}.DenseReluDense.{name}.weight"] = _linear(params[name]["kernel"])


def hf_tensors(params: Params, config: T5Config) -> Dict[str, np.ndarray]:
  """HF tensor name -> float32 array for our `params` of `config` (see module doc)."""
  hf_convert.check_param_shapes(params, config, "model")
  out: Dict[str, np.ndarray] = {"shared.weight": _f32(params["token_embedder"]["embedding"])}
  for side, layers, norm in (("encoder", config.num_encoder_layers, "encoder_norm"),
                             ("decoder", config.num_decoder_layers, "decoder_norm")):
    tree = params[side]
    out[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = _linear(
        tree["relpos_bias"]["rel_embedding"])
    for i in range(layers):
      layer, block = tree[f"layers_{i}"], f"{side}.block.{i}.layer"
      if side == "encoder":
        out[f"{block}.0.layer_norm.weight"] = _f32(layer["pre_attention_layer_norm"]["scale"])
        _attention(out, f"{block}.0.SelfAttention", layer["attention"])
        out[f"{block}.1.layer_norm.weight"] = _f32(layer["pre_mlp_layer_norm"]["scale"])
        _mlp(out, f"{block}.1", layer["mlp"], config.feed_forward)
      else:
        out[f"{block}.0.layer_norm.weight"] = _f32(layer["pre_self_attention_layer_norm"]["scale"])
        _attention(out, f"{block}.0.SelfAttention", layer["self_attention"])
        out[f"{block}.1.layer_norm.weight"] = _f32(layer["pre_cross_attention_layer_norm"]["scale"])
        _attention(out, f"{block}.1.EncDecAttention", layer["encoder_decoder_attention"])
        out[f"{block}.2.layer_norm.weight"] = _f32(layer["pre_mlp_layer_norm"]["scale"])
        _mlp(out, f"{block}.2", layer["mlp"], config.feed_forward)
    out[f"{side}.final_layer_norm.weight"] = _f32(tree[norm]["scale"])
  if not config.tie_embeddings:
    out["lm_head.weight"] = _linear(params["decoder"]["logits_dense"]["kernel"])
  return out


def export_hf_t5(params: Params, config: T5Config) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """(tensors, config.json dict) of our model in the Hugging Face T5 layout.

  `hf_convert.params_from_hf` of the result gives back `params` (same values) and `config`.
  """
  return hf_tensors(params, config), hf_config(config)
