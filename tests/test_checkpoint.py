"""Checkpoints: keep-last-K, atomic saves, fingerprints, unwritable/full disks, and a run killed
with SIGKILL (also during a save) that resumes to the same parameters as an uninterrupted one."""
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from private_t5.errors import CheckpointError
from private_t5.models import checkpoint_read, checkpoints

from micro_run import fortunes_corpus_and_vocab

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(value: float):
  return {"step": np.int32(value), "params": {"w": np.full((4, 3), value, np.float32)},
          "opt_state": [np.zeros(3, np.float32)]}


def _target():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), _state(0))


def test_keeps_last_k_and_restores(tmp_path):
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=2, fingerprint={"model": 1})
  for step in (1, 2, 3):
    manager.save(step, _state(step), {"note": f"s{step}"})
  manager.wait()
  assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
  state, metadata = manager.restore(_target())
  np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 3.0))
  assert metadata["note"] == "s3" and metadata["step"] == 3 and metadata["fingerprint"] == {"model": 1}
  state, _ = manager.restore(_target(), step=2)
  assert float(state["params"]["w"][0, 0]) == 2.0
  manager.close()


def test_other_fingerprint_is_refused(tmp_path):
  manager = checkpoints.CheckpointManager(str(tmp_path), fingerprint={"model": {"d_model": 32}, "data": "a"})
  manager.save(1, _state(1), {})
  manager.close()
  with pytest.raises(CheckpointError, match=r"first difference: 'model.d_model': checkpoint has 32, this run has 64"):
    checkpoints.CheckpointManager(str(tmp_path), fingerprint={"model": {"d_model": 64}, "data": "a"})
  checkpoints.CheckpointManager(str(tmp_path), fingerprint={"model": {"d_model": 32}, "data": "a"}).close()


def test_unwritable_model_dir_is_a_clear_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(CheckpointError, match="is not writable"):
    checkpoints.CheckpointManager(str(blocker / "run"))


def test_failed_save_keeps_earlier_checkpoints(tmp_path, monkeypatch):
  """A disk that fills up during a save: clear error, the earlier checkpoint still restores."""
  from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler  # pylint: disable=g-import-not-at-top
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=3)
  manager.save(1, _state(1), {})
  manager.wait()

  def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(handler.JsonCheckpointHandler, "async_save", disk_full)
  monkeypatch.setattr(handler.JsonCheckpointHandler, "save", disk_full)
  with pytest.raises(CheckpointError, match="No space left on device.*earlier checkpoints are intact"):
    manager.save(2, _state(2), {})
    manager.wait()
  monkeypatch.undo()
  reopened = checkpoints.CheckpointManager(str(tmp_path))
  assert reopened.all_steps() == [1]
  state, _ = reopened.restore(_target())
  assert float(state["params"]["w"][0, 0]) == 1.0
  reopened.close()


def test_unfinished_save_is_invisible_and_cleaned(tmp_path):
  manager = checkpoints.CheckpointManager(str(tmp_path))
  manager.save(1, _state(1), {})
  manager.close()
  leftover = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-123"
  (leftover / "state").mkdir(parents=True)
  reopened = checkpoints.CheckpointManager(str(tmp_path))
  assert reopened.latest_step() == 1 and not leftover.exists()
  reopened.close()


def test_restore_for_inference_errors(tmp_path):
  with pytest.raises(CheckpointError, match="no checkpoints"):
    checkpoint_read.restore_for_inference(str(tmp_path))


def test_restore_for_inference_reads_the_new_latest_after_a_rotation(tmp_path, monkeypatch):
  """Every reader (evaluate, memorization, export) survives a training rotating the latest away."""
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=1, async_save=False)
  manager.save(1, _state(1), {})
  manager.close()
  directory = tmp_path / "checkpoints"
  reads = []

  def read(model_dir, step):
    reads.append(step)
    if (directory / "1").exists():  # the training saves step 2 and deletes step 1 meanwhile
      os.rename(directory / "1", directory / "2")
      raise CheckpointError("checkpoint 1 vanished")
    return "params", "config", {"step": 2}

  monkeypatch.setattr(checkpoint_read, "_read_for_inference", read)
  assert checkpoint_read.restore_for_inference(str(tmp_path))[2] == {"step": 2} and reads == [None, None]
  os.rename(directory / "2", directory / "1")
  with pytest.raises(CheckpointError, match="vanished"):  # a given step is read once
    checkpoint_read.restore_for_inference(str(tmp_path), step=1)


def test_every_reader_falls_back_from_a_damaged_latest_checkpoint(tmp_path, caplog):
  """export, memorization, evaluation and a LoRA base read all use restore_for_inference: a newest
  checkpoint with emptied metadata is skipped for the newest one that reads, as training does."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from private_t5.models import config  # pylint: disable=g-import-not-at-top
  metadata = {"model_config": dataclasses.asdict(config.load_preset("t5_1_0_tiny"))}
  manager = checkpoints.CheckpointManager(str(tmp_path), keep=3, async_save=False)
  for step in (1, 2, 3):
    manager.save(step, _state(step), metadata)
  manager.close()
  for step in (2, 3):
    open(tmp_path / "checkpoints" / str(step) / "metadata" / "metadata", "w").close()  # emptied
  params, _, info = checkpoint_read.restore_for_inference(str(tmp_path))
  assert info["step"] == 1 and float(params["w"][0, 0]) == 1.0
  assert "cannot read checkpoint 3" in caplog.text and "read checkpoint 1 instead" in caplog.text
  # orbax's routine warnings of a read-only read ("read_only=True, setting save_interval_steps=0", ...) stay quiet.
  assert not [r.getMessage() for r in caplog.records if r.name == "absl" and r.levelno == logging.WARNING]
  with pytest.raises(CheckpointError, match="cannot read checkpoint 3"):  # a step asked for is that step
    checkpoint_read.restore_for_inference(str(tmp_path), step=3)
  open(tmp_path / "checkpoints" / "1" / "metadata" / "metadata", "w").close()
  with pytest.raises(CheckpointError, match="cannot read checkpoint 3"):  # none reads: the newest's error
    checkpoint_read.restore_for_inference(str(tmp_path))


# -- kill -9 and resume --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_corpus_and_vocab(shared_data, tmp_path_factory):
  return fortunes_corpus_and_vocab(shared_data, str(tmp_path_factory.mktemp("vocab")))


def _command(model_dir, corpus, vocab, steps, *extra):
  return [sys.executable, "-m", "private_t5.stages.cli", "train",
          "--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.CORPUS={corpus}", f"--gin.VOCAB_PATH={vocab}", f"--gin.TRAIN_STEPS={steps}",
          f"--gin.DATA_CACHE_DIR={os.path.dirname(vocab)}/cache",
          "--gin.VOCAB_SIZE=512", "--gin.T5Config.d_model=32", "--gin.T5Config.num_heads=2",
          "--gin.T5Config.d_ff=64", "--gin.T5Config.num_encoder_layers=1",
          "--gin.T5Config.num_decoder_layers=1", "--gin.BATCH_SIZE=8",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.train.mesh_shape=(1, 1)",
          "--gin.make_source.max_documents=300", "--gin.train.eval_examples=8",
          "--gin.train.insecure_deterministic_seed=99", "--gin.DPConfig.target_epsilon=None",
          "--gin.DPConfig.noise_multiplier=1.0", "--gin.DPConfig.expected_batch_size=0.5",
          "--gin.train.checkpoint_every=2", "--gin.train.keep_checkpoints=2", "--gin.train.log_every=1", *extra]


def _env():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = PROJECT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _kill_during_save_or_after(model_dir: str, command, min_step: int, timeout: float = 600.0) -> str:
  """Starts `command`, SIGKILLs it while a save is in flight (or once step >= min_step is
  saved, if no save was caught in flight); returns which of the two happened."""
  ckpt_dir = os.path.join(model_dir, "checkpoints")
  proc = subprocess.Popen(command, cwd=PROJECT_ROOT, env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + timeout
  try:
    while time.time() < deadline:
      names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
      steps = [int(n) for n in names if n.isdigit()]
      if any(".orbax-checkpoint-tmp" in n for n in names) and steps:
        proc.send_signal(signal.SIGKILL)
        return "during a save"
      if steps and max(steps) >= min_step:
        proc.send_signal(signal.SIGKILL)
        return "between saves"
      if proc.poll() is not None:
        raise AssertionError(f"training exited (rc {proc.returncode}) before it could be killed")
      time.sleep(0.002)
    raise AssertionError("training did not reach a checkpoint in time")
  finally:
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_kill_9_then_rerun_resumes_without_lost_or_repeated_steps(small_corpus_and_vocab, tmp_path):
  corpus, vocab = small_corpus_and_vocab
  steps = 8
  reference_dir, killed_dir = str(tmp_path / "reference"), str(tmp_path / "killed")
  done = subprocess.run(_command(reference_dir, corpus, vocab, steps), cwd=PROJECT_ROOT, env=_env(),
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]

  # The killed run and its rerun build their batches in two data worker processes, the reference in
  # its own thread: the same parameters bit for bit.
  workers = "--gin.train.data_workers=2"
  how = _kill_during_save_or_after(killed_dir, _command(killed_dir, corpus, vocab, steps, workers), min_step=4)
  killed_at = checkpoints.CheckpointManager(killed_dir).latest_step()
  assert killed_at is not None and killed_at < steps, how
  rerun = subprocess.run(_command(killed_dir, corpus, vocab, steps, workers), cwd=PROJECT_ROOT, env=_env(),
                         capture_output=True, text=True, timeout=900)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"resuming from checkpoint step {killed_at}" in rerun.stdout

  ref_params, _, ref_info = checkpoint_read.restore_for_inference(reference_dir)
  params, _, info = checkpoint_read.restore_for_inference(killed_dir)
  assert info["step"] == ref_info["step"] == steps
  for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  assert info["privacy_report"]["steps"] == ref_info["privacy_report"]["steps"] == steps
  assert info["privacy_report"]["epsilon"] == pytest.approx(ref_info["privacy_report"]["epsilon"])
  assert info["privacy_report"]["training_epsilon"] == pytest.approx(ref_info["privacy_report"]["training_epsilon"])
  assert info["privacy_report"]["training_epsilon"] > 0
  # The default DP run: untruncated Poisson in microbatches, both accountants, the smaller used.
  for key in ("epsilon_rdp", "epsilon_pld"):
    assert info["privacy_report"][key] == pytest.approx(ref_info["privacy_report"][key])
  report = info["privacy_report"]
  assert report["truncation_delta"] == 0.0 and report["max_batch_size"] is None
  assert report["training_epsilon"] == min(report["epsilon_rdp"], report["epsilon_pld"])
  assert report["clipping_method"] == "ghost" and report["batch_size"] == 8
  summary = json.load(open(os.path.join(killed_dir, "summary.json")))
  assert summary["resumed_from_step"] == killed_at and summary["steps_this_run"] == steps - killed_at
  assert summary["real_row_fraction"] is None or 0 < summary["real_row_fraction"] <= 1
