"""The memorization findings of Ponomareva et al. 2022 end to end: data, vocabularies, models, results.

Phases (each logs one line when it starts, and each is skipped when its result exists, so a
re-run resumes):
  1. data: train / validation documents, and a training corpus in which a fraction of the
     training documents is repeated r times (r cycles through 2, 5, 10 by default);
  2. vocabularies: a SentencePiece vocabulary and a DP-SentencePiece one, both of the training corpus;
  3. for each model (`nondp_prefix`, `nondp_span`, `dp_prefix`, `fulldp_prefix`, optionally
     `dp_span`): training with the same model, steps and data (`train_model`), then the
     memorization stage (the four splits, greedy EM / TA / MED and the approximate-match rate, and
     with `audit_canaries` > 0 the one-run privacy audit) and teacher-forced validation token accuracy;
  4. results.json, results.md (Table-3-like and Table-2-like tables) and figure.png.

Each training run is the caller's `train_model(model_dir, gin_bindings) -> summary`
(`private-t5 study` passes one that runs the Gin-configured `train`).
"""
import dataclasses
import json
import logging
import math
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

from private_t5 import io as io_lib
from private_t5.data import corpora
from private_t5.data import duplication
from private_t5.dp import privacy_report
from private_t5.errors import ConfigError, PrivacyError
from private_t5.eval import audit
from private_t5.eval import memorization_run
from private_t5.eval import study_report
from private_t5.eval.split_types import SPLIT_NAMES, SplitConfig
from private_t5.tokenizer import dp_spm
from private_t5.tokenizer import spm

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """One model of the study: its objective, whether it trains with DP, and its vocabulary."""
  objective: str
  private: bool
  vocabulary: str  # "spm" (non-private SentencePiece) or "dp_spm"


MODELS = {
    "nondp_prefix": ModelSpec("prefix_lm", False, "spm"),
    "nondp_span": ModelSpec("span_corruption", False, "spm"),
    "dp_prefix": ModelSpec("prefix_lm", True, "spm"),
    "fulldp_prefix": ModelSpec("prefix_lm", True, "dp_spm"),
    "dp_span": ModelSpec("span_corruption", True, "spm"),
    "fulldp_span": ModelSpec("span_corruption", True, "dp_spm"),
}
DEFAULT_MODELS = ("nondp_prefix", "nondp_span", "dp_prefix", "fulldp_prefix")
RESULT_FILE = "result.json"
# The audit figures a model's entry keeps of its memorization report's "audit" (eval/audit.run_audit).
AUDIT_RESULT_KEYS = (
    "epsilon_lower_bound", "max_lower_bound", "epsilon_lower_bound_fdp", "max_lower_bound_fdp", "method",
    "method_fdp", "tpr_at_fpr", "auroc", "auroc_interval", "saturated", "saturation", "steinke", "confidence",
    "num_canaries", "num_included", "num_held_out", "guesses", "correct", "ledger_epsilon", "delta", "violation",
    "fdp_exceeds_ledger", "comparable_with_ledger", "repetitions", "canary_kind", "by_kind")
# Extraction groups beyond the four splits kept when the report has them: a uniform sample of the
# training documents (the 50/50 protocol) and the four splits pooled.
EXTRA_GROUPS = ("train_sample", "overall")
# A model's result keys computed from the private validation documents without DP.
NOT_DP_RESULT_KEYS = ("validation_token_accuracy", "validation_loss")
# The data phase holds its documents in memory (Python objects, ~1 KB a short document: see
# docs/scaling.md): a study trains several models on a small corpus, and refuses a larger one.
MAX_DOCUMENTS = 1_000_000
# The audit canary kinds a study plants (`audit.KINDS` less those drawn from a vocabulary).
STUDY_CANARY_KINDS = tuple(k for k in audit.KINDS if k not in audit.VOCAB_KINDS)


def _nan_to_none(value):
  if isinstance(value, float) and math.isnan(value):
    return None
  return value


def _interval(values) -> Optional[List[Optional[float]]]:
  return None if values is None else [_nan_to_none(float(v)) for v in values]


def _split_result(metrics: dict) -> dict:
  """{"em", "ta", "med", "n"} of a split, and when the report has them the approximate-match rate
  "am" and the Clopper-Pearson intervals "em_ci" and "am_ci" (None for NaN)."""
  out = {"em": _nan_to_none(metrics["exact_match"]), "ta": _nan_to_none(metrics["token_accuracy"]),
         "med": _nan_to_none(metrics["median_edit_distance"]), "n": int(metrics["n"])}
  if "approximate_match" in metrics:
    out["am"] = _nan_to_none(metrics["approximate_match"])
  for key, name in (("exact_match_ci", "em_ci"), ("approximate_match_ci", "am_ci")):
    if key in metrics:
      out[name] = _interval(metrics[key])
  return out


def em_by_repetitions(per_document: dict, repeated: Dict[str, int]) -> Dict[str, dict]:
  """Greedy EM of the evaluated train-dup documents, grouped by how often the study repeated them.

  A document and its planted copies share their prompt, so each original document counts once
  (extracted if any of its evaluated occurrences was). Group "natural": documents the split
  detection flagged as duplicates that the study did not repeat. {group: {"em", "n"}}.
  """
  outcome: Dict[str, int] = {}
  for doc_id, exact in zip(per_document.get("ids", []), per_document.get("exact", [])):
    original = duplication.original_id(doc_id)
    outcome[original] = max(outcome.get(original, 0), int(exact))
  groups: Dict[str, List[int]] = {}
  for original, exact in outcome.items():
    groups.setdefault(str(repeated[original]) if original in repeated else "natural", []).append(exact)
  order = sorted((g for g in groups if g != "natural"), key=int) + (["natural"] if "natural" in groups else [])
  return {g: {"em": sum(groups[g]) / len(groups[g]), "n": len(groups[g])} for g in order}


def model_result(name: str, spec: ModelSpec, summary: dict, report: dict, wall: Dict[str, float],
                 repeated: Optional[Dict[str, int]] = None) -> dict:
  """One model's entry of results.json from its training summary and memorization report."""
  check_private(name, spec, summary)
  validation = summary.get("validation_not_dp") or summary.get("validation") or {}
  greedy = report["extraction"]["greedy"]
  result = {"objective": spec.objective, "private": spec.private, "vocabulary": spec.vocabulary,
            "training_epsilon": summary.get("training_epsilon"), "training_delta": summary.get("training_delta"),
            "validation_token_accuracy": validation.get("token_accuracy"),
            "validation_loss": validation.get("loss"),
            "splits": {s: _split_result(greedy[s]) for s in SPLIT_NAMES},
            "final_step": summary.get("final_step"), "wall_seconds": wall,
            # Held-out documents of the private corpus: their metrics are outside any guarantee.
            "not_dp": list(NOT_DP_RESULT_KEYS)}
  groups = {g: _split_result(greedy[g]) for g in EXTRA_GROUPS if greedy.get(g)}
  if groups:
    result["groups"] = groups
  threshold = greedy[SPLIT_NAMES[0]].get("approximate_threshold")
  if threshold is not None:
    result["approximate_threshold"] = threshold
  if report.get("audit"):
    result["audit"] = {k: report["audit"].get(k) for k in AUDIT_RESULT_KEYS}
  per_document = report.get("per_document", {}).get("greedy", {}).get("train_dup")
  if per_document is not None and repeated is not None:
    result["train_dup_by_repetitions"] = em_by_repetitions(per_document, repeated)
  result.update(privacy_fields(spec, summary))
  return result


def privacy_fields(spec: ModelSpec, summary: dict) -> dict:
  """A model's "epsilon", "delta", "epsilon_scope" as the study's tables state them.

  A DP vocabulary's ε is composed in ("training + vocabulary"); with a non-private vocabulary
  the ledger's total is ∞ and the training guarantee alone is reported, as the paper's "DP
  training" rows ("training only"). Non-private models: None.
  """
  if not spec.private:
    return {"epsilon": None, "delta": None, "epsilon_scope": None}
  if summary.get("epsilon") is not None:
    return {"epsilon": summary["epsilon"], "delta": summary["delta"], "epsilon_scope": "training + vocabulary"}
  return {"epsilon": summary["training_epsilon"], "delta": summary["training_delta"],
          "epsilon_scope": "training only (vocabulary not private)"}


def check_private(name: str, spec: ModelSpec, summary: dict) -> None:
  """PrivacyError / ConfigError when a run's privacy is not what the study asked for."""
  if spec.private and not summary.get("private"):
    raise PrivacyError(f"model {name} should train with DP but its run was not private (is DP=None set?)")
  if not spec.private and summary.get("private"):
    raise ConfigError(f"model {name} should train without DP but its run was private")


def pretraining_bindings(run_dir: str, data: dict, vocab_path: str, objective: str, private: bool,
                         output_dir: str) -> List[str]:
  """The Gin bindings the study sets for one training run on its own data (the rest is the Gin files')."""
  bindings = [f"MODEL_DIR={run_dir!r}", f"CORPUS={data['train']!r}", f"VALID_CORPUS={data['valid']!r}",
              f"VOCAB_PATH={vocab_path!r}", f"OBJECTIVE={objective!r}",
              f"DATA_CACHE_DIR={os.path.join(output_dir, 'cache')!r}"]
  return bindings + ([] if private else ["DP=None"])


def cached_json(path: str, compute: Callable[[], dict], what: str) -> dict:
  """The JSON at `path` when a finished run wrote it (resume), else `compute()` written there atomically."""
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      logger.info("[study] %s: reusing %s", what, path)
      return json.load(f)
  result = compute()
  io_lib.write_json_atomic(path, result)
  return result


def check_audit_canary_kind(kind) -> str:
  """The study's audit canary kind: "words", "rare_words" or both, "words,rare_words" (each kind
  audited alone too); ConfigError otherwise.

  The canaries are planted in phase 1, before phase 2 trains the vocabularies on the corpus
  that holds them, so the kinds drawn from a SentencePiece vocabulary (`audit.VOCAB_KINDS`)
  have none to draw from.
  """
  try:
    parts = audit.parse_kinds(kind)
  except ConfigError:
    parts = ()
  vocabulary = [p for p in parts if p in audit.VOCAB_KINDS]
  if vocabulary:
    raise ConfigError(f"audit_canary_kind {vocabulary[0]!r} needs a SentencePiece vocabulary, which the study trains "
                      f"after planting the canaries; use one of {', '.join(STUDY_CANARY_KINDS)}")
  if not parts or any(p not in STUDY_CANARY_KINDS for p in parts):
    raise ConfigError(f"audit_canary_kind must be one of {', '.join(STUDY_CANARY_KINDS)} (or both, joined by a "
                      f"comma), got {kind!r}")
  return ",".join(parts)


def prepare_data(corpus: str, output_dir: str, dup_cfg, text_field: str = "text", audit_canaries: int = 0,
                 audit_canary_kind: str = "words") -> dict:
  """Phase 1: writes data/train.jsonl.gz, data/valid.jsonl.gz and data/duplication.json (reused).

  The documents are held in memory: at most `MAX_DOCUMENTS` (`dup_cfg.max_documents` above it,
  or a longer corpus without it, is a ConfigError before anything is written).

  With `audit_canaries` = m > 0, m audit canaries (eval/audit.py) of `audit_canary_kind` are
  planted in the training corpus, each once with probability 1/2, and their secret record goes to
  data/train.audit.json.
  """
  check_audit_canary_kind(audit_canary_kind)
  if dup_cfg.max_documents is not None and dup_cfg.max_documents > MAX_DOCUMENTS:
    raise ConfigError(f"max_documents must be <= {MAX_DOCUMENTS:,} (a study holds its corpus in memory), "
                      f"got {dup_cfg.max_documents:,}")
  data_dir = os.path.join(output_dir, "data")
  record_path = os.path.join(data_dir, "duplication.json")
  settings = {"corpus": os.path.abspath(corpus) if os.path.exists(corpus) else corpus, **dup_cfg.as_dict()}
  if audit_canaries:
    settings["audit_canaries"] = int(audit_canaries)
    if audit_canary_kind != "words":  # the default is left out: older studies resume
      settings["audit_canary_kind"] = audit_canary_kind
  if os.path.isfile(record_path):
    with open(record_path, encoding="utf-8") as f:
      record = json.load(f)
    if record.get("settings") != settings:
      raise ConfigError(f"{output_dir} holds a study of other data settings ({record_path}); "
                        "use a new --output directory")
    logger.info("[study] data: reusing %s", data_dir)
    return record
  docs, _ = corpora.read_corpus(corpus, text_field=text_field, max_documents=dup_cfg.max_documents or MAX_DOCUMENTS + 1)
  if len(docs) > MAX_DOCUMENTS:
    raise ConfigError(f"corpus {corpus} has more than {MAX_DOCUMENTS:,} documents, which a study holds in memory; "
                      f"set max_documents (its first documents) to at most {MAX_DOCUMENTS:,}")
  study = duplication.plant_duplicates(docs, dup_cfg)
  train_path = os.path.join(data_dir, "train.jsonl.gz")
  audit_record = None
  if audit_canaries:
    _, audit_record, _, _ = audit.plant(study.train, train_path, num_canaries=int(audit_canaries),
                                        kind=audit_canary_kind, source=corpus)
  else:
    duplication.write_jsonl(train_path, study.train)
  valid_path = duplication.write_jsonl(os.path.join(data_dir, "valid.jsonl.gz"), study.valid)
  record = {"settings": settings, "train": os.path.abspath(train_path), "valid": os.path.abspath(valid_path),
            "stats": study.describe(), "repeated": study.repeated}
  if audit_record:
    record["audit_record"] = os.path.abspath(audit_record)
  io_lib.write_json_atomic(record_path, record)  # last: its presence marks the phase done
  stats = record["stats"]
  logger.info("[study] data: %d training documents (%d with copies), %d validation; %d repeated %s",
              stats["train_documents"], stats["train_documents_with_copies"], stats["valid_documents"],
              stats["repeated_documents"], stats["repeated_by_count"])
  return record


def train_vocabularies(train_corpus: str, output_dir: str, *, needed: Sequence[str], vocab_size: int,
                       dp_vocab_epsilon: float, dp_vocab_delta: float, dp_vocab_max_words: int,
                       text_field: str = "text") -> Dict[str, str]:
  """Phase 2: the SentencePiece and DP-SentencePiece vocabularies of the training corpus (reused)."""
  vocab_dir = os.path.join(output_dir, "vocab")
  paths = {"spm": os.path.join(vocab_dir, "spm.model"), "dp_spm": os.path.join(vocab_dir, "dp_spm", "dp_spm.model")}
  if "spm" in needed and not os.path.isfile(paths["spm"]):
    texts = (d.text for d in corpora.iter_documents(train_corpus, text_field=text_field))
    spm.train_from_sentences(texts, paths["spm"], vocab_size=vocab_size)
    logger.info("[study] vocabulary: SentencePiece, %d pieces: %s", vocab_size, paths["spm"])
  report_path = privacy_report.vocabulary_report_path(paths["dp_spm"])
  if "dp_spm" in needed and not (os.path.isfile(paths["dp_spm"]) and os.path.isfile(report_path)):
    report = dp_spm.train_dp_vocabulary(train_corpus, paths["dp_spm"], vocab_size=vocab_size,
                                        target_epsilon=dp_vocab_epsilon, delta=dp_vocab_delta,
                                        max_words_per_document=dp_vocab_max_words, text_field=text_field,
                                        eval_documents=0, nonprivate_baseline=False, verbose=False)
    logger.info("[study] vocabulary: DP-SentencePiece at ε = %.4g, δ = %.3g: %s",
                report["epsilon"], report["delta"], paths["dp_spm"])
  return paths


def _checked_arguments(corpus, output_dir, models: Sequence[str], train_model, split_config, audit_canary_kind: str,
                       prompt_length, generation_length, vocab_size, memorization_batch_size,
                       train_sample_size) -> SplitConfig:
  """Checks the study's arguments before anything runs; returns the near-duplicate settings (default ones if None)."""
  for name, value in (("corpus", corpus), ("output", output_dir)):
    if not isinstance(value, str) or not value:
      raise ConfigError(f"private-t5 study: missing --{name}")
  unknown = [m for m in models if m not in MODELS]
  if unknown or not models or len(set(models)) != len(models):
    raise ConfigError(f"models must be distinct names among {', '.join(MODELS)}, got {list(models)!r}")
  if train_model is None:
    raise ConfigError("run_study needs train_model (run it as `private-t5 study`)")
  split_config = split_config if split_config is not None else SplitConfig()
  if not isinstance(split_config, SplitConfig):
    raise ConfigError(f"split_config must be a SplitConfig (@SplitConfig()), got {split_config!r}")
  split_config.validate()
  check_audit_canary_kind(audit_canary_kind)
  for name, value in (("prompt_length", prompt_length), ("generation_length", generation_length),
                      ("vocab_size", vocab_size), ("memorization_batch_size", memorization_batch_size)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(f"{name} must be a positive integer, got {value!r}")
  if not isinstance(train_sample_size, int) or isinstance(train_sample_size, bool) or train_sample_size < 0:
    raise ConfigError(f"train_sample_size must be an integer >= 0 (0: no training sample), got {train_sample_size!r}")
  return split_config


def _run_model(name: str, output_dir: str, data: dict, vocabs: dict, train_model: Callable, phase, steps: int, *,
               prompt_length: int, generation_length: int, memorization_batch_size: int,
               max_examples_per_split: Optional[int], train_sample_size: int, split_config: SplitConfig,
               text_field: str, seed: int) -> dict:
  """Phase 3 for one model: trains it and measures its memorization (or reuses the result file of a former run)."""
  spec = MODELS[name]
  model_root = os.path.join(output_dir, "models", name)
  result_path = os.path.join(model_root, RESULT_FILE)
  if os.path.isfile(result_path):
    with open(result_path, encoding="utf-8") as f:
      result = json.load(f)
    next(phase), next(phase)
    logger.info("[study] %s: reusing %s", name, result_path)
    return result
  run_dir = os.path.join(model_root, "run")
  logger.info("[study] phase %d/%d: train %s (%s, %s, %s vocabulary)", next(phase), steps, name,
              spec.objective, "DP" if spec.private else "non-private", spec.vocabulary)
  t0 = time.time()
  summary = train_model(run_dir, pretraining_bindings(run_dir, data, vocabs[spec.vocabulary], spec.objective,
                                                      spec.private, output_dir))
  t1 = time.time()
  logger.info("[study] phase %d/%d: memorization of %s", next(phase), steps, name)
  report = memorization_run.run_memorization(
      model_dir=run_dir, train_corpus=data["train"], valid_corpus=data["valid"],
      output_dir=os.path.join(model_root, "memorization"), prompt_length=prompt_length,
      generation_length=generation_length, batch_size=memorization_batch_size,
      max_examples_per_split=max_examples_per_split, train_sample_size=train_sample_size,
      span_corruption_variant=False,
      split_config=split_config, text_field=text_field, seed=seed, audit=data.get("audit_record"),
      log=logger.info)
  wall = {"train": round(t1 - t0, 1), "memorization": round(time.time() - t1, 1)}
  result = model_result(name, spec, summary, report, wall, data["repeated"])
  result["privacy_unit"] = privacy_report.read_report(privacy_report.report_path(run_dir))["privacy_unit"]
  io_lib.write_json_atomic(result_path, result)
  return result


def run_study(*, corpus: Optional[str] = None, output_dir: Optional[str] = None, models: Sequence[str] = DEFAULT_MODELS,
              validation_fraction: float = 0.1, duplicate_fraction: float = 0.1,
              repetitions: Sequence[int] = (2, 5, 10), max_documents: Optional[int] = None, seed: int = 0,
              vocab_size: int = 2000, dp_vocab_epsilon: float = 3.37, dp_vocab_delta: float = 1e-8,
              dp_vocab_max_words: int = 256, prompt_length: int = 32, generation_length: int = 16,
              max_examples_per_split: Optional[int] = 500, memorization_batch_size: int = 64,
              train_sample_size: int = 0, split_config=None, text_field: str = "text", audit_canaries: int = 0,
              audit_canary_kind: str = "words", training_windows: Optional[int] = None,
              train_model: Optional[Callable[[str, List[str]], dict]] = None) -> dict:
  """Runs the study and writes results.json, results.md and figure.png to `output_dir`.

  Args:
    corpus: corpus spec (see `private_t5.data.corpora`).
    output_dir: the study's folder (data/, vocab/, models/NAME/, results.*).
    models: which of `MODELS` to train, in order.
    validation_fraction, duplicate_fraction, repetitions, max_documents, seed: the data phase
      (`private_t5.data.duplication.DuplicationConfig`).
    vocab_size: SentencePiece pieces of both vocabularies (the DP one may end up smaller).
    dp_vocab_epsilon, dp_vocab_delta, dp_vocab_max_words: the DP-SentencePiece vocabulary.
    prompt_length, generation_length: memorization prompt P and generated length T.
    max_examples_per_split: documents evaluated per memorization split.
    memorization_batch_size: prompts decoded together.
    train_sample_size: N > 0 also evaluates each model on N training documents drawn uniformly
      (seeded) from those with P + T tokens, streamed (the "train sample" group of the 50/50
      protocol, Carlini et al. 2023); 0: the four splits only.
    split_config: the near-duplicate settings (`SplitConfig`).
    text_field: JSONL/TSV field of the text.
    audit_canaries: m > 0 plants m audit canaries in the training corpus (each once, with
      probability 1/2) and reports every model's one-run privacy audit; 0: no audit.
    audit_canary_kind: the audit canaries' kind, "words" (random words of the corpus) or
      "rare_words" (random draws from its rarest words); the vocabulary kinds of `audit.KINDS`
      are refused, as the canaries are planted before the vocabularies are trained.
    training_windows: the training runs' `make_source.max_windows_per_document` (K: a draw
      trains on one of a document's first K grid windows; 1: its opening, the window the
      memorization prompts come from; None: a window anywhere), recorded and stated in results.md.
    train_model: `train_model(model_dir, gin_bindings) -> summary`, set by the command line:
      trains one model with the study's Gin files plus these bindings.
  """
  t_start = time.time()
  split_config = _checked_arguments(corpus, output_dir, models, train_model, split_config, audit_canary_kind,
                                    prompt_length, generation_length, vocab_size, memorization_batch_size,
                                    train_sample_size)
  dup_cfg = duplication.DuplicationConfig(validation_fraction=validation_fraction, fraction=duplicate_fraction,
                                          repetitions=tuple(repetitions), seed=seed,
                                          max_documents=max_documents).validate()
  output_dir = os.path.abspath(output_dir)
  steps = 2 + 2 * len(models) + 1
  phase = iter(range(1, steps + 1))

  logger.info("[study] phase %d/%d: data from %s", next(phase), steps, corpus)
  if not isinstance(audit_canaries, int) or isinstance(audit_canaries, bool) or audit_canaries < 0:
    raise ConfigError(f"audit_canaries must be a non-negative integer, got {audit_canaries!r}")
  data = prepare_data(corpus, output_dir, dup_cfg, text_field, audit_canaries, audit_canary_kind)
  logger.info("[study] phase %d/%d: vocabularies", next(phase), steps)
  t_vocab = time.time()
  vocabs = train_vocabularies(data["train"], output_dir, needed={MODELS[m].vocabulary for m in models},
                              vocab_size=vocab_size, dp_vocab_epsilon=dp_vocab_epsilon, dp_vocab_delta=dp_vocab_delta,
                              dp_vocab_max_words=dp_vocab_max_words, text_field=text_field)
  vocab_seconds = time.time() - t_vocab

  results = {}
  for name in models:
    results[name] = _run_model(
        name, output_dir, data, vocabs, train_model, phase, steps, prompt_length=prompt_length,
        generation_length=generation_length, memorization_batch_size=memorization_batch_size,
        max_examples_per_split=max_examples_per_split, train_sample_size=train_sample_size,
        split_config=split_config, text_field=text_field, seed=seed)

  logger.info("[study] phase %d/%d: results", next(phase), steps)
  out = {"models": results, "corpus": corpus, "data": data["stats"],
         "settings": {"duplication": dup_cfg.as_dict(), "vocab_size": vocab_size,
                      "dp_vocab_epsilon": dp_vocab_epsilon, "dp_vocab_delta": dp_vocab_delta,
                      "prompt_length": prompt_length, "generation_length": generation_length,
                      "max_examples_per_split": max_examples_per_split, "split_config": split_config.key_fields(),
                      "training_windows": training_windows,
                      **({"train_sample_size": train_sample_size} if train_sample_size else {}),
                      **({"audit_canaries": audit_canaries, "audit_canary_kind": audit_canary_kind}
                         if audit_canaries else {})},
         "wall_seconds": {"vocabularies": round(vocab_seconds, 1), "total_this_run": round(time.time() - t_start, 1)}}
  paths = study_report.write_results(out, output_dir)
  logger.info("[study] wrote %s in %.0f s", ", ".join(paths), time.time() - t_start)
  return out
