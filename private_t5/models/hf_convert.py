"""Import public T5 weights from the Hugging Face layout (`config.json` + safetensors).

Reads a local directory holding `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json` with its shards) with `safetensors.numpy`: no network, no
PyTorch. Produces our parameter tree (T5X names, see docs/architecture.md) and `T5Config`.

Mapping (HF `nn.Linear.weight` is `[out, in]`, our kernels are `[in, out]`, hence `.T`):

  shared.weight                                   -> token_embedder/embedding
  {enc,dec}.block.0.layer.0.SelfAttention.relative_attention_bias.weight [buckets, heads]
                                                  -> {enc,dec}/relpos_bias/rel_embedding.T
  encoder.block.i.layer.0.SelfAttention.{q,k,v,o} -> encoder/layers_i/attention/{query,key,value,out}
  encoder.block.i.layer.0.layer_norm              -> encoder/layers_i/pre_attention_layer_norm
  encoder.block.i.layer.1.DenseReluDense.{wi,wi_0,wi_1,wo} -> encoder/layers_i/mlp/...
  decoder.block.i.layer.{0,1,2}                   -> self_attention, encoder_decoder_attention, mlp
  {enc,dec}oder.final_layer_norm                  -> {encoder/encoder_norm, decoder/decoder_norm}
  lm_head.weight                                  -> decoder/logits_dense/kernel.T (untied)

The output layer. T5 v1.0 ties it to the embedding and scales the decoder output by
`d_model**-0.5` (our `tie_embeddings=True`). T5 v1.1 has an untied `lm_head` and no scaling
(our `tie_embeddings=False`). Files written by recent `transformers` releases always tie
`lm_head` to `shared` and record the scaling in `scale_decoder_outputs`; a tied, unscaled
head is imported as an untied `logits_dense` holding a copy of the embedding, and an untied,
scaled head as `logits_dense` with the scale folded in: the logits are the same either way.
"""
import json
import os
from typing import Any, Dict, Mapping, Tuple

import jax
import numpy as np
from safetensors import numpy as st_numpy

from private_t5.errors import CheckpointError
from private_t5.models.config import T5Config
from private_t5.models import network
from private_t5.models.network import param_shapes

Params = Dict[str, Any]
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Hugging Face model types whose checkpoints share T5's parameter layout.
SUPPORTED_MODEL_TYPES = ("t5", "mt5")
_FEED_FORWARD = {"relu": "relu", "gated-gelu": "gated-gelu"}
# Our RMSNorm has a fixed epsilon.
_LAYER_NORM_EPSILON = 1e-6


def read_hf_config(path: str) -> Dict[str, Any]:
  """The parsed `config.json` of a Hugging Face model directory."""
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isdir(path):
    raise CheckpointError(f"Hugging Face model directory {path!r} does not exist")
  if not os.path.exists(config_path):
    raise CheckpointError(f"{path!r} has no {CONFIG_FILE}; expected a Hugging Face T5 directory "
                          f"({CONFIG_FILE} + {WEIGHTS_FILE})")
  try:
    with open(config_path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"cannot read {config_path}: {e}") from e


def is_hf_t5_dir(path: str) -> bool:
  """True when `path` looks like a Hugging Face model directory (has `config.json`)."""
  return os.path.isfile(os.path.join(path, CONFIG_FILE))


def _uses_output_scaling(hf: Mapping[str, Any]) -> bool:
  if "scale_decoder_outputs" in hf:
    return bool(hf["scale_decoder_outputs"])
  # Older files: T5 v1.0 (tied) scales, v1.1 (tie_word_embeddings=false) does not.
  return hf.get("tie_word_embeddings", True) is not False


def config_from_hf(hf: Mapping[str, Any], *, tie_embeddings: bool) -> T5Config:
  """Our `T5Config` from a Hugging Face T5 `config.json` dict.

  Raises:
    CheckpointError: not a T5 architecture, or a setting our network cannot represent.
  """
  model_type = hf.get("model_type")
  architectures = hf.get("architectures") or []
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(f"config.json describes a {model_type!r} model ({', '.join(architectures) or 'no architectures'});"
                          f" only T5 checkpoints ({', '.join(SUPPORTED_MODEL_TYPES)}) can be imported")
  feed_forward = hf.get("feed_forward_proj", "relu")
  if feed_forward not in _FEED_FORWARD:
    raise CheckpointError(f"feed_forward_proj={feed_forward!r} is not supported; "
                          f"supported: {', '.join(_FEED_FORWARD)}")
  epsilon = float(hf.get("layer_norm_epsilon", _LAYER_NORM_EPSILON))
  if abs(epsilon - _LAYER_NORM_EPSILON) > 1e-12:
    raise CheckpointError(f"layer_norm_epsilon={epsilon} is not supported (the network uses "
                          f"{_LAYER_NORM_EPSILON})")
  try:
    num_layers = int(hf["num_layers"])
    return T5Config(
        vocab_size=int(hf["vocab_size"]), d_model=int(hf["d_model"]), num_heads=int(hf["num_heads"]),
        d_kv=int(hf["d_kv"]), d_ff=int(hf["d_ff"]), num_encoder_layers=num_layers,
        num_decoder_layers=int(hf.get("num_decoder_layers") or num_layers),
        dropout_rate=float(hf.get("dropout_rate", 0.1)), feed_forward=_FEED_FORWARD[feed_forward],
        tie_embeddings=tie_embeddings,
        relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)))
  except KeyError as e:
    raise CheckpointError(f"config.json lacks the T5 field {e.args[0]!r}") from e
  except Exception as e:  # ConfigError from validation, bad types.
    raise CheckpointError(f"config.json does not describe a valid T5 model: {e}") from e


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
  """All tensors of `model.safetensors` (or of every shard listed in the index)."""
  single = os.path.join(path, WEIGHTS_FILE)
  index = os.path.join(path, WEIGHTS_INDEX_FILE)
  if os.path.exists(single):
    files = [single]
  elif os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as e:
      raise CheckpointError(f"cannot read {index}: {e}") from e
    files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
  else:
    found = ", ".join(sorted(os.listdir(path)))
    raise CheckpointError(f"{path!r} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} (found: {found}); "
                          "save the model with safetensors (save_pretrained does by default)")
  tensors = {}
  for name in files:
    try:
      tensors.update(st_numpy.load_file(name))
    except (OSError, ValueError) as e:
      raise CheckpointError(f"cannot read safetensors file {name}: {e}") from e
    except Exception as e:  # safetensors raises its own SafetensorError on corrupt files.
      raise CheckpointError(f"cannot read safetensors file {name}: {e}") from e
  return tensors


class _Reader:
  """Fetches HF tensors by name as float32, remembering which ones were used."""

  def __init__(self, tensors: Mapping[str, np.ndarray], source: str):
    self.tensors = tensors
    self.source = source
    self.used = set()

  def __contains__(self, name: str) -> bool:
    return name in self.tensors

  def get(self, *names: str) -> np.ndarray:
    for name in names:
      if name in self.tensors:
        self.used.add(name)
        return np.asarray(self.tensors[name], dtype=np.float32)
    raise CheckpointError(f"{self.source} lacks the T5 tensor {names[0]!r}; it is not a complete "
                          "T5 encoder-decoder checkpoint")

  def kernel(self, name: str) -> np.ndarray:
    return np.ascontiguousarray(self.get(name + ".weight").T)


def _attention(r: _Reader, prefix: str) -> Params:
  return {ours: {"kernel": r.kernel(f"{prefix}.{theirs}")}
          for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))}


def _mlp(r: _Reader, prefix: str, feed_forward: str) -> Params:
  names = ("wi",) if feed_forward == "relu" else ("wi_0", "wi_1")
  out = {name: {"kernel": r.kernel(f"{prefix}.DenseReluDense.{name}")} for name in names}
  out["wo"] = {"kernel": r.kernel(f"{prefix}.DenseReluDense.wo")}
  return out


def _scale(r: _Reader, name: str) -> Params:
  return {"scale": r.get(name + ".weight")}


def params_from_hf(tensors: Mapping[str, np.ndarray], hf: Mapping[str, Any],
                   source: str = "checkpoint") -> Tuple[Params, T5Config]:
  """Our (params, config) from HF tensors and the parsed `config.json` (see module doc)."""
  r = _Reader(tensors, source)
  embedding = r.get("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
  scaled = _uses_output_scaling(hf)
  lm_head = None
  if "lm_head.weight" in r:
    lm_head = r.get("lm_head.weight")
    if lm_head.shape == embedding.shape and np.array_equal(lm_head, embedding) and scaled:
      lm_head = None  # A stored copy of the tied embedding.
  tie = lm_head is None and scaled
  config = config_from_hf(hf, tie_embeddings=tie)

  encoder = {"relpos_bias": {"rel_embedding": np.ascontiguousarray(
      r.get("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight").T)}}
  for i in range(config.num_encoder_layers):
    block = f"encoder.block.{i}.layer"
    encoder[f"layers_{i}"] = {
        "pre_attention_layer_norm": _scale(r, f"{block}.0.layer_norm"),
        "attention": _attention(r, f"{block}.0.SelfAttention"),
        "pre_mlp_layer_norm": _scale(r, f"{block}.1.layer_norm"),
        "mlp": _mlp(r, f"{block}.1", config.feed_forward),
    }
  encoder["encoder_norm"] = _scale(r, "encoder.final_layer_norm")

  decoder = {"relpos_bias": {"rel_embedding": np.ascontiguousarray(
      r.get("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight").T)}}
  for i in range(config.num_decoder_layers):
    block = f"decoder.block.{i}.layer"
    decoder[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": _scale(r, f"{block}.0.layer_norm"),
        "self_attention": _attention(r, f"{block}.0.SelfAttention"),
        "pre_cross_attention_layer_norm": _scale(r, f"{block}.1.layer_norm"),
        "encoder_decoder_attention": _attention(r, f"{block}.1.EncDecAttention"),
        "pre_mlp_layer_norm": _scale(r, f"{block}.2.layer_norm"),
        "mlp": _mlp(r, f"{block}.2", config.feed_forward),
    }
  decoder["decoder_norm"] = _scale(r, "decoder.final_layer_norm")
  if not tie:
    head = embedding if lm_head is None else lm_head
    if scaled:
      # HF computes (x * d_model**-0.5) @ head.T; fold the constant into the kernel.
      head = head * np.float32(config.d_model ** -0.5)
    decoder["logits_dense"] = {"kernel": np.ascontiguousarray(head.T)}

  params = {"token_embedder": {"embedding": embedding}, "encoder": encoder, "decoder": decoder}
  _check_unused(r, config)
  check_param_shapes(params, config, source)
  return params, config


def _check_unused(r: _Reader, config: T5Config) -> None:
  """A tensor we did not read means a layout we do not understand (e.g. more layers)."""
  ignorable = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight",
               # Present in some old files, never used by T5 (only layer 0 holds the bias).
               "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")
  unused = sorted(set(r.tensors) - r.used - set(ignorable))
  if unused:
    raise CheckpointError(f"{r.source} has {len(unused)} tensor(s) that a T5 with "
                          f"{config.num_encoder_layers}+{config.num_decoder_layers} layers does not use, "
                          f"e.g. {unused[0]!r}; config.json and the weights disagree")


def check_param_shapes(params: Params, config: T5Config, source: str = "checkpoint") -> None:
  """Raises CheckpointError unless `params` has exactly the tree and shapes of `config`'s network,
  in either layer layout (`T5Config.scan_layers`: compared unrolled, `network.to_layout`)."""
  unrolled = config.replace(scan_layers=False)
  expected = {jax.tree_util.keystr(k): tuple(v.shape)
              for k, v in jax.tree_util.tree_flatten_with_path(param_shapes(unrolled))[0]}
  got = {jax.tree_util.keystr(k): tuple(np.shape(v))
         for k, v in jax.tree_util.tree_flatten_with_path(network.to_layout(params, False))[0]}
  missing = sorted(set(expected) - set(got))
  extra = sorted(set(got) - set(expected))
  if missing or extra:
    raise CheckpointError(f"{source} does not match the model config: missing {missing[:3]}, "
                          f"unexpected {extra[:3]}")
  for name, shape in expected.items():
    if got[name] != shape:
      raise CheckpointError(f"{source}: parameter {name} has shape {got[name]}, the model config "
                            f"needs {shape}")


def import_hf_t5(path: str) -> Tuple[Params, T5Config]:
  """Reads a Hugging Face T5 directory: returns (params as numpy float32, T5Config).

  Args:
    path: directory with `config.json` and `model.safetensors` (or a sharded index),
      e.g. the output of `T5ForConditionalGeneration.save_pretrained` or a downloaded
      `t5-small` / `google/t5-v1_1-small` snapshot.

  Raises:
    CheckpointError: missing files, a non-T5 architecture, or tensors whose names or shapes
      do not match the configuration.
  """
  hf = read_hf_config(path)
  # Refuse a non-T5 model before reading (possibly large) weights.
  if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
    config_from_hf(hf, tie_embeddings=True)
  return params_from_hf(read_safetensors(path), hf, source=path)


def hf_vocabulary_path(path: str):
  """The SentencePiece model shipped beside HF T5 weights (`spiece.model`), or None."""
  candidate = os.path.join(path, "spiece.model")
  return candidate if os.path.exists(candidate) else None
