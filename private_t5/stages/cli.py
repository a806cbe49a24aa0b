"""The single console entry point: `private-t5 <stage> [flags]`.

Each stage lives in its own module exposing `main(argv: list[str]) -> int`; modules are
imported lazily so that `private-t5 epsilon` does not pay for importing TensorFlow.
"""
import importlib
import importlib.util
import logging
import os
import sys
import warnings

# Before anything imports TensorFlow: its C++ INFO/WARNING lines are not for users.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from private_t5.errors import PrivateT5Error  # pylint: disable=g-import-not-at-top,wrong-import-position

# stage name -> (module, one-line help)
STAGES = {
    "info": ("private_t5.stages.info", "print a model preset's summary (parameters, shapes) as JSON"),
    "spm": ("private_t5.stages.spm", "train a (non-private) SentencePiece vocabulary from a corpus"),
    "dp-spm": ("private_t5.stages.dp_spm", "train a differentially private SentencePiece vocabulary"),
    "store": ("private_t5.stages.store", "tokenize a corpus into the token store cache (local or Apache Beam)"),
    "train": ("private_t5.stages.train", "pretrain or fine-tune a T5 model from Gin configs (DP or not)"),
    "epsilon": ("private_t5.stages.epsilon", "compute epsilon for a DP run, or the noise for a target epsilon"),
    "splits": ("private_t5.stages.splits", "find the memorization splits (near-duplicates) of train/validation"),
    "memorization": ("private_t5.stages.memorization", "measure training-data extraction and canary exposure"),
    "canaries": ("private_t5.stages.canaries", "insert random canaries into a corpus and record them"),
    "evaluate": ("private_t5.stages.evaluate", "evaluate a checkpoint on GLUE-style tasks"),
    "study": ("private_t5.stages.study", "reproduce the paper's memorization findings end to end on a corpus"),
    "bench": ("private_t5.stages.bench", "benchmark non-DP vs DP training steps side by side"),
    "redact": ("private_t5.stages.redact", "detect secrets and write a redacted corpus"),
    "jft": ("private_t5.stages.jft", "selective DP: Just Fine-tune Twice (redacted phase, then DP phase)"),
    "adaptive": ("private_t5.stages.adaptive", "adaptive-noise DP training (no formal guarantee)"),
    "import": ("private_t5.stages.import_hf", "import a Hugging Face T5 directory as a model directory"),
    "export": ("private_t5.stages.export", "export a model directory to the Hugging Face T5 format"),
    "launch": ("private_t5.stages.launch", "run a stage as N cooperating JAX processes on this machine"),
}


def _available():
  out = {}
  for name, (module, help_text) in STAGES.items():
    try:
      found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
      found = False
    if found:
      out[name] = (module, help_text)
  return out


def _usage(stages) -> str:
  lines = ["usage: private-t5 <stage> [flags]   (private-t5 <stage> --help for its flags)", "", "stages:"]
  lines += [f"  {name:<14}{help_text}" for name, (_, help_text) in stages.items()]
  return "\n".join(lines)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  stages = _available()
  if not argv or argv[0] in ("-h", "--help", "help"):
    try:
      print(_usage(stages), flush=True)
    except BrokenPipeError:  # `private-t5 --help | head`: the reader has what it wanted
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
  name, rest = argv[0], argv[1:]
  if name not in stages:
    print(f"error: unknown stage {name!r}\n\n{_usage(stages)}", file=sys.stderr)
    return 2
  try:
    from private_t5.stages import verbosity  # pylint: disable=g-import-not-at-top
    rest, setting = verbosity.pop_verbosity(rest)
    verbosity.configure_logging(*(setting or (logging.INFO, False)))
    # The RDP accountant's Python warnings for orders it leaves out (see accounting.ConvergenceFilter).
    warnings.filterwarnings("ignore", message=".*failed to converge.*")
    module = importlib.import_module(stages[name][0])
    return int(module.main(rest) or 0)
  except PrivateT5Error as e:
    from private_t5.stages import gin_errors  # pylint: disable=g-import-not-at-top
    print("error: " + gin_errors.error_message(e), file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
