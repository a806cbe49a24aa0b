"""What a DP-SentencePiece vocabulary is made of and how well it tokenizes (its report's diagnostics).

`piece_sources`: how many pieces each source (data-independent, private words, public words) can
have produced; `tokenization_utility`: `<unk>` rate, tokens per word and exact round trips on a
sample of texts.
"""
from typing import Any, Dict, Iterable, Sequence, Union

from private_t5.tokenizer.dp_spm_train import WORD_BOUNDARY, processor


def piece_sources(model: Union[str, bytes], private_words: Iterable[str], public_words: Iterable[str],
                  base: str) -> Dict[str, int]:
  """How many pieces of a vocabulary (`.model` path or bytes) each source can have produced.

  `special`, `byte` and `base_character` (incl. ▁) pieces are data-independent; a learned piece
  counts as `private`, `public` or `private_and_public` by which words contain it (with the
  word-boundary prefix); `other` should stay 0.
  """
  proc = processor(model)
  out = dict.fromkeys(("special", "byte", "base_character", "private", "public", "private_and_public", "other"), 0)
  learned = set()
  base_set = set(base) | {WORD_BOUNDARY}
  for i in range(proc.get_piece_size()):
    piece = proc.id_to_piece(i)
    if proc.is_control(i) or proc.is_unknown(i):
      out["special"] += 1
    elif proc.is_byte(i):
      out["byte"] += 1
    elif piece in base_set:
      out["base_character"] += 1
    else:
      learned.add(piece)
  longest = max((len(p) for p in learned), default=0)

  def found(words):
    hit = set()
    for word in words:
      s = WORD_BOUNDARY + word
      for i in range(len(s)):
        for j in range(i + 1, min(len(s), i + longest) + 1):
          if s[i:j] in learned:
            hit.add(s[i:j])
    return hit

  private, public = found(private_words), found(public_words)
  for piece in learned:
    key = ("private_and_public" if piece in public else "private") if piece in private else (
        "public" if piece in public else "other")
    out[key] += 1
  return out


def tokenization_utility(model: Union[str, bytes], texts: Sequence[str]) -> Dict[str, Any]:
  """`<unk>` rate (share of tokens), tokens per whitespace word and exact round trips on `texts`
  (`model`: a `.model` path or its bytes)."""
  proc = processor(model)
  tokens = unknown = words = exact = 0
  for text in texts:
    ids = proc.encode(text)
    tokens += len(ids)
    unknown += sum(1 for i in ids if i == proc.unk_id())
    words += len(text.split())
    exact += int(proc.decode(ids) == text)
  return {"vocab_size": proc.get_piece_size(), "documents": len(texts), "words": words, "tokens": tokens,
          "unk_rate": unknown / max(tokens, 1), "tokens_per_word": tokens / max(words, 1),
          "exact_round_trip_fraction": exact / max(len(texts), 1)}
