"""The NumPy span corruption against t5.data.preprocessors, and the prefix-LM split."""
import os
import subprocess
import sys

import numpy as np
import pytest

from private_t5.data import objectives
from private_t5.errors import ConfigError

VOCAB_SIZE = 32100
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _VocabSize:
  """What t5's sentinel helpers read from a vocabulary: its size."""
  vocab_size = VOCAB_SIZE


def _t5_mask(length, seed):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from t5.data import preprocessors  # pylint: disable=g-import-not-at-top
  seeds = tf.constant([[seed, 1], [seed, 2]], tf.int32)
  return preprocessors.random_spans_noise_mask(length, 0.15, seeds, 3.0).numpy()


def _span_stats(mask):
  starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
  return int(mask.sum()), len(starts), bool(mask[0])


@pytest.mark.parametrize("length", [1, 2, 3, 7, 20, 101, 568])
def test_noise_mask_matches_t5_counts(length):
  rng = np.random.default_rng(length)
  for seed in range(5):
    ours = objectives.random_spans_noise_mask(length, 0.15, rng, 3.0)
    theirs = _t5_mask(length, seed)
    assert ours.shape == theirs.shape == (length,)
    # Same number of noise tokens and spans, never noise first (deterministic in t5).
    assert _span_stats(ours) == _span_stats(theirs)


def test_noise_mask_statistics_match_t5():
  """Span-length and position distributions agree (T5: all masks equally likely)."""
  rng = np.random.default_rng(0)
  ours = np.stack([objectives.random_spans_noise_mask(568, 0.15, rng) for _ in range(300)])
  theirs = np.stack([_t5_mask(568, s) for s in range(300)])
  assert ours.mean() == pytest.approx(theirs.mean(), abs=1e-9)  # exact count per mask
  # Where the noise falls (fraction in each quarter of the window) and the longest span.
  for quarter in range(4):
    part = slice(quarter * 142, (quarter + 1) * 142)
    assert ours[:, part].mean() == pytest.approx(theirs[:, part].mean(), abs=0.01)

  def longest(m):
    runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], m.astype(int), [0]]))))[::2]
    return runs.max()

  assert np.mean([longest(m) for m in ours]) == pytest.approx(np.mean([longest(m) for m in theirs]), rel=0.1)


def test_sentinel_layout_identical_to_t5():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from t5.data import preprocessors  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  for length in (5, 40, 568):
    tokens = rng.integers(3, 30000, size=length).astype(np.int32)
    mask = objectives.random_spans_noise_mask(length, 0.15, rng)
    for ours_fn, theirs_fn in ((objectives.noise_span_to_unique_sentinel, preprocessors.noise_span_to_unique_sentinel),
                               (objectives.nonnoise_span_to_unique_sentinel,
                                preprocessors.nonnoise_span_to_unique_sentinel)):
      theirs = theirs_fn(tf.constant(tokens), tf.constant(mask), _VocabSize(), None).numpy()
      np.testing.assert_array_equal(ours_fn(tokens, mask, VOCAB_SIZE), theirs)


@pytest.mark.parametrize("noise_density", [0.05, 0.15, 0.3, 0.5, 0.8])
@pytest.mark.parametrize("mean_noise_span_length", [1.0, 2.5, 3.0, 10.0])
@pytest.mark.parametrize("extra_inputs,extra_targets", [(1, 1), (0, 1), (2, 0), (1, 3)])
def test_random_spans_lengths_match_t5(noise_density, mean_noise_span_length, extra_inputs, extra_targets):
  from t5.data import preprocessors  # pylint: disable=g-import-not-at-top
  for inputs_length in (2, 3, 5, 17, 64, 128, 129, 512, 1000):
    kwargs = dict(inputs_length=inputs_length, noise_density=noise_density,
                  mean_noise_span_length=mean_noise_span_length,
                  extra_tokens_per_span_inputs=extra_inputs, extra_tokens_per_span_targets=extra_targets)
    theirs = preprocessors.random_spans_helper(**kwargs)
    assert objectives.random_spans_lengths(**kwargs) == tuple(int(x) for x in theirs), kwargs


def test_objectives_import_without_tensorflow():
  code = ("import sys; from private_t5.data import objectives, source; "
          "assert objectives.span_corruption_lengths(128) == (141, 29); "
          "objectives.make_objective('span_corruption', {'inputs': 128, 'targets': 29}, 32100); "
          "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 't5')); "
          "assert not loaded, loaded[:5]")
  subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=_ROOT))


def test_span_corruption_fills_512_114():
  assert objectives.span_corruption_lengths(512) == (568, 114)
  sc = objectives.make_objective("span_corruption", {"inputs": 512, "targets": 114}, VOCAB_SIZE)
  window = np.arange(3, 3 + 568, dtype=np.int32)
  inputs, targets = sc(window, np.random.default_rng(0))
  assert len(inputs) == 512 and len(targets) == 114
  assert inputs[-1] == targets[-1] == objectives.EOS_ID
  assert inputs[0] == 3  # the first token is never noise
  sentinels = inputs[inputs >= VOCAB_SIZE - 100]
  np.testing.assert_array_equal(sentinels, targets[targets >= VOCAB_SIZE - 100])


def test_prefix_lm_split():
  p = objectives.make_objective("prefix_lm", {"inputs": 512, "targets": 114}, VOCAB_SIZE)
  assert p.raw_length == 624
  window = np.arange(3, 3 + 700, dtype=np.int32)[:624]
  inputs, targets = p(window, np.random.default_rng(0))
  np.testing.assert_array_equal(inputs[:-1], window[:511])
  np.testing.assert_array_equal(targets[:-1], window[511:])
  rng = np.random.default_rng(0)
  for length in (1, 2, 3, 50, 300, 623):
    for _ in range(10):
      inputs, targets = p(window[:length], rng)
      assert len(inputs) <= 512 and len(targets) <= 114 and len(targets) >= 2 - (length == 0)
      np.testing.assert_array_equal(np.concatenate([inputs[:-1], targets[:-1]]), window[:length])


@pytest.mark.parametrize("name,lengths,message", [
    ("span_corruption", {"inputs": 1, "targets": 114}, "inputs length >= 2"),
    ("span_corruption", {"inputs": 512, "targets": 113}, ">= 114"),
    ("prefix_lm", {"inputs": 512, "targets": 1}, "targets length >= 2"),
    ("prefix_lm", {"inputs": 0, "targets": 114}, "positive"),
    ("prefix_lm", {"inputs": "x", "targets": 114}, "integers"),
])
def test_lengths_that_cannot_fit(name, lengths, message):
  with pytest.raises(ConfigError, match=message):
    objectives.make_objective(name, lengths, VOCAB_SIZE)


def test_tiny_windows_still_give_valid_examples():
  sc = objectives.make_objective("span_corruption", {"inputs": 512, "targets": 114}, VOCAB_SIZE)
  for length in (0, 1, 2, 3):
    inputs, targets = sc(np.arange(3, 3 + length, dtype=np.int32), np.random.default_rng(length))
    assert inputs[-1] == targets[-1] == objectives.EOS_ID
    assert len(inputs) + len(targets) <= length + 4


@pytest.mark.parametrize("length", [1, 2, 3, 17, 568])
def test_span_corruption_in_one_pass_equals_the_two_sentinel_functions(length):
  """`SpanCorruption.__call__` builds inputs and targets in one pass over the mask: the same
  arrays as `noise_span_to_unique_sentinel` / `nonnoise_span_to_unique_sentinel` on that mask."""
  obj = objectives.SpanCorruption(512, 114, 1000)
  for seed in range(20):
    window = np.random.default_rng(seed).integers(3, 900, length).astype(np.int32)
    mask = objectives.random_spans_noise_mask(length, obj.noise_density, np.random.default_rng([seed, 1]),
                                              obj.mean_noise_span_length)
    inputs, targets = obj(window, np.random.default_rng([seed, 1]))
    np.testing.assert_array_equal(inputs[:-1], objectives.noise_span_to_unique_sentinel(window, mask, 1000))
    np.testing.assert_array_equal(targets[:-1], objectives.nonnoise_span_to_unique_sentinel(window, mask, 1000))
    assert inputs[-1] == targets[-1] == objectives.EOS_ID
