"""The accountants' log: dp_accounting's numerical notes that no user can act on, left out.

`quiet_convergence_warnings` installs `ConvergenceFilter` on the absl logger dp_accounting
writes through; `accounting` does so when it is imported.
"""
import logging

from absl import logging as absl_logging


class ConvergenceFilter(logging.Filter):
  """Drops dp_accounting's numerical notes that no user can act on (`QUIET_MESSAGES`).

  "_compute_log_a_frac failed to converge": the RDP accountant evaluates a grid of Rényi
  orders; for fractional orders at large σ·q the series may not converge and dp_accounting then
  leaves that order out of the minimum (the bound stays valid, computed from the remaining
  orders). "Negative Renyi divergence ... Returning an epsilon of zero": at a huge σ (say 1e9)
  an order's divergence rounds below 0 and that order gives ε = 0, which is the answer (one
  such line per order: dozens per call).
  """
  QUIET_MESSAGES = ("failed to converge", "Negative Renyi divergence")

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(part in message for part in self.QUIET_MESSAGES)


def quiet_convergence_warnings() -> None:
  """Installs `ConvergenceFilter` on the absl logger dp_accounting writes through (once)."""
  target = absl_logging.get_absl_logger()
  if not any(isinstance(f, ConvergenceFilter) for f in target.filters):
    target.addFilter(ConvergenceFilter())
