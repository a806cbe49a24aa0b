"""Each step's batch built ahead by worker threads (`train.step_data`): the same batches as built in
line for the same (seed, step), in any order and with any number of workers; a worker's failure is
one DataError naming the step, never a hang; the stacked step's bucket of microbatches."""
import threading
import time

import jax
import numpy as np
import pytest

from private_t5.models import config
from private_t5.dp import clipping
from private_t5.dp.aggregator import MeanAggregator
from private_t5.dp.config import BatchLayout
from private_t5.dp.sampling import PoissonSampler
from private_t5.errors import DataError
from private_t5.train import optimizers, step_data
from private_t5.models import sharding
from private_t5.train.state import RunSeeds
from private_t5.train.trainer import Trainer, make_loss_fn, microbatch_bucket

CONFIG = config.T5Config(vocab_size=128, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                         num_decoder_layers=1)


class _Source:
  """A stand-in corpus whose rows are a pure function of (index, seed), like `CorpusSource`."""

  num_examples = 64

  def __init__(self, fail_at_seed=None):
    self.fail_at_seed = fail_at_seed

  def get_batch(self, indices, seed, batch_size):
    if seed == self.fail_at_seed:
      raise ValueError("mmap length is greater than file size")
    time.sleep(0.001 * (seed % 3))  # workers finish out of order
    indices = np.asarray(indices, np.int64)
    rows = np.zeros((batch_size, 6), np.int32)
    rows[:len(indices)] = (indices[:, None] * 7 + seed + np.arange(6)) % 100 + 3
    weight = (np.arange(batch_size) < len(indices)).astype(np.float32)
    index = np.full((batch_size,), -1, np.int64)
    index[:len(indices)] = indices
    return {"encoder_input_tokens": rows, "decoder_input_tokens": rows[:, :4], "decoder_target_tokens": rows[:, 1:5],
            "decoder_loss_weights": np.ones((batch_size, 4), np.float32) * weight[:, None],
            "example_weight": weight, "is_padding": weight == 0, "example_index": index}


class _Privacy:
  def __init__(self, sampler):
    self.sampler = sampler

  def indices_for_step(self, step):
    return self.sampler.indices_for_step(step)


@pytest.fixture(scope="module")
def trainer():
  mesh = sharding.create_mesh((1, 1), devices=jax.devices()[:1])
  return Trainer(CONFIG, MeanAggregator(make_loss_fn(CONFIG)), optimizers.adafactor(optimizers.constant_schedule(0.01)),
                 mesh)


def _builder(trainer, source=None, microbatch_size=4):
  seeds = RunSeeds.create(insecure_deterministic_seed=5)
  privacy = _Privacy(PoissonSampler(_Source.num_examples, 10 / _Source.num_examples, None, seeds.sampler_seed))
  layout = BatchLayout(batch_rows=microbatch_size, variable_rows=True, microbatch_size=microbatch_size)
  return step_data.StepBatchBuilder(privacy=privacy, layout=layout, source=source or _Source(), seeds=seeds,
                                    trainer=trainer)


def _host(batch):
  return [{k: v.tolist() for k, v in sorted(micro.items())} for micro in batch.host]


def test_prefetched_batches_equal_the_batches_built_in_line(trainer):
  inline = step_data.Prefetcher(_builder(trainer), 0, 12, depth=0)
  want = [inline.get(t) for t in range(12)]
  with step_data.Prefetcher(_builder(trainer), 0, 12, depth=3, workers=3) as ahead:
    got = [ahead.get(t) for t in range(12)]
  with step_data.Prefetcher(_builder(trainer), 7, 12, depth=2) as resumed:  # a run resumed at step 7
    again = [resumed.get(t) for t in range(7, 12)]
  for t, (w, g) in enumerate(zip(want, got)):
    assert (g.step, g.num_sampled, g.rows, g.count, g.shape) == (w.step, w.num_sampled, w.rows, w.count, w.shape), t
    assert _host(g) == _host(w), t
    for name in w.placed:
      np.testing.assert_array_equal(np.asarray(g.placed[name]), np.asarray(w.placed[name]), err_msg=f"{t} {name}")
  assert [_host(b) for b in again] == [_host(b) for b in want[7:]]
  # The step's sample in microbatches of 4, each row carrying its position in the sample.
  b = want[3]
  assert b.count == -(-b.num_sampled // 4) and b.rows == 4 * b.count
  positions = np.concatenate([micro[clipping.ROW_ID] for micro in b.host]) if b.host else np.zeros(0)
  assert positions.tolist() == list(range(b.rows))
  # One compiled shape for the run: the stack holds a sample far above the expected 10.
  assert {x.shape for x in want} == {("microbatches", step_data.stack_base(4, 10.0, True), 4)}
  assert all(np.shape(x.placed["encoder_input_tokens"])[:2] == (x.shape[1], 4) for x in want)


def test_a_failing_worker_stops_the_run_with_one_line_naming_the_step(trainer):
  builder = _builder(trainer, _Source(fail_at_seed=None))
  seeds = RunSeeds.create(insecure_deterministic_seed=5)
  builder._host.source.fail_at_seed = seeds.data_seed(4)  # pylint: disable=protected-access
  with step_data.Prefetcher(builder, 0, 10, depth=3, workers=2) as ahead:
    for t in range(4):
      ahead.get(t)
    with pytest.raises(DataError, match=r"^building the batch of step 4 failed: ValueError: mmap length") as caught:
      ahead.get(4)
  assert "\n" not in str(caught.value)
  # Closed: the queued builds are dropped and the workers end (nothing left running after the run).
  deadline = time.time() + 5
  while [t for t in threading.enumerate() if t.name.startswith("private_t5-data")] and time.time() < deadline:
    time.sleep(0.05)
  assert not [t for t in threading.enumerate() if t.name.startswith("private_t5-data")]


def test_microbatch_buckets_are_few():
  assert [microbatch_bucket(k) for k in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
  assert [microbatch_bucket(k, 9) for k in (0, 4, 9, 10, 19)] == [9, 9, 9, 18, 36]
  assert step_data.stack_base(8, 32, variable=False) == 4
  base = step_data.stack_base(8, 32.0, variable=True)  # P(Poisson(32) > 8 * base) < 1e-9
  assert 8 * base >= 32 + 6 * 32 ** 0.5 and base <= 12
