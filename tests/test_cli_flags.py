"""One command-line style: every stage's --help, plain flags as Gin bindings, aliases, verbosity."""
import logging

import pytest

from private_t5.stages import cli
from private_t5.stages import flags
from private_t5.stages import verbosity
from private_t5.errors import ConfigError

# stage -> the plain flags its --help must list (besides --gin_file and --verbosity).
COMMON_FLAGS = {
    "info": ("--vocab_size",),
    "spm": ("--corpus", "--output", "--vocab_size"),
    "dp-spm": ("--corpus", "--output", "--vocab_size", "--target_epsilon", "--delta"),
    "train": ("--model_dir", "--corpus", "--vocab_path", "--target_epsilon", "--delta", "--initial_checkpoint"),
    "epsilon": ("--target_epsilon", "--delta", "--noise_multiplier", "--steps"),
    "memorization": ("--model_dir", "--output", "--vocab_path", "--canaries"),
    "canaries": ("--corpus", "--output"),
    "evaluate": ("--model_dir", "--output", "--vocab_path", "--initial_checkpoint"),
    "bench": ("--output",),
    "study": ("--corpus", "--output"),
    "redact": ("--corpus", "--output"),
    "jft": ("--model_dir", "--target_epsilon", "--delta"),
    "adaptive": ("--model_dir", "--target_epsilon", "--delta"),
    "import": ("--hf_dir", "--model_dir"),
    "export": ("--model_dir", "--output", "--format", "--initial_checkpoint"),
    "store": ("--corpus", "--vocab_path", "--cache_dir", "--runner", "--beam_options"),
    "splits": ("--train_corpus", "--valid_corpus", "--output", "--vocab_path", "--runner", "--beam_options"),
}


def _run(argv):
  try:
    return cli.main(argv)
  except SystemExit as e:  # argparse's --help
    return e.code or 0


# `launch` has its own few flags: it wraps another stage's command line (after `--`).
OWN_STYLE = {"launch"}


def test_every_stage_is_covered():
  assert set(COMMON_FLAGS) == set(cli.STAGES) - OWN_STYLE


@pytest.mark.parametrize("stage", sorted(COMMON_FLAGS))
def test_stage_help_lists_common_flags(stage, capsys):
  assert _run([stage, "--help"]) == 0
  out = capsys.readouterr().out
  for flag in ("--gin_file", "--gin.NAME=VALUE", "--verbosity") + COMMON_FLAGS[stage]:
    assert flag in out, f"private-t5 {stage} --help does not list {flag}"


def test_plain_flag_becomes_gin_binding():
  parser = flags.StageParser("x", "test")
  parser.add_flag("model_dir", gin="MODEL_DIR")
  parser.add_flag("delta", gin="DPConfig.delta", type=float)
  args, files, bindings = parser.parse_stage_args(
      ["--gin_file=a.gin", "--gin.X=1", "--model_dir=/tmp/a b", "--delta=1e-6"])
  assert files == ["a.gin"]
  assert list(bindings) == ["X=1", "MODEL_DIR='/tmp/a b'", "DPConfig.delta=1e-06"]
  assert bindings[1].flag == "--model_dir=/tmp/a b"  # errors name the flag the user typed
  assert args.model_dir == "/tmp/a b"


def test_alias_logs_deprecation(caplog):
  parser = flags.StageParser("x", "test")
  parser.add_flag("corpus", aliases=("input",))
  with caplog.at_level(logging.WARNING):
    args, _, _ = parser.parse_stage_args(["--input=c.txt"])
  assert args.corpus == "c.txt"
  assert "--input is deprecated; use --corpus" in caplog.text


def test_plain_stage_reads_flags_from_gin_macros(tmp_path):
  gin_file = tmp_path / "spm.gin"
  gin_file.write_text('CORPUS = "from_gin.txt"\nVOCAB_SIZE = 123\nOUTPUT = "x.model"\n')
  parser = flags.StageParser("x", "test")
  parser.add_flag("corpus")
  parser.add_flag("vocab_size", type=int)
  parser.add_flag("output")
  args, _, _ = parser.parse_stage_args([f"--gin_file={gin_file}", "--output=flag.model"])
  assert (args.corpus, args.vocab_size, args.output) == ("from_gin.txt", 123, "flag.model")


def test_unknown_flag_is_one_line_error(capsys):
  assert cli.main(["epsilon", "--bogus=1"]) == 2
  err = capsys.readouterr().err
  assert "unknown flag(s): --bogus=1" in err and "Traceback" not in err


def test_verbosity_values():
  assert verbosity.parse_verbosity("debug") == (logging.DEBUG, False)
  assert verbosity.parse_verbosity("quiet") == (logging.WARNING, True)
  assert verbosity.parse_verbosity("-1") == (logging.WARNING, True)
  assert verbosity.parse_verbosity("0") == (logging.INFO, False)
  with pytest.raises(ConfigError, match="--verbosity"):
    verbosity.parse_verbosity("loud")
  rest, setting = verbosity.pop_verbosity(["--a=1", "-q", "--verbosity", "debug", "--b"])
  assert rest == ["--a=1", "--b"] and setting == (logging.DEBUG, False)


def test_epsilon_alias_and_json(capsys):
  assert cli.main(["epsilon", "--epsilon=3", "--sampling_rate=0.01", "--steps=100", "--delta=1e-5", "-q"]) == 0
  assert '"target_epsilon": 3.0' in capsys.readouterr().out


def test_progress_bars_off_when_quiet_or_not_a_terminal(monkeypatch):
  from private_t5 import progress  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv(progress.QUIET_ENV, raising=False)
  assert not progress.enabled()  # pytest's stderr is not a terminal
  assert progress.bar(total=3).disable
  monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
  monkeypatch.setenv(progress.QUIET_ENV, "1")
  assert not progress.enabled()
  monkeypatch.delenv(progress.QUIET_ENV)
  assert progress.enabled()
  seen = []
  update = progress.callback("x")
  for done in (2, 5):
    update(done, 5)
    seen.append(done)
  assert seen == [2, 5]
