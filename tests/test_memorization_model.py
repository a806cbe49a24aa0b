"""Extraction and canary exposure on a tiny T5 deliberately overfit on real documents.

The model (the real `t5_1_0_tiny` preset, a 500-piece SentencePiece vocabulary trained on
fortunes) is trained non-privately with a short optax loop on a few linux_docs documents
(prompt P=16 tokens -> next T=8 tokens) and on one canary; it must then regenerate the
training continuations (high EM) but not those of unseen documents (EM ~ 0), and the
inserted canary must have exposure ~ log2|R| while a never-inserted one does not.
"""
import gzip
import json
import math
import os

import numpy as np
import pytest
from conftest import shared_or_fixture

P, T = 16, 8
NUM_TRAIN, NUM_UNSEEN = 8, 8
# The split detection settings of the stage runs below (fewer permutations than the default).
SPLIT_CONFIG_FLAGS = ["--gin.SplitConfig.num_perm=900", "--gin.SplitConfig.num_bands=90",
                      "--gin.SplitConfig.num_workers=1"]
# The overfit run: full-batch Adam, a warmup then cosine decay to 0, from PRNGKey(0), no dropout;
# every input (documents, vocabulary, canaries, split detection) is fixed, so it computes the same
# thing on every run. After it, each position of each training continuation has its target token
# ahead of the runner-up by >= OVERFIT_MARGIN nats (teacher-forced), so greedy decoding regenerates
# all NUM_TRAIN of them. Measured: the smallest of those margins is 7.5-8.0 nats for init seeds
# 0-5 on the fixture data (tests/data) and on ../shared/data, so numerics that differ between
# machines do not come near it.
OVERFIT_STEPS = 250
OVERFIT_LEARNING_RATE = 3e-3
OVERFIT_WARMUP = 20
OVERFIT_MARGIN = 3.0


def _read_jsonl(path, limit):
  out = []
  with gzip.open(path, "rt", encoding="utf-8") as f:
    for line in f:
      out.append(json.loads(line))
      if len(out) >= limit:
        break
  return out


def _train_overfit(batch, config, steps=None, seed=0, learning_rate=None):
  """Full-batch Adam on `batch` from PRNGKey(seed): (params, the loss of every step)."""
  import jax
  import jax.numpy as jnp
  import optax
  from private_t5.models import network
  from private_t5.models import config as config_lib
  from private_t5.models import model
  steps = OVERFIT_STEPS if steps is None else steps
  learning_rate = OVERFIT_LEARNING_RATE if learning_rate is None else learning_rate
  params = network.init_params(config, jax.random.PRNGKey(seed))
  opt = optax.adam(optax.warmup_cosine_decay_schedule(0.0, learning_rate, OVERFIT_WARMUP, steps))
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    loss_fn = lambda p: jnp.mean(model.example_loss_fn(p, batch, config))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(loss)
  return jax.device_get(params), [float(x) for x in jax.device_get(losses)]


def _target_margins(params, config, examples):
  """Per continuation, the smallest teacher-forced log-probability lead of its target token over
  the most likely other token (nats; negative where another token is ahead)."""
  import jax
  from private_t5.models import network
  from private_t5.models import config as config_lib
  from private_t5.models import model
  targets = np.stack(examples.targets)
  logits = model.EncoderDecoderModel(config).compute_logits(
      params, {"encoder_input_tokens": examples.inputs, "decoder_target_tokens": targets})
  logp = np.array(jax.nn.log_softmax(logits.astype(np.float32)))
  target = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  np.put_along_axis(logp, targets[..., None], -np.inf, -1)
  return (target - logp.max(-1)).min(-1)


@pytest.fixture(scope="module")
def overfit(shared_data, tmp_path_factory):
  from private_t5.models import network
  from private_t5.models import config as config_lib
  from private_t5.models import model
  from private_t5.documents import Document
  from private_t5.eval import canaries as canaries_lib
  from private_t5.eval import memorization
  from private_t5.tokenizer import spm
  from private_t5 import vocabulary

  tmp = tmp_path_factory.mktemp("overfit")
  fortunes = _read_jsonl(os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz"), 4000)
  vocab_path = spm.train_from_sentences((d["text"] for d in fortunes), str(tmp / "spm.model"), vocab_size=500)
  vocab = vocabulary.load_vocabulary(vocab_path)
  linux = _read_jsonl(shared_or_fixture("pretrain/linux_docs.jsonl.gz"), 200)
  docs = [Document(d["id"], d["text"]) for d in linux]
  tokens = memorization.tokenize_documents(vocab, [d.text for d in docs])
  # Documents long enough whose continuations differ (distinct first P+T tokens), and that the
  # split detection does not find near-duplicated in the pool (some corpora share boilerplate).
  # The T + 1 tokens the model is trained to continue with are all different: a 2-layer decoder
  # learns a repeated token ("/ /", ":: ::") only after many more steps (it must count positions),
  # which left some continuations undecided (two tokens tied) after the short training.
  from private_t5.eval import split_types
  from private_t5.eval import split_search
  split_config = split_types.SplitConfig(num_perm=900, num_bands=90, num_workers=1)  # as SPLIT_CONFIG_FLAGS
  found = split_search.build_splits(docs, [], split_config, tokenize=lambda text: vocab.encode(text))
  unique = set(found.ids["train_unique"])
  picked, seen = [], set()
  for d, t in zip(docs, tokens):
    if d.id not in unique:
      continue
    key = tuple(t[:P + T])
    if len(t) >= P + T + 1 and key not in seen and len(set(t[P:P + T + 1].tolist())) == T + 1:
      picked.append(d)
      seen.add(key)
    if len(picked) == NUM_TRAIN + NUM_UNSEEN:
      break
  train_docs, unseen_docs = picked[:NUM_TRAIN], picked[NUM_TRAIN:]

  fmt = canaries_lib.CanaryFormat(template="My ID is {secret}", length=3)
  cans, _ = canaries_lib.make_canaries(fmt, repetitions=(20,), num_reference=1, seed=7)
  inserted = [c for c in cans if c.repetitions]

  cfg = memorization.ExtractionConfig(prompt_length=P, generation_length=T, batch_size=8)
  # Targets run one token past T (as a longer document's continuation would), so that the
  # model does not learn to stop after T tokens.
  longer = memorization.ExtractionConfig(prompt_length=P, generation_length=T + 1)
  train_ex = memorization.prefix_examples([d.id for d in train_docs],
                                          memorization.tokenize_documents(vocab, [d.text for d in train_docs]), longer)
  enc_width, dec_width = P + 1, T + 1
  encoder = __import__("private_t5.eval.exposure", fromlist=["x"]).CandidateEncoder(vocab, fmt)
  rows_enc, rows_tgt = [], []
  for inp, tgt in zip(train_ex.inputs, train_ex.targets):
    rows_enc.append(inp)
    rows_tgt.append(tgt)
  for c in inserted:
    enc, tgt, w = encoder.encode([c.secret], dec_width)
    e = np.zeros(enc_width, np.int32)
    e[:enc.shape[1]] = enc[0]
    rows_enc.append(e)
    rows_tgt.append(tgt[0][w[0] > 0])
  n = len(rows_enc)
  enc = np.zeros((n, enc_width), np.int32)
  tgt = np.zeros((n, dec_width), np.int32)
  for i, (e, t) in enumerate(zip(rows_enc, rows_tgt)):
    enc[i, :len(e)] = e
    tgt[i, :len(t)] = t
  batch = {"encoder_input_tokens": enc, "decoder_target_tokens": tgt,
           "decoder_input_tokens": np.pad(tgt[:, :-1], ((0, 0), (1, 0))),
           "decoder_loss_weights": (tgt > 0).astype(np.float32)}

  vocab_rows = -(-vocab.vocab_size // 128) * 128
  config = config_lib.load_preset("t5_1_0_tiny", vocab_size=vocab_rows, dropout_rate=0.0)
  params, losses = _train_overfit(batch, config)
  return dict(params=params, config=config, vocab=vocab, vocab_path=vocab_path,
              train_docs=train_docs, unseen_docs=unseen_docs, canaries=cans, fmt=fmt, cfg=cfg,
              final_loss=losses[-1], tmp=tmp)


@pytest.mark.slow
def test_overfit_model_regenerates_training_continuations_only(overfit):
  from private_t5.eval import memorization
  o = overfit
  assert o["final_loss"] < 0.05, o["final_loss"]
  results = {}
  for name, docs in (("train", o["train_docs"]), ("unseen", o["unseen_docs"])):
    toks = memorization.tokenize_documents(o["vocab"], [d.text for d in docs])
    ex = memorization.prefix_examples([d.id for d in docs], toks, o["cfg"])
    assert ex.skipped == 0 and len(ex.ids) == len(docs)
    metrics, stats, _ = memorization.evaluate_split(o["params"], o["config"], ex, o["cfg"], verbose=False)
    results[name] = metrics
    assert stats.generated_tokens == len(docs) * T
    if name == "train":
      margins = _target_margins(o["params"], o["config"], ex)
  # Every training continuation is learnt with a clear margin, and regenerated.
  print(f"regenerated {round(results['train'].exact_match * NUM_TRAIN)} of {NUM_TRAIN} training continuations, "
        f"smallest margin {margins.min():.2f} nats (asked >= {OVERFIT_MARGIN})")
  assert margins.min() >= OVERFIT_MARGIN, margins
  assert results["train"].exact_match == 1.0, results
  assert results["train"].token_accuracy == 1.0, results
  assert results["train"].median_edit_distance == 0.0
  assert results["unseen"].exact_match <= 0.15, results
  assert results["unseen"].token_accuracy < 0.5, results
  assert results["unseen"].median_edit_distance >= 4
  # The span-corruption variant runs on the same documents (this prefix-LM model was not
  # trained to fill sentinels, so it does not regenerate the masked spans).
  toks = memorization.tokenize_documents(o["vocab"], [d.text for d in o["train_docs"]])
  span_ex = memorization.span_corruption_examples([d.id for d in o["train_docs"]], toks, o["cfg"],
                                                  o["vocab"].vocab_size)
  assert span_ex.skipped == 0 and span_ex.inputs.shape == (NUM_TRAIN, P)
  span, _, _ = memorization.evaluate_split(o["params"], o["config"], span_ex, o["cfg"], verbose=False)
  assert span.n == NUM_TRAIN and span.exact_match == 0.0


@pytest.mark.slow
def test_beam_search_and_uncached_reference_agree_with_greedy_on_memorized_text(overfit):
  import dataclasses
  from private_t5.eval import memorization
  o = overfit
  toks = memorization.tokenize_documents(o["vocab"], [d.text for d in o["train_docs"]])
  ex = memorization.prefix_examples([d.id for d in o["train_docs"]], toks, o["cfg"])
  greedy, _, g_preds = memorization.evaluate_split(o["params"], o["config"], ex, o["cfg"], verbose=False)
  nocache = dataclasses.replace(o["cfg"], use_cache=False)
  _, _, n_preds = memorization.evaluate_split(o["params"], o["config"], ex, nocache, verbose=False)
  np.testing.assert_array_equal(g_preds, n_preds)
  beam_cfg = dataclasses.replace(o["cfg"], beam_size=2)
  beam, _, _ = memorization.evaluate_split(o["params"], o["config"], ex, beam_cfg, method=memorization.BEAM,
                                           verbose=False)
  assert beam.exact_match >= greedy.exact_match - 0.15


@pytest.mark.slow
def test_inserted_canary_is_exposed_and_reference_is_not(overfit):
  from private_t5.eval import exposure, memorization
  o = overfit
  scorer = memorization.make_scorer(o["params"], o["config"])
  encoder = exposure.CandidateEncoder(o["vocab"], o["fmt"])
  evaluator = exposure.ExposureEvaluator(scorer, encoder, batch_size=250, max_exact=10_000)
  results = {r.repetitions: r for r in evaluator.evaluate(o["canaries"])}
  top = math.log2(1000)
  assert results[20].method == "exact"
  assert results[20].rank == 1 and results[20].exposure == pytest.approx(top)
  assert results[0].exposure < top - 3, results[0]
  # The extrapolated estimate agrees: the inserted canary is far in the tail of the fit.
  sampled = exposure.ExposureEvaluator(scorer, encoder, batch_size=250, max_exact=100, num_samples=500)
  est = {r.repetitions: r for r in sampled.evaluate(o["canaries"])}
  assert est[20].method == "skewnorm"
  assert est[20].exposure > top - 2
  assert est[0].exposure < top - 3


def _save_checkpoint(o, model_dir):
  """Writes the overfit parameters as a training run's checkpoint (the train stage's layout)."""
  import dataclasses
  from private_t5.dp.ledger import PrivacyLedger
  from private_t5.models import checkpoints
  manager = checkpoints.CheckpointManager(str(model_dir), async_save=False)
  ledger = PrivacyLedger.non_private_baseline(num_examples=len(o["train_docs"]), batch_size=len(o["train_docs"]))
  manager.save(400, {"params": o["params"]}, {
      "model_config": dataclasses.asdict(o["config"]), "vocab_path": o["vocab_path"],
      "privacy_report": ledger.report(), "feature_lengths": {"inputs": P + 1, "targets": T + 1},
      "data": {"objective": "prefix_lm"}})
  manager.close()
  # The operative Gin config the train stage writes beside its checkpoints names the objective.
  (model_dir / "config.gin").write_text("OBJECTIVE = 'prefix_lm'\n")


@pytest.mark.slow
def test_memorization_cli_end_to_end(overfit, tmp_path, capsys):
  from private_t5.stages import cli
  from private_t5.eval import canaries as canaries_lib
  from private_t5.tokenizer import spm
  from private_t5 import vocabulary
  o = overfit
  model_dir = tmp_path / "run"
  _save_checkpoint(o, model_dir)
  # The training corpus as the model saw it: the documents plus 20 copies of the canary.
  train_path = str(tmp_path / "train.jsonl")
  _, record, n_docs = canaries_lib.write_canary_corpus(o["train_docs"], train_path, o["fmt"], o["canaries"], seed=3)
  assert n_docs == NUM_TRAIN + 20
  valid_path = tmp_path / "valid.jsonl"
  valid_path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in o["unseen_docs"]))
  out_dir = tmp_path / "memorization"
  args = ["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.TRAIN_CORPUS={train_path}", f"--gin.VALID_CORPUS={valid_path}", f"--gin.OUTPUT_DIR={out_dir}",
          f"--gin.PROMPT_LENGTH={P}", f"--gin.GENERATION_LENGTH={T}", "--gin.BATCH_SIZE=8",
          f"--gin.CANARIES={record}", *SPLIT_CONFIG_FLAGS]
  assert cli.main(args) == 0
  report = json.loads((out_dir / "report.json").read_text())
  greedy = report["extraction"]["greedy"]
  assert report["epsilon_text"].startswith("ε = ∞")
  assert report["checkpoint"]["objective"] == "prefix_lm"
  # The 20 identical canary copies are near-duplicates of each other, too short for P + T.
  assert report["splits"]["sizes"] == {"train_dup": 20, "train_unique": NUM_TRAIN, "valid_in_train": 0,
                                       "valid_unique": NUM_UNSEEN}
  assert greedy["train_dup"]["n"] == 0 and greedy["train_dup"]["skipped"] == 20
  assert greedy["train_unique"]["n"] == NUM_TRAIN and greedy["train_unique"]["exact_match"] == 1.0
  assert greedy["valid_unique"]["n"] == NUM_UNSEEN and greedy["valid_unique"]["exact_match"] <= 0.15
  assert greedy["valid_in_train"]["n"] == 0 and greedy["valid_in_train"]["exact_match"] is None
  assert any("valid_in_train" in w and "empty" in w for w in report["warnings"])
  exposures = {c["repetitions"]: c for c in report["canaries"]}
  assert exposures[20]["exposure"] == pytest.approx(math.log2(1000))
  assert exposures[0]["exposure"] < math.log2(1000) - 3
  # Greedy decoding of the prefix gives the inserted canary's secret, not the reference's.
  assert exposures[20]["extracted"] is True and exposures[0]["extracted"] is False
  assert "| extracted |" in (out_dir / "report.md").read_text()
  assert report["throughput"]["generated_tokens"] == (NUM_TRAIN + NUM_UNSEEN) * T
  import jax
  assert report["devices"] == jax.device_count() and report["mesh_shape"] == [jax.device_count(), 1]
  for name in ("report.md", "extraction.png", "exposure.png"):
    assert (out_dir / name).stat().st_size > 0
  assert "| Train unique | 8 | 0 |" in (out_dir / "report.md").read_text()
  assert not report["splits"]["reused"]

  # A second run reuses the split file.
  assert cli.main(args) == 0
  assert json.loads((out_dir / "report.json").read_text())["splits"]["reused"]

  # Another vocabulary than the checkpoint's is refused with a clear message.
  other = spm.train_from_sentences((d.text for d in o["unseen_docs"]), str(tmp_path / "other.model"),
                                   vocab_size=300)
  capsys.readouterr()
  assert cli.main(args + [f"--gin.VOCAB_PATH={other}"]) == 2
  assert "differs from the one the checkpoint was trained with" in capsys.readouterr().err


@pytest.mark.slow
def test_memorization_on_two_processes_equals_one(overfit, tmp_path):
  """`private-t5 launch`: 2 processes x 2 devices decode on one mesh and report what 1 x 4 does."""
  import subprocess
  import sys
  from private_t5.eval import canaries as canaries_lib
  o = overfit
  model_dir = tmp_path / "run"
  _save_checkpoint(o, model_dir)
  train_path = str(tmp_path / "train.jsonl")
  canaries_lib.write_canary_corpus(o["train_docs"], train_path, o["fmt"], o["canaries"], seed=3)
  valid_path = tmp_path / "valid.jsonl"
  valid_path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in o["unseen_docs"]))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2")
  reports = {}
  # The third run splits the parameters over a model axis that spans both processes.
  for procs, devices, mesh in ((1, 4, "-1,1"), (2, 2, "-1,1"), (2, 2, "1,4")):
    out_dir = tmp_path / f"memorization_{procs}x{devices}_mesh{mesh.replace(',', '_')}"
    done = subprocess.run(
        [sys.executable, "-m", "private_t5.stages.cli", "launch", f"--num_processes={procs}",
         f"--devices_per_process={devices}", "--", "memorization", "--gin_file=configs/runs/memorization.gin",
         f"--gin.MODEL_DIR={model_dir}", f"--gin.TRAIN_CORPUS={train_path}", f"--gin.VALID_CORPUS={valid_path}",
         f"--gin.OUTPUT_DIR={out_dir}", f"--gin.PROMPT_LENGTH={P}", f"--gin.GENERATION_LENGTH={T}",
         "--gin.BATCH_SIZE=4", f"--mesh_shape={mesh}", *SPLIT_CONFIG_FLAGS], cwd=root, env=env, capture_output=True,
        text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stdout.count("[memorization] wrote") == 1  # written once, by process 0
    if procs == 2 and mesh == "-1,1":  # the split file is built once, by process 0; process 1 reads it
      assert "[p0] [memorization] splits written to" in done.stdout
      assert "[p1] [memorization] splits reused from" in done.stdout
    reports[(procs, mesh)] = json.loads((out_dir / "report.json").read_text())
  one, two = reports[(1, "-1,1")]["extraction"]["greedy"], reports[(2, "-1,1")]["extraction"]["greedy"]
  assert one == two == reports[(2, "1,4")]["extraction"]["greedy"]
  # One mesh of the 4 devices of both processes decodes, as the one process's 4 devices do.
  assert [r["devices"] for r in reports.values()] == [4, 4, 4]
  assert [r["mesh_shape"] for r in reports.values()] == [[4, 1], [4, 1], [1, 4]]
  assert two["train_unique"]["n"] == NUM_TRAIN and two["valid_unique"]["n"] == NUM_UNSEEN


@pytest.mark.slow
def test_uniform_training_sample_finds_the_memorized_documents_only(overfit, tmp_path):
  """configs/runs/memorization_50_50.gin (at P, T of the overfit model): the training sample
  holds the memorized documents and the unseen ones put in the same corpus; the first are exact
  and approximate matches, the others are not."""
  from private_t5.stages import cli
  o = overfit
  model_dir = tmp_path / "run"
  _save_checkpoint(o, model_dir)
  train_path = tmp_path / "train.jsonl"
  docs = o["train_docs"] + o["unseen_docs"]
  train_path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
  valid_path = tmp_path / "valid.jsonl"
  valid_path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in o["unseen_docs"][:4]))
  out_dir = tmp_path / "memorization"
  sample = NUM_TRAIN + NUM_UNSEEN - 2
  args = ["memorization", "--gin_file=configs/runs/memorization_50_50.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.TRAIN_CORPUS={train_path}", f"--gin.VALID_CORPUS={valid_path}", f"--gin.OUTPUT_DIR={out_dir}",
          f"--gin.PROMPT_LENGTH={P}", f"--gin.GENERATION_LENGTH={T}", "--gin.BATCH_SIZE=8",
          f"--gin.TRAIN_SAMPLE_SIZE={sample}", "--gin.APPROXIMATE_THRESHOLD=0.25", "--gin.MAX_EXAMPLES_PER_SPLIT=4",
          *SPLIT_CONFIG_FLAGS]
  assert cli.main(args) == 0
  report = json.loads((out_dir / "report.json").read_text())
  assert report["settings"]["train_sample_size"] == sample and report["settings"]["approximate_threshold"] == 0.25
  assert report["train_sample"]["eligible"] == NUM_TRAIN + NUM_UNSEEN
  assert report["train_sample"]["evaluated"] == sample
  got = report["extraction"]["greedy"]["train_sample"]
  per_doc = report["per_document"]["greedy"]["train_sample"]
  assert got["n"] == sample == len(per_doc["ids"]) and got["skipped"] == 0
  trained = {d.id for d in o["train_docs"]}
  order = [d.id for d in docs]
  assert per_doc["ids"] == sorted(per_doc["ids"], key=order.index)  # in corpus order
  seen = [(e, a) for i, e, a in zip(per_doc["ids"], per_doc["exact"], per_doc["approximate"]) if i in trained]
  unseen = [(e, a) for i, e, a in zip(per_doc["ids"], per_doc["exact"], per_doc["approximate"]) if i not in trained]
  assert seen and unseen and len(seen) + len(unseen) == sample
  assert all(e == a == 1 for e, a in seen), seen
  assert sum(e for e, _ in unseen) <= 1 and sum(a for _, a in unseen) <= 1, unseen
  assert got["exact_matches"] == sum(per_doc["exact"]) and got["approximate_matches"] == sum(per_doc["approximate"])
  low, high = got["exact_match_ci"]
  assert low < got["exact_match"] < high
  assert report["decoding"]["greedy/train_sample"]["prompts"] == sample
  assert report["decoding"]["greedy/train_sample"]["prompts_per_second"] > 0
  assert report["extraction"]["greedy"]["overall"]["n"] == sum(
      report["extraction"]["greedy"][s]["n"] for s in ("train_dup", "train_unique", "valid_in_train", "valid_unique"))
  md = (out_dir / "report.md").read_text()
  assert f"| Train sample (uniform) | {sample} | 0 |" in md and "approx. % (≤ 0.25)" in md
