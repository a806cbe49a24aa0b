"""Data worker processes (`train.worker_pool`, `train.data_workers`): the batch of step t is the
same for 0, 1 and 2 processes and in any order; workers never import JAX; a worker that raises or
dies stops the run with one line naming the step; none is left after `close()` or after its
parent is killed with SIGKILL."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from private_t5.data import shared_arrays
from private_t5.data import source as source_lib
from private_t5.dp.config import BatchLayout
from private_t5.dp.sampling import PoissonSampler
from private_t5.errors import ConfigError, DataError
from private_t5.models import config as config_lib
from private_t5.dp.aggregator import MeanAggregator
from private_t5.train import optimizers, step_data, step_rows, worker_pool
from private_t5.models import sharding
from private_t5.train.state import RunSeeds
from private_t5.train.trainer import Trainer, make_loss_fn
from test_batch_objectives import write_word_corpus
from test_data_vocab import small_vocab_path
from worker_probe import Probe

TESTS = os.path.dirname(os.path.abspath(__file__))


def _gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status") as f:
      return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)  # a zombie has ended
  except FileNotFoundError:
    return True


def _wait_gone(pids, seconds=10.0):
  deadline = time.time() + seconds
  while time.time() < deadline and not all(_gone(p) for p in pids):
    time.sleep(0.1)
  return [p for p in pids if not _gone(p)]


@pytest.fixture(scope="module")
def host_builder(tmp_path_factory, shared_data):
  folder = tmp_path_factory.mktemp("worker_pool")
  corpus = write_word_corpus(folder / "docs.jsonl", 120, 400)
  source = source_lib.make_source(str(corpus), small_vocab_path(tmp_path_factory, shared_data),
                                  feature_lengths={"inputs": 64, "targets": 16}, cache_dir=str(folder / "cache"),
                                  split="all", progress=False)
  sampler = PoissonSampler(source.num_examples, 20 / source.num_examples, None, 1234)
  layout = BatchLayout(batch_rows=8, variable_rows=True, microbatch_size=8)
  return step_rows.HostStepBuilder(sampler, layout, source, 2, (0, 2), "row_id")


def _rows(host_step):
  return (host_step.step, host_step.num_sampled, host_step.rows, host_step.count,
          [{k: v.tolist() for k, v in sorted(chunk.items())} for chunk in host_step.host],
          None if host_step.empty is None else {k: v.tolist() for k, v in host_step.empty.items()})


def test_steps_are_the_same_for_any_number_of_worker_processes(host_builder):
  steps = list(range(10))
  want = [_rows(host_builder(t, 1000 + t)) for t in steps]
  assert len({str(w[4]) for w in want}) == len(steps)  # the steps differ
  for workers in (1, 2):
    pool = worker_pool.WorkerPool(host_builder, workers)
    try:
      order = steps[::-1] if workers == 2 else steps  # asked for in another order
      for t in order:
        pool.submit(t, 1000 + t)
      got = {t: _rows(pool.result(t)) for t in order}
    finally:
      pool.close()
    assert [got[t] for t in steps] == want, workers
    assert not _wait_gone([p.pid for p in pool.processes], 5)


def test_a_held_step_is_never_written_over_and_a_released_file_is_written_again(host_builder, monkeypatch):
  files = []  # the shared-memory file (the parent's mapping of it) each step came in
  unpack = worker_pool._unpack

  def recording_unpack(block, *args, **kwargs):
    files.append(id(block))
    return unpack(block, *args, **kwargs)

  monkeypatch.setattr(worker_pool, "_unpack", recording_unpack)
  steps = list(range(12))
  want = [_rows(host_builder(t, 7 + t)) for t in steps]
  pool = worker_pool.WorkerPool(host_builder, 1)
  try:
    pool.submit(0, 7)
    held = pool.result(0)  # kept while the worker builds every later step
    for t in steps[1:]:
      pool.submit(t, 7 + t)
      assert _rows(pool.result(t)) == want[t]  # and dropped at once: its file is released
    assert _rows(held) == want[0]
  finally:
    pool.close()
  assert files[0] not in files[1:]
  assert len(set(files[1:])) == 1, files  # released, then written again


def test_workers_import_neither_jax_nor_tensorflow_and_share_the_work():
  pool = worker_pool.WorkerPool(Probe(slow_at=None), 2)
  try:
    for t in range(8):
      pool.submit(t, 5)
    results = [pool.result(t) for t in range(8)]
  finally:
    pool.close()
  assert "jax" in sys.modules  # this process did
  for t, r in enumerate(results):
    assert r.host[0]["imported"].tolist() == [0, 0]
    np.testing.assert_array_equal(r.host[0]["tokens"], np.arange(12).reshape(3, 4) + t * 100 + 5)
  assert {int(r.host[0]["pid"][0]) for r in results} <= {p.pid for p in pool.processes}
  assert not _wait_gone([p.pid for p in pool.processes], 5)


def test_a_raising_worker_stops_the_run_with_one_line_naming_the_step():
  pool = worker_pool.WorkerPool(Probe(fail_at=3, private_error_at=5), 2)
  try:
    for t in range(6):
      pool.submit(t, 0)
    for t in range(3):
      pool.result(t)
    with pytest.raises(DataError, match=r"^building the batch of step 3 failed in a data worker process: "
                                        r"ValueError: mmap length is greater than file size$"):
      pool.result(3)
    pool.result(4)
    with pytest.raises(DataError, match=r"^the store changed under step 5$"):  # our own errors as they are
      pool.result(5)
  finally:
    pool.close()
  assert not _wait_gone([p.pid for p in pool.processes], 5)


def test_a_killed_worker_stops_the_run_with_one_line_naming_the_step():
  pool = worker_pool.WorkerPool(Probe(slow_at=2), 1)
  try:
    for t in range(3):
      pool.submit(t, 0)
    pool.result(0)
    pool.result(1)
    time.sleep(0.5)  # the worker is now inside step 2
    os.kill(pool.processes[0].pid, signal.SIGKILL)
    start = time.time()
    with pytest.raises(DataError, match=r"^a data worker process ended \(exit code -9\) while the batch of step 2 "
                                        r"was being built$") as caught:
      pool.result(2)
    assert time.time() - start < 5 and "\n" not in str(caught.value)
  finally:
    pool.close()


def test_no_worker_outlives_a_parent_killed_with_sigkill(tmp_path):
  script = tmp_path / "parent.py"
  script.write_text(textwrap.dedent(f"""
      import sys, time
      sys.path.insert(0, {TESTS!r})
      from private_t5.train import worker_pool
      from worker_probe import Probe
      pool = worker_pool.WorkerPool(Probe(slow_at=0), 2)
      pool.submit(0, 0)
      print(" ".join(str(p.pid) for p in pool.processes), flush=True)
      time.sleep(120)
  """))
  parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
  try:
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and not any(_gone(p) for p in pids)
  finally:
    parent.kill()
    parent.wait()
  assert not _wait_gone(pids, 10)


def test_the_loops_batches_are_the_same_with_worker_processes(host_builder):
  """`StepBatchBuilder(processes=2)` through the `Prefetcher` places the same arrays as without."""
  config = config_lib.T5Config(vocab_size=host_builder.source.vocab_size, d_model=16, num_heads=2, d_ff=32,
                           num_encoder_layers=1, num_decoder_layers=1)
  mesh = sharding.create_mesh((1, 1), devices=jax.devices()[:1])
  trainer = Trainer(config, MeanAggregator(make_loss_fn(config)),
                    optimizers.adafactor(optimizers.constant_schedule(0.01)), mesh)

  class Privacy:
    sampler = host_builder.sampler

  def batches(processes):
    builder = step_data.StepBatchBuilder(privacy=Privacy(), layout=host_builder.layout, source=host_builder.source,
                                         seeds=RunSeeds.create(insecure_deterministic_seed=3), trainer=trainer,
                                         processes=processes)
    with step_data.Prefetcher(builder, 2, 9, depth=2) as prefetcher:
      out = [prefetcher.get(t) for t in range(2, 9)]
    if processes:
      assert not _wait_gone([p.pid for p in builder._pool.processes], 5)  # pylint: disable=protected-access
    return out

  want, got = batches(0), batches(2)
  for w, g in zip(want, got):
    assert (g.step, g.num_sampled, g.rows, g.count, g.shape) == (w.step, w.num_sampled, w.rows, w.count, w.shape)
    for name in w.placed:
      np.testing.assert_array_equal(np.asarray(g.placed[name]), np.asarray(w.placed[name]), err_msg=name)


def test_a_source_sent_to_workers_shares_its_per_document_arrays(host_builder, monkeypatch):
  """Pickled for a spawned worker, the source's arrays as long as its documents travel as shared
  memory (one copy on the machine) and the store is opened again from its files."""
  monkeypatch.setattr(shared_arrays, "_MIN_BYTES", 0)
  source = host_builder.source
  docs = np.array(source._docs)  # pylint: disable=protected-access
  plain = pickle.loads(pickle.dumps(source))  # outside a process start: copies, the same rows
  np.testing.assert_array_equal(plain._docs, docs)  # pylint: disable=protected-access
  pool = worker_pool.WorkerPool(host_builder, 1)
  try:
    assert not source._docs.flags.writeable  # the parent reads the shared copy now  # pylint: disable=protected-access
    np.testing.assert_array_equal(source._docs, docs)  # pylint: disable=protected-access
    pool.submit(0, 7)
    got = pool.result(0)
  finally:
    pool.close()
  assert _rows(got) == _rows(host_builder(0, 7))


def test_a_builder_that_cannot_be_sent_to_a_worker_is_one_config_line():
  with pytest.raises(ConfigError, match=r"^train.data_workers=2: what builds the batches cannot be sent to a worker "
                                        r"process \(.*\); set train.data_workers=0$"):
    worker_pool.WorkerPool(lambda step, seed: None, 2)
