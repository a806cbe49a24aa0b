"""The memorization evaluation of a checkpoint: does it leak its training data?

`run_memorization` (the `private-t5 memorization` stage binds it with Gin) builds (or reuses) the four splits of Lee et al. (train dup / train unique / valid in train /
valid unique), prompts the checkpoint with the first P tokens of up to N documents of each
split, generates T tokens greedily (and with beam search when BEAM_SIZE > 0), scores EM / TA /
MED and the exact and approximate match rates with their Clopper-Pearson intervals, optionally
a uniform sample of the training documents (the "train_sample" group: the 50/50 extraction
protocol of Carlini et al. 2023), the span-corruption variant, the exposure of recorded canaries and the one-run
privacy audit (an ε lower bound from audit canaries, beside the ledger's ε), and writes
report.json, report.md and plots to the output directory.
"""
import array
import dataclasses
import hashlib
import os
import re
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import jax
from jax.experimental import multihost_utils
import numpy as np

from private_t5 import progress as progress_lib
from private_t5.data import corpora
from private_t5.data import objectives
from private_t5.errors import CheckpointError, ConfigError, DataError
from private_t5.io import check_output_file, file_sha256
from private_t5.eval import audit as audit_lib
from private_t5.eval import canaries as canaries_lib
from private_t5.eval import exposure, extraction_metrics, memorization
from private_t5.eval import report as report_lib
from private_t5.eval import split_files, split_search
from private_t5.eval.split_types import SPLIT_NAMES, SplitConfig, check_nonempty
from private_t5.models import run_dir, sharding
from private_t5.models import checkpoint_read
from private_t5 import vocabulary

AUTO = "auto"


def _objective_of(info: dict, model_dir: str) -> Optional[str]:
  """The pretraining objective: from the checkpoint info, else the run's operative config.gin."""
  for source in (info, info.get("data") or {}):
    if isinstance(source, dict) and source.get("objective"):
      return str(source["objective"])
  config_gin = run_dir.config_path(model_dir)
  if os.path.isfile(config_gin):
    with open(config_gin, encoding="utf-8") as f:
      match = re.search(r"^(?:OBJECTIVE|\S*make_source\.objective)\s*=\s*['\"](\w+)['\"]", f.read(), re.M)
    if match:
      return match.group(1)
  return None


def run_memorization(*, model_dir: str, train_corpus: str, valid_corpus: str, output_dir: str,
                     vocab_path: Optional[str] = None, step: Optional[int] = None,
                     prompt_length: int = 512, generation_length: int = 114, batch_size: int = 32,
                     beam_size: int = 0, beam_alpha: float = 0.6, max_examples_per_split: Optional[int] = 1000,
                     span_corruption_variant=AUTO, split_config: SplitConfig = SplitConfig(),
                     canaries: Optional[str] = None, canary_scoring: str = AUTO, canary_max_exact: int = 100_000,
                     canary_samples: int = 10_000, canary_batch_size: int = 512, audit: Optional[str] = None,
                     audit_confidence: float = 0.95, audit_guesses: Optional[int] = None,
                     audit_delta: Optional[float] = None,
                     audit_bootstrap_samples: int = audit_lib.BOOTSTRAP_SAMPLES, text_field: str = "text",
                     train_sample_size: int = 0,
                     approximate_threshold: float = extraction_metrics.APPROXIMATE_THRESHOLD,
                     match_confidence: float = extraction_metrics.CONFIDENCE,
                     seed: int = 0, use_cache: bool = True, mesh_shape: Sequence[int] = (-1, 1),
                     parameter_sharding: str = sharding.REPLICATED, log: Callable[[str], None] = print) -> dict:
  """Runs the memorization stage and writes the report; returns the report dict.

  Args:
    model_dir: a training run's MODEL_DIR (checkpoints/ inside).
    train_corpus: spec of the corpus the checkpoint was trained on.
    valid_corpus: spec of a held-out corpus of the same kind.
    output_dir: where splits_<key>.json, report.json/.md and the plots go.
    vocab_path: the SentencePiece model; default the one recorded in the checkpoint.
    step: checkpoint step (None: latest).
    prompt_length, generation_length: P and T.
    batch_size: prompts decoded together.
    beam_size, beam_alpha: beam search pass (beam_size 0: greedy only).
    max_examples_per_split: documents evaluated per split (a seeded random subset of those long
      enough; the others are counted as skipped).
    span_corruption_variant: True / False / "auto" (on when the checkpoint says it was trained
      with span corruption).
    split_config: near-duplicate settings (`SplitConfig`).
    canaries: a canary record (`*.canaries.json`) to compute exposures for.
    canary_scoring: "prefix", "sentinel" or "auto" (sentinel for span-corruption checkpoints).
    canary_max_exact, canary_samples, canary_batch_size: exact enumeration up to this space
      size, else a skew-normal fit on this many sampled candidates; scoring batch.
    audit: a membership record (`*.audit.json`) of audit canaries: report an ε lower bound.
    audit_confidence: confidence of the bound (0.95).
    audit_guesses: k, the guesses on each side (the k lowest losses "in", the k highest "out");
      default m // 4. Fix it before looking at the results.
    audit_delta: δ of the bound (default: the ledger's δ; 1e-5 for a non-private run).
    audit_bootstrap_samples: resamples of the audit's TPR and AUROC intervals (0: none).
    text_field: JSONL/TSV field of the text.
    train_sample_size: training documents drawn uniformly (seeded, without replacement) from
      those with at least P + T tokens and evaluated as the "train_sample" group, streamed in
      chunks; 0: none.
    approximate_threshold: normalized token edit distance (distance / T) up to which a
      generation is an approximate match (0.1: 5 of 50 tokens wrong).
    match_confidence: confidence of the Clopper-Pearson intervals of the match rates.
    seed: seed of the per-split subsets, of the training sample and of the span-corruption masks.
    use_cache: decode with the KV cache.
    mesh_shape: (data, model) mesh of the decoding and scoring, as training's; -1 takes the
      remaining devices. Default: every device of every process on `data`. `batch_size` is the
      global batch, rounded up to a multiple of the `data` axis.
    parameter_sharding: the parameters' layout, "replicated" (split over `model` only) or
      "fully_sharded" (also `embed` over `data`), training's rules.
    log: progress output.
  """
  t_start = time.time()
  cfg = _checked_settings(
      model_dir=model_dir, train_corpus=train_corpus, valid_corpus=valid_corpus, output_dir=output_dir,
      prompt_length=prompt_length, generation_length=generation_length, batch_size=batch_size, beam_size=beam_size,
      beam_alpha=beam_alpha, use_cache=use_cache, seed=seed, approximate_threshold=approximate_threshold,
      match_confidence=match_confidence, train_sample_size=train_sample_size,
      max_examples_per_split=max_examples_per_split, split_config=split_config, audit=audit,
      audit_guesses=audit_guesses, audit_delta=audit_delta, audit_bootstrap_samples=audit_bootstrap_samples)
  model, mesh = _model_on_mesh(model_dir, step, vocab_path, mesh_shape, parameter_sharding, batch_size, log)
  warnings = []
  os.makedirs(output_dir, exist_ok=True)
  data = build_splits(model, train_corpus, valid_corpus, output_dir, split_config, text_field, warnings, log)
  if span_corruption_variant == AUTO:
    span_corruption_variant = model.objective == "span_corruption"
  extraction, decode_stats, evaluated, per_document = evaluate_extraction(
      model, data, cfg, max_examples_per_split=max_examples_per_split,
      span_corruption=bool(span_corruption_variant), warnings=warnings, log=log)
  train_sample = None
  if train_sample_size:
    train_sample = evaluate_train_sample(model, data, cfg, train_sample_size, extraction, decode_stats,
                                         per_document, warnings, log)
    evaluated["train_sample"] = train_sample["evaluated"]
  if canary_scoring == AUTO:
    canary_scoring = (exposure.SENTINEL_SCORING if model.objective == "span_corruption"
                      else exposure.PREFIX_SCORING)
  audit_result = None
  if audit:
    audit_result = _audit(model, audit, canary_scoring, audit_confidence, audit_guesses, audit_delta,
                          canary_batch_size, audit_bootstrap_samples, warnings, log)
  canary_results, canary_fmt = [], None
  if canaries:
    canary_fmt, canary_results = evaluate_canaries(
        model, canaries, canary_scoring, max_exact=canary_max_exact, num_samples=canary_samples,
        batch_size=canary_batch_size, seed=seed, log=log)

  throughput = _logged_throughput(decode_stats, log)
  settings = {"prompt_length": prompt_length, "generation_length": generation_length,
              "batch_size": batch_size, "global_batch_size": model.inference.global_batch_size(batch_size),
              "parameter_sharding": parameter_sharding, "beam_size": beam_size, "beam_alpha": beam_alpha,
              "max_examples_per_split": max_examples_per_split, "seed": seed,
              "train_sample_size": train_sample_size, "approximate_threshold": approximate_threshold,
              "match_confidence": match_confidence,
              "span_corruption_variant": bool(span_corruption_variant), "use_cache": use_cache,
              "train_corpus": train_corpus, "valid_corpus": valid_corpus}
  report = _report(model, model_dir, mesh, settings, data, evaluated, split_config, {
      "extraction": extraction,
      "train_sample": train_sample,
      "per_document": per_document,
      "decoding": {k: v.as_dict() for k, v in decode_stats.items()},
      "throughput": throughput,
      "canaries": canary_results,
      "canary_format": canary_fmt.as_dict() if canary_fmt else None,
      "canary_space_size": canary_fmt.space_size if canary_fmt else None,
      "canary_scoring": canary_scoring if canaries else None,
      "audit": audit_result,
      "warnings": warnings,
  }, t_start)
  return write_report(report, output_dir, log)


def _checked_settings(*, model_dir, train_corpus, valid_corpus, output_dir, prompt_length: int,
                      generation_length: int, batch_size: int, beam_size: int, beam_alpha: float, use_cache: bool,
                      seed: int, approximate_threshold: float, match_confidence: float, train_sample_size,
                      max_examples_per_split: Optional[int], split_config, audit: Optional[str],
                      audit_guesses: Optional[int], audit_delta: Optional[float],
                      audit_bootstrap_samples: int) -> memorization.ExtractionConfig:
  """Checks the settings before the checkpoint is read; returns the extraction's configuration."""
  for macro, value in (("MODEL_DIR", model_dir), ("TRAIN_CORPUS", train_corpus), ("VALID_CORPUS", valid_corpus),
                       ("OUTPUT_DIR", output_dir)):
    if not isinstance(value, str) or not value:
      raise ConfigError(f"{macro} is required: pass --gin.{macro}=... (see --help)")
  cfg = memorization.ExtractionConfig(prompt_length=prompt_length, generation_length=generation_length,
                                      batch_size=batch_size, beam_size=beam_size, beam_alpha=beam_alpha,
                                      use_cache=use_cache, seed=seed, approximate_threshold=approximate_threshold,
                                      confidence=match_confidence).validate()
  if isinstance(train_sample_size, bool) or not isinstance(train_sample_size, int) or train_sample_size < 0:
    raise ConfigError(f"train_sample_size must be an integer >= 0 (0: no training sample), got {train_sample_size!r}")
  if max_examples_per_split is not None and max_examples_per_split < 1:
    raise ConfigError(f"max_examples_per_split must be positive or None, got {max_examples_per_split}")
  if not isinstance(split_config, SplitConfig):
    raise ConfigError(f"split_config must be a SplitConfig (@SplitConfig()), got {split_config!r}")
  split_config.validate()
  if audit:  # a bad record, k, δ or bootstrap count is refused before the long passes
    audit_lib.check_settings(audit_lib.load_record(audit).num_canaries, audit_guesses, audit_delta,
                             audit_bootstrap_samples)
  check_output_file(os.path.join(output_dir, "report.json"), "OUTPUT_DIR")
  return cfg


def _model_on_mesh(model_dir: str, step: Optional[int], vocab_path: Optional[str], mesh_shape: Sequence[int],
                   parameter_sharding: str, batch_size: int, log: Callable[[str], None]) -> Tuple["LoadedModel", Any]:
  """(model, mesh): the checkpoint loaded and its parameters placed on the decoding mesh, logged."""
  rules = sharding.axis_rules(parameter_sharding)
  mesh = sharding.create_mesh(mesh_shape)
  model = load_model(model_dir, step, vocab_path, log)
  model.inference = memorization.make_inference(model.params, model.model_config, mesh, rules)
  data_size, model_size = sharding.mesh_shape_of(mesh)
  log(f"[memorization] decoding on {mesh.devices.size} device(s) of {jax.device_count()}: mesh (data "
      f"{data_size}, model {model_size}), global batch {model.inference.global_batch_size(batch_size)}")
  if mesh.devices.size < jax.device_count():
    log(f"[memorization] warning: mesh_shape {tuple(mesh_shape)} uses {mesh.devices.size} of the "
        f"{jax.device_count()} devices; the others stay idle (mesh_shape=(-1, 1) uses them all)")
  return model, mesh


def _audit(model: "LoadedModel", audit: str, canary_scoring: str, confidence: float, guesses_per_side: Optional[int],
           delta: Optional[float], batch_size: int, bootstrap_samples: int, warnings: List[str],
           log: Callable[[str], None]) -> dict:
  """The one-run privacy audit of the audit canaries; its failure, excess or saturation added to `warnings`."""
  audit_result = evaluate_audit(model, audit, canary_scoring, confidence=confidence,
                                guesses_per_side=guesses_per_side, delta=delta,
                                batch_size=batch_size, bootstrap_samples=bootstrap_samples, log=log)
  if audit_result["violation"]:
    warnings.append("PRIVACY AUDIT FAILED: " + audit_lib.audit_failure_text(audit_result))
  elif audit_result["fdp_exceeds_ledger"]:
    warnings.append("privacy audit: " + audit_lib.fdp_note(audit_result))
  if audit_result["saturation"]:
    warnings.append(f"privacy audit saturated: {audit_result['saturation']}")
  return audit_result


def _logged_throughput(decode_stats: dict, log: Callable[[str], None]) -> dict:
  """The decoding throughput of the run, logged."""
  throughput = memorization.summarize_decode_stats(decode_stats)
  log(f"[memorization] decoding: {throughput['tokens_per_second_steady']:.0f} tokens/s, "
      f"{throughput['prompts_per_second']:.1f} prompts/s ({throughput['generated_tokens']} tokens in "
      f"{throughput['seconds']:.1f} s)")
  return throughput


def _report(model: "LoadedModel", model_dir: str, mesh, settings: dict, data: "SplitData", evaluated: dict,
            split_config: SplitConfig, results: dict, t_start: float) -> dict:
  """The report: the checkpoint, its privacy, the mesh and settings, the splits, the `results`, the time taken."""
  data_size, model_size = sharding.mesh_shape_of(mesh)
  return {
      "checkpoint": {"model_dir": model.info.get("model_dir", model_dir), "step": model.info.get("step"),
                     "vocab_path": os.path.abspath(model.vocab_path), "objective": model.objective,
                     "model_config": dataclasses.asdict(model.model_config)},
      "privacy_report": model.privacy_report,
      "epsilon": (model.privacy_report or {}).get("epsilon"),
      "epsilon_text": model.eps_text,
      "devices": int(mesh.devices.size),
      "mesh_shape": [data_size, model_size],
      "settings": settings,
      "splits": {"file": data.split_path, "reused": data.reused, "sizes": data.sizes, "evaluated": evaluated,
                 "config": split_config.key_fields(), "stats": data.splits.stats},
      **results,
      "wall_seconds": round(time.time() - t_start, 2),
  }


@dataclasses.dataclass
class LoadedModel:
  """A checkpoint ready for the memorization measurements."""
  params: Any
  model_config: Any
  info: dict
  vocab: Any
  vocab_path: str
  objective: Optional[str]
  privacy_report: Optional[dict]
  eps_text: str
  inference: Any = None  # the parameters on the mesh (`memorization.make_inference`)


@dataclasses.dataclass
class SplitData:
  """The four splits built (or reused) from the corpora, and what the evaluation reads of them."""
  splits: Any
  split_path: str
  reused: bool
  sizes: dict
  corpora: dict  # "train" / "valid" -> corpus spec
  lengths: dict  # "train" / "valid" -> uint32 [documents]: token count of each document
  text_field: str = "text"


def load_model(model_dir: str, step: Optional[int], vocab_path: Optional[str],
               log: Callable[[str], None] = print) -> LoadedModel:
  """The checkpoint, its vocabulary (the recorded one unless `vocab_path`) and its privacy ledger."""
  params, model_config, info = checkpoint_read.restore_for_inference(model_dir, step)
  recorded_vocab = info.get("vocab_path")
  if vocab_path is None:
    if not recorded_vocab:
      raise CheckpointError(f"checkpoint in {model_dir} records no vocabulary; set --gin.VOCAB_PATH")
    if not os.path.isfile(recorded_vocab):
      raise DataError(f"the checkpoint's vocabulary {recorded_vocab} is missing; set --gin.VOCAB_PATH")
    vocab_path = recorded_vocab
  elif recorded_vocab and os.path.isfile(recorded_vocab) and os.path.isfile(vocab_path) and \
      file_sha256(vocab_path) != file_sha256(recorded_vocab):
    raise CheckpointError(f"vocabulary {vocab_path} differs from the one the checkpoint was trained with "
                          f"({recorded_vocab}); token ids would not match")
  vocab = vocabulary.load_vocabulary(vocab_path)
  memorization.check_model_matches(params, model_config, vocab.vocab_size)
  objective = _objective_of(info, model_dir)
  privacy_report = info.get("privacy_report")
  eps_text = report_lib.epsilon_text(privacy_report)
  log(f"[memorization] checkpoint {info.get('model_dir', model_dir)} step {info.get('step')}: {eps_text}; "
      f"objective {objective or 'unknown'}")
  return LoadedModel(params=params, model_config=model_config, info=info, vocab=vocab, vocab_path=vocab_path,
                     objective=objective, privacy_report=privacy_report, eps_text=eps_text)


_ENCODE_BATCH = 256


def scan_corpus(spec: str, vocab, text_field: str) -> Tuple[str, np.ndarray]:
  """(`split_files.corpus_fingerprint`, token count of each document) in one streaming pass."""
  fingerprint, lengths, batch = hashlib.sha256(), array.array("I"), []

  def encode():
    lengths.extend(len(ids) for ids in vocab.tokenizer.encode(batch))
    batch.clear()

  for d in corpora.iter_documents(spec, text_field=text_field):
    fingerprint.update(d.id.encode("utf-8") + b"\0" + d.text.encode("utf-8") + b"\1")
    batch.append(d.text)
    if len(batch) >= _ENCODE_BATCH:
      encode()
  if batch:
    encode()
  return fingerprint.hexdigest(), np.frombuffer(lengths, dtype=np.uint32)


def read_documents_by_number(spec: str, numbers, text_field: str) -> Dict[int, Any]:
  """The documents of `spec` whose 0-based numbers are in `numbers`, in one streaming pass that
  stops after the last one."""
  wanted, found = set(int(i) for i in numbers), {}
  if not wanted:
    return found
  last = max(wanted)
  for i, d in enumerate(corpora.iter_documents(spec, text_field=text_field, allow_empty=True)):
    if i in wanted:
      found[i] = d
    if i >= last:
      break
  return found


def build_splits(model: LoadedModel, train_corpus: str, valid_corpus: str, output_dir: str,
                 split_config: SplitConfig, text_field: str, warnings: List[str],
                 log: Callable[[str], None] = print) -> SplitData:
  """Builds (or reuses) the four splits of Lee et al., streaming the corpora.

  One pass over each corpus computes its key (`split_files.corpus_fingerprint`) and every document's
  token count; the split file of that key is read if it exists, else built
  (`split_search.build_splits_streaming`, a second pass). Memory: 4 bytes of token count and a flag a
  document. With several JAX processes the split file is built once: process 0 builds and writes
  it (atomically), the others wait at a barrier and then read it (on a file system that they do
  not share with process 0 they find no file and build the same splits themselves).
  """
  sp = model.vocab.tokenizer
  tokenizer_id = file_sha256(model.vocab_path)
  (train_fp, train_lengths), (valid_fp, valid_lengths) = (
      scan_corpus(spec, model.vocab, text_field) for spec in (train_corpus, valid_corpus))
  log(f"[memorization] {len(train_lengths)} training and {len(valid_lengths)} validation documents")
  key = split_files.splits_key_from_fingerprints(train_fp, valid_fp, split_config, tokenizer_id)
  path = split_files.split_file_path(output_dir, key)

  def load_or_build():
    splits = split_files.load_split_file(path, key, verbose=True)
    if splits is not None:
      return splits, path, True
    docs = lambda spec: corpora.iter_documents(spec, text_field=text_field)
    splits = split_search.build_splits_streaming(docs(train_corpus), docs(valid_corpus), split_config,
                                               tokenize=lambda text: sp.encode(text), verbose=True)
    split_files.write_split_file(path, splits, key, split_config, tokenizer_id,
                                {"train": train_corpus, "valid": valid_corpus})
    return splits, path, False

  if jax.process_count() == 1:
    splits, split_path, reused = load_or_build()
  else:
    if jax.process_index() == 0:
      splits, split_path, reused = load_or_build()
    multihost_utils.sync_global_devices("private_t5 memorization splits written")
    if jax.process_index() != 0:
      splits, split_path, reused = load_or_build()
      if not reused:
        log(f"[memorization] warning: process {jax.process_index()} found no split file {split_path} "
            "written by process 0 (OUTPUT_DIR not shared?) and built the splits itself")
  if (len(splits.train_dup), len(splits.valid_dup)) != (len(train_lengths), len(valid_lengths)):
    raise DataError(f"split file {split_path} has {len(splits.train_dup)} + {len(splits.valid_dup)} documents, "
                    f"the corpora {len(train_lengths)} + {len(valid_lengths)}: remove it to rebuild it")
  sizes = splits.sizes()
  log(f"[memorization] splits {'reused from' if reused else 'written to'} {split_path}: "
      + ", ".join(f"{k} {v}" for k, v in sizes.items()))
  for w in check_nonempty(splits):
    warnings.append(w + ": its metrics are empty, the rest of the report is still produced")
    log(f"[memorization] warning: {warnings[-1]}")
  return SplitData(splits=splits, split_path=split_path, reused=reused, sizes=sizes,
                   corpora={"train": train_corpus, "valid": valid_corpus},
                   lengths={"train": train_lengths, "valid": valid_lengths}, text_field=text_field)


def _selected(positions: np.ndarray, k: Optional[int], seed: int) -> np.ndarray:
  """`memorization.subsample`'s rows of `positions`: up to k, seeded, in corpus order."""
  if k is None or len(positions) <= k:
    return positions
  return positions[np.sort(np.random.default_rng(seed).choice(len(positions), size=k, replace=False))]


def evaluate_extraction(model: LoadedModel, data: SplitData, cfg, *, max_examples_per_split: Optional[int],
                        span_corruption: bool, warnings: List[str], log: Callable[[str], None] = print):
  """Extraction metrics per split and decoding method: (extraction, decode_stats, evaluated, per_document).

  per_document[method][split] = {"ids": the evaluated documents, "exact": 1 where the
  generation reproduced the document's continuation exactly, else 0}, in the same order.

  Every document of a split is checked for length (from the token counts; the skipped ones are
  counted), then up to MAX_EXAMPLES_PER_SPLIT of the long-enough ones are chosen, and only
  those are read back from the corpus (one streaming pass a corpus) and tokenized.
  """
  methods = [memorization.GREEDY] + ([memorization.BEAM] if cfg.beam_size > 0 else [])
  variants = [(m, "prefix") for m in methods] + ([(memorization.GREEDY, "span_corruption")]
                                                 if span_corruption else [])
  raw, _ = objectives.span_corruption_lengths(cfg.prompt_length, cfg.noise_density, cfg.mean_noise_span_length)
  min_length = {"prefix": cfg.prompt_length + cfg.generation_length, "span_corruption": raw}
  plan = {}  # (split, variant) -> (split size, eligible count, chosen positions in the split, document numbers)
  for k, name in enumerate(SPLIT_NAMES):
    numbers = data.splits.indices(name)
    lengths = data.lengths["train" if name.startswith("train") else "valid"][numbers]
    for variant in {v for _, v in variants}:
      eligible = np.flatnonzero(lengths >= min_length[variant])
      chosen = _selected(eligible, max_examples_per_split, cfg.seed + k)
      plan[(name, variant)] = (len(numbers), len(eligible), chosen, numbers[chosen])
  docs = {}
  for corpus in ("train", "valid"):
    wanted = np.unique(np.concatenate([np.zeros(0, np.int64)] + [
        v[3] for (name, _), v in plan.items() if name.startswith(corpus)]))
    found = read_documents_by_number(data.corpora[corpus], wanted, data.text_field)
    if len(found) != len(wanted):
      raise DataError(f"corpus {data.corpora[corpus]} changed while it was evaluated")
    docs.update({(corpus, i): d for i, d in found.items()})
  extraction, decode_stats, evaluated, per_document = {}, {}, {}, {}
  for name in SPLIT_NAMES:
    corpus = "train" if name.startswith("train") else "valid"
    for method, variant in variants:
      size, eligible, chosen, numbers = plan[(name, variant)]
      chosen_docs = [docs[(corpus, int(i))] for i in numbers]
      ids = [d.id for d in chosen_docs]
      tokens = memorization.tokenize_documents(model.vocab, [d.text for d in chosen_docs])
      if variant == "prefix":
        examples = memorization.prefix_examples(ids, tokens, cfg)
      else:
        examples = memorization.span_corruption_examples(ids, tokens, cfg, model.vocab.vocab_size,
                                                         positions=chosen.tolist())
      examples.skipped = size - eligible
      if size and not eligible:
        warnings.append(f"split {name!r}: all {size} documents are shorter than the "
                        f"{'prompt + generation length' if variant == 'prefix' else 'span-corruption window'}")
        log(f"[memorization] warning: {warnings[-1]}")
      evaluated[name] = len(examples.ids)
      label = f"{name} {variant}"
      metrics, stats, preds = memorization.evaluate_split(model.params, model.model_config, examples, cfg,
                                                          method=method, label=label, inference=model.inference)
      key = method if variant == "prefix" else f"{variant}_{method}"
      extraction.setdefault(key, {})[name] = metrics.as_dict()
      exact = extraction_metrics.exact_matches(list(preds), examples.targets)
      approximate = extraction_metrics.approximate_matches(list(preds), examples.targets, cfg.approximate_threshold)
      per_document.setdefault(key, {})[name] = {"ids": list(examples.ids), "exact": [int(e) for e in exact],
                                                "approximate": [int(a) for a in approximate]}
      decode_stats[f"{key}/{name}"] = stats
      log(f"[memorization] {name:<15} {key:<22} n={metrics.n:<5} skipped={metrics.skipped:<5} "
          f"EM={100 * metrics.exact_match:.2f}% TA={100 * metrics.token_accuracy:.2f}% "
          f"MED={metrics.median_edit_distance:g} approx={100 * metrics.approximate_match:.2f}%  ({model.eps_text})")
  for key, per_split in extraction.items():
    per_split["overall"] = extraction_metrics.pool([per_split[name] for name in SPLIT_NAMES if name in per_split],
                                                   cfg.confidence)
  return extraction, decode_stats, evaluated, per_document


TRAIN_SAMPLE = "train_sample"
_SAMPLE_CHUNK_BATCHES = 16  # global batches of prompts read, tokenized and decoded together


def sample_documents(lengths: np.ndarray, min_length: int, size: int, seed: int) -> Tuple[np.ndarray, int]:
  """(document numbers, in corpus order, of `size` documents drawn uniformly without replacement
  from those with >= `min_length` tokens; how many have that many): all of them when fewer."""
  eligible = np.flatnonzero(np.asarray(lengths) >= min_length)
  if len(eligible) <= size:
    return eligible, len(eligible)
  rows = np.random.default_rng([seed, len(SPLIT_NAMES)]).choice(len(eligible), size=size, replace=False)
  return eligible[np.sort(rows)], len(eligible)


def iter_documents_by_number(spec: str, numbers: np.ndarray, text_field: str) -> Iterator[Any]:
  """The documents of `spec` whose 0-based numbers are `numbers` (sorted), in one streaming pass that
  stops after the last one (the numbering of `read_documents_by_number`)."""
  numbers = np.asarray(numbers)
  if not len(numbers):
    return
  k = 0
  for i, d in enumerate(corpora.iter_documents(spec, text_field=text_field, allow_empty=True)):
    if i == numbers[k]:
      yield d
      k += 1
      if k == len(numbers):
        return
  raise DataError(f"corpus {spec} changed while it was evaluated")


def iter_prefix_chunks(vocab, documents: Iterable[Any], cfg, chunk_size: int) -> Iterator[Any]:
  """`memorization.prefix_examples` of `documents`, `chunk_size` documents at a time."""
  batch = []
  for d in documents:
    batch.append(d)
    if len(batch) == chunk_size:
      yield memorization.prefix_examples([x.id for x in batch], memorization.tokenize_documents(
          vocab, [x.text for x in batch]), cfg)
      batch = []
  if batch:
    yield memorization.prefix_examples([x.id for x in batch], memorization.tokenize_documents(
        vocab, [x.text for x in batch]), cfg)


def evaluate_train_sample(model: LoadedModel, data: SplitData, cfg, size: int, extraction: dict,
                          decode_stats: dict, per_document: dict, warnings: List[str],
                          log: Callable[[str], None] = print) -> dict:
  """Extraction on `size` training documents drawn uniformly (seeded) from those with >= P + T tokens.

  The documents are streamed from the training corpus, tokenized and decoded a chunk of
  `_SAMPLE_CHUNK_BATCHES` global batches at a time (`memorization.evaluate_streaming`, the
  splits' decoding path), so neither the corpus nor all prompts are held. Adds the
  "train_sample" group to `extraction`, `decode_stats` and `per_document` for each prefix
  decoding method; returns the sample's description.
  """
  min_length = cfg.prompt_length + cfg.generation_length
  lengths = data.lengths["train"]
  numbers, eligible = sample_documents(lengths, min_length, size, cfg.seed)
  if eligible < size:
    warnings.append(f"{TRAIN_SAMPLE}: only {eligible} of the {len(lengths)} training documents have the "
                    f"{min_length} tokens of prompt + generation (asked {size}); all of them are evaluated")
    log(f"[memorization] warning: {warnings[-1]}")
  chunk_size = _SAMPLE_CHUNK_BATCHES * model.inference.global_batch_size(cfg.batch_size)
  methods = [memorization.GREEDY] + ([memorization.BEAM] if cfg.beam_size > 0 else [])
  for method in methods:
    chunks = iter_prefix_chunks(model.vocab, iter_documents_by_number(data.corpora["train"], numbers,
                                                                      data.text_field), cfg, chunk_size)
    metrics, stats, ids, exact, approximate = memorization.evaluate_streaming(
        model.params, model.model_config, chunks, cfg, method=method, label=TRAIN_SAMPLE, total=len(numbers),
        skipped=len(lengths) - eligible, inference=model.inference)
    if len(ids) != len(numbers):
      raise DataError(f"corpus {data.corpora['train']} changed while it was evaluated")
    extraction.setdefault(method, {})[TRAIN_SAMPLE] = metrics.as_dict()
    decode_stats[f"{method}/{TRAIN_SAMPLE}"] = stats
    per_document.setdefault(method, {})[TRAIN_SAMPLE] = {"ids": ids, "exact": [int(e) for e in exact],
                                                         "approximate": [int(a) for a in approximate]}
    log(f"[memorization] {TRAIN_SAMPLE:<15} {method:<22} n={metrics.n:<5} EM={100 * metrics.exact_match:.2f}% "
        f"approx={100 * metrics.approximate_match:.2f}% TA={100 * metrics.token_accuracy:.2f}% "
        f"{stats.prompts_per_second:.1f} prompts/s  ({model.eps_text})")
  return {"size": size, "eligible": eligible, "evaluated": len(numbers), "documents": len(lengths),
          "min_length": min_length, "seed": cfg.seed}


def evaluate_canaries(model: LoadedModel, canaries: str, scoring: str, *, max_exact: int, num_samples: int,
                      batch_size: int, seed: int, log: Callable[[str], None] = print):
  """The exposure of each recorded canary: (canary format, results as dicts)."""
  canary_fmt, canary_list = canaries_lib.load_canaries(canaries)
  encoder = exposure.CandidateEncoder(model.vocab, canary_fmt, scoring)
  evaluator = exposure.ExposureEvaluator(
      memorization.make_scorer(model.params, model.model_config, model.inference), encoder, batch_size=batch_size,
      max_exact=max_exact, num_samples=num_samples, seed=seed,
      progress=progress_lib.callback("canary candidates", "candidates"))
  results = [r.as_dict() for r in evaluator.evaluate(canary_list)]
  # Extraction (Carlini et al. 2019): the model's greedy continuation of the canaries' common prefix,
  # decoded once on the mesh; a canary whose secret it is was extracted from the prefix alone.
  generated = model.inference.decode(encoder.encoder_input[None], encoder.target_width(), batch_size=1)[0]
  for r, extracted in zip(results, encoder.extracted(generated, [c.secret for c in canary_list])):
    r["extracted"] = extracted
  for r in results:
    log(f"[memorization] canary {r['id']} x{r['repetitions']}: rank {r['rank']:.4g}, exposure "
        f"{r['exposure']:.2f} / {r['max_exposure']:.2f} bits ({r['method']})"
        + ("; extracted by greedy decoding of the prefix" if r["extracted"] else ""))
  return canary_fmt, results


def evaluate_audit(model: LoadedModel, record: str, scoring: str, *, confidence: float,
                   guesses_per_side: Optional[int], delta: Optional[float], batch_size: int,
                   bootstrap_samples: int = audit_lib.BOOTSTRAP_SAMPLES,
                   log: Callable[[str], None] = print) -> dict:
  """The one-run privacy audit of the checkpoint on the audit canaries of `record` (eval/audit.py)."""
  targets = (model.info.get("feature_lengths") or {}).get("targets")
  return audit_lib.run_audit(memorization.make_scorer(model.params, model.model_config, model.inference),
                             model.vocab, record,
                             scoring=scoring, privacy_report=model.privacy_report, confidence=confidence,
                             guesses_per_side=guesses_per_side, delta=delta, batch_size=batch_size,
                             max_target_tokens=int(targets) - 1 if targets else None,
                             bootstrap_samples=bootstrap_samples, log=log)


def write_report(report: dict, output_dir: str, log: Callable[[str], None] = print) -> dict:
  """Writes report.json, report.md and the plots to `output_dir`; returns the report."""
  if jax.process_index() != 0:  # several processes: the report is written once
    return report
  paths = report_lib.write_report(report, output_dir)
  log(f"[memorization] wrote {', '.join(paths)} in {report['wall_seconds']:.1f} s")
  return report
