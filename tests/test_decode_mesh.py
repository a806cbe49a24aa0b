"""Decoding and scoring on a mesh (models/mesh_inference.py): prompts over `data`, parameters as
in training; the tokens and the memorization metrics equal the one-device decode's.

The tests run on the 8 fake CPU devices of conftest.py, with one tiny random model and a few
prompts compiled once per mesh (module-scoped fixtures).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5 import models
from private_t5.models import config as config_lib
from private_t5.models import network
from private_t5.models import model as model_lib
from private_t5.eval import memorization
from private_t5.models import decoding, layers, mesh_inference, sharding

VOCAB, WIDTH, LENGTH, ROWS, BEAM = 256, 9, 6, 11, 3
# Meshes (data, model) against the one-device decode; 11 prompts in batches of 4 make a padded
# last batch, and 4 is rounded up to the 8 data positions of (8, 1).
MESHES = [(1, 1), (8, 1), (2, 4)]


@pytest.fixture(scope="module")
def tiny():
  config = config_lib.load_preset("t5_1_1_tiny", vocab_size=VOCAB)
  params = network.init_params(config, jax.random.PRNGKey(0))
  inputs = np.random.default_rng(0).integers(3, VOCAB, size=(ROWS, WIDTH)).astype(np.int32)
  inputs[3, 4:] = 0  # a shorter prompt
  one = jax.devices()[0]
  on_one = jax.device_put(params, one)
  greedy = np.asarray(decoding.greedy_decode(on_one, config, jax.device_put(inputs, one), max_decode_length=LENGTH))
  beam, _ = decoding.beam_search(on_one, config, jax.device_put(inputs, one), max_decode_length=LENGTH,
                                 beam_size=BEAM)
  return dict(config=config, params=params, inputs=inputs, greedy=greedy, beam=np.asarray(beam)[:, 0])


@pytest.fixture(scope="module", params=MESHES, ids=lambda s: f"mesh{s[0]}x{s[1]}")
def on_mesh(request, tiny):
  shape = request.param
  mesh = sharding.create_mesh(shape, jax.devices()[:shape[0] * shape[1]])
  return shape, memorization.make_inference(tiny["params"], tiny["config"], mesh)


def test_greedy_tokens_equal_the_one_device_decode(tiny, on_mesh):
  shape, inference = on_mesh
  assert inference.devices == shape[0] * shape[1]
  out = inference.decode(tiny["inputs"], LENGTH, batch_size=4)
  np.testing.assert_array_equal(out, tiny["greedy"])


@pytest.mark.parametrize("shape", [(8, 1), (2, 4)])
def test_beam_tokens_equal_the_one_device_decode(tiny, shape):
  mesh = sharding.create_mesh(shape)
  inference = memorization.make_inference(tiny["params"], tiny["config"], mesh)
  out = inference.decode(tiny["inputs"], LENGTH, batch_size=8, method=models.model.BEAM, beam_size=BEAM)
  np.testing.assert_array_equal(out, tiny["beam"])


def test_padding_rows_are_masked(tiny):
  """Rows marked inactive (a padded batch's filler) decode to zeros; the others as without a mask."""
  active = np.arange(ROWS) % 3 != 0
  out = np.asarray(decoding.greedy_decode(tiny["params"], tiny["config"], tiny["inputs"], max_decode_length=LENGTH,
                                          active=active))
  assert not out[~active].any()
  np.testing.assert_array_equal(out[active], tiny["greedy"][active])
  # EOS is the first token of row 1: with only that row active, every row has ended after one step.
  eos = int(tiny["greedy"][1, 0])
  only = np.zeros(ROWS, bool)
  only[1] = True
  one_step = np.asarray(decoding.greedy_decode(tiny["params"], tiny["config"], tiny["inputs"],
                                               max_decode_length=LENGTH, eos_id=eos, active=only))
  assert one_step[1, 0] == eos and not one_step[:, 1:].any() and not one_step[~only].any()


def test_fully_sharded_parameters_decode_the_same_tokens(tiny):
  """`embed` also over `data` (ZeRO-3): every parameter split over all 8 devices."""
  mesh = sharding.create_mesh((4, 2))
  inference = memorization.make_inference(tiny["params"], tiny["config"], mesh, sharding.FULLY_SHARDED_RULES)
  total = sum(x.nbytes for x in jax.tree.leaves(inference.params))
  assert sharding.bytes_per_device(inference.params) < 0.25 * total
  np.testing.assert_array_equal(inference.decode(tiny["inputs"], LENGTH, batch_size=4), tiny["greedy"])


def test_parameters_are_laid_out_by_the_training_rules(tiny, on_mesh):
  shape, inference = on_mesh
  placed = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(inference.params)}
  expected = sharding.param_shardings(network.param_logical_axes(tiny["config"]), network.param_shapes(tiny["config"]),
                                      inference.mesh)
  for key, want in jax.tree_util.tree_leaves_with_path(expected):
    assert placed[jax.tree_util.keystr(key)].sharding.is_equivalent_to(want, len(want.spec) or 1)
  total = sum(x.nbytes for x in placed.values())
  per_device = sharding.bytes_per_device(inference.params)
  if shape[1] == 1:
    assert per_device == total  # replicated over `data`
  else:
    assert per_device < 0.5 * total  # the large dimensions split over `model`


def test_memorization_metrics_on_eight_devices_equal_one(tiny):
  """`evaluate_split` through the mesh: 1 vs 8 devices give the same tokens and EM / TA / MED."""
  cfg = memorization.ExtractionConfig(prompt_length=WIDTH - 1, generation_length=LENGTH, batch_size=8)
  # Targets: the greedy tokens on the odd rows (exact matches), one token changed on the others.
  targets = [g.copy() for g in tiny["greedy"]]
  for t in targets[::2]:
    t[2] = 3 + (t[2] + 1) % (VOCAB - 3)
  examples = memorization.ExtractionExamples(ids=[str(i) for i in range(ROWS)], inputs=tiny["inputs"],
                                             targets=targets, skipped=2, max_target_length=LENGTH)
  results = {}
  for devices in (1, 8):
    mesh = sharding.create_mesh((devices, 1), jax.devices()[:devices])
    inference = memorization.make_inference(tiny["params"], tiny["config"], mesh)
    metrics, stats, preds = memorization.evaluate_split(None, tiny["config"], examples, cfg, verbose=False,
                                                        inference=inference)
    assert stats.prompts == ROWS and stats.generated_tokens == ROWS * LENGTH
    results[devices] = (metrics.as_dict(), np.asarray(preds))
  assert results[1][0] == results[8][0]
  assert results[1][0]["exact_match"] == pytest.approx(5 / ROWS)
  np.testing.assert_array_equal(results[1][1], results[8][1])
  np.testing.assert_array_equal(results[8][1], tiny["greedy"])


def test_scores_on_the_mesh_equal_one_device(tiny, on_mesh):
  _, inference = on_mesh
  targets = np.random.default_rng(1).integers(3, VOCAB, size=(5, LENGTH)).astype(np.int32)
  weights = np.ones(targets.shape, np.float32)
  weights[0, 3:] = 0
  reference = jax.jit(model_lib.EncoderDecoderModel(tiny["config"]).score_batch)(
      tiny["params"], {"encoder_input_tokens": tiny["inputs"][:5], "decoder_target_tokens": targets,
                       "decoder_loss_weights": weights})
  got = memorization.make_scorer(None, tiny["config"], inference)(tiny["inputs"][:5], targets, weights)
  assert got.shape == (5,)
  np.testing.assert_allclose(got, np.asarray(reference), rtol=1e-5, atol=1e-4)


def test_a_compile_only_object_gives_the_memory_of_a_mesh_program(tiny):
  """No parameters needed: the decode program lowered from shapes, its per-device memory."""
  mesh = sharding.create_mesh((2, 4))
  inference = mesh_inference.MeshInference(tiny["config"], mesh)
  compiled = inference.lower_decode(8, WIDTH, LENGTH).compile()
  assert compiled.memory_analysis().argument_size_in_bytes > 0
  with pytest.raises(ValueError, match="compile only"):
    inference.decode(tiny["inputs"], LENGTH, batch_size=8)


@pytest.mark.parametrize("bad, message", [
    (["--mesh_shape=3,3"], "needs 9 devices, only 8 available"),
    (["--gin.MESH_SHAPE=(3, -1)"], "does not divide the 8 devices"),
    (["--mesh_shape=two"], "expected DATA,MODEL"),
    (["--gin.run_memorization.parameter_sharding='zero'"], "parameter_sharding must be one of"),
])
def test_memorization_refuses_a_bad_mesh_before_loading(bad, message, tmp_path, capsys):
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  rc = cli.main(["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={tmp_path}/none",
                 f"--gin.TRAIN_CORPUS={tmp_path}/t.jsonl", f"--gin.VALID_CORPUS={tmp_path}/v.jsonl",
                 f"--gin.OUTPUT_DIR={tmp_path}/out", *bad])
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
  assert message in errors[0]
  assert not (tmp_path / "out").exists()


def test_training_and_evaluation_share_the_rules():
  assert sharding.LOGICAL_AXIS_RULES == sharding.LOGICAL_AXIS_RULES
  assert sharding.FULLY_SHARDED_RULES == sharding.FULLY_SHARDED_RULES
  assert sharding.axis_rules("fully_sharded") == sharding.axis_rules("fully_sharded")


def test_glue_evaluation_on_the_mesh_equals_one_device(shared_data, tmp_path):
  """`evaluate`'s decoding: a (2, 4) mesh of 8 devices predicts the texts one device does, and
  the results record the devices."""
  from private_t5.eval import glue_eval  # pylint: disable=g-import-not-at-top
  from test_glue_tasks import train_test_vocab  # pylint: disable=g-import-not-at-top,g-bad-import-order
  vocab = train_test_vocab(shared_data, tmp_path / "glue.model", vocab_size=400)
  config = config_lib.load_preset("t5_1_1_tiny", vocab_size=512)
  params = network.init_params(config, jax.random.PRNGKey(2))
  lengths = {"inputs": 24, "targets": 4}
  runs = {}
  for shape in ((1, 1), (2, 4)):
    mesh = sharding.create_mesh(shape, jax.devices()[:shape[0] * shape[1]])
    runs[shape] = glue_eval.evaluate_params(params, config, "rotten_tomatoes", vocab, lengths, batch_size=4,
                                            max_examples=10, progress=False, mesh=mesh)
  for shape, results in runs.items():
    assert results["devices"] == shape[0] * shape[1] and results["mesh_shape"] == list(shape)
    task, reference = results["tasks"]["rotten_tomatoes"], runs[(1, 1)]["tasks"]["rotten_tomatoes"]
    assert task["examples"] == reference["examples"] and task["metrics"] == reference["metrics"]
  assert len({e["prediction"] for e in runs[(1, 1)]["tasks"]["rotten_tomatoes"]["examples"]}) > 1


def test_parameters_cast_once_give_the_same_logits_and_tokens_in_bfloat16():
  """`layers.cast_at_use` (the decode program casts kernels and embeddings to the activation
  dtype once, outside its loop): bit for bit the model's own casts, layer-norm scales kept."""
  config = config_lib.load_preset("t5_1_1_tiny", vocab_size=VOCAB, dtype="bfloat16")
  params = network.init_params(config, jax.random.PRNGKey(1))
  cast = layers.cast_at_use(params, config.dtype)
  kinds = {jax.tree_util.keystr(k).split("'")[-2]: v.dtype for k, v in jax.tree_util.tree_leaves_with_path(cast)}
  assert kinds == {"kernel": jnp.bfloat16, "embedding": jnp.bfloat16, "rel_embedding": jnp.bfloat16,
                   "scale": jnp.float32}
  assert layers.cast_at_use(params, "float32") is params
  inputs = np.random.default_rng(1).integers(3, VOCAB, size=(ROWS, WIDTH)).astype(np.int32)
  model = models.model.EncoderDecoderModel(config)
  batch = {"encoder_input_tokens": inputs, "decoder_target_tokens": inputs[:, :LENGTH],
           "decoder_loss_weights": np.ones((ROWS, LENGTH), np.float32)}
  np.testing.assert_array_equal(np.asarray(model.score_batch(cast, batch)), np.asarray(model.score_batch(params, batch)))
  want = np.asarray(decoding.greedy_decode(params, config, inputs, max_decode_length=LENGTH))
  inference = memorization.make_inference(params, config, sharding.create_mesh((1, 1), jax.devices()[:1]))
  np.testing.assert_array_equal(inference.decode(inputs, LENGTH, batch_size=4), want)
