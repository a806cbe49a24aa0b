"""Privacy accounting: the paper's Table 5, PLD vs RDP, calibration, truncation, bad input, CLI."""
import json
import logging
import math
import warnings

import dp_accounting
from dp_accounting import pld, rdp
import pytest
from scipy import stats

from private_t5.stages import cli
from private_t5.dp import accounting
from private_t5.dp import truncation
from private_t5.dp import privacy_params
from private_t5.dp import accounting_log
from private_t5.errors import PrivacyError

N_PAPER = 5_240_387_307
Q_PAPER = 8192 / N_PAPER
DELTA_PAPER = 1.9082e-10  # just below 1/N
# Ponomareva et al. 2022, Appendix C, Table 5: batch 8192, 100K steps, RDP.
TABLE5 = [(0.40, 6.0573157), (0.35, 8.6898032), (0.30, 13.4586238), (0.20, 47.2630501), (0.10, 319.1941523)]


@pytest.mark.parametrize("sigma,paper_eps", TABLE5)
def test_table5_rdp(sigma, paper_eps):
  eps = accounting.compute_epsilon(sigma, Q_PAPER, 100_000, DELTA_PAPER, "rdp")
  assert abs(eps - paper_eps) < 0.01, (sigma, eps, paper_eps)


def test_matches_direct_dp_accounting_calls():
  for sigma, q, steps, delta in [(1.1, 0.01, 500, 1e-5), (0.7, 0.003, 2000, 1e-6)]:
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert accounting.compute_epsilon(sigma, q, steps, delta, "rdp") == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
    acc = pld.PLDAccountant(value_discretization_interval=accounting.PLD_VALUE_DISCRETIZATION_INTERVAL)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert accounting.compute_epsilon(sigma, q, steps, delta, "pld") == pytest.approx(acc.get_epsilon(delta), rel=1e-9)


def test_pld_tighter_than_rdp():
  for sigma, q, steps in [(1.0, 0.01, 300), (0.8, 0.02, 100), (0.4, Q_PAPER, 1000)]:
    e_rdp = accounting.compute_epsilon(sigma, q, steps, 1e-6, "rdp")
    e_pld = accounting.compute_epsilon(sigma, q, steps, 1e-6, "pld")
    assert 0 < e_pld < e_rdp, (sigma, q, steps, e_pld, e_rdp)


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
  e = [accounting.compute_epsilon(1.0, 0.01, s, 1e-5) for s in (10, 100, 1000)]
  assert e[0] < e[1] < e[2]
  e = [accounting.compute_epsilon(s, 0.01, 100, 1e-5) for s in (0.8, 1.0, 2.0)]
  assert e[0] > e[1] > e[2]


@pytest.mark.parametrize("acct,steps", [("rdp", 100_000), ("pld", 200)])
def test_calibration_round_trip(acct, steps):
  q = Q_PAPER if acct == "rdp" else 0.01
  delta = DELTA_PAPER if acct == "rdp" else 1e-6
  target = 6.06 if acct == "rdp" else 2.0
  sigma = accounting.calibrate_noise(target, q, steps, delta, acct)
  eps = accounting.compute_epsilon(sigma, q, steps, delta, acct)
  assert eps <= target + 1e-9
  assert accounting.compute_epsilon(sigma * 0.995, q, steps, delta, acct) > target  # near-smallest σ
  if acct == "rdp":
    assert sigma == pytest.approx(0.4, abs=1e-3)  # Table 5 backwards


def test_unreachable_target_is_an_error():
  with pytest.raises(PrivacyError, match="unreachable"):
    accounting.calibrate_noise(1e-9, 1.0, 10**6, 1e-10)


def test_truncation_probability_is_binomial_tail():
  n, q, cap = 10_000, 0.01, 120
  assert truncation.truncation_probability(n, q, cap) == pytest.approx(stats.binom.sf(cap, n + 1, q))
  assert truncation.truncation_probability(n, q, None) == 0.0
  assert truncation.truncation_probability(n, q, n + 1) == 0.0
  # Monte Carlo: fraction of Poisson batches above the cap.
  import numpy as np  # pylint: disable=g-import-not-at-top
  draws = np.random.default_rng(0).binomial(n + 1, q, size=200_000)
  p_mc = float(np.mean(draws > cap))
  p = truncation.truncation_probability(n, q, cap)
  assert abs(p_mc - p) < 5 * math.sqrt(p * (1 - p) / draws.size) + 1e-6
  assert truncation.total_delta(1e-6, 100, p, 2.0) == pytest.approx(1e-6 + (1 + math.exp(2.0)) * 100 * p)
  assert truncation.total_delta(1e-6, 100, 0.0, 2.0) == 1e-6


def test_max_batch_size_for_bounds_truncation():
  cap = truncation.max_batch_size_for(10_000, 0.01, 1e-9)
  assert truncation.truncation_probability(10_000, 0.01, cap) <= 1e-9
  assert truncation.truncation_probability(10_000, 0.01, cap - 1) > 1e-9
  # The paper's run at the tail the e^ε factor asks for: the smallest cap, found quickly.
  n, q = 5_240_387_307, 8192 / 5_240_387_307
  target = (1 / n) / (10 * 100_000 * (1 + math.exp(6.0573)))
  cap = truncation.max_batch_size_for(n, q, target)
  assert truncation.truncation_probability(n, q, cap) <= target < truncation.truncation_probability(n, q, cap - 1)
  assert 8192 < cap < 9100


def test_fixed_batches_are_not_accounted_as_poisson():
  e_fixed = accounting.compute_epsilon(1.0, 0.01, 100, 1e-5, sampling="fixed", num_examples=10_000)
  e_poisson = accounting.compute_epsilon(1.0, 0.01, 100, 1e-5)
  assert e_fixed != pytest.approx(e_poisson)
  acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(10_000, 100, dp_accounting.GaussianDpEvent(0.5)), 100)
  assert e_fixed == pytest.approx(acc.get_epsilon(1e-5))
  with pytest.raises(PrivacyError, match="rdp"):
    accounting.compute_epsilon(1.0, 0.01, 100, 1e-5, "pld", sampling="fixed", num_examples=10_000)


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(sampling_rate=1.5), "sampling_rate"),
    (dict(sampling_rate=0.0), "sampling_rate"),
    (dict(steps=0), "steps"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(batch_size=200, num_examples=100), "larger than the dataset"),
    (dict(accountant="moments"), "accountant"),
    (dict(noise_multiplier=float("nan")), "finite"),
])
def test_bad_inputs(kwargs, match):
  with pytest.raises(PrivacyError, match=match):
    privacy_params.validate_privacy_params(**kwargs)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), None])
def test_one_check_of_the_clip_norm(value):
  with pytest.raises(PrivacyError, match="clip_norm"):
    privacy_params.check_clip_norm(value)
  assert privacy_params.check_clip_norm(0.5) == 0.5


def test_delta_at_least_one_over_n_warns():
  with pytest.warns(privacy_params.MeaninglessGuaranteeWarning, match="meaningless"):
    privacy_params.validate_privacy_params(delta=1e-3, num_examples=1000)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    privacy_params.validate_privacy_params(delta=1e-4, num_examples=1000)


def test_compute_epsilon_validates_before_compute():
  with pytest.raises(PrivacyError):
    accounting.compute_epsilon(0.0, 0.01, 10, 1e-5)
  with pytest.raises(PrivacyError):
    accounting.compute_epsilon(1.0, 0.01, 10, 1.5)


def _cli_json(capsys, argv):
  assert cli.main(["epsilon"] + argv) == 0
  return json.loads(capsys.readouterr().out)


def test_cli_paper_row(capsys):
  out = _cli_json(capsys, ["--noise_multiplier=0.4", "--batch_size=8192", "--num_examples=5240387307",
                           "--steps=100000", "--delta=1.9082e-10", "--accountant=rdp"])
  assert {"epsilon", "delta", "noise_multiplier", "sampling_rate", "steps", "accountant"} <= set(out)
  assert round(out["epsilon"], 2) == 6.06
  assert out["sampling_rate"] == pytest.approx(Q_PAPER)
  assert out["steps"] == 100_000 and out["accountant"] == "rdp" and out["delta"] == 1.9082e-10


def test_cli_target_epsilon_and_sampling_rate(capsys):
  out = _cli_json(capsys, ["--target_epsilon=6.06", f"--sampling_rate={Q_PAPER!r}", "--steps=100000",
                           "--delta=1.9082e-10", "--accountant=rdp"])
  assert out["noise_multiplier"] == pytest.approx(0.4, abs=1e-3)
  assert out["epsilon"] <= 6.06


def test_cli_truncation_reported(capsys):
  out = _cli_json(capsys, ["--noise_multiplier=1.0", "--batch_size=100", "--num_examples=10000", "--steps=50",
                           "--delta=1e-6", "--max_batch_size=140", "--accountant=rdp"])
  assert out["truncation_probability"] == pytest.approx(stats.binom.sf(140, 10_001, 0.01))
  assert out["total_delta"] == pytest.approx(
      1e-6 + (1 + math.exp(out["epsilon"])) * 50 * out["truncation_probability"])


@pytest.mark.parametrize("argv", [
    ["--noise_multiplier=0", "--sampling_rate=0.1", "--steps=10", "--delta=1e-5"],
    ["--noise_multiplier=1", "--sampling_rate=1.1", "--steps=10", "--delta=1e-5"],
    ["--noise_multiplier=1", "--batch_size=500", "--num_examples=100", "--steps=10", "--delta=1e-5"],
    ["--noise_multiplier=1", "--steps=10", "--delta=1e-5"],
    ["--target_epsilon=1e-9", "--sampling_rate=1.0", "--steps=1000000", "--delta=1e-10"],
])
def test_cli_bad_input_exits_2(capsys, argv):
  assert cli.main(["epsilon"] + argv) == 2
  assert "error:" in capsys.readouterr().err


def test_cli_warns_when_truncation_makes_delta_meaningless(capsys):
  assert cli.main(["epsilon", "--noise_multiplier=1.0", "--batch_size=100", "--num_examples=10000", "--steps=50",
                   "--delta=1e-6", "--max_batch_size=140", "--accountant=rdp"]) == 0
  captured = capsys.readouterr()
  total = json.loads(captured.out)["total_delta"]
  assert 1e-4 < total < 1  # ≥ 1/N
  # The warning names the δ it is about (the total, not a clipped stand-in) and where it came from.
  assert "WARNING" in captured.err and "meaningless" in captured.err
  assert f"total_delta={total:.4g} (δ=1e-06 from --delta plus " in captured.err and "0.999999" not in captured.err


# Truncating at 4 a batch of expected size 8: RDP's total δ is 68.9, no guarantee at all.
TRUNCATED_TO_NOTHING = ["--batch_size=8", "--num_examples=200", "--max_batch_size=4", "--noise_multiplier=1",
                        "--steps=10", "--delta=1e-5"]


def test_cli_refuses_a_truncated_rdp_result_whose_total_delta_is_at_least_one(capsys):
  assert cli.main(["epsilon", *TRUNCATED_TO_NOTHING, "--accountant=rdp"]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and "Traceback" not in captured.err
  assert captured.err.startswith("error: no guarantee: truncating batches at --max_batch_size=4 (probability 0.907 "
                                 "a step) adds 68.94 to δ=1e-05 (from --delta) under RDP, a total δ of 68.94 >= 1; ")
  assert captured.err.count("\n") == 1


def test_cli_auto_reports_only_an_epsilon_that_holds_at_the_delta_asked(capsys):
  """auto used to report RDP's ε = 1.89 "at δ = 1e-5" beside total_delta 68.9: now PLD's ε, which
  accounts the truncation exactly at δ; RDP's ε, with δ >= 1, is no guarantee and is not shown."""
  assert cli.main(["epsilon", *TRUNCATED_TO_NOTHING]) == 0
  captured = capsys.readouterr()
  out = json.loads(captured.out)
  assert out["accountant_used"] == "pld" and out["epsilon"] == out["epsilon_pld"] > 1.89
  assert out["delta"] == out["total_delta"] == 1e-5
  assert out["epsilon_rdp"] is None and out["delta_rdp"] == pytest.approx(68.94, abs=0.01)
  assert "WARNING" not in captured.err


def test_cli_meaningless_delta_warning_says_where_delta_came_from(capsys, tmp_path):
  argv = ["epsilon", "--noise_multiplier=1.0", "--sampling_rate=0.01", "--num_examples=10000", "--steps=10"]
  assert cli.main([*argv, "--delta=1e-3", "--accountant=rdp"]) == 0
  assert "delta=0.001 (--delta) >= 1/num_examples=0.0001" in capsys.readouterr().err
  gin_file = tmp_path / "delta.gin"
  gin_file.write_text("DELTA = 2e-3\n")
  assert cli.main([*argv, f"--gin_file={gin_file}", "--accountant=rdp"]) == 0
  assert "delta=0.002 (Gin macro DELTA) >= 1/num_examples=0.0001" in capsys.readouterr().err


def test_cli_huge_noise_prints_the_result_only(capsys):
  """σ = 1e9: dp_accounting's 84 "Negative Renyi divergence" lines are dropped (ε = 0 is the answer)."""
  assert cli.main(["epsilon", "--batch_size=8", "--num_examples=200", "--noise_multiplier=1e9", "--steps=10",
                   "--delta=1e-5"]) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out)["epsilon"] == 0.0 and captured.err == ""


@pytest.mark.parametrize("sigma, q, steps", [(0.8, 0.01, 300), (1.5, 0.05, 100), (0.6, 0.002, 2000)])
def test_auto_is_the_smaller_of_rdp_and_pld(sigma, q, steps):
  both = accounting.compute_epsilons(sigma, q, steps, 1e-6)
  auto = accounting.compute_epsilon(sigma, q, steps, 1e-6, "auto")
  assert set(both) == {"rdp", "pld"}
  assert auto == min(both.values()) and auto <= both["rdp"] and auto <= both["pld"]
  assert both["rdp"] == accounting.compute_epsilon(sigma, q, steps, 1e-6, "rdp")
  assert both["pld"] == accounting.compute_epsilon(sigma, q, steps, 1e-6, "pld")


def test_auto_calibration_takes_the_smaller_sigma():
  q, steps, delta, target = 0.01, 500, 1e-6, 3.0
  sigmas = {name: accounting.calibrate_noise(target, q, steps, delta, name) for name in ("rdp", "pld")}
  auto = accounting.calibrate_noise(target, q, steps, delta, "auto")
  assert auto == min(sigmas.values())
  assert accounting.compute_epsilon(auto, q, steps, delta, "auto") <= target + 1e-6


def test_cli_prints_both_accountants(capsys):
  out = _cli_json(capsys, ["--noise_multiplier=1.0", "--batch_size=100", "--num_examples=10000",
                           "--steps=200", "--delta=1e-6"])
  assert out["accountant"] == "auto" and out["accountant_used"] in ("rdp", "pld")
  assert out["epsilon"] == min(out["epsilon_rdp"], out["epsilon_pld"])


def test_truncated_event_is_accounted_exactly_by_pld():
  n, q, cap, steps = 10_000, 0.01, 120, 50
  exact = accounting.compute_epsilon(1.0, q, steps, 1e-6, "pld", num_examples=n, max_batch_size=cap)
  assert math.isfinite(exact) and exact > 0
  both = accounting.compute_epsilons(1.0, q, steps, 1e-6, num_examples=n, max_batch_size=cap)
  assert both["pld"] == exact


def test_accountant_convergence_warning_is_filtered():
  record = logging.LogRecord("absl", logging.WARNING, __file__, 1,
                             "_compute_log_a_frac failed to converge after %d iterations", (5,), None)
  assert not accounting_log.ConvergenceFilter().filter(record)
  negative = logging.LogRecord("absl", logging.WARNING, __file__, 1, "Negative Renyi divergence of %g, probably "
                               "caused by numerical instability from extreme DpEvents. Returning an epsilon of zero.",
                               (-2e-15,), None)
  assert not accounting_log.ConvergenceFilter().filter(negative)
  # Installed on the logger dp_accounting writes through, so no handler ever sees it.
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  assert not absl_logging.get_absl_logger().filter(record)


@pytest.fixture
def no_pld(monkeypatch):
  """The PLD accountant, whose arrays would take TiB here, must not run (fails at once instead)."""
  def refuse(*args, **kwargs):
    raise AssertionError("the PLD accountant was run")
  monkeypatch.setattr(accounting.pld, "PLDAccountant", refuse)


def test_cli_absurd_step_count_is_answered_by_rdp_or_refused_by_pld(capsys, no_pld):
  argv = ["--sampling_rate=0.001", "--steps=1000000000000", "--delta=1e-8"]
  out = _cli_json(capsys, ["--noise_multiplier=1.0", *argv])
  assert out["epsilon"] == out["epsilon_rdp"] > 9e5 and out["epsilon_pld"] is None and out["accountant_used"] == "rdp"
  out = _cli_json(capsys, ["--target_epsilon=6", *argv])
  assert out["epsilon_rdp"] <= 6 and out["epsilon_pld"] is None
  assert cli.main(["epsilon", "--noise_multiplier=1.0", *argv, "--accountant=pld"]) == 2
  assert capsys.readouterr().err == (
      "error: steps=1000000000000 is more than the PLD accountant composes (1e+07 at most: its arrays and "
      "time grow with the steps); use accountant='rdp' or 'auto'\n")


def test_pld_is_not_run_where_rdp_gives_no_guarantee(no_pld):
  # σ = 0.3, q = 0.1, 10^6 steps: ε ≈ 1.4e6 by RDP; the PLD would need several GB.
  eps = accounting.compute_epsilons(0.3, 0.1, 10**6, 1e-8)
  assert list(eps) == ["rdp"] and eps["rdp"] > accounting.PLD_MAX_EPSILON
  with pytest.raises(PrivacyError, match=r"ε = 1.4\d+e\+06 by RDP .* PLD accountant's arrays outgrow memory"):
    accounting.compute_epsilon(0.3, 0.1, 10**6, 1e-8, "pld")
