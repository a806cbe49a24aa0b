"""DP-LoRA fine-tuning: adapters on a frozen base, end to end on real text (rotten_tomatoes).

One tiny T5 v1.1 base (written as a Hugging Face directory, so both our loader and
`transformers` read it), one `private-t5 train` run of configs/runs/finetune_lora_dp.gin (DP,
ghost clipping, untruncated Poisson samples in microbatches) shared by the tests, and one
aggregator pair (vmap, ghost) for the sensitivity property.
"""
import functools
import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import traverse_util
from safetensors import numpy as st_numpy

from private_t5 import io as io_lib
from private_t5.models import config as config_lib
from private_t5.models import network
from private_t5.data import glue_tasks
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp import aggregator as agg_lib
from private_t5.dp import ghost
from private_t5.errors import CheckpointError, ConfigError
from private_t5.models import hf_convert, hf_export
from private_t5.models import checkpoint_read
from private_t5.models import lora as lora_lib
from private_t5.stages import cli
from private_t5.train import main as train_main
from private_t5.train.trainer import make_loss_fn

from test_bad_inputs import one_error_line  # pylint: disable=g-bad-import-order
from test_glue_tasks import train_test_vocab  # pylint: disable=g-bad-import-order

LENGTHS = {"inputs": 32, "targets": 4}
VOCAB_SIZE = 1024
CONFIG = config_lib.load_preset("t5_1_1_tiny", vocab_size=VOCAB_SIZE, dropout_rate=0.0)
# Every kind of target: attention (all three blocks), the gated MLP's wi_0 / wi_1, and wo.
LORA = lora_lib.LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=("query", "value", "wi", "wo"))
CLIP = 1.0
STEPS = 4


@pytest.fixture(scope="module")
def vocab(shared_data, tmp_path_factory):
  return train_test_vocab(shared_data, tmp_path_factory.mktemp("vocab") / "glue.model")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  """A 'pretrained' base: random tiny T5 v1.1 weights in the Hugging Face layout."""
  params = jax.tree.map(np.asarray, network.init_params(CONFIG, jax.random.PRNGKey(0)))
  tensors, hf_config = hf_export.export_hf_t5(params, CONFIG)
  path = tmp_path_factory.mktemp("base")
  io_lib.write_json_atomic(str(path / "config.json"), hf_config)
  io_lib.write_bytes_atomic(str(path / "model.safetensors"), st_numpy.save(tensors, metadata={"format": "pt"}))
  return str(path)


def _train_args(model_dir, base_dir, vocab):
  targets = "(" + ", ".join(f"'{t}'" for t in LORA.targets) + ",)"
  return ["train", "--gin_file=configs/models/t5_1_1_tiny.gin", "--gin_file=configs/runs/finetune_lora_dp.gin",
          f"--gin.MODEL_DIR={model_dir}", f"--gin.INITIAL_CHECKPOINT={base_dir}", f"--gin.VOCAB_PATH={vocab}",
          "--gin.MIXTURE_OR_TASK_NAME=rotten_tomatoes", f"--gin.VOCAB_SIZE={VOCAB_SIZE}",
          f"--gin.TASK_FEATURE_LENGTHS={LENGTHS!r}", f"--gin.TRAIN_STEPS={STEPS}", "--gin.BATCH_SIZE=16",
          "--gin.LORA_RANK=4", "--gin.LORA_ALPHA=8.0", "--gin.LORA_DROPOUT=0.1", f"--gin.LORA_TARGETS={targets}",
          "--gin.train.microbatch_size=8", "--gin.train.checkpoint_every=2", "--gin.train.eval_examples=0",
          "--gin.train.insecure_deterministic_seed=11", "--gin.DPConfig.target_epsilon=None",
          "--gin.DPConfig.noise_multiplier=1.0", f"--gin.DPConfig.clip_norm={CLIP}"]


@pytest.fixture(scope="module")
def lora_run(base_dir, vocab, tmp_path_factory):
  """`private-t5 train` with configs/runs/finetune_lora_dp.gin for STEPS steps (checkpoints 2, 4)."""
  before = io_lib.file_sha256(os.path.join(base_dir, "model.safetensors"))
  model_dir = str(tmp_path_factory.mktemp("runs") / "lora_dp")
  assert cli.main(_train_args(model_dir, base_dir, vocab)) == 0
  assert io_lib.file_sha256(os.path.join(base_dir, "model.safetensors")) == before
  return model_dir


def _tokens(seed=0, rows=3):
  rng = np.random.default_rng(seed)
  enc = rng.integers(2, VOCAB_SIZE - 100, size=(rows, 11)).astype(np.int32)
  enc[1, 7:] = 0
  dec = rng.integers(2, VOCAB_SIZE - 100, size=(rows, 5)).astype(np.int32)
  dec[:, 0] = 0
  return enc, dec


def test_fresh_adapters_give_exactly_the_base_logits_and_merge_matches(base_dir):
  base, _ = hf_convert.import_hf_t5(base_dir)
  adapters = network.init_adapters(CONFIG, LORA, jax.random.PRNGKey(1))
  assert all(not np.any(b["lora_b"]["kernel"]) for b in _adapted_layers(adapters))
  enc, dec = _tokens()
  plain = network.Transformer(CONFIG).apply({"params": base}, enc, dec)
  adapted = network.Transformer(CONFIG, LORA).apply({"params": lora_lib.combine(base, adapters)}, enc, dec)
  np.testing.assert_array_equal(np.asarray(adapted), np.asarray(plain))
  # Non-zero adapters: the merged plain T5 computes the adapted network.
  trained = jax.tree.map(lambda x: x + 0.05 * np.random.default_rng(2).standard_normal(x.shape, np.float32),
                         adapters)
  adapted = network.Transformer(CONFIG, LORA).apply({"params": lora_lib.combine(base, trained)}, enc, dec)
  merged = network.Transformer(CONFIG).apply({"params": lora_lib.merge(base, trained, LORA)}, enc, dec)
  np.testing.assert_allclose(np.asarray(merged), np.asarray(adapted), rtol=1e-4, atol=1e-4)


def _adapted_layers(tree):
  flat = traverse_util.flatten_dict(tree)
  layers = {path[:path.index(lora_lib.A_NAME)] for path in flat if lora_lib.A_NAME in path}
  return [functools.reduce(lambda node, part: node[part], layer, tree) for layer in sorted(layers)]


def test_lora_config_is_checked_once():
  for bad in (dict(rank=0), dict(alpha=0.0), dict(dropout=1.0), dict(targets=("query", "bogus")), dict(targets=())):
    with pytest.raises(ConfigError, match="LoraConfig"):
      lora_lib.LoraConfig(**bad)
  assert LORA.adapts("wi_0") and LORA.adapts("wi_1") and not LORA.adapts("key")
  assert lora_lib.LoraConfig.from_dict(LORA.to_dict()) == LORA


@pytest.fixture(scope="module")
def clipped_sums(base_dir):
  """Jitted noiseless clipped sums of adapter gradients, vmap and ghost, loss bound to the base."""
  loss_fn = make_loss_fn(CONFIG, 0.0, LORA)
  fns = {}
  for name, cls in (("vmap", agg_lib.DPAggregator), ("ghost", ghost.GhostDPAggregator)):
    def fn(adapters, base, batch, key, cls=cls):
      aggregator = cls(functools.partial(loss_fn, base=base), NoisySum(CLIP, 0.0, 1.0))
      return aggregator.clipped_sum(adapters, batch, key)
    fns[name] = jax.jit(fn)
  return fns


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def test_adapter_sensitivity_is_at_most_c_with_vmap_and_ghost(base_dir, vocab, clipped_sums):
  """Neighbouring samples (one row turned into padding) move the adapters' clipped sum by <= C,
  on both sides of C; vmap and ghost agree; the frozen base gets no gradient at all."""
  base, _ = hf_convert.import_hf_t5(base_dir)
  source = glue_tasks.GlueSource("rotten_tomatoes", "train", vocab, LENGTHS, vocab_size=VOCAB_SIZE)
  batch = {k: v for k, v in source.get_batch(list(range(6)), 0, 6).items() if k not in ("example_index", "is_padding")}
  adapters = jax.tree.map(lambda x: x + 0.05 * np.random.default_rng(3).standard_normal(x.shape, np.float32),
                          network.init_adapters(CONFIG, LORA, jax.random.PRNGKey(1)))
  key = jax.random.PRNGKey(5)
  max_change = 0.0
  for factor in (1e-4, 1e4):  # the logits, hence the gradients, scale with the final norm
    scaled = dict(base, decoder=dict(base["decoder"], decoder_norm={"scale": base["decoder"]["decoder_norm"]["scale"] * factor}))
    sums = {}
    for name, fn in clipped_sums.items():
      full, metrics = fn(adapters, scaled, batch, key)
      assert jax.tree.structure(full) == jax.tree.structure(adapters)  # adapters only
      sums[name] = _flat(full)
      for row in range(6):
        neighbour = dict(batch, example_weight=batch["example_weight"].copy())
        neighbour["example_weight"][row] = 0.0
        change = np.linalg.norm(sums[name] - _flat(fn(adapters, scaled, neighbour, key)[0]))
        assert change <= CLIP * (1 + 1e-5), (name, factor, row, change)
        max_change = max(max_change, change)
    np.testing.assert_allclose(sums["ghost"], sums["vmap"], rtol=1e-4, atol=1e-6)
    grad_norm = float(metrics["nondp/grad_norm_mean"])
    assert (grad_norm < CLIP) if factor < 1 else (grad_norm > 10 * CLIP)
  assert max_change > 0.99 * CLIP


def test_lora_run_checkpoints_only_adapters_and_trains_only_them(lora_run, base_dir):
  with open(os.path.join(lora_run, "summary.json")) as f:
    summary = json.load(f)
  assert summary["final_step"] == STEPS and summary["private"]
  adapters, config, info = checkpoint_read.restore_for_inference(lora_run, merge_adapters=False)
  assert config == CONFIG.replace(dropout_rate=0.1)
  paths = list(traverse_util.flatten_dict(adapters))
  assert paths and all(lora_lib.A_NAME in p or lora_lib.B_NAME in p for p in paths)  # no base weight stored
  assert summary["num_params"] == lora_lib.num_params(adapters) < network.num_params(CONFIG) / 10
  record = info["lora"]
  assert record["config"] == LORA.to_dict() and record["base"]["path"] == os.path.abspath(base_dir)
  base, _ = hf_convert.import_hf_t5(base_dir)
  assert record["base"]["sha256"] == lora_lib.params_sha256(base)
  # The merged model differs from the base exactly in the adapted kernels: nothing else moved.
  merged, _, _ = checkpoint_read.restore_for_inference(lora_run)
  adapted = {p[:p.index(lora_lib.A_NAME)] + ("kernel",) for p in paths if lora_lib.A_NAME in p}
  for path, value in traverse_util.flatten_dict(base).items():
    same = np.array_equal(np.asarray(traverse_util.flatten_dict(merged)[path]), value)
    assert same != (path in adapted), path
  with open(os.path.join(lora_run, "privacy_report.json")) as f:
    assert json.load(f)["steps"] == STEPS


def test_resume_equals_the_uninterrupted_run(lora_run, base_dir, vocab, tmp_path, capsys):
  """Stopped after checkpoint 2 (later ones gone), resumed to STEPS from the base moved to another
  folder (the same bytes: the run names its base by hash, not by path): the same adapters."""
  resumed = str(tmp_path / "resumed")
  shutil.copytree(lora_run, resumed)
  for name in os.listdir(os.path.join(resumed, "checkpoints")):
    if name.isdigit() and int(name) > 2:
      shutil.rmtree(os.path.join(resumed, "checkpoints", name))
  moved = str(tmp_path / "moved_base")
  shutil.copytree(base_dir, moved)
  # Other weights at the new path are refused.
  tensors = st_numpy.load_file(os.path.join(moved, "model.safetensors"))
  name = sorted(tensors)[0]
  tensors[name] = tensors[name] + 1.0
  io_lib.write_bytes_atomic(os.path.join(moved, "model.safetensors"), st_numpy.save(tensors, metadata={"format": "pt"}))
  assert cli.main(_train_args(resumed, moved, vocab)) == 2
  assert "first difference: 'privacy.lora.base.sha256'" in capsys.readouterr().err
  shutil.copyfile(os.path.join(base_dir, "model.safetensors"), os.path.join(moved, "model.safetensors"))
  assert cli.main(_train_args(resumed, moved, vocab)) == 0
  a = checkpoint_read.restore_for_inference(lora_run, merge_adapters=False)[0]
  b = checkpoint_read.restore_for_inference(resumed, merge_adapters=False)[0]
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_a_changed_base_is_refused(lora_run):
  record = checkpoint_read.restore_for_inference(lora_run, merge_adapters=False)[2]["lora"]
  wrong = dict(record, base=dict(record["base"], sha256="0" * 64))
  with pytest.raises(CheckpointError, match="changed since the LoRA run"):
    checkpoint_read.read_lora_base(wrong, lora_run)


def test_export_and_evaluate_name_a_moved_base_as_train_does(lora_run, base_dir, tmp_path, capsys):
  """The base moved after training (the run records its old path): export and evaluate refuse in one
  line naming --initial_checkpoint, train's flag for the same case; given it, they check the new
  place by the recorded SHA-256 (as a resumed train does) and read the run."""
  moved, other, a_file = str(tmp_path / "moved_base"), str(tmp_path / "other_base"), str(tmp_path / "a_file")
  shutil.copytree(base_dir, other)
  tensors = st_numpy.load_file(os.path.join(other, "model.safetensors"))
  name = sorted(tensors)[0]
  tensors[name] = tensors[name] + 1.0
  io_lib.write_bytes_atomic(os.path.join(other, "model.safetensors"), st_numpy.save(tensors, metadata={"format": "pt"}))
  open(a_file, "w").close()
  export = ["export", f"--model_dir={lora_run}", f"--output={tmp_path / 'out'}"]
  evaluate = ["evaluate", "--gin_file=configs/runs/eval.gin", f"--model_dir={lora_run}", "--task=rotten_tomatoes",
              f"--gin.TASK_FEATURE_LENGTHS={LENGTHS!r}", "--gin.evaluate.max_examples=2", "--batch_size=2",
              f"--output={tmp_path / 'eval'}"]
  os.rename(base_dir, moved)
  try:
    for argv in (export, export + ["--lora=adapter"], evaluate):
      line = one_error_line(argv, capsys)
      assert f"adapts the weights in {os.path.abspath(base_dir)!r}, which are missing" in line
      assert "--initial_checkpoint=DIR" in line, line
    assert "changed since the LoRA run" in one_error_line(export + [f"--initial_checkpoint={other}"], capsys)
    assert "changed since the LoRA run" in one_error_line(evaluate + [f"--initial_checkpoint={other}"], capsys)
    assert "is a file, not a checkpoint directory" in one_error_line(export + [f"--initial_checkpoint={a_file}"],
                                                                      capsys)
    line = one_error_line(["evaluate", "--gin_file=configs/runs/eval.gin", f"--model_dir={moved}",
                           "--task=rotten_tomatoes", f"--initial_checkpoint={moved}"], capsys)
    assert "is not a LoRA run" in line
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "eval")
    assert cli.main(export + [f"--initial_checkpoint={moved}"]) == 0
    with open(tmp_path / "out" / "privacy_report.json") as f:
      assert json.load(f)["exported_from"]["lora"]["base"]["path"] == moved  # where the base is now
    assert cli.main(export[:-1] + [f"--output={tmp_path / 'adapter'}", "--lora=adapter",
                                   f"--initial_checkpoint={moved}"]) == 0
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
      assert json.load(f)["base_model_name_or_path"] == moved
    assert cli.main(evaluate + [f"--initial_checkpoint={moved}"]) == 0
    with open(tmp_path / "eval" / "results.json") as f:
      assert json.load(f)["max_examples"] == 2
  finally:
    os.rename(moved, base_dir)


def test_a_lora_run_without_a_base_names_the_base(tmp_path, capsys):
  """Not "set VOCAB_PATH": what is missing is the LoRA base checkpoint (INITIAL_CHECKPOINT)."""
  line = one_error_line(["train", "--gin_file=configs/models/t5_1_1_tiny.gin", "--gin_file=configs/runs/finetune_lora.gin",
                         f"--gin.MODEL_DIR={tmp_path / 'm'}", "--gin.MIXTURE_OR_TASK_NAME=rotten_tomatoes",
                         "--gin.INITIAL_CHECKPOINT=None"], capsys)
  assert "set INITIAL_CHECKPOINT (--initial_checkpoint), the LoRA base checkpoint" in line and "VOCAB_PATH" not in line
  assert not os.path.exists(tmp_path / "m")


def test_lora_needs_an_initial_checkpoint(vocab, tmp_path):
  source = glue_tasks.GlueSource("rotten_tomatoes", "train", vocab, LENGTHS, vocab_size=VOCAB_SIZE)
  with pytest.raises(ConfigError, match="INITIAL_CHECKPOINT"):
    train_main.train(model_config=CONFIG, train_data=source, model_dir=str(tmp_path / "m"), train_steps=1,
                     batch_size=4, lora=LORA)
  assert not os.path.exists(tmp_path / "m")


def test_lora_rank_larger_than_an_adapted_layer_is_refused(vocab, base_dir, tmp_path):
  # t5_1_1_tiny: d_model 128, 4 heads of 32 (128), d_ff 256.
  lora_lib.LoraConfig(rank=128, targets=("query", "wo")).check_fits(CONFIG)
  with pytest.raises(ConfigError, match=r"LoraConfig.rank=129 is larger than the narrowest adapted layer's width \(128"):
    lora_lib.LoraConfig(rank=129, targets=("wi",)).check_fits(CONFIG)
  source = glue_tasks.GlueSource("rotten_tomatoes", "train", vocab, LENGTHS, vocab_size=VOCAB_SIZE)
  with pytest.raises(ConfigError, match="LoraConfig.rank=100000 is larger"):
    train_main.train(model_config=CONFIG, train_data=source, model_dir=str(tmp_path / "m"), train_steps=1,
                     batch_size=4, lora=lora_lib.LoraConfig(rank=100000), initial_checkpoint=base_dir)
  assert not os.path.exists(tmp_path / "m")


def _hf_logits(model, enc, dec):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(input_ids=torch.tensor(enc, dtype=torch.long), attention_mask=torch.tensor(enc > 0, dtype=torch.long),
                 decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()


def test_peft_adapter_and_merged_exports_give_our_logits(lora_run, base_dir, tmp_path, capsys):
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  merged, config, _ = checkpoint_read.restore_for_inference(lora_run)
  enc, dec = _tokens(seed=4)
  ours = np.asarray(network.Transformer(config).apply({"params": merged}, enc, dec))
  adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
  assert cli.main(["export", f"--model_dir={lora_run}", f"--output={adapter_dir}", "--lora=adapter"]) == 0
  assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors",
                                             "privacy_report.json", "spiece.model"]
  with open(os.path.join(adapter_dir, "privacy_report.json")) as f:
    exported_from = json.load(f)["exported_from"]
  assert exported_from["lora_export"] == "adapter" and exported_from["lora"]["base"]["path"] == base_dir
  base = transformers.T5ForConditionalGeneration.from_pretrained(base_dir).eval()
  with_adapter = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
  np.testing.assert_allclose(_hf_logits(with_adapter, enc, dec), ours, rtol=1e-4, atol=1e-4)
  assert cli.main(["export", f"--model_dir={lora_run}", f"--output={merged_dir}"]) == 0  # --lora=merged
  exported = transformers.T5ForConditionalGeneration.from_pretrained(merged_dir).eval()
  np.testing.assert_allclose(_hf_logits(exported, enc, dec), ours, rtol=1e-4, atol=1e-4)
  # An adapter export of a run without adapters: one line, nothing written.
  capsys.readouterr()
  assert cli.main(["import", f"--hf_dir={merged_dir}", f"--model_dir={tmp_path / 'plain'}"]) == 0
  assert cli.main(["export", f"--model_dir={tmp_path / 'plain'}", f"--output={tmp_path / 'x'}", "--lora=adapter"]) == 2
  assert "is not a LoRA run" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")
