"""The objectives on a whole batch (`SpanCorruption.batch`, `PrefixLM.batch`) against their
one-example definitions: exactly where the definition fixes a number, in distribution where it
draws one; and the counter-based randomness (`row_random`) a row draws from."""
import json
import math

import numpy as np
import pytest

from private_t5.data import objectives
from private_t5.data import row_random
from private_t5.data import source as source_lib
from test_data_vocab import small_vocab_path

VOCAB_SIZE = 32100
LENGTHS = (0, 1, 2, 3, 4, 5, 7, 17, 20, 101, 300, 567, 568)


def _span_stats(mask):
  starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
  return int(mask.sum()), len(starts), bool(mask[0]) if len(mask) else False


def _span_lengths(mask, value=True):
  """Lengths of the runs of `value` in a 1-D boolean mask."""
  m = np.concatenate([[False], mask == value, [False]]).astype(np.int8)
  edges = np.flatnonzero(np.diff(m))
  return edges[1::2] - edges[::2]


def _windows(lengths, seed=0, width=None):
  lengths = np.asarray(lengths, np.int64)
  width = width or max(1, int(lengths.max()))
  windows = np.random.default_rng(seed).integers(3, VOCAB_SIZE - 100, (len(lengths), width)).astype(np.int32)
  windows[np.arange(width)[None, :] >= lengths[:, None]] = 0
  return windows


def _unmask(inputs, targets, vocab_size):
  """The window a span-corruption example was made from: each sentinel of the inputs replaced by
  the tokens that follow the same sentinel in the targets."""
  spans, current = {}, None
  for t in targets[:-1]:
    if t >= vocab_size - 100:
      current = int(t)
      spans[current] = []
    else:
      spans[current].append(int(t))
  out = []
  for t in inputs[:-1]:
    out.extend(spans[int(t)] if t >= vocab_size - 100 else [int(t)])
  return out


def test_row_keys_and_draws_are_pure_functions_of_seed_index_and_counter():
  keys = row_random.row_keys(7, np.arange(10_000))
  assert keys.dtype == np.uint64 and len(np.unique(keys)) == 10_000
  np.testing.assert_array_equal(row_random.row_keys(7, [42, 3]), keys[[42, 3]])
  assert not np.array_equal(row_random.row_keys(8, [42, 3]), keys[[42, 3]])
  np.testing.assert_array_equal(row_random.row_keys(-1, [5]), row_random.row_keys(2**64 - 1, [5]))
  table = row_random.bits(keys[:4], np.arange(6))
  assert table.shape == (4, 6)
  np.testing.assert_array_equal(table[:, 2], row_random.bits(keys[:4], 2))
  # Uniform integers: every value of [0, n) about equally often, none outside.
  values = row_random.below(row_random.bits(keys, 0), 10)
  assert values.min() == 0 and values.max() == 9
  counts = np.bincount(values, minlength=10)
  assert np.abs(counts / 10_000 - 0.1).max() < 0.015
  np.testing.assert_array_equal(row_random.below(row_random.bits(keys[:3], 0), 0), 0)


@pytest.mark.parametrize("noise_density,mean_span", [(0.15, 3.0), (0.5, 2.0), (0.05, 10.0)])
def test_noise_masks_have_t5s_exact_counts(noise_density, mean_span):
  lengths = np.repeat(LENGTHS, 40)
  keys = row_random.row_keys(3, np.arange(len(lengths)))
  masks = objectives.random_spans_noise_masks(lengths, noise_density, keys, mean_span, width=600)
  assert masks.shape == (len(lengths), 600)
  for length, mask in zip(lengths, masks):
    assert not mask[length:].any()
    reference = objectives.random_spans_noise_mask(int(length), noise_density, np.random.default_rng(int(length)),
                                                   mean_span)
    # Noise tokens, spans and the first token's kind are fixed by the length (T5's definition).
    assert _span_stats(mask[:length]) == _span_stats(reference), length


def _floyd_step_by_step(num_items, num_segments, keys, stream):
  """`_random_segmentations` of one row at a time, Floyd's algorithm as written: a set, a loop."""
  rows = []
  for n, k, key in zip(num_items, num_segments, keys):
    gaps, cuts, chosen = int(n) - 1, int(k) - 1, set()
    for i in range(cuts):
      j = gaps - cuts + i
      t = int(row_random.below(row_random.bits(np.array([key], np.uint64), 2 * i + stream), j + 1)[0])
      chosen.add(j if t in chosen else t)
    rows.append(sorted(chosen))
  return rows


@pytest.mark.parametrize("stream", [0, 1])
def test_segmentations_are_floyds_algorithm_step_by_step(stream):
  rng = np.random.default_rng(stream)
  num_items = np.concatenate([rng.integers(1, 40, 300), rng.integers(80, 500, 100), [1, 2, 3, 3, 7]])
  num_segments = np.minimum(np.maximum(1, (num_items * rng.uniform(0.05, 1.0, len(num_items))).astype(int)),
                            num_items)
  keys = row_random.row_keys(17, np.arange(len(num_items)))
  bounds = objectives._random_segmentations(num_items, num_segments, keys, stream)
  for row, cuts in enumerate(_floyd_step_by_step(num_items, num_segments, keys, stream)):
    k = len(cuts)
    np.testing.assert_array_equal(bounds[row, 1:k + 1], np.array(cuts) + 1)
    assert bounds[row, 0] == 0 and (bounds[row, k + 1:] == num_items[row]).all()
    assert np.all(np.diff(bounds[row, :k + 2]) > 0)  # positive segment lengths


def test_span_corruption_batch_is_the_sentinel_functions_on_its_mask():
  lengths = np.repeat(LENGTHS, 20)
  windows = _windows(lengths, width=568)
  keys = row_random.row_keys(11, np.arange(len(lengths)))
  obj = objectives.SpanCorruption(512, 114, VOCAB_SIZE)
  inputs, targets, inputs_lengths, targets_lengths = obj.batch(windows, lengths, keys)
  assert inputs.shape == (len(lengths), 512) and targets.shape == (len(lengths), 114)
  assert inputs.dtype == targets.dtype == np.int32
  masks = objectives.random_spans_noise_masks(lengths, obj.noise_density, keys, obj.mean_noise_span_length, 568)
  for r, length in enumerate(lengths):
    window, mask = windows[r, :length], masks[r, :length]
    want_in = objectives.noise_span_to_unique_sentinel(window, mask, VOCAB_SIZE)
    want_tgt = objectives.nonnoise_span_to_unique_sentinel(window, mask, VOCAB_SIZE)
    assert inputs_lengths[r] == len(want_in) + 1 and targets_lengths[r] == len(want_tgt) + 1
    np.testing.assert_array_equal(inputs[r, :len(want_in)], want_in)
    np.testing.assert_array_equal(targets[r, :len(want_tgt)], want_tgt)
    assert inputs[r, len(want_in)] == targets[r, len(want_tgt)] == objectives.EOS_ID
    assert not inputs[r, len(want_in) + 1:].any() and not targets[r, len(want_tgt) + 1:].any()
    # Sentinels vocab_size-1, vocab_size-2, ... in order, the same ones on both sides.
    sentinels = inputs[r][inputs[r] >= VOCAB_SIZE - 100]
    np.testing.assert_array_equal(sentinels, VOCAB_SIZE - 1 - np.arange(len(sentinels)))
    np.testing.assert_array_equal(sentinels, targets[r][targets[r] >= VOCAB_SIZE - 100][:len(sentinels)])
    # Inputs and targets give back the window exactly.
    assert _unmask(inputs[r, :inputs_lengths[r]], targets[r, :targets_lengths[r]], VOCAB_SIZE) == window.tolist()
    if length == 568:
      assert inputs_lengths[r] == 512 and targets_lengths[r] == 114
      assert inputs[r, -1] == targets[r, -1] == objectives.EOS_ID


def test_span_corruption_batch_matches_one_example_per_call_in_distribution():
  """Span lengths and where the noise falls agree with the one-example objective, and the noise
  span lengths with the exact law of a uniformly random segmentation (T5's definition)."""
  rows, length = 4000, 568
  obj = objectives.SpanCorruption(512, 114, VOCAB_SIZE)
  masks = objectives.random_spans_noise_masks(np.full(rows, length), obj.noise_density,
                                              row_random.row_keys(0, np.arange(rows)))
  reference = np.stack([objectives.random_spans_noise_mask(length, 0.15, np.random.default_rng([0, i]))
                        for i in range(rows)])
  noise, spans, _ = _span_stats(reference[0])
  for value, top in ((True, 12), (False, 60)):
    ours = np.concatenate([_span_lengths(m, value) for m in masks])
    theirs = np.concatenate([_span_lengths(m, value) for m in reference])
    assert len(ours) == len(theirs) == rows * spans
    hist_ours = np.bincount(np.minimum(ours, top), minlength=top + 1)[1:] / len(ours)
    hist_theirs = np.bincount(np.minimum(theirs, top), minlength=top + 1)[1:] / len(theirs)
    assert np.abs(hist_ours - hist_theirs).max() < 0.01, value
  # A uniform split of n noise tokens into k spans: P(a span has l tokens) = C(n-l-1, k-2) / C(n-1, k-1).
  lengths = np.concatenate([_span_lengths(m) for m in masks])
  law = np.array([math.comb(noise - l - 1, spans - 2) / math.comb(noise - 1, spans - 1) for l in range(1, 11)])
  got = np.bincount(lengths, minlength=11)[1:11] / len(lengths)
  assert np.abs(got - law).max() < 0.006
  # Where the noise falls: never on the first token, then by position bins.
  assert not masks[:, 0].any() and not reference[:, 0].any()
  for part in np.array_split(np.arange(1, length), 8):
    assert masks[:, part].mean() == pytest.approx(reference[:, part].mean(), abs=0.01)
  for position in range(1, 8):
    assert masks[:, position].mean() == pytest.approx(reference[:, position].mean(), abs=0.03)


def test_every_mask_equally_likely():
  """12 tokens at density 0.5, mean span 2: 6 noise tokens in 3 spans, 6 clean ones in 3 spans:
  C(5, 2)^2 = 100 masks, each as likely (chi-square over 20000 draws)."""
  rows = 20_000
  masks = objectives.random_spans_noise_masks(np.full(rows, 12), 0.5, row_random.row_keys(5, np.arange(rows)), 2.0)
  codes = masks.astype(np.int64) @ (1 << np.arange(12))
  values, counts = np.unique(codes, return_counts=True)
  assert len(values) == 100
  expected = rows / 100
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  assert chi2 < 180  # 99 degrees of freedom: mean 99, sd 14


def test_prefix_lm_batch_splits():
  obj = objectives.PrefixLM(512, 114, VOCAB_SIZE)
  lengths = np.array([0, 1, 2, 3, 50, 113, 114, 300, 511, 600, 623, 624] * 50)
  windows = _windows(lengths, width=624)
  keys = row_random.row_keys(2, np.arange(len(lengths)))
  inputs, targets, inputs_lengths, targets_lengths = obj.batch(windows, lengths, keys)
  split = obj.split_points(lengths, keys)
  for r, length in enumerate(lengths):
    li, lt = inputs_lengths[r], targets_lengths[r]
    assert li == split[r] + 1 and lt == length - split[r] + 1 and li <= 512 and lt <= 114
    assert inputs[r, li - 1] == targets[r, lt - 1] == objectives.EOS_ID
    assert not inputs[r, li:].any() and not targets[r, lt:].any()
    np.testing.assert_array_equal(np.concatenate([inputs[r, :li - 1], targets[r, :lt - 1]]), windows[r, :length])
  # Where the one-example split is fixed, the same; where it draws, uniform over the same range.
  rng = np.random.default_rng(0)
  for length in (0, 1, 2, 3, 624):
    assert set(split[lengths == length]) == {obj.split_point(int(length), rng) for _ in range(200)}
  many = obj.split_points(np.full(20_000, 300), row_random.row_keys(9, np.arange(20_000)))
  reference = np.array([obj.split_point(300, np.random.default_rng([9, i])) for i in range(20_000)])
  assert many.min() == reference.min() == 187 and many.max() == reference.max() == 299
  assert np.abs(np.bincount(many - 187) / 20_000 - 1 / 113).max() < 0.004
  assert many.mean() == pytest.approx(243, abs=1.0) and reference.mean() == pytest.approx(243, abs=1.0)


@pytest.mark.parametrize("name", ["span_corruption", "prefix_lm"])
def test_a_row_depends_on_its_key_only(name):
  obj = objectives.make_objective(name, {"inputs": 512, "targets": 114}, VOCAB_SIZE)
  lengths = np.array([624, 568, 5, 300, 0, 1, 600, 568])
  windows = _windows(lengths, width=obj.raw_length)
  lengths = np.minimum(lengths, obj.raw_length)
  keys = row_random.row_keys(4, np.arange(len(lengths)))
  first = obj.batch(windows, lengths, keys)
  again = obj.batch(windows, lengths, keys)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  order = np.array([5, 2, 7, 0])
  part = obj.batch(windows[order], lengths[order], keys[order])
  for a, b in zip(first, part):
    np.testing.assert_array_equal(a[order], b)
  for r in range(len(lengths)):
    alone = obj.batch(windows[r:r + 1], lengths[r:r + 1], keys[r:r + 1])
    for a, b in zip(first, alone):
      np.testing.assert_array_equal(a[r], b[0])


def write_word_corpus(path, documents: int, max_words: int, users: int = 0) -> str:
  """A JSON-lines corpus of `documents` documents of 1..max_words random words (an "author" of
  `users` when given), for tests that need many documents of many lengths."""
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for i in range(documents):
      words = " ".join(f"word{w}" for w in rng.integers(0, 400, int(rng.integers(1, max_words))))
      f.write(json.dumps({"id": f"d{i}", **({"author": f"u{i % users}"} if users else {}),
                          "text": f"Message {i}: {words}"}) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def user_corpus(tmp_path_factory, shared_data):
  folder = tmp_path_factory.mktemp("batch_users")
  corpus = write_word_corpus(folder / "users.jsonl", 80, 700, users=9)
  return corpus, small_vocab_path(tmp_path_factory, shared_data), str(folder / "cache")


@pytest.mark.parametrize("objective", ["span_corruption", "prefix_lm"])
@pytest.mark.parametrize("unit,windows", [("document", None), ("document", 2), ("example", None), ("user", None)])
def test_source_rows_are_the_examples_of_their_index(user_corpus, objective, unit, windows):
  corpus, vocab_path, cache = user_corpus
  src = source_lib.make_source(corpus, vocab_path, objective=objective, privacy_unit=unit, cache_dir=cache,
                               split="all", user_field="author", max_windows_per_document=windows, progress=False)
  n = src.num_examples
  indices = np.random.default_rng(1).permutation(n)[:min(n, 12)]
  batch = src.get_batch(indices, seed=21, batch_size=16)
  again = src.get_batch(indices[::-1], seed=21, batch_size=16)
  ids = src.document_ids(indices, seed=21)
  vocab_size = src.objective.vocab_size
  positions = {src.store.ids[d]: d for d in range(src.store.num_documents)}
  for row, index in enumerate(indices):
    inputs, targets = src.example(int(index), seed=21)
    for key, tokens in (("encoder_input_tokens", inputs), ("decoder_target_tokens", targets)):
      np.testing.assert_array_equal(batch[key][row, :len(tokens)], tokens)
      assert not batch[key][row, len(tokens):].any()
      np.testing.assert_array_equal(again[key][len(indices) - 1 - row], batch[key][row])
    # The row's window is a contiguous piece of the document `document_ids` names.
    if objective == "span_corruption":
      window = _unmask(inputs, targets, vocab_size)
    else:
      window = inputs[:-1].tolist() + targets[:-1].tolist()
    doc = positions[ids[row]]
    tokens = np.asarray(src.store.document_tokens(doc)).tolist()
    assert len(window) == min(len(tokens), src.objective.raw_length) or unit == "example"
    assert any(tokens[s:s + len(window)] == window for s in range(len(tokens) - len(window) + 1))
    if unit == "user":
      assert int(ids[row][1:]) % 9 == int(index)


def test_store_windows_are_the_document_slices(tmp_path, user_corpus):
  """`DocumentStore.windows` (one gather a shard) holds what `document_tokens` slices give,
  on a one-shard and a two-shard store of the same documents."""
  from private_t5.data import store as store_lib  # pylint: disable=g-import-not-at-top
  from private_t5.data import store_beam  # pylint: disable=g-import-not-at-top
  corpus, vocab_path, _ = user_corpus
  lines = open(corpus).read().splitlines()
  for k in range(2):
    (tmp_path / f"part-{k}.jsonl").write_text("\n".join(lines[k * 40:(k + 1) * 40]) + "\n")
  pattern = str(tmp_path / "part-*")
  one = store_lib.build_store(pattern, vocab_path, cache_dir=str(tmp_path / "one"), progress=False)
  two, _ = store_beam.build_store_beam(pattern, vocab_path, cache_dir=str(tmp_path / "two"))
  assert one.num_shards == 1 and two.num_shards == 2
  rng = np.random.default_rng(3)
  docs = rng.integers(0, one.num_documents, 50)
  lengths = one.lengths()[docs]
  starts = (rng.random(50) * lengths).astype(np.int64)
  pieces = np.minimum(lengths - starts, rng.integers(0, 40, 50))
  for store in (one, two):
    got = store.windows(docs, starts, pieces, 40)
    assert got.shape == (50, 40) and got.dtype == np.int32
    for row, (d, s, n) in enumerate(zip(docs, starts, pieces)):
      np.testing.assert_array_equal(got[row, :n], store.document_tokens(int(d))[s:s + n])
      assert not got[row, n:].any()
  assert store.windows([], [], [], 8).shape == (0, 8)
  with pytest.raises(IndexError):
    one.windows([one.num_documents], [0], [1], 8)
