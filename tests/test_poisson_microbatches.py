"""The one microbatching path: a step's rows run as fixed-size microbatches through the
trainer's accumulate loop (an untruncated Poisson sample of any size, or a fixed batch larger
than the microbatch size).

The step's result must not depend on the microbatch size m (same sample, same noise key), for
both DP aggregators and the non-private mean, and equals the fused single-call step; the noise
is added once; adding or removing one example moves the pre-noise sum by at most C for any
sample size, including 0 and sizes that are not a multiple of m.
"""
import jax
import numpy as np
import pytest

from private_t5.models import config
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.mechanism import AGGREGATORS
from private_t5.dp.aggregator import MeanAggregator
from private_t5.dp import noise as noise_lib
from private_t5.train import optimizers
from private_t5.models import sharding
from private_t5.train.host_microbatches import (accumulate_microbatches, split_microbatches,
                                               train_step_microbatched, train_step_on_microbatches)
from private_t5.train.state import RunSeeds
from private_t5.train.trainer import Trainer, make_loss_fn

CONFIG = config.T5Config(vocab_size=256, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                         num_decoder_layers=1, dropout_rate=0.1)
CLIP = 0.05  # small enough that every example is clipped: the bound is tight
SIGMA = 1.5
EXPECTED = 6.0


def _examples(count=9, inputs=12, targets=6, seed=0):
  rng = np.random.default_rng(seed)
  tgt = rng.integers(3, CONFIG.vocab_size, (count, targets)).astype(np.int32)
  return rng.integers(3, CONFIG.vocab_size, (count, inputs)).astype(np.int32), tgt


def _batch(examples, indices, rows):
  """Examples `indices` in rows 0..n-1 of a batch of `rows` rows (the rest padding)."""
  enc_all, tgt_all = examples
  n = len(indices)
  enc = np.zeros((rows, enc_all.shape[1]), np.int32)
  tgt = np.zeros((rows, tgt_all.shape[1]), np.int32)
  enc[:n], tgt[:n] = enc_all[indices], tgt_all[indices]
  dec = np.zeros_like(tgt)
  dec[:, 1:] = tgt[:, :-1]
  weight = (np.arange(rows) < n).astype(np.float32)
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec, "decoder_target_tokens": tgt,
          "decoder_loss_weights": (tgt > 0).astype(np.float32), "example_weight": weight}


def _padded(n, m):
  return -(-n // m) * m


@pytest.fixture(scope="module", params=["vmap", "ghost"])
def trainer(request):
  aggregator = AGGREGATORS[request.param](make_loss_fn(CONFIG), NoisySum(CLIP, SIGMA, EXPECTED))
  mesh = sharding.create_mesh((1, 1), devices=jax.devices()[:1])
  return Trainer(CONFIG, aggregator, optimizers.adafactor(optimizers.constant_schedule(0.01)), mesh)


@pytest.fixture(scope="module")
def spread_trainer():
  """DP-ghost on a 4-device mesh, each example's values on its device of the `data` axis."""
  aggregator = AGGREGATORS["ghost"](make_loss_fn(CONFIG), NoisySum(CLIP, SIGMA, EXPECTED),
                                    spmd_axis_name=sharding.DATA_AXIS)
  mesh = sharding.create_mesh((4, 1), devices=jax.devices()[:4])
  return Trainer(CONFIG, aggregator, optimizers.adafactor(optimizers.constant_schedule(0.01)), mesh)


@pytest.fixture(scope="module")
def seeds():
  return RunSeeds.create(insecure_deterministic_seed=11)


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(jax.device_get(tree))])


def test_step_does_not_depend_on_microbatch_size(trainer, seeds):
  examples = _examples()
  sample = [0, 2, 3, 5, 8]  # n = 5: not a multiple of 2 or 4
  results = {}
  for m in (2, 8):  # 3 microbatches (the last one part padding) against one
    state = trainer.init_state(seeds.init_key)
    state, metrics = train_step_microbatched(trainer, state, _batch(examples, sample, _padded(5, m)), m,
                                             seeds.dropout_base_key, seeds.noise_base_key)
    assert int(state.step) == 1 and float(metrics["nondp/batch_size"]) == 5.0
    results[m] = (_flat(state.params), {k: float(v) for k, v in jax.device_get(metrics).items()})
  # The fixed-batch step on the same 5 rows padded to 8 is the same computation.
  state = trainer.init_state(seeds.init_key)
  state, metrics = trainer.train_step(state, _batch(examples, sample, 8), seeds.dropout_base_key,
                                      seeds.noise_base_key)
  results["fixed"] = (_flat(state.params), {k: float(v) for k, v in jax.device_get(metrics).items()})
  ref_params, ref_metrics = results[8]
  for key, (params, metrics) in results.items():
    np.testing.assert_allclose(params, ref_params, rtol=1e-5, atol=1e-6, err_msg=str(key))
    for name in ("nondp/loss", "nondp/batch_size", "nondp/grad_norm_mean", "nondp/fraction_clipped"):
      assert metrics[name] == pytest.approx(ref_metrics[name], rel=1e-5, abs=1e-6), (key, name)


def test_accumulated_sum_does_not_depend_on_m_and_noise_is_added_once(trainer, seeds):
  examples = _examples()
  state = trainer.init_state(seeds.init_key)
  sample = list(range(7))
  sums = {m: accumulate_microbatches(trainer, state.params, _batch(examples, sample, _padded(7, m)), m,
                                     seeds.dropout_base_key, state.step) for m in (2, 3, 7)}
  for m in (2, 3):
    np.testing.assert_allclose(_flat(sums[m][0]), _flat(sums[7][0]), rtol=1e-5, atol=1e-7)
  # An empty sample: no microbatch runs; the step still adds the noise (once) and updates.
  empty = accumulate_microbatches(trainer, state.params, _batch(examples, [], 0), 2, seeds.dropout_base_key,
                                  state.step)
  assert not np.any(_flat(empty[0]))
  grads_std = []
  for m in (2, 7):  # the finalized (noisy) step differs from the noiseless sum by sigma C noise once
    acc = accumulate_microbatches(trainer, state.params, _batch(examples, sample, _padded(7, m)), m,
                                  seeds.dropout_base_key, state.step)
    noise_rng = jax.random.fold_in(seeds.noise_base_key, 0)
    grads, _ = trainer.aggregator.finish(state.params, acc)
    grads = noise_lib.apply(trainer.noise, grads, {}, state.params, noise_rng)
    noise = _flat(grads) * EXPECTED - _flat(acc[0])
    grads_std.append(np.std(noise))
  assert grads_std[0] == pytest.approx(SIGMA * CLIP, rel=0.05)
  assert grads_std[0] == pytest.approx(grads_std[1], rel=1e-4)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5])
def test_adding_or_removing_one_example_moves_the_sum_by_at_most_c(trainer, seeds, n):
  examples = _examples()
  m = 2
  state = trainer.init_state(seeds.init_key)
  base = list(range(n))
  grown = base + [8]  # one more example (the neighbour with n + 1)

  def clipped_sum(indices):
    acc = accumulate_microbatches(trainer, state.params, _batch(examples, indices, _padded(len(indices), m)), m,
                                  seeds.dropout_base_key, state.step)
    return _flat(acc[0])

  moved = np.linalg.norm(clipped_sum(grown) - clipped_sum(base))
  assert moved <= CLIP * (1 + 1e-4)
  assert moved >= 0.5 * CLIP  # the added example is clipped to exactly C: the bound is tight


def test_a_non_private_fixed_batch_in_microbatches_equals_the_fused_step(seeds):
  """A fixed batch larger than m runs through the same accumulate loop: the weighted mean of the
  non-private aggregator (with per-row dropout keys) does not depend on m."""
  aggregator = MeanAggregator(make_loss_fn(CONFIG), per_example_dropout_keys=True)
  mesh = sharding.create_mesh((1, 1), devices=jax.devices()[:1])
  trainer = Trainer(CONFIG, aggregator, optimizers.adafactor(optimizers.constant_schedule(0.01)), mesh)
  batch = _batch(_examples(), [1, 4, 0, 7, 2, 6], 8)
  state = trainer.init_state(seeds.init_key)
  fused, fused_metrics = trainer.train_step(state, batch, seeds.dropout_base_key, seeds.noise_base_key)
  for m in (2, 4):
    state = trainer.init_state(seeds.init_key)
    host = train_step_microbatched(trainer, state, batch, m, seeds.dropout_base_key, seeds.noise_base_key)
    micro, metrics = host
    np.testing.assert_allclose(_flat(micro.params), _flat(fused.params), rtol=1e-5, atol=1e-7, err_msg=str(m))
    for name in ("nondp/loss", "nondp/batch_size"):
      assert float(metrics[name]) == pytest.approx(float(fused_metrics[name]), rel=1e-5), (m, name)
  # One dispatch (the loop's path) equals the host-dispatched microbatches.
  _same_step(_stacked_step(trainer, trainer.init_state(seeds.init_key), batch, 4, seeds, 4), host, exact=False)


class _ExamplesSource:
  """get_batch of the trainer contract over `_examples()` (the stand-in corpus)."""

  def __init__(self, examples):
    self.examples = examples

  def get_batch(self, indices, seed, batch_size):
    del seed
    batch = _batch(self.examples, np.asarray(indices, np.int64), batch_size)
    batch["example_index"] = np.full((batch_size,), -1, np.int64)
    batch["example_index"][:len(indices)] = indices
    batch["is_padding"] = batch["example_weight"] == 0
    return batch


def test_microbatched_step_equals_the_spread_whole_batch_step(spread_trainer, seeds):
  """One process in microbatches of m < batch (sample order) and the multi-process layout (the
  sample spread over the `data` axis, `loop.local_batch`) compute the same step: every example
  keeps its dropout key (its position in the sample), the noise is the step's. (Ghost clipping:
  the layout does not depend on the method; vmap's sums equal ghost's, tests/test_ghost.py.)"""
  from private_t5.train import loop
  trainer = spread_trainer
  source = _ExamplesSource(_examples())
  sample = np.array([8, 0, 5, 3, 2, 6], np.int64)  # 6 rows: 2 microbatches of 4, or spread over 4 x 4
  state = trainer.init_state(seeds.init_key)
  micro, micro_metrics = train_step_microbatched(trainer, state, source.get_batch(sample, 0, 8), 4,
                                                 seeds.dropout_base_key, seeds.noise_base_key)
  state = trainer.init_state(seeds.init_key)
  spread = loop.local_batch(source, sample, 0, 16, 4, range(16))
  assert spread["example_index"].tolist()[:4] == [8, 2, -1, -1]  # not the sample's order
  whole, whole_metrics = trainer.train_step(state, spread, seeds.dropout_base_key, seeds.noise_base_key)
  np.testing.assert_allclose(_flat(whole.params), _flat(micro.params), rtol=1e-5, atol=1e-7)
  for name in ("nondp/loss", "nondp/batch_size", "nondp/grad_norm_mean", "nondp/fraction_clipped"):
    assert float(whole_metrics[name]) == pytest.approx(float(micro_metrics[name]), rel=1e-5), name


def test_every_donated_buffer_is_used(seeds):
  """The compiled steps donate only buffers an output can reuse: compiling them warns of none.
  (The host-dispatched step runs through `Trainer.train_step_microbatched`, its deprecated alias.)"""
  import warnings  # pylint: disable=g-import-not-at-top
  aggregator = AGGREGATORS["vmap"](make_loss_fn(CONFIG), NoisySum(CLIP, SIGMA, EXPECTED))
  mesh = sharding.create_mesh((1, 1), devices=jax.devices()[:1])
  trainer = Trainer(CONFIG, aggregator, optimizers.adafactor(optimizers.constant_schedule(0.01)), mesh)
  examples = _examples()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = trainer.init_state(seeds.init_key)
    state, _ = trainer.train_step_microbatched(state, _batch(examples, [0, 1, 2], 4), 2, seeds.dropout_base_key,
                                               seeds.noise_base_key)
    state, _ = trainer.train_step(state, _batch(examples, [3, 4], 4), seeds.dropout_base_key, seeds.noise_base_key)
    jax.block_until_ready(state)
  assert not [str(w.message) for w in caught if "donated" in str(w.message)]
  assert [w for w in caught if issubclass(w.category, DeprecationWarning) and "host_microbatches" in str(w.message)]


def _stacked_step(trainer, state, batch, m, seeds, bucket=None):
  """`Trainer.train_step_stacked` on `batch`'s microbatches of m rows (one padding microbatch
  and count 0 for an empty batch)."""
  micro = split_microbatches(batch, m)
  stack = micro or split_microbatches(_batch(_examples(), [], m), m)
  placed = trainer.place_stacked(stack, bucket)
  return trainer.train_step_stacked(state, placed, len(micro), seeds.dropout_base_key, seeds.noise_base_key)


def _same_step(a, b, exact: bool):
  (state_a, metrics_a), (state_b, metrics_b) = a, b
  if exact:  # the same functions summed in the same order: the same bits
    np.testing.assert_array_equal(_flat(state_a.params), _flat(state_b.params))
    np.testing.assert_array_equal(_flat(state_a.opt_state), _flat(state_b.opt_state))
  else:
    np.testing.assert_allclose(_flat(state_a.params), _flat(state_b.params), rtol=1e-5, atol=1e-7)
  assert int(state_a.step) == int(state_b.step)
  assert sorted(metrics_a) == sorted(metrics_b)
  for name in metrics_a:
    assert float(metrics_a[name]) == pytest.approx(float(metrics_b[name]), rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("sample, bucket", [([0, 2, 3, 5, 8], None), ([], None)])
def test_one_dispatch_step_equals_the_host_dispatched_microbatches(trainer, seeds, sample, bucket):
  """The step's microbatches accumulated inside one compiled call (stacked, padded to a bucket of
  microbatches that are never computed, an empty sample included) give the step the microbatches
  dispatched one by one from the host give: same clipping, same single noise draw, same update,
  bit for bit on this backend (the same order of summation)."""
  m = 2
  batch = _batch(_examples(), sample, _padded(len(sample), m))
  host = train_step_microbatched(trainer, trainer.init_state(seeds.init_key), batch, m, seeds.dropout_base_key,
                                 seeds.noise_base_key)
  one = _stacked_step(trainer, trainer.init_state(seeds.init_key), batch, m, seeds, bucket)
  _same_step(one, host, exact=jax.default_backend() == "cpu")
  # A second step from there: the keys follow the state's step.
  host2 = train_step_microbatched(trainer, host[0], batch, m, seeds.dropout_base_key, seeds.noise_base_key)
  one2 = _stacked_step(trainer, one[0], batch, m, seeds, bucket)
  _same_step(one2, host2, exact=jax.default_backend() == "cpu")


def test_one_dispatch_spread_step_equals_the_host_dispatched_one(spread_trainer, seeds):
  """A 4-device mesh whose microbatches' rows are spread over the `data` axis (`loop.local_batch`,
  as several processes build them): one dispatch equals the host-dispatched microbatches. (The
  non-private mean's: the fixed-batch test above.)"""
  from private_t5.train import loop  # pylint: disable=g-import-not-at-top
  spread = spread_trainer
  source = _ExamplesSource(_examples())
  sample = np.array([8, 0, 5, 3, 2, 6, 1, 4, 7], np.int64)  # 9 rows: 3 microbatches of 4 rows (1 per device)
  micro = [loop.local_batch(source, sample[s:s + 4], 0, 4, 4, range(4), row_offset=s) for s in range(0, 12, 4)]
  host = train_step_on_microbatches(spread, spread.init_state(seeds.init_key), micro, seeds.dropout_base_key,
                                    seeds.noise_base_key)
  one = spread.train_step_stacked(spread.init_state(seeds.init_key), spread.place_stacked(micro, 4), 3,
                                  seeds.dropout_base_key, seeds.noise_base_key)
  _same_step(one, host, exact=False)
