"""A correlated-noise strategy file is checked before any step (keys, finite coefficients, a positive
diagonal, a sensitivity and a C⁻¹ that stay within float32's reach), and a resume with another
num_bands names num_bands, with its old and new value."""
import json

import numpy as np
import pytest

from private_t5.dp import strategies
from private_t5.dp.config import DPConfig
from private_t5.errors import CheckpointError, ConfigError, PrivacyError
from private_t5.models import checkpoints
from private_t5.stages import cli


def _file(tmp_path, content) -> str:
  path = tmp_path / "strategy.json"
  path.write_text(json.dumps(content))
  return str(path)


SENSITIVITY = "sensitivity ‖coefs‖₂ must be a finite number in [1e-06, 1e+06], got"


@pytest.mark.parametrize("content, error, message", [
    ({"coefs": [1e300, 1e300]}, PrivacyError, f"{SENSITIVITY} inf"),
    ({"coefs": [1e-9]}, PrivacyError, f"{SENSITIVITY} 1e-09"),
    ({"coefs": [-0.8, 0.5]}, PrivacyError, "first coefficient (C's diagonal) must be positive, got -0.8"),
    ({"coefs": [0.0, 1.0]}, PrivacyError, "first coefficient (C's diagonal) must be positive, got 0.0"),
    ({"coefs": [1.0, 2.0]}, PrivacyError, "C⁻¹ grows to"),  # 1 + 2z has its root inside the unit circle
    ({"coefs": [1.0, float("nan")]}, PrivacyError, "must be finite numbers"),
    ({"coefs": [0.8, 0.5], "bands": 2}, ConfigError,
     "has unknown key 'bands'; a banded strategy's keys are kind, coefs"),
    ({"coefs": [0.8, 0.5], "digest": "0" * 64}, PrivacyError, "does not match its coefficients"),
    ({"kind": "blt", "buf_decay": [0.5], "output_scale": [0.2]}, PrivacyError, "holds a 'blt' strategy"),
    ({"coefs": [0.8, 0.5], "buf_decay": [0.5]}, ConfigError, "unknown key 'buf_decay'"),
])
def test_a_strategy_file_that_breaks_the_noise_is_refused_in_one_line(tmp_path, content, error, message):
  path = _file(tmp_path, content)
  with pytest.raises(error) as e:
    strategies.from_file(path, kind="banded", steps=64, num_bands=2)
  assert message in str(e.value) and path in str(e.value) and "\n" not in str(e.value)
  if "C⁻¹" in message:  # C⁻¹'s growth depends on the steps: checked when the run's mechanism is built
    return
  with pytest.raises(error, match="strategy"):  # when the DP settings are made, before any data is read
    DPConfig(noise="banded", num_bands=2, noise_multiplier=1.0, strategy_file=path)


def test_a_good_strategy_file_and_a_recorded_one_are_read(tmp_path):
  strategy = strategies.from_file(_file(tmp_path, {"coefs": [0.8, 0.5]}), kind="banded", steps=64, num_bands=2)
  assert strategy.sensitivity == pytest.approx(np.hypot(0.8, 0.5)) and strategy.coefs == (0.8, 0.5)
  recorded = dict(strategy.to_dict(), buffers=None, jax_privacy="x", cache_version=1)
  again = strategies.from_file(_file(tmp_path, recorded), kind="banded", steps=16, num_bands=4)
  assert again.digest == strategy.digest and (again.steps, again.num_bands) == (16, 4)
  blt = {"kind": "blt", "buf_decay": [0.5], "output_scale": [0.2], "extra": 1}
  with pytest.raises(ConfigError, match="unknown key 'extra'; a blt strategy's keys are kind, buf_decay, output_scale"):
    strategies.from_file(_file(tmp_path, blt), kind="blt", steps=8, num_bands=2)


def test_more_bands_than_steps_names_the_steps():
  with pytest.raises(PrivacyError, match=r"num_bands b=8 must be in \[1, steps=4\]"):
    strategies.for_run("banded", steps=4, num_bands=8, strategy_file="unused.json")


def test_train_refuses_the_strategy_file_before_the_first_step(shared_data, tmp_path, capsys):
  from micro_run import fortunes_corpus_and_vocab  # pylint: disable=g-import-not-at-top
  corpus, vocab = fortunes_corpus_and_vocab(shared_data, str(tmp_path))
  model_dir = tmp_path / "run"
  rc = cli.main(["train", "--gin_file=models/t5_1_0_tiny.gin", "--gin_file=runs/pretrain_banded.gin",
                 f"--model_dir={model_dir}", "--train_steps=8",
                 "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 4}",
                 f"--corpus={corpus}", f"--vocab_path={vocab}", f"--gin.DATA_CACHE_DIR={tmp_path / 'cache'}",
                 f"--gin.DPConfig.strategy_file={_file(tmp_path, {'coefs': [1e300, 1e300]})}"])
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
  assert "sensitivity ‖coefs‖₂ must be a finite number" in errors[0]
  assert not model_dir.exists()


def _state():
  return {"step": np.int32(1), "params": {"w": np.ones((2, 2), np.float32)}}


def test_a_resume_with_another_num_bands_names_num_bands(tmp_path):
  from private_t5.train import main as train_main  # pylint: disable=g-import-not-at-top
  saved = {"privacy": {"noise": "banded", "num_bands": 4, "noise_multiplier": 0.9, "sampling_rate": 0.04,
                       "strategy": "a" * 64}}
  manager = checkpoints.CheckpointManager(str(tmp_path), fingerprint=saved)
  manager.save(1, _state(), {})
  manager.close()
  # σ calibrated for the target ε: σ (and q) differ first, but the setting that changed is b.
  dp = DPConfig(noise="banded", num_bands=2, target_epsilon=8.0)
  now = {"privacy": {"noise": "banded", "num_bands": 2, "noise_multiplier": 1.3, "sampling_rate": 0.02,
                     "strategy": "b" * 64}}
  manager = checkpoints.CheckpointManager(str(tmp_path))
  try:
    with pytest.raises(CheckpointError) as e:
      manager.check_compatible(now, hints=train_main.resume_hints(dp, manager))
  finally:
    manager.close()
  message = str(e.value)
  assert "first difference: 'privacy.noise_multiplier'" in message
  assert "num_bands changed: the checkpoint's run has num_bands b=4, this run b=2" in message
  assert "keep num_bands=4 (--gin.NUM_BANDS=4" in message and "TRAIN_STEPS" not in message
  # The same b: σ that differs is blamed on the steps, as before.
  same_b = DPConfig(noise="banded", num_bands=4, target_epsilon=8.0)
  manager = checkpoints.CheckpointManager(str(tmp_path))
  try:
    hints = train_main.resume_hints(same_b, manager)
  finally:
    manager.close()
  assert "TRAIN_STEPS" in hints["privacy.noise_multiplier"] and "num_bands changed" not in str(hints)
