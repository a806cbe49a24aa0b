"""The runner switch of the corpus-wide stages: `local` or an Apache Beam runner, and its options.

Every corpus-wide stage (the DP-SentencePiece histogram, the memorization splits) takes

  --runner=local                 the in-process path (default; fast for small corpora), or
  --runner=DirectRunner|DaskRunner|DataflowRunner|FlinkRunner|SparkRunner|...   an Apache Beam runner,
  --beam_options="--direct_num_workers=2 --direct_running_mode=multi_processing"
                                 passed to `PipelineOptions` unchanged
                                 (DaskRunner: "--dask_client_address=HOST:PORT" of a running
                                 dask.distributed scheduler, or "--dask_local_cluster" for a
                                 local cluster started in this process; docs/scaling.md).

Beam is imported only when a Beam runner is chosen (`import_beam`, `pipeline_options`): a missing
Beam, or Dask for the DaskRunner, is one ConfigError line saying what to install, and an invalid
option is one line naming it, before anything is built or written. On the DaskRunner the
`--dask_*` options are checked before anything is submitted (`_dask_flags`): an unknown one, a
value that is not a positive integer or a HOST:PORT address, no scheduler at all (neither an
address, a scheduler file nor `--dask_local_cluster`), and a scheduler that does not answer a
TCP connection (within 5 s, or `--dask_connection_timeout`) are one ConfigError line each.
`--beam_options` given with `--runner=local`, which reads none of them, is one warning.
"""
import contextlib
import io
import json
import logging
import re
import shlex
import socket
import types
from typing import Dict, List, Optional, Sequence, Tuple, Union

from private_t5.errors import ConfigError
from private_t5.lazy_imports import MissingLibrary, import_now, lazy_module

# Its log lines carry the name of `data.beam_io`, the stages' one module for Beam.
logger = logging.getLogger("private_t5.data.beam_io")

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

# `--dask_local_cluster` is this package's own option, taken out before Beam reads the options:
# Beam's DaskRunner starts a local cluster when it is given no scheduler, which has to be asked for.
DASK_LOCAL_CLUSTER = "--dask_local_cluster"
DASK_ADDRESS = "--dask_client_address"
DASK_SCHEDULER_FILE = "--dask_scheduler_file"
DASK_CONNECTION_TIMEOUT = "--dask_connection_timeout"
_DASK_FLAG = re.compile(r"--dask[_-]")
# Seconds a TCP connection to the scheduler may take before it is reported as not answering
# (--dask_connection_timeout when given); a refused connection is reported at once.
PROBE_SECONDS = 5
# [tcp://]HOST:PORT, HOST a name, an IPv4 address or a bracketed IPv6 one.
_ADDRESS = re.compile(r"(?:(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://)?(?P<host>\[[0-9A-Fa-f:.%\w]+\]|[^\s:/\[\]@]+)"
                      r":(?P<port>[0-9]{1,5})/?")
_TCP_SCHEMES = ("tcp", "tls", "ws", "wss")  # schemes over a TCP connection, which is probed
_SCHEMES = _TCP_SCHEMES + ("ucx",)


def check_runner(runner: str) -> str:
  """Returns `runner` when it is `local` or a known Beam runner; else one-line ConfigError."""
  if runner not in RUNNERS:
    raise ConfigError(f"unknown runner {runner!r}: use one of {', '.join(RUNNERS)}")
  return runner


def is_beam(runner: Optional[str]) -> bool:
  """True when `runner` names a Beam runner (not the in-process path)."""
  return check_runner(runner or LOCAL_RUNNER) != LOCAL_RUNNER


def warn_ignored_options(runner: Optional[str], beam_options: Optional[str]) -> None:
  """One warning when `--beam_options` are given with `--runner=local`, which reads none of them
  (called by the stages' flag parser once the flags are read)."""
  if (runner or LOCAL_RUNNER) == LOCAL_RUNNER and (beam_options or "").strip():
    logger.warning("--beam_options=%r is ignored: --runner=local runs in-process and reads no "
                   "Beam options; give a Beam runner (--runner=DirectRunner, DaskRunner, ...) to use them",
                   beam_options)


def add_runner_flags(parser) -> None:
  """Adds --runner, --beam_options and --skip_bad_lines to an argparse parser."""
  parser.add_argument("--runner", default=LOCAL_RUNNER,
                      help=f"'{LOCAL_RUNNER}' (in-process, default) or a Beam runner: {', '.join(BEAM_RUNNERS)}")
  parser.add_argument("--beam_options", default="",
                      help="Beam pipeline flags, passed to PipelineOptions unchanged "
                           "(e.g. \"--direct_num_workers=2 --direct_running_mode=multi_processing\"; "
                           f"DaskRunner: \"{DASK_ADDRESS}=HOST:PORT\" of a running scheduler, or "
                           f"\"{DASK_LOCAL_CLUSTER}\" to start a local one); ignored by --runner=local")
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

  On the DaskRunner the `--dask_*` options are checked first and the scheduler is reached once
  with a TCP connection (`_dask_flags`, `probe_scheduler`); `--dask_local_cluster` is taken out.

  Raises:
    ConfigError: an unbalanced quote, `--runner` inside the options, or an invalid option value;
      a `--dask_*` option on another runner; on the DaskRunner an unknown `--dask_*` option, no
      scheduler named (and no `--dask_local_cluster`), or one that cannot be reached.
  """
  check_runner(runner)
  if runner == LOCAL_RUNNER:
    raise ConfigError("the local runner builds no Beam pipeline")
  flags = _split_options(beam_options)
  if any(f == "--runner" or f.startswith("--runner=") for f in flags):
    raise ConfigError("give the runner with --runner, not inside --beam_options")
  dask = [f.split("=", 1)[0] for f in flags if _DASK_FLAG.match(f)]
  if runner != DASK_RUNNER and dask:
    raise ConfigError(f"--beam_options: the Dask options ({', '.join(dict.fromkeys(dask))}) are for "
                      f"--runner=DaskRunner, not --runner={runner}")
  import_beam()
  scheduler, given = None, {}
  if runner == DASK_RUNNER:
    _import_dask_runner()  # registers its options (--dask_client_address, ...)
    flags, given = _dask_flags(flags)
    scheduler = _dask_scheduler(given)
    if not any(name in given for name in ("--dask_npartitions", "--dask_partition_size")):
      # One element (a file, a band, a partition) is one Dask task: the runner's default puts up
      # to 128 elements of a Create in one task, which one worker would run one after another.
      flags.append("--dask_partition_size=1")
  options = options_lib.PipelineOptions(flags=flags + [f"--runner={_RUNNER_PATHS.get(runner, runner)}"])
  _check_options(options, beam_options)
  if scheduler is not None:
    timeout = given.get(DASK_CONNECTION_TIMEOUT)
    probe_scheduler(*scheduler, seconds=int(timeout) if timeout else PROBE_SECONDS)
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


class _OptionRecorder:
  """What Beam's `DaskOptions._add_argparse_args` declares, recorded without a parser: option name
  -> its settings (`type`, `default`, ...) as a namespace."""

  def __init__(self):
    self.options: Dict[str, types.SimpleNamespace] = {}

  def add_argument(self, *names, **settings):
    for name in names:
      # nargs as argparse reads it: 0 for a switch (store_true/store_false/store_const), else a value.
      switch = settings.get("action") in ("store_true", "store_false", "store_const", "count")
      self.options[name] = types.SimpleNamespace(type=settings.get("type"), default=settings.get("default"),
                                                 nargs=0 if switch else settings.get("nargs"))

  def add_mutually_exclusive_group(self, **_):
    return self

  add_argument_group = add_mutually_exclusive_group


def dask_option_actions() -> Dict[str, Optional[types.SimpleNamespace]]:
  """The `--dask_*` options the installed Beam's DaskRunner knows (name -> its declared settings:
  `type`, ...), and this package's `--dask_local_cluster` (None: a switch taken out before Beam)."""
  recorder = _OptionRecorder()
  _import_dask_runner().DaskOptions._add_argparse_args(recorder)  # pylint: disable=protected-access
  known: Dict[str, Optional[types.SimpleNamespace]] = {
      name: option for name, option in recorder.options.items() if name.startswith("--dask_")}
  known[DASK_LOCAL_CLUSTER] = None
  return known


def _dask_flags(flags: List[str]) -> Tuple[List[str], Dict[str, Union[str, bool]]]:
  """(the flags for Beam, the `--dask_*` options given: name -> value), each value checked.

  `--dask_X=V` and `--dask_X V` are both read (as Beam reads them) and handed on as `--dask_X=V`;
  `--dask_local_cluster` is taken out. An integer option is a positive integer, the connection
  timeout a positive whole number of seconds (Beam silently drops any other value), the address
  [tcp://]HOST:PORT.
  """
  known = dask_option_actions()
  rest: List[str] = []
  given: Dict[str, Union[str, bool]] = {}
  i = 0
  while i < len(flags):
    flag = flags[i]
    i += 1
    if not _DASK_FLAG.match(flag):
      rest.append(flag)
      continue
    name, has_value, value = flag.partition("=")
    if name not in known:
      raise ConfigError(f"--beam_options: unknown Dask option {name}; the DaskRunner knows "
                        f"{', '.join(sorted(known))}")
    if known[name] is None or known[name].nargs == 0:
      if has_value:
        raise ConfigError(f"--beam_options: {name} takes no value, got {flag!r}")
      given[name] = True
      if known[name] is not None:
        rest.append(name)
      continue
    if not has_value:
      if i == len(flags) or flags[i].startswith("--"):
        raise ConfigError(f"--beam_options: {name} needs a value ({name}=VALUE)")
      value = flags[i]
      i += 1
    if name == DASK_CONNECTION_TIMEOUT:
      _positive_int(name, value, "a positive whole number of seconds")
    elif known[name].type is int:
      _positive_int(name, value, "a positive integer")
    elif name == DASK_ADDRESS:
      parse_address(value, name)
    elif not value.strip():
      raise ConfigError(f"--beam_options: {name} needs a value ({name}=VALUE)")
    given[name] = value
    rest.append(f"{name}={value}")
  if "--dask_npartitions" in given and "--dask_partition_size" in given:
    raise ConfigError("--beam_options: give --dask_npartitions or --dask_partition_size, not both")
  return rest, given


def _positive_int(name: str, value: str, what: str) -> int:
  if not re.fullmatch(r"\s*\+?[0-9]+\s*", value) or int(value) < 1:
    raise ConfigError(f"--beam_options: {name} must be {what}, got {value!r}")
  return int(value)


def parse_address(address: str, source: str = DASK_ADDRESS) -> Tuple[str, str, int]:
  """(scheme, host, port) of a Dask scheduler address [SCHEME://]HOST:PORT; else a ConfigError
  naming `source` (the option, or the scheduler file it was read from)."""
  match = _ADDRESS.fullmatch(address.strip())
  port = int(match.group("port")) if match else 0
  if not match or not 0 < port < 65536:
    raise ConfigError(f"{source}: {address!r} is not a Dask scheduler address (HOST:PORT or tcp://HOST:PORT, "
                      "e.g. tcp://10.0.0.5:8786)")
  scheme = (match.group("scheme") or "tcp").lower()
  if scheme not in _SCHEMES:
    raise ConfigError(f"{source}: {address!r} has an unknown protocol {scheme!r} (use one of {', '.join(_SCHEMES)})")
  return scheme, match.group("host").strip("[]"), port


def _dask_scheduler(given: Dict[str, Union[str, bool]]) -> Optional[Tuple[str, str]]:
  """(address, where it came from) of the scheduler the options name, or None for
  `--dask_local_cluster`; a ConfigError when they name none, or more than one."""
  named = [n for n in (DASK_ADDRESS, DASK_SCHEDULER_FILE, DASK_LOCAL_CLUSTER) if n in given]
  if not named:
    raise ConfigError(f"--runner=DaskRunner needs a scheduler: give --beam_options=\"{DASK_ADDRESS}=HOST:PORT\" "
                      f"(or \"{DASK_SCHEDULER_FILE}=FILE\") of a running dask.distributed cluster, or "
                      f"--beam_options={DASK_LOCAL_CLUSTER} to start a local cluster in this process")
  if len(named) > 1:
    raise ConfigError(f"--beam_options: give one of {DASK_ADDRESS}, {DASK_SCHEDULER_FILE} and {DASK_LOCAL_CLUSTER}, "
                      f"not {' and '.join(named)}")
  if DASK_ADDRESS in given:
    return str(given[DASK_ADDRESS]), DASK_ADDRESS
  if DASK_SCHEDULER_FILE in given:
    path = str(given[DASK_SCHEDULER_FILE])
    source = f"{DASK_SCHEDULER_FILE}={path}"
    try:
      with open(path, encoding="utf-8") as f:
        address = json.load(f).get("address")
    except FileNotFoundError:
      raise ConfigError(f"{source}: no such file (the file `dask scheduler --scheduler-file` writes)") from None
    except (OSError, ValueError, AttributeError) as e:
      raise ConfigError(f"{source}: not a Dask scheduler file ({type(e).__name__}: {e})") from None
    if not isinstance(address, str):
      raise ConfigError(f"{source}: not a Dask scheduler file (no \"address\")")
    return address, source
  return None


def probe_scheduler(address: str, source: str = DASK_ADDRESS, seconds: float = PROBE_SECONDS) -> None:
  """Opens (and closes) one TCP connection to a Dask scheduler; a ConfigError line at once when it
  is refused or its host is unknown, after `seconds` when nothing answers.

  Dask itself retries a refused connection for 30 s before it reports it. An address over
  another transport (ucx) is not probed.
  """
  scheme, host, port = parse_address(address, source)
  if scheme not in _TCP_SCHEMES:
    return
  where = f"the Dask scheduler at {address} ({source})"
  try:
    socket.create_connection((host, port), timeout=seconds).close()
  except socket.gaierror as e:
    raise ConfigError(f"cannot reach {where}: unknown host {host!r} ({e.strerror or e})") from None
  except socket.timeout:
    raise ConfigError(f"cannot reach {where}: no answer within {seconds:g} s (a firewall, or the wrong host? "
                      f"{DASK_CONNECTION_TIMEOUT}=SECONDS waits longer)") from None
  except OSError as e:
    reason = (e.strerror or str(e) or type(e).__name__).lower()
    raise ConfigError(f"cannot reach {where}: {reason} (is the scheduler running, and on that port? "
                      f"{DASK_LOCAL_CLUSTER} starts a local cluster instead)") from None


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
