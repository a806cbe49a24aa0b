"""`private-t5 export --format=hf`: transformers loads the export and gives the same logits."""
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
from private_t5 import io as io_lib  # pylint: disable=g-import-not-at-top
from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
from private_t5.models import network  # pylint: disable=g-import-not-at-top
from private_t5.models import hf_convert  # pylint: disable=g-import-not-at-top
from private_t5.models import hf_export  # pylint: disable=g-import-not-at-top

SPM_MODEL = None


def _tiny_hf(path, feed_forward, tie):
  torch.manual_seed(0)
  hf_config = transformers.T5Config(
      vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
      feed_forward_proj=feed_forward, tie_word_embeddings=tie, relative_attention_num_buckets=8,
      relative_attention_max_distance=20, dropout_rate=0.0)
  model = transformers.T5ForConditionalGeneration(hf_config).eval()
  with torch.no_grad():
    for n, p in model.named_parameters():
      if "layer_norm" in n:
        p.uniform_(0.5, 1.5)
  model.save_pretrained(path)
  return model


def _inputs():
  rng = np.random.default_rng(0)
  enc = rng.integers(2, 96, size=(3, 11)).astype(np.int32)
  enc[1, 7:] = 0
  dec = rng.integers(2, 96, size=(3, 6)).astype(np.int32)
  dec[:, 0] = 0
  return enc, dec


def _hf_logits(model, enc, dec):
  with torch.no_grad():
    return model(input_ids=torch.tensor(enc, dtype=torch.long),
                 attention_mask=torch.tensor(enc > 0, dtype=torch.long),
                 decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()


def _vocab(tmp_path):
  path = tmp_path / "vocab.model"
  path.write_bytes(b"not a real sentencepiece model, shipped byte for byte")
  return str(path)


@pytest.mark.parametrize("feed_forward,tie", [("relu", True), ("gated-gelu", False)])
def test_export_round_trip(tmp_path, feed_forward, tie):
  """HF -> import -> export -> HF: same logits (1e-4) and identical weights; report beside them."""
  original = _tiny_hf(str(tmp_path / "hf"), feed_forward, tie)
  model_dir, out = str(tmp_path / "model"), str(tmp_path / "export")
  assert cli.main(["import", f"--hf_dir={tmp_path / 'hf'}", f"--model_dir={model_dir}",
                   f"--vocab_path={_vocab(tmp_path)}"]) == 0
  assert cli.main(["export", f"--model_dir={model_dir}", f"--output={out}", "--format=hf"]) == 0
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "privacy_report.json", "spiece.model"]
  with open(os.path.join(out, "privacy_report.json")) as f:
    report = json.load(f)
  assert report["exported_from"]["step"] == 0 and "ε = ∞" in report["statement"]

  exported = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
  enc, dec = _inputs()
  np.testing.assert_allclose(_hf_logits(exported, enc, dec), _hf_logits(original, enc, dec), rtol=1e-4, atol=1e-4)
  ours, config = hf_convert.import_hf_t5(out)
  np.testing.assert_allclose(np.asarray(network.Transformer(config).apply({"params": ours}, enc, dec)),
                             _hf_logits(original, enc, dec), rtol=1e-4, atol=1e-4)
  a, b = original.state_dict(), exported.state_dict()
  assert set(a) == set(b)
  for name in a:
    assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("tie", [True, False])
def test_ours_to_hf_to_ours_is_identity(tie):
  import jax  # pylint: disable=g-import-not-at-top
  config = config_lib.T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=2,
                           num_decoder_layers=1, feed_forward="relu" if tie else "gated-gelu",
                           tie_embeddings=tie, relative_attention_num_buckets=8)
  enc, dec = np.ones((1, 4), np.int32), np.ones((1, 3), np.int32)
  params = network.Transformer(config).init(jax.random.PRNGKey(0), enc, dec)["params"]
  import flax  # pylint: disable=g-import-not-at-top
  params = jax.tree.map(np.asarray, flax.core.meta.unbox(params))
  tensors, hf = hf_export.export_hf_t5(params, config)
  back, back_config = hf_convert.params_from_hf(tensors, hf)
  assert back_config == config.replace(dropout_rate=back_config.dropout_rate)
  for (path, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                               jax.tree_util.tree_flatten_with_path(back)[0]):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_export_refuses_a_non_empty_output(tmp_path, capsys):
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "x").write_text("x")
  assert cli.main(["export", f"--model_dir={tmp_path}", f"--output={tmp_path / 'out'}"]) == 2
  assert "already exists" in capsys.readouterr().err
  assert cli.main(["export", f"--model_dir={tmp_path}", f"--output={tmp_path / 'new'}"]) == 2
  assert "no checkpoints" in capsys.readouterr().err
  assert not (tmp_path / "new").exists()


def _imported_model_dir(tmp_path):
  _tiny_hf(str(tmp_path / "hf"), "relu", True)
  model_dir = str(tmp_path / "model")
  assert cli.main(["import", f"--hf_dir={tmp_path / 'hf'}", f"--model_dir={model_dir}",
                   f"--vocab_path={_vocab(tmp_path)}"]) == 0
  return model_dir


def test_export_removes_the_temporaries_of_killed_exports(tmp_path):
  """Like the store build: folders of dead processes (or, owner unknown, a day old) go."""
  model_dir = _imported_model_dir(tmp_path)
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                        text=True, check=True)
  host = socket.gethostname()
  names = {"dead": f".export_hf_{host}-{int(dead.stdout)}-abc12", "alive": f".export_hf_{host}-{os.getpid()}-def34",
           "old": ".export_hf_x7yq_2", "recent": ".export_hf_k3j9p1"}
  for name in names.values():
    (tmp_path / name).mkdir()
    (tmp_path / name / "model.safetensors").write_bytes(b"\0" * 100)
  day_ago = time.time() - 2 * 24 * 3600
  os.utime(tmp_path / names["old"], (day_ago, day_ago))
  assert cli.main(["export", f"--model_dir={model_dir}", f"--output={tmp_path / 'export'}"]) == 0
  assert {n for n in os.listdir(tmp_path) if n.startswith(".export_hf_")} == {names["alive"], names["recent"]}


def test_export_onto_a_full_disk_or_read_only_folder_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys,
                                                                                  read_only):
  model_dir = _imported_model_dir(tmp_path)
  capsys.readouterr()
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  assert cli.main(["export", f"--model_dir={model_dir}", f"--output={tmp_path / 'ro' / 'export'}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "cannot be written" in err[0]

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(io_lib, "write_bytes_atomic", full)
  assert cli.main(["export", f"--model_dir={model_dir}", f"--output={tmp_path / 'export'}"]) == 2
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "No space left on device" in errors[0] and "Traceback" not in err
  assert not (tmp_path / "export").exists() and not any(n.startswith(".export_hf_") for n in os.listdir(tmp_path))


def test_export_reads_the_new_latest_when_training_rotates_the_checkpoint_away(tmp_path, monkeypatch):
  """A training with keep_checkpoints=1 saves step 1 and deletes step 0 while export reads step 0."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  model_dir = _imported_model_dir(tmp_path)
  directory = os.path.join(model_dir, "checkpoints")
  restore = ocp.CheckpointManager.restore

  def rotated_while_read(self, step, *args, **kwargs):
    if os.path.isdir(os.path.join(directory, "0")):
      shutil.copytree(os.path.join(directory, "0"), os.path.join(directory, "1"))
      shutil.rmtree(os.path.join(directory, "0"))
    return restore(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", rotated_while_read)
  out = tmp_path / "export"
  assert cli.main(["export", f"--model_dir={model_dir}", f"--output={out}"]) == 0
  assert json.loads((out / "privacy_report.json").read_text())["exported_from"]["step"] == 1
