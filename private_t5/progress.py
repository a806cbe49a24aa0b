"""Progress bars (tqdm) for loops that can take more than a few seconds.

Bars go to stderr and are off when stderr is not a terminal (logs, CI, pipes) or when the
command line asked for quiet output (`--verbosity=quiet` / `-q` sets `QUIET_ENV`).
"""
import os
import sys
from typing import Any, Callable, Iterable, Optional

from private_t5.lazy_imports import lazy_module

# Imported on first use: `private-t5 --help`, which imports this module, does not load tqdm.
tqdm_auto = lazy_module("tqdm.auto", needed_for="a progress bar", install="tqdm (requirements.txt)")

# Set by the command line (private_t5.stages.flags) for --verbosity=quiet / -q.
QUIET_ENV = "PRIVATE_T5_QUIET"


def enabled() -> bool:
  """True when bars should be drawn: stderr is a terminal and quiet output was not asked for."""
  if os.environ.get(QUIET_ENV):
    return False
  try:
    return sys.stderr.isatty()
  except (AttributeError, ValueError):
    return False


def bar(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: Optional[str] = None,
        unit: str = "it", **kwargs: Any):
  """A `tqdm` bar over `iterable` (or a manual one with `total`), disabled as `enabled()` says."""
  kwargs.setdefault("disable", not enabled())
  kwargs.setdefault("dynamic_ncols", True)
  kwargs.setdefault("leave", False)
  return tqdm_auto.tqdm(iterable, total=total, desc=desc, unit=unit, **kwargs)


def callback(desc: str, unit: str = "it") -> Callable[[int, int], None]:
  """A `(done, total)` callback that moves a bar (for code that reports absolute positions)."""
  state = {"bar": None}

  def update_to(done: int, total: int) -> None:
    if state["bar"] is None:
      state["bar"] = bar(total=total, desc=desc, unit=unit)
    b = state["bar"]
    b.total = total
    b.update(done - b.n)
    if done >= total:
      b.close()
      state["bar"] = None

  return update_to
