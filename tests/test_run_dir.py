"""A run directory to trust: one run per MODEL_DIR (lock, also for a refused multi-process
launch), failed saves as one CheckpointError naming the step, a privacy report that never runs
ahead of the checkpoints, and a fallback from an unreadable latest checkpoint."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from private_t5.stages import launch
from private_t5.errors import CheckpointError
from private_t5.models import checkpoints, run_dir, run_lock
from private_t5.models import checkpoint_read
from private_t5 import errors
from private_t5.stages import train as train_stage
from private_t5.train import loop

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
  code = ("import sys, time; from private_t5.models import run_lock; run_lock.acquire(sys.argv[1]); "
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
  assert json.load(open(os.path.join(model_dir, run_dir.LOCK_FILENAME)))["pid"] == os.getpid()


def test_lock_is_reentrant_in_one_process_and_released_on_close(tmp_path):
  model_dir = str(tmp_path / "run")
  first = checkpoints.CheckpointManager(model_dir)
  second = checkpoints.CheckpointManager(model_dir)  # same process: no self-lockout
  second.close()
  first.close()
  checkpoints.CheckpointManager(model_dir).latest_step()  # dropped without close: lock released
  code = "import sys; from private_t5.models import run_lock; run_lock.acquire(sys.argv[1]); print('ok')"
  done = subprocess.run([sys.executable, "-c", code, model_dir], cwd=PROJECT_ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# Each process of a local cluster opens a CheckpointManager on MODEL_DIR, as `train` does.
_OPEN_MODEL_DIR = """
import sys
from private_t5.errors import PrivateT5Error
from private_t5.models import checkpoints
from private_t5.train import partitioning
partitioning.initialize_distributed()
try:
  checkpoints.CheckpointManager(sys.argv[1], keep=1).close()
except PrivateT5Error as e:
  print("error: " + str(e), flush=True)
  sys.exit(2)
print("opened", flush=True)
"""


class _Lines:
  def __init__(self):
    self.text = ""

  def write(self, s):
    self.text += s

  def flush(self):
    pass


def test_refused_launch_leaves_the_running_job_alone(tmp_path, capsys):
  """Process 0 of a launch is refused the lock: no process touches the running job's save in
  progress, and the refusal is one line, within seconds."""
  model_dir = str(tmp_path / "run")
  holder = _hold_lock(model_dir)
  in_progress = os.path.join(model_dir, "checkpoints", "3.orbax-checkpoint-tmp")
  os.makedirs(os.path.join(in_progress, "state"))
  out = _Lines()
  try:
    t0 = time.monotonic()
    code = launch.launch(2, 1, [model_dir], out=out, grace_s=5.0,
                             command=[sys.executable, "-c", _OPEN_MODEL_DIR])
    elapsed = time.monotonic() - t0
    assert holder.poll() is None
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  text = out.text + capsys.readouterr().err
  assert os.path.isdir(os.path.join(in_progress, "state")), text
  assert code == 2 and "opened" not in text, text
  refusals = [line for line in text.splitlines() if "in use by another run" in line]
  assert len(refusals) == 1 and f"(PID {holder.pid} on host" in refusals[0], text
  assert "Traceback" not in text
  assert elapsed < 60, elapsed


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
    done = subprocess.run([sys.executable, "-m", "private_t5.stages.cli", "train", *_args(model_dir, corpus, vocab, 2)],
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


# A save on a full disk with the command line's logging: TensorStore reports it in a long message
# ending in the errno, and orbax logs it with a traceback from each of its threads.
_SAVE_ON_A_FULL_DISK = """
import asyncio, errno, sys
import numpy as np
from private_t5.stages import flags
flags.configure_logging()
from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler
from private_t5.errors import CheckpointError
from private_t5.models import checkpoints

async def disk_full(self, x, directory):
  await asyncio.sleep(0.5)  # the array writes finish first, as when the disk fills up on the last file
  tmp = f"{directory}/ocdbt.process_0"
  raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file '
                   f'"{tmp}/": Failed writing: "{tmp}/d/6106fc3457dad794882c06bcf865548a": Failed to '
                   f"write 1568149 bytes to file 5: No space left on device [os_error_code='{errno.ENOSPC}']")

manager = checkpoints.CheckpointManager(sys.argv[1], keep=5)
state = {"step": np.int32(1), "params": {"w": np.ones((4, 3), np.float32)}}
manager.save(1, state, {})
manager.wait()
handler.JsonCheckpointHandler._save_fn = disk_full
try:
  manager.save(2, state, {})
  manager.wait()
except CheckpointError as e:
  print("error: " + str(e), file=sys.stderr)
print(manager.all_steps())
"""


def test_disk_full_is_one_short_line_without_orbax_tracebacks(tmp_path):
  done = subprocess.run([sys.executable, "-c", _SAVE_ON_A_FULL_DISK, str(tmp_path)], cwd=PROJECT_ROOT,
                        env=_env(), capture_output=True, text=True, timeout=120)
  directory = os.path.join(str(tmp_path), "checkpoints")
  assert done.stderr.strip() == (f"error: saving checkpoint 2 to {directory} failed: No space left on "
                                 "device; training stopped, earlier checkpoints are intact"), done.stderr[-3000:]
  assert done.stdout.strip() == "[1]" and _no_tmp_left(str(tmp_path))


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
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 6))
  monkeypatch.undo()
  assert _no_tmp_left(model_dir)
  manager = checkpoints.CheckpointManager(model_dir)
  assert manager.all_steps() == [1, 2]
  assert manager.read_metadata(2)["ledger"]["steps"] == 2
  manager.close()
  _, _, info = checkpoint_read.restore_for_inference(model_dir)
  assert info["step"] == 2
  assert json.load(open(os.path.join(model_dir, "privacy_report.json")))["steps"] <= 2
  # The next run resumes from step 2 and completes.
  summary = train_stage.run_from_args(_args(model_dir, corpus, vocab, 4))
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
  train_stage.run_from_args(_args(model_dir, corpus, vocab, 4))
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
  command = [sys.executable, "-m", "private_t5.stages.cli", "train", *_args(model_dir, corpus, vocab, steps)]
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

@pytest.mark.parametrize("damage", ["empty", "truncated", "missing"])
def test_unreadable_latest_metadata_falls_back_to_the_previous(tmp_path, damage):
  """The newest checkpoint's metadata file emptied, cut short or gone: the fingerprint check,
  the seeds and the restore all use the newest intact checkpoint; the bad one is set aside."""
  fingerprint = {"model": 1}
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=3, fingerprint=fingerprint)
  for step in (1, 2, 3):
    manager.save(step, _state(step), {"seeds": {"root_seed": 7}, "note": f"s{step}"})
  manager.close()
  path = os.path.join(str(tmp_path), "checkpoints", "3", "metadata", "metadata")
  if damage == "missing":
    os.remove(path)
  else:
    text = open(path).read()
    open(path, "w").write("" if damage == "empty" else text[:len(text) // 2])
  reopened = checkpoints.CheckpointManager(str(tmp_path), keep=3, fingerprint=fingerprint)
  assert checkpoints.saved_seeds(reopened) == {"root_seed": 7}
  messages = []
  step, state, saved = loop._restore_latest_readable(reopened, _target(), messages.append)
  assert step == 2 and saved["note"] == "s2" and float(state["params"]["w"][0, 0]) == 2.0
  assert reopened.all_steps() == [1, 2]
  assert len(messages) == 1 and "checkpoint 3" in messages[0] and "resuming from checkpoint 2" in messages[0]
  reopened.close()


def test_a_save_that_cannot_fit_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capfd):
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=3, fingerprint={"model": 1})
  manager.save(1, _state(1), {"seeds": {"root_seed": 7}})
  manager.wait()
  usage = shutil.disk_usage(str(tmp_path))
  monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda _: usage._replace(free=100 << 10))
  capfd.readouterr()
  with pytest.raises(errors.CheckpointError,
                     match=r"saving checkpoint 2 .* failed: No space left on device \(needs about 0\.\d MiB, "
                           r"0\.1 MiB free\); training stopped, earlier checkpoints are intact"):
    manager.save(2, _state(2), {"seeds": {"root_seed": 7}})
  assert manager.all_steps() == [1] and sorted(os.listdir(manager.directory)) == ["1"]
  manager.close()
  assert "Traceback" not in capfd.readouterr().err


def test_an_emptied_checkpoint_file_is_refused_before_the_storage_layer_reads(tmp_path, capfd):
  """An empty file (the array manifest here) is named in one line before TensorStore starts its
  parallel reads: none of its threads' "Event loop is closed" tracebacks reach the console."""
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=3, fingerprint={"model": 1})
  for step in (1, 2):
    manager.save(step, _state(step), {"seeds": {"root_seed": 7}, "note": f"s{step}"})
  manager.close()
  open(os.path.join(str(tmp_path), "checkpoints", "2", "state", "manifest.ocdbt"), "w").close()
  reopened = checkpoints.CheckpointManager(str(tmp_path), keep=3, fingerprint={"model": 1})
  capfd.readouterr()
  with pytest.raises(errors.CheckpointError, match=r"checkpoint 2 .* unreadable: state/manifest.ocdbt is empty"):
    reopened.restore(_target(), 2)
  messages = []
  step, _, saved = loop._restore_latest_readable(reopened, _target(), messages.append)
  assert step == 1 and saved["note"] == "s1"
  assert len(messages) == 1 and "manifest.ocdbt is empty" in messages[0]
  reopened.close()
  assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_unreadable_latest_checkpoint_falls_back_to_the_previous(corpus_and_vocab, tmp_path, capsys):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  train_stage.run_from_args(_args(model_dir, corpus, vocab, 3))
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
  summary = train_stage.run_from_args(_args(model_dir, corpus, vocab, 5))
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


def test_late_storage_callbacks_are_not_printed_by_the_command_line(capfd, monkeypatch):
  """When a checkpoint read or write fails half-way, TensorStore's threads post their late results
  to the closed asyncio loop and Python reports each "Event loop is closed" as unraisable, and the
  writes still in flight fail unawaited ("Task exception was never retrieved"); the command line
  drops exactly those (shown with --verbosity=debug) and keeps every other report."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  from private_t5.stages import verbosity  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # restored after the test
  closed = asyncio.new_event_loop()
  closed.close()

  class LateCallback:  # an error raised where nothing can catch it, as in a storage thread
    def __del__(self):
      closed.call_soon_threadsafe(lambda: None)

  class OtherError:
    def __del__(self):
      raise ValueError("a real problem")

  # A checkpoint write still in flight when its save has failed: its task fails, nobody awaits it,
  # and asyncio logs "Task exception was never retrieved" when the task is collected.
  namespace = {}
  exec(compile("async def write_fragment():\n  raise ValueError('NOT_FOUND: the folder is gone')\n",
               os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "serialization.py"), "exec"),
       namespace)

  class LateTask:
    def __init__(self):
      loop = asyncio.new_event_loop()
      loop.create_task(namespace["write_fragment"]())
      loop.run_until_complete(asyncio.sleep(0))
      loop.close()

  def unraisable(cls) -> str:
    gc.collect()  # what earlier tests left behind is reported now, not below
    capfd.readouterr()
    obj = cls()
    del obj
    gc.collect()
    return capfd.readouterr().err

  verbosity.configure_logging(logging.INFO)
  assert unraisable(LateCallback) == ""
  assert unraisable(LateTask) == ""
  assert "ValueError: a real problem" in unraisable(OtherError)
  verbosity.configure_logging(logging.DEBUG)
  assert "Event loop is closed" in unraisable(LateCallback)
  assert "Task exception was never retrieved" in unraisable(LateTask)
  verbosity.configure_logging(logging.INFO)
