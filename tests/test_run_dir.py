"""A run directory to trust: one run per MODEL_DIR (lock), failed saves as one CheckpointError
naming the step, a privacy report that never runs ahead of the checkpoints, and a fallback
from an unreadable latest checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from private_t5.errors import CheckpointError
from private_t5.train import checkpoints, main, run_lock

from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = "configs/experiments/quickstart.gin"


def _env():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = PROJECT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _state(value: float):
  return {"step": np.int32(value), "params": {"w": np.full((4, 3), value, np.float32)},
          "opt_state": [np.zeros(3, np.float32)]}


def _target():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), _state(0))


def _hold_lock(model_dir: str) -> subprocess.Popen:
  """A process that takes MODEL_DIR's lock, says so on stdout, then sleeps."""
  code = ("import sys, time; from private_t5.train import run_lock; run_lock.acquire(sys.argv[1]); "
          "print('locked', flush=True); time.sleep(600)")
  proc = subprocess.Popen([sys.executable, "-c", code, model_dir], cwd=PROJECT_ROOT, env=_env(),
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


# -- one run per MODEL_DIR ------------------------------------------------------------------------

def test_second_process_on_a_locked_model_dir_is_refused(tmp_path):
  model_dir = str(tmp_path / "run")
  holder = _hold_lock(model_dir)
  try:
    with pytest.raises(CheckpointError, match=rf"in use by another run \(PID {holder.pid} on host "):
      checkpoints.CheckpointManager(model_dir)
    assert not os.path.exists(os.path.join(model_dir, "checkpoints"))
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # The kernel drops the lock of a dead process: the stale .lock file does not block.
  manager = checkpoints.CheckpointManager(model_dir)
  manager.save(1, _state(1), {})
  manager.close()
  assert json.load(open(os.path.join(model_dir, run_lock.LOCK_FILENAME)))["pid"] == os.getpid()


def test_lock_is_reentrant_in_one_process_and_released_on_close(tmp_path):
  model_dir = str(tmp_path / "run")
  first = checkpoints.CheckpointManager(model_dir)
  second = checkpoints.CheckpointManager(model_dir)  # same process: no self-lockout
  second.close()
  first.close()
  checkpoints.CheckpointManager(model_dir).latest_step()  # dropped without close: lock released
  code = "import sys; from private_t5.train import run_lock; run_lock.acquire(sys.argv[1]); print('ok')"
  done = subprocess.run([sys.executable, "-c", code, model_dir], cwd=PROJECT_ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.fixture(scope="module")
def corpus_and_vocab(shared_data, tmp_path_factory):
  return fortunes_corpus_and_vocab(shared_data, str(tmp_path_factory.mktemp("vocab")))


def _args(model_dir, corpus, vocab, steps, *extra):
  return ["--gin_file=" + QUICKSTART, f"--gin.MODEL_DIR={model_dir}", f"--gin.CORPUS={corpus}",
          f"--gin.VOCAB_PATH={vocab}", f"--gin.TRAIN_STEPS={steps}",
          f"--gin.DATA_CACHE_DIR={os.path.dirname(vocab)}/cache", *MICRO_TRAIN_ARGS,
          "--gin.train.checkpoint_every=1", "--gin.train.keep_checkpoints=5", "--gin.train.log_every=1",
          *extra]


@pytest.mark.slow
def test_train_cli_on_a_locked_model_dir_exits_2_naming_the_holder(corpus_and_vocab, tmp_path):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  holder = _hold_lock(model_dir)
  try:
    done = subprocess.run([sys.executable, "-m", "private_t5.cli", "train", *_args(model_dir, corpus, vocab, 2)],
                          cwd=PROJECT_ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert done.returncode == 2, done.stderr[-2000:]
  assert f"in use by another run (PID {holder.pid} on host" in done.stderr
  assert "Traceback" not in done.stderr
  assert not os.path.exists(os.path.join(model_dir, "checkpoints"))


# -- failed saves -------------------------------------------------------------------------------

def _json_handler():
  from orbax.checkpoint._src.handlers import json_checkpoint_handler  # pylint: disable=g-import-not-at-top
  return json_checkpoint_handler.JsonCheckpointHandler


def _no_tmp_left(model_dir):
  names = os.listdir(os.path.join(model_dir, "checkpoints"))
  return not [n for n in names if ".orbax-checkpoint-tmp" in n]


def test_background_save_failure_names_its_own_step(tmp_path, monkeypatch):
  """A save failing in the background is reported with its step at the next save, not later."""
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=5)
  manager.save(1, _state(1), {})
  manager.wait()

  async def read_only(self, x, directory):
    raise PermissionError(13, "Permission denied")

  monkeypatch.setattr(_json_handler(), "_save_fn", read_only)
  manager.save(2, _state(2), {})  # returns at once; the write fails in the background
  monkeypatch.undo()
  with pytest.raises(CheckpointError, match=r"^saving checkpoint 2 to .* failed: Permission denied; "):
    manager.save(3, _state(3), {})
  assert _no_tmp_left(str(tmp_path))
  assert manager.all_steps() == [1]
  state, _ = manager.restore(_target(), 1)
  assert float(state["params"]["w"][0, 0]) == 1.0
  manager.close()


def test_any_save_error_is_one_checkpoint_error(tmp_path, monkeypatch):
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=5)

  def exhausted(*args, **kwargs):
    raise ValueError("RESOURCE_EXHAUSTED: out of disk\nmore details")

  monkeypatch.setattr(_json_handler(), "async_save", exhausted)
  with pytest.raises(CheckpointError) as raised:
    manager.save(7, _state(7), {})
    manager.wait()
  assert str(raised.value).startswith("saving checkpoint 7 to ")
  assert "ValueError: RESOURCE_EXHAUSTED: out of disk;" in str(raised.value)
  assert "\n" not in str(raised.value)
  monkeypatch.undo()
  assert manager.all_steps() == []
  manager.close()
  reopened = checkpoints.CheckpointManager(str(tmp_path))
  assert _no_tmp_left(str(tmp_path)) and reopened.all_steps() == []
  reopened.save(8, _state(8), {})
  reopened.close()


@pytest.mark.slow
def test_disk_full_mid_run_stops_training_with_the_step(corpus_and_vocab, tmp_path, monkeypatch):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  handler = _json_handler()
  original = handler.async_save
  calls = []

  async def fills_up_at_third(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
      raise ValueError("RESOURCE_EXHAUSTED: disk full")
    return await original(self, *args, **kwargs)

  monkeypatch.setattr(handler, "async_save", fills_up_at_third)
  with pytest.raises(CheckpointError, match=r"^saving checkpoint 3 to .*RESOURCE_EXHAUSTED: disk full; "):
    main.run_from_args(_args(model_dir, corpus, vocab, 6))
  monkeypatch.undo()
  assert _no_tmp_left(model_dir)
  manager = checkpoints.CheckpointManager(model_dir)
  assert manager.all_steps() == [1, 2]
  assert manager.read_metadata(2)["ledger"]["steps"] == 2
  manager.close()
  _, _, info = checkpoints.restore_for_inference(model_dir)
  assert info["step"] == 2
  assert json.load(open(os.path.join(model_dir, "privacy_report.json")))["steps"] <= 2
  # The next run resumes from step 2 and completes.
  summary = main.run_from_args(_args(model_dir, corpus, vocab, 4))
  assert summary["resumed_from_step"] == 2 and summary["final_step"] == 4


# -- the privacy report never runs ahead of the checkpoints ---------------------------------------

@pytest.mark.slow
def test_privacy_report_is_written_after_its_checkpoint_commits(corpus_and_vocab, tmp_path, monkeypatch):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  ckpt_dir = os.path.join(model_dir, "checkpoints")
  seen = []
  real_replace = os.replace

  def observing_replace(src, dst, *args, **kwargs):
    if str(dst).endswith("privacy_report.json"):
      committed = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()] if os.path.isdir(ckpt_dir) else []
      seen.append((json.load(open(src))["steps"], max(committed, default=0)))
    return real_replace(src, dst, *args, **kwargs)

  handler = _json_handler()
  original = handler._save_fn  # pylint: disable=protected-access

  async def slow_save(self, x, directory):
    time.sleep(0.3)  # a slow disk: the background write outlasts the next steps
    return await original(self, x, directory)

  monkeypatch.setattr(handler, "_save_fn", slow_save)
  monkeypatch.setattr(os, "replace", observing_replace)
  main.run_from_args(_args(model_dir, corpus, vocab, 4))
  monkeypatch.undo()
  assert seen and seen[-1][0] == 4
  assert all(report_steps <= committed for report_steps, committed in seen), seen


def _report_and_committed(model_dir):
  """(steps claimed by privacy_report.json or 0, newest committed checkpoint step or 0)."""
  report = os.path.join(model_dir, "privacy_report.json")
  claimed = json.load(open(report))["steps"] if os.path.exists(report) else 0
  ckpt_dir = os.path.join(model_dir, "checkpoints")
  names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
  return claimed, max((int(n) for n in names if n.isdigit()), default=0)


@pytest.mark.slow
def test_privacy_report_is_never_ahead_of_the_checkpoints_under_kill_9(corpus_and_vocab, tmp_path):
  """SIGKILL at random moments of a run that checkpoints every step; after each kill the report
  claims no step that no committed checkpoint holds, and the run finishes on relaunch."""
  import random  # pylint: disable=g-import-not-at-top
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  steps = 30
  command = [sys.executable, "-m", "private_t5.cli", "train", *_args(model_dir, corpus, vocab, steps)]
  rng = random.Random(1234)
  kills = 0
  for _ in range(3):
    proc = subprocess.Popen(command, cwd=PROJECT_ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
      start = _report_and_committed(model_dir)[1]
      deadline = time.monotonic() + 600
      while _report_and_committed(model_dir)[1] <= start and proc.poll() is None:
        assert time.monotonic() < deadline, "no new checkpoint in time"
        time.sleep(0.01)
      time.sleep(rng.uniform(0.0, 1.5))  # somewhere in the following steps and saves
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        kills += 1
    finally:
      proc.kill()
      proc.wait()
    claimed, committed = _report_and_committed(model_dir)
    assert claimed <= committed, (claimed, committed)
  assert kills >= 2
  done = subprocess.run(command, cwd=PROJECT_ROOT, env=_env(), capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert _report_and_committed(model_dir) == (steps, steps)


# -- an unreadable latest checkpoint --------------------------------------------------------------

@pytest.mark.slow
def test_unreadable_latest_checkpoint_falls_back_to_the_previous(corpus_and_vocab, tmp_path, capsys):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  main.run_from_args(_args(model_dir, corpus, vocab, 3))
  state_dir = os.path.join(model_dir, "checkpoints", "3", "state")
  emptied = 0
  for root, _, files in os.walk(state_dir):
    for name in files:
      path = os.path.join(root, name)
      if f"{os.sep}d{os.sep}" in path and os.path.getsize(path) > 0:  # the array data files
        open(path, "wb").close()
        emptied += 1
  assert emptied
  capsys.readouterr()
  summary = main.run_from_args(_args(model_dir, corpus, vocab, 5))
  out = capsys.readouterr().out
  warning = [line for line in out.splitlines() if "WARNING: checkpoint 3" in line]
  assert warning and "unreadable" in warning[0] and "resuming from checkpoint 2" in warning[0], out
  assert summary["resumed_from_step"] == 2 and summary["final_step"] == 5
  manager = checkpoints.CheckpointManager(model_dir)
  assert manager.latest_step() == 5
  for step in manager.all_steps():
    assert manager.read_metadata(step)["ledger"]["steps"] == step
  manager.close()
  assert json.load(open(os.path.join(model_dir, "privacy_report.json")))["steps"] == 5
