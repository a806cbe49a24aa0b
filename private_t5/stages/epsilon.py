"""`private-t5 epsilon`: ε of a DP training run, or the noise multiplier for a target ε.

  private-t5 epsilon --noise_multiplier=0.4 --batch_size=8192 --num_examples=5240387307 \\
      --steps=100000 --delta=1.9082e-10 --accountant=rdp
  private-t5 epsilon --target_epsilon=6.06 --sampling_rate=1.5632e-6 --steps=100000 --delta=1e-10

Prints one JSON object: {"epsilon", "epsilon_rdp", "epsilon_pld", "accountant_used", "delta",
"noise_multiplier", "sampling_rate", "steps", "accountant", ...}. The default --accountant=auto
computes both RDP and PLD and reports the smaller ε (σ for a target ε: the smaller of the two
calibrations); with --max_batch_size also the truncation probability, "total_delta" (the δ the
reported ε holds at) and "delta_rdp" (RDP's δ, grown by the truncation term; PLD accounts the
truncated event itself, at --delta). "auto" then reports the smaller ε among the accountants that
hold at --delta; an RDP result whose total δ is >= 1 is refused (no guarantee). Past 10^7 steps,
or where RDP's ε is above 10^4, PLD is not run (its arrays grow with both): "auto" reports RDP's
ε ("epsilon_pld": null) and --accountant=pld is refused.

--noise=banded --num_bands=b (or --noise=blt [--buffers=k]) accounts correlated noise by matrix
factorization with cyclic Poisson sampling in b groups: --sampling_rate is the rate q within a
group, --batch_size the expected batch q·N/b of a step (q = b · batch / N). The output names the
mechanism ("mechanism"); the strategy's coefficients do not change ε (docs/privacy.md).

Without --delta (nor the Gin macro DELTA), δ is training's default for N = --num_examples,
min(1e-5, 1/N^1.1) (`dp.mechanism.default_delta`); the output then says so ("delta_source") and
a log line gives the value.

Every flag can be given as its Gin macro instead, in a --gin_file or as --gin.NAME=VALUE
(--gin.NUM_BANDS=4 is --num_bands=4, --gin.DELTA=1e-6 is --delta=1e-6), parsed and type-checked
as every stage does (`stages.flags`); an override that sets anything else is refused, and so is
a flag given beside its macro with another value. A target ε that no σ up to the largest one the
calibration searches reaches is refused in one line naming the smallest ε these settings reach.
"""
import argparse
import json
import logging
import sys
import warnings
from typing import List, Optional

from private_t5 import checks, epsilon_checks
from private_t5.dp import accounting
from private_t5.dp import privacy_params
from private_t5.dp import truncation
from private_t5.errors import PrivacyError
from private_t5.stages import flags

logger = logging.getLogger(__name__)
DEFAULT_DELTA_SOURCE = "the training default min(1e-5, 1/N^1.1) of N = --num_examples"


def _parser():
  p = flags.StageParser("epsilon", __doc__.split("\n\n")[0], macros_only=True)
  p.add_flag("noise_multiplier", type=float, help="σ: noise std / clip norm")
  p.add_flag("target_epsilon", aliases=("epsilon",), type=float,
             help="calibrate σ for this ε instead (exclusive with --noise_multiplier)")
  p.add_flag("batch_size", type=float, help="expected batch size (with --num_examples)")
  p.add_flag("num_examples", type=int, help="N, the number of privacy units sampled from",
             check=lambda v, name: checks.integer(v, name, minimum=1))
  p.add_flag("sampling_rate", type=float, help="q, instead of --batch_size/--num_examples")
  p.add_flag("steps", type=int, help="number of training steps (required)",
             check=lambda v, name: checks.integer(v, name, minimum=1))
  p.add_flag("delta", type=float, check=checks.probability,
             help="δ in (0, 1) (use δ << 1/N); default: training's, min(1e-5, 1/N^1.1) of --num_examples")
  p.add_flag("accountant", default=privacy_params.AUTO, choices=privacy_params.ACCOUNTANT_CHOICES,
             help="auto (default): the smaller ε of rdp and pld")
  p.add_flag("sampling", default="poisson", choices=privacy_params.SAMPLING_SCHEMES,
             help="poisson (default) or fixed shuffled batches (accounted without replacement)")
  p.add_flag("max_batch_size", type=int, help="truncation cap of a Poisson batch (adds to δ)")
  p.add_flag("noise", default="gaussian", choices=("gaussian", "banded", "blt"),
             help="gaussian (DP-SGD, default), or correlated noise: banded or blt matrix factorization")
  p.add_flag("num_bands", type=int, check=lambda v, name: checks.integer(v, name, minimum=1),
             help="b >= 1: cyclic Poisson groups (bands; a BLT's min separation); default 1 (banded: DP-SGD)")
  p.add_flag("buffers", type=int, help="--noise=blt: its buffers (ε does not depend on them)")
  return p


def run(args: argparse.Namespace, delta_source: str = "--delta") -> dict:
  """Computes the JSON answer for parsed flags (raises PrivacyError on bad input; the settings are
  checked together by `private_t5.epsilon_checks`).

  `delta_source` names where δ came from ("--delta", or the Gin macro DELTA) in the warnings.
  The reported ε holds at `total_delta`: at --delta, unless only RDP accounted a truncated batch
  (its δ then grows by the truncation term, `accounting.total_delta`); a total δ >= 1 (no
  guarantee at all) is refused.
  """
  if args.num_bands is None:
    args.num_bands = 1
  epsilon_checks.check_bands(args)
  epsilon_checks.check_sampling_source(args)
  if args.sampling_rate is not None:
    q = args.sampling_rate
  else:
    privacy_params.validate_privacy_params(batch_size=args.batch_size, num_examples=args.num_examples)
    q = privacy_params.sampling_rate_from_batch(args.batch_size * args.num_bands, args.num_examples)
  if args.noise.correlated:
    return _correlated(args, q, delta_source)
  epsilon_checks.check_gaussian(args)
  privacy_params.validate_privacy_params(
      noise_multiplier=args.noise_multiplier, sampling_rate=q, steps=args.steps, delta=args.delta,
      num_examples=args.num_examples, accountant=args.accountant, sampling=args.sampling,
      delta_source=delta_source)
  epsilon_checks.check_gaussian_sampling(args)
  p_trunc = truncation.truncation_probability(args.num_examples, q, args.max_batch_size)
  kw = dict(sampling=args.sampling, num_examples=args.num_examples)
  out = {}
  if args.target_epsilon is not None:
    sigma = accounting.calibrate_noise(args.target_epsilon, q, args.steps, args.delta, args.accountant, **kw)
    out["target_epsilon"] = args.target_epsilon
  else:
    sigma = args.noise_multiplier
  eps_by = accounting.compute_epsilons(sigma, q, args.steps, args.delta, accountant=args.accountant,
                                       max_batch_size=args.max_batch_size, **kw)
  # The δ each ε holds at: PLD accounts a truncated batch exactly (at --delta); RDP accounts the
  # untruncated batch, and truncation adds (1 + e^ε) · steps · p_trunc to its δ.
  delta_by = {name: (truncation.total_delta(args.delta, args.steps, p_trunc, e) if name == "rdp" else args.delta)
              for name, e in eps_by.items()}
  # The smaller ε among the accountants that hold at --delta; RDP at its larger δ only when it is alone.
  at_delta = [name for name in eps_by if delta_by[name] <= args.delta]
  used = min(at_delta or eps_by, key=lambda name: (eps_by[name], name))
  eps, delta_total = eps_by[used], delta_by[used]
  if delta_total >= 1.0:
    raise PrivacyError(epsilon_checks.no_guarantee(args, p_trunc, delta_total, delta_source,
                                                   args.accountant == privacy_params.AUTO))
  # An accountant's ε whose δ is >= 1 is no guarantee: not printed as one.
  shown = {name: (e if delta_by[name] < 1.0 else None) for name, e in eps_by.items()}
  out.update(epsilon=eps, epsilon_rdp=shown.get("rdp"), epsilon_pld=shown.get("pld"),
             accountant_used=used, delta=args.delta, noise_multiplier=sigma, sampling_rate=q,
             steps=args.steps, accountant=args.accountant, sampling=args.sampling, noise="gaussian")
  if args.max_batch_size is not None:
    out.update(max_batch_size=args.max_batch_size, truncation_probability=p_trunc, total_delta=delta_total)
    if "rdp" in delta_by:
      out["delta_rdp"] = delta_by["rdp"]
  if delta_total > args.delta:
    where = (f"δ={args.delta:g} from {delta_source} plus {delta_total - args.delta:.4g} for truncating batches "
             f"at --max_batch_size={args.max_batch_size}, accounted by RDP")
    if delta_total >= 1.0 / args.num_examples:
      warnings.warn(
          f"total_delta={delta_total:.4g} ({where}) >= 1/num_examples={1.0 / args.num_examples:g}: the (ε, δ) "
          "guarantee is meaningless (a mechanism that publishes one random example satisfies it); raise "
          "--max_batch_size" + ("" if args.accountant == privacy_params.AUTO else " or use --accountant=pld"),
          privacy_params.MeaninglessGuaranteeWarning)
    else:
      logger.warning("ε=%.4g holds at total_delta=%.4g (%s), not at δ=%g%s", eps, delta_total, where, args.delta,
                      "" if args.accountant == privacy_params.AUTO else
                      "; --accountant=pld accounts the truncation exactly at δ")
  return out


def _correlated(args: argparse.Namespace, q: float, delta_source: str) -> dict:
  """`run` for --noise=banded or blt (untruncated Poisson sampling in --num_bands groups)."""
  epsilon_checks.check_correlated(args)
  privacy_params.validate_privacy_params(
      noise_multiplier=args.noise_multiplier, sampling_rate=q, steps=args.steps, delta=args.delta,
      num_examples=args.num_examples, accountant=args.accountant, delta_source=delta_source)
  out = accounting.correlated_plan(args.noise, q, args.steps, args.delta, num_bands=args.num_bands,
                                   noise_multiplier=args.noise_multiplier, target_epsilon=args.target_epsilon,
                                   accountant=args.accountant)
  out.update(delta=args.delta, sampling_rate=q, steps=args.steps, accountant=args.accountant, sampling="poisson",
             noise=str(args.noise), num_bands=args.num_bands)
  if args.buffers is not None:
    out["buffers"] = args.buffers
  if args.num_examples is not None:
    out["expected_batch_size"] = q * args.num_examples / args.num_bands
  return out


def main(argv: Optional[List[str]] = None) -> int:
  parser = _parser()
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_stage_args(argv).args
  args.noise = privacy_params.NoiseKind(args.noise)  # parsed once (one of its flag's choices)
  if (args.noise_multiplier is None) == (args.target_epsilon is None):
    raise PrivacyError("give exactly one of --noise_multiplier and --target_epsilon")
  flags.check_required(parser, args, ("steps",))
  given = any(a == "--delta" or a.startswith("--delta=") for a in argv)
  source = "--delta" if given else "Gin macro DELTA"
  if args.delta is None:
    if args.num_examples is None:
      raise PrivacyError("give --delta, or --num_examples for training's default δ = min(1e-5, 1/N^1.1)")
    privacy_params.validate_privacy_params(num_examples=args.num_examples)
    from private_t5.dp import config  # pylint: disable=g-import-not-at-top  # (imports JAX)
    args.delta, source = config.default_delta(args.num_examples), DEFAULT_DELTA_SOURCE
    logger.info("no --delta: δ = %g, training's default min(1e-5, 1/N^1.1) for N = %d", args.delta,
                args.num_examples)
  if args.noise == privacy_params.NoiseKind.BANDED and (args.num_bands or 1) == 1:
    logger.warning("--noise=banded with num_bands b = 1%s is plain DP-SGD (one band: the identity strategy, "
                   "every example sampled at every step), the same ε as --noise=gaussian; give --num_bands=b > 1 "
                   "for banded noise", "" if args.num_bands else " (no --num_bands)")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", privacy_params.MeaninglessGuaranteeWarning)
    out = run(args, source)
  for w in caught:
    logger.warning("%s", w.message)
  out["delta_source"] = "training default min(1e-5, 1/N^1.1)" if source == DEFAULT_DELTA_SOURCE else source
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
