"""`private-t5 epsilon` reads --gin.NAME=VALUE as `train` does: each flag's macro is the flag, typed and
checked once; a flag beside its macro with another value, an override it would not read, an unreachable
target ε are one error line; banded noise with b = 1 and the correlated settings of a non-private
training run are warned about. The Gin parser's flag/override agreement is checked for `train` too."""
import json
import logging

import pytest

from private_t5 import checks
from private_t5.dp import accounting
from private_t5.errors import ConfigError
from private_t5.stages import cli, flags

PLAN = ["--noise_multiplier=1", "--batch_size=50", "--num_examples=10000", "--steps=64"]


def _epsilon(capsys, *argv) -> dict:
  assert cli.main(["epsilon", *argv, "-q"]) == 0
  return json.loads(capsys.readouterr().out)


def one_error_line(argv, capsys) -> str:
  """Runs `private-t5 ARGV`; asserts exit status 2, exactly one `error:` line and no traceback on
  stderr, nothing on stdout."""
  rc = cli.main(argv)
  out, err = capsys.readouterr()
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert rc == 2 and len(errors) == 1 and "Traceback" not in err and out == "", err
  return errors[0]


def test_a_gin_macro_is_its_flag(capsys):
  by_macro = _epsilon(capsys, "--noise=banded", "--gin.NUM_BANDS=4", "--delta=1e-5", *PLAN)
  by_flag = _epsilon(capsys, "--noise=banded", "--num_bands=4", "--delta=1e-5", *PLAN)
  assert by_macro == by_flag and by_macro["num_bands"] == 4 and by_macro["participations"] == 16
  assert by_macro["epsilon"] > _epsilon(capsys, "--noise=banded", "--num_bands=1", "--delta=1e-5", *PLAN)["epsilon"]
  # The same value twice is one setting.
  assert _epsilon(capsys, "--num_bands=4", "--gin.NUM_BANDS=4", "--noise=banded", "--delta=1e-5", *PLAN) == by_flag
  by_macro = _epsilon(capsys, "--gin.DELTA=1e-6", *PLAN)
  by_flag = _epsilon(capsys, "--delta=1e-6", *PLAN)
  assert by_macro["delta"] == by_flag["delta"] == 1e-6 and by_macro["epsilon"] == by_flag["epsilon"]
  assert (by_macro["delta_source"], by_flag["delta_source"]) == ("Gin macro DELTA", "--delta")


@pytest.mark.parametrize("bad, message", [
    (["--noise=banded", "--gin.NUM_BANDS='4'"], "Gin macro NUM_BANDS must be an integer, got '4' (str)"),
    (["--noise=banded", "--gin.NUM_BANDS=1.5"], "Gin macro NUM_BANDS must be an integer, got 1.5"),
    (["--noise=banded", "--gin.NUM_BANDS=0"], "Gin macro NUM_BANDS must be >= 1, got 0"),
    (["--noise=banded", "--num_bands=0"], "--num_bands must be >= 1, got 0"),
    (["--gin.DELTA=1.5"], "Gin macro DELTA must be < 1, got 1.5"),
    (["--gin.DELTA=0"], "Gin macro DELTA must be > 0"),
    (["--gin.DELTA=True"], "Gin macro DELTA must be a number, got True (bool)"),
    (["--delta=nan"], "--delta must be finite"),
    (["--gin.STEPS=64.0", "--delta=1e-5"], "Gin macro STEPS must be an integer"),
    (["--gin.NOISE='laplace'", "--delta=1e-5"], "Gin macro NOISE must be one of gaussian, banded, blt"),
    (["--noise=banded", "--num_bands=2", "--gin.NUM_BANDS=4", "--delta=1e-5"],
     "--num_bands=2 and --gin.NUM_BANDS=4 set the same setting to different values"),
    (["--delta=1e-5", "--gin.DELTA=1e-6"], "--delta=1e-5 and --gin.DELTA=1e-6 set the same setting"),
    (["--delta=1e-5", "--gin.TRAIN_STEPS=3"], "--gin.TRAIN_STEPS=3 sets nothing this stage reads: its Gin macros "
     "are NOISE_MULTIPLIER"),
    (["--delta=1e-5", "--gin.DPConfig.num_bands=4"], "--gin.DPConfig.num_bands=4 sets nothing this stage reads"),
    (["--noise=banded", "--num_bands=300", "--delta=1e-5"], "--num_bands b=300 exceeds --steps=64"),
    (["--noise=banded", "--num_bands=40", "--batch_size=300", "--delta=1e-5"],
     "--num_bands × --batch_size = 40 × 300 exceeds --num_examples=10000"),
])
def test_bad_settings_are_one_error_line(bad, message, capsys):
  line = one_error_line(["epsilon", *PLAN, *bad], capsys)
  assert message in line, line
  assert "larger than the dataset" not in line


def test_an_unreachable_target_names_the_smallest_epsilon_reachable(capsys):
  for noise in ("gaussian", "banded"):
    line = one_error_line(["epsilon", "--target_epsilon=1e-3", "--sampling_rate=1", "--steps=1000", "--delta=1e-5",
                           f"--noise={noise}", *(["--num_bands=2"] if noise == "banded" else [])], capsys)
    assert "target_epsilon=0.001 is unreachable" in line and "the smallest ε they reach is" in line, line
    assert f"noise_multiplier={accounting.MAX_NOISE_MULTIPLIER:g}, the largest σ the calibration searches" in line
  line = one_error_line(["epsilon", "--target_epsilon=1e-9", "--batch_size=50", "--num_examples=10000", "--steps=64",
                         "--delta=1e-5", "--noise=blt", "--num_bands=4"], capsys)
  smallest = float(line.split("the smallest ε they reach is ")[1].split(" ")[0])
  assert smallest > 1e-9 and "(by PLD)" in line


@pytest.mark.parametrize("noise", ["gaussian", "banded"])
def test_a_tiny_target_is_an_answer_or_one_line_never_a_traceback(noise, capsys):
  """ε = 1e-9 and 1e-4 at these settings: RDP reaches them (at the σ where its total-variation bound
  gives ε = 0), PLD does not (its discretisation); the answer holds the target."""
  for target in (1e-9, 1e-4):
    rc = cli.main(["epsilon", f"--target_epsilon={target}", "--batch_size=50", "--num_examples=10000", "--steps=64",
                   "--delta=1e-5", f"--noise={noise}", *(["--num_bands=4"] if noise == "banded" else []), "-q"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err, err
    answer = json.loads(out)
    assert answer["epsilon"] <= target and answer["noise_multiplier"] <= accounting.MAX_NOISE_MULTIPLIER


def test_banded_noise_with_one_band_warns_that_it_is_dp_sgd(capsys, caplog):
  with caplog.at_level(logging.WARNING):
    banded = _epsilon(capsys, "--noise=banded", "--delta=1e-5", *PLAN)
  assert "--noise=banded with num_bands b = 1 (no --num_bands) is plain DP-SGD" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    gaussian = _epsilon(capsys, "--delta=1e-5", *PLAN)
    _epsilon(capsys, "--noise=banded", "--num_bands=2", "--delta=1e-5", *PLAN)
  assert "plain DP-SGD" not in caplog.text and banded["epsilon"] == gaussian["epsilon"]


def test_a_non_private_run_warns_that_its_correlated_noise_settings_are_ignored(capsys, caplog):
  base = ["train", "--gin_file=models/t5_1_0_tiny.gin", "--gin_file=runs/pretrain_banded.gin"]
  with caplog.at_level(logging.WARNING):
    assert cli.main(base + ["--gin.DP=None"]) == 2  # then stopped: the required macros are missing
  assert ("train.dp is None (DP=None: a non-private run, no noise at all), so these DP settings are ignored: "
          "DPConfig.noise='banded', DPConfig.num_bands=4") in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert cli.main(["train", "--gin_file=models/t5_1_0_tiny.gin", "--gin_file=runs/pretrain.gin", "--gin.DP=None",
                     "--noise_multiplier=1.1", "--gin.DPConfig.clip_norm=0.5"]) == 2
  assert "these DP settings are ignored: --gin.DPConfig.clip_norm=0.5, --noise_multiplier=1.1" in caplog.text
  assert "missing required Gin macro" in capsys.readouterr().err
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert cli.main(base) == 2
    assert cli.main(["train", "--gin_file=models/t5_1_0_tiny.gin", "--gin_file=runs/pretrain.gin",
                     "--gin.DP=None"]) == 2
  assert "ignored" not in caplog.text


def test_train_refuses_a_flag_and_its_binding_with_different_values(capsys):
  base = ["train", "--gin_file=models/t5_1_0_tiny.gin", "--gin_file=runs/pretrain.gin"]
  line = one_error_line(base + ["--train_steps=5", "--gin.TRAIN_STEPS=6"], capsys)
  assert "--train_steps=5 and --gin.TRAIN_STEPS=6 set the same setting to different values" in line
  line = one_error_line(base + ["--gin.DPConfig.delta=1e-6", "--delta=1e-7"], capsys)
  assert "--delta=1e-7 and --gin.DPConfig.delta=1e-6" in line
  # The same value twice is one setting: the run goes on (to the next missing macro).
  line = one_error_line(base + ["--train_steps=5", "--gin.TRAIN_STEPS=5", "--model_dir=/tmp/x",
                                "--gin.MODEL_DIR=/tmp/x"], capsys)
  assert "missing required Gin macro" in line and "TRAIN_STEPS" not in line and "MODEL_DIR" not in line


def test_calibration_takes_the_accountant_that_reaches_a_tiny_target():
  # BLT (one Gaussian release): RDP's ε at the largest σ is above 1e-3, PLD's below: PLD's σ.
  sigma = accounting.calibrate_correlated("blt", 1e-3, 0.02, 64, 1e-5, num_bands=4)
  assert sigma < accounting.MAX_NOISE_MULTIPLIER
  assert accounting.correlated_epsilons("blt", sigma, 0.02, 64, 1e-5, num_bands=4)["pld"] <= 1e-3
  with pytest.raises(accounting.UnreachableTargetError) as e:
    accounting.calibrate_noise(1e-3, 1.0, 1000, 1e-5, "auto")
  assert set(e.value.smallest) == {"rdp", "pld"} and min(e.value.smallest.values()) > 1e-3


def test_every_stage_reads_its_macros_typed_from_the_overrides():
  """The parser every stage uses: a flag's macro from --gin.NAME=VALUE alone, typed (a boolean is
  True or False, never the string "False"), and a flag beside its override must agree."""
  parser = flags.StageParser("x", "a stage")
  parser.add_flag("audit", action="store_true", default=False)
  parser.add_flag("corpus", action="append")
  parser.add_flag("steps", type=int, check=lambda v, name: checks.integer(v, name, minimum=1))
  args = parser.parse_stage_args(["--gin.AUDIT=True", "--gin.CORPUS=a.txt", "--gin.STEPS=3"]).args
  assert (args.audit, args.corpus, args.steps) == (True, ["a.txt"], 3)
  assert parser.parse_stage_args(["--gin.AUDIT=False"]).args.audit is False
  for bad, message in ((["--gin.AUDIT='False'"], "Gin macro AUDIT must be True or False, got 'False' (str)"),
                       (["--gin.STEPS=0"], "Gin macro STEPS must be >= 1, got 0"),
                       (["--steps=0"], "--steps must be >= 1, got 0"),
                       (["--corpus=a.txt", "--gin.CORPUS='b.txt'"], "--corpus=a.txt and --gin.CORPUS='b.txt' set")):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
      parser.parse_stage_args(bad)
  assert parser.parse_stage_args(["--corpus=a.txt", "--gin.CORPUS=a.txt"]).args.corpus == ["a.txt"]
