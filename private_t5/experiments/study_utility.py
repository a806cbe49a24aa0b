"""The utility findings of Ponomareva et al. 2022 end to end (`private-t5 study --part=utility`).

  private-t5 study --part=utility --corpus=PATH --task_dir=DIR --output=OUT [--gin.NAME=VALUE ...]

The paper's headline (Tables 1 and 2, Appendix D): DP pretraining costs pretraining accuracy,
yet fine-tuned GLUE scores stay close to the non-private model's, and DP training needs large
batches. Phases (each skipped when its result file exists, so a re-run resumes; a training run
interrupted half-way resumes from its last checkpoint):
  1. data: train / validation documents of the corpus (the memorization part's data phase,
     without planted copies);
  2. vocabularies: SentencePiece and DP-SentencePiece of the training documents;
  3. pretraining (span corruption) of `nondp_span`, `dp_span` (DP-Adafactor) and `fulldp_span`
     (DP-SentencePiece + DP-Adafactor, composed ε); `scratch` is never pretrained;
  4. fine-tuning of every model on the task, publicly (as in the paper) and with DP at
     `finetune_epsilon` over the task's training examples (a larger expected batch, untruncated
     Poisson sampling run in microbatches); each fine-tuned model's validation metric by greedy
     decoding, with a bootstrap interval over the validation examples;
  5. the batch sweep: span-corruption pretraining at several expected batch sizes, the same
     number of examples processed and σ calibrated to the same ε at each (untruncated Poisson
     sampling run in microbatches), beside non-private runs of the same batches;
  6. results.json ("utility"), results.md and figure.png.

The default Gin experiment is configs/experiments/study_utility.gin (pretraining and sweep
settings); fine-tuning runs with `finetune_gin_files` (configs/experiments/study_utility_finetune.gin).
"""
import json
import logging
import math
import os
import time
from typing import Callable, List, Optional, Sequence, Union

from private_t5 import io as io_lib
from private_t5.data import duplication
from private_t5.data import glue_registry
from private_t5.data import glue_rows
from private_t5.data import task_dir as task_dir_lib
from private_t5.errors import ConfigError
from private_t5.eval import glue_eval
from private_t5.eval import study_utility_report
from private_t5.experiments import study
from private_t5.models import checkpoint_read

logger = logging.getLogger(__name__)

SCRATCH = "scratch"
PRETRAINED = ("nondp_span", "dp_span", "fulldp_span")
DEFAULT_MODELS = PRETRAINED + (SCRATCH,)
FINETUNE_MODES = ("public", "dp")
SUMMARY_FILE = "pretrain.json"
SETTINGS_FILE = "utility_settings.json"


def _positive_int(name: str, value) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ConfigError(f"{name} must be a positive integer, got {value!r}")
  return value


def _pretrain(name: str, data: dict, vocabs: dict, output_dir: str, train_model: Callable) -> dict:
  """Phase 3 for one model: its span-corruption pretraining run and the fields the table reads."""
  spec = study.MODELS[name]
  run_dir = os.path.join(output_dir, "models", name, "run")

  def compute():
    t0 = time.time()
    summary = train_model(run_dir, study.pretraining_bindings(run_dir, data, vocabs[spec.vocabulary],
                                                              spec.objective, spec.private, output_dir))
    study.check_private(name, spec, summary)
    validation = summary.get("validation_not_dp") or summary.get("validation") or {}
    return {"private": spec.private, "vocabulary": spec.vocabulary, **study.privacy_fields(spec, summary),
            "training_epsilon": summary.get("training_epsilon"), "noise_multiplier": summary.get("noise_multiplier"),
            "pretrain_validation_token_accuracy": validation.get("token_accuracy"),
            "pretrain_validation_loss": validation.get("loss"), "run_dir": run_dir,
            "final_step": summary.get("final_step"), "wall_seconds": round(time.time() - t0, 1)}

  return study.cached_json(os.path.join(output_dir, "models", name, SUMMARY_FILE), compute, f"pretraining {name}")


def _finetune(name: str, mode: str, pretrained: Optional[dict], task: str, vocabs: dict, output_dir: str,
              finetune_model: Callable, settings: dict) -> dict:
  """Phase 4 for one model and mode: fine-tuning on the task, then its validation metric with a CI."""
  root = os.path.join(output_dir, "models", name, f"finetune_{mode}")
  run_dir = os.path.join(root, "run")

  def compute():
    t0 = time.time()
    lengths = settings["feature_lengths"]
    run = settings["dp"] if mode == "dp" else settings
    bindings = [f"MODEL_DIR={run_dir!r}", f"MIXTURE_OR_TASK_NAME={task!r}",
                f"INITIAL_CHECKPOINT={pretrained['run_dir'] if pretrained else None!r}",
                # The scratch model reads the non-private vocabulary; the others their checkpoint's.
                f"VOCAB_PATH={None if pretrained else vocabs['spm']!r}",
                f"TRAIN_STEPS={run['steps']}", f"BATCH_SIZE={run['batch_size']}",
                f"LEARNING_RATE={run['learning_rate']!r}", f"TASK_FEATURE_LENGTHS={dict(lengths)!r}"]
    if mode == "dp":
      # A separate mechanism on other data: its ledger covers the task's training examples only.
      # The vocabulary (SentencePiece or DP-SentencePiece) was built from the pretraining corpus,
      # which does not hold the task's examples: it is public for this guarantee (a DP report of
      # it covers the corpus, not the task, and is not composed). BATCH_SIZE is the expected batch
      # of untruncated Poisson sampling, run in microbatches.
      bindings += ["DP=@DPConfig()", f"DPConfig.target_epsilon={settings['epsilon']!r}",
                   "DPConfig.sampling='poisson'", "DPConfig.expected_batch_size=None",
                   f"train.microbatch_size={run['microbatch_size']}", "VOCAB_IS_PUBLIC=True"]
    else:
      bindings.append("DP=None")
    summary = finetune_model(run_dir, bindings)
    if bool(summary.get("private")) != (mode == "dp"):
      raise ConfigError(f"fine-tuning {name} ({mode}) ran {'with' if summary.get('private') else 'without'} DP")
    t1 = time.time()
    params, config, info = checkpoint_read.restore_for_inference(run_dir)
    evaluation = glue_eval.evaluate_params(params, config, task, info["vocab_path"], lengths, "validation",
                                           batch_size=settings["eval_batch_size"],
                                           max_examples=settings["max_eval_examples"], progress=False,
                                           bootstrap_samples=settings["bootstrap_samples"])
    entry = evaluation["tasks"][task]
    result = {"metric": entry["metric"], "value": entry["score"], "ci": entry["ci"],
              "ci_confidence": entry["ci_confidence"], "num_examples": entry["num_examples"],
              "majority_baseline": entry["majority_baseline"]["score"],
              "invalid_predictions": entry["invalid_predictions"], "private": mode == "dp",
              "epsilon": None, "delta": None, "run_dir": run_dir,
              "wall_seconds": {"train": round(t1 - t0, 1), "evaluate": round(time.time() - t1, 1)}}
    if mode == "dp":
      # The fine-tuning guarantee over the task's training examples (its own ledger: the
      # pretraining's ε covers the corpus, another dataset, and is not in it).
      result.update(epsilon=summary["training_epsilon"], delta=summary["training_delta"],
                    ledger_epsilon=summary.get("epsilon"), noise_multiplier=summary.get("noise_multiplier"),
                    expected_batch_size=run["batch_size"], steps=run["steps"])
    logger.info("[study] %s fine-tuned (%s): %s %.2f, %g%% interval [%.2f, %.2f]", name, mode, entry["metric"],
                result["value"], 100 * result["ci_confidence"], *result["ci"])
    return result

  return study.cached_json(os.path.join(root, study.RESULT_FILE), compute, f"fine-tuning {name} ({mode})")


def _check_settings(output_dir: str, settings: dict) -> None:
  """Records the fine-tuning and sweep settings of `output_dir` on its first run; ConfigError when a
  re-run asks for others (its finished runs would be reused as if they were of the new settings)."""
  path = os.path.join(output_dir, SETTINGS_FILE)
  settings = json.loads(json.dumps(settings))  # as JSON reads it back (tuples become lists)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      if json.load(f) != settings:
        raise ConfigError(f"{output_dir} holds a utility study of other task, fine-tuning or batch-sweep "
                          f"settings ({path}); use a new --output directory")
    return
  io_lib.write_json_atomic(path, settings)


def sweep_points(batch_sizes: Sequence[int], examples: int, microbatch_size: int) -> List[dict]:
  """The sweep's runs: steps = ceil(examples / expected batch), microbatches of at most `microbatch_size`."""
  points = []
  for b in batch_sizes:
    _positive_int("batch_sweep_sizes entries", b)
    micro = min(b, microbatch_size)
    if b % micro:
      raise ConfigError(f"batch sweep size {b} is not a multiple of batch_sweep_microbatch_size={microbatch_size}")
    points.append({"expected_batch_size": b, "steps": max(1, math.ceil(examples / b)), "microbatch_size": micro})
  return points


def _sweep_run(point: dict, private: bool, data: dict, vocabs: dict, output_dir: str, train_model: Callable,
               epsilon: float) -> dict:
  """Phase 5 for one batch size: a span-corruption run at that (expected) batch."""
  b = point["expected_batch_size"]
  root = os.path.join(output_dir, "batch_sweep", f"{'dp' if private else 'nondp'}_b{b}")
  run_dir = os.path.join(root, "run")

  def compute():
    t0 = time.time()
    bindings = study.pretraining_bindings(run_dir, data, vocabs["spm"], "span_corruption", private, output_dir)
    bindings += [f"BATCH_SIZE={b}", f"TRAIN_STEPS={point['steps']}", f"train.microbatch_size={point['microbatch_size']}"]
    if private:
      bindings += [f"DPConfig.target_epsilon={epsilon!r}", "DPConfig.expected_batch_size=None",
                   "DPConfig.sampling='poisson'"]
    summary = train_model(run_dir, bindings)
    if bool(summary.get("private")) != private:
      raise ConfigError(f"batch sweep run {root} ran {'with' if summary.get('private') else 'without'} DP")
    validation = summary.get("validation_not_dp") or summary.get("validation") or {}
    sigma = summary.get("noise_multiplier") if private else None
    return {"expected_batch_size": b, "steps": point["steps"], "examples": b * point["steps"],
            "private": private, "noise_multiplier": sigma,
            "noise_batch_ratio": sigma / b if sigma is not None else None,
            "epsilon": summary.get("training_epsilon") if private else None,
            "delta": summary.get("training_delta") if private else None,
            "validation_token_accuracy": validation.get("token_accuracy"), "run_dir": run_dir,
            "wall_seconds": round(time.time() - t0, 1)}

  return study.cached_json(os.path.join(root, study.RESULT_FILE), compute,
                           f"batch sweep {'DP' if private else 'non-DP'} b={b}")


def run_utility_study(*, corpus: Optional[str] = None, output_dir: Optional[str] = None, task_dir: Optional[str] = None,
                      task: Optional[str] = None, text_fields: Union[None, str, Sequence[str]] = None,
                      label_field: Optional[str] = None, label_names: Union[None, str, Sequence[str]] = None,
                      metric: Optional[str] = None, task_module: Union[None, str, Sequence[str]] = None,
                      models: Sequence[str] = DEFAULT_MODELS,
                      validation_fraction: float = 0.1, max_documents: Optional[int] = None, seed: int = 0,
                      vocab_size: int = 2000, dp_vocab_epsilon: float = 3.37, dp_vocab_delta: float = 1e-8,
                      dp_vocab_max_words: int = 256, text_field: str = "text",
                      finetune_steps: int = 300, finetune_batch_size: int = 32,
                      finetune_learning_rate: float = 1e-3, finetune_feature_lengths=None,
                      finetune_epsilon: float = 8.0, finetune_dp_steps: Optional[int] = None,
                      finetune_dp_batch_size: Optional[int] = None,
                      finetune_dp_learning_rate: Optional[float] = None, finetune_microbatch_size: int = 32,
                      finetune_modes: Sequence[str] = FINETUNE_MODES, eval_batch_size: int = 64,
                      max_eval_examples: Optional[int] = None, bootstrap_samples: int = 1000,
                      batch_sweep_sizes: Sequence[int] = (16, 64, 256), batch_sweep_examples: int = 9600,
                      batch_sweep_microbatch_size: int = 32, batch_sweep_epsilon: float = 8.0,
                      batch_sweep_nondp: bool = True,
                      train_model: Optional[Callable[[str, List[str]], dict]] = None,
                      finetune_model: Optional[Callable[[str, List[str]], dict]] = None) -> dict:
  """Runs the utility part and writes results.json, results.md and figure.png to `output_dir`.

  Args:
    corpus: the pretraining corpus spec (see `private_t5.data.corpora`).
    output_dir: the study's folder (data/, vocab/, models/NAME/, batch_sweep/, results.*).
    task_dir: a local GLUE-layout task folder (`<dir>/{train,validation}.tsv`) described by its
      `task.json` or by `text_fields`, `label_field`, `label_names`, `metric` (which override it;
      `data.task_dir`), or named like a registered local task (e.g. `.../glue_like/rotten_tomatoes`); or
    task: a registered task name (`sst2` with TFDS or GLUE data, `rotten_tomatoes`, ...); with
      `task_dir`, the name of the folder's task (default: task.json's "name", else the folder's).
    text_fields, label_field, label_names, metric: the description of `task_dir`'s task.
    task_module: module(s) imported first (TASK_MODULE; also in every worker process), which
      register tasks in code.
    models: which of `nondp_span`, `dp_span`, `fulldp_span`, `scratch`.
    validation_fraction, max_documents, seed: the data phase (no planted copies).
    vocab_size, dp_vocab_epsilon, dp_vocab_delta, dp_vocab_max_words: the vocabularies.
    text_field: JSONL/TSV field of the corpus text.
    finetune_steps, finetune_batch_size, finetune_learning_rate: every public fine-tuning run
      (constant rate, Adafactor).
    finetune_feature_lengths: every fine-tuning run ({"inputs": Li, "targets": Lt}; Lt is also
      the decode length).
    finetune_epsilon: target ε of DP fine-tuning (over the task's training examples).
    finetune_dp_steps, finetune_dp_batch_size, finetune_dp_learning_rate: every DP fine-tuning
      run (the expected batch of untruncated Poisson sampling); None: the public run's value.
    finetune_microbatch_size: rows of a DP fine-tuning microbatch (must divide its batch).
    finetune_modes: "public" (the paper's fine-tuning) and / or "dp" ([] skips fine-tuning).
    eval_batch_size, max_eval_examples: validation decoding (None: every example).
    bootstrap_samples: resamples of the validation examples for each metric's 95% interval.
    batch_sweep_sizes: expected batch sizes of the sweep ([] skips it).
    batch_sweep_examples: examples processed by every sweep run (steps = examples / batch).
    batch_sweep_microbatch_size: rows a microbatch of the sweep's runs holds.
    batch_sweep_epsilon: the training ε every DP sweep run is calibrated to.
    batch_sweep_nondp: also run each batch size without DP (the reference).
    train_model, finetune_model: `fn(model_dir, gin_bindings) -> summary`, set by the command
      line: one training run with the pretraining / fine-tuning Gin files plus these bindings.
  """
  t_start, cpu_start = time.time(), time.process_time()
  dp_run, lengths, points = _checked_arguments(
      corpus, output_dir, task_dir, task, models, finetune_modes, train_model, finetune_model,
      finetune_steps=finetune_steps, finetune_batch_size=finetune_batch_size,
      finetune_learning_rate=finetune_learning_rate, finetune_feature_lengths=finetune_feature_lengths,
      finetune_dp_steps=finetune_dp_steps, finetune_dp_batch_size=finetune_dp_batch_size,
      finetune_dp_learning_rate=finetune_dp_learning_rate, finetune_microbatch_size=finetune_microbatch_size,
      eval_batch_size=eval_batch_size, bootstrap_samples=bootstrap_samples, vocab_size=vocab_size,
      batch_sweep_sizes=batch_sweep_sizes, batch_sweep_examples=batch_sweep_examples,
      batch_sweep_microbatch_size=batch_sweep_microbatch_size)
  description = dict(text_fields=text_fields, label_field=label_field, label_names=label_names, metric=metric)
  task = _checked_task(task, task_dir, task_module, description)
  dup_cfg = duplication.DuplicationConfig(validation_fraction=validation_fraction, fraction=0.0, repetitions=(2,),
                                          seed=seed, max_documents=max_documents).validate()
  output_dir = os.path.abspath(output_dir)
  settings = {"steps": finetune_steps, "batch_size": finetune_batch_size, "learning_rate": finetune_learning_rate,
              "feature_lengths": lengths, "epsilon": finetune_epsilon, "dp": dp_run, "eval_batch_size": eval_batch_size,
              "max_eval_examples": max_eval_examples, "bootstrap_samples": bootstrap_samples}
  phases = ("data", "vocabularies", "pretraining", "fine-tuning", "batch sweep", "results")
  phase = iter(enumerate(phases, 1))

  def log_phase(detail: str = ""):
    k, what = next(phase)
    logger.info("[study] phase %d/%d: %s%s", k, len(phases), what, detail)

  log_phase(f" from {corpus}")
  data = study.prepare_data(corpus, output_dir, dup_cfg, text_field)
  _check_recorded(output_dir, task, task_dir, description, settings, batch_sweep_examples,
                  batch_sweep_microbatch_size, batch_sweep_epsilon)
  log_phase()
  pretrained_names = [m for m in models if m != SCRATCH]
  vocabs = study.train_vocabularies(
      data["train"], output_dir, needed={"spm"} | {study.MODELS[m].vocabulary for m in pretrained_names},
      vocab_size=vocab_size, dp_vocab_epsilon=dp_vocab_epsilon, dp_vocab_delta=dp_vocab_delta,
      dp_vocab_max_words=dp_vocab_max_words, text_field=text_field)
  log_phase(f": {', '.join(pretrained_names)}")
  pretrained = {m: _pretrain(m, data, vocabs, output_dir, train_model) for m in pretrained_names}
  log_phase(f" on {task}: {', '.join(models)} ({', '.join(finetune_modes)})")
  table = _finetuned_table(models, finetune_modes, pretrained, task, vocabs, output_dir, finetune_model, settings)
  log_phase(f": expected batches {[p['expected_batch_size'] for p in points]}, "
            f"{batch_sweep_examples} examples each")
  sweep = _batch_sweep(points, batch_sweep_nondp, data, vocabs, output_dir, train_model, batch_sweep_epsilon)
  log_phase()
  out = {"utility": {
      "models": table, "batch_sweep": sweep, "task": task, "corpus": corpus, "data": data["stats"],
      "settings": {"validation_fraction": validation_fraction, "max_documents": max_documents, "seed": seed,
                   "vocab_size": vocab_size, "dp_vocab_epsilon": dp_vocab_epsilon, "dp_vocab_delta": dp_vocab_delta,
                   "finetune": dict(settings), "finetune_modes": list(finetune_modes),
                   "batch_sweep": {"sizes": [p["expected_batch_size"] for p in points],
                                   "examples": batch_sweep_examples, "epsilon": batch_sweep_epsilon,
                                   "microbatch_size": batch_sweep_microbatch_size}},
      "time_this_run": {"wall_seconds": round(time.time() - t_start, 1),
                        "cpu_seconds": round(time.process_time() - cpu_start, 1)}}}
  paths = study_utility_report.write_results(out, output_dir)
  logger.info("[study] wrote %s in %.0f s", ", ".join(paths), time.time() - t_start)
  return out


def _checked_arguments(corpus, output_dir, task_dir, task, models: Sequence[str], finetune_modes: Sequence[str],
                       train_model, finetune_model, *, finetune_steps, finetune_batch_size, finetune_learning_rate,
                       finetune_feature_lengths, finetune_dp_steps, finetune_dp_batch_size,
                       finetune_dp_learning_rate, finetune_microbatch_size, eval_batch_size, bootstrap_samples,
                       vocab_size, batch_sweep_sizes, batch_sweep_examples, batch_sweep_microbatch_size):
  """Checks the arguments before anything runs: (the DP fine-tuning run, the feature lengths, the sweep's points)."""
  for name, value in (("corpus", corpus), ("output", output_dir)):
    if not isinstance(value, str) or not value:
      raise ConfigError(f"private-t5 study --part=utility: missing --{name}")
  if task_dir is None and task is None:
    raise ConfigError("private-t5 study --part=utility: give one of --task_dir (a GLUE-layout folder) "
                      "and --task (a registered task name)")
  unknown = [m for m in models if m not in DEFAULT_MODELS]
  if unknown or not models or len(set(models)) != len(models):
    raise ConfigError(f"models must be distinct names among {', '.join(DEFAULT_MODELS)}, got {list(models)!r}")
  if any(m not in FINETUNE_MODES for m in finetune_modes):
    raise ConfigError(f"finetune_modes must be among {FINETUNE_MODES}, got {list(finetune_modes)!r}")
  if train_model is None or finetune_model is None:
    raise ConfigError("run_utility_study needs train_model and finetune_model (run it as `private-t5 study`)")
  dp_run = {"steps": finetune_dp_steps or finetune_steps, "batch_size": finetune_dp_batch_size or finetune_batch_size,
            "learning_rate": finetune_dp_learning_rate or finetune_learning_rate,
            "microbatch_size": min(finetune_microbatch_size, finetune_dp_batch_size or finetune_batch_size)}
  for name, value in (("finetune_steps", finetune_steps), ("finetune_batch_size", finetune_batch_size),
                      ("finetune_dp_steps", dp_run["steps"]), ("finetune_dp_batch_size", dp_run["batch_size"]),
                      ("finetune_microbatch_size", finetune_microbatch_size),
                      ("eval_batch_size", eval_batch_size), ("bootstrap_samples", bootstrap_samples),
                      ("batch_sweep_examples", batch_sweep_examples), ("vocab_size", vocab_size),
                      ("batch_sweep_microbatch_size", batch_sweep_microbatch_size)):
    _positive_int(name, value)
  for name, value in (("finetune_learning_rate", finetune_learning_rate),
                      ("finetune_dp_learning_rate", dp_run["learning_rate"])):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
      raise ConfigError(f"{name} must be a positive number, got {value!r}")
  if dp_run["batch_size"] % dp_run["microbatch_size"]:
    raise ConfigError(f"finetune_microbatch_size={finetune_microbatch_size} must divide the DP fine-tuning "
                      f"batch {dp_run['batch_size']}")
  lengths = dict(finetune_feature_lengths or {"inputs": 64, "targets": 12})
  if set(lengths) != {"inputs", "targets"}:
    raise ConfigError(f"finetune_feature_lengths needs 'inputs' and 'targets', got {lengths!r}")
  points = sweep_points(batch_sweep_sizes, batch_sweep_examples, batch_sweep_microbatch_size)
  return dp_run, lengths, points


def _checked_task(task: Optional[str], task_dir: Optional[str], task_module, description: dict) -> str:
  """The name of the study's one task; a malformed task folder is refused now, not after pretraining (phase 4)."""
  task = glue_registry.get_task(task_dir_lib.task_name(task, task_dir, task_module, **description)).name  # one task
  if task_dir is not None:
    for split in ("train", "validation"):
      glue_rows.load_examples(task, split)
  return task


def _check_recorded(output_dir: str, task: str, task_dir: Optional[str], description: dict, settings: dict,
                    batch_sweep_examples: int, batch_sweep_microbatch_size: int, batch_sweep_epsilon: float) -> None:
  """Checks the settings a finished run's result depends on against those the folder recorded."""
  # The lists of models, modes and batch sizes may change between runs of one folder (each
  # run's result is its own file).
  recorded = {"task": task, "task_dir": os.path.abspath(task_dir) if task_dir else None,
              "finetune": settings, "batch_sweep_examples": batch_sweep_examples,
              "batch_sweep_microbatch_size": batch_sweep_microbatch_size,
              "batch_sweep_epsilon": batch_sweep_epsilon}
  if task_dir is not None and task_dir_lib.description(os.path.abspath(task_dir), **description) is not None:
    recorded["task_layout"] = task_dir_lib.layout(glue_registry.get_task(task))  # a task of its own description
  _check_settings(output_dir, recorded)


def _finetuned_table(models: Sequence[str], finetune_modes: Sequence[str], pretrained: dict, task: str,
                     vocabs: dict, output_dir: str, finetune_model: Callable, settings: dict) -> dict:
  """Phase 4: every model fine-tuned in every mode, beside its pretraining figures."""
  table = {}
  for m in models:
    base = pretrained.get(m)
    entry = {"private": base["private"] if base else False, "epsilon": base["epsilon"] if base else None,
             "delta": base["delta"] if base else None, "epsilon_scope": base["epsilon_scope"] if base else None,
             "vocabulary": base["vocabulary"] if base else "spm",
             "pretrain_validation_token_accuracy": base["pretrain_validation_token_accuracy"] if base else None,
             "pretrain_wall_seconds": base["wall_seconds"] if base else 0.0}
    for mode in finetune_modes:
      result = _finetune(m, mode, base, task, vocabs, output_dir, finetune_model, settings)
      entry["finetuned" if mode == "public" else "finetuned_dp"] = result
    table[m] = entry
  return table


def _batch_sweep(points: List[dict], nondp: bool, data: dict, vocabs: dict, output_dir: str, train_model: Callable,
                 epsilon: float) -> List[dict]:
  """Phase 5: the DP run of every batch size (and its non-DP reference)."""
  sweep = []
  for point in points:
    sweep.append(_sweep_run(point, True, data, vocabs, output_dir, train_model, epsilon))
    if nondp:
      sweep.append(_sweep_run(point, False, data, vocabs, output_dir, train_model, epsilon))
  return sweep
