"""The entry layer's Gin plumbing: one registry, syntax errors named in one line, clean errors."""
import os

import gin
import pytest

from private_t5.stages import cli, gin_utils
from private_t5.stages import gin_args
from private_t5.stages import gin_table
from private_t5.stages import gin_errors
from private_t5.stages import gin_paths
from private_t5.errors import ConfigError, PrivacyError


def test_registry_entries_resolve_and_stages_use_registered_names():
  for name, target in gin_table.CONFIGURABLES.items():
    assert callable(gin_utils.resolve(target)), name
  for entry, names in gin_table.STAGE_CONFIGURABLES.items():
    assert entry in names
    assert set(names) <= set(gin_table.CONFIGURABLES), entry
  for name, (_, users) in gin_table.GIN_TABLE.items():
    assert set(users) <= set(gin_table.ENTRIES) <= set(gin_table.GIN_TABLE), name


def test_unknown_stage_entry_is_a_config_error():
  with pytest.raises(ConfigError, match="no Gin stage entry named 'nope'"):
    gin_utils.parse([], entry="nope", files_required=False)


def test_unknown_registry_name_is_a_config_error():
  with pytest.raises(ConfigError, match="NoSuchName"):
    gin_utils.configured("NoSuchName")


@pytest.mark.parametrize("flag", ["--gin.BATCH_SIZE=[16", "--gin.BATCH_SIZE=(1, 2", "--gin.X='abc"])
def test_binding_syntax_error_names_the_flag_in_one_line(flag):
  _, files, bindings = gin_args.split_gin_args(["--gin_file=configs/models/t5_1_0_tiny.gin", flag])
  with pytest.raises(ConfigError) as info:
    gin_utils.parse(files, bindings, check_required=False, entry="T5Config")
  message = str(info.value)
  assert "\n" not in message
  assert f"(from {flag})" in message and "invalid Gin binding" in message


def test_binding_syntax_error_through_the_cli(capsys):
  assert cli.main(["info", "--gin_file=configs/models/t5_1_0_tiny.gin", "--gin.BATCH_SIZE=[16"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: invalid Gin binding") and "--gin.BATCH_SIZE=[16" in err
  assert len(err.splitlines()) == 1 and "Traceback" not in err


SEQIO_RUN = ["configs/models/t5_1_0_tiny.gin", "configs/runs/pretrain.gin", "configs/runs/seqio.gin"]
SEQIO_MACROS = ['MIXTURE_OR_TASK_NAME="t"', 'MODEL_DIR="/tmp/x"', "TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 4}",
                "TRAIN_STEPS=3"]


@pytest.mark.parametrize("binding,message", [
    ('ONE_EXAMPLE_PER_DOCUMENT="False"', "ONE_EXAMPLE_PER_DOCUMENT (bound to make_seqio_source.one_example_per_document) "
     "must be True or False, got 'False' (str) (a string is not a boolean"),
    ("ONE_EXAMPLE_PER_DOCUMENT=1", "must be True or False, got 1 (int)"),
    ("DOCUMENTS_PER_EXAMPLE=2.5", "DOCUMENTS_PER_EXAMPLE (bound to make_seqio_source.documents_per_example) must be an "
     "integer, got 2.5"),
    ("TRAIN_STEPS=True", "TRAIN_STEPS (bound to train.train_steps) must be an integer, got True (bool)"),
    ('DPConfig.clip_norm="1.0"', "Gin binding DPConfig.clip_norm must be a number, got '1.0' (str)"),
    ("DPConfig.noise_multiplier=nan", "DPConfig.noise_multiplier must be finite, got nan"),
])
def test_every_bound_value_is_type_checked_at_parse(binding, message):
  # A string is never a boolean ("False" is truthy), a boolean never a number: one check, at parse,
  # for every binding, through its macros.
  with pytest.raises(ConfigError) as info:
    gin_utils.parse(SEQIO_RUN, SEQIO_MACROS + [binding], entry="train")
  assert message in str(info.value) and "\n" not in str(info.value)
  gin_utils.parse(SEQIO_RUN, SEQIO_MACROS + ["ONE_EXAMPLE_PER_DOCUMENT=True", "DOCUMENTS_PER_EXAMPLE=2",
                                             "DPConfig.clip_norm=1"], entry="train")


@pytest.mark.parametrize("text,line", [("X = 1\nY = [1,\n", None), ("X = 1\n\nZ = 3)\n", 3)])
def test_file_syntax_error_names_the_file_and_line(tmp_path, text, line):
  path = tmp_path / "bad.gin"
  path.write_text(text)
  with pytest.raises(ConfigError) as info:
    gin_utils.parse([str(path)], check_required=False, entry="T5Config")
  message = str(info.value)
  assert "\n" not in message and str(path) in message
  if line:
    assert f"(line {line})" in message


@pytest.mark.parametrize("text,reason", [
    ("X = 1\nY = [\nZ = 2\n", "'[' opened on line 2 is not closed (line 3: unexpected 'Z')"),
    ("X = 1\nY = [1, 2\nZ = 2\n", "'[' opened on line 2 is not closed (line 3: Expected ',' or ']')"),
    ("X = 1\nY = {'a': (1,\n", "'(' opened on line 2 is not closed"),
    ("X = 1\nY = [a]\n", "'a' is not a value: quote a string, write @name for a configurable or %NAME for "
     "a macro (line 2)"),
], ids=["bare_word_after", "value_after", "end_of_file", "bare_word"])
def test_file_syntax_error_is_readable(tmp_path, capsys, text, reason):
  path = tmp_path / "bad.gin"
  path.write_text(text)
  assert cli.main(["info", f"--gin_file={path}"]) == 2
  assert capsys.readouterr().err == f"error: invalid Gin syntax in {path}: {reason}\n"
  if "line 3" in reason:  # the same through an include
    top = tmp_path / "top.gin"
    top.write_text(f"include '{path}'\n")
    with pytest.raises(ConfigError) as info:
      gin_utils.parse([str(top)], check_required=False, entry="T5Config")
    assert str(info.value) == f"invalid Gin syntax in {path}: {reason}"


def test_included_file_syntax_error_names_the_file(tmp_path):
  bad = tmp_path / "bad.gin"
  bad.write_text("X = 1\nZ = 3)\n")
  top = tmp_path / "top.gin"
  top.write_text(f"include '{bad}'\n")
  with pytest.raises(ConfigError, match=rf"{bad}.*line 2"):
    gin_utils.parse([str(top)], check_required=False, entry="T5Config")


def test_unwrap_error_strips_gin_proxy_and_context():
  @gin.configurable("raises_privacy_error_for_test")
  def fail():
    raise PrivacyError("sigma must be > 0")

  with pytest.raises(PrivacyError) as info:
    gin_utils.call_configured(fail)
  assert type(info.value) is PrivacyError
  assert str(info.value) == "sigma must be > 0"
  assert gin_errors.error_message(ValueError("bad\n  In call to configurable 'x' (<fn>)")) == "bad"


MODEL_FILES = ["t5_1_0_base", "t5_1_0_large", "t5_1_0_small", "t5_1_0_tiny",
               "t5_1_1_base", "t5_1_1_large", "t5_1_1_small", "t5_1_1_tiny"]


def _model_config(path, bindings=()):
  gin_utils.parse([path], list(bindings), check_required=False, entry="T5Config")
  config = gin_utils.configured("T5Config")()
  gin.clear_config()
  return config


@pytest.mark.parametrize("name", MODEL_FILES)
def test_layered_model_files_configure_what_the_standalone_ones_did(name):
  """configs/models/<size>.gin = its family's base + size overrides: the same T5Config as before."""
  standalone = _model_config(f"tests/testdata/standalone_models/{name}.gin")
  layered = _model_config(f"configs/models/{name}.gin")
  assert layered == standalone
  # VOCAB_SIZE still reaches the model through the base file.
  assert _model_config(f"configs/models/{name}.gin", ["VOCAB_SIZE=1024"]).vocab_size == 1024


def test_size_files_include_their_family_base():
  for name in MODEL_FILES:
    family, size = name.rsplit("_", 1)
    text = open(f"configs/models/{name}.gin").read()
    assert (f"include 'configs/models/{family}_base.gin'" in text) == (size != "base"), name


def _model_from(cwd, files, **kwargs):
  old = os.getcwd()
  os.chdir(cwd)
  try:
    gin_utils.parse(files, check_required=False, entry="T5Config", **kwargs)
    return gin_utils.configured("T5Config")().num_encoder_layers
  finally:
    os.chdir(old)
    gin.clear_config()


@pytest.mark.parametrize("name", ["models/t5_1_0_small.gin", "configs/models/t5_1_0_small.gin",
                                  os.path.join(gin_paths.PACKAGE_CONFIGS, "models", "t5_1_0_small.gin")])
def test_shipped_configs_are_found_by_name_from_any_directory(tmp_path, name):
  assert _model_from(str(tmp_path), [name]) == 6


def test_gin_search_paths_come_after_the_current_directory_and_before_the_package(tmp_path):
  user = tmp_path / "mine"
  (user / "models").mkdir(parents=True)
  # A user file that includes a shipped one by name, and shadows a shipped name.
  (user / "deep.gin").write_text("include 'models/t5_1_0_small.gin'\nT5Config.num_encoder_layers = 9\n")
  (user / "models" / "t5_1_0_tiny.gin").write_text("include 'configs/models/t5_1_0_base.gin'\n"
                                                   "T5Config.num_encoder_layers = 3\n")
  assert _model_from(str(tmp_path), ["deep.gin"], gin_search_paths=f"/nonexistent,{user}") == 9
  assert _model_from(str(tmp_path), ["models/t5_1_0_tiny.gin"], gin_search_paths=[str(user)]) == 3
  assert _model_from(str(tmp_path), ["models/t5_1_0_tiny.gin"]) == 2
  with pytest.raises(ConfigError, match=r"Gin file not found: 'deep.gin' \(looked in "):
    _model_from(str(tmp_path), ["deep.gin"])
  with pytest.raises(ConfigError, match="Gin file not found"):
    _model_from(str(tmp_path), [str(tmp_path / "absent.gin")])


def test_every_stage_takes_gin_search_paths_on_its_command_line(tmp_path, capsys):
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  user = tmp_path / "mine"
  user.mkdir()
  (user / "deep.gin").write_text("include 'models/t5_1_0_small.gin'\nT5Config.num_encoder_layers = 9\n")
  old = os.getcwd()
  os.chdir(tmp_path)
  try:
    assert cli.main(["info", f"--gin_search_paths={user}", "--gin_file=deep.gin"]) == 0
    assert '"num_encoder_layers": 9' in capsys.readouterr().out
    assert cli.main(["info", "--gin_file=deep.gin"]) == 2  # not searched without the flag
    assert "Gin file not found: 'deep.gin'" in capsys.readouterr().err
  finally:
    os.chdir(old)
    gin_paths.set_search_paths(None)
    gin.clear_config()


def test_the_fewer_kernels_file_binds_the_two_speed_settings():
  """configs/runs/fewer_kernels.gin turns on batched Adafactor and stacked ghost layers."""
  gin_utils.parse(["runs/fewer_kernels.gin"], check_required=False, entry="train")
  try:
    assert gin.query_parameter("adafactor.batched_over_shapes") is True
    assert gin.query_parameter("train.ghost_stack_layers") is True
  finally:
    gin.clear_config()
