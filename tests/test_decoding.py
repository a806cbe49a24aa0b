"""Decoding: the KV-cached path picks the same tokens as the full re-run; EOS, sampling, beams."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5.models.network import Transformer, init_params
from private_t5.models import decoding
from private_t5.models.config import load_preset

VOCAB, LENGTH = 256, 9


@pytest.fixture(scope="module", params=["t5_1_0_tiny", "t5_1_1_tiny"])
def model(request):
  config = load_preset(request.param, vocab_size=VOCAB)
  params = init_params(config, jax.random.PRNGKey(0))
  enc = jax.random.randint(jax.random.PRNGKey(1), (3, 11), 3, VOCAB, dtype=jnp.int32)
  enc = enc.at[2, 5:].set(0)  # a padded row
  return config, params, enc


def test_greedy_cached_equals_uncached(model):
  config, params, enc = model
  cached = decoding.greedy_decode(params, config, enc, max_decode_length=LENGTH)
  uncached = decoding.greedy_decode(params, config, enc, max_decode_length=LENGTH, use_cache=False)
  assert cached.shape == (3, LENGTH) and cached.dtype == jnp.int32
  np.testing.assert_array_equal(cached, uncached)
  # Temperature 0 and top-1 sampling are greedy.
  rng = jax.random.PRNGKey(5)
  np.testing.assert_array_equal(
      decoding.sample_decode(params, config, enc, rng, max_decode_length=LENGTH, temperature=0.0), cached)
  np.testing.assert_array_equal(
      decoding.sample_decode(params, config, enc, rng, max_decode_length=LENGTH, top_k=1), cached)


def test_beam_cached_equals_uncached(model):
  config, params, enc = model
  seqs, scores = decoding.beam_search(params, config, enc, max_decode_length=LENGTH, beam_size=3)
  ref_seqs, ref_scores = decoding.beam_search(params, config, enc, max_decode_length=LENGTH,
                                              beam_size=3, use_cache=False)
  assert seqs.shape == (3, 3, LENGTH) and scores.shape == (3, 3)
  np.testing.assert_array_equal(seqs, ref_seqs)
  np.testing.assert_allclose(scores, ref_scores, rtol=1e-4, atol=1e-4)
  assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)
  # Beams of one row are distinct hypotheses.
  for row in np.asarray(seqs):
    assert len({tuple(beam) for beam in row}) == 3


def test_a_beam_alive_at_the_length_wins_over_a_worse_finished_one(model):
  """A fixed-length decode (extraction's T tokens) has no EOS to reach: the beam that is still
  alive at max_decode_length is a complete hypothesis and must beat a finished (EOS) one it
  outscores. beam_size=1 follows the greedy path; the EOS is declared to be the runner-up
  token of the first step, so a one-token finished hypothesis exists from the start."""
  from private_t5.models.model import EncoderDecoderModel  # pylint: disable=g-import-not-at-top
  config, params, enc = model
  row = enc[:1]
  greedy = np.asarray(decoding.greedy_decode(params, config, row, max_decode_length=LENGTH, eos_id=-1))
  logits = EncoderDecoderModel(config).compute_logits(
      params, {"encoder_input_tokens": row, "decoder_target_tokens": greedy})
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))[0]
  eos = next(int(t) for t in np.argsort(-logp[0])[1:] if t not in greedy[0])
  alpha = 5.0  # long hypotheses favoured: the live beam outscores every EOS ending on its path
  penalty = lambda n: float(decoding.brevity_penalty(alpha, n))
  path = np.concatenate([[0.0], np.cumsum(logp[np.arange(LENGTH), greedy[0]])])
  live = path[-1] / penalty(LENGTH)
  assert all(live > (path[t] + logp[t, eos]) / penalty(t + 1) for t in range(LENGTH))
  seqs, scores = decoding.beam_search(params, config, row, max_decode_length=LENGTH, beam_size=1,
                                      alpha=alpha, eos_id=eos)
  np.testing.assert_array_equal(np.asarray(seqs)[0, 0], greedy[0])
  assert float(scores[0, 0]) == pytest.approx(live, rel=1e-4)


@pytest.mark.parametrize("model", ["t5_1_1_tiny"], indirect=True)
def test_eos_stops_each_row(model):
  config, params, enc = model
  greedy = np.asarray(decoding.greedy_decode(params, config, enc, max_decode_length=LENGTH))
  # Declare the token greedy emits at step 2 of row 0 to be EOS: row 0 must stop right there.
  eos = int(greedy[0, 2])
  first = int(np.flatnonzero(greedy[0] == eos)[0])
  for use_cache in (True, False):
    stopped = np.asarray(decoding.greedy_decode(params, config, enc, max_decode_length=LENGTH,
                                                eos_id=eos, use_cache=use_cache))
    for row, full in zip(stopped, greedy):
      hits = np.flatnonzero(full == eos)
      if hits.size:
        end = hits[0] + 1
        np.testing.assert_array_equal(row[:end], full[:end])
        assert np.all(row[end:] == 0)
      else:
        np.testing.assert_array_equal(row, full)
    assert np.all(stopped[0, first + 1:] == 0)


@pytest.mark.parametrize("model", ["t5_1_0_tiny"], indirect=True)
def test_sampling_is_keyed_and_respects_top_k(model):
  config, params, enc = model
  sample = lambda seed, **kw: np.asarray(decoding.sample_decode(
      params, config, enc, jax.random.PRNGKey(seed), max_decode_length=LENGTH, **kw))
  a, b, c = sample(0, temperature=1.5), sample(0, temperature=1.5), sample(1, temperature=1.5)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  cached = sample(3, temperature=1.0, top_k=4)
  np.testing.assert_array_equal(cached, sample(3, temperature=1.0, top_k=4, use_cache=False))
  # Every sampled token is among the 4 most likely given its prefix (teacher-forced logits).
  prefix = np.concatenate([np.zeros((3, 1), np.int32), cached[:, :-1]], axis=1)
  logits = jax.jit(Transformer(config).apply)({"params": params}, enc, prefix)
  rank = np.sum(np.asarray(logits) > np.take_along_axis(np.asarray(logits), cached[..., None], -1), -1)
  after_eos = np.cumsum(cached == decoding.EOS_ID, axis=1) - (cached == decoding.EOS_ID) > 0
  assert np.all((rank < 4) | after_eos)
