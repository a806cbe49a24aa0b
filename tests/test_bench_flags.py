"""`private-t5 bench` and `private-t5 info`: settings that cannot work are one `error:` line and
exit status 2 before any work, with nothing written (in-process, well under a second a case)."""
import jax
import pytest

from private_t5.experiments import benchmark
from private_t5.experiments import benchmark_case

from test_bad_inputs import BENCH, files_under, one_error_line


class _WouldRun(Exception):
  pass


@pytest.fixture
def no_cases(monkeypatch):
  """A case that passes every check is not run: `_WouldRun` carries its dict instead."""
  def stop(case):
    raise _WouldRun(case)
  monkeypatch.setattr(benchmark, "_run_isolated", stop)
  monkeypatch.setattr(benchmark, "run_case", stop)


@pytest.mark.parametrize("bad, message", [
    # One array of the step alone is larger than any machine's memory.
    (["--gin.benchmark.shapes=[(100000000, 8, 2)]"],
     "benchmark.shapes entry (100000000, 8, 2) cannot fit in this machine's memory"),
    (["--gin.benchmark.shapes=[(8, 8, 67108864)]", "--gin.benchmark.methods=['nondp', 'ghost']"],
     "t5_1_0_tiny's output logits [batch 67108864, targets 8, vocab 8320] in float32, is 16,640.0 GiB"),
    (["--gin.benchmark.shapes=[(8, 8, 67108864)]"], "per-example gradients of the largest parameter"),
    (["--gin.benchmark.shapes=[(32, 8, 4)]", "--gin.benchmark.microbatch_size=3"],
     "benchmark.microbatch_size=3 must divide the batch size of every benchmark.shapes entry"),
    (["--gin.benchmark.max_batch_cap=0"], "benchmark.max_batch_cap must be an integer >= 1 (or None"),
    (["--gin.benchmark.max_batch_cap=2.5"], "benchmark.max_batch_cap must be an integer"),
    (["--gin.benchmark.memory_budget_gb=-1"], "benchmark.memory_budget_gb must be a finite number > 0"),
    (["--gin.benchmark.memory_budget_gb=0"], "benchmark.memory_budget_gb must be a finite number > 0"),
    (["--gin.benchmark.max_batch_resolution=1.0"], "benchmark.max_batch_resolution must be a number in [0, 1)"),
    (["--gin.benchmark.max_batch_resolution=-0.5"], "benchmark.max_batch_resolution must be a number in [0, 1)"),
    (["--gin.benchmark.max_batch_shapes=[5]"], "benchmark.max_batch_shapes must be a list of (inputs, targets)"),
    (["--gin.benchmark.max_batch_shapes=[(32, 0)]"], "benchmark.max_batch_shapes must be a list"),
    (["--gin.benchmark.presets='t5_1_0_tiny'"], "benchmark.presets must be a non-empty list"),
    (["--gin.benchmark.presets=[]"], "benchmark.presets must be a non-empty list"),
    (["--gin.benchmark.methods='nondp'"], "benchmark.methods must be a non-empty subset"),
    (["--gin.benchmark.dtypes='bfloat16'"], "benchmark.dtypes must be a non-empty list"),
    (["--gin.benchmark.dropout_rate=2.0"], "T5Config.dropout_rate must be in [0, 1)"),
])
def test_bench_refuses_settings_that_cannot_work(bad, message, tmp_path, capsys, no_cases):
  del no_cases
  line = one_error_line(BENCH + [f"--output={tmp_path}/b", *bad], capsys)
  assert message in line, line
  assert files_under(tmp_path) == []


def test_a_shape_is_refused_by_what_one_array_of_its_step_needs():
  from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.load_preset("t5_1_0_tiny")
  floor, what = benchmark_case.step_memory_floor(config, 100_000_000, 8, 2, benchmark_case.NONDP)
  assert floor == 2 * 4 * 100_000_000 ** 2 * 4 and what.startswith("attention weights")
  floor, what = benchmark_case.step_memory_floor(config, 32, 8, 2, benchmark_case.VMAP)
  assert floor == 2 * 8320 * 128 * 4 and what.startswith("per-example gradients")
  floor, _ = benchmark_case.step_memory_floor(config.replace(dtype="bfloat16"), 8, 8, 1000, benchmark_case.NONDP)
  assert floor == 1000 * 8 * 8320 * 2  # the output logits, in the activation dtype
  assert benchmark_case.machine_memory_bytes() > 0


def test_no_max_batch_cap_is_the_token_limit_of_the_benchmark(tmp_path, no_cases):
  del no_cases
  with pytest.raises(_WouldRun) as run:
    benchmark.benchmark(presets=["t5_1_0_tiny"], shapes=[(32, 8, 2)], output_dir=str(tmp_path),
                        memory_budget_gb=0.05, max_batch_cap=None)
  case = run.value.args[0]
  assert case["max_batch_cap"] == benchmark.MAX_TOKENS // 40 and case["memory_budget_gb"] == 0.05
  assert files_under(tmp_path) == []


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN's attention runs on a GPU")
def test_info_refuses_cudnn_attention_off_a_gpu_as_train_does(capsys):
  line = one_error_line(["info", "--gin_file=models/t5_1_1_small.gin", "--gin.T5Config.attention='cudnn'"],
                        capsys)
  assert "T5Config.attention 'cudnn' is NVIDIA's fused attention kernel and needs a GPU" in line
  assert f"JAX backend is {jax.default_backend()!r}" in line


def test_info_takes_the_portable_fused_attention(capsys):
  assert one_line_json(["info", "--gin_file=models/t5_1_1_tiny.gin", "--gin.T5Config.attention='xla'",
                        "--indent=0"], capsys)["config"]["attention"] == "xla"


def one_line_json(argv, capsys):
  import json  # pylint: disable=g-import-not-at-top
  from private_t5.stages import cli  # pylint: disable=g-import-not-at-top
  assert cli.main(argv) == 0
  return json.loads(capsys.readouterr().out)
