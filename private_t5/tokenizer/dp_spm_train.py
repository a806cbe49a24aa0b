"""SentencePiece trained on DP-SentencePiece's released word counts.

Every private vocabulary holds pieces that depend on no data: pad/eos/unk, the 256 byte pieces
(byte fallback) and the public base characters (`base_characters`), so that no text becomes
`<unk>`; `min_vocab_size` counts them. The kept counts are scaled down for SentencePiece's trainer
when their total is too large (`scale_counts`), and a vocabulary the words cannot support is
trained at the largest size SentencePiece accepts, or refused (`train_capped`).
"""
import re
from typing import List, Optional, Sequence, Tuple, Union

import sentencepiece as spm

from private_t5.errors import ConfigError, DataError
from private_t5.tokenizer import spm as spm_lib

# The SentencePiece model types a private vocabulary may have.
MODEL_TYPES = ("unigram", "bpe", "char")
# Pieces of every private vocabulary that do not depend on any data: pad/eos/unk, the 256 UTF-8
# byte pieces (byte fallback), SentencePiece's word-boundary mark and the base characters.
SPECIAL_PIECES = 3
BYTE_PIECES = 256
WORD_BOUNDARY = "\u2581"
# Printable ASCII without whitespace (the space is the word-boundary piece).
BASE_CHARACTERS = "".join(chr(c) for c in range(33, 127))


def base_characters(extra_characters: Optional[str] = "") -> str:
  """The public base character set: printable ASCII plus `extra_characters` (no whitespace), each once."""
  extra_characters = "" if extra_characters is None else extra_characters
  if not isinstance(extra_characters, str):
    raise ConfigError(f"extra_characters must be a string, got {extra_characters!r}")
  extra = "".join(c for c in extra_characters if not c.isspace() and c != WORD_BOUNDARY)
  return "".join(dict.fromkeys(BASE_CHARACTERS + extra))


def min_vocab_size(base: str) -> int:
  """The smallest vocabulary holding the data-independent pieces (special, bytes, ▁, `base`)."""
  return SPECIAL_PIECES + BYTE_PIECES + 1 + len(base)


def processor(model: Union[str, bytes]):
  """The SentencePieceProcessor of a `.model` path or of a model's bytes."""
  if isinstance(model, bytes):
    return spm.SentencePieceProcessor(model_proto=model)
  return spm.SentencePieceProcessor(model_file=model)


_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")


class UnsupportedSize(Exception):
  """The training words support at most `cap` pieces, fewer than requested."""

  def __init__(self, cap: int):
    super().__init__(cap)
    self.cap = cap


# SentencePiece's trainer holds memory in proportion to the total of the counts it is given (~130
# bytes a word occurrence): a corpus of C4's size (10^11 words) cannot be handed over as it is. Above
# this total the counts are scaled down to it, each kept word keeping a count of at least 1:
# post-processing of the released histogram (no privacy cost), which keeps the words' relative
# frequencies to within that rounding. Below it (every corpus of the tests) nothing changes.
MAX_TRAINER_TOTAL_COUNT = 4_000_000


def scale_counts(word_counts: Sequence[Tuple[str, float]], total: int = MAX_TRAINER_TOTAL_COUNT):
  """(counts whose sum is about `total` at most, the factor applied): `word_counts` as they are
  (factor 1.0) when their sum is within `total`, else each multiplied by total/sum, rounded, >= 1."""
  current = float(sum(c for _, c in word_counts))
  if current <= total:
    return list(word_counts), 1.0
  factor = total / current
  return [(w, max(1, int(round(c * factor)))) for w, c in word_counts], factor


def train_capped(word_counts: List[Tuple[str, int]], vocab_size: int, model_type: str,
                 allow_vocab_cap: bool, character_coverage: float, base: str) -> Tuple[int, bytes]:
  """Trains SentencePiece (byte fallback, `base` characters, exact round trip) in memory.

  Returns (the size trained, the model's bytes).

  When the words cannot support `vocab_size`, trains the largest size SentencePiece accepts, or
  raises `UnsupportedSize` when `allow_vocab_cap` is False.
  """
  options = dict(model_type=model_type, character_coverage=character_coverage, byte_fallback=True,
                 required_chars=base, exact_round_trip=True)
  try:
    return vocab_size, spm_lib.model_from_word_counts(word_counts, vocab_size, **options)
  except DataError as e:
    match = _TOO_HIGH.search(str(e))
    if not match:
      raise
    cap = int(match.group(2))
    if not allow_vocab_cap:
      raise UnsupportedSize(cap) from e
    return cap, spm_lib.model_from_word_counts(word_counts, cap, **options)
