"""`private-t5 info --gin_file=configs/models/<preset>.gin [--gin.X=..]`: a model's summary as JSON.

Shapes come from `jax.eval_shape`, so even the large presets are never allocated.
"""
import dataclasses
import json
import sys
from typing import List, Optional

from private_t5.stages import gin_utils
from private_t5.errors import ConfigError
from private_t5.stages import flags


def summarize(config) -> dict:
  """JSON-ready summary of a `T5Config`: sizes, parameter count, parameters per top-level part."""
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.models import network  # pylint: disable=g-import-not-at-top
  shapes = network.param_shapes(config)
  per_part = {name: sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))
              for name, tree in shapes.items()}
  summary = {
      "num_params": sum(per_part.values()),
      "num_params_by_part": per_part,
      "num_layers": config.num_layers,
      "num_encoder_layers": config.num_encoder_layers,
      "num_decoder_layers": config.num_decoder_layers,
      "d_model": config.d_model,
      "vocab_size": config.vocab_size,
      "num_heads": config.num_heads,
      "d_kv": config.d_kv,
      "d_ff": config.d_ff,
      "feed_forward": config.feed_forward,
      "tie_embeddings": config.tie_embeddings,
      "dropout_rate": config.dropout_rate,
      "dtype": config.dtype,
  }
  summary["config"] = dataclasses.asdict(config)
  return summary


def main(argv: Optional[List[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = flags.StageParser(
      "info", "Print a T5 model's summary (parameter count, shapes) as JSON. "
              "Flags: --gin_file=configs/models/<preset>.gin (repeatable), --gin.NAME=VALUE.")
  parser.add_flag("vocab_size", gin="T5Config.vocab_size", type=int, help="vocabulary size of the model")
  parser.add_flag("indent", type=int, default=2, macro=False, help="JSON indentation (0 for one line)")
  parsed = parser.parse_stage_args(argv)
  args, gin_files, gin_bindings = parsed.args, parsed.gin_files, parsed.gin_bindings
  if not gin_files:
    raise ConfigError("info needs --gin_file=configs/models/<preset>.gin")
  gin_utils.parse(gin_files, gin_bindings, check_required=False, entry="T5Config")  # only the model is read
  config = gin_utils.call_configured(gin_utils.configured("T5Config"))
  from private_t5.train.main import check_attention_backend  # pylint: disable=g-import-not-at-top
  check_attention_backend(config)  # as `train` does: tracing the model runs the attention's checks
  print(json.dumps(summarize(config), indent=args.indent or None))
  return 0


if __name__ == "__main__":
  sys.exit(main())
