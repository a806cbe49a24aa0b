"""Property tests of the gradient aggregators on a tiny T5 fed with real text (fortunes).

Compiling a per-example-gradient step of even a tiny T5 takes seconds on CPU, so the jitted
functions are built once per module and shared: `clipped_sum` (no noise) whole and in microbatches
of 2 rows, the full DP call (noise on), the mean aggregator, one sharded step,
and a single-example gradient for the explicit Python-loop reference.
"""
import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import sentencepiece as spm

from private_t5.dp.privacy_params import NoisySum
from private_t5.dp import aggregator as agg_lib
from private_t5.dp import clipping
from private_t5.dp import noise as noise_lib
from private_t5.dp.aggregator import DPAggregator, MeanAggregator
from private_t5.errors import PrivacyError
from private_t5.models.model import example_loss_fn
from private_t5.models.network import init_params
from private_t5.models.config import load_preset
from private_t5.tokenizer.spm import train_from_sentences
from private_t5.train.host_microbatches import split_microbatches

VOCAB_PIECES = 256
MODEL_VOCAB = 384  # 256 pieces + 100 sentinels, padded to a multiple of 128
INPUT_LENGTH, TARGET_LENGTH = 32, 8
BATCH = 8
CLIP = 1.0
SIGMA = 2.0
EXPECTED_BATCH = 5.0  # public q N; deliberately != the realised number of rows


# ---------------------------------------------------------------------------------------------
# Real-text fixtures: a SentencePiece vocabulary and prefix-LM examples from fortunes.


def _fortunes(shared_data, limit):
  path = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  out = []
  with gzip.open(path, "rt", encoding="utf-8") as f:
    for line in f:
      out.append(json.loads(line)["text"])
      if len(out) >= limit:
        break
  return out


@pytest.fixture(scope="module")
def examples(shared_data, tmp_path_factory):
  """64 examples: the first half of a fortune's tokens as input, the next ones as targets."""
  texts = _fortunes(shared_data, 1500)
  model_path = str(tmp_path_factory.mktemp("vocab") / "fortunes.model")
  train_from_sentences(texts, model_path, vocab_size=VOCAB_PIECES)
  sp = spm.SentencePieceProcessor(model_file=model_path)
  rows = []
  for text in texts[::5]:
    ids = sp.encode(text)
    if len(ids) < 12:
      continue
    cut = min(len(ids) // 2, INPUT_LENGTH - 1)
    inputs = ids[:cut] + [1]
    targets = ids[cut:cut + TARGET_LENGTH - 1] + [1]
    enc = np.zeros(INPUT_LENGTH, np.int32)
    enc[:len(inputs)] = inputs
    tgt = np.zeros(TARGET_LENGTH, np.int32)
    tgt[:len(targets)] = targets
    rows.append((enc, tgt))
    if len(rows) == 64:
      break
  assert len(rows) == 64
  return rows


def make_batch(examples, indices, batch_size=BATCH):
  """A padded batch in the trainer's layout; rows past len(indices) are padding."""
  enc = np.zeros((batch_size, INPUT_LENGTH), np.int32)
  tgt = np.zeros((batch_size, TARGET_LENGTH), np.int32)
  weight = np.zeros(batch_size, np.float32)
  index = np.full(batch_size, -1, np.int64)
  for row, i in enumerate(indices):
    enc[row], tgt[row] = examples[i]
    weight[row] = 1.0
    index[row] = i
  dec_in = np.zeros_like(tgt)
  dec_in[:, 1:] = tgt[:, :-1]
  return {
      "encoder_input_tokens": enc,
      "decoder_input_tokens": dec_in,
      "decoder_target_tokens": tgt,
      "decoder_loss_weights": (tgt > 0).astype(np.float32),
      "example_weight": weight,
      "is_padding": weight == 0,
      "example_index": index,
  }


@pytest.fixture(scope="module")
def config():
  # The tiny v1.0 preset with one layer each side: compile time dominates these tests.
  return load_preset("t5_1_0_tiny", vocab_size=MODEL_VOCAB, dropout_rate=0.1,
                     num_encoder_layers=1, num_decoder_layers=1)


@pytest.fixture(scope="module")
def params(config):
  return init_params(config, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def loss_fn(config):
  def fn(p, batch, dropout_rng):
    return example_loss_fn(p, batch, config, dropout_rng=dropout_rng)
  return fn


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def assert_tree_close(a, b, rtol=2e-4, atol=1e-6):
  fa, fb = flat(a), flat(b)
  err = np.linalg.norm(fa - fb)
  assert err <= rtol * np.linalg.norm(fb) + atol, f"||a - b|| = {err}, ||b|| = {np.linalg.norm(fb)}"


# ---------------------------------------------------------------------------------------------
# Shared compiled functions.


@pytest.fixture(scope="module")
def single_grad(loss_fn):
  """The reference: gradient of ONE example's loss, called in a Python loop."""
  @jax.jit
  def grad_one(p, example, key):
    return jax.value_and_grad(lambda q: loss_fn(q, example, key)[0])(p)
  return grad_one


def loop_grads(single_grad, params, batch, dropout_rng):
  """Per-example (loss, grad) by an explicit loop, dropout key fold_in(rng, row)."""
  out = []
  for row in range(batch["example_weight"].shape[0]):
    example = {k: v[row:row + 1] for k, v in batch.items()}
    out.append(single_grad(params, example, jax.random.fold_in(dropout_rng, row)))
  return out


def reference_clipped_sum(grads, weights, clip):
  """sum_i w_i min(1, C/||g_i||) g_i in float64, with the norms."""
  total, norms = 0.0, []
  for (_, g), w in zip(grads, weights):
    if w == 0:
      norms.append(0.0)
      continue
    v = flat(g)
    n = np.linalg.norm(v)
    norms.append(n)
    total = total + w * min(1.0, clip / n) * v
  return total, np.array(norms)


def accumulate_microbatches(aggregator, params, batch, microbatch_size, dropout_rng):
  """The accumulator of `batch` run as microbatches of `microbatch_size` rows through
  `zero_sum` / `accumulate`, as `train.host_microbatches.accumulate_microbatches` does."""
  accumulate = jax.jit(aggregator.accumulate)
  acc = aggregator.zero_sum(params)
  for micro in split_microbatches({k: np.asarray(v) for k, v in batch.items()}, microbatch_size):
    acc = accumulate(params, acc, micro, dropout_rng)
  return acc


@pytest.fixture(scope="module")
def dp_aggregator(loss_fn):
  """A noiseless DP aggregator."""
  return DPAggregator(loss_fn, NoisySum(CLIP, 0.0, EXPECTED_BATCH))


@pytest.fixture(scope="module")
def clipped_sum_fns(dp_aggregator):
  """microbatch_size -> noiseless `clipped_sum(params, batch, dropout_rng)`: None, one jitted
  call on the whole batch; 2, microbatches of 2 rows through `accumulate`."""

  def in_microbatches(params, batch, dropout_rng):
    grad_sum, sums = accumulate_microbatches(dp_aggregator, params, batch, 2, dropout_rng)
    return grad_sum, clipping.metrics_from_sums(**sums)

  return {None: jax.jit(dp_aggregator.clipped_sum), 2: in_microbatches}


@pytest.fixture(scope="module")
def dp_step(loss_fn):
  """The full DP step's release: the clipped sum, then the noise transform (noise on)."""
  aggregator = DPAggregator(loss_fn, NoisySum(CLIP, SIGMA, EXPECTED_BATCH))
  return jax.jit(lambda p, b, d, n: noise_lib.privatize(aggregator, p, b, dropout_rng=d, noise_rng=n))


@pytest.fixture(scope="module")
def mean_step(loss_fn):
  """The non-private mean with DPAggregator's per-row dropout keys."""
  aggregator = MeanAggregator(loss_fn, per_example_dropout_keys=True)
  return jax.jit(lambda p, b, d: aggregator(p, b, dropout_rng=d))


def test_batched_mean_equals_per_example_mean_without_dropout(params, batch, loss_fn, mean_step):
  """The fast batched non-DP path is the same weighted mean (dropout masks aside), in one call
  or in microbatches of 4 rows."""
  per_example, m1 = mean_step(params, batch, None)
  batched = MeanAggregator(loss_fn)
  whole = jax.jit(lambda p, b: batched(p, b))(params, batch)
  micro = batched.finish(params, accumulate_microbatches(batched, params, batch, 4, None))
  for grads, m2 in (whole, micro):
    np.testing.assert_allclose(flat(grads), flat(per_example), rtol=2e-4, atol=1e-6)
    for k in m1:
      np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5)
  # Padding rows (zero weight, real tokens) contribute nothing on the batched path either.
  noisy = {k: np.array(v) for k, v in batch.items()}
  noisy["example_weight"][:] = 0.0
  noisy["example_weight"][:2] = 1.0
  clean = {k: v[:2] for k, v in noisy.items()}
  g_noisy, _ = jax.jit(lambda p, b: MeanAggregator(loss_fn)(p, b))(params, noisy)
  g_clean, _ = jax.jit(lambda p, b: MeanAggregator(loss_fn)(p, b))(params, clean)
  np.testing.assert_allclose(flat(g_noisy), flat(g_clean), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def batch(examples):
  return make_batch(examples, [3, 11, 17, 25, 33, 41])  # 6 real rows + 2 padding rows


DROPOUT_KEY = jax.random.PRNGKey(42)


# ---------------------------------------------------------------------------------------------
# Tests.


@pytest.mark.slow
def test_vmap_per_example_grads_equal_python_loop(params, batch, single_grad, clipped_sum_fns):
  reference = loop_grads(single_grad, params, batch, DROPOUT_KEY)
  weights = batch["example_weight"]
  ref_sum, ref_norms = reference_clipped_sum(reference, weights, CLIP)
  real = weights > 0
  assert (ref_norms[real] > CLIP).any() and np.isfinite(ref_norms).all()
  fn = clipped_sum_fns[None]
  summed, metrics = fn(params, batch, DROPOUT_KEY)
  np.testing.assert_allclose(flat(summed), ref_sum, rtol=2e-4, atol=2e-6)
  np.testing.assert_allclose(float(metrics[clipping.METRIC_GRAD_NORM]), ref_norms[real].mean(),
                             rtol=1e-4)
  np.testing.assert_allclose(float(metrics[clipping.METRIC_FRACTION_CLIPPED]),
                             (ref_norms[real] > CLIP).mean())
  assert float(metrics[clipping.METRIC_BATCH_SIZE]) == real.sum()
  ref_loss = np.mean([float(l) for (l, _), w in zip(reference, weights) if w > 0])
  np.testing.assert_allclose(float(metrics[clipping.METRIC_LOSS]), ref_loss, rtol=1e-5)
  # Each example on its own (one-hot weights): the vmapped gradient of row i is the loop's,
  # clipped; its norm before clipping is reported exactly.
  for row in np.flatnonzero(real)[:3]:
    one_hot = dict(batch, example_weight=np.eye(BATCH, dtype=np.float32)[row])
    summed, metrics = fn(params, one_hot, DROPOUT_KEY)
    g = flat(reference[row][1])
    np.testing.assert_allclose(flat(summed), g * min(1.0, CLIP / np.linalg.norm(g)),
                               rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(float(metrics[clipping.METRIC_GRAD_NORM]), np.linalg.norm(g),
                               rtol=1e-4)


@pytest.mark.slow
def test_microbatch_size_does_not_change_result(params, batch, clipped_sum_fns):
  full, full_metrics = clipped_sum_fns[None](params, batch, DROPOUT_KEY)
  micro, micro_metrics = clipped_sum_fns[2](params, batch, DROPOUT_KEY)
  assert_tree_close(micro, full, rtol=1e-5)
  for name in full_metrics:
    np.testing.assert_allclose(float(micro_metrics[name]), float(full_metrics[name]), rtol=1e-5)


def _scaled(params, factor):
  """Params with the decoder's final norm scaled: logits, hence gradients, grow with it."""
  out = jax.tree.map(lambda x: x, params)
  out["decoder"] = dict(out["decoder"])
  out["decoder"]["decoder_norm"] = {"scale": params["decoder"]["decoder_norm"]["scale"] * factor}
  return out


@pytest.mark.slow
def test_sensitivity_removing_one_example_moves_sum_by_at_most_c(params, examples,
                                                                 clipped_sum_fns):
  """Neighbouring batches (one example removed = its row turned into padding) differ by <= C."""
  fn = clipped_sum_fns[None]
  rng = np.random.default_rng(7)
  max_change, saw_small, saw_huge = 0.0, False, False
  for trial, factor in enumerate([0.001, 1.0, 1e3, 1e6]):
    scaled = _scaled(params, factor)
    for _ in range(2):
      n_real = int(rng.integers(2, BATCH + 1))
      batch = make_batch(examples, rng.choice(len(examples), n_real, replace=False))
      key = jax.random.PRNGKey(100 + trial)
      full, metrics = fn(scaled, batch, key)
      full = flat(full)
      mean_norm = float(metrics[clipping.METRIC_GRAD_NORM])
      saw_small |= mean_norm < CLIP
      saw_huge |= mean_norm > 1e3 * CLIP
      for row in range(n_real):
        neighbour = dict(batch, example_weight=batch["example_weight"].copy())
        neighbour["example_weight"][row] = 0.0
        change = np.linalg.norm(full - flat(fn(scaled, neighbour, key)[0]))
        assert change <= CLIP * (1 + 1e-5), (factor, row, change)
        max_change = max(max_change, change)
  assert saw_small and saw_huge  # the property was exercised on both sides of C
  assert max_change > 0.99 * CLIP  # and the bound is tight for clipped examples


@pytest.mark.slow
def test_padding_rows_contribute_exactly_zero(params, examples, clipped_sum_fns, mean_step):
  real = [5, 9, 13]
  clean = make_batch(examples, real)
  # Padding rows filled with real tokens and loss weights: only example_weight marks them.
  noisy = make_batch(examples, real + [20, 21, 22, 23, 24])
  noisy["example_weight"][len(real):] = 0.0
  noisy["is_padding"] = noisy["example_weight"] == 0
  fn = clipped_sum_fns[None]
  a, metrics_a = fn(params, clean, DROPOUT_KEY)
  b, metrics_b = fn(params, noisy, DROPOUT_KEY)
  np.testing.assert_array_equal(flat(a), flat(b))
  for name in metrics_a:
    np.testing.assert_array_equal(np.asarray(metrics_a[name]), np.asarray(metrics_b[name]))
  assert float(metrics_b[clipping.METRIC_BATCH_SIZE]) == len(real)
  # The non-private mean ignores padding as well.
  m_a, _ = mean_step(params, clean, DROPOUT_KEY)
  m_b, _ = mean_step(params, noisy, DROPOUT_KEY)
  np.testing.assert_array_equal(flat(m_a), flat(m_b))


@pytest.mark.slow
def test_mean_aggregator_is_weighted_mean_of_loop_grads(params, batch, single_grad, mean_step):
  reference = loop_grads(single_grad, params, batch, DROPOUT_KEY)
  weights = batch["example_weight"]
  expected = sum(w * flat(g) for (_, g), w in zip(reference, weights)) / weights.sum()
  grads, metrics = mean_step(params, batch, DROPOUT_KEY)
  np.testing.assert_allclose(flat(grads), expected, rtol=2e-4, atol=1e-6)
  expected_loss = sum(w * float(l) for (l, _), w in zip(reference, weights)) / weights.sum()
  np.testing.assert_allclose(float(metrics[clipping.METRIC_LOSS]), expected_loss, rtol=1e-5)
  assert float(metrics[clipping.METRIC_BATCH_SIZE]) == weights.sum()


@pytest.mark.slow
def test_noise_is_gaussian_on_the_sum_divided_by_public_batch_size(params, batch, dp_step,
                                                                   clipped_sum_fns):
  noise_key = jax.random.PRNGKey(2024)  # deterministic test seed
  grads, metrics = dp_step(params, batch, DROPOUT_KEY, noise_key)
  clean, _ = clipped_sum_fns[None](params, batch, DROPOUT_KEY)
  # grads = (clipped sum + N(0, sigma^2 C^2)) / qN, with qN = 5 while 6 rows are real.
  assert float(metrics[clipping.METRIC_BATCH_SIZE]) == 6.0 != EXPECTED_BATCH
  noise = flat(grads) * EXPECTED_BATCH - flat(clean)
  n = noise.size
  std = SIGMA * CLIP
  # Sample std of n normals: relative standard error 1/sqrt(2n); allow 6 of them.
  assert abs(noise.std() / std - 1) < 6 / np.sqrt(2 * n), (noise.std(), std, n)
  assert abs(noise.mean()) < 6 * std / np.sqrt(n)
  assert scipy.stats.kstest(noise[:20000] / std, "norm").pvalue > 1e-4
  # The noise is exactly sigma*C times the documented draw from the step's key.
  leaves = jax.tree.leaves(clean)
  expected = np.concatenate([np.ravel(x) for x in noise_lib.gaussian_like(noise_key, leaves)])
  np.testing.assert_allclose(noise, std * expected, rtol=1e-3, atol=1e-3 * std)
  # Same key: same noise; another key: independent noise.
  again, _ = dp_step(params, batch, DROPOUT_KEY, noise_key)
  np.testing.assert_array_equal(flat(again), flat(grads))
  other, _ = dp_step(params, batch, DROPOUT_KEY, jax.random.PRNGKey(2025))
  other_noise = flat(other) * EXPECTED_BATCH - flat(clean)
  assert abs(np.corrcoef(noise, other_noise)[0, 1]) < 6 / np.sqrt(n)


def test_noise_leaves_are_independent():
  leaves = [jnp.zeros((64, 32)), jnp.zeros((64, 32)), jnp.zeros((7,))]
  draws = noise_lib.gaussian_like(jax.random.PRNGKey(0), leaves)
  assert [d.shape for d in draws] == [(64, 32), (64, 32), (7,)]
  a, b = np.ravel(draws[0]), np.ravel(draws[1])
  assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(a.size)


def test_nonfinite_example_gradient_is_dropped_not_propagated():
  """A NaN/inf gradient would make every coordinate NaN and break the bound of C."""
  def loss_fn(p, batch, key):
    del key
    return jnp.sum((batch["x"] @ p["w"]) ** 2, axis=-1)

  p = {"w": jnp.ones((3, 2))}
  x = np.array([[1, 0, 0], [np.inf, 0, 0], [0, 1, 0], [0, 0, 0]], np.float32)
  batch = {"x": x, "example_weight": np.array([1, 1, 1, 0], np.float32)}
  aggregator = DPAggregator(loss_fn, NoisySum(1.0, 0.0, 3.0))
  summed, _ = jax.jit(aggregator.clipped_sum)(p, batch)
  assert np.isfinite(flat(summed)).all()
  without_inf = dict(batch, example_weight=np.array([1, 0, 1, 0], np.float32))
  np.testing.assert_allclose(flat(summed), flat(jax.jit(aggregator.clipped_sum)(p, without_inf)[0]))


@pytest.mark.slow
def test_sharded_step_equals_single_device(params, batch, loss_fn, dp_step):
  devices = jax.devices()
  assert len(devices) == 8, "tests/conftest.py provides 8 CPU devices"
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sharded_aggregator = DPAggregator(loss_fn, NoisySum(CLIP, SIGMA, EXPECTED_BATCH), spmd_axis_name="data")
  noise_key = jax.random.PRNGKey(7)
  with jax.set_mesh(mesh):
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sharded_batch = jax.device_put(batch, data)
    sharded_params = jax.device_put(params, replicated)
    step = jax.jit(lambda p, b, d, n: noise_lib.privatize(sharded_aggregator, p, b, dropout_rng=d, noise_rng=n))
    grads, metrics = step(sharded_params, sharded_batch, DROPOUT_KEY, noise_key)
    assert len(sharded_batch["encoder_input_tokens"].sharding.device_set) == 8
  reference, ref_metrics = dp_step(params, batch, DROPOUT_KEY, noise_key)
  assert_tree_close(grads, reference, rtol=1e-5)
  for name in ref_metrics:
    np.testing.assert_allclose(float(metrics[name]), float(ref_metrics[name]), rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip_norm=0.0), "clip_norm"),
    (dict(clip_norm=-1.0), "clip_norm"),
    (dict(clip_norm=float("nan")), "clip_norm"),
    (dict(clip_norm=float("inf")), "clip_norm"),
    (dict(noise_multiplier=-0.1), "noise_multiplier"),
    (dict(noise_multiplier=float("nan")), "noise_multiplier"),
    (dict(expected_batch_size=0.0), "expected_batch_size"),
    (dict(expected_batch_size=-4.0), "expected_batch_size"),
])
def test_bad_privacy_parameters_raise_before_any_compute(kwargs, match):
  calls = []

  def loss_fn(p, b, k):
    calls.append(1)
    return jnp.zeros(1)

  args = dict(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, **{})
  args.update(kwargs)
  with pytest.raises(PrivacyError, match=match):
    DPAggregator(loss_fn, NoisySum(**args))
  assert not calls


def test_noise_needs_a_key():
  def loss_fn(p, batch, key):
    del key
    return jnp.sum(batch["x"] * p["w"], axis=-1)

  aggregator = DPAggregator(loss_fn, NoisySum(1.0, 1.0, 2.0))
  batch = {"x": np.ones((2, 3), np.float32), "example_weight": np.ones(2, np.float32)}
  with pytest.raises(PrivacyError, match="noise_rng"):
    noise_lib.privatize(aggregator, {"w": jnp.ones(3)}, batch, noise_rng=None)
