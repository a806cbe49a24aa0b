"""T5 hyper-parameters (`T5Config`) and the named presets of T5 v1.0 and v1.1."""
import dataclasses
from typing import Any, Dict, Optional

from private_t5.errors import ConfigError

FEED_FORWARD_TYPES = ("relu", "gated-gelu")
DTYPES = ("float32", "bfloat16", "float16")
# How attention weights are computed: our einsums and softmax, or `jax.nn.dot_product_attention`
# with that implementation ("cudnn": the fused kernel of NVIDIA GPUs).
ATTENTION_IMPLEMENTATIONS = ("einsum", "xla", "cudnn")
# What the backward pass recomputes instead of keeping (T5X's names): "none" keeps every
# activation; "minimal" keeps the outputs of matmuls without batch dimensions (the dense layers')
# and recomputes the rest of each layer; "full" keeps only each layer's input.
REMAT_POLICIES = ("none", "minimal", "full")
# Fields that choose how the network is computed, not what it computes: left out of a run's
# fingerprint (a run resumes with another value, and runs saved before a field existed still
# match) and not taken from a checkpoint (the run that loads it chooses; the default otherwise).
EXECUTION_FIELDS = ("attention", "scan_layers", "remat_policy")

# T5's SentencePiece vocabulary (32000 pieces + 100 sentinels, padded to a multiple of 128).
T5_VOCAB_SIZE = 32128
# Tiny presets expect a small vocabulary (8192 pieces + 100 sentinels, padded to a multiple
# of 128): with 32128 rows the embedding alone would exceed the 1-3M parameters a test
# model should have.
TINY_VOCAB_SIZE = 8320


@dataclasses.dataclass(frozen=True, kw_only=True)
class T5Config:
  """Shape of a T5 encoder-decoder.

  Attributes:
    vocab_size: rows of the token embedding (and columns of the logits).
    d_model: width of the residual stream (logical axis `embed`).
    num_heads: attention heads per attention layer.
    d_kv: width of one head; `None` derives `d_model // num_heads` (which must divide).
      T5 v1.1 small uses 6 heads of 64 on a 512-wide model, so `num_heads * d_kv` need
      not equal `d_model` when `d_kv` is given.
    d_ff: hidden width of the feed-forward block (logical axis `mlp`).
    num_encoder_layers: encoder blocks.
    num_decoder_layers: decoder blocks.
    dropout_rate: dropout on embeddings, attention weights, feed-forward hidden units and
      every residual branch (T5 uses one rate everywhere).
    feed_forward: "relu" (T5 v1.0) or "gated-gelu" (T5 v1.1).
    tie_embeddings: True (v1.0) reuses the token embedding as the output layer with logits
      scaled by `d_model**-0.5`; False (v1.1) adds `decoder/logits_dense`.
    relative_attention_num_buckets: buckets of the relative position bias.
    relative_attention_max_distance: distance beyond which all offsets share one bucket.
    dtype: activation dtype ("float32", "bfloat16" or "float16") of the matmuls and the
      residual stream, as T5X's `T5Config.dtype`. Parameters and optimizer state are always
      float32; layer norms, attention softmax, logits and the loss are computed in float32.
      The T5 v1.1 presets other than tiny use "bfloat16" (as T5X's v1.1 configs); every other
      preset "float32" (see docs/model.md, "Activation dtype"). Training refuses "float16":
      T5's activations overflow its range (`train.main.validate_train_args`).
    attention: how the attention weights are computed. "einsum" (default): two einsums and a
      float32 softmax, with dropout on the weights. "xla" or "cudnn": one call of
      `jax.nn.dot_product_attention` with that implementation ("cudnn" is NVIDIA's fused
      attention kernel, for bfloat16/float16 activations on a GPU). The fused call has no
      dropout on the weights, so both need `dropout_rate=0` (T5 v1.1's pretraining setting).
      Cached decoding always uses "einsum" (one query position at a time).
    scan_layers: False (default): each layer is its own piece of the compiled program and
      its parameters their own arrays (`encoder/layers_0/...`). True: the layers of each stack
      are one `nn.scan` over a stacked parameter axis (`encoder/layers/...`, leading logical axis
      `layers`, never sharded), as T5X's `scalable_t5`: one compiled layer body looped by XLA,
      so compile time and program size do not grow with depth. The same function of the same
      parameters in another layout (`network.to_layout` converts; checkpoints and exports
      convert as they are read). DP-vmap and DP-ghost clipping run inside the scan.
    remat_policy: `REMAT_POLICIES`; what the backward pass recomputes (`jax.checkpoint` on
      each layer). The same values, less activation memory, more compute. Ghost clipping needs
      `scan_layers` with it (docs/model.md, "Scanned layers and rematerialisation").
  """
  vocab_size: int
  d_model: int
  num_heads: int
  d_kv: Optional[int] = None
  d_ff: int
  num_encoder_layers: int
  num_decoder_layers: int
  dropout_rate: float = 0.1
  feed_forward: str = "relu"
  tie_embeddings: bool = True
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  dtype: str = "float32"
  attention: str = "einsum"
  scan_layers: bool = False
  remat_policy: str = "none"

  def __post_init__(self):
    if self.d_kv is None and _is_positive_int(self.num_heads) and _is_positive_int(self.d_model):
      if self.d_model % self.num_heads:
        raise ConfigError(f"num_heads={self.num_heads} does not divide d_model={self.d_model}; "
                          "choose a divisor or set d_kv explicitly")
      object.__setattr__(self, "d_kv", self.d_model // self.num_heads)
    self.validate()

  def validate(self) -> "T5Config":
    """Raises `ConfigError` naming the first invalid field; returns self when valid."""
    for name in ("vocab_size", "d_model", "num_heads", "d_kv", "d_ff", "num_encoder_layers",
                 "num_decoder_layers", "relative_attention_num_buckets",
                 "relative_attention_max_distance"):
      value = getattr(self, name)
      if not _is_positive_int(value):
        raise ConfigError(f"T5Config.{name} must be a positive integer, got {value!r}")
    if not isinstance(self.dropout_rate, (int, float)) or not 0.0 <= self.dropout_rate < 1.0:
      raise ConfigError(f"T5Config.dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
    if self.feed_forward not in FEED_FORWARD_TYPES:
      raise ConfigError(f"T5Config.feed_forward must be one of {FEED_FORWARD_TYPES}, "
                        f"got {self.feed_forward!r}")
    if not isinstance(self.tie_embeddings, bool):
      raise ConfigError(f"T5Config.tie_embeddings must be True or False, got {self.tie_embeddings!r}")
    if self.dtype not in DTYPES:
      raise ConfigError(f"T5Config.dtype must be one of {DTYPES}, got {self.dtype!r}")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ConfigError(f"T5Config.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r}")
    if self.attention != "einsum" and self.dropout_rate > 0:
      raise ConfigError(f"T5Config.attention={self.attention!r} has no dropout on the attention weights; "
                        f"set dropout_rate=0 (got {self.dropout_rate}) or attention='einsum'")
    if self.attention == "cudnn" and self.dtype == "float32":
      raise ConfigError("T5Config.attention='cudnn' needs bfloat16 or float16 activations (cuDNN's fused "
                        "attention); set dtype='bfloat16' or attention='xla'")
    if not isinstance(self.scan_layers, bool):
      raise ConfigError(f"T5Config.scan_layers must be True or False, got {self.scan_layers!r}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ConfigError(f"T5Config.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
    buckets = self.relative_attention_num_buckets
    # The bidirectional encoder splits the buckets by sign, then keeps half of each side
    # for exact offsets (T5's `_relative_position_bucket`); both halves must be non-empty.
    if buckets < 4 or buckets % 2:
      raise ConfigError("T5Config.relative_attention_num_buckets must be an even number >= 4, "
                        f"got {buckets}")
    if self.relative_attention_max_distance <= buckets // 2:
      raise ConfigError(f"T5Config.relative_attention_max_distance={self.relative_attention_max_distance} "
                        f"must exceed relative_attention_num_buckets // 2 = {buckets // 2}")
    return self

  def replace(self, **changes) -> "T5Config":
    """A copy with some fields changed (validated)."""
    return dataclasses.replace(self, **changes)

  @property
  def num_layers(self) -> int:
    return self.num_encoder_layers + self.num_decoder_layers


def network_fields(config: T5Config) -> Dict[str, Any]:
  """The config as a dict without its `EXECUTION_FIELDS`: what a checkpoint's network is."""
  return {k: v for k, v in dataclasses.asdict(config).items() if k not in EXECUTION_FIELDS}


def from_saved(saved: Dict[str, Any]) -> T5Config:
  """The config of a stored `model_config` dict, with the defaults of its `EXECUTION_FIELDS`."""
  return T5Config(**{k: v for k, v in saved.items() if k not in EXECUTION_FIELDS})


def _is_positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _v1_0(d_model, num_heads, d_ff, layers, vocab_size=T5_VOCAB_SIZE, d_kv=None):
  return dict(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, d_kv=d_kv, d_ff=d_ff,
              num_encoder_layers=layers, num_decoder_layers=layers, dropout_rate=0.1,
              feed_forward="relu", tie_embeddings=True)


def _v1_1(d_model, num_heads, d_ff, layers, vocab_size=T5_VOCAB_SIZE, d_kv=64, dtype="bfloat16"):
  # T5 v1.1 was pretrained without dropout (it is turned back on for fine-tuning), with
  # bfloat16 activations (T5X's t5_1_1 gin files); the tiny test preset stays float32.
  return dict(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, d_kv=d_kv, d_ff=d_ff,
              num_encoder_layers=layers, num_decoder_layers=layers, dropout_rate=0.0,
              feed_forward="gated-gelu", tie_embeddings=False, dtype=dtype)


# The public T5 checkpoints' shapes (T5 paper Table 14; T5 v1.1 gin files).
PRESETS: Dict[str, dict] = {
    "t5_1_0_tiny": _v1_0(d_model=128, num_heads=4, d_ff=512, layers=2, vocab_size=TINY_VOCAB_SIZE),
    "t5_1_0_small": _v1_0(d_model=512, num_heads=8, d_ff=2048, layers=6),
    "t5_1_0_base": _v1_0(d_model=768, num_heads=12, d_ff=3072, layers=12),
    "t5_1_0_large": _v1_0(d_model=1024, num_heads=16, d_ff=4096, layers=24),
    "t5_1_1_tiny": _v1_1(d_model=128, num_heads=4, d_ff=256, layers=2, vocab_size=TINY_VOCAB_SIZE,
                         d_kv=32, dtype="float32"),
    "t5_1_1_small": _v1_1(d_model=512, num_heads=6, d_ff=1024, layers=8),
    "t5_1_1_base": _v1_1(d_model=768, num_heads=12, d_ff=2048, layers=12),
    "t5_1_1_large": _v1_1(d_model=1024, num_heads=16, d_ff=2816, layers=24),
    "t5_1_1_xl": _v1_1(d_model=2048, num_heads=32, d_ff=5120, layers=24),
    "t5_1_1_xxl": _v1_1(d_model=4096, num_heads=64, d_ff=10240, layers=24),
}


def load_preset(name: str, **overrides) -> T5Config:
  """The named preset (e.g. "t5_1_0_small"), optionally with some fields changed."""
  if name not in PRESETS:
    raise ConfigError(f"unknown model preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}")
  unknown = set(overrides) - {f.name for f in dataclasses.fields(T5Config)}
  if unknown:
    raise ConfigError(f"unknown T5Config field(s) {sorted(unknown)} for preset {name!r}")
  return T5Config(**{**PRESETS[name], **overrides})
