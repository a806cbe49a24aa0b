"""DP-SentencePiece: privacy maths, contribution bounds, Monte Carlo threshold, real-text vocabulary."""
import gzip
import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from scipy import optimize, special, stats

from private_t5 import doc_fingerprints
from private_t5.stages import cli
from private_t5.dp import privacy_report
from private_t5.dp.ledger import PrivacyLedger
from private_t5.errors import ConfigError, DataError, PrivacyError
from private_t5.tokenizer import dp_spm
from private_t5.tokenizer import dp_spm_histogram
from private_t5.tokenizer import dp_spm_release
from private_t5.tokenizer import spm as spm_lib
from private_t5.tokenizer import dp_spm_measures
from private_t5.tokenizer import dp_spm_train
from conftest import expected, shared_or_fixture

PAPER = dp_spm_histogram.ContributionBound("paper", 256)
CAPPED = dp_spm_histogram.ContributionBound("capped", 256)


def _analytic_gaussian_delta(eps, s):
  """Balle & Wang (2018) Thm 8, sensitivity 1, noise std s, written out independently."""
  return stats.norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps) * stats.norm.cdf(-1 / (2 * s) - eps * s)


# ---------------------------------------------------------------------------------------------
# Privacy maths against independent computations
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bound", [PAPER, CAPPED, dp_spm_histogram.ContributionBound("paper", 64)])
@pytest.mark.parametrize("sigma_over_k", [0.3, 2.0, 30.0])
def test_epsilon_and_threshold_match_independent_computation(bound, sigma_over_k):
  delta = 1e-8
  sigma = sigma_over_k * bound.l2
  p = dp_spm_release.privacy_parameters(delta, bound, sigma=sigma)
  # Tight ε: root of the analytic Gaussian δ(ε) = δ/2.
  eps = optimize.brentq(lambda e: _analytic_gaussian_delta(e, sigma_over_k) - delta / 2, 1e-9, 500)
  assert p["epsilon"] == pytest.approx(eps, rel=1e-5)
  # The paper's formula, Hoory et al. Theorem 1.
  assert p["epsilon_paper_formula"] == pytest.approx(bound.l2 / sigma * math.sqrt(2 * math.log(2.5 / delta)))
  assert p["epsilon_paper_formula_valid"] == (p["epsilon_paper_formula"] < 1)
  # Threshold: one-sided tail δ/(2n) per word, written with erf⁻¹ (the √2 the paper drops).
  n, m = bound.max_distinct, bound.linf
  assert p["threshold"] == pytest.approx(m + sigma * math.sqrt(2) * special.erfinv(1 - delta / n), rel=1e-7)  # erf⁻¹ near 1 loses digits
  assert p["threshold_paper_formula"] == pytest.approx(m + sigma * special.erfinv(1 - delta / (2 * n)))
  assert p["threshold_delta_check"] == pytest.approx(delta / 2, rel=1e-6)
  # The printed threshold spends far more than δ/2 on thresholding.
  assert p["threshold_paper_formula_delta"] > 1000 * delta


def test_classical_bound_only_valid_below_one():
  # For ε < 1 the classical formula over-estimates ε; above 1 it can UNDER-estimate it.
  small = dp_spm_release.privacy_parameters(1e-8, PAPER, sigma=256 * 30.0)
  assert small["epsilon_paper_formula_valid"] and small["epsilon"] < small["epsilon_paper_formula"]
  large = dp_spm_release.privacy_parameters(1e-8, PAPER, sigma=256 * 0.2302)
  assert not large["epsilon_paper_formula_valid"] and large["epsilon"] > large["epsilon_paper_formula"]


@pytest.mark.parametrize("target", [0.17, 3.37, 33.7])
@pytest.mark.parametrize("bound", [PAPER, CAPPED])
def test_calibration_both_ways(target, bound):
  forward = dp_spm_release.privacy_parameters(1e-8, bound, target_epsilon=target)
  assert forward["epsilon"] <= target * (1 + 1e-6)
  assert forward["epsilon"] == pytest.approx(target, rel=1e-3)
  back = dp_spm_release.privacy_parameters(1e-8, bound, sigma=forward["noise_std"])
  assert back["epsilon"] == pytest.approx(forward["epsilon"], rel=1e-9)
  assert back["threshold"] == pytest.approx(forward["threshold"])


def test_capped_is_sixteen_times_less_noise_than_paper():
  p = dp_spm_release.privacy_parameters(1e-8, PAPER, target_epsilon=3.37)
  c = dp_spm_release.privacy_parameters(1e-8, CAPPED, target_epsilon=3.37)
  assert p["noise_std"] / c["noise_std"] == pytest.approx(16.0, rel=1e-3)  # k = 256 vs √256
  assert c["threshold"] < p["threshold"] / 10


@pytest.mark.parametrize("kwargs", [dict(delta=0.0, sigma=1.0), dict(delta=1.0, sigma=1.0), dict(delta=1e-8, sigma=0.0),
                                    dict(delta=1e-8), dict(delta=1e-8, sigma=1.0, target_epsilon=1.0),
                                    dict(delta=1e-8, target_epsilon=-1.0)])
def test_bad_privacy_inputs(kwargs):
  delta = kwargs.pop("delta")
  with pytest.raises(PrivacyError):
    dp_spm_release.privacy_parameters(delta, PAPER, **kwargs)


def test_bad_bound():
  with pytest.raises(ConfigError):
    dp_spm_histogram.ContributionBound("none", 256)
  with pytest.raises(ConfigError):
    dp_spm_histogram.ContributionBound("paper", 0)


# ---------------------------------------------------------------------------------------------
# Contribution bounds (sensitivity)
# ---------------------------------------------------------------------------------------------

def _adversarial_documents(rng):
  vocab = [f"w{i}" for i in range(5000)]
  docs = ["spam " * 10_000, " ".join(vocab), "a b c", "x\ty\nz  x"]
  for _ in range(40):
    length = int(rng.integers(1, 3000))
    docs.append(" ".join(rng.choice(vocab[: int(rng.integers(2, 5000))], size=length)))
  return docs


@pytest.mark.parametrize("bound", [PAPER, CAPPED, dp_spm_histogram.ContributionBound("capped", 7)])
def test_document_histogram_respects_bound(bound):
  for doc in _adversarial_documents(np.random.default_rng(1)):
    h = dp_spm_histogram.document_histogram(doc, bound)
    v = np.array(list(h.values()), dtype=float)
    assert np.linalg.norm(v) <= bound.l2 + 1e-9
    assert v.max() <= bound.linf
    assert len(h) <= bound.max_distinct
    assert set(h) <= set(doc.split())


def test_paper_and_capped_counts():
  doc = "the cat saw the dog and the bird"
  assert dp_spm_histogram.document_histogram(doc, PAPER) == {"the": 3, "cat": 1, "saw": 1, "dog": 1, "and": 1, "bird": 1}
  assert dp_spm_histogram.document_histogram(doc, CAPPED) == {w: 1 for w in ["the", "cat", "saw", "dog", "and", "bird"]}
  # Long documents keep N evenly spaced positions; capped keeps the W most frequent words.
  long_doc = " ".join(f"w{i}" for i in range(1000))
  assert sum(dp_spm_histogram.document_histogram(long_doc, PAPER).values()) == 256
  h = dp_spm_histogram.document_histogram("b a a c c c d", dp_spm_histogram.ContributionBound("capped", 2))
  assert h == {"c": 1, "a": 1}
  # Words are unnormalised: punctuation and case are kept.
  assert "Chrysler's" in dp_spm_histogram.document_histogram("Chrysler's chrysler", PAPER)


@pytest.mark.parametrize("bound", [PAPER, CAPPED])
def test_removing_one_document_moves_sum_by_at_most_k(bound):
  docs = _adversarial_documents(np.random.default_rng(2))
  full, _ = dp_spm_histogram.build_histogram(docs, bound, num_workers=1, chunk_size=7)
  for i in range(0, len(docs), 5):
    rest, _ = dp_spm_histogram.build_histogram(docs[:i] + docs[i + 1:], bound, num_workers=1, chunk_size=7)
    diff = np.array([full[w] - rest.get(w, 0) for w in full], dtype=float)
    assert np.linalg.norm(diff) <= bound.l2 + 1e-9
    assert np.abs(diff).max() <= bound.linf
    assert sum(1 for w in full if w not in rest) <= bound.max_distinct


def test_parallel_histogram_equals_serial():
  docs = _adversarial_documents(np.random.default_rng(3))
  serial, s1 = dp_spm_histogram.build_histogram(docs, PAPER, num_workers=1)
  parallel, s2 = dp_spm_histogram.build_histogram(iter(docs), PAPER, num_workers=2, chunk_size=3)
  assert serial == parallel
  assert (s1.documents, s1.bytes, s1.words_raw, s1.words_counted) == (
      s2.documents, s2.bytes, s2.words_raw, s2.words_counted)


# ---------------------------------------------------------------------------------------------
# Monte Carlo: a word from a single document survives with probability ≤ the bound
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bound", [dp_spm_histogram.ContributionBound("paper", 4), dp_spm_histogram.ContributionBound("capped", 4)])
def test_single_document_word_survival_monte_carlo(bound):
  delta, sigma, trials = 0.2, 3.0 * bound.l2, 400_000
  p = dp_spm_release.privacy_parameters(delta, bound, sigma=sigma)
  # Worst case: a word that only one document has, at the largest count it may give (m).
  hist = {f"u{i}": int(bound.linf) for i in range(trials)}
  kept = dp_spm_release.private_histogram(hist, p["noise_std"], p["threshold"], np.random.default_rng(7))
  rate = len(kept) / trials
  per_word_bound = p["delta_threshold"] / bound.max_distinct
  se = math.sqrt(per_word_bound * (1 - per_word_bound) / trials)
  assert rate <= per_word_bound + 4 * se
  assert rate >= per_word_bound - 4 * se  # the bound is attained at count m: it is tight
  # The paper's printed threshold lets such words through far more often than δ/(2N).
  kept_paper = dp_spm_release.private_histogram(hist, p["noise_std"], p["threshold_paper_formula"], np.random.default_rng(8))
  assert len(kept_paper) / trials > 2 * per_word_bound


# ---------------------------------------------------------------------------------------------
# Noise
# ---------------------------------------------------------------------------------------------

def test_noise_is_fresh_without_seed_and_fixed_with_it():
  a = dp_spm_release.noise_generator().normal(size=8)
  b = dp_spm_release.noise_generator().normal(size=8)
  assert not np.allclose(a, b)
  c = dp_spm_release.noise_generator(123).normal(size=8)
  d = dp_spm_release.noise_generator(123).normal(size=8)
  np.testing.assert_array_equal(c, d)
  hist = {f"w{i}": 50 for i in range(2000)}
  k1 = dp_spm_release.private_histogram(hist, 5.0, 50.0, dp_spm_release.noise_generator())
  k2 = dp_spm_release.private_histogram(hist, 5.0, 50.0, dp_spm_release.noise_generator())
  assert k1 != k2
  # Noisy counts have the configured std.
  noisy = np.array(list(dp_spm_release.private_histogram(hist, 5.0, -1e9, dp_spm_release.noise_generator(0)).values()))
  assert abs(noisy.std() - 5.0) < 0.5 and abs(noisy.mean() - 50.0) < 0.5


def test_sentencepiece_builtin_dp_mode_is_ignored():
  # Cross-check: the pinned SentencePiece accepts but ignores its own DP flags (docs/privacy.md).
  assert spm_lib.builtin_dp_is_ignored()


# ---------------------------------------------------------------------------------------------
# End to end on real text
# ---------------------------------------------------------------------------------------------

def _write_jsonl(path, texts):
  with open(path, "w") as f:
    for i, t in enumerate(texts):
      f.write(json.dumps({"id": str(i), "text": t}) + "\n")
  return str(path)


def _fortunes(shared_data):
  return os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")


@pytest.mark.slow
def test_vocabulary_from_real_text_round_trips(tmp_path, shared_data):
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from private_t5 import vocabulary  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "vocab" / "dp.model")
  # The DP histogram of the 2,000 fixture documents keeps fewer words than the full 15,218.
  vocab_size = expected(600, 400)
  report = dp_spm.train_dp_vocabulary(_fortunes(shared_data), out, vocab_size=vocab_size, delta=1e-8, target_epsilon=33.7,
                                      sensitivity="capped", insecure_seed=0, num_workers=2, verbose=False)
  assert os.path.isfile(out)
  on_disk = json.load(open(tmp_path / "vocab" / "privacy_report.json"))
  for key in ("epsilon", "epsilon_paper_formula", "delta", "noise_std", "threshold", "sensitivity", "words_total",
              "words_kept", "words_dropped_fraction", "vocab_size", "model_type"):
    assert key in on_disk, key
  assert on_disk["epsilon"] == pytest.approx(33.7, rel=1e-3)
  assert 0 < report["words_kept"] < report["words_total"]
  assert report["words_dropped_fraction"] == pytest.approx(1 - report["words_kept"] / report["words_total"])
  assert report["vocab_size"] == vocab_size and not report["vocab_size_capped"]
  assert not [f for f in os.listdir(tmp_path / "vocab") if f.endswith(".tmp")]
  proc = spm.SentencePieceProcessor(model_file=out)
  assert (proc.pad_id(), proc.eos_id(), proc.unk_id(), proc.bos_id()) == (0, 1, 2, -1)
  texts = []
  with gzip.open(shared_or_fixture("pretrain/linux_docs.jsonl.gz"), "rt") as f:
    for line, _ in zip(f, range(3)):
      texts.append(json.loads(line)["text"][:3000])
  for text in texts:
    ids = proc.encode(text)
    assert len(ids) > 10
    # Byte fallback: characters outside the private vocabulary become bytes, never <unk>, and
    # decoding gives the text back exactly.
    assert proc.unk_id() not in ids
    assert proc.decode(ids) == text
  vocab = vocabulary.load_vocabulary(out)  # the data pipeline's loader accepts it (T5 layout + sentinels)
  assert vocab.vocab_size == vocab_size + 100
  # The training ledger composes the report.
  ledger = PrivacyLedger.create(noise_multiplier=1.0, clip_norm=1.0, delta=1e-7, num_examples=10_000, batch_size=100)
  ledger.record_steps(10)
  ledger.add_component_from_report(report["report_path"])
  assert ledger.epsilon_by_addition() == pytest.approx(ledger.training_epsilon() + report["epsilon"])
  # Its Gaussian event composes with training's: less than the sum.
  assert ledger.total_epsilon() == ledger.epsilon_by_events() < ledger.epsilon_by_addition()
  assert ledger.total_delta() == pytest.approx(ledger.training_delta() + 1e-8)


@pytest.mark.parametrize("model_type", ["bpe", "char"])
def test_other_model_types_and_seeded_runs_are_deterministic(tmp_path, model_type):
  texts = [f"alpha beta gamma delta {i % 5} epsilon zeta eta theta iota kappa lambda" for i in range(400)]
  corpus = _write_jsonl(tmp_path / "c.jsonl", texts)
  kw = dict(vocab_size=400, model_type=model_type, delta=1e-4, target_epsilon=5.0, sensitivity="capped",
            max_words_per_document=16, insecure_seed=3, num_workers=1, verbose=False)
  r1 = dp_spm.train_dp_vocabulary(corpus, str(tmp_path / "a" / "m.model"), **kw)
  r2 = dp_spm.train_dp_vocabulary(corpus, str(tmp_path / "b" / "m.model"), **kw)
  assert r1["words_kept"] == r2["words_kept"] and r1["noise_seed"] == "insecure_fixed_seed"
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  pieces = []
  for d in ("a", "b"):
    proc = spm.SentencePieceProcessor(model_file=str(tmp_path / d / "m.model"))
    pieces.append([(proc.id_to_piece(i), proc.get_score(i)) for i in range(proc.get_piece_size())])
  assert pieces[0] == pieces[1]
  assert r1["model_type"] == model_type


def test_report_names_its_vocabulary_and_training_composes_it(tmp_path):
  """The report carries the model's SHA-256; the ledger composes it for that vocabulary only."""
  from private_t5.io import file_sha256  # pylint: disable=g-import-not-at-top
  texts = [f"alpha beta gamma delta {i % 5} epsilon zeta eta theta iota kappa lambda" for i in range(400)]
  corpus = _write_jsonl(tmp_path / "c.jsonl", texts)
  out = str(tmp_path / "v" / "dp.model")
  report = dp_spm.train_dp_vocabulary(corpus, out, vocab_size=400, delta=1e-4, target_epsilon=5.0,
                                      sensitivity="capped", max_words_per_document=16, insecure_seed=3,
                                      num_workers=1, verbose=False)
  on_disk = json.load(open(report["report_path"]))
  assert on_disk["vocab_sha256"] == file_sha256(out) and on_disk["privacy_unit"] == "document"
  # The files read, by content (a public declaration of this vocabulary is checked against them),
  # and the model says it was trained from a word histogram (a copy without its report is known).
  assert on_disk["corpus_file_digests"] == [{"path": os.path.realpath(corpus), "bytes": os.path.getsize(corpus),
                                             "sha256": file_sha256(corpus)}]
  from private_t5 import vocabulary  # pylint: disable=g-import-not-at-top
  assert spm_lib.trained_from_word_histogram(out) and not spm_lib.trained_from_word_histogram(corpus)
  assert privacy_report.find_vocabulary_report(out) == report["report_path"]
  ledger = PrivacyLedger.create(noise_multiplier=1.0, clip_norm=1.0, delta=1e-7, num_examples=10_000, batch_size=100)
  ledger.record_steps(10)
  component = ledger.add_vocabulary(out, report["report_path"])
  assert component["name"] == "dp_sentencepiece" and ledger.vocabulary_status() == "dp"
  assert ledger.epsilon_by_addition() == pytest.approx(ledger.training_epsilon() + report["epsilon"])
  # Its Gaussian event composes with training's: less than the sum.
  assert ledger.total_epsilon() == ledger.epsilon_by_events() < ledger.epsilon_by_addition()
  # A fixed noise seed: the vocabulary's report says so in one line, and the ledger sees it.
  assert on_disk["noise_secret"] is False and on_disk["warnings"][0].startswith("NO PRIVACY GUARANTEE")
  assert component["noise_secret"] is False and ledger.report()["noise_secret"] is False
  assert any("dp_sentencepiece" in w for w in ledger.report()["warnings"])


# The process dies where dp-spm has trained the model but not yet written its report.
_KILLED_AFTER_TRAINING = """
import os, signal, sys
from private_t5.tokenizer import dp_spm
dp_spm.piece_sources = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
dp_spm.train_dp_vocabulary(sys.argv[1], sys.argv[2], vocab_size=int(sys.argv[3]), delta=1e-4, target_epsilon=5.0,
                           sensitivity="capped", max_words_per_document=16, insecure_seed=3, num_workers=1,
                           verbose=False)
"""


def test_killed_dp_spm_leaves_no_model_without_its_report(tmp_path):
  """Model and report are one unit: a kill leaves neither (new folder) or the old pair (re-run)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  texts = [f"alpha beta gamma delta {i % 5} epsilon zeta eta theta iota kappa lambda" for i in range(400)]
  corpus = _write_jsonl(tmp_path / "c.jsonl", texts)
  out = tmp_path / "v" / "dp.model"

  def killed_run(vocab_size):
    done = subprocess.run([sys.executable, "-c", _KILLED_AFTER_TRAINING, corpus, str(out), str(vocab_size)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr

  killed_run(400)
  assert not out.exists(), "a vocabulary without its privacy report"
  report = dp_spm.train_dp_vocabulary(corpus, str(out), vocab_size=400, delta=1e-4, target_epsilon=5.0,
                                      sensitivity="capped", max_words_per_document=16, insecure_seed=3,
                                      num_workers=1, verbose=False)
  pair = (out.read_bytes(), open(report["report_path"]).read())
  killed_run(380)  # another vocabulary into the same folder
  assert (out.read_bytes(), open(report["report_path"]).read()) == pair
  assert privacy_report.find_vocabulary_report(str(out)) == report["report_path"]
  # (apart from them, private: the keyed signatures of the pair's documents and their key)
  assert sorted(os.listdir(out.parent)) == ["dp.model", "privacy_report.json"]
  assert sorted(os.listdir(str(out.parent) + ".private/dp.model")) == sorted(
      [*doc_fingerprints.FILES.values(), doc_fingerprints.KEY_FILE])


def test_vocab_cap_reported_or_refused(tmp_path):
  texts = [f"one two three four {i % 3}" for i in range(300)]
  corpus = _write_jsonl(tmp_path / "c.jsonl", texts)
  kw = dict(delta=1e-4, target_epsilon=8.0, sensitivity="capped", max_words_per_document=8, insecure_seed=0,
            num_workers=1, verbose=False)
  r = dp_spm.train_dp_vocabulary(corpus, str(tmp_path / "m.model"), vocab_size=5000, **kw)
  assert r["vocab_size_capped"] and r["vocab_size"] < 5000 and r["vocab_size_requested"] == 5000
  with pytest.raises(DataError, match="vocab_size"):
    dp_spm.train_dp_vocabulary(corpus, str(tmp_path / "n.model"), vocab_size=5000, allow_vocab_cap=False, **kw)


def test_every_word_dropped_names_the_knob(tmp_path):
  corpus = _write_jsonl(tmp_path / "c.jsonl", ["a few words here"] * 20)
  with pytest.raises(DataError, match="every word was dropped.*target_epsilon"):
    dp_spm.train_dp_vocabulary(corpus, str(tmp_path / "m.model"), vocab_size=400, delta=1e-4, target_epsilon=0.17,
                               num_workers=1, verbose=False)


def test_empty_corpus_is_an_error(tmp_path):
  corpus = _write_jsonl(tmp_path / "c.jsonl", ["   ", "\n"])
  with pytest.raises(DataError, match="empty"):
    dp_spm.train_dp_vocabulary(corpus, str(tmp_path / "m.model"), delta=1e-8, target_epsilon=1.0, num_workers=1,
                               verbose=False)


def test_large_delta_warns(tmp_path):
  texts = [f"one two three four {i % 3}" for i in range(300)]
  corpus = _write_jsonl(tmp_path / "c.jsonl", texts)
  with pytest.warns(UserWarning, match="meaningless"):
    dp_spm.train_dp_vocabulary(corpus, str(tmp_path / "m.model"), vocab_size=400, delta=0.01, target_epsilon=8.0,
                               sensitivity="capped", max_words_per_document=8, num_workers=1, verbose=False)


def test_cli_with_gin_and_flags(tmp_path, capsys):
  texts = [f"one two three four five six {i % 4}" for i in range(300)]
  corpus = _write_jsonl(tmp_path / "c.jsonl", texts)
  out = str(tmp_path / "v" / "dp.model")
  rc = cli.main(["dp-spm", "--gin_file=configs/runs/dp_spm.gin", f"--gin.CORPUS={corpus}", f"--gin.OUTPUT={out}",
                 "--vocab_size=400", "--sensitivity=capped", "--max_words=8", "--delta=1e-4", "--noise_std=2.0",
                 "--insecure_seed=1", "--num_workers=1"])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  assert report["noise_std"] == 2.0 and report["target_epsilon"] is None
  assert report["sensitivity"]["mode"] == "capped" and report["sensitivity"]["k_l2"] == pytest.approx(math.sqrt(8))
  assert os.path.isfile(out) and os.path.isfile(tmp_path / "v" / "privacy_report.json")
  # Bad input exits 2 with one line.
  rc = cli.main(["dp-spm", "--gin_file=configs/runs/dp_spm.gin", f"--gin.CORPUS={tmp_path}/missing.jsonl",
                 f"--gin.OUTPUT={out}", "--num_workers=1"])
  err = capsys.readouterr().err
  assert rc == 2 and [l for l in err.splitlines() if l.startswith("error:")] == [f"error: corpus not found: {tmp_path}/missing.jsonl"]
  rc = cli.main(["dp-spm", "--gin_file=configs/runs/dp_spm.gin", f"--corpus={corpus}", "--num_workers=1"])
  assert rc == 2 and "missing output" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Byte fallback and the public base character set: nothing is <unk>
# ---------------------------------------------------------------------------------------------

_UNRELATED = [
    "Grüße aus Köln — naïve café, façade; Ελληνικά, русский текст, 中文字符, 日本語のテキスト, 한국어",
    "emoji 😀🚀👩‍👩‍👧 and symbols ∑∫√≠ ©®™ € £ ¥",
    "  leading and trailing spaces  ",
    "tabs\tnew\nlines\r\nand   runs of   spaces",
    "ＦＵＬＬＷＩＤＴＨ and ligatures ﬁ ﬂ and combining e\u0301",
    "control \x00 \x07 \x1b characters, RTL \u202e mark, zero-width \u200b joiner",
    "",
    "x",
]


def _small_vocab(tmp_path, name, texts, **kw):
  corpus = _write_jsonl(tmp_path / f"{name}.jsonl", texts)
  args = dict(vocab_size=400, delta=1e-4, target_epsilon=8.0, max_words_per_document=16, insecure_seed=0,
              num_workers=1, verbose=False)
  args.update(kw)
  out = str(tmp_path / name / "dp.model")
  return out, dp_spm.train_dp_vocabulary(corpus, out, **args)


def _data_independent_pieces(model_file):
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  proc = spm.SentencePieceProcessor(model_file=model_file)
  return {proc.id_to_piece(i) for i in range(proc.get_piece_size())
          if proc.is_byte(i) or proc.is_control(i) or proc.is_unknown(i)
          or proc.id_to_piece(i) in set(dp_spm_train.BASE_CHARACTERS) | {dp_spm_train.WORD_BOUNDARY}}


def test_any_unicode_string_round_trips_without_unk(tmp_path):
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  texts = [f"alpha beta gamma delta {i % 5} epsilon zeta eta theta iota kappa lambda" for i in range(400)]
  out, report = _small_vocab(tmp_path, "a", texts)
  assert report["byte_fallback"] and report["base_characters"] == dp_spm_train.BASE_CHARACTERS
  proc = spm.SentencePieceProcessor(model_file=out)
  rng = np.random.default_rng(0)
  random_texts = ["".join(chr(int(c)) for c in rng.integers(1, 0x2FFFF, size=int(rng.integers(1, 60)))
                          if not 0xD800 <= int(c) <= 0xDFFF) for _ in range(200)]
  for text in _UNRELATED + random_texts:
    ids = proc.encode(text)
    assert proc.unk_id() not in ids, text
    assert proc.decode(ids) == text, text


def test_data_independent_pieces_in_every_vocabulary(tmp_path):
  a, ra = _small_vocab(tmp_path, "a", [f"alpha beta gamma delta {i % 5} epsilon" for i in range(400)])
  b, rb = _small_vocab(tmp_path, "b", [f"Ωmega ψι χι φι {i % 3} υψιλον" for i in range(400)])
  pa, pb = _data_independent_pieces(a), _data_independent_pieces(b)
  assert pa == pb
  assert len(pa) == dp_spm_train.min_vocab_size(dp_spm_train.BASE_CHARACTERS) == 3 + 256 + 1 + 94
  assert {f"<0x{i:02X}>" for i in range(256)} <= pa and set(dp_spm_train.BASE_CHARACTERS) <= pa
  for r in (ra, rb):
    src = r["pieces_by_source"]
    assert (src["special"], src["byte"], src["base_character"]) == (3, 256, 95)
    assert src["other"] == 0 and src["public"] == 0 and sum(src.values()) == r["vocab_size"]


def test_extra_characters_and_too_small_vocab(tmp_path):
  texts = [f"alpha beta gamma {i % 5}" for i in range(300)]
  out, report = _small_vocab(tmp_path, "a", texts, extra_characters="é ñ€é")
  assert report["base_characters"] == dp_spm_train.BASE_CHARACTERS + "éñ€"
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  proc = spm.SentencePieceProcessor(model_file=out)
  assert all(proc.piece_to_id(c) != proc.unk_id() for c in "éñ€")
  with pytest.raises(ConfigError, match="vocab_size must be an integer >= 354"):
    _small_vocab(tmp_path, "b", texts, vocab_size=353)


def test_capped_is_the_default_sensitivity(tmp_path):
  assert dp_spm_histogram.DEFAULT_SENSITIVITY == "capped" and dp_spm_histogram.ContributionBound().mode == "capped"
  _, report = _small_vocab(tmp_path, "a", [f"alpha beta gamma {i % 5}" for i in range(300)])
  assert report["sensitivity"]["mode"] == "capped"
  _, report = _small_vocab(tmp_path, "b", [f"alpha beta gamma {i % 5}" for i in range(300)], sensitivity="paper",
                           target_epsilon=50.0)
  assert report["sensitivity"]["mode"] == "paper"
  assert 'train_dp_vocabulary.sensitivity = "capped"' in open("configs/runs/dp_spm.gin").read()


# ---------------------------------------------------------------------------------------------
# A public corpus: exact counts merged after the private release
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bound", [PAPER, CAPPED])
def test_sensitivity_holds_with_public_merge(bound):
  docs = _adversarial_documents(np.random.default_rng(4))
  public_docs = [" ".join(f"w{i}" for i in range(j, j + 300)) for j in range(0, 3000, 100)] + ["spam public"]
  public, _ = dp_spm_histogram.build_histogram(public_docs, bound, num_workers=1)
  full, _ = dp_spm_histogram.build_histogram(docs, bound, num_workers=1, chunk_size=7)
  merged_full = dict(dp_spm_release.merge_public(full, public))
  for i in range(0, len(docs), 7):
    rest, _ = dp_spm_histogram.build_histogram(docs[:i] + docs[i + 1:], bound, num_workers=1, chunk_size=7)
    # The public counts are computed without the private corpus: the same for both neighbours.
    assert dp_spm_histogram.build_histogram(public_docs, bound, num_workers=1)[0] == public
    merged_rest = dict(dp_spm_release.merge_public(rest, public))
    diff = np.array([merged_full[w] - merged_rest.get(w, 0) for w in merged_full], dtype=float)
    assert np.linalg.norm(diff) <= bound.l2 + 1e-9
    assert np.abs(diff).max() <= bound.linf
    assert sum(1 for w in merged_full if w not in merged_rest) <= bound.max_distinct


def test_merge_public_sums_and_keeps_public_words():
  merged = dp_spm_release.merge_public({"a": 10.4, "b": 3.0}, {"a": 2, "c": 1})
  assert merged == [("a", 12), ("b", 3), ("c", 1)]
  assert dp_spm_release.merge_public({"a": 0.2}) == [("a", 1)]


def test_public_corpus_adds_pieces_without_touching_the_private_release(tmp_path):
  texts = [f"alpha beta gamma delta {i % 5} epsilon zeta" for i in range(400)]
  public = _write_jsonl(tmp_path / "public.jsonl",
                        [f"the quick brown fox jumps over the lazy dog number{i % 50} again" for i in range(300)])
  _, without = _small_vocab(tmp_path, "a", texts)
  _, with_public = _small_vocab(tmp_path, "b", texts, public_corpus=public)
  # Same noise seed: the private words that pass the noisy threshold are the same.
  assert with_public["words_kept"] == without["words_kept"] and with_public["threshold"] == without["threshold"]
  assert with_public["epsilon"] == without["epsilon"]
  assert with_public["public_corpus"] == [public] and with_public["public_words"] == 59
  src = with_public["pieces_by_source"]
  assert src["public"] > 0 and src["private"] + src["private_and_public"] > 0
  assert sum(src.values()) == with_public["vocab_size"] > without["vocab_size"]
  # Only public words: still a vocabulary (nothing private passed the threshold).
  _, only_public = _small_vocab(tmp_path, "c", ["a few words here"] * 20, target_epsilon=0.17, public_corpus=public)
  assert only_public["words_kept"] == 0 and only_public["pieces_by_source"]["private"] == 0


# ---------------------------------------------------------------------------------------------
# A small vocabulary: one warning, or an error
# ---------------------------------------------------------------------------------------------

def test_small_vocabulary_warns_once_and_strict_fails(tmp_path, caplog, capsys):
  texts = [f"one two three four {i % 3}" for i in range(300)]
  with caplog.at_level("WARNING"):
    _, r = _small_vocab(tmp_path, "a", texts, vocab_size=5000, max_words_per_document=8)
  # The tests' fixed noise seed adds its own "no guarantee" warning; the size warning is one line.
  not_size = lambda m: m.startswith("NO PRIVACY GUARANTEE") or "fixed seed" in m
  lines = [rec.getMessage() for rec in caplog.records
           if rec.levelname == "WARNING" and not not_size(rec.getMessage())]
  assert len(lines) == 1 and "\n" not in lines[0]
  assert f"only {r['vocab_size']} of the 5000 requested pieces" in lines[0]
  for knob in ("ε=8", "sensitivity=capped", "W=8 words per document", "public corpus: none", "--public_corpus",
               "--strict_vocab_size"):
    assert knob in lines[0], knob
  assert r["vocab_size_warning"] == lines[0] and r["vocab_size_capped"]
  caplog.clear()
  with caplog.at_level("WARNING"):
    _, r = _small_vocab(tmp_path, "b", texts, vocab_size=r["vocab_size"], max_words_per_document=8)
  assert not [rec for rec in caplog.records
              if rec.levelname == "WARNING" and not not_size(rec.getMessage())] and r["vocab_size_warning"] is None
  with pytest.raises(DataError, match=r"at most \d+ pieces, fewer than vocab_size=5000 \(ε=8"):
    _small_vocab(tmp_path, "c", texts, vocab_size=5000, max_words_per_document=8, strict_vocab_size=True)
  assert not os.path.exists(tmp_path / "c" / "dp.model")
  corpus = str(tmp_path / "a.jsonl")
  rc = cli.main(["dp-spm", "--gin_file=configs/runs/dp_spm.gin", f"--corpus={corpus}",
                 f"--output={tmp_path}/d/dp.model", "--vocab_size=5000", "--max_words=8", "--delta=1e-4",
                 "--epsilon=8", "--insecure_seed=0", "--num_workers=1", "--strict_vocab_size"])
  err = capsys.readouterr().err
  assert rc == 2 and len([l for l in err.splitlines() if l.startswith("error:")]) == 1
  assert "fewer than vocab_size=5000" in err


# ---------------------------------------------------------------------------------------------
# Utility in the report
# ---------------------------------------------------------------------------------------------

def test_utility_report_with_and_without_eval_corpus(tmp_path, capsys):
  texts = [f"alpha beta gamma delta {i % 5} epsilon zeta eta theta" for i in range(400)]
  heldout = _write_jsonl(tmp_path / "heldout.jsonl", _UNRELATED[:4] * 5)
  _, r = _small_vocab(tmp_path, "a", texts, eval_corpus=heldout, eval_documents=10)
  u = r["utility"]
  assert u["sample"]["source"] == "eval_corpus" and u["sample"]["dp_statistic"] and u["sample"]["documents"] == 10
  assert u["dp_vocabulary"]["unk_rate"] == 0.0 and u["dp_vocabulary"]["exact_round_trip_fraction"] == 1.0
  assert u["dp_vocabulary"]["tokens_per_word"] > 1 and u["dp_vocabulary"]["vocab_size"] == r["vocab_size"]
  base = u["nonprivate_baseline"]
  assert base["label"].startswith("non-private") and "never" in base["label"] and base["unk_rate"] == 0.0
  assert "utility.nonprivate_baseline" in r["not_dp_fields"] and "utility.dp_vocabulary" not in r["not_dp_fields"]
  on_disk = json.load(open(r["report_path"]))
  assert on_disk["utility"] == u and on_disk["vocab_sha256"]
  # Default: a sample of the training corpus, labelled as a non-private statistic; the stage's
  # last lines give the numbers.
  corpus = str(tmp_path / "a.jsonl")
  rc = cli.main(["dp-spm", "--gin_file=configs/runs/dp_spm.gin", f"--corpus={corpus}",
                 f"--output={tmp_path}/b/dp.model", "--vocab_size=400", "--max_words=16", "--delta=1e-4",
                 "--epsilon=8", "--insecure_seed=0", "--num_workers=1", "--eval_documents=50"])
  out, err = capsys.readouterr()
  assert rc == 0
  r = json.loads(out)
  assert r["utility"]["sample"]["source"] == "training_corpus" and not r["utility"]["sample"]["dp_statistic"]
  assert {"utility.sample", "utility.dp_vocabulary", "utility.nonprivate_baseline"} <= set(r["not_dp_fields"])
  last = err.strip().splitlines()[-3:]
  assert "utility on 50 documents (training corpus, NOT a DP statistic): <unk> rate 0.00%" in last[0]
  assert "dp-spm: non-private SentencePiece (comparison only, never released)" in last[1]
  assert "dp-spm: wrote" in last[2]


@pytest.mark.slow
def test_unrelated_real_text_has_no_unk(tmp_path, shared_data):
  """A vocabulary from fortunes tokenizes news and documentation it never saw: no <unk>, exact decode."""
  import csv  # pylint: disable=g-import-not-at-top
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "v" / "dp.model")
  report = dp_spm.train_dp_vocabulary(_fortunes(shared_data), out, vocab_size=2000, delta=1e-8, target_epsilon=3.37,
                                      max_documents=5000, insecure_seed=0, num_workers=2, eval_documents=0,
                                      verbose=False)
  assert report["sensitivity"]["mode"] == "capped" and report["utility"] is None
  proc = spm.SentencePieceProcessor(model_file=out)
  texts = []
  with open(os.path.join(shared_data, "glue_like", "bbc_news", "test.tsv"), newline="") as f:
    for row, _ in zip(csv.reader(f, delimiter="\t"), range(50)):
      texts.append(max(row, key=len))
  with gzip.open(os.path.join(shared_data, "pretrain", "python_docs.jsonl.gz"), "rt") as f:
    for line, _ in zip(f, range(20)):
      texts.append(json.loads(line)["text"])
  u = dp_spm_measures.tokenization_utility(out, texts + _UNRELATED)
  assert u["unk_rate"] == 0.0 and u["exact_round_trip_fraction"] == 1.0 and u["tokens"] > 10_000
  for text in texts:
    assert proc.decode(proc.encode(text)) == text


def test_counts_past_the_trainers_budget_are_scaled_down_not_dropped():
  # SentencePiece's trainer holds memory in proportion to the total count: a large corpus's
  # histogram is scaled to the budget (post-processing), every kept word keeping a count >= 1.
  small = [("a", 5), ("b", 3)]
  assert dp_spm_train.scale_counts(small, total=100) == (small, 1.0)
  counts = [("common", 9_000_000), ("rare", 3), ("mid", 1_000_000)]
  scaled, factor = dp_spm_train.scale_counts(counts, total=1_000_000)
  assert factor == pytest.approx(1_000_000 / 10_000_003)
  assert dict(scaled) == {"common": 900_000, "rare": 1, "mid": 100_000}
  assert sum(c for _, c in scaled) <= 1_000_000 + len(counts)
