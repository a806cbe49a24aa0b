"""Export our T5 parameters to the Hugging Face layout (`config.json` + safetensors tensors).

The inverse of `hf_convert` (see its module doc for the name mapping): our `[in, out]` kernels
become `nn.Linear.weight` `[out, in]` (hence `.T`), the relative position biases go back to
`[buckets, heads]`, and the output layer is written as `transformers` reads it:

  * `tie_embeddings=True` (T5 v1.0): `shared.weight` only, `tie_word_embeddings: true` and
    `scale_decoder_outputs: true` (HF multiplies the decoder output by `d_model**-0.5`);
  * `tie_embeddings=False` (T5 v1.1): `lm_head.weight` = `logits_dense/kernel.T` beside
    `shared.weight`, `tie_word_embeddings: false` and `scale_decoder_outputs: false`.

A LoRA run's adapters export as a Hugging Face PEFT adapter (`peft_adapter`): `lora_A.weight`
`[r, in]` = A.T and `lora_B.weight` `[out, r]` = B.T beside each adapted `nn.Linear`, with
`lora_alpha` / `r` as our alpha / r, so `peft.PeftModel.from_pretrained(base, ADAPTER_DIR)` on the
exported base gives our logits.

Pure conversion: no files are written here (the `export` stage writes them).
"""
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import numpy as np

from private_t5.errors import CheckpointError
from private_t5.models import hf_convert
from private_t5.models import lora as lora_lib
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


_ATTENTION = (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))


def linear_modules(config: T5Config) -> Iterator[Tuple[Tuple[str, ...], str]]:
  """(path of our dense layer, name of the HF `nn.Linear` module) of every attention and MLP
  projection (the output layer excluded)."""
  mlp = (("wi",) if config.feed_forward == "relu" else ("wi_0", "wi_1")) + ("wo",)
  for side, layers in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    for i in range(layers):
      block = f"{side}.block.{i}.layer"
      if side == "encoder":
        attentions, mlp_index = (("attention", "0.SelfAttention"),), 1
      else:
        attentions, mlp_index = (("self_attention", "0.SelfAttention"),
                                 ("encoder_decoder_attention", "1.EncDecAttention")), 2
      for ours, theirs in attentions:
        for name, hf_name in _ATTENTION:
          yield (side, f"layers_{i}", ours, name), f"{block}.{theirs}.{hf_name}"
      for name in mlp:
        yield (side, f"layers_{i}", "mlp", name), f"{block}.{mlp_index}.DenseReluDense.{name}"


def _node(tree: Params, path: Tuple[str, ...]) -> Optional[Any]:
  for part in path:
    if not isinstance(tree, Mapping) or part not in tree:
      return None
    tree = tree[part]
  return tree


def hf_tensors(params: Params, config: T5Config) -> Dict[str, np.ndarray]:
  """HF tensor name -> float32 array for our `params` of `config` (see module doc)."""
  hf_convert.check_param_shapes(params, config, "model")
  out: Dict[str, np.ndarray] = {"shared.weight": _f32(params["token_embedder"]["embedding"])}
  for side, layers, norm in (("encoder", config.num_encoder_layers, "encoder_norm"),
                             ("decoder", config.num_decoder_layers, "decoder_norm")):
    tree = params[side]
    out[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = _linear(
        tree["relpos_bias"]["rel_embedding"])
    norms = (("pre_attention_layer_norm", "pre_mlp_layer_norm") if side == "encoder" else
             ("pre_self_attention_layer_norm", "pre_cross_attention_layer_norm", "pre_mlp_layer_norm"))
    for i in range(layers):
      for index, name in enumerate(norms):
        out[f"{side}.block.{i}.layer.{index}.layer_norm.weight"] = _f32(tree[f"layers_{i}"][name]["scale"])
    out[f"{side}.final_layer_norm.weight"] = _f32(tree[norm]["scale"])
  for path, module in linear_modules(config):
    out[f"{module}.weight"] = _linear(_node(params, path)["kernel"])
  if not config.tie_embeddings:
    out["lm_head.weight"] = _linear(params["decoder"]["logits_dense"]["kernel"])
  return out


def export_hf_t5(params: Params, config: T5Config) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """(tensors, config.json dict) of our model in the Hugging Face T5 layout.

  `hf_convert.params_from_hf` of the result gives back `params` (same values) and `config`.
  """
  return hf_tensors(params, config), hf_config(config)


# The HF module name of each of our LoRA target names (PEFT matches `target_modules` by the
# last part of a module's name).
_PEFT_TARGETS = {"query": ("q",), "key": ("k",), "value": ("v",), "out": ("o",), "wo": ("wo",)}


def peft_adapter(adapters: Params, lora: lora_lib.LoraConfig, config: T5Config,
                 base_model_name_or_path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """(tensors of `adapter_model.safetensors`, `adapter_config.json` dict) of a PEFT LoRA adapter
  equal to our `adapters` on the base T5 of `config`."""
  tensors: Dict[str, np.ndarray] = {}
  for path, module in linear_modules(config):
    node = _node(adapters, path)
    if node is None:
      continue
    prefix = f"base_model.model.{module}"
    tensors[f"{prefix}.lora_A.weight"] = _linear(node[lora_lib.A_NAME]["kernel"])
    tensors[f"{prefix}.lora_B.weight"] = _linear(node[lora_lib.B_NAME]["kernel"])
  if not tensors:
    raise CheckpointError("the checkpoint holds no LoRA adapters")
  wi = ("wi",) if config.feed_forward == "relu" else ("wi_0", "wi_1")
  targets = sorted(name for t in lora.targets for name in _PEFT_TARGETS.get(t, wi))
  adapter_config = {
      "peft_type": "LORA", "task_type": "SEQ_2_SEQ_LM", "base_model_name_or_path": base_model_name_or_path,
      "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets,
      "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
      "inference_mode": True, "modules_to_save": None,
  }
  return tensors, adapter_config
