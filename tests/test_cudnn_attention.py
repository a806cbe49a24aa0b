"""T5 attention through cuDNN's fused kernel (`T5Config.attention="cudnn"`), checked on a host
without a GPU: the layout checks jax runs before lowering, the shapes handed to the kernel, and
the numbers of the same call on XLA."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo

from private_t5.models.network import Transformer, init_params
from private_t5.models.model import example_loss_fn
from private_t5.models import layers
from private_t5.models.config import load_preset
from private_t5.models.network import param_shapes

SMALL_VOCAB = 64


@pytest.fixture
def cudnn_on_host(monkeypatch):
  """jax asks the installed cuDNN for its version before it checks the layouts; answering for it
  lets the checks and the CUDA lowering run on this host."""
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


def _batch(batch=2, inputs=12, targets=6, seed=0):
  rng = np.random.default_rng(seed)
  enc = rng.integers(2, SMALL_VOCAB, (batch, inputs))
  enc[1, inputs - 5:] = 0
  dec = rng.integers(2, SMALL_VOCAB, (batch, targets))
  dec[0, targets - 2:] = 0
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=dec,
              decoder_loss_weights=(dec > 0).astype(np.float32))


def _padded_decoder_length(batch) -> int:
  """The decoder runs on its positions padded to a multiple of 8 (`network.Decoder`)."""
  return -(-batch["decoder_input_tokens"].shape[1] // 8) * 8


def _config(**changes):
  return load_preset("t5_1_1_tiny", vocab_size=SMALL_VOCAB, dtype="bfloat16", **changes)


# `... custom_call @__cudnn$fmha...(operands) {config} : (operand types) -> (results)`
_FMHA = re.compile(r"custom_call @__cudnn\$(fmha\w*)\(.* : \((.*?)\) ->")


def _fmha_calls(hlo_text: str):
  """(kind, operand shapes) of every cuDNN attention call in a lowered module."""
  calls = []
  for line in hlo_text.splitlines():
    match = _FMHA.search(line)
    if match:
      shapes = [tuple(int(d) for d in t.split("x")[:-1])
                for t in re.findall(r"tensor<([0-9x]*[a-z]\w*)>", match.group(2))]
      calls.append((match.group(1), shapes))
  return calls


def test_the_train_step_lowers_for_cuda_with_cudnn_attention(cudnn_on_host):
  """The gradient of the loss lowers to cuDNN attention calls for CUDA (jax's layout checks pass:
  they refused the cross-attention's `[B, 1, 1, k]` mask), and every bias that carries the
  relative position bias has batch 1, the only shape whose gradient cuDNN computes."""
  config = _config(attention="cudnn")
  batch = _batch()
  loss = lambda p: jnp.sum(example_loss_fn(p, batch, config))
  text = jax.jit(jax.grad(loss)).trace(param_shapes(config)).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = _fmha_calls(text)
  forward = [shapes for kind, shapes in calls if not kind.endswith("Backward")]
  backward = [shapes for kind, shapes in calls if kind.endswith("Backward")]
  layers_with_attention = config.num_encoder_layers + 2 * config.num_decoder_layers
  # The backward pass recomputes the forward one: two forward calls per attention layer.
  assert len(forward) == 2 * len(backward) == 2 * layers_with_attention, calls
  heads, (b, lq), lt = config.num_heads, batch["encoder_input_tokens"].shape, _padded_decoder_length(batch)
  # Backward operands: Q, K, V, softmax statistics, dO, bias, O, [q lengths, kv lengths].
  biases = sorted(shapes[5] for shapes in backward)
  assert biases == sorted([(1, heads, lq, lq)] * config.num_encoder_layers
                          + [(1, heads, lt, lt)] * config.num_decoder_layers
                          + [(b, 1, lt, lq)] * config.num_decoder_layers), biases


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_each_attention_passes_the_layout_checks(cudnn_on_host, kind):
  """Self-attention with the relative position bias (bidirectional with key padding; causal) and
  cross-attention with key padding pass cuDNN's layout checks, forward and backward."""
  b, lq, lk, heads, d = 2, 8, 6, 4, 32
  q_len, k_len = (lq, lq) if kind != "cross" else (lk, lq)
  query = jnp.ones((b, q_len, heads, d), jnp.bfloat16)
  key = jnp.ones((b, k_len, heads, d), jnp.bfloat16)
  mask, bias = _mask_and_bias(kind, b, q_len, k_len, heads, np.random.default_rng(0))
  inputs = layers.cudnn_attention_inputs(mask, bias, b, q_len, k_len, jnp.bfloat16)
  attend = lambda q, k, bias: jnp.sum(jax.nn.dot_product_attention(
      q, k, k, scale=1.0, implementation="cudnn", **dict(inputs, bias=bias)).astype(jnp.float32))
  text = jax.jit(jax.grad(attend, argnums=(0, 1, 2) if bias is not None else (0, 1))).trace(
      query, key, inputs.get("bias")).lower(lowering_platforms=("cuda",)).as_text()
  assert len(_fmha_calls(text)) == 2


def _mask_and_bias(kind, b, q_len, k_len, heads, rng):
  lengths = np.array([k_len, k_len - 3])
  padding = (np.arange(k_len)[None, :] < lengths[:, None])[:, None, None, :]
  bias = jnp.asarray(rng.normal(size=(1, heads, q_len, k_len)), jnp.float32)
  if kind == "encoder":
    return jnp.asarray(padding), bias
  if kind == "decoder":
    return jnp.tril(jnp.ones((q_len, k_len), jnp.bool_))[None, None], bias
  return jnp.asarray(padding), None


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_the_cudnn_inputs_compute_the_same_attention(kind):
  """On XLA, the mask and bias as handed to cuDNN give today's attention and its gradients."""
  b, lq, lk, heads, d = 2, 8, 6, 4, 32
  q_len, k_len = (lq, lq) if kind != "cross" else (lk, lq)
  rng = np.random.default_rng(1)
  query, key, value = (jnp.asarray(rng.normal(size=(b, n, heads, d)), jnp.float32)
                       for n in (q_len, k_len, k_len))
  mask, bias = _mask_and_bias(kind, b, q_len, k_len, heads, rng)

  def attend(q, k, v, bias, cudnn_layout):
    inputs = (layers.cudnn_attention_inputs(mask, bias, b, q_len, k_len, jnp.float32)
              if cudnn_layout else dict(mask=mask, bias=bias))
    return jax.nn.dot_product_attention(q, k, v, scale=1.0, implementation="xla", **inputs)

  args = (query, key, value) + ((bias,) if bias is not None else ())
  vjp = lambda cudnn_layout: jax.vjp(lambda *x: attend(*x[:3], *(x[3:] or (None,)), cudnn_layout), *args)
  (ours, ours_vjp), (today, today_vjp) = vjp(True), vjp(False)
  np.testing.assert_allclose(ours, today, atol=1e-6, rtol=1e-6)
  cotangent = jnp.asarray(rng.normal(size=ours.shape), jnp.float32)
  for a, t in zip(ours_vjp(cotangent), today_vjp(cotangent)):
    np.testing.assert_allclose(a, t, atol=1e-5, rtol=1e-5)


def test_the_network_with_cudnn_inputs_computes_the_same_logits_and_gradients(monkeypatch):
  """The whole network with `attention="cudnn"`, its kernel replaced by XLA's, gives the logits and
  gradients of `attention="xla"` (padded inputs and targets)."""
  fused = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, implementation=None, **kw: fused(*a, implementation="xla", **kw))
  batch = _batch(batch=3)
  params = init_params(_config(), jax.random.PRNGKey(0))
  enc, dec = batch["encoder_input_tokens"], batch["decoder_input_tokens"]
  logits = lambda c: jax.jit(lambda p: Transformer(c).apply({"params": p}, enc, dec))(params)
  grad = lambda c: jax.jit(jax.grad(lambda p: jnp.sum(example_loss_fn(p, batch, c))))(params)
  cudnn, xla = _config(attention="cudnn"), _config(attention="xla")
  np.testing.assert_allclose(logits(cudnn), logits(xla), atol=1e-6, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grad(cudnn)), jax.tree.leaves(grad(xla))):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("d_kv, capability, refused", [
    (64, "9.0", False), (256, "9.0", False), (256, "8.0", True), (36, "9.0", True), (264, "10.0", True)])
def test_the_configuration_refuses_head_dims_cudnn_does_not_take(monkeypatch, d_kv, capability, refused):
  """On a GPU, `check_attention_backend` refuses only head dimensions cuDNN's kernel does not take."""
  from private_t5.errors import ConfigError
  from private_t5.train.main import check_attention_backend
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a: [type("Gpu", (), {"compute_capability": capability})()])
  config = _config(attention="cudnn", d_kv=d_kv)
  if not refused:
    check_attention_backend(config)
    return
  with pytest.raises(ConfigError, match=f"multiples of 8 up to .* but d_kv is {d_kv}") as error:
    check_attention_backend(config)
  assert "\n" not in str(error.value)


def test_per_example_gradients_run_on_cudnn_with_the_examples_as_heads(cudnn_on_host, monkeypatch):
  """Under `jax.vmap` (per-example gradients: the DP paths) jax's own batching would hand cuDNN
  the examples as one batch, whose bias gradient is zero or their sum: the examples become heads
  of one call instead. Lowered for CUDA, every attention is a cuDNN call, and every bias that
  carries the relative position bias has batch 1 and examples x heads heads; on the host the
  per-example gradients equal those of `attention="xla"`, the relative position table's included."""
  config, batch = _config(attention="cudnn"), _batch(batch=3)
  one = lambda ex: jax.tree.map(lambda x: x[None], ex)
  per_example = lambda c: jax.vmap(jax.grad(lambda p, ex: example_loss_fn(p, one(ex), c)[0]), in_axes=(None, 0))
  text = jax.jit(per_example(config)).trace(param_shapes(config), batch).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = _fmha_calls(text)
  backward = [shapes for kind, shapes in calls if kind.endswith("Backward")]
  layers_with_attention = config.num_encoder_layers + 2 * config.num_decoder_layers
  assert len(calls) == 3 * len(backward) == 3 * layers_with_attention, calls
  examples, heads = batch["encoder_input_tokens"].shape[0], config.num_heads
  lq, lt = batch["encoder_input_tokens"].shape[1], _padded_decoder_length(batch)
  biases = sorted(shapes[5] for shapes in backward)
  assert biases == sorted([(1, examples * heads, lq, lq)] * config.num_encoder_layers
                          + [(1, examples * heads, lt, lt)] * config.num_decoder_layers
                          + [(examples, 1, lt, lq)] * config.num_decoder_layers), biases
  fused = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, implementation=None, **kw: fused(*a, implementation="xla", **kw))
  params = init_params(_config(), jax.random.PRNGKey(0))
  got, want = (jax.jit(per_example(c))(params, batch) for c in (config, _config(attention="xla")))
  relpos = got["encoder"]["relpos_bias"]["rel_embedding"]
  assert float(jnp.min(jnp.sum(jnp.abs(relpos), axis=(1, 2)))) > 0  # each example's own, not zero
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def test_ghost_clipping_with_cudnn_attention_gives_the_norms_and_sums_of_xla_attention(monkeypatch):
  """DP-ghost with `attention="cudnn"` (the examples folded into heads, the kernel replaced by
  XLA's on this host): the per-example norms (the relative position table's included) and the
  clipped sum of `attention="xla"`."""
  from private_t5.dp import ghost
  from private_t5.dp.privacy_params import NoisySum
  from private_t5.train.trainer import make_loss_fn
  fused = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, implementation=None, **kw: fused(*a, implementation="xla", **kw))
  batch = dict(_batch(batch=3), example_weight=np.ones(3, np.float32))
  params = init_params(_config(), jax.random.PRNGKey(0))

  def clipped(config):
    aggregator = ghost.GhostDPAggregator(make_loss_fn(config), NoisySum(0.05, 0.0, 3))
    return jax.jit(lambda p, b: aggregator.ghost_clipped_sum(p, b, None))(params, batch)

  (got_sum, got_losses, got_norms, _), (want_sum, want_losses, want_norms, _) = (
      clipped(_config(attention=a)) for a in ("cudnn", "xla"))
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
  np.testing.assert_allclose(got_norms, want_norms, rtol=1e-5)
  assert float(jnp.max(jnp.abs(got_sum["encoder"]["relpos_bias"]["rel_embedding"]))) > 0
  for a, b in zip(jax.tree.leaves(got_sum), jax.tree.leaves(want_sum)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
