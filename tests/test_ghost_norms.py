"""Ghost norms of each layer type against explicitly instantiated per-example gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5.dp import ghost_norms as gn

RTOL = 1e-5


def _rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)))


def _rng(seed=0):
  return np.random.default_rng(seed)


def _per_example_sq_norm(loss_of_param, param, *per_example_args):
  """||d loss_i / d param||^2 for each example, by autodiff of one example at a time."""
  def one(*args):
    grad = jax.grad(loss_of_param)(param, *args)
    return jnp.sum(jnp.square(grad.astype(jnp.float64 if jax.config.x64_enabled else jnp.float32)))
  return jax.vmap(one)(*per_example_args)


@pytest.mark.parametrize("method", [gn.GRAM, gn.INSTANTIATE, gn.AUTO])
def test_linear_sq_norms_match_explicit(method):
  rng = _rng(1)
  batch, seq, d_in, d_out = 3, 7, 5, 6
  a = rng.normal(size=(batch, seq, d_in)).astype(np.float32)
  w = rng.normal(size=(d_in, d_out)).astype(np.float32)
  u = rng.normal(size=(batch, seq, d_out)).astype(np.float32)  # loss_i = sum(u_i * (a_i W))
  got = gn.linear_sq_norms(a, u, method)  # g_i = d loss_i / d y_i = u_i
  want = _per_example_sq_norm(lambda k, ai, ui: jnp.sum(ui * (ai @ k)), w, a, u)
  assert _rel_err(got, want) <= RTOL


def test_linear_sq_norms_folds_middle_axes():
  rng = _rng(2)
  a = rng.normal(size=(2, 1, 4, 3)).astype(np.float32)
  g = rng.normal(size=(2, 1, 4, 5)).astype(np.float32)
  want = np.sum(np.einsum("bti,bto->bio", a[:, 0], g[:, 0]) ** 2, axis=(1, 2))
  assert _rel_err(gn.linear_sq_norms(a, g, gn.GRAM), want) <= RTOL


@pytest.mark.parametrize("block", [1, 3, 4, 7, 64])
def test_gram_sq_norms_in_blocks_of_rows(block):
  # T = 7: blocks of 3 (and 4) leave a shorter last block.
  rng = _rng(3)
  a = rng.normal(size=(2, 7, 4)).astype(np.float32)
  g = rng.normal(size=(2, 7, 5)).astype(np.float32)
  want = np.sum(np.einsum("bti,bto->bio", a, g) ** 2, axis=(1, 2))
  assert _rel_err(gn.gram_sq_norms(a, g, block), want) <= RTOL
  # bfloat16 inputs are multiplied into float32 sums: the norm of the bfloat16 values.
  a16, g16 = jnp.asarray(a, jnp.bfloat16), jnp.asarray(g, jnp.bfloat16)
  want16 = np.sum(np.einsum("bti,bto->bio", np.asarray(a16, np.float32), np.asarray(g16, np.float32)) ** 2,
                  axis=(1, 2))
  assert _rel_err(gn.gram_sq_norms(a16, g16, block), want16) <= RTOL


def test_choose_linear_method_prefers_gram_for_short_sequences():
  assert gn.choose_linear_method(seq_len=16, d_in=512, d_out=512) == gn.GRAM
  assert gn.choose_linear_method(seq_len=4096, d_in=64, d_out=64) == gn.INSTANTIATE
  gram, inst = gn.linear_costs(512, 512, 2048)
  assert gram > inst  # long encoder sequences: instantiation is cheaper


def test_lookup_sq_norms_with_repeated_tokens():
  rng = _rng(3)
  vocab, batch, seq, dim = 11, 4, 9, 5
  tokens = rng.integers(0, 4, size=(batch, seq)).astype(np.int32)  # many repeats
  table = rng.normal(size=(vocab, dim)).astype(np.float32)
  u = rng.normal(size=(batch, seq, dim)).astype(np.float32)
  got = gn.lookup_sq_norms(tokens, u)
  want = _per_example_sq_norm(lambda e, x, ui: jnp.sum(ui * e[x]), table, tokens, u)
  assert _rel_err(got, want) <= RTOL


@pytest.mark.parametrize("method", [gn.GRAM, gn.INSTANTIATE])
def test_tied_embedding_includes_all_cross_terms(method):
  rng = _rng(4)
  vocab, batch, dim, len_in, len_out = 13, 3, 6, 8, 5
  table = rng.normal(size=(vocab, dim)).astype(np.float32)
  x = rng.integers(0, 5, size=(batch, len_in)).astype(np.int32)
  y = rng.integers(0, 5, size=(batch, len_out)).astype(np.int32)
  u_enc = rng.normal(size=(batch, len_in, dim)).astype(np.float32)
  u_dec = rng.normal(size=(batch, len_out, dim)).astype(np.float32)
  h = rng.normal(size=(batch, len_out, dim)).astype(np.float32)
  u_logits = rng.normal(size=(batch, len_out, vocab)).astype(np.float32)

  def loss(e, xi, yi, ue, ud, hi, ul):
    # Three uses of one table: encoder lookup, decoder lookup, output projection h E^T.
    return jnp.sum(ue * e[xi]) + jnp.sum(ud * e[yi]) + jnp.sum(ul * (hi @ e.T))

  want = _per_example_sq_norm(loss, table, x, y, u_enc, u_dec, h, u_logits)
  got = gn.tied_embedding_sq_norms([(x, u_enc), (y, u_dec)], [(h, u_logits)], method)
  assert _rel_err(got, want) <= RTOL
  # Dropping the cross terms (sum of separate norms) is measurably wrong.
  separate = (gn.lookup_sq_norms(x, u_enc) + gn.lookup_sq_norms(y, u_dec)
              + gn.linear_sq_norms(h, u_logits, method))
  assert _rel_err(separate, want) > 1e-3


def test_tied_embedding_projection_only_and_lookup_only():
  rng = _rng(5)
  vocab, dim = 7, 3
  table = rng.normal(size=(vocab, dim)).astype(np.float32)
  h = rng.normal(size=(2, 4, dim)).astype(np.float32)
  u = rng.normal(size=(2, 4, vocab)).astype(np.float32)
  want = _per_example_sq_norm(lambda e, hi, ui: jnp.sum(ui * (hi @ e.T)), table, h, u)
  assert _rel_err(gn.tied_embedding_sq_norms([], [(h, u)]), want) <= RTOL
  with pytest.raises(ValueError):
    gn.tied_embedding_sq_norms([], [])


def test_scale_sq_norms():
  rng = _rng(6)
  x_hat = rng.normal(size=(3, 5, 4)).astype(np.float32)
  scale = rng.normal(size=(4,)).astype(np.float32)
  u = rng.normal(size=(3, 5, 4)).astype(np.float32)
  want = _per_example_sq_norm(lambda s, xi, ui: jnp.sum(ui * (xi * s)), scale, x_hat, u)
  assert _rel_err(gn.scale_sq_norms(x_hat, u), want) <= RTOL


def test_relpos_sq_norms():
  rng = _rng(7)
  heads, num_buckets, q, k, batch = 3, 6, 5, 7, 2
  # A bucket per offset k - q (any assignment, not only T5's), and the [q, k] matrix it implies.
  buckets = rng.integers(0, num_buckets, size=(q + k - 1,))
  pairs = buckets[np.arange(k)[None, :] - np.arange(q)[:, None] + q - 1]
  table = rng.normal(size=(heads, num_buckets)).astype(np.float32)
  u = rng.normal(size=(batch, heads, q, k)).astype(np.float32)
  want = _per_example_sq_norm(lambda t, ui: jnp.sum(ui * t[:, pairs]), table, u)
  assert _rel_err(gn.relpos_sq_norms(u, buckets, num_buckets), want) <= RTOL
  for shape in ((1, 1), (4, 9), (9, 4)):  # each diagonal summed once, whatever the aspect
    g = rng.normal(size=(2, 3) + shape).astype(np.float32)
    sums = np.asarray(gn.diagonal_sums(g))
    for j in range(shape[0] + shape[1] - 1):
      want_j = sum(g[..., qq, qq + j - (shape[0] - 1)] for qq in range(shape[0])
                   if 0 <= qq + j - (shape[0] - 1) < shape[1])
      np.testing.assert_allclose(sums[..., j], want_j, rtol=1e-6, atol=1e-6)


def test_weighted_sums_match_explicit():
  rng = _rng(8)
  a = rng.normal(size=(3, 4, 5)).astype(np.float32)
  g = rng.normal(size=(3, 4, 2)).astype(np.float32)
  w = np.array([0.5, 0.0, 2.0], np.float32)
  want = np.einsum("b,bti,bto->io", w, a, g)
  np.testing.assert_allclose(gn.linear_weighted_sum(a, g, w), want, rtol=1e-5, atol=1e-6)
  per_example = gn.linear_per_example_grads(a, g)
  np.testing.assert_allclose(gn.linear_weighted_sum(a, g, w, per_example), want, rtol=1e-5,
                             atol=1e-6)
  tokens = rng.integers(0, 3, size=(3, 4))
  want_e = np.zeros((6, 2), np.float32)
  for i in range(3):
    for t in range(4):
      want_e[tokens[i, t]] += w[i] * g[i, t]
  np.testing.assert_allclose(gn.lookup_weighted_sum(tokens, g, w, 6), want_e, rtol=1e-5, atol=1e-6)


def _dot_generals(fn, *args):
  """Every dot_general of fn's jaxpr, nested jaxprs (loops) included."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(eqn)
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns"):
          walk(inner)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_contraction_is_exact_float32_whatever_the_backend_default(dtype):
  # A GPU multiplies float32 operands in TF32 by default (a TPU in bfloat16): the norms and the
  # book-keeping sums must not, or the clip would bound a term other than the one summed.
  rng = _rng(12)
  a = jnp.asarray(rng.normal(size=(3, 200, 5)), dtype)  # 200 > GRAM_BLOCK: the blocked loop too
  g = jnp.asarray(rng.normal(size=(3, 200, 4)), dtype)
  w = jnp.asarray([0.5, 0.0, 2.0], jnp.float32)
  fns = [lambda a, g: gn.linear_sq_norms(a, g, gn.GRAM), lambda a, g: gn.linear_sq_norms(a[:, :7], g[:, :7], gn.GRAM),
         lambda a, g: gn.linear_sq_norms(a, g, gn.INSTANTIATE), lambda a, g: gn.linear_weighted_sum(a, g, w),
         lambda a, g: gn.linear_weighted_sum(a, g, w, gn.linear_per_example_grads(a, g))]
  for fn in fns:
    dots = _dot_generals(fn, a, g)
    assert dots
    for eqn in dots:
      operands = {str(v.aval.dtype) for v in eqn.invars}
      if operands == {"bfloat16"}:
        assert eqn.params["preferred_element_type"] == jnp.float32
      else:
        assert operands == {"float32"}
        assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
