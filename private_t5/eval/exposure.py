"""Canary exposure (Carlini et al. 2019, "The Secret Sharer", §4).

    exposure(s) = log2 |R| - log2 rank(s)

where R is the space of possible secrets and rank(s) is the position of the true secret when
all candidates are sorted by the model's log-perplexity of the secret given the canary's
prefix (rank 1 = the model's favourite). Exposure ranges from 0 to log2 |R|; a secret the model
has not learnt has exposure about 1 on average.

* Exact: every candidate is scored (batched teacher-forced scoring), for small spaces.
* Extrapolated (Carlini et al. §4.3): the log-perplexities of a uniform sample of candidates
  are fitted with a skew-normal distribution; exposure = -log2 CDF(log-perplexity of s), and
  the estimated rank is |R| · CDF.
"""
import dataclasses
import math
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

from private_t5.errors import DataError
from private_t5.eval.canaries import Canary, CanaryFormat

EOS_ID = 1
PREFIX_SCORING = "prefix"
SENTINEL_SCORING = "sentinel"


def exposure_from_rank(rank: float, space_size: int) -> float:
  """log2 |R| - log2 rank."""
  return math.log2(space_size) - math.log2(rank)


def exact_rank(canary_log_perplexity: float, candidate_log_perplexities: np.ndarray) -> int:
  """1 + the number of candidates the model strictly prefers (lower log-perplexity).

  `candidate_log_perplexities` covers the whole space, the canary included; ties count in the
  canary's favour.
  """
  return 1 + int(np.sum(np.asarray(candidate_log_perplexities) < canary_log_perplexity))


def skewnorm_exposure(canary_log_perplexity: float, sample_log_perplexities: np.ndarray,
                      space_size: int) -> Tuple[float, float, dict]:
  """(exposure, estimated rank, fit) from a skew-normal fit of sampled log-perplexities."""
  sample = np.asarray(sample_log_perplexities, dtype=np.float64)
  a, loc, scale = stats.skewnorm.fit(sample)
  log_cdf = float(stats.skewnorm.logcdf(canary_log_perplexity, a, loc, scale))
  # The rank is at least 1, so exposure is at most log2 |R|.
  exposure = min(-log_cdf / math.log(2), math.log2(space_size))
  rank = max(1.0, space_size * math.exp(log_cdf))
  return exposure, rank, {"skewness": float(a), "loc": float(loc), "scale": float(scale),
                          "sample_size": int(sample.size)}


@dataclasses.dataclass
class CanaryResult:
  """Exposure of one canary."""
  id: str
  secret: str
  repetitions: int
  log_perplexity: float
  rank: float
  exposure: float
  max_exposure: float
  method: str  # "exact" or "skewnorm"

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class CandidateEncoder:
  """Turns candidate secrets into fixed-shape (encoder input, target, weight) arrays.

  The canary text is tokenized whole (so the secret's pieces are those seen in training)
  and cut after the prefix's tokens: the prefix (+ EOS) is the encoder input, the rest
  (+ EOS) the target, as the prefix-LM objective splits a short document.
  With `scoring="sentinel"` (span-corruption models) the encoder input is
  `prefix <extra_id_0> EOS` and the target `<extra_id_0> secret EOS`.
  """

  def __init__(self, vocab, fmt: CanaryFormat, scoring: str = PREFIX_SCORING):
    if scoring not in (PREFIX_SCORING, SENTINEL_SCORING):
      raise ValueError(f"scoring must be {PREFIX_SCORING!r} or {SENTINEL_SCORING!r}, got {scoring!r}")
    self.fmt, self.scoring = fmt, scoring
    self._sp = vocab.tokenizer
    self._sentinel = vocab.vocab_size - 1
    self.prefix_ids = list(self._sp.encode(fmt.prefix.rstrip()))
    enc = self.prefix_ids + ([self._sentinel] if scoring == SENTINEL_SCORING else []) + [EOS_ID]
    self.encoder_input = np.asarray(enc, dtype=np.int32)

  def secret_ids(self, secrets: Sequence[str]) -> List[List[int]]:
    full = self._sp.encode([self.fmt.render(s) for s in secrets])
    n = len(self.prefix_ids)
    out = []
    for ids in full:
      # SentencePiece keeps the prefix's pieces when the secret follows a space; otherwise
      # cut where the two tokenizations stop agreeing.
      k = 0
      while k < min(n, len(ids)) and ids[k] == self.prefix_ids[k]:
        k += 1
      out.append(list(ids[k:]))
    return out

  def encode(self, secrets: Sequence[str], width: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = self.secret_ids(secrets)
    head = [self._sentinel] if self.scoring == SENTINEL_SCORING else []
    targets = np.zeros((len(secrets), width), dtype=np.int32)
    weights = np.zeros((len(secrets), width), dtype=np.float32)
    for i, s in enumerate(ids):
      row = (head + s + [EOS_ID])[:width]
      targets[i, :len(row)] = row
      weights[i, :len(row)] = 1.0
    enc = np.broadcast_to(self.encoder_input, (len(secrets), self.encoder_input.shape[0]))
    return enc, targets, weights

  def extracted(self, generated: np.ndarray, secrets: Sequence[str]) -> List[bool]:
    """Whether `generated` (the greedy decode of `encoder_input`: int32 [L], zeros after the first
    EOS) is each secret's target, through its EOS: the secret is extracted from the prefix alone."""
    targets, weights = self.encode(secrets, max(len(generated), 1))[1:]
    generated = np.asarray(generated)
    out = []
    for target, weight in zip(targets, weights):
      n = int(weight.sum())
      out.append(bool(n <= len(generated) and target[n - 1] == EOS_ID and (generated[:n] == target[:n]).all()))
    return out

  def target_width(self) -> int:
    """Enough decoder positions for any secret of the format (measured on extreme secrets)."""
    probes = [self.fmt.alphabet[0] * self.fmt.length, self.fmt.alphabet[-1] * self.fmt.length]
    rng = np.random.default_rng(0)
    probes += self.fmt.secrets_at(rng.integers(0, self.fmt.space_size, size=256))
    longest = max(len(s) for s in self.secret_ids(probes))
    # Room for the worst case: one piece per symbol.
    return max(longest, self.fmt.length) + 2


class ExposureEvaluator:
  """Scores candidate secrets with a model and computes each canary's exposure.

  Args:
    score_fn: `(encoder_inputs, targets, weights) -> log p [B]` (memorization.make_scorer).
    encoder: the CandidateEncoder of the canary format.
    batch_size: candidates scored together (fixed shape: compiled once).
    max_exact: spaces up to this size are enumerated; larger ones are extrapolated.
    num_samples: candidates sampled for the skew-normal fit.
    seed: sampling seed.
  """

  def __init__(self, score_fn: Callable, encoder: CandidateEncoder, batch_size: int = 1024,
               max_exact: int = 100_000, num_samples: int = 10_000, seed: int = 0,
               progress: Optional[Callable[[int, int], None]] = None):
    self.score_fn, self.encoder = score_fn, encoder
    self.batch_size, self.max_exact, self.num_samples, self.seed = batch_size, max_exact, num_samples, seed
    self.width = encoder.target_width()
    self.progress = progress

  def log_perplexities(self, secrets: Sequence[str]) -> np.ndarray:
    """-log p(secret | prefix) in nats for every secret, in fixed-size batches."""
    out = np.zeros(len(secrets), dtype=np.float64)
    b = self.batch_size
    for lo in range(0, len(secrets), b):
      chunk = list(secrets[lo:lo + b])
      rows = len(chunk)
      chunk += [chunk[-1]] * (b - rows)
      enc, tgt, w = self.encoder.encode(chunk, self.width)
      out[lo:lo + rows] = -self.score_fn(enc, tgt, w)[:rows]
      if self.progress:
        self.progress(lo + rows, len(secrets))
    return out

  def evaluate(self, canaries: Sequence[Canary]) -> List[CanaryResult]:
    if not canaries:
      raise DataError("no canaries to evaluate")
    fmt = self.encoder.fmt
    space = fmt.space_size
    canary_lp = self.log_perplexities([c.secret for c in canaries])
    results = []
    if space <= self.max_exact:
      all_lp = self.log_perplexities(fmt.secrets_at(range(space)))
      index = {s: i for i, s in enumerate(fmt.secrets_at(range(space)))}
      for c, lp in zip(canaries, canary_lp):
        # Use the enumeration's own score of the secret so that it ties with itself exactly.
        own = all_lp[index[c.secret]]
        rank = exact_rank(own, all_lp)
        results.append(CanaryResult(c.id, c.secret, c.repetitions, float(own), float(rank),
                                    exposure_from_rank(rank, space), math.log2(space), "exact"))
      return results
    rng = np.random.default_rng(self.seed)
    sample = self.log_perplexities(fmt.secrets_at(rng.integers(0, space, size=self.num_samples)))
    for c, lp in zip(canaries, canary_lp):
      exposure, rank, _ = skewnorm_exposure(lp, sample, space)
      results.append(CanaryResult(c.id, c.secret, c.repetitions, float(lp), float(rank), float(exposure),
                                  math.log2(space), "skewnorm"))
    return results
