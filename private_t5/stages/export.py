"""`private-t5 export`: a model directory in the Hugging Face T5 format.

  private-t5 export --model_dir=/tmp/run --output=/tmp/run_hf --format=hf

writes OUTPUT/config.json, OUTPUT/model.safetensors (float32), OUTPUT/spiece.model (the
model's SentencePiece vocabulary) and OUTPUT/privacy_report.json (the privacy report of the
exported checkpoint: what (ε, δ) covers these weights and their vocabulary), and nothing else:
this is the folder to publish. The run's private files never go into it: not its root seed
(MODEL_DIR/secrets/), not the checkpoints (optimizer and noise state, older metadata with the
seed), not config.gin, and of a DP-SentencePiece vocabulary only the `.model` file (its document
fingerprints and their key, if they lie beside it, are named in a warning: that folder must not
be published; docs/privacy.md, "Which files of a run are private"). The directory
loads with `transformers.T5ForConditionalGeneration.from_pretrained(OUTPUT)` and gives the
same logits; `private-t5 import --hf_dir=OUTPUT` reads it back. Nothing is written unless the
whole export succeeds: the files are written into `.export_hf_<host>-<pid>-<random>/` beside
OUTPUT, renamed to OUTPUT at the end; such folders left by killed exports are removed by the
next export into the same parent folder. Exporting the latest checkpoint of a running training
is safe: a checkpoint rotated away while it is read is read again from the new latest.

A LoRA run (configs/runs/finetune_lora*.gin) exports its merged weights (`--lora=merged`, the
default: a plain T5 as above) or a Hugging Face PEFT adapter (`--lora=adapter`):
OUTPUT/adapter_config.json + OUTPUT/adapter_model.safetensors (+ spiece.model and
privacy_report.json, whose `exported_from.lora` names the base weights by path and SHA-256), which
`peft.PeftModel.from_pretrained(base, OUTPUT)` loads onto the base T5 (export the base with
`private-t5 export` first if it is one of our run directories). When the base has moved since
training, `--initial_checkpoint=DIR` names its new place (as `private-t5 train` resumes such a
run): its weights must have the SHA-256 the run recorded.
"""
import logging
import os
import shutil
import sys
from typing import Any, Dict, List, Optional

from private_t5.stages import flags
from private_t5 import io as io_lib
from private_t5.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

FORMATS = ("hf",)
LORA_MODES = ("merged", "adapter")
VOCAB_FILE = "spiece.model"
TEMP_PREFIX = ".export_hf_"


def _privacy_report(model_dir: str, info: Dict[str, Any], privacy_report) -> Dict[str, Any]:
  """The report of the exported checkpoint (its own step), else the run's file, else "no guarantee"."""
  report = info.get("privacy_report")
  if report:
    return dict(report)
  path = privacy_report.report_path(model_dir)
  if os.path.isfile(path):
    return privacy_report.read_report(path)
  return privacy_report.no_guarantee_report()


def export_model_dir(model_dir: str, output: str, *, fmt: str = "hf", step: Optional[int] = None,
                     vocab_path: Optional[str] = None, lora: str = "merged",
                     initial_checkpoint: Optional[str] = None) -> str:
  """Exports the checkpoint of `model_dir` (latest, or `step`) to `output`; returns `output`.

  `lora`: for a LoRA run, "merged" (plain T5 weights) or "adapter" (a PEFT adapter directory).
  `initial_checkpoint`: a LoRA run's base, moved since training (checked by its SHA-256).

  Raises:
    ConfigError: an unknown format or LoRA mode, "adapter" for a run without adapters, or an
      `output` that already holds files.
    CheckpointError: no readable checkpoint, or no vocabulary file to ship.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  from private_t5.dp import privacy_report as privacy_report_lib  # pylint: disable=g-import-not-at-top
  from private_t5.models import hf_export  # pylint: disable=g-import-not-at-top
  from private_t5.models import checkpoint_read  # pylint: disable=g-import-not-at-top
  from private_t5.models import lora as lora_lib  # pylint: disable=g-import-not-at-top
  if fmt not in FORMATS:
    raise ConfigError(f"--format={fmt!r} is not supported (formats: {', '.join(FORMATS)})")
  if lora not in LORA_MODES:
    raise ConfigError(f"--lora={lora!r} is not supported (modes: {', '.join(LORA_MODES)})")
  if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
    raise ConfigError(f"--output {output!r} already exists and is not empty; choose a new directory")
  io_lib.check_output_file(os.path.join(output, "config.json"))  # a read-only folder, a file in the way
  adapter = lora == "adapter"
  params, config, info = checkpoint_read.restore_for_inference(model_dir, step, merge_adapters=not adapter,
                                                           lora_base=initial_checkpoint)
  if adapter and not info.get("lora"):
    raise ConfigError(f"--lora=adapter: {model_dir!r} is not a LoRA run (it has no adapters); use --lora=merged")
  vocab_path = vocab_path or info.get("vocab_path")
  if not vocab_path or not os.path.isfile(vocab_path):
    raise CheckpointError(f"the vocabulary of {model_dir!r} ({vocab_path!r}) is missing; "
                          "give --vocab_path=FILE.model")
  _warn_of_private_vocabulary_files(vocab_path)
  if adapter:
    checkpoint_read.read_lora_base(info["lora"], model_dir)  # the base the adapter belongs to is unchanged
    tensors, json_file = hf_export.peft_adapter(_to_numpy(params, np), lora_lib.config_of(info["lora"]), config,
                                                info["lora"]["base"]["path"])
    json_name, tensors_name = "adapter_config.json", "adapter_model.safetensors"
  else:
    tensors, json_file = hf_export.export_hf_t5(_to_numpy(params, np), config)
    json_name, tensors_name = "config.json", "model.safetensors"
  report = _privacy_report(model_dir, info, privacy_report_lib)
  exported_from = {"model_dir": os.path.abspath(model_dir), "step": info.get("step"),
                   "vocabulary_sha256": io_lib.file_sha256(vocab_path)}
  if info.get("lora"):  # the adapters' settings and base (path, SHA-256), and which form was written
    exported_from.update(lora=info["lora"], lora_export=lora)
  report = dict(report, exported_from=exported_from)
  parent = os.path.dirname(os.path.abspath(output)) or "."
  os.makedirs(parent, exist_ok=True)
  io_lib.remove_stale_temp_dirs(parent, TEMP_PREFIX)
  tmp_dir = io_lib.make_temp_dir(parent, TEMP_PREFIX)
  try:
    io_lib.write_json_atomic(os.path.join(tmp_dir, json_name), json_file)
    io_lib.write_bytes_atomic(os.path.join(tmp_dir, tensors_name),
                              st_numpy.save(tensors, metadata={"format": "pt"}))
    shutil.copyfile(vocab_path, os.path.join(tmp_dir, VOCAB_FILE))
    privacy_report_lib.write_report(privacy_report_lib.report_path(tmp_dir), report)
    if os.path.isdir(output):
      os.rmdir(output)  # empty (checked above)
    os.replace(tmp_dir, output)
  except OSError as e:  # a full disk, a folder made read-only meanwhile: nothing is left at --output
    raise ConfigError(f"--output {output!r} cannot be written: {e.strerror or e}") from None
  finally:
    if os.path.isdir(tmp_dir):
      shutil.rmtree(tmp_dir, ignore_errors=True)
  logger.info("exported %s (step %s) to %s", model_dir, info.get("step"), output)
  return output


def private_vocabulary_files(vocab_path: str) -> List[str]:
  """The private files of a DP-SentencePiece vocabulary in `vocab_path`'s folder: its documents'
  keyed fingerprints and their key (`doc_fingerprints`), a membership oracle for those documents."""
  from private_t5 import doc_fingerprints  # pylint: disable=g-import-not-at-top
  folder = os.path.dirname(os.path.abspath(vocab_path))
  try:
    names = os.listdir(folder)
  except OSError:
    return []
  suffixes = (doc_fingerprints.FINGERPRINTS_SUFFIX, doc_fingerprints.KEY_SUFFIX)
  return sorted(os.path.join(folder, n) for n in names if n.endswith(suffixes))


def _warn_of_private_vocabulary_files(vocab_path: str) -> None:
  private = private_vocabulary_files(vocab_path)
  if private:
    logger.warning("the vocabulary's folder %s holds private files of a DP-SentencePiece vocabulary (%s: keyed "
                   "fingerprints of its documents and their key, which test whether a text was one of them): "
                   "export copies only %s, but never publish that folder", os.path.dirname(private[0]),
                   ", ".join(os.path.basename(p) for p in private), os.path.basename(vocab_path))


def _to_numpy(tree, np):
  """A nested dict of arrays as numpy float32 arrays."""
  if isinstance(tree, dict):
    return {k: _to_numpy(v, np) for k, v in tree.items()}
  return np.asarray(tree, dtype=np.float32)


def _parser() -> flags.StageParser:
  p = flags.StageParser("export", __doc__.split("\n\n")[0])
  p.add_flag("model_dir", help="model directory (a training run or `private-t5 import`) (required)")
  p.add_flag("output", help="new directory to write (required)")
  p.add_flag("format", default="hf", choices=FORMATS, help="output format (hf: Hugging Face T5)")
  p.add_flag("step", type=int, help="checkpoint step (default: the latest)")
  p.add_flag("vocab_path", help="SentencePiece model to ship (default: the checkpoint's)")
  p.add_flag("lora", default="merged", choices=LORA_MODES,
             help="a LoRA run: merged weights (a plain T5) or a PEFT adapter directory")
  p.add_flag("initial_checkpoint", help="a LoRA run whose base moved: the base's new directory (it must hold "
             "the weights the run recorded, checked by SHA-256; as for `private-t5 train`)")
  return p


def main(argv: Optional[List[str]] = None) -> int:
  parser = _parser()
  args = parser.parse_stage_args(sys.argv[1:] if argv is None else argv).args
  flags.check_required(parser, args, ("model_dir", "output"))
  out = export_model_dir(args.model_dir, args.output, fmt=args.format, step=args.step,
                         vocab_path=args.vocab_path, lora=args.lora, initial_checkpoint=args.initial_checkpoint)
  print(f"exported {args.model_dir} to {out} ({', '.join(sorted(os.listdir(out)))})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
