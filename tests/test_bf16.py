"""bfloat16 activations with the DP guarantee kept in float32, on a tiny T5 v1.1 fed real text.

The float32 and the bfloat16 model share one set of float32 parameters; only
`T5Config.dtype` differs. Compiled functions are built once per module.

Tolerance of the sensitivity checks (derived in docs/model.md, "Activation dtype"): the norm
that sets each clip factor and the term that is summed are computed from the same float32
values (vmap: the per-example gradient cast to float32 once; ghost book-keeping: the
recorded bfloat16 inputs and output gradients cast to float32 once), so the only gap is
float32 rounding of the norm, the factor and the batch sums, a few 1e-6 of C for these
sizes; SENSITIVITY_RTOL = 1e-5 is the float32 tolerance tests/test_dp_aggregator.py uses.
"""
import gzip
import json
import os
import re

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm

from private_t5.dp.config import SECOND_PASS
from private_t5.models import config as config_lib
from private_t5.models import network
from private_t5.models import model
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp import auditing, clipping, ghost
from private_t5.dp import noise as noise_lib
from private_t5.dp.aggregator import DPAggregator
from private_t5.errors import ConfigError
from private_t5.stages import gin_utils
from private_t5.tokenizer.spm import train_from_sentences
from private_t5.models import checkpoint_read
from private_t5.stages import train as train_stage
from private_t5.train import optimizers
from private_t5.models import sharding
from private_t5.train.trainer import Trainer, make_loss_fn

from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab

INPUT_LENGTH, TARGET_LENGTH, BATCH = 32, 8, 8
CLIP = 1.0
EXPECTED_BATCH = 6.0
SENSITIVITY_RTOL = 1e-5
DROPOUT_KEY = jax.random.PRNGKey(3)
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def examples(shared_data, tmp_path_factory):
  """Prefix-LM rows from fortunes: the first half of a fortune's tokens in, the rest out."""
  texts = []
  with gzip.open(os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz"), "rt", encoding="utf-8") as f:
    for line in f:
      texts.append(json.loads(line)["text"])
      if len(texts) == 1500:
        break
  model_path = str(tmp_path_factory.mktemp("vocab") / "fortunes.model")
  train_from_sentences(texts, model_path, vocab_size=256)
  sp = spm.SentencePieceProcessor(model_file=model_path)
  rows = []
  for text in texts[::7]:
    ids = sp.encode(text)
    if len(ids) >= 12:
      cut = min(len(ids) // 2, INPUT_LENGTH - 1)
      rows.append((ids[:cut] + [1], ids[cut:cut + TARGET_LENGTH - 1] + [1]))
    if len(rows) == BATCH:
      break
  assert len(rows) == BATCH
  return rows


@pytest.fixture(scope="module")
def batch(examples):
  """8 rows, the last two padding (their tokens are real text: only example_weight marks them)."""
  enc = np.zeros((BATCH, INPUT_LENGTH), np.int32)
  tgt = np.zeros((BATCH, TARGET_LENGTH), np.int32)
  for row, (inputs, targets) in enumerate(examples):
    enc[row, :len(inputs)], tgt[row, :len(targets)] = inputs, targets
  dec = np.concatenate([np.zeros((BATCH, 1), np.int32), tgt[:, :-1]], axis=1)
  weight = np.array([1] * 6 + [0] * 2, np.float32)
  return dict(encoder_input_tokens=enc, decoder_input_tokens=dec, decoder_target_tokens=tgt,
              decoder_loss_weights=(tgt > 0).astype(np.float32), example_weight=weight)


@pytest.fixture(scope="module")
def configs():
  base = config_lib.load_preset("t5_1_1_tiny", vocab_size=384, num_encoder_layers=1,
                            num_decoder_layers=1, dropout_rate=0.1)
  return {dtype: base.replace(dtype=dtype) for dtype in DTYPES}


@pytest.fixture(scope="module")
def params(configs):
  return network.init_params(configs["float32"], jax.random.PRNGKey(0))


def _loss_fn(config):
  loss = make_loss_fn(config)
  return lambda p, b, k: loss(p, b, k)


@pytest.fixture(scope="module")
def aggregators(configs):
  """(dtype, "vmap" | "ghost") -> the DP aggregator (noise multiplier 0.5)."""
  out = {}
  for dtype, config in configs.items():
    loss_fn = _loss_fn(config)
    out[dtype, "vmap"] = DPAggregator(loss_fn, NoisySum(CLIP, 0.5, EXPECTED_BATCH))
    out[dtype, "ghost"] = ghost.GhostDPAggregator(loss_fn, NoisySum(CLIP, 0.5, EXPECTED_BATCH))
  return out


@pytest.fixture(scope="module")
def ghost_sums(aggregators):
  """dtype -> compiled (params, batch) -> (clipped sum, losses, norms, factors): ghost clipping
  with the aggregator's per-row dropout keys."""
  keys = clipping.example_keys(DROPOUT_KEY, jnp.arange(BATCH, dtype=jnp.int32))
  return {dtype: jax.jit(lambda p, b, a=aggregators[dtype, "ghost"]: a.ghost_clipped_sum(p, b, keys))
          for dtype in DTYPES}


@pytest.fixture(scope="module")
def vmap_bf16_sum(aggregators):
  return jax.jit(aggregators["bfloat16", "vmap"].clipped_sum)


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs nested in it (jit, custom_jvp, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(item, "jaxpr", item)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


def test_network_computes_in_the_activation_dtype_with_float32_params(configs, params, batch):
  """Matmuls in bfloat16 on float32 parameters; norms, softmax, logits and loss in float32."""
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  ops = {}
  for dtype, config in configs.items():
    closed = jax.make_jaxpr(lambda p, b, config=config: model.example_loss_fn(p, b, config))(params, batch)
    assert closed.out_avals[0].dtype == jnp.float32  # the per-example loss
    eqns = list(_equations(closed.jaxpr))
    ops[dtype] = {name: [e for e in eqns if str(e.primitive) == name]
                  for name in ("dot_general", "exp", "rsqrt", "reduce_max")}
  for dtype in DTYPES:
    dots = ops[dtype]["dot_general"]
    # Per layer 4 projections + 2 einsums per attention and 3 MLP kernels: encoder 9, decoder
    # 15, then the logits.
    assert len(dots) == 25
    assert {str(v.aval.dtype) for e in dots for v in e.invars} == {dtype}
    # RMSNorm's rsqrt, the softmax's and the loss's exp: float32 whatever the activations.
    for name in ("exp", "rsqrt"):
      assert ops[dtype][name] and {str(e.outvars[0].aval.dtype) for e in ops[dtype][name]} == {"float32"}


def test_bf16_per_example_norms_within_one_percent_of_float32(aggregators, ghost_sums, params, batch):
  """Ghost norms in both dtypes, and bfloat16 per-example gradients under vmap (float32 values)."""
  real = batch["example_weight"] > 0
  f32 = np.asarray(ghost_sums["float32"](params, batch)[2])[real]
  bf16 = np.asarray(ghost_sums["bfloat16"](params, batch)[2])[real]
  rows = jnp.arange(BATCH, dtype=jnp.int32)
  vmap = aggregators["bfloat16", "vmap"]
  _, grads = jax.jit(lambda p, b: vmap.per_example_grads(p, b, rows, DROPOUT_KEY))(params, batch)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  bf16_vmap = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)).reshape(BATCH, -1), axis=1)
                          for g in jax.tree.leaves(grads)))[real]
  assert np.all(f32 > CLIP)  # every real example is clipped
  np.testing.assert_allclose(bf16, f32, rtol=1e-2)
  np.testing.assert_allclose(bf16_vmap, f32, rtol=1e-2)
  # In bfloat16 the two methods agree much more closely (both read the same bf16 activations).
  np.testing.assert_allclose(bf16, bf16_vmap, rtol=1e-3)


def test_bf16_dp_update_is_close_to_float32(aggregators, ghost_sums, params, batch):
  """One noisy DP gradient in both dtypes: the noise, the division by qN and the output are
  float32, and the same key gives the same noise bit for bit."""
  noise_key = jax.random.PRNGKey(11)
  clean, noisy = {}, {}
  for dtype in DTYPES:
    agg = aggregators[dtype, "ghost"]
    grad_sum = ghost_sums[dtype](params, batch)[0]
    assert {g.dtype for g in jax.tree.leaves(grad_sum)} == {jnp.dtype(jnp.float32)}
    update = jax.jit(lambda p, g, k: noise_lib.apply(noise_lib.transform_for(agg), agg.finalize(p, g), {}, p, k))(
        params, grad_sum, noise_key)
    assert {g.dtype for g in jax.tree.leaves(update)} == {jnp.dtype(jnp.float32)}
    clean[dtype], noisy[dtype] = _flat(grad_sum) / EXPECTED_BATCH, _flat(update)
  np.testing.assert_allclose(noisy["bfloat16"] - noisy["float32"],
                             clean["bfloat16"] - clean["float32"], atol=1e-6)
  # The noiseless update (6 clipped gradients of norm C, / qN) moves by a few 1e-3 of itself.
  c16, c32 = clean["bfloat16"], clean["float32"]
  assert np.linalg.norm(c16 - c32) <= 2e-2 * np.linalg.norm(c32)
  assert float(np.dot(c16, c32) / np.linalg.norm(c16) / np.linalg.norm(c32)) > 0.999


def _scaled(params, factor):
  """Params with the decoder's final norm scaled: logits, hence gradients, grow with it."""
  out = dict(params, decoder=dict(params["decoder"]))
  out["decoder"]["decoder_norm"] = {"scale": params["decoder"]["decoder_norm"]["scale"] * factor}
  return out


@pytest.mark.parametrize("method", ["vmap", "ghost", "ghost_dot_product_attention", "ghost_stacked_layers"])
def test_the_audit_measures_max_change_over_c_in_bf16(method, configs, ghost_sums, vmap_bf16_sum, params, batch):
  """max ||S(D) - S(D')|| / C over add/remove neighbours, bfloat16 activations: <= 1 (+ float32
  rounding), on both sides of the clip (tiny gradients kept whole, large ones clipped); also
  with the attention as one `jax.nn.dot_product_attention` call (`T5Config.attention="xla"`), and
  with the layers of one shape stacked (`GhostDPAggregator(stack_layers=True)`)."""
  if method == "vmap":
    fn = lambda p, b: vmap_bf16_sum(p, b, DROPOUT_KEY)[0]
  elif method == "ghost":
    fn = lambda p, b: ghost_sums["bfloat16"](p, b)[0]
  elif method == "ghost_stacked_layers":
    aggregator = ghost.GhostDPAggregator(_loss_fn(configs["bfloat16"]), NoisySum(CLIP, 0.5, EXPECTED_BATCH),
                                         stack_layers=True)
    fn = jax.jit(lambda p, b: aggregator.ghost_clipped_sum(p, b, None)[0])
  else:
    config = configs["bfloat16"].replace(attention="xla", dropout_rate=0.0)
    aggregator = ghost.GhostDPAggregator(_loss_fn(config), NoisySum(CLIP, 0.5, EXPECTED_BATCH))
    compiled = jax.jit(lambda p, b: aggregator.ghost_clipped_sum(p, b, None)[0])
    fn = compiled
  measured = {}
  for factor in (1e-3, 1.0, 1e3):
    scaled = _scaled(params, factor)
    ratios = auditing.sensitivity_ratios(lambda b, s=scaled: fn(s, b), batch, CLIP)
    assert ratios.shape == (6,)
    measured[factor] = float(np.max(ratios))
    assert measured[factor] <= 1 + SENSITIVITY_RTOL, (factor, ratios)
  assert measured[1e-3] < 0.5  # unclipped: each example moves the sum by its own norm
  assert measured[1.0] > 1 - SENSITIVITY_RTOL and measured[1e3] > 1 - SENSITIVITY_RTOL  # tight


def test_second_pass_is_refused_with_bf16_activations(aggregators, params, batch):
  agg = aggregators["bfloat16", "ghost"]
  second = ghost.GhostDPAggregator(agg.loss_fn, NoisySum(CLIP, 0.0, EXPECTED_BATCH), clipped_sum_method=SECOND_PASS)
  with pytest.raises(ConfigError, match="second pass.*bfloat16.*bookkeeping"):
    jax.eval_shape(second.clipped_sum, params, batch)


def test_bf16_train_step_keeps_params_and_optimizer_state_float32(configs, aggregators, params, batch):
  mesh = sharding.create_mesh((1, 1), jax.devices()[:1])
  trainer = Trainer(configs["bfloat16"], aggregators["bfloat16", "ghost"],
                    optimizers.adafactor(learning_rate=1e-2), mesh)
  state = trainer.init_state(jax.random.PRNGKey(0), initial_params=params)
  before = _flat(state.params)
  state, metrics = trainer.train_step(state, batch, jax.random.PRNGKey(1), jax.random.PRNGKey(2))
  leaves = jax.tree.leaves((state.params, state.opt_state))
  assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
  after = _flat(state.params)
  assert np.all(np.isfinite(after)) and np.any(after != before)
  assert np.isfinite(float(metrics["nondp/loss"]))


def _dtype_from(files, bindings=()):
  gin_utils.parse(files, list(bindings), check_required=False, entry="T5Config")
  try:
    return gin_utils.configured("T5Config")().dtype
  finally:
    gin.clear_config()


@pytest.mark.parametrize("name, dtype", [
    ("t5_1_1_small", "bfloat16"), ("t5_1_1_base", "bfloat16"), ("t5_1_1_large", "bfloat16"), ("t5_1_1_xl", "bfloat16"),
    ("t5_1_1_tiny", "float32"), ("t5_1_0_small", "float32"), ("t5_1_0_tiny", "float32")])
def test_model_files_set_the_activation_dtype_macro(name, dtype):
  assert _dtype_from([f"configs/models/{name}.gin"]) == dtype == config_lib.load_preset(name).dtype
  other = "float32" if dtype == "bfloat16" else "bfloat16"
  assert _dtype_from([f"configs/models/{name}.gin"], [f"ACTIVATION_DTYPE = '{other}'"]) == other


@pytest.mark.slow
def test_bf16_dp_training_end_to_end(shared_data, tmp_path):
  """`private-t5 train` with `ACTIVATION_DTYPE='bfloat16'` on fortunes: DP steps with ghost
  clipping, a checkpoint whose parameters are float32 and whose config keeps the dtype."""
  corpus, vocab = fortunes_corpus_and_vocab(shared_data, str(tmp_path))
  model_dir = str(tmp_path / "run")
  summary = train_stage.run_from_args([
      "--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
      f"--gin.CORPUS={corpus}", f"--gin.VOCAB_PATH={vocab}", "--gin.TRAIN_STEPS=2",
      f"--gin.DATA_CACHE_DIR={tmp_path}/cache", *MICRO_TRAIN_ARGS,
      "--gin.ACTIVATION_DTYPE='bfloat16'", "--gin.train.clipping_method='ghost'"])
  assert summary["final_step"] == 2 and summary["private"]
  params, config, _ = checkpoint_read.restore_for_inference(model_dir)
  assert config.dtype == "bfloat16"
  leaves = jax.tree.leaves(params)
  assert {np.asarray(x).dtype for x in leaves} == {np.dtype(np.float32)}
  assert all(np.all(np.isfinite(np.asarray(x))) for x in leaves)



# --- the book-keeping sums on tensor cores: bfloat16 products, float32 accumulation ---------------

def test_bf16_parts_add_up_to_the_float32_value_exactly():
  from private_t5.dp import ghost_norms as gn  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  x = (rng.normal(size=4096) * 2.0 ** rng.uniform(-60, 60, size=4096)).astype(np.float32)
  x[:4] = [0.0, -0.0, 1.0, np.float32(1) + np.float32(2 ** -23)]
  parts = jax.jit(gn.bf16_parts)(jnp.asarray(x))
  assert all(p.dtype == jnp.bfloat16 for p in parts)
  total = sum(np.asarray(p, np.float64) for p in parts)
  np.testing.assert_array_equal(total, x.astype(np.float64))


def test_the_bf16_book_keeping_sum_is_the_float32_contraction():
  """`sum_i w_i a_i^T g_i` of bfloat16 inputs and output gradients, formed from bfloat16 parts,
  is the float32 contraction of the float32 terms `w_i a_it` (up to float32 rounding of the sums),
  with only bfloat16 x bfloat16 products accumulated in float32."""
  from private_t5.dp import ghost_norms as gn  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(6)
  a = jnp.asarray(rng.normal(size=(4, 40, 24)), jnp.bfloat16)
  g = jnp.asarray(rng.normal(size=(4, 40, 16)) * 1e-3, jnp.bfloat16)
  w = jnp.asarray(rng.uniform(0, 1, size=4), jnp.float32)
  got = np.asarray(jax.jit(gn.linear_weighted_sum)(a, g, w), np.float64)
  scaled = np.asarray(a, np.float32) * np.asarray(w)[:, None, None]  # the float32 terms, as summed
  want = np.einsum("bti,bto->io", scaled.astype(np.float64), np.asarray(g, np.float64))
  scale = np.einsum("bti,bto->io", np.abs(scaled).astype(np.float64), np.abs(np.asarray(g, np.float64)))
  assert np.max(np.abs(got - want) / scale) < 1e-6
  dots = [eqn for eqn in jax.make_jaxpr(gn.linear_weighted_sum)(a, g, w).jaxpr.eqns
          if eqn.primitive.name == "dot_general"]
  assert len(dots) == 3 and all({str(v.aval.dtype) for v in eqn.invars} == {"bfloat16"}
                                and eqn.params["preferred_element_type"] == jnp.float32 for eqn in dots)


_DOT_GENERAL = re.compile(r"stablehlo\.dot_general.*:\s*\(tensor<[0-9x]*(\w+)>,\s*tensor<[0-9x]*(\w+)>\)")


def _float32_matmuls(method):
  from private_t5.experiments import benchmark_case as bench  # pylint: disable=g-import-not-at-top
  config, trainer = bench.make_trainer("t5_1_1_tiny", method, 2, 1.0, 1.0, 0.0, "bfloat16")
  batch = bench.random_batch(config.vocab_size, 2, 32, 8, 0)
  keys = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))
  text = trainer.lower_train_step(trainer.abstract_state(), batch, *keys, platforms=("cuda",)).as_text()
  operands = [m.groups() for m in map(_DOT_GENERAL.search, text.splitlines()) if m]
  assert operands
  return sum(1 for pair in operands if pair == ("f32", "f32"))


def test_the_dp_ghost_step_for_a_gpu_has_no_more_float32_matmuls_than_non_dp():
  """Lowered for CUDA (read here), the bf16 DP-ghost step's norms and book-keeping sums are all
  bfloat16 products accumulated in float32 (tensor cores): no float32 x float32 `dot_general`
  beyond the non-DP step's."""
  from private_t5.experiments import benchmark_case as bench  # pylint: disable=g-import-not-at-top
  assert _float32_matmuls(bench.GHOST) <= _float32_matmuls(bench.NONDP)
