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
  from private_t5 import vocabulary
  _, vocab_path = fortunes_corpus_and_vocab(shared_data, str(tmp_path))
  vocab = vocabulary.load_vocabulary(vocab_path)
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
  assert "PRIVACY AUDIT FAILED" in text and "| 2.500 | – | 95% |" in text
  assert "FAILED" not in "\n".join(report.audit_markdown(dict(base, violation=False, epsilon_lower_bound=0.5)))
  # The library's figures, when the audit has them: f-DP bound, TPR at fixed FPR, AUROC, saturation.
  full = dict(base, violation=False, epsilon_lower_bound_fdp=4.25, max_lower_bound_fdp=5.0,
              method="CanaryScoreAuditor.epsilon_one_run", saturation="all guesses right: the bound is the cap",
              tpr_at_fpr=[{"fpr": 0.01, "tpr": 0.5, "interval": [0.4, 0.6]}, {"fpr": 0.001, "tpr": 0.25, "interval": None}],
              auroc=0.9, auroc_interval=[0.85, 0.95], steinke={"epsilon_lower_bound": 2.0, "method": "k a side"})
  text = "\n".join(report.audit_markdown(full))
  assert "| 2.500 | 4.25 | 95% |" in text and "CanaryScoreAuditor.epsilon_one_run" in text and "(f-DP: 5.000)" in text
  assert "**saturated**: all guesses right" in text and "TPR at FPR 1%: 0.5 (0.4 to 0.6)" in text
  assert "TPR at FPR 0.1%: 0.25" in text and "AUROC: 0.9 (0.85 to 0.95)" in text and "99 of 100 guesses right" in text


def test_memorization_refuses_a_missing_audit_record_first(tmp_path, capsys):
  from private_t5.stages import cli
  args = ["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={tmp_path}/none",
          f"--gin.TRAIN_CORPUS={tmp_path}/t.jsonl", f"--gin.VALID_CORPUS={tmp_path}/v.jsonl",
          f"--gin.OUTPUT_DIR={tmp_path}/out", f"--gin.AUDIT={tmp_path}/missing.audit.json"]
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "audit record not found" in err[0]


# jax-privacy's CanaryScoreAuditor: the report's figures.

def _three_level_scores():
  """100 in, 100 out on three score levels: the ROC is concave, so its hull is the ROC itself.

  Level 3: 40 in, 0 out; level 2: 40 in, 20 out; level 1: 20 in, 80 out. ROC points (FPR, TPR):
  (0, 0), (0, 0.4), (0.2, 0.8), (1, 1). TPR at FPR f <= 0.2 is 0.4 + 2 f; AUROC is
  0.2 (0.4 + 0.8) / 2 + 0.8 (0.8 + 1) / 2 = 0.84 (= P[in > out] + P[tie] / 2).
  """
  scores = np.array([3.0] * 40 + [2.0] * 40 + [1.0] * 20 + [2.0] * 20 + [1.0] * 80)
  return scores, np.arange(200) < 100


def test_library_tpr_and_auroc_on_a_hand_made_roc():
  scores, included = _three_level_scores()
  res = auditing.score_audit(scores, included, 1e-5, 0.95, bootstrap_samples=100, bootstrap_seed=3)
  assert [t["fpr"] for t in res.tpr_at_fpr] == [0.01, 0.001]
  assert [t["tpr"] for t in res.tpr_at_fpr] == pytest.approx([0.42, 0.402], abs=1e-12)
  assert res.auroc == pytest.approx(0.84, abs=1e-12)
  for value, (lo, hi) in [(t["tpr"], t["interval"]) for t in res.tpr_at_fpr] + [(res.auroc, res.auroc_interval)]:
    assert 0 <= lo <= value <= hi <= 1 and hi - lo < 0.3
  assert res.num_included == res.num_held_out == 100 and not res.saturated
  assert 0 < res.epsilon_one_run < res.epsilon_one_run_cap and res.epsilon_one_run < res.epsilon_one_run_fdp
  # In = the included canaries' scores, higher = member. Negated, the ROC falls below the chance
  # line (AUROC 0.16), whose hull is the chance line itself: the library reports no attack.
  flipped = auditing.score_audit(-scores, included, 1e-5, bootstrap_samples=0)
  assert flipped.auroc == 0.5 and [t["tpr"] for t in flipped.tpr_at_fpr] == pytest.approx([0.01, 0.001])
  assert flipped.epsilon_one_run == 0.0
  assert flipped.auroc_interval is None and flipped.tpr_at_fpr[0]["interval"] is None
  again = auditing.score_audit(scores, included, 1e-5, 0.95, bootstrap_samples=100, bootstrap_seed=3)
  assert again == res  # the bootstrap is seeded


def test_library_bound_saturates_when_every_guess_is_right():
  included, _ = auditing.draw_membership(64, seed=1)  # 31 in, 33 out
  scores = np.where(included, 10.0, 0.0) + np.linspace(0, 1, 64)
  res = auditing.score_audit(scores, included, 1e-5, bootstrap_samples=20)
  assert res.saturated and res.auroc == 1.0 and all(t["tpr"] == 1.0 for t in res.tpr_at_fpr)
  assert res.epsilon_one_run == res.epsilon_one_run_cap and res.epsilon_one_run_fdp == res.epsilon_one_run_fdp_cap
  # The library's cap: every included canary guessed in and right, β shared among the 3 vertices of
  # the separated ROC's hull (Bonferroni); the f-DP bound's cap is far higher.
  assert res.epsilon_one_run == pytest.approx(auditing.epsilon_lower_bound(64, 31, 31, 1e-5, 1 - 0.05 / 3), abs=2e-6)
  assert res.epsilon_one_run == pytest.approx(1.954, abs=1e-3)
  assert res.epsilon_one_run_fdp == pytest.approx(3.775, abs=1e-3)
  text = auditing.saturation_text(res.num_included, res.num_held_out, res.epsilon_one_run_cap)
  assert text.startswith("all guesses right: the bound is the cap for 64 canaries (31 included, 33 held out), 1.954")
  # One included canary below a held-out one: no longer saturated, and below the cap.
  scores[np.flatnonzero(included)[0]] = -1.0
  res = auditing.score_audit(scores, included, 1e-5, bootstrap_samples=0)
  assert not res.saturated and res.epsilon_one_run < res.epsilon_one_run_cap


def test_library_bound_on_scores_without_signal_is_near_zero():
  rng = np.random.default_rng(3)
  included = rng.random(1000) < 0.5
  res = auditing.score_audit(rng.normal(size=1000), included, 1e-5, bootstrap_samples=50)
  ledger_epsilon = 1.0
  assert res.epsilon_one_run == 0.0 and res.epsilon_one_run_fdp < 0.1 < ledger_epsilon
  assert res.epsilon_one_run_cap > 4.5 and not res.saturated  # 0 is a measurement, not a cap
  # The hull's AUROC is optimistic for the attack on a finite sample (0.522 here), its interval too.
  assert 0.5 <= res.auroc < 0.55 and all(t["tpr"] < 0.03 for t in res.tpr_at_fpr)
  # Over many draws without signal the bound is positive at most about 1 - confidence of the time.
  from jax_privacy import auditing as jpa
  positive = 0
  for _ in range(300):
    inc = rng.random(64) < 0.5
    s = rng.normal(size=64)
    positive += jpa.CanaryScoreAuditor(s[inc], s[~inc]).epsilon_one_run(0.05, 1e-5) > 0
  assert positive / 300 < 0.09  # 0.05 + 3 standard errors


@pytest.mark.parametrize("m, r, v, delta, confidence", [
    (1000, 200, 150, 1e-5, 0.95), (1000, 600, 600, 1e-5, 0.95), (64, 32, 30, 1e-5, 0.95), (128, 32, 32, 1e-5, 0.99),
    (256, 100, 80, 1e-3, 0.9), (50, 20, 15, 1e-3, 0.95), (1000, 500, 270, 1e-5, 0.95), (10, 10, 7, 0.01, 0.95),
    (10_000, 5000, 3000, 1e-6, 0.95)])
def test_own_bound_agrees_with_the_librarys_epsilon_one_run(m, r, v, delta, confidence):
  # r canaries score 1 (guessed in), v of them included; the rest score 0. At the explicit threshold
  # 1 the library bounds exactly these counts. Both root finders stop within 1e-6 of the crossing
  # p(ε) = β (brentq's xtol; the bisection's width, rounded down), and both p-values are the same
  # formula to rounding, so they agree to 2e-6.
  from jax_privacy import auditing as jpa
  n_in = max(v, m // 2)
  ins = np.r_[np.ones(v), np.zeros(n_in - v)]
  outs = np.r_[np.ones(r - v), np.zeros(m - n_in - (r - v))]
  lib = float(jpa.CanaryScoreAuditor(ins, outs).epsilon_one_run(1 - confidence, delta,
                                                                 threshold_strategy=jpa.Explicit(1.0)))
  ours = auditing.epsilon_lower_bound(m, r, v, delta, confidence)
  assert -1e-6 <= lib - ours <= 2e-6, (lib, ours)


def test_library_audit_refuses_what_it_cannot_bound():
  with pytest.raises(DataError, match="included and held-out"):
    auditing.score_audit([1.0, 2.0], [True, True], 1e-5)
  with pytest.raises(ConfigError, match=r"delta must be in \(0, 1\)"):
    auditing.score_audit([1.0, 2.0], [True, False], 0.0)
  with pytest.raises(ConfigError, match="bootstrap samples"):
    auditing.score_audit([1.0, 2.0], [True, False], 1e-5, bootstrap_samples=-1)
  with pytest.raises(ConfigError, match="scores for"):
    auditing.score_audit([1.0, 2.0, 3.0], [True, False], 1e-5)


class _Tokenizer:
  """Canary i -> [i + 2, 2, 3, 4]: the encoder input starts with i + 2."""

  def __init__(self, texts):
    self.index = {t: i for i, t in enumerate(texts)}

  def encode(self, texts):
    return [[self.index[t] + 2, 2, 3, 4] for t in texts]


class _Vocab:
  vocab_size = 10_000

  def __init__(self, texts):
    self.tokenizer = _Tokenizer(texts)


def _audit_run(tmp_path, losses, included, privacy_report=None, **kwargs):
  """run_audit on a record of len(losses) canaries, canary i scored with loss losses[i]."""
  from private_t5.eval import audit
  texts = [f"canary {i}" for i in range(len(losses))]
  record = audit.AuditRecord(texts=texts, included=np.asarray(included), repetitions=1, seed=1, kind="words",
                             length=2, source="", corpus="")
  path = audit.write_record(record, str(tmp_path / "r.audit.json"), documents=0)
  losses = np.asarray(losses, np.float64)
  score = lambda enc, tgt, w: -losses[enc[:, 0] - 2] * w.sum(axis=1)
  lines = []
  out = audit.run_audit(score, _Vocab(texts), path, scoring="prefix", privacy_report=privacy_report,
                        log=lines.append, **kwargs)
  json.dumps(out)  # report.json takes it as it is
  return out, "\n".join(lines)


def test_run_audit_reports_the_library_figures_and_saturation(tmp_path):
  included, _ = auditing.draw_membership(64, seed=1)
  losses = np.where(included, 1.0, 3.0) + np.linspace(0, 0.1, 64)
  out, log = _audit_run(tmp_path, losses, included, bootstrap_samples=20)
  # What study.py, report.py and the tests read.
  assert {"epsilon_lower_bound", "confidence", "num_canaries", "guesses", "correct", "ledger_epsilon", "delta",
          "violation", "ledger_scope", "num_included", "k_plus", "max_lower_bound", "repetitions",
          "mean_loss_included", "mean_loss_excluded", "histogram", "comparable_with_ledger"} <= set(out)
  assert out["method"].startswith("jax_privacy.auditing.CanaryScoreAuditor.epsilon_one_run (jax-privacy 2.")
  assert out["method_fdp"].startswith("jax_privacy.auditing.CanaryScoreAuditor.epsilon_one_run_fdp")
  assert (out["num_canaries"], out["num_included"], out["num_held_out"], out["guesses"], out["correct"]) == \
      (64, 31, 33, 32, 32)
  assert out["epsilon_lower_bound"] == out["max_lower_bound"] == pytest.approx(1.954, abs=1e-3)
  assert out["epsilon_lower_bound_fdp"] == out["max_lower_bound_fdp"] > 3.5
  assert out["saturated"] and out["saturation"].startswith("all guesses right: the bound is the cap for 64 canaries")
  assert out["auroc"] == 1.0 and [t["fpr"] for t in out["tpr_at_fpr"]] == [0.01, 0.001]
  assert out["bootstrap"]["samples"] == 20 and out["auroc_interval"] == [1.0, 1.0]
  own = out["steinke"]  # the cross-check: k = 16 a side, all right
  assert own["saturated"] and own["epsilon_lower_bound"] == own["max_lower_bound"] == pytest.approx(2.3, abs=0.05)
  assert own["saturation"] == ("all guesses right: the bound is the cap for 32 guesses on 64 canaries, "
                               f"{own['max_lower_bound']:.3f}")
  assert out["ledger_epsilon"] is None and not out["violation"] and not out["fdp_exceeds_ledger"]
  assert "jax_privacy.auditing.CanaryScoreAuditor; 64 canaries: 31 included, 33 held out; 95% confidence" in log
  assert "privacy audit saturated: all guesses right" in log and "AUROC 1 [1, 1]" in log


def test_run_audit_compares_the_librarys_bound_with_the_ledger(tmp_path):
  included, _ = auditing.draw_membership(64, seed=1)
  rng = np.random.default_rng(0)
  dp_report = {"epsilon": 1.0, "delta": 1e-5}
  out, log = _audit_run(tmp_path, rng.normal(3.0, 0.1, 64), included, dp_report, bootstrap_samples=0)
  assert out["epsilon_lower_bound"] < 0.5 and out["epsilon_lower_bound_fdp"] < 1.0
  assert out["comparable_with_ledger"] and not out["violation"] and not out["saturated"] and out["saturation"] is None
  assert out["auroc_interval"] is None and "FAILED" not in log and "saturated" not in log
  separated = np.where(included, 1.0, 3.0)
  out, log = _audit_run(tmp_path, separated, included, dict(dp_report, epsilon=0.5), bootstrap_samples=0)
  assert out["violation"] and "PRIVACY AUDIT FAILED: the ε lower bound 1.954" in log
  # Between the two bounds: the f-DP bound refutes a Gaussian trade-off, noted but not a failure.
  out, log = _audit_run(tmp_path, separated, included, dict(dp_report, epsilon=3.0), bootstrap_samples=0)
  assert not out["violation"] and out["fdp_exceeds_ledger"] and "note: the one-run f-DP bound 3.775" in log
  with pytest.raises(ConfigError, match=r"audit delta must be in \(0, 1\)"):
    _audit_run(tmp_path, separated, included, delta=0.0)


def test_run_audit_reports_each_kind_of_a_record_of_several(tmp_path):
  from private_t5.eval import audit, report
  included, _ = auditing.draw_membership(128, seed=2)
  kinds = ("words", "rare_words") * 64
  # The rare-word canaries are memorized (separated), the words canaries are not (noise).
  rng = np.random.default_rng(0)
  losses = np.where(np.asarray(kinds) == "rare_words", np.where(included, 1.0, 3.0), rng.normal(3.0, 0.1, 128))
  texts = [f"canary {i}" for i in range(128)]
  record = audit.AuditRecord(texts=texts, included=included, repetitions=1, seed=1, kind="words,rare_words",
                             length=2, source="", corpus="", canary_kinds=kinds)
  path = audit.write_record(record, str(tmp_path / "r.audit.json"), documents=0)
  score = lambda enc, tgt, w: -losses[enc[:, 0] - 2] * w.sum(axis=1)
  lines = []
  out = audit.run_audit(score, _Vocab(texts), path, scoring="prefix", privacy_report={"epsilon": 1.0, "delta": 1e-5},
                        bootstrap_samples=0, log=lines.append)
  json.dumps(out)
  by = out["by_kind"]
  assert list(by) == ["words", "rare_words"] and by["words"]["num_canaries"] == by["rare_words"]["num_canaries"] == 64
  for name in by:  # each kind is the library's audit of its own canaries
    rows = np.asarray(kinds) == name
    alone = auditing.score_audit(-losses[rows], included[rows], out["delta"], 0.95, bootstrap_samples=0)
    assert by[name]["epsilon_lower_bound"] == alone.epsilon_one_run and by[name]["auroc"] == alone.auroc
  assert by["rare_words"]["epsilon_lower_bound"] > 1.0 > by["words"]["epsilon_lower_bound"]
  assert by["rare_words"]["tpr_at_fpr"][0]["tpr"] > by["words"]["tpr_at_fpr"][0]["tpr"]
  assert by["rare_words"]["exceeds_ledger"] and not by["words"]["exceeds_ledger"]
  log = "\n".join(lines)
  assert "privacy audit, rare_words canaries alone (64:" in log and "PRIVACY AUDIT FAILED for the rare_words" in log
  md = "\n".join(report.audit_markdown(out))
  assert "Each kind of canary alone" in md and "| rare_words | 64 (" in md and "above the ledger's ε" in md
  # A record of one kind has no per-kind section.
  single, _ = _audit_run(tmp_path, losses, included, bootstrap_samples=0)
  assert "by_kind" not in single and "Each kind" not in "\n".join(report.audit_markdown(single))


def test_an_audit_record_needs_a_held_out_canary(tmp_path):
  from private_t5.eval import audit
  record = audit.AuditRecord(texts=["a b", "c d"], included=np.array([True, True]), repetitions=1, seed=1,
                             kind="words", length=2, source="", corpus="")
  path = audit.write_record(record, str(tmp_path / "r.audit.json"), documents=0)
  with pytest.raises(DataError, match="at least one held-out canary"):
    audit.load_record(path)
