"""The runner switch of the corpus-wide stages: `local` or an Apache Beam runner, and its options.

Every corpus-wide stage (the DP-SentencePiece histogram, the memorization splits) takes

  --runner=local                 the in-process path (default; fast for small corpora), or
  --runner=DirectRunner|DaskRunner|DataflowRunner|FlinkRunner|SparkRunner|...   an Apache Beam runner,
  --beam_options="--direct_num_workers=2 --direct_running_mode=multi_processing"
                                 passed to `PipelineOptions` unchanged
                                 (DaskRunner: "--dask_client_address=HOST:PORT" of a running
                                 dask.distributed scheduler; docs/scaling.md).

Beam is imported only when a Beam runner is chosen (`import_beam`, `pipeline_options`): a missing
Beam, or Dask for the DaskRunner, is one ConfigError line saying what to install, and an invalid
option is one line naming it, before anything is built or written.
"""
import contextlib
import io
import shlex
from typing import List, Optional, Sequence, Union

from private_t5.errors import ConfigError
from private_t5.lazy_imports import MissingLibrary, import_now, lazy_module

# How to get Beam, for the one line a missing Beam module gives.
BEAM_INSTALL = "apache-beam (requirements.txt), or use --runner=local"
_DASK_INSTALL = "pip install 'private_t5[dask]'"
options_lib = lazy_module("apache_beam.options.pipeline_options", needed_for="a Beam runner", install=BEAM_INSTALL)
dask_distributed = lazy_module("dask.distributed", needed_for="--runner=DaskRunner", install=_DASK_INSTALL)
dask_runner = lazy_module("apache_beam.runners.dask.dask_runner", needed_for="--runner=DaskRunner",
                          install=_DASK_INSTALL)

LOCAL_RUNNER = "local"
BEAM_RUNNERS = ("DirectRunner", "DaskRunner", "PrismRunner", "DataflowRunner", "FlinkRunner", "SparkRunner",
                "PortableRunner", "SwitchingDirectRunner")
DASK_RUNNER = "DaskRunner"
# Runners Beam does not resolve by their short name.
_RUNNER_PATHS = {DASK_RUNNER: "apache_beam.runners.dask.dask_runner.DaskRunner"}
RUNNERS = (LOCAL_RUNNER,) + BEAM_RUNNERS


def check_runner(runner: str) -> str:
  """Returns `runner` when it is `local` or a known Beam runner; else one-line ConfigError."""
  if runner not in RUNNERS:
    raise ConfigError(f"unknown runner {runner!r}: use one of {', '.join(RUNNERS)}")
  return runner


def is_beam(runner: Optional[str]) -> bool:
  """True when `runner` names a Beam runner (not the in-process path)."""
  return check_runner(runner or LOCAL_RUNNER) != LOCAL_RUNNER


def add_runner_flags(parser) -> None:
  """Adds --runner, --beam_options and --skip_bad_lines to an argparse parser."""
  parser.add_argument("--runner", default=LOCAL_RUNNER,
                      help=f"'{LOCAL_RUNNER}' (in-process, default) or a Beam runner: {', '.join(BEAM_RUNNERS)}")
  parser.add_argument("--beam_options", default="",
                      help="Beam pipeline flags, passed to PipelineOptions unchanged "
                           "(e.g. \"--direct_num_workers=2 --direct_running_mode=multi_processing\"; "
                           "DaskRunner: \"--dask_client_address=HOST:PORT\")")
  parser.add_argument("--skip_bad_lines", action="store_true",
                      help="Beam runners: count and skip malformed lines instead of stopping")


def import_beam():
  """`apache_beam`, or a one-line ConfigError when it is not importable."""
  try:
    # Not a lazy stand-in, which would remember its first import: checked again on every call.
    import apache_beam as beam  # pylint: disable=g-import-not-at-top  # checked again on every call
  except ImportError as e:
    raise ConfigError(f"a Beam runner needs Apache Beam, which is not importable ({e}); install "
                      "apache-beam (requirements.txt) or use --runner=local") from None
  return beam


def pipeline_options(runner: str, beam_options: Union[str, Sequence[str], None] = ""):
  """`PipelineOptions` from the flag string (unchanged) plus the runner name, all parsed.

  Raises:
    ConfigError: an unbalanced quote, `--runner` inside the options, or an invalid option value.
  """
  check_runner(runner)
  if runner == LOCAL_RUNNER:
    raise ConfigError("the local runner builds no Beam pipeline")
  flags = _split_options(beam_options)
  if any(f == "--runner" or f.startswith("--runner=") for f in flags):
    raise ConfigError("give the runner with --runner, not inside --beam_options")
  import_beam()
  if runner == DASK_RUNNER:
    _import_dask_runner()  # registers its options (--dask_client_address, ...)
    if not any(f.split("=", 1)[0] in ("--dask_npartitions", "--dask_partition_size") for f in flags):
      # One element (a file, a band, a partition) is one Dask task: the runner's default puts up
      # to 128 elements of a Create in one task, which one worker would run one after another.
      flags.append("--dask_partition_size=1")
  options = options_lib.PipelineOptions(flags=flags + [f"--runner={_RUNNER_PATHS.get(runner, runner)}"])
  _check_options(options, beam_options)
  return options


def runner_name(options) -> str:
  """The short runner name of built options (`DaskRunner`, not its module path)."""
  return str(options.view_as(options_lib.StandardOptions).runner or "").rsplit(".", 1)[-1]


def _import_dask_runner():
  """Beam's DaskRunner module, or a one-line ConfigError when dask or distributed is missing."""
  try:
    import_now(dask_distributed)
    return import_now(dask_runner)
  except ImportError as e:
    reason = e.__cause__ if isinstance(e, MissingLibrary) and e.__cause__ is not None else e
    raise ConfigError(f"--runner=DaskRunner needs dask and distributed, which are not importable ({reason}); "
                      f"install them with {_DASK_INSTALL}") from None


def _split_options(beam_options: Union[str, Sequence[str], None]) -> List[str]:
  """The --beam_options string split as a shell would (a list is taken as it is)."""
  if not isinstance(beam_options, str):
    return list(beam_options or [])
  try:
    return shlex.split(beam_options)
  except ValueError as e:  # an unbalanced quote
    raise ConfigError(f"--beam_options={beam_options!r}: {e}") from None


def _check_options(options, beam_options) -> None:
  """Parses every Beam option now, before anything is built or written.

  Beam parses its options lazily, with argparse: an invalid value would print Beam's whole usage
  text and exit once the pipeline starts. Here it is one ConfigError naming the option.
  """
  usage = io.StringIO()
  try:
    with contextlib.redirect_stderr(usage):
      options.get_all_options()
  except SystemExit:
    lines = usage.getvalue().strip().splitlines()
    reason = lines[-1].split("error: ", 1)[-1] if lines else "invalid option"
    raise ConfigError(f"--beam_options={beam_options!r}: {reason}") from None
