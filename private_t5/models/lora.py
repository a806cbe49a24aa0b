"""LoRA: low-rank adapters on the dense layers of our T5 (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models"; Yu et al. 2022, "Differentially Private Fine-tuning of
Language Models").

A targeted dense layer `y = x W` becomes `y = x W + (alpha / r) dropout(x) A B` with `A [in, r]`
(random init) and `B [r, out]` (zeros, so a fresh adapter leaves the model unchanged). The base
weights `W` are frozen: only the adapters are trained, clipped, noised and checkpointed. In the
parameter tree an adapter lives beside the kernel it adapts,
`encoder/layers_0/attention/query/{lora_a,lora_b}/kernel`, as two ordinary `layers.Dense`
layers, so ghost clipping records them like any other dense layer.

This module owns the concept: the settings (`LoraConfig`), which layers are targeted, the split
of a parameter tree into base and adapters and back (`combine`), the merged weights
`W + (alpha / r) A B` (`merge`), and the hash that ties a run's adapters to its base
(`params_sha256`). The network reads `LoraConfig.adapts`; nothing here imports the network.
"""
import dataclasses
import hashlib
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
from flax import traverse_util

from private_t5.errors import ConfigError

Params = Dict[str, Any]

# The dense layers that can be adapted, by their name in the network: attention (every
# attention block: encoder self-attention, decoder self- and cross-attention) and the MLP
# ("wi" also names T5 v1.1's gated "wi_0" and "wi_1").
TARGETS = ("query", "key", "value", "out", "wi", "wo")
# Hu et al. 2021 adapt the attention query and value projections.
DEFAULT_TARGETS = ("query", "value")
# The names of the two adapter layers inside an adapted dense layer.
A_NAME, B_NAME = "lora_a", "lora_b"
ADAPTER_NAMES = (A_NAME, B_NAME)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """The adapters of a LoRA run (Gin: `LoraConfig`); checked when made.

  Attributes:
    rank: r, the inner dimension of `A [in, r]` and `B [r, out]`.
    alpha: the adapter output is scaled by alpha / r.
    dropout: dropout rate on the adapter's input (only while training with dropout on).
    targets: names of the dense layers to adapt, a subset of `TARGETS`.
  """
  rank: int = 8
  alpha: float = 8.0
  dropout: float = 0.0
  targets: Tuple[str, ...] = DEFAULT_TARGETS

  def __post_init__(self):
    targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
    object.__setattr__(self, "targets", targets)
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
      raise ConfigError(f"LoraConfig.rank must be an integer >= 1, got {self.rank!r}")
    if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
      raise ConfigError(f"LoraConfig.alpha must be a number > 0, got {self.alpha!r}")
    object.__setattr__(self, "alpha", float(self.alpha))
    if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
    object.__setattr__(self, "dropout", float(self.dropout))
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown or len(set(targets)) != len(targets):
      raise ConfigError(f"LoraConfig.targets must be distinct names among {', '.join(TARGETS)}; "
                        f"got {list(targets)!r}")

  def check_fits(self, model_config) -> None:
    """ConfigError when the rank exceeds the narrower side of an adapted layer of `model_config`
    (a `T5Config`): `A B` then cannot have that rank, and the adapter has more parameters than the layer."""
    heads = model_config.num_heads * model_config.d_kv
    widths = {"query": heads, "key": heads, "value": heads, "out": heads, "wi": model_config.d_ff,
              "wo": model_config.d_ff}
    narrowest = min(min(widths[t], model_config.d_model) for t in self.targets)
    if self.rank > narrowest:
      raise ConfigError(f"LoraConfig.rank={self.rank} is larger than the narrowest adapted layer's width "
                        f"({narrowest}, of {', '.join(self.targets)} with d_model {model_config.d_model}): use a "
                        f"rank <= {narrowest}, typically 4 to 64")

  @property
  def scaling(self) -> float:
    """alpha / r, the factor of the adapter's output."""
    return self.alpha / self.rank

  def adapts(self, layer_name: str) -> bool:
    """Whether the dense layer called `layer_name` in the network gets an adapter."""
    name = "wi" if layer_name in ("wi_0", "wi_1") else layer_name
    return name in self.targets

  def to_dict(self) -> Dict[str, Any]:
    return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}

  @classmethod
  def from_dict(cls, d: Dict[str, Any]) -> "LoraConfig":
    return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), dropout=float(d["dropout"]),
               targets=tuple(d["targets"]))


def _is_adapter(path: Sequence[str]) -> bool:
  return any(part in ADAPTER_NAMES for part in path)


def adapters_of(params: Params) -> Params:
  """The adapter leaves (`lora_a`, `lora_b` kernels) of a LoRA network's parameter tree."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({path: v for path, v in flat.items() if _is_adapter(path)})


def combine(base: Params, adapters: Params) -> Params:
  """The LoRA network's parameter tree: the frozen `base` with `adapters` beside their kernels."""
  flat = traverse_util.flatten_dict(base)
  flat.update(traverse_util.flatten_dict(adapters))
  return traverse_util.unflatten_dict(flat)


def num_params(tree: Params) -> int:
  """Number of scalars in a parameter tree."""
  return sum(int(np.prod(np.shape(v))) for v in traverse_util.flatten_dict(tree).values())


def merge(base: Params, adapters: Params, lora: LoraConfig) -> Params:
  """Plain T5 parameters equal to base + adapters: each adapted `kernel` becomes
  `kernel + (alpha / r) A B` (float32 numpy; the model then runs without adapters)."""
  flat = {p: np.asarray(v, np.float32) for p, v in traverse_util.flatten_dict(base).items()}
  found = traverse_util.flatten_dict(adapters)
  for path, a in found.items():
    if path[-2:] != (A_NAME, "kernel"):
      continue
    layer = path[:-2]
    kernel = layer + ("kernel",)
    b = found.get(layer + (B_NAME, "kernel"))
    if kernel not in flat or b is None:
      raise ConfigError(f"adapter {'/'.join(path)} has no base kernel or no {B_NAME} beside it")
    flat[kernel] = flat[kernel] + np.float32(lora.scaling) * (np.asarray(a, np.float32) @ np.asarray(b, np.float32))
  return traverse_util.unflatten_dict(flat)


def params_sha256(params: Params) -> str:
  """SHA-256 of a parameter tree's float32 values and paths (the base a LoRA run depends on)."""
  digest = hashlib.sha256()
  for path, value in sorted(traverse_util.flatten_dict(params).items()):
    array = np.ascontiguousarray(np.asarray(value, np.float32))
    digest.update("/".join(path).encode() + b"\0" + str(array.shape).encode() + b"\0")
    digest.update(array.tobytes())
  return digest.hexdigest()


def base_record(path: str, sha256: str, lora: LoraConfig) -> Dict[str, Any]:
  """The `lora` entry of a LoRA run's checkpoint metadata: its settings and its base."""
  return {"config": lora.to_dict(), "base": {"path": path, "sha256": sha256}}


def config_of(record: Optional[Dict[str, Any]]) -> Optional[LoraConfig]:
  """The `LoraConfig` of a checkpoint's `lora` metadata entry (None: not a LoRA run)."""
  return None if not record else LoraConfig.from_dict(record["config"])
