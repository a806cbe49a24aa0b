"""Loading a SentencePiece vocabulary (T5 layout) with a clear DataError for a bad file.

Vocabularies follow T5's layout: pad=0, eos=1, unk=2, no BOS, and `NUM_EXTRA_IDS` sentinel
extra ids on top (`<extra_id_0>` … `<extra_id_99>`, `<extra_id_0>` the highest id), added to the
model as seqio's `SentencePieceVocabulary` adds them (Raffel et al., "Exploring the Limits of
Transfer Learning with a Unified Text-to-Text Transformer", 2020), so ids, pieces and the
serialized model are the same as seqio's (tests/test_data_vocab.py compares them) without
importing seqio or TensorFlow.
Training vocabularies is `private_t5.tokenizer`'s job; this module only reads them, so the
data pipeline and the evaluators need nothing from the tokenizer package.
Base layer: imports nothing from the package but `errors`.
"""
import os
from typing import Iterable, List

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from private_t5.errors import DataError

NUM_EXTRA_IDS = 100
PAD_ID = 0


class SentencePieceVocabulary:
  """A T5-layout SentencePiece model with `extra_ids` sentinels (seqio's ids and pieces).

  Attributes:
    tokenizer: the SentencePieceProcessor of the model with the sentinels.
    sp_model: that model, serialized.
    extra_ids: the number of sentinels.
  """

  def __init__(self, model_path: str, sp_model: bytes, extra_ids: int):
    self.sentencepiece_model_file = model_path
    self.extra_ids = int(extra_ids)
    self.sp_model = sp_model
    self.tokenizer = spm.SentencePieceProcessor()
    self.tokenizer.LoadFromSerializedProto(sp_model)

  @property
  def vocab_size(self) -> int:
    """Number of ids, sentinels included."""
    return self.tokenizer.GetPieceSize()

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_id()

  @property
  def unk_id(self) -> int:
    return self.tokenizer.unk_id()

  @property
  def bos_id(self) -> int:
    return self.tokenizer.bos_id()

  def encode(self, text: str) -> List[int]:
    """Token ids of `text`, without EOS."""
    return self.tokenizer.EncodeAsIds(text)

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids` up to and including the first EOS (ids out of range read as UNK)."""
    ids = [self.unk_id if int(i) >= self.vocab_size else int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id) + 1]
    return self.tokenizer.DecodeIds(ids)

  def __str__(self) -> str:
    return f"SentencePieceVocabulary(file={self.sentencepiece_model_file}, extra_ids={self.extra_ids})"


def with_sentinels(sp_model: bytes, extra_ids: int) -> bytes:
  """`sp_model` with `extra_ids` user-defined pieces `▁<extra_id_{i}>` appended, highest i first."""
  model = sentencepiece_model_pb2.ModelProto.FromString(sp_model)
  for i in reversed(range(extra_ids)):
    model.pieces.add(piece=f"▁<extra_id_{i}>", score=0.0,
                     type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED)
  return model.SerializeToString()


def load_vocabulary(model_path: str, extra_ids: int = NUM_EXTRA_IDS) -> SentencePieceVocabulary:
  """Returns the vocabulary of a SentencePiece model file (T5 layout + sentinels), validated.

  Raises:
    DataError: the file is missing, not a SentencePiece model, or not in T5's layout.
  """
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
  with open(model_path, "rb") as f:
    sp_model = f.read()
  return SentencePieceVocabulary(model_path, with_sentinels(sp_model, extra_ids), extra_ids)


def sentencepiece_processor(vocab: SentencePieceVocabulary):
  """A SentencePieceProcessor holding the model of `vocab` (from `load_vocabulary`)."""
  proc = spm.SentencePieceProcessor()
  proc.LoadFromSerializedProto(vocab.sp_model)
  return proc
