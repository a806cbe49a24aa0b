"""A step's device time by HLO op, read back from a `jax.profiler` trace (CPU here)."""
import time

import jax
import jax.numpy as jnp
import pytest

from private_t5.train import kernel_profile


def test_op_kinds_from_names():
  kinds = {name: kernel_profile.op_kind(name) for name in (
      "cublas-gemm.3", "gemm_fusion.2", "dot.5", "ynn_fusion.1", "while.761", "input_reduce_fusion.3",
      "transpose_copy_fusion.9", "all-reduce.1", "loop_multiply_fusion", "wrapped_sine")}
  assert kinds == {"cublas-gemm.3": "matmul", "gemm_fusion.2": "matmul", "dot.5": "matmul",
                   "ynn_fusion.1": "matmul", "while.761": "loop", "input_reduce_fusion.3": "reduce",
                   "transpose_copy_fusion.9": "copy/transpose", "all-reduce.1": "collective",
                   "loop_multiply_fusion": "other", "wrapped_sine": "other"}


def test_a_profile_sums_each_op_once_per_step(tmp_path):
  x = jnp.ones((128, 128), jnp.float32)
  step = jax.jit(lambda x: jax.lax.fori_loop(0, 20, lambda i, y: jnp.tanh(y @ x), x).sum())
  step(x).block_until_ready()  # compiled before the trace
  wall = []

  def run():
    t = time.perf_counter()
    step(x).block_until_ready()
    wall.append(time.perf_counter() - t)

  profile = kernel_profile.profile_steps(run, 3, str(tmp_path / "trace"))
  assert profile["steps"] == 3 and profile["ops"] >= 1
  # The loop's body runs inside the loop's event: counted once, with the loop (not as matmuls too).
  assert max(profile["by_kind"], key=profile["by_kind"].get) == "loop", profile["by_kind"]
  assert profile["by_kind"].get("matmul", 0) < 0.2 * profile["by_kind"]["loop"], profile["by_kind"]
  assert 0 < profile["ms_per_step"] <= 1e3 * max(wall) * 1.05
  assert sum(profile["by_kind"].values()) == pytest.approx(profile["ms_per_step"], rel=1e-3)


def test_a_module_filter_that_matches_nothing_is_an_error(tmp_path):
  f = jax.jit(lambda x: x * 2)
  f(jnp.ones(4)).block_until_ready()
  with pytest.raises(RuntimeError, match="names an HLO instruction of a module named like 'no_such'"):
    kernel_profile.profile_steps(lambda: f(jnp.ones(4)).block_until_ready(), 1, str(tmp_path), module="no_such")


class _Event:
  def __init__(self, name, stats, duration_ns=5.0):
    self.name, self.stats, self.duration_ns = name, list(stats.items()), duration_ns


def test_an_op_is_read_from_its_stats_an_annotation_or_a_kernel_name():
  read = kernel_profile._op_and_module  # pylint: disable=protected-access
  assert read(_Event("x", {"hlo_op": "fusion.3", "hlo_module": "jit_step"}), False) == ("fusion.3", "jit_step")
  assert read(_Event("sm90_gemm", {"level 0": "cublas-gemm.1:#hlo_module=jit_step,program_id=7#"}), True) == (
      "cublas-gemm.1", "jit_step")
  assert read(_Event("loop_add_fusion", {"stream_id": 7}), True) == ("loop_add_fusion", "")
  assert read(_Event("ThreadpoolListener::Record", {}), False) == (None, None)
