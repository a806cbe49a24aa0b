"""Shared settings of the end-to-end training tests: a micro T5 that compiles in seconds."""
import gzip
import json
import os

import jax
import numpy as np

from private_t5.tokenizer import spm

# Gin overrides layered on configs/experiments/quickstart.gin: one layer each side, d_model 32,
# 32/8 tokens, batch 8, 300 fortunes, fixed seeds (insecure: tests only), σ = 1, q·N = 0.5
# (a cap of 8 rows then adds < 10% of δ over a few steps: build_mechanism refuses more).
MICRO_TRAIN_ARGS = ["--gin.VOCAB_SIZE=512", "--gin.T5Config.d_model=32", "--gin.T5Config.num_heads=2",
                    "--gin.T5Config.d_ff=64", "--gin.T5Config.num_encoder_layers=1",
                    "--gin.T5Config.num_decoder_layers=1", "--gin.BATCH_SIZE=8",
                    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.train.mesh_shape=(1, 1)",
                    "--gin.make_source.max_documents=300", "--gin.train.eval_examples=16",
                    "--gin.train.insecure_deterministic_seed=1234", "--gin.DPConfig.target_epsilon=None",
                    "--gin.DPConfig.noise_multiplier=1.0", "--gin.DPConfig.expected_batch_size=0.5"]


def fortunes_corpus_and_vocab(shared_data: str, directory: str):
  """(fortunes corpus path, a 300-piece vocabulary trained on its first 2000 documents)."""
  corpus = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  with gzip.open(corpus, "rt") as f:
    texts = [json.loads(line)["text"] for _, line in zip(range(2000), f)]
  vocab = os.path.join(directory, "spm.model")
  spm.train_from_sentences(texts, vocab, vocab_size=300)
  return corpus, vocab


def split_corpus(corpus: str, directory, num_train: int, num_valid: int):
  """(train.jsonl, valid.jsonl) in `directory`: the first rows of `corpus`, then the next ones."""
  with gzip.open(corpus, "rt") as f:
    rows = [next(f) for _ in range(num_train + num_valid)]
  train, valid = os.path.join(directory, "train.jsonl"), os.path.join(directory, "valid.jsonl")
  for path, part in ((train, rows[:num_train]), (valid, rows[num_train:])):
    with open(path, "w", encoding="utf-8") as f:
      f.write("".join(part))
  return train, valid


def saved_state(model_dir: str, step: int):
  """Every array of checkpoint `step`'s state (numpy, by entry), without a target."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.abspath(model_dir), "checkpoints", str(step), "state")
  meta = ocp.PyTreeCheckpointer().metadata(path)
  meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
  restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(item=meta, restore_args=args))
  return dict(jax.tree_util.tree_flatten_with_path(restored)[0])
