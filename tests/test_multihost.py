"""Multi-host: `private-t5 launch` (a local cluster of JAX processes), each process's rows of the
batch, and 2 processes x 2 devices training exactly like 1 process x 4 devices."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from private_t5.stages import launch
from private_t5.train import launch as launch_lib
from private_t5.errors import ConfigError
from private_t5.models import checkpoints, run_dir
from private_t5.models import checkpoint_read
from private_t5.train import loop, partitioning
from private_t5.models import sharding

from conftest import expected
from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab, saved_state

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- launcher: flags and bad input --------------------------------------------------------------

def test_parse_args():
  assert launch.parse_args(["--num_processes=2", "--devices_per_process=3", "--", "train", "--x=1"]) == (
      2, 3, None, ["train", "--x=1"])
  assert launch.parse_args(["--num_processes=1", "--port=1234", "--", "evaluate"])[2] == 1234


@pytest.mark.parametrize("argv,message", [
    (["--num_processes=0", "--", "train"], "num_processes must be an integer >= 1"),
    (["--num_processes=two", "--", "train"], "num_processes must be an integer >= 1"),
    (["--num_processes=2", "--devices_per_process=0", "--", "train"], "devices_per_process"),
    (["--num_processes=2", "train"], "needs `-- <stage>"),
    (["--num_processes=2", "--"], "needs a stage"),
    (["--devices_per_process=2", "--", "train"], "needs --num_processes"),
    (["--num_procs=2", "--", "train"], "unknown launch flag"),
    (["--num_processes=2", "--", "launch"], "cannot launch itself"),
])
def test_bad_flags_are_one_clear_error(argv, message):
  with pytest.raises(ConfigError, match=message):
    launch.parse_args(argv)


def test_port_in_use_is_refused_before_anything_starts(capsys):
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
    busy.bind(("localhost", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    with pytest.raises(ConfigError, match=f"--port={port} is already in use"):
      launch.launch(2, 1, ["train"], port=port)
  assert "[launch] process" not in capsys.readouterr().err  # nothing started


def test_process_env_replaces_the_device_count():
  env = launch_lib.process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"}, process_id=1,
                               num_processes=2, devices_per_process=3, port=999)
  assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=3"
  assert env[partitioning.COORDINATOR_ENV] == "localhost:999"
  assert env[partitioning.NUM_PROCESSES_ENV] == "2" and env[partitioning.PROCESS_ID_ENV] == "1"


_LEAVE = """
import sys, time
import jax
from private_t5.train import partitioning
from jax._src import distributed
assert partitioning.initialize_distributed()
print(int(jax.numpy.arange(4).sum()), flush=True)  # the backend, with its collectives
state = distributed.global_state
times = {}
client_shutdown, service = state.client.shutdown, state.service
state.client = type("Client", (), {"shutdown": lambda self: times.setdefault("client", time.monotonic()) and client_shutdown()})()
class Service:
  def shutdown(self):
    times["service"] = time.monotonic()
    service.shutdown()
    print("client left, service stopped %.2f s later" % (times["service"] - times["client"]), flush=True)
state.service = Service()
"""


def test_process_0_stops_the_coordination_service_after_its_client_has_left():
  """At exit the client leaves first; the service stops `SERVICE_STOP_DELAY_S` later (a gRPC race)."""
  env = launch_lib.process_env(dict(os.environ, PYTHONPATH=PROJECT_ROOT, TF_CPP_MIN_LOG_LEVEL="2"), process_id=0,
                           num_processes=1, devices_per_process=1, port=launch_lib.free_port())
  done = subprocess.run([sys.executable, "-c", _LEAVE], env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  lines = done.stdout.split("\n")
  assert lines[0] == "6"
  delay = float(lines[1].split()[-3])
  assert partitioning.SERVICE_STOP_DELAY_S <= delay < partitioning.SERVICE_STOP_DELAY_S + 5


# -- launcher: output and faults (stand-in processes, no JAX) -------------------------------------

_WORKER = """
import os, signal, sys, time
i = int(os.environ["PRIVATE_T5_PROCESS_ID"])
print("hello from", i, os.environ["XLA_FLAGS"], flush=True)
mode = sys.argv[1]
if mode == "die" and i == 1:
  time.sleep(0.5)
  os.kill(os.getpid(), signal.SIGKILL)
if mode == "fail" and i == 0:
  sys.exit(3)
if mode == "raise" and i == 0:
  raise RuntimeError("a bug of process 0")
if mode == "partner" and i == 1:
  time.sleep(0.3)
  os.kill(os.getpid(), signal.SIGKILL)
if mode == "partner" and i == 0:  # its collective fails once its partner is gone, or it is stopped
  def gone(*args):
    raise RuntimeError("Gloo: connection closed by peer")
  signal.signal(signal.SIGTERM, gone)
  time.sleep(1.0)
  gone()
if mode != "ok":
  time.sleep(600)  # a process waiting for a collective whose partner is gone
"""


class _Lines:
  def __init__(self):
    self.text = ""

  def write(self, s):
    self.text += s

  def flush(self):
    pass


def test_output_is_prefixed_and_success_is_zero():
  out = _Lines()
  code = launch.launch(3, 2, ["ok"], out=out, command=[sys.executable, "-c", _WORKER])
  assert code == 0
  for i in range(3):
    assert f"[p{i}] hello from {i} --xla_force_host_platform_device_count=2" in out.text


@pytest.mark.parametrize("mode,status,message", [("die", 1, "process 1 was killed by SIGKILL"),
                                                 ("fail", 3, "process 0 exited with status 3")])
def test_one_failing_process_stops_the_others(mode, status, message, capsys):
  t0 = time.monotonic()
  code = launch.launch(2, 1, [mode], out=_Lines(), grace_s=2.0, command=[sys.executable, "-c", _WORKER])
  assert code == status
  assert time.monotonic() - t0 < 30  # not the 600 s the survivor would wait
  err = capsys.readouterr().err
  assert message in err and "stopping the other 1 running process(es)" in err


def test_a_survivors_traceback_after_a_partner_died_is_one_line(capsys):
  out = _Lines()
  assert launch.launch(2, 1, ["partner"], out=out, grace_s=2.0, command=[sys.executable, "-c", _WORKER]) == 1
  assert "process 1 was killed by SIGKILL" in capsys.readouterr().err
  assert "Traceback" not in out.text and "Gloo" not in out.text
  assert "[p0] (stopped after another process failed; its" in out.text
  # A process's own failure keeps its traceback.
  out = _Lines()
  assert launch.launch(2, 1, ["raise"], out=out, grace_s=2.0, command=[sys.executable, "-c", _WORKER]) == 1
  assert "process 0 exited with status 1" in capsys.readouterr().err
  assert "[p0] Traceback (most recent call last):" in out.text and "[p0] RuntimeError: a bug of process 0" in out.text


_LAUNCHER = """
import sys
from private_t5.stages import launch
sys.exit(launch.launch(2, 1, ["sleep"], grace_s=5.0, command=[sys.executable, "-c", sys.argv[1]]))
"""


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signal_to_the_launcher_stops_and_waits_for_its_processes(signum):
  env = dict(os.environ, PYTHONPATH=PROJECT_ROOT)
  launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _WORKER], cwd=PROJECT_ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  pids = []
  try:
    for line in launcher.stderr:
      if line.startswith("[launch] process"):
        pids.append(int(line.rsplit("pid", 1)[1]))
        if len(pids) == 2:
          break
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    launcher.send_signal(signum)
    launcher.wait(timeout=30)
    assert launcher.returncode == 128 + signum
    assert not [pid for pid in pids if _alive(pid)]
    assert f"launch received {signal.Signals(signum).name}" in launcher.stderr.read()
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait()
    for pid in pids:  # orphans of a launcher that did not stop them
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)


# -- rows of each process -------------------------------------------------------------------------

def test_one_process_owns_every_row():
  mesh = sharding.create_mesh((4, 2))
  assert sharding.local_rows(mesh, 16) == (0, 16)
  assert sharding.local_data_positions(mesh) == 4
  with pytest.raises(ConfigError, match="multiple of the mesh's data axis"):
    sharding.local_rows(mesh, 6)


class _IndexSource:
  """get_batch of the trainer contract whose token rows name the example (tracks reads)."""

  def __init__(self):
    self.reads = 0

  def get_batch(self, indices, seed, batch_size):
    from private_t5.data.source import assemble_batch
    indices = np.asarray(indices, np.int64)
    self.reads += len(indices)
    enc = np.zeros((batch_size, 2), np.int32)
    enc[:len(indices), 0] = indices + 1
    enc[:len(indices), 1] = seed
    return assemble_batch(enc, enc.copy(), indices)


def test_processes_read_only_their_rows_and_real_rows_are_spread():
  indices = np.array([11, 12, 13, 14, 15, 16], np.int64)  # 6 real rows of a padded batch of 16
  whole_source = _IndexSource()
  whole = loop.local_batch(whole_source, indices, 7, 16, 4, range(0, 16))
  assert whole_source.reads == 6
  # Data position p (4 rows) holds indices p, p + 4, ... then padding.
  assert whole["example_index"].tolist() == [11, 15, -1, -1, 12, 16, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1]
  # Each row's position in the step's sample (its dropout key), padding numbered after the sample.
  assert whole["row_id"].tolist() == [0, 4, 6, 7, 1, 5, 8, 9, 2, 10, 11, 12, 3, 13, 14, 15]
  parts = []
  for rows in (range(0, 8), range(8, 16)):  # process 0 and 1 of a 2 x 2 cluster
    source = _IndexSource()
    parts.append(loop.local_batch(source, indices, 7, 16, 4, rows))
    assert source.reads == 4 if rows.start == 0 else source.reads == 2
  for key, value in whole.items():
    np.testing.assert_array_equal(np.concatenate([parts[0][key], parts[1][key]]), value)


# -- 2 processes x 2 devices == 1 process x 4 devices (slow: real runs) ---------------------------

@pytest.fixture(scope="module")
def corpus_and_vocab(shared_data, tmp_path_factory):
  return fortunes_corpus_and_vocab(shared_data, str(tmp_path_factory.mktemp("vocab")))


def _train_args(model_dir, corpus, vocab, steps, *extra):
  return ["train", "--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
          f"--gin.CORPUS={corpus}", f"--gin.VOCAB_PATH={vocab}", f"--gin.TRAIN_STEPS={steps}",
          f"--gin.DATA_CACHE_DIR={os.path.dirname(vocab)}/cache", *MICRO_TRAIN_ARGS,
          "--gin.BATCH_SIZE=16", "--gin.train.microbatch_size=None", "--gin.DPConfig.expected_batch_size=2", "--gin.train.log_every=1",
          "--gin.train.eval_examples=16", *extra]


def _launch(num_processes, devices, args, timeout=1500):
  """`python -m private_t5.stages.cli launch ...` in a fresh process: the CompletedProcess."""
  env = dict(os.environ, PYTHONPATH=PROJECT_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run([sys.executable, "-m", "private_t5.stages.cli", "launch", f"--num_processes={num_processes}",
                         f"--devices_per_process={devices}", "--", *args],
                        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [
    # Poisson samples of about 6 run as global microbatches of 4 rows, spread over both processes.
    # (Ghost clipping, the default: how rows reach the processes does not depend on the clipping
    # method, and vmap's clipped sums equal ghost's on one process, tests/test_ghost.py.) Banded
    # noise (b = 2, from Gin): its state, fully sharded over the data axis, is threaded and saved
    # by both processes together. (Gaussian noise on two processes: the LoRA and kill tests.)
    ("dp_ghost", ["--gin.train.clipping_method='ghost'", "--gin.train.mesh_shape=(4, 1)",
                  "--gin.train.microbatch_size=4", "--gin.DPConfig.expected_batch_size=6",
                  "--gin.DPConfig.noise='banded'", "--gin.DPConfig.num_bands=2",
                  "--gin.train.parameter_sharding='fully_sharded'"]),
    ("nonprivate", ["--gin.DP=None", "--gin.train.mesh_shape=(2, 2)"]),
])
def test_two_processes_train_like_one(corpus_and_vocab, tmp_path, name, extra):
  corpus, vocab = corpus_and_vocab
  results = {}
  for procs, devices in ((1, 4), (2, 2)):
    model_dir = str(tmp_path / f"{name}_{procs}x{devices}")
    # The two-process DP run builds its rows in a data worker process of each (the same sample in
    # both workers, each process's rows only): the same step as one process building in line.
    workers = ["--gin.train.data_workers=1"] if procs == 2 and name.startswith("dp") else []
    done = _launch(procs, devices, _train_args(model_dir, corpus, vocab, 3, *extra, *workers))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "[p0] [train] done: step 3" in done.stdout
    # One dispatch a step, one compiled shape: the Poisson sample's microbatches stacked to a fixed count.
    shapes = r"\d+ microbatches of 4 rows" if name.startswith("dp") else "one batch of 16 rows"
    assert re.search(rf"\[p0\] \[train\] compiled train-step shapes this session: 1 \({shapes}\)", done.stdout)
    if procs == 2:
      assert "[p1] [train] done: step 3" in done.stdout
    with open(os.path.join(model_dir, "privacy_report.json")) as f:
      results[procs] = (saved_state(model_dir, 3), json.load(f))
  (s1, r1), (s2, r2) = results[1], results[2]
  assert s1.keys() == s2.keys()
  assert any("noise_state" in jax.tree_util.keystr(k) for k in s1) == name.startswith("dp")
  for path in s1:  # the parameters, the optimizer's state and the noise state
    np.testing.assert_allclose(s2[path], s1[path], rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert r1 == r2 and r2["steps"] == 3


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory):
  """Random weights of the micro model in the Hugging Face layout: a LoRA run's frozen base."""
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  from private_t5 import io as io_lib  # pylint: disable=g-import-not-at-top
  from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from private_t5.models import network  # pylint: disable=g-import-not-at-top
  from private_t5.models import hf_export  # pylint: disable=g-import-not-at-top
  config = config_lib.T5Config(vocab_size=512, d_model=32, num_heads=2, d_kv=16, d_ff=64, num_encoder_layers=1,
                           num_decoder_layers=1)
  tensors, hf_config = hf_export.export_hf_t5(jax.tree.map(np.asarray, network.init_params(config, jax.random.PRNGKey(0))),
                                              config)
  path = tmp_path_factory.mktemp("lora_base")
  io_lib.write_json_atomic(str(path / "config.json"), hf_config)
  io_lib.write_bytes_atomic(str(path / "model.safetensors"), st_numpy.save(tensors, metadata={"format": "pt"}))
  return str(path)


@pytest.mark.slow
def test_two_processes_train_lora_adapters_like_one(corpus_and_vocab, lora_base, tmp_path):
  """DP-LoRA (ghost): the frozen base goes to every process's devices, the adapters agree."""
  corpus, vocab = corpus_and_vocab
  extra = ["--gin.DPConfig.method='ghost'", "--gin.train.mesh_shape=(2, 2)", f"--gin.train.initial_checkpoint='{lora_base}'",
           "--gin.train.lora=@LoraConfig()", "--gin.LoraConfig.targets=('query', 'value', 'wo')"]
  adapters = {}
  for procs, devices in ((1, 4), (2, 2)):
    model_dir = str(tmp_path / f"lora_{procs}x{devices}")
    done = _launch(procs, devices, _train_args(model_dir, corpus, vocab, 2, *extra))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    adapters[procs] = checkpoint_read.restore_for_inference(model_dir, merge_adapters=False)[0]
  leaves = jax.tree.leaves(adapters[1])
  assert len(leaves) == 2 * (3 + 5)  # A and B of query, value, wo (encoder); of both attentions' query, value and wo (decoder)
  for a, b in zip(leaves, jax.tree.leaves(adapters[2])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_killed_process_stops_the_cluster_and_the_relaunch_resumes(corpus_and_vocab, tmp_path):
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path / "run")
  steps = 12  # each step saves a checkpoint: the kill, 0.2 s after the first one, lands mid-run
  args = _train_args(model_dir, corpus, vocab, steps, "--gin.train.mesh_shape=(4, 1)",
                     "--gin.train.checkpoint_every=1", "--gin.train.eval_examples=0")
  env = dict(os.environ, PYTHONPATH=PROJECT_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  launcher = subprocess.Popen([sys.executable, "-m", "private_t5.stages.cli", "launch", "--num_processes=2",
                               "--devices_per_process=2", "--", *args], cwd=PROJECT_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    # Any committed checkpoint (rotation keeps only the newest few, so step 1 may be gone already).
    deadline = time.monotonic() + 1200
    while not run_dir.checkpoint_step_names(model_dir) and time.monotonic() < deadline and launcher.poll() is None:
      time.sleep(0.2)
    assert run_dir.checkpoint_step_names(model_dir), "no checkpoint was written"
    assert launcher.poll() is None, "the run ended before it could be killed"
    pids = {}
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
      children = [int(x) for x in f.read().split()]
    for pid in children:
      with open(f"/proc/{pid}/environ", "rb") as f:
        environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
      pids[int(environ[partitioning.PROCESS_ID_ENV.encode()])] = pid
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    out, err = launcher.communicate(timeout=60)
    assert time.monotonic() - t0 < 60
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert launcher.returncode != 0
  assert "process 1 was killed by SIGKILL" in err
  assert "Traceback" not in out, out[-3000:]  # the survivor's failed collective is not a second story
  for pid in pids.values():
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
  saved = checkpoints.CheckpointManager(model_dir, async_save=False)
  last = saved.latest_step()
  saved.close()
  assert last is not None and last >= 1
  # The same launch resumes from the last complete checkpoint, with the same ledger (checkpointing
  # only at the end: what is tested is the resume, not the saves after it).
  done = _launch(2, 2, [*args, f"--gin.train.checkpoint_every={steps}"])
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
  assert f"[p0] [train] resuming from checkpoint step {last}" in done.stdout
  with open(os.path.join(model_dir, "privacy_report.json")) as f:
    assert json.load(f)["steps"] == steps


# -- GLUE evaluation: 2 processes x 2 devices == 1 process x 4 devices (slow) ----------------------

_GLUE_LENGTHS = {"inputs": 32, "targets": 4}


@pytest.fixture(scope="module")
def glue_model_dir(shared_data, tmp_path_factory):
  """A tiny model trained briefly on bbc_news: its predictions differ between examples (4 of the
  5 topics on the first 45 validation examples), so the metrics see every gathered prediction."""
  from private_t5.models import config as config_lib
  from private_t5.models import network
  from private_t5.data import glue_tasks
  from private_t5.train import main as train_main
  from private_t5.train import optimizers
  from test_glue_tasks import train_test_vocab  # pylint: disable=g-bad-import-order
  directory = tmp_path_factory.mktemp("glue")
  vocab = train_test_vocab(shared_data, directory / "glue.model")
  train = glue_tasks.GlueSource("bbc_news", "train", vocab, _GLUE_LENGTHS, vocab_size=1024)
  model_dir = str(directory / "ft")
  train_main.train(model_config=config_lib.load_preset("t5_1_0_tiny", vocab_size=1024, dropout_rate=0.0),
                   train_data=train, model_dir=model_dir, train_steps=60,
                   batch_size=min(32, train.num_examples),  # 30 rows in the repository's fixture
                   learning_rate=optimizers.constant_schedule(1e-2), dp=None, vocab_path=vocab,
                   checkpoint_every=60, eval_every=0, eval_examples=0, log_every=60, mesh_shape=(1, 1),
                   insecure_deterministic_seed=3)
  return model_dir


@pytest.mark.slow
def test_evaluation_on_two_processes_equals_one(glue_model_dir, tmp_path):
  """`private-t5 evaluate` under `launch`: the examples are split over the processes, the decoded
  texts gathered, and the results (written once, by process 0) equal the single process's."""
  results = {}
  for procs, devices in ((1, 4), (2, 2)):
    out_dir = tmp_path / f"eval_{procs}x{devices}"
    # 45 examples (15 in the fixture): an odd count, so the two processes' shares differ.
    done = _launch(procs, devices, [
        "evaluate", "--gin_file=configs/runs/eval.gin", f"--gin.MODEL_DIR={glue_model_dir}",
        "--gin.MIXTURE_OR_TASK_NAME=bbc_news", f"--gin.TASK_FEATURE_LENGTHS={_GLUE_LENGTHS!r}",
        "--gin.evaluate.batch_size=8", "--gin.evaluate.max_examples=45", f"--gin.evaluate.output_dir={out_dir}"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stdout.count("| majority class |") == 1  # the table is printed (and written) once
    with open(out_dir / "results.json") as f:
      results[procs] = json.load(f)
  assert results[1] == results[2]
  task = results[2]["tasks"]["bbc_news"]
  assert task["num_examples"] == expected(45, 15) and task["invalid_predictions"] < 1.0
  assert 0.0 < task["score"] < 100.0  # not one constant prediction (these examples share one label)
