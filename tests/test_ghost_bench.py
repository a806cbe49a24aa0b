"""`private-t5 bench`: configuration errors, ratios and report, and one real tiny run."""
import json
import os

import pytest

from private_t5.experiments import benchmark
from private_t5.stages import bench
from private_t5.errors import ConfigError


def _result(method, step_s, peak, rss, flops, max_batch=None):
  r = dict(preset="t5_1_0_tiny", inputs=32, targets=8, batch_size=4, method=method, step_s=step_s,
           step_cpu_s=2 * step_s,
           examples_per_s=4 / step_s, memory={"peak_bytes": peak}, peak_rss_bytes=rss,
           flops=flops, compile_s=1.0, memory_budget_gb=1.0)
  if max_batch is not None:
    r["max_batch"] = {"max_batch": max_batch, "capped": False}
  return r


def test_ratios_are_against_the_non_dp_step_of_the_same_shape():
  results = [_result("nondp", 2.0, 100, 1000, 10.0, 64), _result("ghost", 2.5, 110, 1200, 12.0, 48),
             _result("vmap", 4.0, 300, 3000, 11.0, 8)]
  ratios = {r["method"]: r for r in benchmark._ratios(results)}  # pylint: disable=protected-access
  assert set(ratios) == {"ghost", "vmap"}
  assert ratios["ghost"]["throughput"] == pytest.approx(0.8)
  assert ratios["ghost"]["compiled_memory"] == pytest.approx(1.1)
  assert ratios["vmap"]["rss"] == pytest.approx(3.0)
  assert ratios["vmap"]["max_batch"] == pytest.approx(0.125)
  text = benchmark.markdown({"machine": dict(platform="linux", cpu_count=2, jax="x", backend="cpu",
                                         load_average=(1.0, 1.0, 1.0), time_utc="t"),
                         "results": results, "ratios": benchmark._ratios(results)})  # pylint: disable=protected-access
  assert "| t5_1_0_tiny | 32/8 | 4 | ghost | 0.80 | 0.80 | 1.10 | 1.20 | 1.20 | 0.75 |" in text


def test_dtype_ratios_compare_each_method_with_its_float32_step():
  results = [dict(_result(m, s, p, 1000, 10.0), dtype=d) for m, s, p, d in (
      ("nondp", 2.0, 100, "float32"), ("nondp", 3.0, 150, "bfloat16"),
      ("ghost", 2.5, 110, "float32"), ("ghost", 5.0, 121, "bfloat16"))]
  ratios = benchmark._dtype_ratios(results)  # pylint: disable=protected-access
  assert [(r["method"], r["dtype"]) for r in ratios] == [("nondp", "bfloat16"), ("ghost", "bfloat16")]
  assert ratios[0]["step_time"] == pytest.approx(1.5) and ratios[1]["step_time"] == pytest.approx(2.0)
  assert ratios[1]["compiled_memory"] == pytest.approx(1.1)
  # The DP / non-DP ratios stay within one dtype.
  dp = benchmark._ratios(results)  # pylint: disable=protected-access
  assert [(r["dtype"], r["throughput"]) for r in dp] == [
      ("float32", pytest.approx(0.8)), ("bfloat16", pytest.approx(0.6))]
  text = benchmark.markdown({"machine": dict(platform="linux", cpu_count=2, jax="x", backend="cpu",
                                         load_average=(1.0,), time_utc="t"),
                         "results": results, "ratios": dp, "dtype_ratios": ratios})
  assert "| t5_1_0_tiny | 32/8 | 4 | ghost | bfloat16 | 2.00 | 2.00 | 1.10 | 1.00 |" in text
  assert "| t5_1_0_tiny bfloat16 | 32/8 | 4 | ghost | 0.60 |" in text


@pytest.mark.parametrize("kwargs,match", [
    (dict(methods=["fast"]), "methods"),
    (dict(shapes=[(32, 8)]), "shapes"),
    (dict(presets=["t5_9_9"]), "preset"),
    (dict(steps=0), "steps"),
    (dict(dtypes=["bf16"]), "dtypes"),
    (dict(dtypes=[]), "dtypes"),
])
def test_invalid_configuration_raises_config_error(kwargs, match, tmp_path):
  args = dict(presets=["t5_1_0_tiny"], shapes=[(32, 8, 2)], output_dir=str(tmp_path))
  with pytest.raises(ConfigError, match=match):
    benchmark.benchmark(**{**args, **kwargs})


def test_cli_rejects_unknown_flags():
  with pytest.raises(ConfigError, match="unknown flag"):
    bench.main(["--gin_file=configs/bench/quick.gin", "--fast"])


@pytest.mark.slow
def test_tiny_benchmark_end_to_end(tmp_path):
  """Real steps of the tiny model: non-DP and ghost side by side, with a max-batch search."""
  out = str(tmp_path / "bench")
  code = bench.main(["--gin_file=configs/bench/quick.gin", f"--gin.benchmark.output_dir={out}",
                     "--gin.benchmark.shapes=[(16, 4, 2)]", '--gin.benchmark.methods=["nondp", "ghost"]',
                     "--gin.benchmark.warmup=0", "--gin.benchmark.isolate=False",
                     "--gin.benchmark.memory_budget_gb=0.15", "--gin.benchmark.max_batch_cap=4"])
  assert code == 0
  with open(os.path.join(out, "bench.json")) as f:
    report = json.load(f)
  methods = [r["method"] for r in report["results"]]
  assert methods == ["nondp", "ghost"]
  for r in report["results"]:
    assert r["step_s"] > 0 and r["step_cpu_s"] > 0 and r["compile_s"] > 0
    assert r["memory"]["peak_bytes"] > 0
    assert r["max_batch"]["max_batch"] >= 1
  assert report["ratios"][0]["method"] == "ghost" and report["ratios"][0]["throughput"] > 0
  assert report["results"][1]["ghost_breakdown"]["layers"]
  with open(os.path.join(out, "bench.md")) as f:
    assert "DP / non-DP ratios" in f.read()
