"""A fine-tuning start reads the initial checkpoint's weights once."""
import os

import numpy as np
import pytest

from private_t5.models import config as config_lib
from private_t5.models import hf_convert
from private_t5.train import initial_checkpoint

CONFIG = config_lib.T5Config(vocab_size=8, d_model=4, num_heads=1, d_kv=4, d_ff=8, num_encoder_layers=1,
                             num_decoder_layers=1)


@pytest.fixture
def counted_reads(tmp_path, monkeypatch):
  """A fake Hugging Face directory whose loader counts its calls."""
  directory = tmp_path / "hf"
  directory.mkdir()
  (directory / "config.json").write_text("{}")
  calls = []

  def fake_import(path):
    calls.append(path)
    return {"w": np.ones((2,), np.float64)}, CONFIG

  monkeypatch.setattr(hf_convert, "import_hf_t5", fake_import)
  monkeypatch.setattr(hf_convert, "check_param_shapes", lambda *a, **k: None)
  monkeypatch.setattr(hf_convert, "hf_vocabulary_path", lambda path: os.path.join(path, "spiece.model"))
  monkeypatch.setattr(initial_checkpoint, "_LAST_READ", {}, raising=False)
  return str(directory), calls


def test_finetune_start_reads_weights_once(counted_reads):
  path, calls = counted_reads
  # What a fine-tune start asks: the vocabulary for each source and the run (finetune.gin's
  # VOCAB, three uses), the checkpoint's description, then its parameters.
  for _ in range(3):
    assert initial_checkpoint.finetune_vocab_path(None, path) == os.path.join(path, "spiece.model")
  assert initial_checkpoint.describe_initial_checkpoint(path)["kind"] == "huggingface"
  params = initial_checkpoint.load_initial_params(path, CONFIG)
  assert params["w"].dtype == np.float32
  assert len(calls) == 1
  # Handing the parameters over drops the cached copy.
  assert initial_checkpoint._LAST_READ == {}  # pylint: disable=protected-access


def test_changed_directory_is_read_again(counted_reads):
  path, calls = counted_reads
  initial_checkpoint.vocabulary_of(path)
  initial_checkpoint.vocabulary_of(path)
  assert len(calls) == 1
  with open(os.path.join(path, "config.json"), "w") as f:
    f.write('{"changed": true}')
  initial_checkpoint.vocabulary_of(path)
  assert len(calls) == 2
