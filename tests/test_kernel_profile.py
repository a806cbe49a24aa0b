"""A step's device time by HLO op, read back from a `jax.profiler` trace (CPU here)."""
import os
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


_FIXTURE = os.path.join(os.path.dirname(__file__), "testdata", "h200_nondp_step.xplane.pb")
_SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "accelerator", "h200_t5_small_b32",
                       "nondp.xplane.pb")


def _check_h200_nondp_step(profile):
  # T5 v1.1 small, 512/114, batch 32, bf16, non-DP, on one H200: every kernel of the step ran
  # inside one command buffer (`hlo_op` "command_buffer_1"), ~3,700 kernels, 23.4 ms of kernel
  # time, 8.2 ms of it matrix products.
  assert profile["ms_per_step"] == pytest.approx(23.42, abs=0.02)
  assert profile["by_kind"]["matmul"] == pytest.approx(8.2, abs=0.02)
  assert profile["ops"] > 200 and not any(op.startswith("command_buffer") for op, _, _ in profile["top_ops"])
  assert sum(profile["by_kind"].values()) == pytest.approx(profile["ms_per_step"], rel=1e-3)


def test_a_gpu_profile_counts_the_kernels_of_a_command_buffer():
  """One step of the H200 profile (its device kernels with their `hlo_op` / `hlo_module`
  stats, the rest dropped): the kernels the command buffer launched, by their own names."""
  _check_h200_nondp_step(kernel_profile.summarize(kernel_profile.op_times(_FIXTURE), steps=1))
  assert kernel_profile.op_times(_FIXTURE, module="no_such") == {}


@pytest.mark.skipif(not os.path.exists(_SHARED), reason="the shared H200 profile is not here")
def test_the_shared_h200_profile_reads_the_same_per_step():
  _check_h200_nondp_step(kernel_profile.summarize(kernel_profile.op_times(_SHARED), steps=3))


class _Line:
  def __init__(self, name, events):
    self.name, self.events = name, events


class _Plane:
  def __init__(self, name, lines):
    self.name, self.lines = name, lines


def _kernel(name, start, duration, **stats):
  event = _Event(name, stats, duration)
  event.start_ns = start
  return event


def test_device_kernels_count_by_instruction_without_command_buffers_and_concurrently():
  """Without command buffers each kernel carries its instruction (a cuBLAS kernel its
  `cublas-gemm`); overlapping kernels all count; a host plane is not read beside a device's."""
  stream = _Line("Stream #14(Compute)", [
      _kernel("nvjet_sm90_tst_128x128", 0, 10, hlo_op="cublas-gemm.3", hlo_module="jit_step"),
      _kernel("nvjet_sm90_tst_128x128", 20, 10, hlo_op="cublas-gemm.3", hlo_module="jit_step"),
      _kernel("loop_add_fusion", 5, 4, hlo_op="loop_add_fusion", hlo_module="jit_step"),
      _kernel("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n", 30, 6, hlo_op="command_buffer_2", hlo_module="jit_step")])
  host = _Plane("/host:CPU", [_Line("python3", [_kernel("while.1", 0, 100, hlo_op="while.1")])])
  times = kernel_profile.plane_op_times([_Plane("/device:GPU:0", [stream]), host])
  assert times == pytest.approx({"cublas-gemm.3": 20e-9, "loop_add_fusion": 4e-9,
                                 "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n": 6e-9})


def test_float32_gemms_on_cuda_cores_are_a_kind_of_their_own():
  kinds = {name: kernel_profile.op_kind(name) for name in (
      "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8", "cutlass_80_simt_sgemm_128x128_8x4_nn_align1",
      "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT", "Memset 0")}
  assert kinds == {"sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8": "matmul f32",
                   "cutlass_80_simt_sgemm_128x128_8x4_nn_align1": "matmul f32",
                   "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": "matmul",
                   "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT": "matmul", "Memset 0": "copy/transpose"}
