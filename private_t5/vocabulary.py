"""Loading a SentencePiece vocabulary (T5 layout) with a clear DataError for a bad file.

Vocabularies follow T5's layout: pad=0, eos=1, unk=2, no BOS; seqio adds `NUM_EXTRA_IDS`
sentinel extra ids on top (`<extra_id_0>` … `<extra_id_99>`) at the top of the id space.
Training vocabularies is `private_t5.tokenizer`'s job; this module only reads them, so the
data pipeline and the evaluators need nothing from the tokenizer package.
Base layer: imports nothing from the package but `errors` and `quiet_tf`.
"""
import os

from private_t5 import quiet_tf
from private_t5.errors import DataError

NUM_EXTRA_IDS = 100


def load_vocabulary(model_path: str, extra_ids: int = NUM_EXTRA_IDS):
  """Returns a seqio SentencePieceVocabulary (T5 layout + sentinels), validating the file.

  Raises:
    DataError: the file is missing, not a SentencePiece model, or not in T5's layout.
  """
  quiet_tf.import_tensorflow()  # seqio imports it
  # Lazy: a base-layer module imports nothing heavy at the top (seqio imports TensorFlow).
  import seqio  # pylint: disable=g-import-not-at-top
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(model_path):
    raise DataError(f"vocabulary file not found: {model_path}")
  proc = spm.SentencePieceProcessor()
  try:
    proc.Load(model_path)
  except (RuntimeError, OSError) as e:
    raise DataError(f"{model_path} is not a SentencePiece model: {str(e).strip()}") from e
  if proc.pad_id() != 0 or proc.eos_id() != 1 or proc.unk_id() != 2:
    raise DataError(f"{model_path}: expected T5 layout pad=0 eos=1 unk=2, got pad={proc.pad_id()} "
                    f"eos={proc.eos_id()} unk={proc.unk_id()}")
  return seqio.SentencePieceVocabulary(model_path, extra_ids=extra_ids)


def sentencepiece_processor(vocab):
  """A SentencePieceProcessor holding the model of `vocab` (from `load_vocabulary`)."""
  # Lazy: a base-layer module imports nothing heavy at the top.
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  proc = spm.SentencePieceProcessor()
  proc.LoadFromSerializedProto(vocab.sp_model)
  return proc
