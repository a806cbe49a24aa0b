"""The Hugging Face T5 importer gives the same logits as `transformers` on random weights."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from private_t5.models import network  # pylint: disable=g-import-not-at-top
from private_t5.errors import CheckpointError  # pylint: disable=g-import-not-at-top
from private_t5.models import hf_convert  # pylint: disable=g-import-not-at-top

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_hf(tmp_path, name, feed_forward, tie):
  torch.manual_seed(0)
  hf_config = transformers.T5Config(
      vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
      feed_forward_proj=feed_forward, tie_word_embeddings=tie, relative_attention_num_buckets=8,
      relative_attention_max_distance=20, dropout_rate=0.0)
  model = transformers.T5ForConditionalGeneration(hf_config).eval()
  with torch.no_grad():  # Layer norms start at 1: randomise them so a swapped norm shows.
    for n, p in model.named_parameters():
      if "layer_norm" in n:
        p.uniform_(0.5, 1.5)
  path = str(tmp_path / name)
  model.save_pretrained(path)
  return model, path


def _inputs():
  rng = np.random.default_rng(0)
  enc = rng.integers(2, 96, size=(3, 11)).astype(np.int32)
  enc[1, 7:] = 0  # padding
  enc[2, 4:] = 0
  dec = rng.integers(2, 96, size=(3, 6)).astype(np.int32)
  dec[:, 0] = 0  # decoding starts from the pad id
  return enc, dec


def _hf_logits(model, enc, dec):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(enc, dtype=torch.long),
                attention_mask=torch.tensor(enc > 0, dtype=torch.long),
                decoder_input_ids=torch.tensor(dec, dtype=torch.long))
  return out.logits.numpy()


def _our_logits(params, config, enc, dec):
  return np.asarray(network.Transformer(config).apply({"params": params}, enc, dec))


@pytest.mark.parametrize("feed_forward,tie,expect_tied", [
    ("relu", True, True),            # T5 v1.0: tied embedding, scaled output
    ("gated-gelu", False, False),    # T5 v1.1: gated GELU, unscaled output layer
])
def test_logits_match_transformers(tmp_path, feed_forward, tie, expect_tied):
  model, path = _tiny_hf(tmp_path, feed_forward, feed_forward, tie)
  params, config = hf_convert.import_hf_t5(path)
  assert config.feed_forward == feed_forward
  assert config.tie_embeddings == expect_tied
  assert (config.num_encoder_layers, config.num_decoder_layers, config.d_kv) == (2, 3, 8)
  enc, dec = _inputs()
  ours, theirs = _our_logits(params, config, enc, dec), _hf_logits(model, enc, dec)
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
  assert np.abs(theirs).max() > 1e-2  # not trivially zero


def test_untied_lm_head_of_hub_v1_1_layout(tmp_path):
  """Hub v1.1 files store their own `lm_head.weight` and `tie_word_embeddings: false`."""
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  model, path = _tiny_hf(tmp_path, "v11", "gated-gelu", False)
  tensors = st_numpy.load_file(os.path.join(path, "model.safetensors"))
  lm_head = np.random.default_rng(1).normal(size=tensors["shared.weight"].shape).astype(np.float32)
  tensors["lm_head.weight"] = lm_head
  st_numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  hf.pop("scale_decoder_outputs", None)
  hf["tie_word_embeddings"] = False
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  params, config = hf_convert.import_hf_t5(path)
  assert not config.tie_embeddings
  enc, dec = _inputs()
  with torch.no_grad():
    out = model(input_ids=torch.tensor(enc, dtype=torch.long),
                attention_mask=torch.tensor(enc > 0, dtype=torch.long),
                decoder_input_ids=torch.tensor(dec, dtype=torch.long), output_hidden_states=True)
  expected = out.decoder_hidden_states[-1].numpy() @ lm_head.T
  np.testing.assert_allclose(_our_logits(params, config, enc, dec), expected, rtol=1e-4, atol=1e-4)


def test_non_t5_architecture_is_refused(tmp_path):
  path = tmp_path / "bert"
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
  with pytest.raises(CheckpointError, match="'bert'.*only T5"):
    hf_convert.import_hf_t5(str(path))


def test_shape_mismatch_and_missing_files_are_refused(tmp_path):
  _, path = _tiny_hf(tmp_path, "v10", "relu", True)
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  hf["d_ff"] = 128
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  with pytest.raises(CheckpointError, match="shape"):
    hf_convert.import_hf_t5(path)
  hf["d_ff"], hf["num_layers"] = 64, 1
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  with pytest.raises(CheckpointError, match="does not use"):
    hf_convert.import_hf_t5(path)
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(CheckpointError, match="no model.safetensors"):
    hf_convert.import_hf_t5(path)
  with pytest.raises(CheckpointError, match="does not exist"):
    hf_convert.import_hf_t5(str(tmp_path / "nowhere"))


def test_convert_script_writes_a_loadable_checkpoint(tmp_path):
  from private_t5.train import initial_checkpoint  # pylint: disable=g-import-not-at-top
  model, path = _tiny_hf(tmp_path, "v10", "relu", True)
  out = str(tmp_path / "imported")
  proc = subprocess.run([sys.executable, os.path.join(PROJECT_ROOT, "scripts", "convert_hf_t5.py"),
                         "--hf_dir", path, "--model_dir", out], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr
  hf_params, config = hf_convert.import_hf_t5(path)
  # Both the converted checkpoint and the HF directory load as initial parameters.
  for source in (out, path):
    params = initial_checkpoint.load_initial_params(source, config)
    enc, dec = _inputs()
    np.testing.assert_allclose(_our_logits(params, config, enc, dec), _hf_logits(model, enc, dec),
                               rtol=1e-4, atol=1e-4)
  # A model config of another shape is refused with a clear error.
  with pytest.raises(CheckpointError, match="d_ff=64 but the model config has d_ff=32"):
    initial_checkpoint.load_initial_params(out, config.replace(d_ff=32))
