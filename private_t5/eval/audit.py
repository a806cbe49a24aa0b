"""The one-run privacy audit of a trained model (Steinke, Nasr and Jagielski, "Privacy Auditing
with One (1) Training Run", 2023; Mahloujifar, Melis and Chaudhuri, "Auditing f-Differential
Privacy in One Run", 2025).

Planting (`private-t5 canaries --audit`): m random documents (random words of the corpus, random
pieces of a SentencePiece vocabulary, or random draws from the corpus's rarest pieces or words:
crafted canaries, after Panda, Tang, Nasr, Choquette-Choo and Mittal, "Privacy Auditing of Large
Language Models", 2025); each is included in the training corpus with
probability 1/2 by a secret seed (`dp/auditing.draw_membership`), as documents of the corpus
(one privacy unit per copy, placed by `canaries.insert_canaries`). The membership record
(`<corpus>.audit.json`, mode 0600) is written beside the new corpus and never into a model
directory: whoever holds it can check the model.

Auditing (`private-t5 memorization --gin.AUDIT=<record>`): every canary is scored on the trained
model (its loss: the mean token cross-entropy of its second half given its first half, as the
prefix-LM objective splits a short document; span-corruption models read `first half
<extra_id_0>` and predict `<extra_id_0> second half`), and jax-privacy's `CanaryScoreAuditor`
(`dp/auditing.score_audit`) turns the scores (minus the losses) of the included and held-out
canaries into ε lower bounds (one run; one-run f-DP), the attack's TPR at FPR 1% and 0.1% and its
AUROC, reported beside the ledger's ε. The report's bound is the library's one-run bound; the
package's own bound on k guesses a side (the k lowest losses "in", the k highest "out") is
reported beside it as a cross-check.
"""
import collections
import dataclasses
import itertools
import json
import math
import os
import re
import time
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from private_t5 import checks, io
from private_t5.dp import auditing
from private_t5.dp import privacy_report as privacy_report_lib
from private_t5.errors import ConfigError, DataError
from private_t5.eval import canaries as canaries_lib
from private_t5.models import run_dir

AUDIT_SUFFIX = ".audit.json"
KINDS = ("words", "tokens", "rare_tokens", "rare_words")
VOCAB_KINDS = ("tokens", "rare_tokens")  # the kinds drawn from a SentencePiece vocabulary
RARE_FRACTION = 0.1  # the rare kinds' pool: the rarest tenth of what the corpus uses ...
MIN_POOL = 100  # ... and at least this many pieces or words (every kind's smallest pool)
ENCODE_BATCH = 256  # documents encoded together when the corpus's pieces are counted
RECORD_KIND = "private_t5 audit canaries"
CONTENT_STREAM = 0x74657874  # the canaries' contents: another stream of the same seed
PREFIX_SCORING, SENTINEL_SCORING = "prefix", "sentinel"
EOS_ID = 1
WORD = re.compile(r"[A-Za-z]{3,}")
MIN_CANARIES = 2  # one guessed in, one guessed out
BOOTSTRAP_SAMPLES = auditing.BOOTSTRAP_SAMPLES  # of the TPR and AUROC intervals


@dataclasses.dataclass(frozen=True)
class AuditRecord:
  """The secret membership record of a corpus with audit canaries."""
  texts: List[str]
  included: np.ndarray  # bool [m]
  repetitions: int
  seed: int
  kind: str  # one of KINDS, or several joined by commas (`canary_kinds` says each canary's)
  length: int
  source: str
  corpus: str
  canary_kinds: Tuple[str, ...] = ()  # each canary's kind when `kind` names several; else empty

  @property
  def num_canaries(self) -> int:
    return len(self.texts)

  @property
  def kinds(self) -> Tuple[str, ...]:
    return parse_kinds(self.kind)


def parse_kinds(kind) -> Tuple[str, ...]:
  """The distinct kinds of `kind` ("words", or several: "words,rare_tokens", or a sequence)."""
  parts = tuple(p.strip() for p in kind.split(",")) if isinstance(kind, str) else tuple(kind)
  bad = [p for p in parts if p not in KINDS]
  if not parts or bad or len(set(parts)) != len(parts):
    raise ConfigError(f"audit canary kind must be one of {', '.join(KINDS)}, or several of them distinct and joined "
                      f"by commas, got {kind!r}")
  return parts


def _is_model_dir(folder: str) -> bool:
  """A training run's folder (checkpoints, privacy report, summary) or a vocabulary's (its privacy report)."""
  return any(os.path.exists(os.path.join(folder, name))
             for name in (run_dir.CHECKPOINT_SUBDIR, privacy_report_lib.REPORT_FILENAME, privacy_report_lib.SUMMARY_FILENAME))


def check_outside_model_dir(output_path: str) -> None:
  """ConfigError when `output_path` lies anywhere inside a model directory (its top level, checkpoints/,
  tensorboard/, ...): whoever can read the model must not find the secret record beside it."""
  folder = os.path.dirname(os.path.abspath(output_path))
  while True:
    if _is_model_dir(folder):
      raise ConfigError(f"{output_path!r} is inside the model directory {folder}; write the audit corpus and "
                        "its secret record elsewhere")
    parent = os.path.dirname(folder)
    if parent == folder:
      return
    folder = parent


def record_path(corpus_path: str) -> str:
  """The membership record beside a corpus: train.jsonl.gz -> train.audit.json."""
  return canaries_lib.record_path(corpus_path, suffix=AUDIT_SUFFIX)


def corpus_words(texts: Sequence[str], limit: int = 100_000) -> List[str]:
  """The distinct words (3+ letters, lower-cased) of the corpus, sorted: the `words` kind's pool."""
  seen = set()
  for text in texts:
    seen.update(w.lower() for w in WORD.findall(text))
    if len(seen) >= limit:
      break
  return sorted(seen)


def word_counts(texts: Iterable[str]) -> collections.Counter:
  """How often each word (3+ letters, lower-cased) occurs in the corpus, read one document at a time."""
  counts = collections.Counter()
  for text in texts:
    counts.update(w.lower() for w in WORD.findall(text))
  return counts


def piece_counts(texts: Iterable[str], vocab, batch_size: int = ENCODE_BATCH) -> np.ndarray:
  """[pieces] how often each piece of `vocab` occurs in the corpus encoded with it, in batches of documents."""
  sp = vocab.tokenizer
  counts = np.zeros(sp.get_piece_size(), np.int64)
  texts = iter(texts)
  while True:
    batch = list(itertools.islice(texts, batch_size))
    if not batch:
      return counts
    ids = [i for row in sp.encode(batch) for i in row]
    counts += np.bincount(np.asarray(ids, np.int64), minlength=len(counts))[:len(counts)]


def ordinary_pieces(vocab) -> List[int]:
  """The ids of the pieces that are neither control, unknown, byte nor unused pieces."""
  sp = vocab.tokenizer
  return [i for i in range(sp.get_piece_size())
          if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))]


def _rarest(counts: dict, fraction: float, minimum: int, what: str, kind: str) -> list:
  """The keys of `counts` (all >= 1) whose count is at most that of the k-th rarest, k = max(minimum,
  ⌈fraction · len⌉): ties kept together, so the pool is not cut at an arbitrary piece or word."""
  if len(counts) < minimum:
    raise DataError(f"the corpus has {len(counts)} distinct {what}; {kind} canaries need at least {minimum}")
  k = max(minimum, math.ceil(fraction * len(counts)))
  threshold = sorted(counts.values())[k - 1]
  return sorted(key for key, c in counts.items() if c <= threshold)


def rare_pieces(counts: np.ndarray, vocab, fraction: float = RARE_FRACTION, minimum: int = MIN_POOL) -> List[int]:
  """The `rare_tokens` pool: the least frequent ordinary pieces that occur in the corpus at least once
  (`counts` from `piece_counts`), the rarest `fraction` of them and at least `minimum`, sorted by id."""
  occurring = {i: int(counts[i]) for i in ordinary_pieces(vocab) if counts[i] > 0}
  return _rarest(occurring, fraction, minimum, "ordinary pieces of the vocabulary", "rare-token")


def rare_words(counts: collections.Counter, fraction: float = RARE_FRACTION, minimum: int = MIN_POOL) -> List[str]:
  """The `rare_words` pool: the corpus's least frequent words (`counts` from `word_counts`), the rarest
  `fraction` of them and at least `minimum`, sorted."""
  return _rarest({w: c for w, c in counts.items() if c > 0}, fraction, minimum, "words", "rare-word")


def make_texts(kind: str, num_canaries: int, length: int, seed: int, words: Sequence[str] = (),
               vocab=None, pieces: Optional[Sequence[int]] = None) -> List[str]:
  """m distinct random documents of `length` words or pieces.

  Kind "words" draws from `words` (`corpus_words`), "rare_words" from `words` (`rare_words`),
  "tokens" from the ordinary pieces of `vocab`, "rare_tokens" from `pieces` of `vocab`
  (`rare_pieces`); every draw uses the seed's content stream.
  """
  if kind not in KINDS:
    raise ConfigError(f"audit canary kind must be one of {', '.join(KINDS)}, got {kind!r}")
  if not isinstance(length, int) or length < 2:
    raise ConfigError(f"audit canary length must be an integer >= 2, got {length!r}")
  rng = np.random.default_rng([seed, CONTENT_STREAM])
  if kind in ("words", "rare_words"):
    pool = list(words)
    if len(pool) < MIN_POOL:
      raise DataError(f"the corpus gives {len(pool)} {'rare' if kind == 'rare_words' else 'distinct'} words; "
                      f"{'rare' if kind == 'rare_words' else 'random'}-word canaries need at least {MIN_POOL}")
    draw = lambda: " ".join(pool[i] for i in rng.integers(0, len(pool), size=length))
  else:
    if vocab is None:
      raise ConfigError(f"audit canaries of kind {kind!r} need a SentencePiece vocabulary (--vocab_path)")
    sp = vocab.tokenizer
    if kind == "tokens":
      pool = ordinary_pieces(vocab)
    elif pieces is None:
      raise ConfigError("audit canaries of kind 'rare_tokens' need their pool of rare pieces (audit.rare_pieces)")
    else:
      pool = list(pieces)
    if len(pool) < MIN_POOL:
      raise DataError(f"the {'vocabulary' if kind == 'tokens' else 'pool of rare pieces'} has {len(pool)} ordinary "
                      f"pieces; {'random' if kind == 'tokens' else 'rare'}-token canaries need at least {MIN_POOL}")
    draw = lambda: sp.decode([pool[i] for i in rng.integers(0, len(pool), size=length)]).strip()
  texts, seen = [], set()
  for _ in range(100 * num_canaries):
    text = draw()
    if text and text not in seen:
      seen.add(text)
      texts.append(text)
      if len(texts) == num_canaries:
        return texts
  raise DataError(f"could not draw {num_canaries} distinct audit canaries of length {length}")


def canary_pool(kind: str, documents, vocab=None):
  """(words, pieces): what `make_texts` draws `kind` from, counted over the corpus read once (a sequence
  of documents, or a function that opens it afresh), never held."""
  if kind not in KINDS:
    raise ConfigError(f"audit canary kind must be one of {', '.join(KINDS)}, got {kind!r}")
  if kind in VOCAB_KINDS and vocab is None:
    raise ConfigError(f"audit canaries of kind {kind!r} need a SentencePiece vocabulary (--vocab_path)")
  if kind == "tokens":
    return (), None
  texts = (d.text for d in (documents() if callable(documents) else documents))
  if kind == "words":
    return corpus_words(texts), None
  if kind == "rare_words":
    return rare_words(word_counts(texts)), None
  return (), rare_pieces(piece_counts(texts, vocab), vocab)


def plant(documents, output_path: str, *, num_canaries: int, kind: str = "words", length: int = 8,
          repetitions: int = 1, seed: Optional[int] = None, vocab=None, source: str = ""):
  """Writes the corpus with the included canaries and the secret membership record beside it.

  `documents`: a sequence, or a function that opens the corpus afresh (read, never held:
  `canaries.insert_canaries`).

  Returns:
    (corpus path, record path, number of documents written, AuditRecord).
  """
  if not isinstance(repetitions, int) or repetitions < 1:
    raise ConfigError(f"audit canary repetitions must be a positive integer, got {repetitions!r}")
  check_outside_model_dir(output_path)
  included, seed = auditing.draw_membership(num_canaries, seed)
  # An audit needs canaries in and out (a draw without both has probability 2^(1-m)): refused before
  # anything is written.
  if included.all() or not included.any():
    raise DataError(f"{'all' if included.all() else 'none'} of the {num_canaries} audit canaries were drawn in; "
                    "plant more canaries (--num_canaries)")
  kinds = parse_kinds(kind)
  # Several kinds: canary k is of kind k mod K, so each kind's canaries are in with probability 1/2 too.
  of_kind = [kinds[k % len(kinds)] for k in range(num_canaries)]
  for name in kinds:
    bits = included[np.asarray(of_kind) == name]
    if len(kinds) > 1 and (bits.all() or not bits.any()):
      raise DataError(f"{'all' if bits.all() else 'none'} of the {len(bits)} audit canaries of kind {name!r} were "
                      "drawn in; plant more canaries (--num_canaries)")
  docs = documents if callable(documents) else list(documents)  # a function that opens the corpus streams it
  drawn = {}
  for name in kinds:
    words, pieces = canary_pool(name, docs, vocab)
    drawn[name] = iter(make_texts(name, of_kind.count(name), length, seed, words=words, vocab=vocab, pieces=pieces))
  texts = [next(drawn[name]) for name in of_kind]
  if len(set(texts)) != len(texts):
    raise DataError("two audit canaries of different kinds drew the same text; plant with another seed")
  planted = [canaries_lib.Canary(id=f"audit-{k}", secret="", text=t, repetitions=repetitions if inc else 0)
             for k, (t, inc) in enumerate(zip(texts, included))]
  n = 0
  with io.atomic_open_text(output_path) as f:
    for row in canaries_lib.insert_canaries(docs, planted, seed):
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
      n += 1
  record = AuditRecord(texts=texts, included=included, repetitions=repetitions, seed=seed, kind=",".join(kinds),
                       length=length, source=source, corpus=os.path.abspath(output_path),
                       canary_kinds=tuple(of_kind) if len(kinds) > 1 else ())
  path = write_record(record, record_path(output_path), documents=n)
  return output_path, path, n, record


def write_record(record: AuditRecord, path: str, documents: int) -> str:
  """The record, readable by its owner only (0600): it says which canaries were trained on."""
  rec = {"kind": RECORD_KIND, "canary_kind": record.kind, "length": record.length, "seed": record.seed,
         "repetitions": record.repetitions, "source": record.source, "corpus": record.corpus,
         "documents": documents, "num_canaries": record.num_canaries, "num_included": int(record.included.sum()),
         "canaries": [{"id": f"audit-{k}", "text": t, "included": bool(inc),
                       **({"canary_kind": record.canary_kinds[k]} if record.canary_kinds else {})}
                      for k, (t, inc) in enumerate(zip(record.texts, record.included))]}
  with io.atomic_open(path, "w", encoding="utf-8") as f:
    os.fchmod(f.fileno(), 0o600)
    json.dump(rec, f, indent=1, ensure_ascii=False)
    f.write("\n")
  return path


def load_record(path: str) -> AuditRecord:
  """Reads a membership record written by `plant`."""
  try:
    with open(path, encoding="utf-8") as f:
      rec = json.load(f)
    if rec.get("kind") != RECORD_KIND:
      raise ValueError("not an audit record (written by `private-t5 canaries --audit`)")
    canaries = rec["canaries"]
    if not isinstance(canaries, list):
      raise ValueError(f"'canaries' must be a list, got {type(canaries).__name__}")
    for k, c in enumerate(canaries):
      if not isinstance(c.get("text"), str):
        raise ValueError(f"each canary needs a string 'text', got {c!r:.80}")
      checks.boolean(c.get("included"), f"canary {k}'s 'included'")
    for name in ("repetitions", "seed", "length"):
      checks.integer(rec[name], repr(name), minimum=0)
    if not isinstance(rec["canary_kind"], str):
      raise ValueError(f"'canary_kind' must be a string, got {rec['canary_kind']!r:.80}")
    try:
      kinds = parse_kinds(rec["canary_kind"])
    except ConfigError:
      raise ValueError(f"'canary_kind' must be one of {', '.join(KINDS)} (or several joined by commas), got "
                       f"{rec['canary_kind']!r:.80}") from None
    per_canary = ()
    if len(kinds) > 1:
      per_canary = tuple(c.get("canary_kind") for c in canaries)
      if any(k not in kinds for k in per_canary):
        raise ValueError(f"each canary needs a 'canary_kind' among {', '.join(kinds)}")
    texts = [c["text"] for c in canaries]
    included = np.array([c["included"] for c in canaries], dtype=bool)
    record = AuditRecord(texts=texts, included=included, repetitions=rec["repetitions"],
                         seed=rec["seed"], kind=",".join(kinds), length=rec["length"],
                         source=str(rec.get("source", "")), corpus=str(rec.get("corpus", "")),
                         canary_kinds=per_canary)
  except FileNotFoundError:
    raise DataError(f"audit record not found: {path}") from None
  except IsADirectoryError:
    raise DataError(f"audit record {path} is a folder; give the .audit.json file written by "
                    "`private-t5 canaries --audit`") from None
  except OSError as e:
    raise DataError(f"audit record {path} cannot be read: {e.strerror or e}") from None
  except (ValueError, KeyError, TypeError, AttributeError, ConfigError) as e:
    raise DataError(f"{path} is not an audit record: {e}") from None
  if record.num_canaries < MIN_CANARIES or len(set(texts)) != len(texts):
    raise DataError(f"{path}: an audit needs at least {MIN_CANARIES} distinct canaries, got {len(texts)}")
  if record.repetitions < 1 or not included.any():
    raise DataError(f"{path}: an audit needs at least one included canary, inserted at least once "
                    f"({int(included.sum())} included, {record.repetitions} repetitions)")
  if included.all():
    raise DataError(f"{path}: an audit needs at least one held-out canary (all {record.num_canaries} are included)")
  return record


def encode_for_scoring(vocab, texts: Sequence[str], scoring: str, max_target_tokens: Optional[int] = None):
  """(encoder inputs [m, Li], targets [m, Lt], weights [m, Lt]): first half -> second half of each text.

  With `max_target_tokens` (the training targets length minus EOS) the target is at most that
  long, as the prefix-LM objective splits a short document: later split points, never earlier.
  """
  if scoring not in (PREFIX_SCORING, SENTINEL_SCORING):
    raise ConfigError(f"audit scoring must be {PREFIX_SCORING!r} or {SENTINEL_SCORING!r}, got {scoring!r}")
  sentinel = vocab.vocab_size - 1
  rows_in, rows_out = [], []
  for ids in vocab.tokenizer.encode(list(texts)):
    ids = list(ids)
    split = max(1, len(ids) // 2, len(ids) - max_target_tokens if max_target_tokens else 0)
    split = min(split, max(1, len(ids) - 1))
    if scoring == SENTINEL_SCORING:
      rows_in.append(ids[:split] + [sentinel, EOS_ID])
      rows_out.append([sentinel] + ids[split:] + [EOS_ID])
    else:
      rows_in.append(ids[:split] + [EOS_ID])
      rows_out.append(ids[split:] + [EOS_ID])
  li, lt = max(map(len, rows_in)), max(map(len, rows_out))
  enc = np.zeros((len(texts), li), np.int32)
  tgt = np.zeros((len(texts), lt), np.int32)
  for i, (a, b) in enumerate(zip(rows_in, rows_out)):
    enc[i, :len(a)] = a
    tgt[i, :len(b)] = b
  return enc, tgt, (tgt > 0).astype(np.float32)


def canary_losses(score_fn: Callable, vocab, texts: Sequence[str], scoring: str, batch_size: int = 256,
                  max_target_tokens: Optional[int] = None) -> np.ndarray:
  """Mean token cross-entropy (nats) of each canary's second half, in fixed-size batches."""
  enc, tgt, w = encode_for_scoring(vocab, texts, scoring, max_target_tokens)
  m = len(texts)
  out = np.zeros(m, np.float64)
  b = min(batch_size, m)
  for lo in range(0, m, b):
    idx = np.arange(lo, lo + b) % m  # the last batch repeats rows: one shape, one compilation
    out[lo:lo + b] = -np.asarray(score_fn(enc[idx], tgt[idx], w[idx]))[:m - lo]
  return out / w.sum(axis=1)


def ledger_claim(privacy_report: Optional[dict]):
  """(ε, δ, scope) the checkpoint's ledger claims; ε None for a non-private run or no ledger."""
  if not privacy_report or not privacy_report.get("dp", True) or privacy_report.get("non_private"):
    return None, None, "non-private"
  if privacy_report.get("epsilon") is not None:
    return float(privacy_report["epsilon"]), privacy_report.get("delta"), "training + components"
  if privacy_report.get("training_epsilon") is not None:
    return (float(privacy_report["training_epsilon"]), privacy_report.get("training_delta"),
            "training only (the vocabulary is not private)")
  return None, None, "unknown"


def check_guesses(num_canaries: int, guesses_per_side: Optional[int]) -> int:
  """k, the guesses on each side: `guesses_per_side`, or m // 4 by default; ConfigError unless 1 <= k <= m // 2."""
  m = num_canaries
  k = max(1, m // 4) if guesses_per_side is None else guesses_per_side
  if not isinstance(k, int) or isinstance(k, bool) or k < 1 or 2 * k > m:
    raise ConfigError(f"audit guesses per side must be an integer in [1, {m // 2}] for {m} canaries, got {k!r}")
  return k


def check_delta(delta: float) -> float:
  """δ of the bounds; ConfigError unless 0 < δ < 1 (jax-privacy's bounds need δ > 0)."""
  if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not 0 < delta < 1:
    raise ConfigError(f"audit delta must be in (0, 1) (jax-privacy's bounds need δ > 0), got {delta!r}")
  return float(delta)


def check_settings(num_canaries: int, guesses_per_side: Optional[int], delta: Optional[float],
                   bootstrap_samples: int) -> int:
  """k (`check_guesses`), after refusing a bad δ (None: the ledger's) or bootstrap count: before any scoring."""
  if delta is not None:
    check_delta(delta)
  auditing.check_bootstrap_samples(bootstrap_samples)
  return check_guesses(num_canaries, guesses_per_side)


def run_audit(score_fn: Callable, vocab, record_path_: str, *, scoring: str, privacy_report: Optional[dict],
              confidence: float = 0.95, guesses_per_side: Optional[int] = None, delta: Optional[float] = None,
              default_delta: float = 1e-5, batch_size: int = 256, max_target_tokens: Optional[int] = None,
              bootstrap_samples: int = BOOTSTRAP_SAMPLES, bootstrap_seed: int = 0,
              log: Callable[[str], None] = print) -> dict:
  """Scores the recorded canaries and returns the report's "audit" entry.

  The entry's `epsilon_lower_bound` (and `max_lower_bound`, its cap) is jax-privacy's one-run
  bound (`method`); `epsilon_lower_bound_fdp` the one-run f-DP bound; `tpr_at_fpr` and `auroc`
  the attack's ROC figures with bootstrap intervals; `saturation` a sentence when every guess is
  right. `guesses`, `correct`, `k_plus` and `k_minus` are the package's k-a-side guesses, whose
  bound is `steinke["epsilon_lower_bound"]` (the cross-check).

  Args:
    score_fn: `(encoder_inputs, targets, weights) -> log p [B]` (memorization.make_scorer).
    vocab: the checkpoint's vocabulary.
    record_path_: the membership record (`*.audit.json`).
    scoring: "prefix" or "sentinel" (span-corruption checkpoints).
    privacy_report: the checkpoint's ledger report (its ε and δ are the claim audited).
    confidence: 1 - β of the bounds and of the bootstrap intervals.
    guesses_per_side: k (k+ = k- = k) of the cross-check; default m // 4. Fix it before seeing the scores.
    delta: δ of the bounds, in (0, 1); default the ledger's δ, or `default_delta` for a non-private run.
    batch_size: canaries scored together.
    max_target_tokens: the training targets length minus EOS (prefix LM: the scored part).
    bootstrap_samples: resamples of the TPR and AUROC intervals (0: none).
    bootstrap_seed: the resampling's seed.
  """
  t0 = time.time()
  record = load_record(record_path_)
  m = record.num_canaries
  k = check_settings(m, guesses_per_side, delta, bootstrap_samples)
  claim_eps, claim_delta, scope = ledger_claim(privacy_report)
  delta = check_delta(delta if delta is not None else claim_delta if claim_delta is not None else default_delta)
  losses = canary_losses(score_fn, vocab, record.texts, scoring, batch_size,
                         max_target_tokens if scoring == PREFIX_SCORING else None)
  lib = auditing.score_audit(-losses, record.included, delta, confidence, bootstrap_samples=bootstrap_samples,
                             bootstrap_seed=bootstrap_seed)
  own = auditing.audit(-losses, record.included, k, k, delta, confidence)
  own_cap = auditing.max_lower_bound(own.guesses, delta, confidence, m)
  # A bound on a group of R copies is not bounded by the per-document ε (group privacy).
  comparable = claim_eps is not None and record.repetitions == 1
  violated = bool(comparable and lib.epsilon_one_run > claim_eps)
  fdp_above = bool(comparable and lib.epsilon_one_run_fdp > claim_eps)
  saturation = (auditing.saturation_text(lib.num_included, lib.num_held_out, lib.epsilon_one_run_cap)
                if lib.saturated else None)
  own_saturation = (f"all guesses right: the bound is the cap for {own.guesses} guesses on {m} canaries, "
                    f"{own_cap:.3f}" if own.guesses and own.correct == own.guesses else None)
  version = auditing.library_version()
  edges = np.histogram_bin_edges(losses[np.isfinite(losses)], bins=30) if np.isfinite(losses).any() else np.arange(2.)
  out = {"epsilon_lower_bound": lib.epsilon_one_run, "confidence": confidence, "num_canaries": m,
         "guesses": own.guesses, "correct": own.correct, "ledger_epsilon": claim_eps,
         "ledger_delta": claim_delta, "ledger_scope": scope, "delta": delta, "k_plus": k, "k_minus": k,
         "num_included": lib.num_included, "num_held_out": lib.num_held_out, "repetitions": record.repetitions,
         "canary_kind": record.kind, "scoring": scoring,
         "score": "minus the mean token loss of the canary's second half",
         "method": f"{auditing.LIBRARY_AUDITOR}.epsilon_one_run (jax-privacy {version}; Steinke, Nasr and "
                   "Jagielski 2023): one-sided guesses (\"in\" at or above a threshold), the threshold chosen "
                   "among the ROC hull's vertices with a Bonferroni correction",
         "max_lower_bound": lib.epsilon_one_run_cap, "saturated": lib.saturated, "saturation": saturation,
         "epsilon_lower_bound_fdp": lib.epsilon_one_run_fdp, "max_lower_bound_fdp": lib.epsilon_one_run_fdp_cap,
         "method_fdp": f"{auditing.LIBRARY_AUDITOR}.epsilon_one_run_fdp (jax-privacy {version}; Mahloujifar, "
                       "Melis and Chaudhuri 2025): the Gaussian trade-off curve of (ε, δ)",
         "fdp_exceeds_ledger": fdp_above,
         "tpr_at_fpr": lib.tpr_at_fpr, "auroc": lib.auroc, "auroc_interval": lib.auroc_interval,
         "bootstrap": {"samples": lib.bootstrap_samples, "seed": lib.bootstrap_seed, "confidence": confidence,
                       "method": f"{auditing.LIBRARY_AUDITOR} with BootstrapParams.confidence_interval "
                                 "(bias-corrected percentiles)"},
         "steinke": {"epsilon_lower_bound": own.epsilon_lower_bound, "max_lower_bound": own_cap,
                     "guesses": own.guesses, "correct": own.correct, "k_plus": k, "k_minus": k,
                     "saturated": own_saturation is not None, "saturation": own_saturation,
                     "method": "private_t5.dp.auditing.epsilon_lower_bound: k lowest losses guessed in, k highest "
                               "out (the cross-check)"},
         "comparable_with_ledger": comparable, "violation": violated,
         "mean_loss_included": float(np.mean(losses[record.included])),
         "mean_loss_excluded": float(np.mean(losses[~record.included])),
         "histogram": {"edges": edges.tolist(),
                       "included": np.histogram(losses[record.included], bins=edges)[0].tolist(),
                       "excluded": np.histogram(losses[~record.included], bins=edges)[0].tolist()},
         "record": os.path.abspath(record_path_), "seconds": round(time.time() - t0, 2)}
  if record.canary_kinds:
    out["by_kind"] = by_kind(-losses, record, delta, confidence, claim_eps if comparable else None,
                             bootstrap_samples, bootstrap_seed)
  for line in audit_log_lines(out):
    log(f"[memorization] {line}")
  return out


def by_kind(scores: np.ndarray, record: AuditRecord, delta: float, confidence: float,
            ledger_epsilon: Optional[float], bootstrap_samples: int, bootstrap_seed: int) -> dict:
  """The audit's figures of each kind's canaries alone (a record of several kinds: one training
  run, so the kinds are compared on the same model). `exceeds_ledger`: that kind's one-run bound is
  above the ledger's ε (each kind's bound holds at `confidence` on its own; K kinds make K tests)."""
  kinds = np.asarray(record.canary_kinds)
  out = {}
  for name in record.kinds:
    rows = kinds == name
    lib = auditing.score_audit(scores[rows], record.included[rows], delta, confidence,
                               bootstrap_samples=bootstrap_samples, bootstrap_seed=bootstrap_seed)
    out[name] = {"num_canaries": int(rows.sum()), "num_included": lib.num_included, "num_held_out": lib.num_held_out,
                 "epsilon_lower_bound": lib.epsilon_one_run, "max_lower_bound": lib.epsilon_one_run_cap,
                 "epsilon_lower_bound_fdp": lib.epsilon_one_run_fdp, "max_lower_bound_fdp": lib.epsilon_one_run_fdp_cap,
                 "saturated": lib.saturated, "tpr_at_fpr": lib.tpr_at_fpr, "auroc": lib.auroc,
                 "auroc_interval": lib.auroc_interval,
                 "exceeds_ledger": bool(ledger_epsilon is not None and lib.epsilon_one_run > ledger_epsilon)}
  return out


def _interval(values) -> str:
  return "" if values is None else f" [{values[0]:.3g}, {values[1]:.3g}]"


def audit_log_lines(audit: dict) -> List[str]:
  """What `memorization` prints of an audit entry (run_audit's): the figures, saturation, notes."""
  claim = ("ε = ∞ (non-private)" if audit["ledger_epsilon"] is None
           else f"ε = {audit['ledger_epsilon']:.4g} ({audit['ledger_scope']})")
  tprs = ", ".join(f"{t['tpr']:.3g}{_interval(t['interval'])} at FPR {100 * t['fpr']:g}%" for t in audit["tpr_at_fpr"])
  own = audit["steinke"]
  lines = [
      f"privacy audit ({auditing.LIBRARY_AUDITOR}; {audit['num_canaries']} canaries: {audit['num_included']} "
      f"included, {audit['num_held_out']} held out; {100 * audit['confidence']:g}% confidence, "
      f"δ = {audit['delta']:.3g}): ε ≥ {audit['epsilon_lower_bound']:.3f} (epsilon_one_run; cap "
      f"{audit['max_lower_bound']:.3f}), ε ≥ {audit['epsilon_lower_bound_fdp']:.3f} (epsilon_one_run_fdp, a "
      f"Gaussian trade-off; cap {audit['max_lower_bound_fdp']:.3f}); ledger {claim}",
      f"privacy audit: attack TPR {tprs}; AUROC {audit['auroc']:.3g}{_interval(audit['auroc_interval'])} "
      f"(bootstrap, {audit['bootstrap']['samples']} resamples)",
      f"privacy audit cross-check (dp/auditing.epsilon_lower_bound, k = {own['k_plus']} a side): "
      f"ε ≥ {own['epsilon_lower_bound']:.3f} ({own['correct']}/{own['guesses']} guesses correct; cap "
      f"{own['max_lower_bound']:.3f})"]
  for name, kind in (audit.get("by_kind") or {}).items():
    tprs = ", ".join(f"{t['tpr']:.3g}{_interval(t['interval'])} at FPR {100 * t['fpr']:g}%" for t in kind["tpr_at_fpr"])
    lines.append(f"privacy audit, {name} canaries alone ({kind['num_canaries']}: {kind['num_included']} included): "
                 f"ε ≥ {kind['epsilon_lower_bound']:.3f} (cap {kind['max_lower_bound']:.3f}), f-DP ε ≥ "
                 f"{kind['epsilon_lower_bound_fdp']:.3f}; TPR {tprs}; AUROC {kind['auroc']:.3g}"
                 f"{_interval(kind['auroc_interval'])}" + (" (saturated)" if kind["saturated"] else ""))
    if kind["exceeds_ledger"]:
      lines.append(f"PRIVACY AUDIT FAILED for the {name} canaries: their ε lower bound "
                   f"{kind['epsilon_lower_bound']:.3f} exceeds the ledger's ε = {audit['ledger_epsilon']:.4g} (one of "
                   f"{len(audit['by_kind'])} tests at {100 * audit['confidence']:g}% confidence each)")
  if audit["saturation"]:
    lines.append(f"privacy audit saturated: {audit['saturation']}")
  if audit["violation"]:
    lines.append(f"PRIVACY AUDIT FAILED: {audit_failure_text(audit)}")
  elif audit.get("fdp_exceeds_ledger"):
    lines.append(f"note: {fdp_note(audit)}")
  if audit["ledger_epsilon"] is not None and audit["repetitions"] > 1:
    lines.append(f"note: each included canary was inserted {audit['repetitions']} times, so the bound concerns a "
                 "group of documents and is not compared with the per-document ledger ε")
  return lines


def fdp_note(audit: dict) -> str:
  """The line of an f-DP bound above the ledger's ε (with the one-run bound below it)."""
  return (f"the one-run f-DP bound {audit['epsilon_lower_bound_fdp']:.3f} exceeds the ledger's ε = "
          f"{audit['ledger_epsilon']:.4g}: training is not μ-GDP for the μ that gives the ledger's (ε, δ) (at "
          f"{100 * audit['confidence']:g}% confidence); DP-SGD's trade-off is close to Gaussian, so check the "
          "implementation and accounting, though only the one-run bound refutes the (ε, δ) claim itself")


def audit_failure_text(audit: dict) -> str:
  """The loud line of a failed audit."""
  return (f"the ε lower bound {audit['epsilon_lower_bound']:.3f} (at {100 * audit['confidence']:g}% confidence) "
          f"exceeds the ledger's ε = {audit['ledger_epsilon']:.4g}: the DP implementation or its privacy "
          "accounting is wrong (or, with probability at most "
          f"{1 - audit['confidence']:.2g}, this audit is a false alarm)")
