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
  length = max(length, 2)  # t5 avoids degeneracy the same way
  num_noise_tokens = int(np.round(np.float32(length) * np.float32(noise_density)))
  num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
  num_noise_spans = max(int(np.round(np.float32(num_noise_tokens) / np.float32(mean_noise_span_length))), 1)
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
