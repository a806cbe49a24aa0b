"""A tiny T5 overfits a batch of real text, then decodes it back (greedy and beam, EOS stop)."""
import gzip
import json
import os
import time

import jax
import numpy as np
import optax
import pytest
import sentencepiece as sentencepiece_lib

from private_t5.models import decoding
from private_t5.models.model import example_loss_fn
from private_t5.models.network import init_params
from private_t5.models.config import load_preset
from private_t5.models.losses import token_accuracy
from private_t5.models.network import Transformer
from private_t5.tokenizer import spm

BATCH, INPUT_LENGTH, TARGET_LENGTH = 8, 32, 24
VOCAB_SIZE = 512
STEPS = 80

pytestmark = pytest.mark.slow


def _fortunes(shared_data, count):
  texts = []
  with gzip.open(os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz"), "rt", encoding="utf-8") as f:
    for line in f:
      texts.append(json.loads(line)["text"])
      if len(texts) == count:
        break
  return texts


def _batch(processor, texts):
  """Encoder: the first tokens of a fortune; targets: the following ones (or a copy), then EOS."""
  enc = np.zeros((BATCH, INPUT_LENGTH), np.int32)
  tgt = np.zeros((BATCH, TARGET_LENGTH), np.int32)
  for i, text in enumerate(texts[:BATCH]):
    ids = processor.encode(text)
    head = ids[:INPUT_LENGTH]
    tail = ids[INPUT_LENGTH:INPUT_LENGTH + TARGET_LENGTH - 1]
    if len(tail) < 4:
      tail = ids[:TARGET_LENGTH - 1]
    enc[i, :len(head)] = head
    tgt[i, :len(tail) + 1] = tail + [decoding.EOS_ID]
  dec = np.concatenate([np.zeros((BATCH, 1), np.int32), tgt[:, :-1]], axis=1)
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=tgt,
              decoder_loss_weights=(tgt > 0).astype(np.float32))


@pytest.fixture(scope="module")
def trained(shared_data, tmp_path_factory):
  texts = _fortunes(shared_data, 1500)
  model_path = spm.train_from_sentences(texts, str(tmp_path_factory.mktemp("spm") / "fortunes.model"),
                                        vocab_size=VOCAB_SIZE)
  batch = _batch(sentencepiece_lib.SentencePieceProcessor(model_file=model_path), texts)
  config = load_preset("t5_1_0_tiny", vocab_size=VOCAB_SIZE, dropout_rate=0.0)
  params = init_params(config, jax.random.PRNGKey(0))
  optimizer = optax.adam(3e-3)

  @jax.jit
  def train_step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: example_loss_fn(p, batch, config).mean())(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  start = time.time()
  losses = []
  for _ in range(STEPS):
    params, opt_state, loss = train_step(params, opt_state)
    losses.append(float(loss))
  return dict(config=config, params=params, batch=batch, losses=losses, seconds=time.time() - start)


def test_tiny_model_overfits_real_text(trained):
  losses = trained["losses"]
  assert losses[0] > 5.0  # about log(512) at initialisation
  assert losses[-1] < losses[0] / 5, losses[::10]
  assert trained["seconds"] < 60
  batch, config = trained["batch"], trained["config"]
  logits = jax.jit(Transformer(config).apply)({"params": trained["params"]},
                                              batch["encoder_input_tokens"], batch["decoder_input_tokens"])
  accuracy = float(token_accuracy(logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"]))
  assert accuracy > 0.95


def test_overfit_model_generates_its_targets_and_stops_at_eos(trained):
  config, params, batch = trained["config"], trained["params"], trained["batch"]
  targets = batch["decoder_target_tokens"]
  greedy = np.asarray(decoding.greedy_decode(params, config, batch["encoder_input_tokens"],
                                             max_decode_length=TARGET_LENGTH))
  exact = np.all(greedy == targets, axis=1)
  assert exact.sum() >= BATCH - 1, (greedy, targets)
  for row in greedy:  # nothing but zeros after the first EOS
    eos = np.flatnonzero(row == decoding.EOS_ID)
    if eos.size:
      assert np.all(row[eos[0] + 1:] == 0)
  sequences, scores = decoding.beam_search(params, config, batch["encoder_input_tokens"],
                                           max_decode_length=TARGET_LENGTH, beam_size=3)
  sequences = np.asarray(sequences)
  assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)  # best first
  assert np.all(sequences[:, 0] == targets, axis=1).sum() >= BATCH - 1
