"""`private-t5 launch`: run a stage as N cooperating JAX processes on this machine.

  private-t5 launch --num_processes=2 --devices_per_process=2 -- train --gin_file=... ...

Starts N copies of `private-t5 <stage> <flags>` that form one JAX cluster: process 0 hosts the
coordinator on localhost:PORT, each process sees M CPU devices
(`--xla_force_host_platform_device_count=M`) and the collectives between processes go through
gloo (`train.partitioning.initialize_distributed` reads `PRIVATE_T5_COORDINATOR`,
`PRIVATE_T5_NUM_PROCESSES` and `PRIVATE_T5_PROCESS_ID`). Their output is streamed line by line
with a `[p0]`, `[p1]`, ... prefix; an `error:` line that several processes print alike (a
refused model directory, a bad setting) is shown once. If any process fails (an error, or
killed), the others are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher
exits non-zero: no process waits for a collective whose partner is gone. Ctrl-C, SIGTERM and
SIGHUP to the launcher stop its processes the same way (it waits for them, exit status 128 + the
signal's number): none is left running.

The same stage code runs unchanged on a TPU pod or a SLURM cluster, where the cluster
environment replaces this launcher (docs/training.md, "Multi-host").
"""
import sys
from typing import List, Optional, Sequence, TextIO, Tuple

from private_t5.errors import ConfigError
# The local cluster's library, importable from here too.
from private_t5.train.launch import STOP_GRACE_S
from private_t5.train import launch as cluster

USAGE = """usage: private-t5 launch --num_processes=N --devices_per_process=M [--port=P] -- <stage> [its flags]

Runs `private-t5 <stage> [its flags]` as N local JAX processes with M CPU devices each (one
cluster of N*M devices; gloo collectives). Output is prefixed [p0], [p1], ...; if one process
fails, the others are stopped and the exit status is non-zero; Ctrl-C, SIGTERM or SIGHUP stop
them all. --port: the coordinator's port (default: a free one)."""


def _int_flag(name: str, value: str, minimum: int) -> int:
  try:
    number = int(value)
  except ValueError:
    raise ConfigError(f"--{name} must be an integer >= {minimum}, got {value!r}") from None
  if number < minimum:
    raise ConfigError(f"--{name} must be an integer >= {minimum}, got {number}")
  return number


def parse_args(argv: Sequence[str]) -> Tuple[int, int, Optional[int], List[str]]:
  """(num_processes, devices_per_process, port or None, stage argv); raises ConfigError."""
  argv = list(argv)
  if "--" not in argv:
    raise ConfigError("launch needs `-- <stage> [its flags]` after its own flags")
  split = argv.index("--")
  own, stage = argv[:split], argv[split + 1:]
  values = {"num_processes": None, "devices_per_process": "1", "port": None}
  for arg in own:
    name, eq, value = arg.partition("=")
    key = name[2:] if name.startswith("--") else None
    if key not in values or not eq:
      raise ConfigError(f"unknown launch flag {arg!r} (expected --num_processes=N, --devices_per_process=M, "
                        "--port=P)")
    values[key] = value
  if values["num_processes"] is None:
    raise ConfigError("launch needs --num_processes=N")
  num_processes = _int_flag("num_processes", values["num_processes"], 1)
  devices = _int_flag("devices_per_process", values["devices_per_process"], 1)
  port = None if values["port"] is None else _int_flag("port", values["port"], 1)
  if port is not None and port > 65535:
    raise ConfigError(f"--port must be at most 65535, got {port}")
  if not stage or stage[0].startswith("-"):
    raise ConfigError("launch needs a stage after `--` (e.g. `-- train --gin_file=...`)")
  if stage[0] == "launch":
    raise ConfigError("launch cannot launch itself")
  return num_processes, devices, port, stage


def launch(num_processes: int, devices_per_process: int, stage_argv: Sequence[str], *,
           port: Optional[int] = None, out: TextIO = sys.stdout, grace_s: float = STOP_GRACE_S,
           command: Optional[Sequence[str]] = None) -> int:
  """Runs the cluster to completion; returns 0, or the first failing process's status (1 if killed).

  Args:
    num_processes, devices_per_process: the cluster's shape.
    stage_argv: `<stage> [its flags]`, run as `python -m private_t5.stages.cli <stage> [its flags]`.
    port: the coordinator's port (default: a free one); refused if in use.
    out: where the prefixed output of the processes goes.
    grace_s: seconds between SIGTERM and SIGKILL when stopping the others after a failure.
    command: the program run before `stage_argv` (default `python -m private_t5.stages.cli`).
  """
  if command is None:
    command = [sys.executable, "-m", "private_t5.stages.cli"]
  return cluster.launch(num_processes, devices_per_process, stage_argv, command=command, port=port, out=out,
                        grace_s=grace_s)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0
  num_processes, devices, port, stage = parse_args(argv)
  return launch(num_processes, devices, stage, port=port)


if __name__ == "__main__":
  sys.exit(main())
