"""The one-run privacy audit (Steinke, Nasr and Jagielski 2023): the bound, the guesses, the
membership draw of the audit canaries, `private-t5 canaries --audit`, and the report section."""
import decimal
import gzip
import json
import math
import os
import stat

import numpy as np
import pytest

from private_t5.dp import auditing
from private_t5.errors import ConfigError, DataError


def _exact_p_value(m, r, v, eps, delta):
  """The bound's formula summed term by term in 60-digit decimal arithmetic (q rounded to a float first)."""
  with decimal.localcontext() as ctx:
    ctx.prec = 60
    q = decimal.Decimal(1.0 / (1.0 + math.exp(-eps)))
    pmf = [math.comb(r, j) * q ** j * (1 - q) ** (r - j) for j in range(r + 1)]
    tail = sum(pmf[v:], decimal.Decimal(0))
    alpha = max([sum(pmf[v - i:v], decimal.Decimal(0)) / i for i in range(1, v + 1)], default=0)
    return min(1.0, float(tail + 2 * m * decimal.Decimal(delta) * alpha))


def _logit(p):
  return math.log(p / (1 - p))


@pytest.mark.parametrize("r", [1, 10, 100, 1000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_pure_dp_perfect_guesses_closed_form(r, confidence):
  # δ = 0, all r guesses right: P[Binomial(r, q) >= r] = q^r = β, so ε = logit(β^(1/r)).
  expected = _logit((1 - confidence) ** (1 / r))
  got = auditing.epsilon_lower_bound(r, r, r, 0.0, confidence)
  assert got == pytest.approx(max(expected, 0.0), abs=1e-5)
  assert got <= max(expected, 0.0) + 1e-9  # rounded down: never claims more than the data shows


@pytest.mark.parametrize("m, r, v, eps, delta", [
    (1000, 200, 150, 0.8, 1e-5), (1000, 600, 600, 5.0, 1e-5), (50, 20, 15, 1.0, 1e-3), (10, 10, 7, 0.3, 0.01),
    (1000, 100, 100, 3.0, 1e-5), (1000, 100, 0, 1.0, 1e-5), (100, 40, 30, 2.0, 0.0)])
def test_p_value_matches_exact_arithmetic(m, r, v, eps, delta):
  assert auditing.p_value(m, r, v, eps, delta) == pytest.approx(_exact_p_value(m, r, v, eps, delta), rel=1e-9,
                                                                abs=1e-15)


def test_bound_is_where_the_test_stops_rejecting():
  for m, r, v, delta in ((1000, 600, 600, 1e-5), (1000, 200, 150, 1e-5), (64, 32, 30, 1e-5), (2000, 1000, 700, 1e-6)):
    eps = auditing.epsilon_lower_bound(m, r, v, delta, 0.95)
    assert eps > 0
    assert auditing.p_value(m, r, v, eps, delta) <= 0.05
    assert auditing.p_value(m, r, v, eps + 1e-4, delta) > 0.05


def test_no_bound_at_chance_or_without_guesses():
  assert auditing.epsilon_lower_bound(1000, 0, 0, 1e-5) == 0.0
  assert auditing.epsilon_lower_bound(1000, 500, 250, 1e-5) == 0.0
  assert auditing.epsilon_lower_bound(1000, 500, 260, 1e-5) == 0.0  # +10 is within the noise at 95%
  assert auditing.epsilon_lower_bound(1000, 500, 270, 1e-5) > 0.0  # +20 is not (one-sided p = 0.04)
  assert auditing.epsilon_lower_bound(1000, 500, 100, 1e-5) == 0.0  # worse than chance proves nothing


def test_monotone_in_correct_guesses_delta_confidence_and_guesses():
  by_correct = [auditing.epsilon_lower_bound(1000, 200, v, 1e-5) for v in range(100, 201, 5)]
  assert all(a <= b for a, b in zip(by_correct, by_correct[1:])) and by_correct[0] == 0 < by_correct[-1]
  by_delta = [auditing.epsilon_lower_bound(1000, 400, 380, d) for d in (0.0, 1e-8, 1e-6, 1e-5, 1e-4, 1e-3)]
  assert all(a >= b for a, b in zip(by_delta, by_delta[1:])) and by_delta[0] > by_delta[-1]
  by_conf = [auditing.epsilon_lower_bound(1000, 400, 380, 1e-5, c) for c in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)]
  assert all(a >= b for a, b in zip(by_conf, by_conf[1:]))
  # Same precision (90%), more guesses: a larger bound.
  by_r = [auditing.epsilon_lower_bound(1000, r, int(0.9 * r), 1e-5) for r in (50, 100, 200, 400, 1000)]
  assert all(a < b for a, b in zip(by_r, by_r[1:]))
  # The most an audit can show grows like ln(r): m = 1000, all correct, δ = 0 -> about 5.8.
  assert auditing.max_lower_bound(1000) == pytest.approx(_logit(0.05 ** 0.001), abs=1e-5)


def test_bad_counts_are_config_errors():
  for args in ((10, 5, 6, 1e-5), (10, 11, 5, 1e-5), (10, -1, 0, 1e-5)):
    with pytest.raises(ConfigError):
      auditing.epsilon_lower_bound(*args)
  with pytest.raises(ConfigError, match="confidence"):
    auditing.epsilon_lower_bound(10, 5, 5, 1e-5, confidence=1.0)
  with pytest.raises(ConfigError, match="delta"):
    auditing.p_value(10, 5, 5, 1.0, 1.5)


def test_guesses_top_and_bottom_k():
  scores = np.array([0.5, 3.0, -1.0, 2.0, 2.0, np.nan, 0.0])
  g = auditing.guess_membership(scores, 2, 2)
  assert g.tolist() == [0, 1, -1, 1, 0, -1, 0]  # tie 2.0/2.0 broken by position; NaN ranks lowest
  assert auditing.guess_membership(scores, 0, 0).tolist() == [0] * 7
  with pytest.raises(ConfigError):
    auditing.guess_membership(scores, 4, 4)
  res = auditing.audit(-np.arange(8.0), [1, 1, 1, 1, 0, 0, 0, 0], 2, 2, 1e-5)
  assert (res.guesses, res.correct, res.num_included) == (4, 4, 4)
  res = auditing.audit(np.arange(8.0), [1, 1, 1, 1, 0, 0, 0, 0], 2, 2, 1e-5)
  assert res.correct == 0 and res.epsilon_lower_bound == 0.0


def test_membership_is_bernoulli_half():
  from scipy import stats
  included, seed = auditing.draw_membership(20_000, seed=5)
  assert seed == 5 and included.dtype == bool
  assert stats.binomtest(int(included.sum()), 20_000, 0.5).pvalue > 1e-3
  # Independent coins: consecutive pairs are uniform over the four outcomes.
  pairs = 2 * included[:-1:2].astype(int) + included[1::2].astype(int)
  assert stats.chisquare(np.bincount(pairs, minlength=4)).pvalue > 1e-3
  # Over seeds, each canary is in half of the time.
  draws = np.stack([auditing.draw_membership(50, seed=s)[0] for s in range(400)])
  assert all(stats.binomtest(int(c), 400, 0.5).pvalue > 1e-4 for c in draws.sum(axis=0))
  assert (auditing.draw_membership(50, seed=1)[0] == auditing.draw_membership(50, seed=1)[0]).all()
  fresh = [auditing.draw_membership(64)[1] for _ in range(2)]
  assert fresh[0] != fresh[1]  # OS entropy by default
  with pytest.raises(ConfigError):
    auditing.draw_membership(0)


def _corpus(path, docs):
  path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs))
  return str(path)


def test_membership_does_not_depend_on_the_data(tmp_path, shared_data):
  from private_t5.data import corpora
  from private_t5.eval import audit
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  docs = list(corpora.iter_documents(src, max_documents=400))
  a = audit.plant(docs[:200], str(tmp_path / "a.jsonl"), num_canaries=100, seed=9)[3]
  b = audit.plant(docs[200:], str(tmp_path / "b.jsonl"), num_canaries=100, seed=9)[3]
  assert (a.included == b.included).all() and a.texts != b.texts  # words come from each corpus
  c = audit.plant(docs[:200], str(tmp_path / "c.jsonl"), num_canaries=100, seed=10)[3]
  assert (a.included != c.included).any()


def test_plant_writes_included_copies_and_a_private_record(tmp_path, shared_data):
  from private_t5.data import corpora
  from private_t5.eval import audit
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  docs = list(corpora.iter_documents(src, max_documents=300))
  out = str(tmp_path / "train_audit.jsonl.gz")
  corpus, record, n, rec = audit.plant(docs, out, num_canaries=60, length=6, repetitions=3, seed=4, source=src)
  assert record == str(tmp_path / "train_audit.audit.json")
  assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
  with gzip.open(corpus, "rt") as f:
    rows = [json.loads(line) for line in f]
  assert n == len(rows) == 300 + 3 * int(rec.included.sum())
  texts = [r["text"] for r in rows]
  for t, inc in zip(rec.texts, rec.included):
    assert texts.count(t) == (3 if inc else 0) and len(t.split()) == 6
  assert [r["id"] for r in rows if not r["id"].startswith("audit-")] == [d.id for d in docs]
  again = audit.load_record(record)
  assert again.texts == rec.texts and (again.included == rec.included).all() and again.repetitions == 3
  # Never into a model directory.
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  with pytest.raises(ConfigError, match="model directory"):
    audit.plant(docs, str(run / "x.jsonl"), num_canaries=10, seed=1)
  (tmp_path / "bad.audit.json").write_text("{}")
  with pytest.raises(DataError, match="not an audit record"):
    audit.load_record(str(tmp_path / "bad.audit.json"))


def test_canaries_cli_audit(tmp_path, shared_data, capsys):
  from private_t5.stages import cli
  from private_t5.eval import audit
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  small = tmp_path / "small.jsonl"
  with gzip.open(src, "rt") as f:
    small.write_text("".join(next(f) for _ in range(200)))
  out = tmp_path / "audit.jsonl"
  assert cli.main(["canaries", "--audit", f"--corpus={small}", f"--output={out}", "--num_canaries=40",
                   "--canary_length=5", "--repetitions=2", "--seed=3"]) == 0
  rec = audit.load_record(str(tmp_path / "audit.audit.json"))
  assert rec.num_canaries == 40 and rec.seed == 3 and rec.repetitions == 2
  assert len(out.read_text().splitlines()) == 200 + 2 * int(rec.included.sum())
  assert "0600" in capsys.readouterr().out
  for bad, message in ((["--repetitions=1,10"], "one positive integer"), (["--canary_kind=tokens"], "--vocab_path"),
                       (["--canary_kind=chars"], "--canary_kind")):
    assert cli.main(["canaries", "--audit", f"--corpus={small}", f"--output={tmp_path / 'b.jsonl'}", *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_token_canaries_and_loss_scoring(tmp_path, shared_data):
  from micro_run import fortunes_corpus_and_vocab
  from private_t5.eval import audit
  from private_t5.tokenizer import spm
  _, vocab_path = fortunes_corpus_and_vocab(shared_data, str(tmp_path))
  vocab = spm.load_vocabulary(vocab_path)
  texts = audit.make_texts("tokens", 30, 6, seed=2, vocab=vocab)
  assert len(set(texts)) == 30
  enc, tgt, w = audit.encode_for_scoring(vocab, texts, "sentinel")
  assert (enc[:, 0] > 0).all() and (tgt[:, 0] == vocab.vocab_size - 1).all() and w.sum(axis=1).min() >= 2
  # Prefix LM: the second half, never longer than the training targets (here 3 tokens + EOS).
  _, tgt, w = audit.encode_for_scoring(vocab, texts, "prefix")
  _, short, w_short = audit.encode_for_scoring(vocab, texts, "prefix", max_target_tokens=3)
  assert w_short.sum(axis=1).max() <= 4 < w.sum(axis=1).max() and (short[:, 0] > 0).all()
  # Losses are -log p / target tokens, in batches of a fixed shape.
  seen = []

  def score(e, t, wt):
    seen.append(e.shape)
    return -np.arange(len(e), dtype=np.float64) * wt.sum(axis=1)

  losses = audit.canary_losses(score, vocab, texts, "prefix", batch_size=8)
  assert len(set(seen)) == 1 and seen[0][0] == 8
  assert losses.tolist() == [float(i % 8) for i in range(30)]


def _explicit_clipped_sum(vectors, clip_norm, clip=True):
  """A clipped sum written out in numpy: sum_i w_i min(1, C / ||v_i||) v_i (or unclipped)."""
  def run(batch):
    norms = np.linalg.norm(vectors, axis=1)
    factors = np.minimum(1.0, clip_norm / norms) if clip else np.ones_like(norms)
    return {"w": np.einsum("b,bd->d", factors * batch["example_weight"], vectors)}
  return run


def test_sensitivity_ratios_of_an_explicit_clipped_sum():
  vectors = np.array([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0], [1.0, 1.0]])  # norms 5, 0.5, 10, sqrt 2
  batch = {"example_weight": np.array([1, 1, 1, 0], np.float32)}  # the last row is padding
  ratios = auditing.sensitivity_ratios(_explicit_clipped_sum(vectors, 2.0), batch, 2.0)
  np.testing.assert_allclose(ratios, [1.0, 0.25, 1.0])  # min(||v_i||, C) / C for the real rows
  unclipped = auditing.sensitivity_ratios(_explicit_clipped_sum(vectors, 2.0, clip=False), batch, 2.0)
  assert unclipped.max() == pytest.approx(5.0)  # a sum without the clip fails the bound
  assert batch["example_weight"].tolist() == [1, 1, 1, 0]  # the caller's batch is not modified


def test_report_section_is_loud_on_a_violation():
  from private_t5.eval import report
  base = {"epsilon_lower_bound": 2.5, "confidence": 0.95, "delta": 1e-5, "num_canaries": 200, "num_included": 98,
          "guesses": 100, "correct": 99, "k_plus": 50, "ledger_epsilon": 1.0, "ledger_scope": "training + components",
          "max_lower_bound": 3.2, "repetitions": 1, "violation": True}
  text = "\n".join(report.audit_markdown(base))
  assert "PRIVACY AUDIT FAILED" in text and "| 2.500 | 95% |" in text
  assert "FAILED" not in "\n".join(report.audit_markdown(dict(base, violation=False, epsilon_lower_bound=0.5)))


def test_memorization_refuses_a_missing_audit_record_first(tmp_path, capsys):
  from private_t5.stages import cli
  args = ["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={tmp_path}/none",
          f"--gin.TRAIN_CORPUS={tmp_path}/t.jsonl", f"--gin.VALID_CORPUS={tmp_path}/v.jsonl",
          f"--gin.OUTPUT_DIR={tmp_path}/out", f"--gin.AUDIT={tmp_path}/missing.audit.json"]
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "audit record not found" in err[0]
