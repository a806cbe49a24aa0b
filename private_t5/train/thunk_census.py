"""Counts the device kernels of a compiled XLA:GPU program from its thunk sequence dump.

XLA:GPU lowers a compiled HLO module to a sequence of thunks (one kernel launch, one GEMM, one
copy, one while loop, ...). With `xla_dump_to` set, the compiler writes the sequence as
`<module>.thunk_sequence.txt` (and, after its thunk passes, e.g. the grouping of thunks into
command buffers, `<module>.thunk_sequence_after_thunk_passes.txt`). `census` reads that text
(as written by the CUDA plugin of jaxlib 0.10.2) and counts what one execution launches.

The format, one thunk a line:

  NNN: KIND [PREV | NEXT] NAME [grid: [x, y, z] threads: [x, y, z]  shared_memory: N bytes]

* `NNN` is the thunk's number (zero-padded), `KIND` its kind (`kCustomKernel`,
  `kCublasLtMatmul`, `kCopy`, `kWhile`, `kCommandBuffer`, ...), `[PREV | NEXT]` its
  dependencies (`source`, `sink`, `prev=NNN (d)`, `next=NNN (d)`), and `NAME` the kernel's
  name for a kernel (`loop_add_fusion_161`, `input_reduce_fusion`, `wrapped_cosine`), the kind
  again for library calls (`kCublasLtMatmul`, `kCopy`), empty for containers.
* A line is indented four spaces per level of nesting. A `kWhile` line is followed by the
  header `condition:` and the condition's thunks, then the header `body:` and the body's
  thunks, each one level deeper than the loop (the headers' own indentation is irregular:
  the level of a section is the one of its first thunk). A `kConditional` lists its branches
  the same way under headers of their own. A `kCommandBuffer` (after the thunk passes) holds
  the thunks it records one level deeper, without a header.
* The dump names no loop and gives no trip count. The loop's HLO instruction (`while.33`) is
  the thunk's `profile_annotation` in `<module>.thunk_metadata.txt` (`while_names` reads it),
  and a loop whose trip count the compiler knows carries `"known_trip_count":{"n":"5"}` in its
  HLO's backend config (`known_trip_counts` reads `<module>...after_optimizations.txt`).

Counting: `kernels_per_step` is the number of device kernels one execution launches: compiled
kernels (`kCustomKernel`, `kKernel`), GEMMs (`kCublasLtMatmul`, `kGemm`), cuDNN calls (any
kind or name with `cudnn`, `kConvolution`), custom calls, FFTs; copies, memsets and the
containers themselves are not kernels. A while loop's body counts `trips` times and its
condition `trips + 1` times; a conditional counts its largest branch; a command buffer counts
the thunks it holds. The per-kind counts (`counts`, `fusion_families`) count each thunk of the
text once; `counts_per_step` and `families_per_step` weigh them by the loops' trip counts.
"""
import collections
import re
from typing import Dict, List, Mapping, Optional, Union

# A thunk line: indentation, number, kind, [dependencies], the rest (name, launch dims).
_THUNK_LINE = re.compile(r"^( *)(\d+): (k\w+)\s*\[([^\]]*)\]\s*(.*?)\s*$")
# A section header inside a container thunk: `condition:`, `body:`, `branch 0:`, ...
_SECTION_LINE = re.compile(r"^\s*([A-Za-z_][\w ]*?):\s*$")
# A kernel's numeric suffix (`loop_add_fusion_161` -> `loop_add_fusion`).
_NUMERIC_SUFFIX = re.compile(r"(?:[._]\d+)+$")

GEMM_KINDS = frozenset({"kCublasLtMatmul", "kGemm", "kCublasMatmul"})
KERNEL_KINDS = frozenset({"kCustomKernel", "kKernel", "kTriton"})
MEMCPY_KINDS = frozenset({"kCopy", "kMemset32BitValue", "kMemzero", "kMemset"})
OTHER_DEVICE_KINDS = frozenset({"kConvolution", "kCustomCall", "kFft", "kCholesky",
                                "kTriangularSolve", "kNorm", "kCubSort"})
LOOP_KINDS = frozenset({"kWhile"})
CONDITIONAL_KINDS = frozenset({"kConditional"})
COMMAND_BUFFER_KINDS = frozenset({"kCommandBuffer"})

TripCounts = Union[None, int, Mapping[Union[int, str], int]]


class _Thunk:
  """One parsed thunk and, for a container, its sections of nested thunks."""

  def __init__(self, number: int, kind: str, name: str, depth: int, line: int):
    self.number = number
    self.kind = kind
    self.name = name
    self.depth = depth
    self.line = line
    self.sections: Dict[str, List["_Thunk"]] = {}
    self.loop_index: Optional[int] = None
    self.current_section: Optional[str] = None


def bucket(kind: str, name: str) -> str:
  """The census bucket of a thunk: gemm, cudnn, memcpy, fusion, while, command_buffer, ..."""
  if "cudnn" in kind.lower() or "cudnn" in name.lower():
    return "cudnn"
  if kind in GEMM_KINDS:
    return "gemm"
  if kind in MEMCPY_KINDS or kind.startswith(("kMemcpy", "kMemset")):
    return "memcpy"
  if kind in KERNEL_KINDS:
    return "fusion"
  if kind in LOOP_KINDS:
    return "while"
  if kind in CONDITIONAL_KINDS:
    return "conditional"
  if kind in COMMAND_BUFFER_KINDS:
    return "command_buffer"
  if kind == "kConvolution":
    return "cudnn"
  if kind in OTHER_DEVICE_KINDS:
    return "custom_call" if kind == "kCustomCall" else kind[1:].lower()
  return "other"


def is_kernel(kind: str, name: str) -> bool:
  """Whether a thunk launches device work counted in `kernels_per_step`."""
  return bucket(kind, name) in ("fusion", "gemm", "cudnn", "custom_call") or (
      kind in OTHER_DEVICE_KINDS)


def family(name: str) -> str:
  """A kernel's family: its name without the numeric suffix XLA appends to repeats."""
  return _NUMERIC_SUFFIX.sub("", name) or name


def parse(text: str) -> List[_Thunk]:
  """Parses a thunk sequence dump into its top-level thunks (containers hold the rest).

  Raises:
    ValueError: on a line that is neither a thunk nor a section header, on nesting that does
      not follow a container, or on a text without thunks.
  """
  top: List[_Thunk] = []
  stack: List[_Thunk] = []
  pending_section: Optional[str] = None
  seen = 0
  for number, raw in enumerate(text.splitlines(), start=1):
    if not raw.strip():
      continue
    match = _THUNK_LINE.match(raw.replace("\t", "    "))
    if match is None:
      section = _SECTION_LINE.match(raw)
      if section is None:
        raise ValueError("thunk sequence line %d is not a thunk (`NNN: kKind [deps] name`) "
                         "nor a section header: %r" % (number, raw[:120]))
      if not stack:
        raise ValueError("thunk sequence line %d: section %r outside a container thunk"
                         % (number, section.group(1)))
      pending_section = section.group(1)
      continue
    indent, thunk_number, kind, _, rest = match.groups()
    depth = len(indent) // 4
    name = rest.split(" grid:")[0].strip().split(" ")[0] if rest else ""
    thunk = _Thunk(int(thunk_number), kind, name, depth, number)
    while stack and stack[-1].depth >= depth:
      stack.pop()
    if depth == 0:
      top.append(thunk)
    else:
      if not stack or stack[-1].depth != depth - 1:
        raise ValueError("thunk sequence line %d is nested %d levels deep without a "
                         "container thunk above it" % (number, depth))
      parent = stack[-1]
      section = pending_section or parent.current_section or "commands"
      parent.current_section = section
      parent.sections.setdefault(section, []).append(thunk)
    pending_section = None
    stack.append(thunk)
    seen += 1
  if not seen:
    raise ValueError("no thunk in the thunk sequence text (%d characters)" % len(text))
  return top


def _walk(thunks: List[_Thunk]):
  for thunk in thunks:
    yield thunk
    for children in thunk.sections.values():
      yield from _walk(children)


def _trip_count(thunk: _Thunk, trips: TripCounts, names: Mapping[int, str]) -> int:
  name = names.get(thunk.number)
  if isinstance(trips, int):
    return trips
  if trips is not None:
    for key in (name, thunk.loop_index, "%03d" % thunk.number, "default"):
      if key is not None and key in trips:
        return int(trips[key])
  raise ValueError("no trip count for while loop #%d (thunk %03d%s); pass trips={%r: N} or "
                   "trips={'default': N}" % (thunk.loop_index, thunk.number,
                                             ", %s" % name if name else "",
                                             name or thunk.loop_index))


def _weigh(thunks: List[_Thunk], weight: int, trips: TripCounts, names: Mapping[int, str],
           kinds: collections.Counter, families: collections.Counter) -> int:
  """Adds the per-step counts of `thunks` run `weight` times; returns their kernel count."""
  kernels = 0
  for thunk in thunks:
    if thunk.kind in LOOP_KINDS:
      n = _trip_count(thunk, trips, names)
      for section, children in thunk.sections.items():
        runs = n + 1 if section == "condition" else n
        kernels += _weigh(children, weight * runs, trips, names, kinds, families)
    elif thunk.kind in CONDITIONAL_KINDS and thunk.sections:
      # The largest branch: count it into scratch counters, then add the chosen one.
      best = None
      for children in thunk.sections.values():
        k, f = collections.Counter(), collections.Counter()
        count = _weigh(children, weight, trips, names, k, f)
        if best is None or count > best[0]:
          best = (count, k, f)
      kernels += best[0]
      kinds.update(best[1])
      families.update(best[2])
    else:
      for children in thunk.sections.values():
        kernels += _weigh(children, weight, trips, names, kinds, families)
    if thunk.kind in LOOP_KINDS or thunk.kind in CONDITIONAL_KINDS or (
        thunk.kind in COMMAND_BUFFER_KINDS):
      continue
    kinds[bucket(thunk.kind, thunk.name)] += weight
    if thunk.kind in KERNEL_KINDS:
      families[family(thunk.name)] += weight
    if is_kernel(thunk.kind, thunk.name):
      kernels += weight
  return kernels


def census(thunk_sequence_text: str, trips: TripCounts = None,
           names: Optional[Mapping[int, str]] = None) -> dict:
  """Counts the thunks of a thunk sequence dump and the kernels one execution launches.

  Args:
    thunk_sequence_text: the text of a `*thunk_sequence.txt` (or
      `*thunk_sequence_after_thunk_passes.txt`) dump.
    trips: the trip count of each while loop: an int for every loop, or a mapping from the
      loop's HLO name (with `names`), its index (0, 1, ... in the order of the text), its
      thunk number as written (`"004"`) or `"default"` to a count. Needed only when the text
      has while loops.
    names: thunk number -> HLO instruction name (`while_names` of the thunk metadata), to key
      `trips` by loop name and to name the loops in the result.

  Returns:
    A dict: `thunks` (lines), `counts` (bucket -> thunks in the text: `fusion`, `gemm`,
    `cudnn`, `memcpy`, `while`, `command_buffer`, ...), `fusion_families` (family ->
    kernels in the text), `command_buffers`, `while_loops` (number of loops),
    `loops` (one dict per loop: index, thunk, name, depth, trips, kernels per trip),
    `kernels_static` (device kernels in the text, each once), `kernels_per_step`,
    `counts_per_step` and `families_per_step` (weighted by trip counts).

  Raises:
    ValueError: on text that is not a thunk sequence, or on a while loop without a trip count.
  """
  names = dict(names or {})
  top = parse(thunk_sequence_text)
  every = list(_walk(top))
  loops = [t for t in every if t.kind in LOOP_KINDS]
  for index, loop in enumerate(loops):
    loop.loop_index = index
  counts = collections.Counter(bucket(t.kind, t.name) for t in every)
  families = collections.Counter(family(t.name) for t in every if t.kind in KERNEL_KINDS)
  kinds_per_step, families_per_step = collections.Counter(), collections.Counter()
  kernels_per_step = _weigh(top, 1, trips, names, kinds_per_step, families_per_step)
  loop_rows = []
  for loop in loops:
    body = loop.sections.get("body", [])
    loop_rows.append(dict(
        index=loop.loop_index, thunk=loop.number, name=names.get(loop.number),
        depth=loop.depth, trips=_trip_count(loop, trips, names),
        body_kernels=sum(1 for t in _walk(body) if is_kernel(t.kind, t.name)),
        condition_kernels=sum(1 for t in _walk(loop.sections.get("condition", []))
                              if is_kernel(t.kind, t.name))))
  return dict(
      thunks=len(every),
      counts=dict(counts.most_common()),
      fusion_families=dict(families.most_common()),
      command_buffers=counts.get("command_buffer", 0),
      while_loops=len(loops),
      loops=loop_rows,
      kernels_static=sum(1 for t in every if is_kernel(t.kind, t.name)),
      kernels_per_step=kernels_per_step,
      counts_per_step=dict(kinds_per_step.most_common()),
      families_per_step=dict(families_per_step.most_common()))


def top_families(result: dict, n: int = 15) -> List[tuple]:
  """The `n` most launched kernel families of a `census` result: (family, kernels per step)."""
  ranked = sorted(result["families_per_step"].items(), key=lambda kv: (-kv[1], kv[0]))
  return ranked[:n]


_METADATA_ENTRY = re.compile(
    r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)\s*\}\s*thunk_kind:\s*"(k\w+)"')
_KNOWN_TRIPS = re.compile(
    r'%?([\w.\-]+) = [^\n]*? while\([^\n]*"known_trip_count":\{"n":"(\d+)"\}')


def while_names(thunk_metadata_text: str) -> Dict[int, str]:
  """Thunk number -> HLO instruction name of each loop of a `*thunk_metadata.txt` dump."""
  return {int(number): name for name, number, kind in _METADATA_ENTRY.findall(
      thunk_metadata_text) if kind in LOOP_KINDS}


def known_trip_counts(hlo_text: str) -> Dict[str, int]:
  """While instruction name -> trip count the compiler knows, from an optimized HLO dump."""
  return {name: int(n) for name, n in _KNOWN_TRIPS.findall(hlo_text)}
