"""A local cluster: N cooperating JAX processes on this machine, their output, their stopping.

Starts N copies of a command (`private-t5 launch` runs `private-t5 <stage> <flags>`) that form
one JAX cluster: process 0 hosts the coordinator on localhost:PORT, each process sees M CPU
devices (`--xla_force_host_platform_device_count=M`) and the collectives between processes go
through gloo (`train.partitioning.initialize_distributed` reads `PRIVATE_T5_COORDINATOR`,
`PRIVATE_T5_NUM_PROCESSES` and `PRIVATE_T5_PROCESS_ID`). Their output is streamed line by line
with a `[p0]`, `[p1]`, ... prefix; an `error:` line that several processes print alike (a
refused model directory, a bad setting) is shown once. If any process fails (an error, or
killed), the others are stopped (SIGTERM, then SIGKILL after a grace period) and `launch`
returns non-zero: no process waits for a collective whose partner is gone. Ctrl-C, SIGTERM and
SIGHUP to the launcher stop its processes the same way (it waits for them, exit status 128 + the
signal's number): none is left running.
"""
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, List, Optional, Sequence, Set, TextIO, Tuple

from private_t5.errors import ConfigError
from private_t5.train.partitioning import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

logger = logging.getLogger(__name__)

# Seconds between SIGTERM and SIGKILL when stopping the remaining processes.
STOP_GRACE_S = 10.0
# Seconds a process's Python traceback is held back (`_stream`).
TRACEBACK_HOLD_S = 5.0
_TRACEBACK = "Traceback (most recent call last):"
_POLL_S = 0.2
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port() -> int:
  """A TCP port on localhost that is free now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def check_port_free(port: int) -> None:
  """Raises ConfigError if localhost:`port` cannot be bound (already in use)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind(("localhost", port))
    except OSError as e:
      raise ConfigError(f"--port={port} is already in use on localhost ({e.strerror or e}); "
                        "choose another or leave --port out") from None


def process_env(base: dict, *, process_id: int, num_processes: int, devices_per_process: int,
                port: int) -> dict:
  """The environment of process `process_id` of the local cluster."""
  env = dict(base)
  flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  env[COORDINATOR_ENV] = f"localhost:{port}"
  env[NUM_PROCESSES_ENV] = str(num_processes)
  env[PROCESS_ID_ENV] = str(process_id)
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _stream(prefix: str, pipe, out: TextIO, lock: threading.Lock, errors_seen: Set[str],
            partner_failed: Callable[[], bool] = lambda: False) -> None:
  """Copies `pipe` to `out` line by line with `prefix`; an `error:` line already shown from
  another process (every process refused alike) is not repeated.

  A Python traceback is held until the process's output ends (or, while it runs on, up to
  `TRACEBACK_HOLD_S`): one that ends the process after another process failed (a collective whose
  partner is gone) is shown as one line, as the launcher names the process that failed first.
  """
  held, since = [], 0.0

  def write(text: str) -> None:
    with lock:
      if text.startswith("error:"):
        if text in errors_seen:
          return
        errors_seen.add(text)
      out.write(f"{prefix} {text}\n")
      out.flush()

  for line in iter(pipe.readline, ""):
    text = line.rstrip("\n")
    if not held and text.startswith(_TRACEBACK):
      held, since = [text], time.monotonic()
      continue
    if held and time.monotonic() - since < TRACEBACK_HOLD_S:
      held.append(text)
      continue
    for t in held:
      write(t)
    held = []
    write(text)
  if held and partner_failed():
    write(f"(stopped after another process failed; its {len(held)}-line traceback is not shown)")
  else:
    for t in held:
      write(t)
  pipe.close()


class _Stopped(Exception):
  """The launcher received SIGTERM or SIGHUP."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
  """Within the block, SIGTERM and SIGHUP raise `_Stopped` once (later ones are ignored while the
  processes are being stopped), so the launcher stops its processes instead of orphaning them."""
  if threading.current_thread() is not threading.main_thread():
    yield  # signal handlers can only be set from the main thread
    return
  received = []

  def handler(signum, frame):  # pylint: disable=unused-argument
    if not received:
      received.append(signum)
      raise _Stopped(signum)

  previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def _describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with status {code}"


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
  """SIGTERM to every running process, SIGKILL to those still running after `grace_s`."""
  for p in procs:
    if p.poll() is None:
      p.terminate()
  deadline = time.monotonic() + grace_s
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def launch(num_processes: int, devices_per_process: int, stage_argv: Sequence[str], *,
           command: Sequence[str], port: Optional[int] = None, out: TextIO = sys.stdout,
           grace_s: float = STOP_GRACE_S) -> int:
  """Runs the cluster to completion; returns 0, or the first failing process's status (1 if killed).

  Args:
    num_processes, devices_per_process: the cluster's shape.
    stage_argv: the arguments each process runs `command` with (`<stage> [its flags]`).
    command: the program each process runs, before `stage_argv`.
    port: the coordinator's port (default: a free one); refused if in use.
    out: where the prefixed output of the processes goes.
    grace_s: seconds between SIGTERM and SIGKILL when stopping the others after a failure.
  """
  if port is None:
    port = free_port()
  else:
    check_port_free(port)
  logger.info("launching %d processes x %d devices, coordinator localhost:%d: %s", num_processes,
               devices_per_process, port, " ".join(stage_argv))
  with _stop_on_signals():
    return _run(num_processes, devices_per_process, stage_argv, port=port, out=out, grace_s=grace_s,
                command=command)


def _run(num_processes: int, devices_per_process: int, stage_argv: Sequence[str], *, port: int,
         out: TextIO, grace_s: float, command: Sequence[str]) -> int:
  lock = threading.Lock()
  errors_seen: Set[str] = set()
  procs: List[subprocess.Popen] = []
  threads: List[threading.Thread] = []
  failed: Optional[Tuple[int, int]] = None
  stopping = threading.Event()  # set once the launcher stops processes itself

  def partner_failed(i: int) -> bool:
    """Whether a process other than `i` failed first (not one the launcher stopped)."""
    if failed is not None:
      return failed[0] != i
    return not stopping.is_set() and any(j != i and p.poll() not in (None, 0) for j, p in enumerate(procs))

  try:
    for i in range(num_processes):
      env = process_env(os.environ, process_id=i, num_processes=num_processes,
                        devices_per_process=devices_per_process, port=port)
      p = subprocess.Popen([*command, *stage_argv], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
      procs.append(p)
      with lock:
        print(f"[launch] process {i} of {num_processes}: pid {p.pid}", file=sys.stderr, flush=True)
      t = threading.Thread(target=_stream, args=(f"[p{i}]", p.stdout, out, lock, errors_seen,
                                                 lambda i=i: partner_failed(i)), daemon=True)
      t.start()
      threads.append(t)
    while failed is None and any(p.poll() is None for p in procs):
      # Of the processes found failed together, one killed by a signal is named first (its
      # partners fail because it is gone).
      found = sorted((p.returncode >= 0, i, p.returncode) for i, p in enumerate(procs) if p.poll() not in (None, 0))
      if found:
        failed = found[0][1:]
      else:
        time.sleep(_POLL_S)
    if failed is None:
      failed = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0), None)
    if failed is not None:
      i, code = failed
      others = [p for j, p in enumerate(procs) if j != i and p.poll() is None]
      with lock:
        note = f"; stopping the other {len(others)} running process(es)" if others else ""
        print(f"error: process {i} {_describe_exit(code)}{note}", file=sys.stderr, flush=True)
      stopping.set()
      _stop(others, grace_s)
  except KeyboardInterrupt:
    stopping.set()
    _stop(procs, grace_s)
    failed = (-1, 130)
  except _Stopped as e:
    with lock:
      print(f"error: launch received {e}; stopping its {len(procs)} process(es)", file=sys.stderr, flush=True)
    stopping.set()
    _stop(procs, grace_s)
    failed = (-1, 128 + e.signum)
  finally:
    _stop(procs, grace_s)
    for t in threads:
      t.join(timeout=5)
  if failed is None:
    return 0
  return failed[1] if failed[1] > 0 else 1
