"""Where a compiled step's time goes: trace, lower, compile, first run and steady runs, each
timed on its own and written down the moment it ends.

  log = PhaseLog("/tmp/profile/phases.jsonl")
  traced = log.time("small/b32/ghost", "trace", lambda: trainer.trace_train_step(...))
  lowered = log.time("small/b32/ghost", "lower", traced.lower, **lowered_stats(...))

A `PhaseLog` appends one JSON line per phase (wall seconds, CPU seconds of this process, and
whatever the caller adds) and flushes it to disk before the next phase starts, so that a run
stopped by a time limit or killed still says how far it got and where the time went.

The size of a program, read off the lowered module (StableHLO text, its largest constant) and
the compiled one (XLA's optimised HLO: `while` loops, matrix products and their distinct
shapes), says why a step is slow to compile before any device time is spent.

Model FLOPs utilisation is computed from an analytic count of the training work (6 x the
parameters each token passes through, plus attention; Kaplan et al. 2020, "Scaling laws for
neural language models"; Chowdhery et al. 2022, "PaLM", App. B), not from XLA's
`cost_analysis`, which counts what one backend's compiler kept and can miss fused work.
"""
import collections
import json
import os
import re
import threading
import time
from typing import Any, Callable, Dict, Optional

from private_t5.io import json_default

# Dense bf16 tensor-core peak (FLOP/s) of the accelerators this framework is checked on, from
# the vendors' data sheets (without sparsity). Used for MFU when the caller gives no peak.
PEAK_BF16_FLOPS = {
    "H100 80GB HBM3": 989e12,  # SXM
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "A100-SXM4-80GB": 312e12,
    "A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
}

_CONSTANT = re.compile(r"stablehlo\.constant dense.*:\s*tensor<([0-9x]*)x?([a-z]+[0-9]*)>")
_WHILE = re.compile(r"\bstablehlo\.while\b")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "i16": 2, "i8": 1,
                "ui32": 4, "ui8": 1, "i1": 1, "ui64": 8, "ui16": 2}
# An XLA HLO matrix product: a `dot`, or a library call a GPU backend rewrote it to.
_DOT = re.compile(r"=\s*(\S+)\s+(?:dot|custom-call)\((.*?)\)(.*)$")


def peak_flops(device_kind: str) -> Optional[float]:
  """The dense bf16 peak of a device kind (`jax.Device.device_kind`), or None if unknown."""
  for name, flops in PEAK_BF16_FLOPS.items():
    if name.lower() in device_kind.lower() or device_kind.lower() in name.lower():
      return flops
  return None


def analytic_train_flops(config, inputs: int, targets: int) -> float:
  """FLOPs of one training step on one `(inputs, targets)` sequence pair (forward + backward).

  Every dense weight does `2 x tokens` FLOPs forward and twice that backward: 6 per weight
  and per token it sees. Encoder weights see the inputs; decoder weights and the output
  projection see the targets. Attention adds its two `[q, k]` products per layer (`q k^T`
  and `weights v`), 2 x 2 x q x k x heads x d_kv forward, x3 with the backward pass. Lookups,
  norms, softmax and the loss are not counted (a few percent at most).
  """
  attn_width = config.num_heads * config.d_kv
  attention_weights = 4 * config.d_model * attn_width  # q, k, v, o
  mlp_weights = (3 if config.feed_forward == "gated-gelu" else 2) * config.d_model * config.d_ff
  encoder = config.num_encoder_layers * (attention_weights + mlp_weights)
  decoder = config.num_decoder_layers * (2 * attention_weights + mlp_weights)
  logits = config.d_model * config.vocab_size
  dense = 6 * (encoder * inputs + (decoder + logits) * targets)
  attention = 12 * attn_width * (config.num_encoder_layers * inputs * inputs
                                 + config.num_decoder_layers * (targets * targets + targets * inputs))
  return float(dense + attention)


def lowered_stats(text: str) -> Dict[str, Any]:
  """Size of a lowered program (its StableHLO text), its largest constant and its `while` loops
  (device loops: a GPU reads each iteration's predicate back on the host)."""
  largest, largest_type, over_1mib = 0, None, 0
  for match in _CONSTANT.finditer(text):
    dims, dtype = match.group(1), match.group(2)
    count = 1
    for d in filter(None, dims.split("x")):
      count *= int(d)
    size = count * _DTYPE_BYTES.get(dtype, 4)
    over_1mib += size > 2 ** 20
    if size > largest:
      largest, largest_type = size, f"{dtype}[{dims.rstrip('x').replace('x', ',')}]"
  return {"lowered_bytes": len(text), "largest_constant_bytes": largest,
          "largest_constant": largest_type, "constants_over_1mib": over_1mib,
          "while_loops": len(_WHILE.findall(text))}


def compiled_stats(text: str) -> Dict[str, Any]:
  """Counts in XLA's optimised HLO: `while` loops, matrix products, their distinct shapes."""
  whiles, dots, shapes = 0, 0, collections.Counter()
  for line in text.splitlines():
    if " while(" in line:
      whiles += 1
    match = _DOT.search(line)
    if match is None:
      continue
    if "custom-call" in line and "gemm" not in line and "matmul" not in line:
      continue
    dots += 1
    operands = re.findall(r"[a-z0-9]+\[[0-9,]*\]", match.group(2))
    shapes[(match.group(1), tuple(operands))] += 1
  return {"compiled_hlo_bytes": len(text), "while_loops": whiles, "matmuls": dots,
          "distinct_matmul_shapes": len(shapes)}


class PhaseLog:
  """Appends one JSON line per timed phase to `path`, durable before the next phase starts."""

  def __init__(self, path: str):
    self.path = path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.records = []
    self._lock = threading.Lock()
    self._closed = False

  def write(self, record: Dict[str, Any], last: bool = False) -> Dict[str, Any]:
    """Appends `record`; with `last` (a watchdog's stop line) nothing is written after it, even
    by a phase that ends on another thread meanwhile."""
    record = dict(record, time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    with self._lock:
      if self._closed:
        return record
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=json_default, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
      self.records.append(record)
      self._closed = last
    return record

  def time(self, case: str, phase: str, fn: Callable[[], Any],
           stats: Optional[Callable[[Any], Dict[str, Any]]] = None, **extra) -> Any:
    """Runs `fn()`, then writes `{case, phase, wall_s, cpu_s, **stats(result), **extra}`."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    record = dict(case=case, phase=phase, wall_s=round(wall, 4), cpu_s=round(cpu, 4), **extra)
    if stats is not None:
      record.update(stats(result))
    self.write(record)
    return result


def read_phases(path: str):
  """The records of a phase file; a last line cut short by a kill is skipped."""
  records = []
  if not os.path.exists(path):
    return records
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records
