"""The memorization stage's streaming selection: choosing the prompts from token counts, then
reading only those documents, gives the examples of tokenizing every document of a split."""
import numpy as np
import pytest

from private_t5.data import objectives
from private_t5.eval import memorization
from private_t5.eval import memorization_run


@pytest.mark.parametrize("variant", ["prefix", "span_corruption"])
@pytest.mark.parametrize("k", [None, 7, 1000])
def test_selection_from_token_counts_equals_subsampling_every_document(variant, k):
  rng = np.random.default_rng(0)
  cfg = memorization.ExtractionConfig(prompt_length=16, generation_length=4, seed=3)
  raw, _ = objectives.span_corruption_lengths(cfg.prompt_length, cfg.noise_density, cfg.mean_noise_span_length)
  need = raw if variant == "span_corruption" else cfg.prompt_length + cfg.generation_length
  tokens = [rng.integers(2, 90, size=int(n)).astype(np.int32) for n in rng.integers(need - 6, need + 30, size=60)]
  ids = [f"d{i}" for i in range(len(tokens))]

  def examples(doc_ids, toks, positions=None):
    if variant == "prefix":
      return memorization.prefix_examples(doc_ids, toks, cfg)
    return memorization.span_corruption_examples(doc_ids, toks, cfg, 100, positions=positions)

  # Before: every document tokenized, the short ones skipped, then a seeded subset.
  want = memorization.subsample(examples(ids, tokens), k, seed=5)
  # Now: lengths only, the chosen positions, then just those documents.
  lengths = np.array([len(t) for t in tokens])
  chosen = memorization_run._selected(np.flatnonzero(lengths >= need), k, 5)
  got = examples([ids[i] for i in chosen], [tokens[i] for i in chosen], chosen.tolist())
  assert 0 < want.skipped < len(tokens)
  assert got.skipped == 0 and len(tokens) - int((lengths >= need).sum()) == want.skipped
  assert got.ids == want.ids
  np.testing.assert_array_equal(got.inputs, want.inputs)
  assert all(np.array_equal(a, b) for a, b in zip(got.targets, want.targets))
