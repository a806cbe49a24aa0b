"""train.thunk_census: parsing XLA:GPU's thunk sequence dumps and counting kernels per step.

The fixtures are excerpts of dumps written by the CUDA plugin of jaxlib 0.10.2: the stacked
train step after the thunk passes (command buffers, a while loop over the microbatches whose
trip count is dynamic) and a small program of nested `fori_loop`s (no command buffers).
"""
import pathlib

import pytest

from private_t5.train import thunk_census

DATA = pathlib.Path(__file__).resolve().parent / "testdata" / "thunk_census"


def _text(name):
  return (DATA / name).read_text()


def test_stacked_step_counts_body_times_trips():
  result = thunk_census.census(_text("stacked_step_after_thunk_passes.txt"), trips=8)
  assert result["command_buffers"] == 3
  assert result["while_loops"] == 1
  assert result["counts"] == {"fusion": 12, "memcpy": 3, "command_buffer": 3, "gemm": 2, "while": 1}
  assert result["kernels_static"] == 14
  # 2 before the loop, 8 per trip x 8, the condition 9 times, 3 after it.
  assert result["kernels_per_step"] == 2 + 8 * 8 + 9 + 3
  assert result["counts_per_step"]["gemm"] == 16
  assert result["counts_per_step"]["memcpy"] == 2 + 8
  assert result["loops"][0]["body_kernels"] == 8
  assert result["fusion_families"]["loop_broadcast_fusion"] == 3
  assert thunk_census.top_families(result, 3) == [
      ("loop_add_fusion", 16), ("wrapped_convert", 16), ("loop_broadcast_fusion", 10)]


def test_trips_by_name_index_and_default():
  text = _text("fori_loops.txt")
  names = {4: "while.33", 7: "while.34", 14: "while.25"}
  by_name = thunk_census.census(text, trips={"while.33": 5, "while.34": 3, "default": 7}, names=names)
  by_index = thunk_census.census(text, trips={0: 5, 1: 3, 2: 7})
  # Outer loop: 5 x (inner 3 x 3 + 4 conditions + 2) + 6 conditions; the dynamic loop 7 x 3 + 8.
  assert by_name["kernels_per_step"] == by_index["kernels_per_step"] == 5 * 15 + 6 + 7 * 3 + 8 + 2
  assert [loop["depth"] for loop in by_name["loops"]] == [0, 1, 0]
  assert [loop["name"] for loop in by_name["loops"]] == ["while.33", "while.34", "while.25"]
  assert by_name["counts_per_step"]["gemm"] == 5 * 3 + 7
  assert by_name["command_buffers"] == 0


def test_missing_trip_count_is_an_error():
  with pytest.raises(ValueError, match="no trip count for while loop #0"):
    thunk_census.census(_text("fori_loops.txt"))


@pytest.mark.parametrize("text", ["", "hello world\n", "001: kCopy kCopy\n",
                                  "    005: kCustomKernel [source | sink] f\n",
                                  "body:\n001: kCopy [source | sink] kCopy\n"])
def test_garbage_is_a_value_error(text):
  with pytest.raises(ValueError):
    thunk_census.census(text)


def test_names_and_known_trip_counts():
  metadata = ('thunk_metadata {\n  thunk_info {\n    profile_annotation: "while.33"\n'
              '    thunk_id: 4\n  }\n  thunk_kind: "kWhile"\n}\nthunk_metadata {\n  thunk_info {\n'
              '    profile_annotation: "copy.23"\n    thunk_id: 6\n  }\n  thunk_kind: "kCopy"\n}\n')
  assert thunk_census.while_names(metadata) == {4: "while.33"}
  hlo = ('  %while.33 = (s32[], f32[256,256]{1,0}) while(%tuple.32), condition=%c, body=%b, '
         'backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"1"}}\n'
         '  %while.25 = (s32[]) while(%tuple.35), condition=%c2, body=%b2\n')
  assert thunk_census.known_trip_counts(hlo) == {"while.33": 5}


def test_family_strips_numeric_suffix():
  assert thunk_census.family("loop_add_fusion_161") == "loop_add_fusion"
  assert thunk_census.family("input_reduce_fusion") == "input_reduce_fusion"
  assert thunk_census.bucket("kCuDnnFusion", "cudnn_fusion_1") == "cudnn"


def test_cudnn_thunks_are_kernels():
  text = ("018: kCuDnn          [prev=017 (1)    | next=020 (2)    ] kCuDnn\n"
          "019: kCublasLtMatmul [prev=018 (1)    | next=020 (1)    ] kCublasLtMatmul\n"
          "020: kCustomKernel   [prev=019 (1)    | sink            ] loop_add_fusion_3 grid: "
          "[1024, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes\n")
  result = thunk_census.census(text)
  assert result["counts"] == {"cudnn": 1, "gemm": 1, "fusion": 1}
  assert result["kernels_per_step"] == 3
