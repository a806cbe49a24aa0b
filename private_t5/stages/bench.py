"""`private-t5 bench`: non-DP, DP-vmap and DP-ghost training steps measured side by side.

  private-t5 bench --gin_file=configs/bench/small.gin --gin.benchmark.output_dir=/tmp/bench

The flags, the Gin files and the call of the Gin-configured `experiments.benchmark.benchmark`
(what it measures: that module's docstring); it writes OUTPUT_DIR/bench.json and
OUTPUT_DIR/bench.md and prints the Markdown.
"""
from typing import Sequence

from private_t5.stages import flags
from private_t5.stages import gin_utils
from private_t5 import moved_names

# The library of the benchmark, readable from here for one more release (with a DeprecationWarning;
# imported on first use: JAX and the trainer are not needed for `bench --help`).
__getattr__ = moved_names.moved(__name__, {
    "private_t5.experiments.benchmark": ("MAX_TOKENS", "benchmark", "markdown"),
    "private_t5.experiments.benchmark_case": (
        "GHOST", "GHOST_RECOMPUTE", "GHOST_SECOND_PASS", "GIB", "METHODS", "NONDP", "VMAP", "compiled_memory",
        "make_trainer", "max_batch_search", "random_batch", "run_case"),
})

USAGE = """usage: private-t5 bench --gin_file=configs/bench/<name>.gin [--gin.benchmark.NAME=VALUE ...]

Measures non-DP, DP-vmap and DP-ghost train steps side by side; writes bench.json and bench.md
to benchmark.output_dir. Configs: configs/bench/{quick,tiny,small}.gin.
"""


def main(argv: Sequence[str]) -> int:
  """`private-t5 bench --gin_file=... [--gin.benchmark.NAME=VALUE ...]`."""
  parser = flags.StageParser("bench", USAGE.split("\n\n", 1)[1].strip(), epilog=USAGE.split("\n")[0],
                             gin_required=True)
  parser.add_flag("output", gin="benchmark.output_dir", help="directory of bench.json and bench.md")
  parser.add_flag("steps", gin="benchmark.steps", type=int, help="measured steps per method")
  parser.add_flag("noise_multiplier", gin="benchmark.noise_multiplier", type=float, help="σ of the DP steps")
  parsed = parser.parse_stage_args(argv)
  gin_utils.parse(parsed.gin_files, parsed.gin_bindings, entry="benchmark")
  report = gin_utils.call_configured(gin_utils.configured("benchmark"))
  from private_t5.experiments.benchmark import markdown  # pylint: disable=g-import-not-at-top  # JAX: not for --help
  print(markdown(report))
  return 0
