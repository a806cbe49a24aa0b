"""A privacy ledger's JSON: the fields it writes, and reading them back from any version.

`ledger_to_dict` writes a `PrivacyLedger`'s fields (its noisy sum as the flat fields
`noise_multiplier`, `clip_norm`, `expected_batch_size`; a Gaussian ledger without the
correlated-noise fields, as it always was) and `ledger_from_dict` reads them back, also from a
`report()` and from ledgers written by earlier versions (no `expected_batch_size`: q·N/b from
`sampling_rate` and `num_examples`).
"""
import dataclasses
from typing import Any, Dict

from private_t5.dp.privacy_params import NoisySum
from private_t5.errors import DataError

LEDGER_VERSION = 1
# The fields only a correlated-noise ledger writes.
_CORRELATED_FIELDS = ("noise", "num_bands", "strategy")


def ledger_to_dict(ledger) -> Dict[str, Any]:
  """The JSON-ready fields of `ledger` (a `PrivacyLedger`), with `ledger_version`."""
  d = dataclasses.asdict(ledger)
  del d["noisy_sum"]
  if not ledger.correlated:  # a Gaussian ledger's JSON is as it always was
    for name in _CORRELATED_FIELDS:
      del d[name]
  else:
    d["noise"] = str(ledger.noise)  # the plain string (a `NoiseKind` is one)
  d.update(noise_multiplier=ledger.noise_multiplier, clip_norm=ledger.clip_norm,
           expected_batch_size=ledger.expected_batch_size, ledger_version=LEDGER_VERSION)
  return d


def ledger_from_dict(cls, d: Dict[str, Any]):
  """The ledger of class `cls` that `d` records (`ledger_to_dict`'s output, of this version or an
  earlier one), or a `report()` (its `ledger` entry is read); DataError for a field missing."""
  if isinstance(d.get("ledger"), dict):
    d = d["ledger"]
  names = {f.name for f in dataclasses.fields(cls)}
  missing = [n for n in ("noise_multiplier", "sampling_rate", "clip_norm", "delta") if n not in d]
  if missing:
    raise DataError(f"privacy ledger is missing {missing}")
  fields = {k: v for k, v in d.items() if k in names and k != "noisy_sum"}
  noisy_sum = None
  if not d.get("non_private", False):
    expected = d.get("expected_batch_size")
    if expected is None and d.get("num_examples"):
      expected = float(d["sampling_rate"]) * int(d["num_examples"]) / int(d.get("num_bands", 1))
    if expected is None:
      raise DataError("privacy ledger has neither expected_batch_size nor num_examples")
    noisy_sum = NoisySum(d["clip_norm"], d["noise_multiplier"], expected)
  return cls(noisy_sum=noisy_sum, **fields)
