"""`private-t5 epsilon`: ε of a DP training run, or the noise multiplier for a target ε.

  private-t5 epsilon --noise_multiplier=0.4 --batch_size=8192 --num_examples=5240387307 \\
      --steps=100000 --delta=1.9082e-10 --accountant=rdp
  private-t5 epsilon --target_epsilon=6.06 --sampling_rate=1.5632e-6 --steps=100000 --delta=1e-10

Prints one JSON object: {"epsilon", "epsilon_rdp", "epsilon_pld", "accountant_used", "delta",
"noise_multiplier", "sampling_rate", "steps", "accountant", ...}. The default --accountant=auto
computes both RDP and PLD and reports the smaller ε (σ for a target ε: the smaller of the two
calibrations); with --max_batch_size also the truncation probability and the total δ of the
RDP bound (PLD accounts the truncated event itself). Past 10^7 steps, or where RDP's ε is above
10^4, PLD is not run (its arrays grow with both): "auto" reports RDP's ε ("epsilon_pld": null) and
--accountant=pld is refused.
"""
import argparse
import json
import logging
import sys
import warnings
from typing import List, Optional

from private_t5.dp import accounting
from private_t5.errors import PrivacyError
from private_t5.stages import flags


def _parser():
  p = flags.StageParser("epsilon", __doc__.split("\n\n")[0])
  p.add_flag("noise_multiplier", type=float, help="σ: noise std / clip norm")
  p.add_flag("target_epsilon", aliases=("epsilon",), type=float,
             help="calibrate σ for this ε instead (exclusive with --noise_multiplier)")
  p.add_flag("batch_size", type=float, help="expected batch size (with --num_examples)")
  p.add_flag("num_examples", type=int, help="N, the number of privacy units sampled from")
  p.add_flag("sampling_rate", type=float, help="q, instead of --batch_size/--num_examples")
  p.add_flag("steps", type=int, help="number of training steps (required)")
  p.add_flag("delta", type=float, help="δ (use δ << 1/N) (required)")
  p.add_flag("accountant", default=accounting.AUTO, choices=accounting.ACCOUNTANT_CHOICES,
             help="auto (default): the smaller ε of rdp and pld")
  p.add_flag("sampling", default="poisson", choices=accounting.SAMPLING_SCHEMES,
             help="poisson (default) or fixed shuffled batches (accounted without replacement)")
  p.add_flag("max_batch_size", type=int, help="truncation cap of a Poisson batch (adds to δ)")
  return p


def run(args: argparse.Namespace) -> dict:
  """Computes the JSON answer for parsed flags (raises PrivacyError on bad input)."""
  if args.sampling_rate is not None:
    if args.batch_size is not None:
      raise PrivacyError("give --sampling_rate or --batch_size/--num_examples, not both")
    q = args.sampling_rate
  else:
    if args.batch_size is None or args.num_examples is None:
      raise PrivacyError("need --sampling_rate, or both --batch_size and --num_examples")
    accounting.validate_privacy_params(batch_size=args.batch_size, num_examples=args.num_examples)
    q = accounting.sampling_rate_from_batch(args.batch_size, args.num_examples)
  accounting.validate_privacy_params(
      noise_multiplier=args.noise_multiplier, sampling_rate=q, steps=args.steps, delta=args.delta,
      num_examples=args.num_examples, accountant=args.accountant, sampling=args.sampling)
  if args.sampling == "fixed" and args.num_examples is None:
    raise PrivacyError("--sampling=fixed needs --num_examples")
  kw = dict(sampling=args.sampling, num_examples=args.num_examples)
  out = {}
  if args.target_epsilon is not None:
    sigma = accounting.calibrate_noise(args.target_epsilon, q, args.steps, args.delta, args.accountant, **kw)
    out["target_epsilon"] = args.target_epsilon
  else:
    sigma = args.noise_multiplier
  eps_by = accounting.compute_epsilons(sigma, q, args.steps, args.delta, accountant=args.accountant,
                                       max_batch_size=args.max_batch_size, **kw)
  used = min(eps_by, key=lambda name: (eps_by[name], name))
  eps = eps_by[used]
  out.update(epsilon=eps, epsilon_rdp=eps_by.get("rdp"), epsilon_pld=eps_by.get("pld"),
             accountant_used=used, delta=args.delta, noise_multiplier=sigma, sampling_rate=q,
             steps=args.steps, accountant=args.accountant, sampling=args.sampling)
  if args.max_batch_size is not None:
    if args.num_examples is None:
      raise PrivacyError("--max_batch_size needs --num_examples")
    p_trunc = accounting.truncation_probability(args.num_examples, q, args.max_batch_size)
    delta_total = (args.delta if used == "pld" else
                   accounting.total_delta(args.delta, args.steps, p_trunc, eps))
    out.update(max_batch_size=args.max_batch_size, truncation_probability=p_trunc, total_delta=delta_total)
    accounting.validate_privacy_params(delta=min(delta_total, 0.999999), num_examples=args.num_examples)
  return out


def main(argv: Optional[List[str]] = None) -> int:
  parser = _parser()
  args = parser.parse_stage_args(sys.argv[1:] if argv is None else argv).args
  if (args.noise_multiplier is None) == (args.target_epsilon is None):
    raise PrivacyError("give exactly one of --noise_multiplier and --target_epsilon")
  flags.check_required(parser, args, ("steps", "delta"))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", accounting.MeaninglessGuaranteeWarning)
    out = run(args)
  for w in caught:
    logging.warning("%s", w.message)
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
