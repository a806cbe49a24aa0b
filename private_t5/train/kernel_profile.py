"""Where a step's device time goes, op by op: a `jax.profiler` trace of a few steps, read back.

  profile = kernel_profile.profile_steps(lambda: run_one_step(), steps=3, trace_dir="/tmp/trace")
  profile["ms_per_step"], profile["by_kind"], profile["top_ops"]

`profile_steps` records a trace of `steps` calls (the first call is expected to be compiled
already) and `op_times` sums the duration of every event that XLA's runtime runs for an HLO
instruction. On a GPU these are the kernels on the device's streams: each kernel is named by the
instruction it runs (its `hlo_op` stat, or an XLA annotation), or by its own name (XLA names a
kernel after its fusion: `loop_add_fusion_102`, `gemm_fusion_dot_770`; a library's kernel after
the library: `nvjet_...`, `sm80_xmma_gemm_...`) when it has no tag or when the tag names the
command buffer (CUDA graph) that launched it, as every kernel of a step launched through one
graph does. Concurrent kernels all count. On a CPU they are the runtime's thunks (a loop's body
counted with the loop). Summed by instruction and by kind of instruction (`op_kind`: matrix
products, float32 matrix products on a GPU's CUDA cores, reductions, loops, copies and
transposes, collectives, random bits, other fusions), divided by the number of steps, they say
what a DP step adds to the non-DP one (compare two profiles) without a profiler UI. The trace
folder itself is kept for TensorBoard or Perfetto.
"""
import collections
import glob
import os
import re
from typing import Any, Callable, Dict, Optional

import jax
from jax.profiler import ProfileData

# Kinds of HLO instruction, by the words of its name (XLA names a fusion by its root and kind:
# `loop_multiply_fusion`, `input_reduce_fusion`, `gemm_fusion`, `cublas-gemm`, `while`, ...).
# A GPU's float32 matrix products without tensor cores (`sm80_xmma_gemm_f32f32_...`, cutlass
# `simt_sgemm`) are a kind of their own: what bf16 operands would move onto tensor cores.
_KINDS = (
    ("matmul f32", re.compile(r"sgemm|gemm_f32f32|f32f32_f32")),
    ("matmul", re.compile(r"gemm|dot|matmul|cublas|cudnn|xmma|cutlass|nvjet|convolution|triton|ynn")),
    ("loop", re.compile(r"while|conditional|^(case|call)\b")),
    ("collective", re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective|send|recv")),
    ("random", re.compile(r"rng|threefry|random")),
    ("reduce", re.compile(r"reduce")),
    ("copy/transpose", re.compile(r"copy|transpose|memcpy|memset|dynamic-update-slice|slice|concatenate")),
)


def op_kind(name: str) -> str:
  """The kind of an HLO instruction from its name (`"other"` when none matches)."""
  lowered = name.lower()
  for kind, pattern in _KINDS:
    if pattern.search(lowered):
      return kind
  return "other"


# An XLA runtime annotation ("fusion.3:#hlo_module=jit_step,program_id=7#"), which a GPU
# profiler may attach to a kernel as its `level 0` stat instead of `hlo_op` / `hlo_module`.
_ANNOTATION = re.compile(r"^([^:#\s]+):?#hlo_module=([^,#]+)")


# Lines of a device plane that summarise others (a TPU's), not kernels.
_SUMMARY_LINES = frozenset({"XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code",
                            "XLA TraceMe", "Launch Stats"})


# The HLO instruction of a command buffer thunk: a CUDA graph of many kernels, not one op.
_COMMAND_BUFFER = re.compile(r"^command_buffer")


def _op_and_module(event, device: bool):
  """(HLO op, module) an event ran, or (None, None): the `hlo_op` / `hlo_module` stats, else an
  XLA annotation in another stat, else (on a device plane) the kernel's own name; on a device
  plane also the kernel's own name when the op is the command buffer that launched it."""
  stats = {k: v for k, v in event.stats}
  op, module = None, ""
  if stats.get("hlo_op"):
    op, module = str(stats["hlo_op"]), str(stats.get("hlo_module", ""))
  else:
    for value in stats.values():
      match = _ANNOTATION.match(str(value))
      if match:
        op, module = match.group(1), match.group(2)
        break
  if device and event.duration_ns > 0 and (op is None or _COMMAND_BUFFER.match(op)):
    return event.name, module
  return (op, module) if op else (None, None)


def op_times(xplane_path: str, module: Optional[str] = None) -> Dict[str, float]:
  """Seconds spent in each HLO instruction (on a GPU: each kernel) in the trace at `xplane_path`:
  device planes (`/device:...`) when the trace has any, else the host's; when `module` is given,
  not the events of modules whose name does not contain it."""
  return plane_op_times(ProfileData.from_file(xplane_path).planes, module)


def plane_op_times(planes, module: Optional[str] = None) -> Dict[str, float]:
  """`op_times` of profile planes (`jax.profiler.ProfileData(...).planes`, or objects with the same
  `name`, `lines`; `line.name`, `line.events`; `event.name`, `start_ns`, `duration_ns`, `stats`).

  A device's kernels all count, concurrent ones included (a CUDA graph runs independent kernels
  side by side): the sum is kernel time, not wall time. A host's thunks nest (a loop's body runs
  inside the loop's event): an event inside an earlier one of its line counts with it.
  """
  planes = list(planes)
  device = [p for p in planes if p.name.startswith("/device:")]
  totals: Dict[str, float] = collections.defaultdict(float)
  for plane in device or planes:
    for line in plane.lines:
      if line.name in _SUMMARY_LINES:  # a device's per-module and per-step lines repeat its ops' time
        continue
      outer_end = float("-inf")
      for event in sorted(line.events, key=lambda e: e.start_ns):
        op, op_module = _op_and_module(event, bool(device))
        if not op or (module and op_module and module not in op_module):
          continue
        if not device:
          if event.start_ns < outer_end:  # inside a loop's (or call's) event, counted with it
            continue
          outer_end = event.start_ns + event.duration_ns
        totals[str(op)] += event.duration_ns * 1e-9
  return dict(totals)


def summarize(times: Dict[str, float], steps: int, top: int = 12) -> Dict[str, Any]:
  """{ms_per_step, by_kind {kind: ms per step}, top_ops [[op, kind, ms per step]], ops}."""
  per_step = {op: 1e3 * t / steps for op, t in times.items()}
  by_kind: Dict[str, float] = collections.defaultdict(float)
  for op, ms in per_step.items():
    by_kind[op_kind(op)] += ms
  ranked = sorted(per_step.items(), key=lambda kv: -kv[1])[:top]
  return {"ms_per_step": round(sum(per_step.values()), 4),
          "by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
          "top_ops": [[op, op_kind(op), round(ms, 4)] for op, ms in ranked], "ops": len(per_step)}


def profile_steps(run: Callable[[], Any], steps: int, trace_dir: str, module: Optional[str] = None,
                  top: int = 12) -> Dict[str, Any]:
  """`run()` `steps` times under `jax.profiler.trace(trace_dir)` (each call must block until its
  step is done), then `summarize(op_times(...))` of the trace, with the trace's path.

  Raises:
    RuntimeError: the profiler wrote no trace, or no event of it names an HLO instruction.
  """
  os.makedirs(trace_dir, exist_ok=True)
  before = set(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  with jax.profiler.trace(trace_dir):
    for _ in range(steps):
      run()
  written = sorted(set(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)) - before)
  if not written:
    raise RuntimeError(f"jax.profiler wrote no trace under {trace_dir}")
  times = op_times(written[-1], module)
  if not times:
    raise RuntimeError(f"no event of the trace {written[-1]} names an HLO instruction"
                       + (f" of a module named like {module!r}" if module else ""))
  return dict(summarize(times, steps, top), trace=written[-1], steps=steps)
