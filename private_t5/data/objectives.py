"""Pretraining objectives on one raw token window: span corruption and prefix LM.

Both turn a window of document tokens (no EOS) into an `(inputs, targets)` pair of int32
arrays ending in EOS, drawing their randomness from an explicit `np.random.Generator`, so that
every draw of an example gets fresh noise from the step's seed (random access, DP rule "sampling matches accounting").

Why a NumPy port of `t5.data.preprocessors.random_spans_noise_mask` and
`noise_span_to_unique_sentinel` instead of calling them in a `tf.function`: `get_batch` builds
128 examples per step on the host; through t5's ops in one compiled `tf.function` a batch of
128 windows takes 264 ms on 2 CPU cores (TF dispatch per example), the port 27 ms
(benchmarks/bench_data.py, docs/data.md). The port keeps T5's exact definition (same number of noise tokens and spans,
alternating non-noise/noise spans starting with non-noise, each segmentation uniformly random,
sentinels `<extra_id_0>`, `<extra_id_1>`, … = vocab_size-1, vocab_size-2, … in order);
tests/test_data_objectives.py checks it against t5's functions (identical sentinel layout for
the same mask, identical span statistics).
"""
import dataclasses
from typing import Tuple

import numpy as np

from private_t5.data import row_random
from private_t5.errors import ConfigError

EOS_ID = 1
SPAN_CORRUPTION = "span_corruption"
PREFIX_LM = "prefix_lm"
OBJECTIVES = (SPAN_CORRUPTION, PREFIX_LM)


def random_spans_lengths(inputs_length: int, noise_density: float, mean_noise_span_length: float,
                         extra_tokens_per_span_inputs: int = 1,
                         extra_tokens_per_span_targets: int = 1) -> Tuple[int, int]:
  """(raw tokens length, targets length) of T5's span corruption for `inputs_length` inputs.

  The same numbers as `t5.data.preprocessors.random_spans_helper` (Raffel et al., "Exploring
  the Limits of Transfer Learning with a Unified Text-to-Text Transformer", 2020), without
  importing t5/TensorFlow: the longest raw window whose corrupted inputs (non-noise tokens, one
  group of `extra_tokens_per_span_inputs` sentinels per noise span, EOS) still fit in
  `inputs_length`, and the length of its targets (noise tokens, sentinels, EOS). With
  `noise_density == 0.5` a window one token shorter is taken when the targets would otherwise
  be longer than the inputs.
  """
  def encoded_lengths(raw: int) -> Tuple[int, int]:
    noise = int(round(raw * noise_density))
    spans = int(round(noise / mean_noise_span_length))
    return (raw - noise + spans * extra_tokens_per_span_inputs + 1,
            noise + spans * extra_tokens_per_span_targets + 1)

  raw = inputs_length - 1
  while encoded_lengths(raw + 1)[0] <= inputs_length:
    raw += 1
  inputs, targets = encoded_lengths(raw)
  if noise_density == 0.5 and targets > inputs:
    raw, targets = raw - 1, targets - 1
  return raw, targets


def span_corruption_lengths(inputs_length: int, noise_density: float = 0.15,
                            mean_noise_span_length: float = 3.0) -> Tuple[int, int]:
  """(raw window length, targets length) such that inputs fill `inputs_length` with EOS.

  `random_spans_lengths` with one sentinel per span (inputs 512 -> raw 568, targets 114).
  """
  if inputs_length < 2:
    raise ConfigError(f"span corruption needs inputs length >= 2, got {inputs_length}")
  if not 0.0 < noise_density < 1.0:
    raise ConfigError(f"noise_density must be in (0, 1), got {noise_density}")
  if mean_noise_span_length <= 0:
    raise ConfigError(f"mean_noise_span_length must be positive, got {mean_noise_span_length}")
  raw_length, targets_length = random_spans_lengths(inputs_length, noise_density, mean_noise_span_length)
  if raw_length < 2:
    raise ConfigError(f"inputs length {inputs_length} gives a raw span-corruption window of {raw_length} "
                      "tokens; at least 2 are needed")
  return int(raw_length), int(targets_length)


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
  """Uniformly random split of `num_items` into `num_segments` positive lengths (as in t5).

  t5 shuffles a 0/1 vector marking which of the `num_items - 1` gaps start a segment; drawing
  a uniform (num_segments-1)-subset of the gaps is the same distribution.
  """
  if num_segments <= 1:
    return np.array([num_items], dtype=np.int64)
  bounds = np.empty(num_segments + 1, np.int64)  # 0, the sorted cuts, num_items
  bounds[0], bounds[-1] = 0, num_items
  bounds[1:-1] = rng.choice(num_items - 1, size=num_segments - 1, replace=False)
  bounds[1:-1].sort()
  bounds[1:-1] += 1
  return bounds[1:] - bounds[:-1]


def random_spans_noise_mask(length: int, noise_density: float, rng: np.random.Generator,
                            mean_noise_span_length: float = 3.0) -> np.ndarray:
  """Boolean noise mask of `length` made of random spans (T5's definition, see module doc)."""
  orig_length = length
  # t5 avoids degeneracy the same way: at least 2 positions, 1..length-1 noise tokens, >= 1 span.
  length, num_noise_tokens, num_noise_spans = (int(x[0]) for x in _span_counts(
      np.array([length], np.int64), noise_density, mean_noise_span_length))
  num_nonnoise_tokens = length - num_noise_tokens
  # t5 can ask for more non-noise spans than non-noise tokens only when length is tiny; its
  # segment_sum then yields empty segments. Clamp like that: at most one span per token.
  noise_spans = _random_segmentation(num_noise_tokens, min(num_noise_spans, num_noise_tokens), rng)
  nonnoise_spans = _random_segmentation(num_nonnoise_tokens, min(num_noise_spans, num_nonnoise_tokens), rng)
  num_spans = min(len(noise_spans), len(nonnoise_spans))
  interleaved = np.stack([nonnoise_spans[:num_spans], noise_spans[:num_spans]], axis=1).reshape(-1)
  # Leftover tokens (only in the clamped tiny case) join the last noise span.
  interleaved[-1] += length - interleaved.sum()
  mask = np.repeat(np.tile([False, True], num_spans), interleaved)
  return mask[:orig_length]


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray, vocab_size: int) -> np.ndarray:
  """Replaces each run of noise tokens by one sentinel: vocab_size-1, vocab_size-2, …"""
  prev_is_noise = np.zeros_like(noise_mask)
  prev_is_noise[1:] = noise_mask[:-1]
  first_noise = noise_mask & ~prev_is_noise
  subsequent_noise = noise_mask & prev_is_noise
  sentinel = vocab_size - np.cumsum(first_noise).astype(tokens.dtype)
  out = np.where(first_noise, sentinel, tokens)
  return out[~subsequent_noise]


def nonnoise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray, vocab_size: int) -> np.ndarray:
  return noise_span_to_unique_sentinel(tokens, ~noise_mask, vocab_size)


def _span_counts(lengths: np.ndarray, noise_density: float, mean_noise_span_length: float):
  """(padded lengths, noise tokens, noise spans) of each row: T5's counts, for one row and for a batch."""
  padded = np.maximum(lengths, 2)
  noise = np.round(padded.astype(np.float32) * np.float32(noise_density)).astype(np.int64)
  noise = np.minimum(np.maximum(noise, 1), padded - 1)
  spans = np.round(noise.astype(np.float32) / np.float32(mean_noise_span_length)).astype(np.int64)
  return padded, noise, np.maximum(spans, 1)


def _random_segmentations(num_items: np.ndarray, num_segments: np.ndarray, keys: np.ndarray,
                          stream: int) -> np.ndarray:
  """int64 [rows, max(num_segments) + 1]: segment boundaries of a uniformly random split of each
  row's `num_items` into `num_segments` positive lengths (`_random_segmentation` of every row).

  Row r's boundaries are 0, its sorted cuts, then `num_items[r]` repeated to the width. The cuts
  are a uniform (num_segments-1)-subset of the num_items-1 gaps, drawn by Floyd's algorithm
  (one draw per cut, all rows at once): draw number 2·i + `stream` of a row's key makes its cut
  i, so a row's segmentation depends on its key alone.
  """
  rows = len(num_items)
  cuts = num_segments - 1  # per row: choose `cuts` of the gaps 0 .. num_items-2
  gaps = num_items - 1
  width = int(cuts.max()) if rows else 0
  step = np.arange(width)
  # Floyd: at step i draw t in [0, j], j = gaps - cuts + i; take j instead if t was already chosen.
  base = gaps - cuts
  j = base[:, None] + step[None, :]
  real = step[None, :] < cuts[:, None]
  t = np.where(real, row_random.below(row_random.bits(keys, 2 * step + stream), j + 1), gaps[:, None])
  # What was chosen before step i is {t_m : m < i} and the j_m of the earlier steps that took
  # theirs, so t_i is taken (and j_i chosen instead) iff it equals an earlier t, or equals j_m
  # (m = t_i - base < i) of a step m that was taken itself. The first part by a stable sort of
  # each row; the second, which refers only to earlier steps, by iterating to its fixed point
  # (at most `width` rounds, one or two in practice): the same choices as the step-by-step loop.
  order = np.argsort(t, axis=1, kind="stable")
  ordered = np.take_along_axis(t, order, axis=1)
  repeated = np.zeros((rows, width), bool)
  repeated[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
  seen = np.empty_like(repeated)
  np.put_along_axis(seen, order, repeated, axis=1)
  earlier = t - base[:, None]
  refers = real & (earlier >= 0) & (earlier < step[None, :])
  earlier = np.clip(earlier, 0, max(width - 1, 0))
  taken = seen
  while True:
    again = seen | (refers & np.take_along_axis(taken, earlier, axis=1))
    if np.array_equal(again, taken):
      break
    taken = again
  chosen = np.where(taken & real, j, t)
  chosen.sort(axis=1)
  bounds = np.empty((rows, width + 2), np.int64)
  bounds[:, 0] = 0
  bounds[:, 1:-1] = chosen + 1
  bounds[:, -1] = num_items
  return bounds


def _noise_spans(lengths: np.ndarray, noise_density: float, keys: np.ndarray, mean_noise_span_length: float):
  """(starts, ends, real): the noise spans of each row's `random_spans_noise_mask`.

  starts, ends: int64 [rows, max spans], span i of row r covers [starts, ends) of its padded
  length (`padded[r]` = max(length, 2)); real: bool, which of them row r has.
  """
  rows = len(lengths)
  padded, noise, spans = _span_counts(lengths, noise_density, mean_noise_span_length)
  nonnoise = padded - noise
  # As the one-row mask: at most one span per token, the leftover (tiny rows) joins the last noise span.
  noise_segments = np.minimum(spans, noise)
  nonnoise_segments = np.minimum(spans, nonnoise)
  num_spans = np.minimum(noise_segments, nonnoise_segments)
  noise_bounds = _random_segmentations(noise, noise_segments, keys, 0)
  nonnoise_bounds = _random_segmentations(nonnoise, nonnoise_segments, keys, 1)
  s = int(num_spans.max()) if rows else 0
  # Noise span i: [nonnoise_bounds[i+1] + noise_bounds[i], nonnoise_bounds[i+1] + noise_bounds[i+1]).
  span = np.arange(s)
  starts = nonnoise_bounds[:, 1:s + 1] + noise_bounds[:, :s]
  ends = nonnoise_bounds[:, 1:s + 1] + noise_bounds[:, 1:s + 1]
  ends = np.where(span[None, :] == num_spans[:, None] - 1, padded[:, None], ends)
  return starts, ends, span[None, :] < num_spans[:, None]


def _mask_of_spans(starts, ends, real, width: int, lengths: np.ndarray) -> np.ndarray:
  rows = len(lengths)
  full = max(width, int(ends.max()) if ends.size else 0)
  edges = np.zeros((rows, full + 1), np.int8)
  row = np.broadcast_to(np.arange(rows)[:, None], starts.shape)[real]
  edges[row, starts[real]] = 1
  edges[row, ends[real]] = -1
  mask = np.cumsum(edges[:, :width], axis=1, dtype=np.int8).view(bool)
  mask &= np.arange(width)[None, :] < lengths[:, None]
  return mask


def random_spans_noise_masks(lengths, noise_density: float, keys: np.ndarray, mean_noise_span_length: float = 3.0,
                             width: int = 0) -> np.ndarray:
  """bool [rows, max(width, max(lengths))]: `random_spans_noise_mask` of each row's length.

  Row r holds the mask of a window of `lengths[r]` tokens (False past it), with T5's exact noise
  token and span counts and uniformly random segmentations of noise and non-noise tokens, drawn
  from its key `keys[r]` (`row_random`) instead of a Generator.
  """
  lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
  keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
  width = max(int(width), int(lengths.max()) if len(lengths) else 0)
  starts, ends, real = _noise_spans(lengths, noise_density, keys, mean_noise_span_length)
  return _mask_of_spans(starts, ends, real, width, lengths)


def _pack(values: np.ndarray, keep: np.ndarray, out_width: int):
  """(int32 [rows, out_width], int64 [rows]): each row's kept values, then EOS, zero-padded and
  cut at `out_width`; and each row's length before the cut (kept values + EOS)."""
  rows = len(values)
  counts = keep.sum(axis=1)
  out = np.zeros((rows, out_width), np.int32)
  kept = values[keep]  # row after row
  if rows and (counts == counts[0]).all() and counts[0] < out_width:  # all rows alike (full windows)
    out[:, :counts[0]] = kept.reshape(rows, int(counts[0]))
  elif rows:
    # Kept value k of row r goes to column k: flat position r·out_width + k.
    first = np.cumsum(counts) - counts
    dest = np.arange(len(kept)) + np.repeat(np.arange(rows) * out_width - first, counts)
    if counts.max() > out_width:
      fits = (dest - np.repeat(np.arange(rows) * out_width, counts)) < out_width
      dest, kept = dest[fits], kept[fits]
    out.reshape(-1)[dest] = kept
  room = counts < out_width
  out[np.flatnonzero(room), counts[room]] = EOS_ID
  return out, counts + 1


def _with_eos(tokens: np.ndarray) -> np.ndarray:
  return np.concatenate([tokens.astype(np.int32), np.array([EOS_ID], np.int32)])


@dataclasses.dataclass(frozen=True)
class SpanCorruption:
  """T5 span corruption: inputs keep non-noise tokens + sentinels, targets the noise spans.

  Attributes:
    inputs_length: fixed encoder length (with EOS); 512 in the paper.
    targets_length: fixed decoder length (with EOS); must be >= the length implied by
      `random_spans_helper` (114 for 512).
    vocab_size: size of the vocabulary including the sentinel extra ids.
  """
  inputs_length: int
  targets_length: int
  vocab_size: int
  noise_density: float = 0.15
  mean_noise_span_length: float = 3.0
  name: str = SPAN_CORRUPTION

  def __post_init__(self):
    raw, needed = span_corruption_lengths(self.inputs_length, self.noise_density, self.mean_noise_span_length)
    if self.targets_length < needed:
      raise ConfigError(f"span corruption with inputs length {self.inputs_length} needs targets length "
                        f">= {needed}, got {self.targets_length}")
    object.__setattr__(self, "_raw_length", raw)

  @property
  def raw_length(self) -> int:
    """Document tokens consumed by one example (568 for inputs 512)."""
    return self._raw_length  # pytype: disable=attribute-error

  def __call__(self, window: np.ndarray, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    mask = random_spans_noise_mask(len(window), self.noise_density, rng, self.mean_noise_span_length)
    # As t5's `denoise` with `inputs_fn=noise_span_to_unique_sentinel`: inputs keep the
    # non-noise tokens (noise spans -> sentinels), targets keep the noise spans. Both sides in
    # one pass over the mask (the same arrays as the two functions above, tested).
    window = np.asarray(window)
    starts = np.empty(len(mask), bool)  # a span (of either kind) starts here
    if len(mask):
      starts[0] = True
      np.not_equal(mask[1:], mask[:-1], out=starts[1:])
    noise_start = starts & mask
    clean_start = starts & ~mask
    inputs = np.where(noise_start, self.vocab_size - np.cumsum(noise_start).astype(window.dtype), window)
    targets = np.where(clean_start, self.vocab_size - np.cumsum(clean_start).astype(window.dtype), window)
    return _with_eos(inputs[~mask | noise_start]), _with_eos(targets[mask | clean_start])

  def batch(self, windows: np.ndarray, lengths, keys: np.ndarray):
    """The examples of a batch of windows at once: the same definition as `__call__`.

    Args:
      windows: int [rows, width], row r's window in its first `lengths[r]` tokens.
      lengths: int [rows], each <= width.
      keys: uint64 [rows], each row's randomness (`row_random`).

    Returns:
      (inputs int32 [rows, inputs_length], targets int32 [rows, targets_length], inputs
      lengths, targets lengths): zero-padded, with EOS; the lengths count EOS.
    """
    windows = np.asarray(windows)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
    rows, width = windows.shape
    starts, ends, real = _noise_spans(lengths, self.noise_density, keys, self.mean_noise_span_length)
    mask = _mask_of_spans(starts, ends, real, width, lengths)
    valid = np.arange(width)[None, :] < lengths[:, None]
    # Inputs drop the noise tokens after a span's first, targets the clean ones after a span's first.
    keep_inputs = valid.copy()
    keep_targets = valid.copy()
    if width > 1:
      keep_inputs[:, 1:] &= ~(mask[:, 1:] & mask[:, :-1])
      keep_targets[:, 1:] &= mask[:, 1:] | mask[:, :-1]
    # A span's first token becomes its sentinel: noise span i (inputs) and clean span i (targets,
    # the first at 0, then one after each noise span) are vocab_size-1-i.
    row = np.broadcast_to(np.arange(rows)[:, None], starts.shape)
    sentinel = (self.vocab_size - 1 - np.arange(starts.shape[1])).astype(np.int32)
    sentinel = np.broadcast_to(sentinel[None, :], starts.shape)
    inputs = windows.astype(np.int32)
    noise = real & (starts < lengths[:, None])
    inputs[row[noise], starts[noise]] = sentinel[noise]
    targets = windows.astype(np.int32)
    targets[:, 0] = self.vocab_size - 1
    clean = real & (ends < lengths[:, None])
    targets[row[clean], ends[clean]] = sentinel[clean] - 1
    inputs, inputs_lengths = _pack(inputs, keep_inputs, self.inputs_length)
    targets, targets_lengths = _pack(targets, keep_targets, self.targets_length)
    return inputs, targets, inputs_lengths, targets_lengths



@dataclasses.dataclass(frozen=True)
class PrefixLM:
  """The paper's "prefix" objective: a context, then predict the continuation.

  A full window is `inputs_length - 1` context tokens followed by `targets_length - 1` target
  tokens (each side then gets EOS): 511 + 113 = 624 raw tokens for 512/114. A document shorter
  than that is split at a random point that keeps both sides within their lengths and leaves at
  least one target token.
  """
  inputs_length: int
  targets_length: int
  vocab_size: int = 0
  name: str = PREFIX_LM

  def __post_init__(self):
    if self.inputs_length < 1 or self.targets_length < 2:
      raise ConfigError(f"prefix LM needs inputs length >= 1 and targets length >= 2, got "
                        f"{self.inputs_length}/{self.targets_length}")

  @property
  def raw_length(self) -> int:
    return self.inputs_length - 1 + self.targets_length - 1

  def split_point(self, length: int, rng: np.random.Generator) -> int:
    """Number of context tokens for a window of `length` tokens."""
    if length >= self.raw_length:
      return self.inputs_length - 1
    low = max(1, length - (self.targets_length - 1))
    high = min(self.inputs_length - 1, length - 1)
    if length < 2 or high < low:
      return min(max(length - (self.targets_length - 1), 0), self.inputs_length - 1)
    return int(rng.integers(low, high + 1))

  def __call__(self, window: np.ndarray, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    split = self.split_point(len(window), rng)
    return _with_eos(window[:split]), _with_eos(window[split:])

  def split_points(self, lengths, keys: np.ndarray) -> np.ndarray:
    """int64 [rows]: `split_point` of each row's length, drawn from its key (`row_random`)."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    li, lt = self.inputs_length - 1, self.targets_length - 1
    low = np.maximum(1, lengths - lt)
    high = np.minimum(li, lengths - 1)
    drawn = low + row_random.below(row_random.bits(keys, 0), high - low + 1)
    short = np.minimum(np.maximum(lengths - lt, 0), li)
    split = np.where((lengths < 2) | (high < low), short, drawn)
    return np.where(lengths >= self.raw_length, li, split)

  def batch(self, windows: np.ndarray, lengths, keys: np.ndarray):
    """The examples of a batch of windows at once: the same definition as `__call__`.

    Arguments and results as `SpanCorruption.batch`.
    """
    windows = np.asarray(windows).astype(np.int32)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    rows, width = windows.shape
    split = self.split_points(lengths, keys)
    position = np.arange(width)[None, :]
    inputs, inputs_lengths = _pack(windows, position < split[:, None], self.inputs_length)
    shifted = np.take_along_axis(windows, np.minimum(position + split[:, None], max(width - 1, 0)), axis=1)
    targets, targets_lengths = _pack(shifted, position < (lengths - split)[:, None], self.targets_length)
    return inputs, targets, inputs_lengths, targets_lengths



def make_objective(objective: str, feature_lengths, vocab_size: int, *, noise_density: float = 0.15,
                   mean_noise_span_length: float = 3.0):
  """Builds the objective named `objective` for `feature_lengths` {"inputs", "targets"}."""
  try:
    inputs_length = int(feature_lengths["inputs"])
    targets_length = int(feature_lengths["targets"])
  except (KeyError, TypeError, ValueError):
    raise ConfigError(f"feature_lengths must map 'inputs' and 'targets' to integers, got {feature_lengths!r}") from None
  if inputs_length <= 0 or targets_length <= 0:
    raise ConfigError(f"feature lengths must be positive, got inputs={inputs_length} targets={targets_length}")
  if objective == SPAN_CORRUPTION:
    return SpanCorruption(inputs_length, targets_length, vocab_size, noise_density, mean_noise_span_length)
  if objective == PREFIX_LM:
    return PrefixLM(inputs_length, targets_length, vocab_size)
  raise ConfigError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
