"""The DaskRunner's options, checked before anything is submitted; --beam_options with the local runner.

No Dask cluster is started here: a scheduler that answers is a listening socket, one that refuses
is a port of 127.0.0.1 nobody listens on. Each error is one ConfigError line, and on the command
line one `error:` line with exit status 2.
"""
import json
import logging
import socket
import time

import pytest

from private_t5.data import beam_runner
from private_t5.errors import ConfigError
from private_t5.stages import cli
from private_t5.stages import splits as splits_stage

pytest.importorskip("apache_beam", reason="needs apache-beam")
pytest.importorskip("distributed", reason="needs dask and distributed (pip install 'private_t5[dask]')")

LOCAL = "--dask_local_cluster"


@pytest.fixture
def refused_port():
  """A port of 127.0.0.1 that nothing listens on (bound, then let go)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def listening():
  """The address of a listening TCP socket (a scheduler that answers)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield f"127.0.0.1:{s.getsockname()[1]}"


def _dask_error(beam_options):
  with pytest.raises(ConfigError) as e:
    beam_runner.pipeline_options("DaskRunner", beam_options)
  assert "\n" not in str(e.value)
  return str(e.value)


def _dask_options(beam_options):
  return beam_runner.pipeline_options("DaskRunner", beam_options).get_all_options(drop_default=True)


def test_no_scheduler_is_an_error_unless_a_local_cluster_is_asked_for():
  message = _dask_error("")
  assert "--dask_client_address=HOST:PORT" in message and LOCAL in message, message
  assert _dask_error("--dask_npartitions=2").startswith("--runner=DaskRunner needs a scheduler")
  options = _dask_options(LOCAL)  # Beam's DaskRunner then starts a local cluster
  assert "address" not in options and options["partition_size"] == 1
  assert not any(LOCAL in str(v) for v in options.values())  # taken out before Beam reads the options


def test_an_unknown_dask_option_is_one_line_listing_the_known_ones():
  known = [n for n in beam_runner.dask_option_actions() if n != LOCAL]
  assert {"--dask_client_address", "--dask_npartitions", "--dask_partition_size",
          "--dask_connection_timeout"} <= set(known)
  for typo in ("--dask_npartitoins=3", "--dask-client-address=h:1"):
    message = _dask_error(f"{LOCAL} {typo}")
    assert message.startswith(f"--beam_options: unknown Dask option {typo.split('=')[0]};"), message
    assert all(name in message for name in known + [LOCAL]), message


@pytest.mark.parametrize("beam_options,reason", [
    ("--dask_npartitions=-1", "--dask_npartitions must be a positive integer, got '-1'"),
    ("--dask_npartitions=0", "--dask_npartitions must be a positive integer, got '0'"),
    ("--dask_partition_size=two", "--dask_partition_size must be a positive integer, got 'two'"),
    ("--dask_connection_limit=0", "--dask_connection_limit must be a positive integer, got '0'"),
    ("--dask_connection_timeout=2.5", "--dask_connection_timeout must be a positive whole number of seconds"),
    ("--dask_connection_timeout=-3", "--dask_connection_timeout must be a positive whole number of seconds"),
    ("--dask_npartitions=2 --dask_partition_size=3", "give --dask_npartitions or --dask_partition_size, not both"),
    ("--dask_npartitions", "--dask_npartitions needs a value"),
    ("--dask_local_cluster=yes", "--dask_local_cluster takes no value"),
], ids=["negative", "zero", "not_a_number", "limit", "fractional_timeout", "negative_timeout", "both_sizes",
        "no_value", "switch_with_value"])
def test_bad_dask_values_are_one_line(beam_options, reason):
  assert reason in _dask_error(f"{beam_options} {LOCAL}" if LOCAL not in beam_options else beam_options)


@pytest.mark.parametrize("address,reason", [
    ("nohost", "'nohost' is not a Dask scheduler address (HOST:PORT or tcp://HOST:PORT"),
    ("host:0", "'host:0' is not a Dask scheduler address"),
    ("host:99999", "'host:99999' is not a Dask scheduler address"),
    ("http://host:8786", "'http://host:8786' has an unknown protocol 'http'"),
    ("", "'' is not a Dask scheduler address"),
])
def test_a_bad_address_is_one_line(address, reason):
  message = _dask_error(f"--dask_client_address={address}")
  assert message.startswith(f"--dask_client_address: {reason}"), message


def test_one_scheduler_only_and_dask_options_on_dask_only(listening):
  assert "not --dask_client_address and --dask_local_cluster" in _dask_error(f"--dask_client_address={listening} {LOCAL}")
  with pytest.raises(ConfigError, match=r"the Dask options \(--dask_npartitions\) are for --runner=DaskRunner, "
                                        r"not --runner=DirectRunner"):
    beam_runner.pipeline_options("DirectRunner", "--dask_npartitions=4")


def test_a_refused_connection_is_reported_at_once(refused_port):
  for address in (f"127.0.0.1:{refused_port}", f"tcp://127.0.0.1:{refused_port}"):
    start = time.time()
    message = _dask_error(f"--dask_client_address={address}")
    assert time.time() - start < 2, message
    assert message.startswith(f"cannot reach the Dask scheduler at {address} (--dask_client_address): "
                              "connection refused"), message


def test_a_refused_connection_on_the_command_line_is_one_line(tmp_path, refused_port, capsys):
  for name in ("train", "valid"):
    (tmp_path / f"{name}.jsonl").write_text('{"text": "a few words"}\n')
  start = time.time()
  rc = cli.main(["splits", f"--train_corpus={tmp_path}/train.jsonl", f"--valid_corpus={tmp_path}/valid.jsonl",
                 f"--output={tmp_path}/out/", "--runner=DaskRunner",
                 f"--beam_options=--dask_client_address=127.0.0.1:{refused_port}"])
  err = capsys.readouterr().err
  assert rc == 2 and time.time() - start < 5 and "Traceback" not in err, err
  assert [l for l in err.splitlines() if l.startswith("error:")] == [
      f"error: cannot reach the Dask scheduler at 127.0.0.1:{refused_port} (--dask_client_address): "
      "connection refused (is the scheduler running, and on that port? --dask_local_cluster starts a local "
      "cluster instead)"], err
  rc = cli.main(["splits", f"--train_corpus={tmp_path}/train.jsonl", f"--valid_corpus={tmp_path}/valid.jsonl",
                 f"--output={tmp_path}/out/", "--runner=DaskRunner"])
  err = capsys.readouterr().err
  assert rc == 2 and [l for l in err.splitlines() if l.startswith("error:")] == [
      "error: " + _dask_error("")], err


def test_an_answering_scheduler_gets_the_options_as_given(listening):
  options = _dask_options(f"--dask_client_address=tcp://{listening} --dask_connection_timeout 7 --dask_npartitions 4")
  assert options["address"] == f"tcp://{listening}" and options["timeout"] == 7 and options["npartitions"] == 4
  assert "partition_size" not in options


def test_a_scheduler_file_is_read_and_its_address_probed(tmp_path, listening, refused_port):
  missing = tmp_path / "missing.json"
  assert _dask_error(f"--dask_scheduler_file={missing}") == (
      f"--dask_scheduler_file={missing}: no such file (the file `dask scheduler --scheduler-file` writes)")
  bad = tmp_path / "bad.json"
  bad.write_text("[]")
  assert "not a Dask scheduler file" in _dask_error(f"--dask_scheduler_file={bad}")
  good = tmp_path / "sched.json"
  good.write_text(json.dumps({"address": f"tcp://127.0.0.1:{refused_port}"}))
  assert _dask_error(f"--dask_scheduler_file={good}").startswith(
      f"cannot reach the Dask scheduler at tcp://127.0.0.1:{refused_port} (--dask_scheduler_file={good}): "
      "connection refused")
  good.write_text(json.dumps({"address": f"tcp://{listening}"}))
  assert _dask_options(f"--dask_scheduler_file={good}")["scheduler_file"] == str(good)


@pytest.mark.parametrize("argv,warned", [
    (["--beam_options=--direct_num_workers=2"], True),
    (["--runner=local", "--beam_options=--direct_num_workers=2"], True),
    (["--beam_options=--direct_num_workers=2", "--runner=local"], True),
    (["--beam_options=--direct_num_workers=2", "--runner=DirectRunner"], False),
    (["--runner=DirectRunner", "--beam_options=--direct_num_workers=2"], False),
    (["--runner=local"], False),
    (["--beam_options="], False),
], ids=["default_runner", "local_first", "local_last", "beam_runner_last", "beam_runner_first", "no_options",
        "empty_options"])
def test_beam_options_with_the_local_runner_are_one_warning(argv, warned, caplog):
  args, _, _ = splits_stage._parser().parse_stage_args(  # pylint: disable=protected-access
      ["--train_corpus=t.jsonl", "--valid_corpus=v.jsonl", "--output=out/"] + argv)
  with caplog.at_level(logging.WARNING, logger="private_t5.data.beam_io"):
    beam = beam_runner.is_beam(args.runner)
    beam_runner.is_beam(args.runner)  # a stage may ask again: one warning
  assert beam == (args.runner == "DirectRunner") and json.dumps(args.runner) == json.dumps(
      "DirectRunner" if beam else "local")
  lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
  assert lines == ([
      "--beam_options='--direct_num_workers=2' is ignored: --runner=local runs in-process and reads no Beam "
      "options; give a Beam runner (--runner=DirectRunner, DaskRunner, ...) to use them"] if warned else []), lines
