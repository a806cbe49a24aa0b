"""Artifacts follow the umask (files 0o644, folders 0o755 under umask 022), so that a model meant
for release is readable by the team that releases it; the checkpoints (whose metadata, as earlier
versions wrote it, may hold the run's secret seed) and a DP vocabulary's private signatures stay
readable by their owner only (the secrets file itself: tests/test_run_secrets.py)."""
import dataclasses
import json
import os
import stat

import jax
import numpy as np
import pytest

from private_t5 import doc_fingerprints
from private_t5.stages import cli
from private_t5 import io as io_lib
from private_t5.models.config import load_preset
from private_t5.models.network import param_shapes
from private_t5.tokenizer import dp_spm, spm
from private_t5.models import checkpoints


@pytest.fixture
def umask_022():
  old = os.umask(0o022)
  yield
  os.umask(old)


def _mode(path) -> int:
  return stat.S_IMODE(os.lstat(path).st_mode)


def _modes(root: str):
  """{path relative to `root`: mode} of every file and folder under `root` (itself excluded)."""
  out = {}
  for parent, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(parent, name)
      out[os.path.relpath(path, root)] = _mode(path)
  return out


def _texts():
  return [f"alpha beta gamma delta {i % 7} epsilon zeta eta theta iota kappa lambda mu" for i in range(300)]


def _model_dir(path: str, vocab: str) -> str:
  """A run directory with one checkpoint: tiny parameters, the model config and secret seeds."""
  config = load_preset("t5_1_0_tiny", vocab_size=128, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                       num_decoder_layers=1)
  manager = checkpoints.CheckpointManager(path, keep=1, async_save=False)
  params = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), param_shapes(config))
  manager.save(1, {"step": 1, "params": params},
               {"model_config": dataclasses.asdict(config), "vocab_path": vocab,
                "seeds": {"root_seed": 1234567, "deterministic": False}})
  manager.close()
  return path


def test_artifacts_follow_the_umask_and_the_seeds_stay_private(tmp_path, umask_022):
  out = tmp_path / "out"
  # The atomic writers behind config.gin, privacy_report.json, summary.json and the corpora.
  io_lib.write_text_atomic(str(out / "run" / "config.gin"), "x = 1\n")
  io_lib.write_json_atomic(str(out / "run" / "privacy_report.json"), {"epsilon": 1.0})
  with io_lib.atomic_open_text(str(out / "corpus.jsonl.gz")) as f:
    f.write("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(_texts())))
  vocab = spm.train_from_sentences(_texts(), str(out / "spm" / "spm.model"), vocab_size=30)
  dp_spm.train_dp_vocabulary(str(out / "corpus.jsonl.gz"), str(out / "dp" / "dp.model"), vocab_size=400,
                             delta=1e-4, target_epsilon=8.0, insecure_seed=0, num_workers=1, eval_documents=0,
                             verbose=False)
  model_dir = _model_dir(str(tmp_path / "run"), vocab)
  assert cli.main(["export", f"--model_dir={model_dir}", f"--output={out / 'export'}"]) == 0

  modes = _modes(str(out))
  for name in ("run/config.gin", "run/privacy_report.json", "spm/spm.model", "dp/dp.model",
               "dp/privacy_report.json", "export/model.safetensors", "export/privacy_report.json",
               "export/spiece.model", "export/config.json"):
    assert modes.pop(name) == 0o644, name
  # The keyed signatures of the DP vocabulary's documents and their key, apart from its folder: the owner's only.
  for name in [f"dp.private/dp.model/{f}" for f in doc_fingerprints.FILES.values()] + [
      f"dp.private/dp.model/{doc_fingerprints.KEY_FILE}"]:
    assert modes.pop(name) == 0o600, name
  for name in ("dp.private", "dp.private/dp.model"):
    assert modes.pop(name) == 0o700, name
  assert all(mode == (0o755 if os.path.isdir(out / name) else 0o644) for name, mode in modes.items()), modes
  # Checkpoints as earlier versions wrote them hold the seed in their metadata: the folder is the owner's only.
  seeds = os.path.join(model_dir, "checkpoints", "1", "metadata", "metadata")
  assert "root_seed" in open(seeds).read()
  assert _mode(os.path.join(model_dir, "checkpoints")) == 0o700
  assert _mode(model_dir) == 0o755 and _mode(os.path.join(model_dir, ".lock")) == 0o644


def test_an_atomic_write_removes_the_temporaries_of_killed_writers(tmp_path):
  """A killed writer leaves `.NAME.<host>-<pid>-<random>.tmp` beside NAME; the next write of
  NAME removes those of dead processes (and old ones of unknown owner), never a live writer's."""
  import socket  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                        text=True, check=True).stdout.strip()
  host = socket.gethostname()
  killed = tmp_path / f".report.json.{host}-{dead}-0a1b2c.tmp"
  live = tmp_path / f".report.json.{host}-{os.getpid()}-3d4e5f.tmp"
  old_style = tmp_path / ".report.json.9f8e7d.tmp"
  recent_style = tmp_path / ".report.json.6c5b4a.tmp"
  other = tmp_path / f".other.json.{host}-{dead}-0a1b2c.tmp"
  for path in (killed, live, old_style, recent_style, other):
    path.write_text("half")
  os.utime(old_style, (0, 0))
  io_lib.write_json_atomic(str(tmp_path / "report.json"), {"ok": True})
  assert json.load(open(tmp_path / "report.json")) == {"ok": True}
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      ["report.json", live.name, recent_style.name, other.name])
