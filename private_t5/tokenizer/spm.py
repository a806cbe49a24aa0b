"""SentencePiece training shared by `private-t5 spm` (public) and `private-t5 dp-spm` (private).

Vocabularies follow T5's layout: pad=0, eos=1, unk=2, no BOS; `vocabulary.py` adds 100 sentinel
extra ids on top (`<extra_id_0>` … `<extra_id_99>`) at the top of the id space.
`load_vocabulary` (from `private_t5.vocabulary`) reads them back.
"""
import io
import itertools
import os
import tempfile
from typing import Dict, Iterable, List, Optional, Tuple

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from private_t5 import io as io_lib
from private_t5.errors import DataError, ConfigError

MODEL_TYPES = ("unigram", "bpe", "char", "word")
# SentencePiece's default `max_sentence_length` (bytes); longer lines are skipped in training.
DEFAULT_MAX_SENTENCE_LENGTH = 4192


def _common_args(vocab_size: int, model_type: str, character_coverage: float, seed_sentencepiece_size: Optional[int]):
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
  if vocab_size < 8:
    raise ConfigError(f"vocab_size must be >= 8, got {vocab_size}")
  args = dict(
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      # Long pieces are fine (T5 used the defaults); keep whitespace handling default.
      hard_vocab_limit=True,
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
  )
  if seed_sentencepiece_size:
    args["seed_sentencepiece_size"] = seed_sentencepiece_size
  return args


def _one_line(message: str) -> str:
  """SentencePiece's message without the Python frames (`At: ...`) it appends."""
  message = message.split("\nAt:")[0].strip()
  return " ".join(message.split())


def _train(*, source_errors: Optional[List[BaseException]] = None,
           long_lines: Optional[Dict[str, int]] = None, **kwargs) -> bytes:
  """Trains in memory; returns the model's bytes (nothing is written).

  `source_errors` collects an exception raised by the input iterator (re-raised as it was);
  `long_lines` counts lines over `max_sentence_length` (named when nothing else is left).
  """
  proto = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(model_writer=proto, **kwargs)
  except RuntimeError as e:
    if source_errors:
      raise source_errors[0] from None
    msg = _one_line(str(e))
    if "Vocabulary size too high" in msg or "vocab_size" in msg:
      raise DataError(f"SentencePiece cannot build the requested vocabulary: {msg}") from e
    if "sentences_.empty()" in msg and long_lines and long_lines["count"]:
      raise DataError(
          f"every line of the corpus is longer than SentencePiece's maximum sentence length "
          f"({kwargs.get('max_sentence_length', DEFAULT_MAX_SENTENCE_LENGTH)} bytes; "
          f"{long_lines['count']} line(s) skipped, the longest {long_lines['longest']} bytes): split "
          "the documents into shorter lines or raise max_sentence_length "
          "(`private-t5 spm --max_sentence_length=N`)") from e
    raise DataError(f"SentencePiece training failed: {msg}") from e
  if source_errors:
    raise source_errors[0]
  return proto.getvalue()


# The name of the word histogram `model_from_word_counts` trains from: SentencePiece records it (and
# the "tsv" format) in the model's trainer_spec, which marks a DP-SentencePiece vocabulary.
WORD_HISTOGRAM_FILE = "words.tsv"


def trained_from_word_histogram(model_path: str) -> bool:
  """Whether the SentencePiece model at `model_path` was trained from a word histogram by
  `model_from_word_counts` (how `private-t5 dp-spm` trains); False for a file that is no model."""
  proto = sentencepiece_model_pb2.ModelProto()
  try:
    with open(model_path, "rb") as f:
      proto.ParseFromString(f.read())
  except Exception:  # pylint: disable=broad-except
    return False  # not a readable model: loading it reports that
  spec = proto.trainer_spec
  return spec.input_format == "tsv" and any(os.path.basename(p) == WORD_HISTOGRAM_FILE for p in spec.input)


def train_from_sentences(sentences: Iterable[str], model_path: str, vocab_size: int,
                         model_type: str = "unigram", character_coverage: float = 0.9995,
                         input_sentence_size: int = 2_000_000,
                         seed_sentencepiece_size: Optional[int] = None,
                         max_sentence_length: int = DEFAULT_MAX_SENTENCE_LENGTH) -> str:
  """Trains a SentencePiece model from raw text lines (the public `spm` stage).

  Lines longer than `max_sentence_length` bytes are skipped by SentencePiece; if that leaves
  nothing, the DataError says so. An error raised while reading `sentences` (a malformed
  corpus line) is raised as it is, not wrapped in SentencePiece's message.
  """
  args = _common_args(vocab_size, model_type, character_coverage, seed_sentencepiece_size)
  if int(max_sentence_length) < 1:
    raise ConfigError(f"max_sentence_length must be >= 1, got {max_sentence_length}")
  args["max_sentence_length"] = int(max_sentence_length)
  it = (s for s in sentences if s and s.strip())
  first = next(it, None)
  if first is None:
    raise DataError("cannot train a vocabulary from an empty corpus")
  source_errors: List[BaseException] = []
  long_lines = {"count": 0, "longest": 0}

  def chain():
    try:
      for line in itertools.chain([first], it):
        size = len(line.encode("utf-8"))
        if size > max_sentence_length:
          long_lines["count"] += 1
          long_lines["longest"] = max(long_lines["longest"], size)
        yield line
    except Exception as e:  # pylint: disable=broad-except
      source_errors.append(e)  # re-raised by _train once SentencePiece has stopped

  os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
  model = _train(source_errors=source_errors, long_lines=long_lines, sentence_iterator=chain(),
                 input_sentence_size=input_sentence_size, shuffle_input_sentence=True, **args)
  return io_lib.write_bytes_atomic(model_path, model)


def model_from_word_counts(word_counts: Iterable[Tuple[str, int]], vocab_size: int,
                           model_type: str = "unigram", character_coverage: float = 0.9995,
                           seed_sentencepiece_size: Optional[int] = None, *, byte_fallback: bool = False,
                           required_chars: str = "", exact_round_trip: bool = False) -> bytes:
  """Trains from a word histogram (SentencePiece's TSV `word<TAB>count` input format).

  This is how DP-SentencePiece trains: only the (noised, thresholded) histogram reaches
  SentencePiece, never the documents. Returns the model's bytes: the caller writes them (with
  their privacy report, `dp_spm.train_dp_vocabulary`).

  Args:
    byte_fallback: add the 256 byte pieces `<0x00>` … `<0xFF>`: a character without a piece is
      encoded as its UTF-8 bytes instead of `<unk>`. They count towards `vocab_size`.
    required_chars: characters that get a piece whatever the data (they count towards
      `vocab_size` and need not occur in `word_counts`).
    exact_round_trip: no normalisation (identity rule) and whitespace kept as it is, so that
      `decode(encode(text)) == text` for every string (with `byte_fallback`).
  """
  args = _common_args(vocab_size, model_type, character_coverage, seed_sentencepiece_size)
  if byte_fallback:
    args["byte_fallback"] = True
  if required_chars:
    args["required_chars"] = required_chars
  if exact_round_trip:
    args.update(normalization_rule_name="identity", remove_extra_whitespaces=False)
  with tempfile.TemporaryDirectory() as tmpdir:
    tsv = os.path.join(tmpdir, WORD_HISTOGRAM_FILE)
    n = 0
    with open(tsv, "w", encoding="utf-8") as f:
      for word, count in word_counts:
        count = int(count)
        if count <= 0 or not word or "\t" in word or "\n" in word:
          continue
        f.write(f"{word}\t{count}\n")
        n += 1
    if n == 0:
      raise DataError("cannot train a vocabulary from an empty word histogram")
    return _train(input=tsv, input_format="tsv", **args)


def builtin_dp_is_ignored() -> bool:
  """True when this SentencePiece build ignores its own `enable_differential_privacy` flags.

  SentencePiece ≥ 0.2 accepts the flags but logs them as deprecated and ignores them; a model
  trained with them then equals the non-private one (see docs/privacy.md).
  """
  with tempfile.TemporaryDirectory() as tmp:
    tsv = os.path.join(tmp, "h.tsv")
    with open(tsv, "w") as f:
      for i in range(200):
        f.write(f"w{i:03d}x\t{(i % 7) + 1}\n")
    models = []
    for dp in (False, True):
      buf = io.BytesIO()
      kw = dict(enable_differential_privacy=True, differential_privacy_noise_level=1000.0,
                differential_privacy_clipping_threshold=10**6) if dp else {}
      try:
        spm.SentencePieceTrainer.train(input=tsv, input_format="tsv", model_writer=buf, vocab_size=20,
                                       model_type="unigram", minloglevel=3, num_threads=1, **kw)
      except RuntimeError:
        if not dp:
          raise
        return False  # the DP mode dropped the words: it is honoured
      proto = spm.SentencePieceProcessor(model_proto=buf.getvalue())
      models.append([proto.id_to_piece(i) for i in range(proto.get_piece_size())])
    # With σ = 1000 and threshold 10⁶ a working DP mode drops every word (training fails).
    return models[0] == models[1]
