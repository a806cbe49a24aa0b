"""Training-data extraction (Ponomareva et al. 2022, §4 "Testing for memorization", Table 3).

Prefix variant (Carlini et al. 2020; Lee et al. 2021): the encoder reads the first P tokens of a
document (followed by EOS, as every training input ends in EOS), the decoder generates T
tokens greedily (optionally with beam search), and the generation is compared with the true
next T tokens (EM / TA / MED, see extraction_metrics.py). Documents shorter than P + T tokens
are skipped and counted.

Span-corruption variant (the alternative definition proposed in Ponomareva et al. 2022, §5.2): the first
`raw` tokens of a document (the window one span-corruption training example consumes for
encoder length P) are corrupted with T5's random spans and sentinels, and the model must
regenerate the masked spans (sentinels included) verbatim.

Decoding is batched, jit-compiled and uses the KV cache (models/decoding.py); it runs on a mesh of
every device (models/mesh_inference.py: prompts over the `data` axis, parameters laid out as in
training), and batches are padded to a fixed size so XLA compiles once per decoding method.
"""
import dataclasses
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import jax
import numpy as np

from private_t5.models import network
from private_t5 import progress as progress_lib
from private_t5.data import objectives
from private_t5.errors import CheckpointError, ConfigError
from private_t5.eval import extraction_metrics
from private_t5.models import mesh_inference, sharding

EOS_ID = 1
GREEDY = "greedy"
BEAM = "beam"


@dataclasses.dataclass(frozen=True)
class ExtractionConfig:
  """Settings of the extraction test.

  Attributes:
    prompt_length: P, prompt tokens taken from the start of each document (512 in the paper).
    generation_length: T, generated and compared tokens (114 in the paper).
    batch_size: prompts decoded together (the last batch is padded to this size).
    beam_size: beam width of the optional beam-search pass; 0 disables it.
    beam_alpha: brevity-penalty exponent of beam search.
    append_eos_to_prompt: end the encoder input with EOS, as training inputs do.
    use_cache: decode with the KV cache (False: the slow reference path).
    noise_density, mean_noise_span_length: span-corruption variant's masking (T5 defaults).
    seed: seed of the span-corruption variant's masks.
    approximate_threshold: normalized token edit distance (distance / T) up to which a
      generation is an approximate match (0.1: Carlini et al. 2023).
    confidence: confidence of the Clopper-Pearson intervals of the match rates.
  """
  prompt_length: int = 512
  generation_length: int = 114
  batch_size: int = 32
  beam_size: int = 0
  beam_alpha: float = 0.6
  append_eos_to_prompt: bool = True
  use_cache: bool = True
  noise_density: float = 0.15
  mean_noise_span_length: float = 3.0
  seed: int = 0
  approximate_threshold: float = extraction_metrics.APPROXIMATE_THRESHOLD
  confidence: float = extraction_metrics.CONFIDENCE

  def validate(self) -> "ExtractionConfig":
    for name in ("prompt_length", "generation_length", "batch_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if self.beam_size < 0:
      raise ConfigError(f"beam_size must be >= 0, got {self.beam_size}")
    if isinstance(self.approximate_threshold, bool) or not isinstance(self.approximate_threshold, (int, float)) \
        or not 0 <= self.approximate_threshold < 1:
      raise ConfigError(f"approximate_threshold must be in [0, 1), got {self.approximate_threshold!r}")
    if isinstance(self.confidence, bool) or not isinstance(self.confidence, (int, float)) \
        or not 0 < self.confidence < 1:
      raise ConfigError(f"the match rates' confidence must be in (0, 1), got {self.confidence!r}")
    return self


@dataclasses.dataclass
class ExtractionExamples:
  """Fixed-shape prompts and targets of one split."""
  ids: List[str]
  inputs: np.ndarray   # int32 [n, Li]
  targets: List[np.ndarray]  # each int32 [<= max target length], no EOS
  skipped: int
  max_target_length: int


def tokenize_documents(vocab, texts: Sequence[str]) -> List[np.ndarray]:
  """Token ids of each text (no EOS) with the SentencePiece vocabulary, batched in C++."""
  if not texts:
    return []
  ids = vocab.tokenizer.encode(list(texts))
  return [np.asarray(x, dtype=np.int32) for x in ids]


def prefix_examples(doc_ids: Sequence[str], token_lists: Sequence[np.ndarray],
                    cfg: ExtractionConfig) -> ExtractionExamples:
  """Prompts (first P tokens [+ EOS]) and targets (next T tokens); short documents skipped."""
  p, t = cfg.prompt_length, cfg.generation_length
  keep = [i for i, toks in enumerate(token_lists) if len(toks) >= p + t]
  width = p + (1 if cfg.append_eos_to_prompt else 0)
  inputs = np.zeros((len(keep), width), dtype=np.int32)
  targets = []
  for row, i in enumerate(keep):
    inputs[row, :p] = token_lists[i][:p]
    if cfg.append_eos_to_prompt:
      inputs[row, p] = EOS_ID
    targets.append(np.asarray(token_lists[i][p:p + t], dtype=np.int32))
  return ExtractionExamples(ids=[doc_ids[i] for i in keep], inputs=inputs, targets=targets,
                            skipped=len(token_lists) - len(keep), max_target_length=t)


def span_corruption_examples(doc_ids: Sequence[str], token_lists: Sequence[np.ndarray],
                             cfg: ExtractionConfig, vocab_size: int,
                             positions: Optional[Sequence[int]] = None) -> ExtractionExamples:
  """The span-corruption variant: corrupt the first raw window of each document.

  Args:
    doc_ids, token_lists: the documents of one split (or a selection of them).
    cfg: lengths, masking and seed (encoder length P with EOS, as in training).
    vocab_size: size of the vocabulary including the sentinels (sentinel k = vocab_size-1-k).
    positions: each document's position in its split, which seeds its mask (default: its
      position in `token_lists`).
  """
  raw, targets_length = objectives.span_corruption_lengths(cfg.prompt_length, cfg.noise_density,
                                                           cfg.mean_noise_span_length)
  keep = [i for i, toks in enumerate(token_lists) if len(toks) >= raw]
  inputs = np.zeros((len(keep), cfg.prompt_length), dtype=np.int32)
  targets = []
  for row, i in enumerate(keep):
    window = np.asarray(token_lists[i][:raw], dtype=np.int32)
    rng = np.random.default_rng([cfg.seed, i if positions is None else int(positions[i])])
    mask = objectives.random_spans_noise_mask(raw, cfg.noise_density, rng, cfg.mean_noise_span_length)
    enc = objectives.noise_span_to_unique_sentinel(window, mask, vocab_size)
    enc = np.concatenate([enc, [EOS_ID]])[:cfg.prompt_length]
    inputs[row, :len(enc)] = enc
    targets.append(objectives.nonnoise_span_to_unique_sentinel(window, mask, vocab_size).astype(np.int32))
  return ExtractionExamples(ids=[doc_ids[i] for i in keep], inputs=inputs, targets=targets,
                            skipped=len(token_lists) - len(keep), max_target_length=targets_length)


def subsample(examples: ExtractionExamples, k: Optional[int], seed: int) -> ExtractionExamples:
  """Up to `k` of the examples, a seeded random subset in corpus order (`skipped` kept)."""
  n = len(examples.ids)
  if k is None or n <= k:
    return examples
  rows = np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))
  return ExtractionExamples(ids=[examples.ids[i] for i in rows], inputs=examples.inputs[rows],
                            targets=[examples.targets[i] for i in rows], skipped=examples.skipped,
                            max_target_length=examples.max_target_length)


def generated_lengths(tokens: np.ndarray, eos_id: int = EOS_ID) -> np.ndarray:
  """Tokens each row of a decode's output `[n, L]` (zeros after the first EOS) generated: up to and
  including its first EOS, or all L without one (greedy decoding stops a batch once every row has
  ended, so L a row over-counts the rows that end early)."""
  tokens = np.asarray(tokens)
  ended = tokens == eos_id
  return np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, tokens.shape[1]).astype(np.int64)


@dataclasses.dataclass
class DecodeStats:
  """Timing of one decoding pass; `generated_tokens` counts what the rows generated
  (`generated_lengths`), not rows × the length asked for."""
  prompts: int = 0
  generated_tokens: int = 0
  seconds: float = 0.0
  first_batch_seconds: float = 0.0  # includes jit compilation
  first_batch_tokens: int = 0

  @property
  def tokens_per_second(self) -> float:
    """Steady-state throughput: generated tokens per second after the first batch."""
    steady_tokens = self.generated_tokens - self.first_batch_tokens
    steady_seconds = self.seconds - self.first_batch_seconds
    if steady_tokens > 0 and steady_seconds > 0:
      return steady_tokens / steady_seconds
    return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

  @property
  def prompts_per_second(self) -> float:
    """Prompts decoded per second of the whole pass (its wall time, compilation included)."""
    return self.prompts / self.seconds if self.seconds > 0 else 0.0

  def merge(self, other: "DecodeStats") -> "DecodeStats":
    """This pass followed by `other` (its first batch stays this one's unless this one is empty)."""
    if not self.generated_tokens:
      return dataclasses.replace(other, prompts=self.prompts + other.prompts)
    return DecodeStats(prompts=self.prompts + other.prompts,
                       generated_tokens=self.generated_tokens + other.generated_tokens,
                       seconds=self.seconds + other.seconds, first_batch_seconds=self.first_batch_seconds,
                       first_batch_tokens=self.first_batch_tokens)

  def as_dict(self) -> dict:
    return {"prompts": self.prompts, "generated_tokens": self.generated_tokens,
            "seconds": round(self.seconds, 3), "first_batch_seconds": round(self.first_batch_seconds, 3),
            "tokens_per_second": round(self.tokens_per_second, 1),
            "prompts_per_second": round(self.prompts_per_second, 2)}


def make_inference(params, model_config, mesh=None,
                   rules=sharding.LOGICAL_AXIS_RULES) -> mesh_inference.MeshInference:
  """The parameters placed on `mesh` (default: every device of every process on the `data` axis)
  by the logical-axis `rules` of training, ready to decode and score."""
  return mesh_inference.MeshInference(model_config, mesh, params=params, rules=rules)


def generate(params, model_config, inputs: np.ndarray, max_decode_length: int, cfg: ExtractionConfig,
             method: str = GREEDY, progress=None,
             inference: Optional[mesh_inference.MeshInference] = None) -> Tuple[np.ndarray, DecodeStats]:
  """Decodes every row of `inputs` on the mesh, in global batches of `cfg.batch_size` rows.

  Each batch's rows are split over the mesh's `data` axis (with several processes each supplies
  the rows of its own devices) and every process gets every prediction. Decoding is row by row
  independent, so the result equals the one-device one.

  Args:
    params, model_config: the checkpoint (ignored when `inference` is given).
    inference: the parameters already on a mesh (`make_inference`); default: placed here on
      every device.

  Returns:
    (tokens int32 [n, max_decode_length] with zeros after the first EOS, DecodeStats). For beam
    search the best beam of each row.
  """
  if method not in (GREEDY, BEAM):
    raise ConfigError(f"decoding method must be {GREEDY!r} or {BEAM!r}, got {method!r}")
  if inference is None:
    inference = make_inference(params, model_config)
  n = inputs.shape[0]
  stats = DecodeStats(prompts=n)
  options = {"use_cache": cfg.use_cache}
  if method == BEAM:
    options.update(beam_size=cfg.beam_size, alpha=cfg.beam_alpha)

  batch_rows = []

  def on_batch(rows: int, seconds: float) -> None:
    if not batch_rows:
      stats.first_batch_seconds = seconds
    batch_rows.append(rows)
    stats.seconds += seconds
    if progress:
      progress.set_postfix_str(f"{sum(batch_rows) / max(stats.seconds, 1e-9):.1f} prompts/s", refresh=False)
      progress.update(rows)

  out = inference.decode(inputs, max_decode_length, batch_size=cfg.batch_size, method=method,
                         on_batch=on_batch, **options)
  lengths = generated_lengths(out)
  stats.generated_tokens = int(lengths.sum())
  stats.first_batch_tokens = int(lengths[:batch_rows[0]].sum()) if batch_rows else 0
  return out, stats


def evaluate_split(params, model_config, examples: ExtractionExamples, cfg: ExtractionConfig,
                   method: str = GREEDY, label: str = "", verbose: bool = True,
                   inference: Optional[mesh_inference.MeshInference] = None):
  """(SplitMetrics, DecodeStats, predictions) of one split's examples (`generate` decodes them)."""
  n = len(examples.ids)
  if n == 0:
    return extraction_metrics.aggregate([], [], skipped=examples.skipped, threshold=cfg.approximate_threshold,
                                        confidence=cfg.confidence), DecodeStats(), []
  progress = progress_lib.bar(total=n, desc=f"{label} {method}".strip(), unit="prompts") if verbose else None
  try:
    preds, stats = generate(params, model_config, examples.inputs, examples.max_target_length, cfg,
                            method=method, progress=progress, inference=inference)
  finally:
    if progress is not None:
      progress.close()
  metrics = extraction_metrics.aggregate(list(preds), examples.targets, skipped=examples.skipped,
                                         threshold=cfg.approximate_threshold, confidence=cfg.confidence)
  return metrics, stats, preds


def evaluate_streaming(params, model_config, chunks: Iterable[ExtractionExamples], cfg: ExtractionConfig,
                       method: str = GREEDY, label: str = "", total: Optional[int] = None, skipped: int = 0,
                       verbose: bool = True, inference: Optional[mesh_inference.MeshInference] = None):
  """`evaluate_split` over examples that arrive in chunks (each decoded by `generate`, in batches
  of `cfg.batch_size`), holding one chunk's prompts and predictions at a time.

  Returns:
    (SplitMetrics, DecodeStats, ids, exact, approximate): the example ids in order, and per
    example whether it is an exact and an approximate match.
  """
  scores, lengths, ids, stats = [], [], [], DecodeStats()
  progress = progress_lib.bar(total=total, desc=f"{label} {method}".strip(), unit="prompts") if verbose else None
  try:
    for chunk in chunks:
      if not chunk.ids:
        continue
      preds, chunk_stats = generate(params, model_config, chunk.inputs, chunk.max_target_length, cfg,
                                    method=method, progress=progress, inference=inference)
      stats = stats.merge(chunk_stats)
      scores.extend(extraction_metrics.per_example_scores(p, t, EOS_ID) for p, t in zip(preds, chunk.targets))
      lengths.extend(len(t) for t in chunk.targets)
      ids.extend(chunk.ids)
  finally:
    if progress is not None:
      progress.close()
  metrics = extraction_metrics.aggregate_scores(scores, lengths, skipped=skipped,
                                                threshold=cfg.approximate_threshold, confidence=cfg.confidence)
  exact = [bool(s[0]) for s in scores]
  approximate = [extraction_metrics.is_approximate_match(s[2], t, cfg.approximate_threshold)
                 for s, t in zip(scores, lengths)]
  return metrics, stats, ids, exact, approximate


def check_model_matches(params, model_config, vocab_size: int) -> None:
  """CheckpointError when the parameters, the config and the vocabulary disagree."""
  if vocab_size > model_config.vocab_size:
    raise CheckpointError(f"the vocabulary has {vocab_size} ids (with sentinels) but the checkpoint's model "
                          f"has only {model_config.vocab_size} embedding rows: wrong vocabulary for this "
                          "checkpoint")
  expected = network.param_shapes(model_config)
  exp_flat = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(expected)}
  got_flat = {jax.tree_util.keystr(k): np.shape(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
  for name in sorted(set(exp_flat) | set(got_flat)):
    if exp_flat.get(name) != got_flat.get(name):
      raise CheckpointError(f"checkpoint parameters do not match its model config: {name} has shape "
                            f"{got_flat.get(name)} in the checkpoint, {exp_flat.get(name)} in the config")


def make_scorer(params, model_config, inference: Optional[mesh_inference.MeshInference] = None
                ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
  """`score(encoder_inputs [B, Li], targets [B, Lt], weights [B, Lt]) -> log p [B]` on the mesh.

  log p is the weighted sum of token log-probabilities of the targets under teacher forcing
  (the negative log-perplexity of Carlini et al. 2019, in nats). The rows are split over the
  `data` axis of `inference`'s mesh (default: the parameters placed here on every device);
  every process gets every score.
  """
  if inference is None:
    inference = make_inference(params, model_config)
  return inference.score


def summarize_decode_stats(stats: Dict[str, DecodeStats]) -> dict:
  """Overall throughput over the decoding passes of a run."""
  tokens = sum(s.generated_tokens for s in stats.values())
  seconds = sum(s.seconds for s in stats.values())
  steady = [s.tokens_per_second for s in stats.values() if s.generated_tokens]
  prompts = sum(s.prompts for s in stats.values() if s.generated_tokens)
  return {"generated_tokens": tokens, "seconds": round(seconds, 3), "prompts": prompts,
          "prompts_per_second": round(prompts / seconds, 2) if seconds else 0.0,
          "tokens_per_second_overall": round(tokens / seconds, 1) if seconds else 0.0,
          "tokens_per_second_steady": round(float(np.median(steady)), 1) if steady else 0.0}
