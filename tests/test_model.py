"""T5 config/presets, parameter names and axes, the network's masks, and the per-example loss."""
import io
import json
import contextlib

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5.stages import cli, gin_utils
from private_t5.errors import ConfigError
from private_t5.models.config import PRESETS, T5Config, load_preset
from private_t5.models.network import Transformer, init_params, num_params, param_logical_axes, param_shapes
from private_t5.models.model import example_loss_fn
from private_t5.models import layers
from private_t5.models.losses import per_example_loss, token_accuracy

# Public parameter counts of the T5 checkpoints with T5's 32128-row vocabulary.
PUBLIC_COUNTS = {
    "t5_1_0_small": 60_506_624,
    "t5_1_0_base": 222_903_552,
    "t5_1_0_large": 737_668_096,
    "t5_1_1_small": 76_961_152,
    "t5_1_1_base": 247_577_856,
    "t5_1_1_large": 783_150_080,
    "t5_1_1_xl": 2_849_757_184,
    "t5_1_1_xxl": 11_135_332_352,
}
SMALL_VOCAB = 256


def _flat(tree, is_leaf=None):
  return flax.traverse_util.flatten_dict(tree, sep="/", is_leaf=is_leaf)


def _tiny(name="t5_1_0_tiny", **overrides):
  return load_preset(name, vocab_size=SMALL_VOCAB, **overrides)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n.endswith(("large", "xl")) else n for n in sorted(PRESETS)])
def test_preset_param_counts(name):
  config = load_preset(name)
  count = num_params(config)
  if name in PUBLIC_COUNTS:
    assert count == PUBLIC_COUNTS[name]
  else:
    assert 1_000_000 <= count <= 3_000_000, count
  shapes = _flat(param_shapes(config))
  assert shapes["token_embedder/embedding"].shape == (config.vocab_size, config.d_model)
  assert f"encoder/layers_{config.num_encoder_layers - 1}/mlp/wo/kernel" in shapes
  assert f"encoder/layers_{config.num_encoder_layers}/mlp/wo/kernel" not in shapes
  assert shapes[f"decoder/layers_{config.num_decoder_layers - 1}/self_attention/query/kernel"].shape == (
      config.d_model, config.num_heads * config.d_kv)


def test_param_names_and_axes_follow_the_contract():
  for name, wi, tied in (("t5_1_0_tiny", ("wi",), True), ("t5_1_1_tiny", ("wi_0", "wi_1"), False)):
    config = _tiny(name)
    shapes = _flat(param_shapes(config))
    axes = _flat(param_logical_axes(config), is_leaf=lambda _, x: isinstance(x, tuple))
    assert set(shapes) == set(axes)
    for key, shape in shapes.items():
      assert len(axes[key]) == len(shape.shape), key
    expected_axes = {
        "token_embedder/embedding": ("vocab", "embed"),
        "encoder/relpos_bias/rel_embedding": ("heads", "relpos_buckets"),
        "decoder/relpos_bias/rel_embedding": ("heads", "relpos_buckets"),
        "encoder/layers_0/pre_attention_layer_norm/scale": ("embed",),
        "encoder/layers_0/pre_mlp_layer_norm/scale": ("embed",),
        "encoder/layers_1/attention/query/kernel": ("embed", "joined_kv"),
        "encoder/layers_1/attention/out/kernel": ("joined_kv", "embed"),
        "encoder/layers_0/mlp/wo/kernel": ("mlp", "embed"),
        "encoder/encoder_norm/scale": ("embed",),
        "decoder/layers_0/pre_self_attention_layer_norm/scale": ("embed",),
        "decoder/layers_0/pre_cross_attention_layer_norm/scale": ("embed",),
        "decoder/layers_0/self_attention/key/kernel": ("embed", "joined_kv"),
        "decoder/layers_0/encoder_decoder_attention/value/kernel": ("embed", "joined_kv"),
        "decoder/decoder_norm/scale": ("embed",),
    }
    expected_axes.update({f"encoder/layers_0/mlp/{w}/kernel": ("embed", "mlp") for w in wi})
    expected_axes.update({f"decoder/layers_1/mlp/{w}/kernel": ("embed", "mlp") for w in wi})
    for key, names in expected_axes.items():
      assert axes[key] == names, key
    assert ("decoder/logits_dense/kernel" in axes) == (not tied)
    if not tied:
      assert axes["decoder/logits_dense/kernel"] == ("embed", "vocab")
    # Only the two relpos tables: one per stack, shared by its layers.
    assert sorted(k for k in axes if "relpos" in k) == ["decoder/relpos_bias/rel_embedding",
                                                        "encoder/relpos_bias/rel_embedding"]


def test_init_params_are_plain_arrays_matching_shapes():
  config = _tiny("t5_1_1_tiny")
  params = init_params(config, jax.random.PRNGKey(0))
  shapes = _flat(param_shapes(config))
  flat = _flat(params)
  assert set(flat) == set(shapes)
  for key, value in flat.items():
    assert isinstance(value, jax.Array), key
    assert value.shape == shapes[key].shape and value.dtype == jnp.float32
  assert np.all(np.asarray(flat["encoder/encoder_norm/scale"]) == 1.0)
  # Embeddings start with unit variance (T5); the query kernel is scaled down by sqrt(d_kv).
  assert abs(float(jnp.std(flat["token_embedder/embedding"])) - 1.0) < 0.05
  q = float(jnp.std(flat["encoder/layers_0/attention/query/kernel"]))
  k = float(jnp.std(flat["encoder/layers_0/attention/key/kernel"]))
  assert q == pytest.approx(k / np.sqrt(config.d_kv), rel=0.15)


def test_dot_product_attention_computes_the_same_network():
  """`T5Config.attention="xla"` (one `jax.nn.dot_product_attention` call) gives the einsum
  attention's logits and gradients, with padded inputs and targets (masks) and the bias."""
  config = _tiny("t5_1_1_tiny", dropout_rate=0.0)
  fused = config.replace(attention="xla")
  params = init_params(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  enc = rng.integers(2, SMALL_VOCAB, (3, 12))
  enc[1, 7:] = 0
  dec = rng.integers(2, SMALL_VOCAB, (3, 5))
  dec[2, 3:] = 0
  logits = lambda c: jax.jit(lambda p: Transformer(c).apply({"params": p}, enc, dec))(params)
  np.testing.assert_allclose(logits(fused), logits(config), atol=2e-5, rtol=1e-5)
  batch = dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=dec,
               decoder_loss_weights=(dec > 0).astype(np.float32))
  grad = lambda c: jax.jit(jax.grad(lambda p: jnp.sum(example_loss_fn(p, batch, c))))(params)
  for a, b in zip(jax.tree.leaves(grad(fused)), jax.tree.leaves(grad(config))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("changes, match", [
    ({"attention": "flash"}, "T5Config.attention must be one of"),
    ({"attention": "xla", "dropout_rate": 0.1}, "no dropout on the attention weights"),
    ({"attention": "cudnn", "dropout_rate": 0.0, "dtype": "float32"}, "needs bfloat16 or float16"),
])
def test_attention_settings_are_checked(changes, match):
  with pytest.raises(ConfigError, match=match):
    _tiny("t5_1_1_tiny", **changes)


def test_grouped_init_draws_every_parameter_like_its_flax_initializer():
  """`init_params` draws the parameters that share an initializer and a shape in one vmapped
  call: each must still follow the distribution Flax's own `init` gives it, the members of a
  group must be independent draws, and another key must give other values."""
  import scipy.stats  # pylint: disable=g-import-not-at-top
  from private_t5.models import network  # pylint: disable=g-import-not-at-top
  config = _tiny("t5_1_1_tiny")
  ours = _flat(init_params(config, jax.random.PRNGKey(0)))
  reference = _flat(flax.linen.unbox(network._init_boxed(config, jax.random.PRNGKey(1))))
  assert set(ours) == set(reference)
  with layers.recording_initializers() as initializers:
    jax.eval_shape(lambda k: network._init_boxed(config, k), jax.random.PRNGKey(0))
  groups = {}
  for path, (init, shape) in initializers.items():
    groups.setdefault((init, shape), []).append("/".join(path))
  assert len(groups) < len(ours) / 3  # drawn in groups, not one call per parameter
  for key, value in ours.items():
    a, b = np.ravel(value), np.ravel(reference[key])
    if np.all(b == b[0]):  # the norms' scales: ones
      np.testing.assert_array_equal(a, b)
    else:
      assert scipy.stats.ks_2samp(a, b).pvalue > 1e-4, key
  for members in groups.values():
    if len(members) > 1 and ours[members[0]].size > 100 and np.std(ours[members[0]]) > 0:
      a, b = np.ravel(ours[members[0]]), np.ravel(ours[members[-1]])
      assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(a.size), members
  other = _flat(init_params(config, jax.random.PRNGKey(1)))
  embedding = "token_embedder/embedding"
  assert abs(np.corrcoef(np.ravel(ours[embedding]), np.ravel(other[embedding]))[0, 1]) < 0.1


@pytest.mark.parametrize("changes, match", [
    (dict(num_heads=3, d_kv=None), "num_heads=3 does not divide d_model=128"),
    (dict(d_model=-8), "d_model must be a positive integer"),
    (dict(d_kv=0), "d_kv must be a positive integer"),
    (dict(num_encoder_layers=0), "num_encoder_layers"),
    (dict(feed_forward="swish"), "feed_forward must be one of"),
    (dict(dropout_rate=1.0), r"dropout_rate must be in \[0, 1\)"),
    (dict(dropout_rate=-0.1), "dropout_rate"),
    (dict(dtype="float8"), "dtype must be one of"),
    (dict(relative_attention_num_buckets=3), "relative_attention_num_buckets"),
    (dict(relative_attention_max_distance=8), "relative_attention_max_distance"),
    (dict(tie_embeddings="yes"), "tie_embeddings"),
])
def test_invalid_config_raises_config_error(changes, match):
  with pytest.raises(ConfigError, match=match):
    load_preset("t5_1_0_tiny", **changes)


def test_unknown_preset_lists_valid_ones():
  with pytest.raises(ConfigError, match="unknown model preset 't5_xxl'.*t5_1_0_small.*t5_1_1_tiny"):
    load_preset("t5_xxl")
  with pytest.raises(ConfigError, match="unknown T5Config field"):
    load_preset("t5_1_0_tiny", d_moel=3)


def test_explicit_d_kv_allows_non_dividing_heads():
  config = load_preset("t5_1_1_small")
  assert (config.num_heads, config.d_kv, config.d_model) == (6, 64, 512)
  assert load_preset("t5_1_0_small").d_kv == 64


def test_relative_position_buckets_match_t5():
  rel = np.arange(-200, 201, dtype=np.int32)
  bi = layers.relative_position_bucket(rel, True, 32, 128)
  causal = layers.relative_position_bucket(rel, False, 32, 128)
  # Encoder: exact buckets for |offset| < 8, future offsets in the upper 16 buckets.
  assert bi[rel == 0][0] == 0 and bi[rel == -1][0] == 1 and bi[rel == 1][0] == 17
  assert bi[rel == -7][0] == 7 and bi[rel == 7][0] == 23
  assert bi.min() == 0 and bi.max() == 31
  assert bi[rel == -200][0] == 15 and bi[rel == 200][0] == 31
  # Decoder: the future all maps to bucket 0; the past has 16 exact buckets then log buckets.
  assert np.all(causal[rel >= 0] == 0)
  assert causal[rel == -15][0] == 15 and causal[rel == -16][0] == 16 and causal[rel == -200][0] == 31
  assert np.all(np.diff(causal[rel <= 0][::-1]) >= 0)


def test_relative_position_bias_indexes_the_table_by_offset_bucket():
  # The bias of pair (q, k) is table[:, bucket(k - q)], the [q, k] bucket matrix T5X computes;
  # the program holds only the per-offset vector (no [q, k] constant).
  for q_len, k_len, bidirectional in ((7, 7, True), (5, 9, False), (9, 5, True)):
    bias_module = layers.RelativePositionBias(num_buckets=8, max_distance=16, num_heads=3)
    variables = bias_module.init(jax.random.PRNGKey(0), q_len, k_len, bidirectional)
    table = np.asarray(flax.linen.unbox(variables["params"]["rel_embedding"]))
    rel = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
    want = table[:, layers.relative_position_bucket(rel, bidirectional, 8, 16)][None]
    got = bias_module.apply(variables, q_len, k_len, bidirectional)
    np.testing.assert_array_equal(np.asarray(got), want)


def _random_tokens(key, shape, low=3):
  return jax.random.randint(jax.random.PRNGKey(key), shape, low, SMALL_VOCAB, dtype=jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5_1_0_tiny", "t5_1_1_tiny"])
def test_forward_masks_padding_and_future(name):
  config = _tiny(name)
  params = init_params(config, jax.random.PRNGKey(0))
  model = Transformer(config)
  apply = jax.jit(model.apply, static_argnames="enable_dropout")
  enc = _random_tokens(1, (2, 9))
  dec = _random_tokens(2, (2, 6))
  logits = apply({"params": params}, enc, dec)
  assert logits.shape == (2, 6, SMALL_VOCAB) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))
  # Extra encoder padding is invisible.
  padded = jnp.concatenate([enc, jnp.zeros((2, 5), jnp.int32)], axis=1)
  np.testing.assert_allclose(apply({"params": params}, padded, dec), logits, atol=1e-4, rtol=1e-4)
  # Changing future decoder tokens leaves earlier logits unchanged; changing the input does not.
  changed = dec.at[:, 4:].set(7)
  out = apply({"params": params}, enc, changed)
  np.testing.assert_allclose(out[:, :4], logits[:, :4], atol=1e-4, rtol=1e-4)
  assert not np.allclose(out[:, 4:], logits[:, 4:])
  assert not np.allclose(apply({"params": params}, enc.at[:, 0].set(5), dec), logits)
  # The decoder's positions padded to a multiple of 8 (6 -> 8) are invisible too: the logits are
  # the leading ones of a run on 8 and on 11 positions (padded to 16) with other tokens after.
  for longer in (8, 11):
    extended = jnp.concatenate([dec, _random_tokens(3, (2, longer - 6))], axis=1)
    np.testing.assert_allclose(apply({"params": params}, enc, extended)[:, :6], logits, atol=1e-5, rtol=1e-5)
  # Dropout is active only with a key, and different keys drop differently.
  drop = lambda k: apply({"params": params}, enc, dec, enable_dropout=True,
                               rngs={"dropout": jax.random.PRNGKey(k)})
  if config.dropout_rate > 0:
    assert not np.allclose(drop(0), drop(1))
  # bfloat16 activations still give float32 logits close to the float32 ones.
  bf16 = jax.jit(Transformer(config.replace(dtype="bfloat16")).apply)({"params": params}, enc, dec)
  assert bf16.dtype == jnp.float32
  assert float(jnp.mean(jnp.argmax(bf16, -1) == jnp.argmax(logits, -1))) > 0.7


def test_per_example_loss_values():
  vocab = 5
  logits = jnp.zeros((3, 4, vocab))  # uniform: CE = log(vocab) per token
  targets = jnp.array([[1, 2, 3, 0], [4, 4, 0, 0], [0, 0, 0, 0]])
  weights = (targets > 0).astype(jnp.float32)
  loss, aux = per_example_loss(logits, targets, weights)
  np.testing.assert_allclose(loss, [np.log(vocab), np.log(vocab), 0.0], rtol=1e-6)
  np.testing.assert_allclose(aux["num_tokens"], [3, 2, 0])
  # z-loss adds z * log(Z)^2 per weighted token (log Z = log 5 here).
  loss_z, aux_z = per_example_loss(logits, targets, weights, z_loss=1e-2)
  np.testing.assert_allclose(aux_z["z_loss"], [1e-2 * np.log(vocab) ** 2] * 2 + [0.0], rtol=1e-5)
  np.testing.assert_allclose(loss_z, loss + aux_z["z_loss"], rtol=1e-6)
  # The empty example has loss 0 and a finite (zero) gradient.
  grad = jax.grad(lambda l: per_example_loss(l, targets, weights)[0][2])(logits)
  assert np.all(np.asarray(grad) == 0.0)
  # A confident correct prediction has ~0 loss; weights select the tokens that count.
  sharp = jax.nn.one_hot(targets, vocab) * 50.0
  assert float(per_example_loss(sharp, targets, weights)[0].max()) < 1e-6
  acc = token_accuracy(sharp.at[0, 0].set(-sharp[0, 0]), targets, weights)
  assert float(acc) == pytest.approx(4 / 5)
  assert float(token_accuracy(logits, targets, jnp.zeros_like(weights))) == 0.0


def _batch(batch_size=4, li=10, lt=7):
  enc = np.array(_random_tokens(3, (batch_size, li)))
  tgt = np.array(_random_tokens(4, (batch_size, lt)))
  enc[1, 6:] = 0
  tgt[2, 3:] = 0
  dec = np.concatenate([np.zeros((batch_size, 1), np.int32), tgt[:, :-1]], axis=1)
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=tgt,
              decoder_loss_weights=(tgt > 0).astype(np.float32),
              example_weight=np.ones((batch_size,), np.float32))


@pytest.mark.slow
def test_example_loss_is_per_example_and_vmappable():
  config = _tiny("t5_1_1_tiny")
  params = init_params(config, jax.random.PRNGKey(0))
  batch = _batch()
  loss_fn = jax.jit(example_loss_fn, static_argnames="config")
  batch_loss = loss_fn(params, batch, config)
  assert batch_loss.shape == (4,)
  # One example at a time (vmap with a batch of one inside) gives the same losses...
  single = jax.tree_util.tree_map(lambda x: x[:, None], batch)
  vmapped = jax.jit(jax.vmap(lambda ex: example_loss_fn(params, ex, config)[0]))(single)
  np.testing.assert_allclose(vmapped, batch_loss, rtol=1e-5, atol=1e-6)
  # ...and their mean is the batch loss of the token-weighted CE when examples are full.
  logits = jax.jit(Transformer(config).apply)({"params": params}, batch["encoder_input_tokens"],
                                     batch["decoder_input_tokens"])
  full = [0, 1, 3]
  log_probs = jax.nn.log_softmax(logits[jnp.array(full)])
  targets = batch["decoder_target_tokens"][full]
  token_ce = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(jnp.mean(batch_loss[jnp.array(full)]), jnp.mean(token_ce), rtol=1e-5)
  # Per-example gradients: a padding row (example_weight 0) has exactly zero gradient.
  batch["example_weight"][3] = 0.0
  single = jax.tree_util.tree_map(lambda x: x[:, None], batch)
  grads = jax.jit(jax.vmap(jax.grad(lambda p, ex: example_loss_fn(p, ex, config)[0]), in_axes=(None, 0)))(
      params, single)
  norms = np.sqrt(sum(np.sum(np.square(g).reshape(4, -1), axis=1) for g in jax.tree_util.tree_leaves(grads)))
  assert np.all(norms[:3] > 0) and norms[3] == 0.0
  # Dropout is on iff a key is given.
  with_dropout = loss_fn(params, batch, config.replace(dropout_rate=0.3),
                         dropout_rng=jax.random.PRNGKey(7))
  assert not np.allclose(with_dropout[:3], batch_loss[:3])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_gin_presets_match_python_presets(name):
  gin_utils.parse([f"configs/models/{name}.gin"])
  assert gin_utils.configured("T5Config")() == load_preset(name)
  gin_utils.parse([f"configs/models/{name}.gin"], ["VOCAB_SIZE = 1000", "T5Config.dtype = 'bfloat16'"])
  config = gin_utils.configured("T5Config")()
  assert (config.vocab_size, config.dtype) == (1000, "bfloat16")


def test_info_cli_prints_summary():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = cli.main(["info", "--gin_file=configs/models/t5_1_0_small.gin"])
  assert rc == 0
  summary = json.loads(out.getvalue())
  assert summary["num_params"] == 60_506_624
  assert (summary["num_layers"], summary["d_model"], summary["vocab_size"]) == (12, 512, 32128)
  assert (summary["num_heads"], summary["d_ff"], summary["feed_forward"], summary["tie_embeddings"]) == (
      8, 2048, "relu", True)
  assert sum(summary["num_params_by_part"].values()) == summary["num_params"]
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    rc = cli.main(["info", "--gin_file=configs/models/t5_1_0_tiny.gin", "--gin.T5Config.num_heads=3"])
  assert rc == 2 and "num_heads=3 does not divide d_model=128" in err.getvalue()
