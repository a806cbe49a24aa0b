"""GLUE-style evaluation of a checkpoint by greedy decoding (the `private-t5 evaluate` stage).

Each validation example is greedy-decoded, the text postprocessed as t5 does (label name ->
class id, STS-B string -> float), and scored with the task's GLUE metric
(`eval.glue_metrics`). Beside it, the majority-class baseline (the most frequent training
label predicted for every example). Writes `MODEL_DIR/eval/results.json` and
`MODEL_DIR/eval/results.md` (a table like Ponomareva et al.'s (2022) Table 2: one column per task + Avg).
"""
import dataclasses
import logging
import os
from typing import Any, Dict, Mapping, Optional, Sequence

import jax
import numpy as np

from private_t5 import progress as progress_lib
from private_t5 import vocabulary as vocab_lib
from private_t5.data import glue_tasks
from private_t5.data import glue_registry
from private_t5.data import glue_rows
from private_t5.errors import ConfigError, DataError
from private_t5.io import check_output_file, write_json_atomic, write_text_atomic
from private_t5.eval import glue_metrics
from private_t5.models import hf_convert, mesh_inference, sharding
from private_t5.models import checkpoint_read

logger = logging.getLogger(__name__)

EVAL_SUBDIR = "eval"


def _decoder(vocab_path: str):
  proc = vocab_lib.sentencepiece_processor(vocab_lib.load_vocabulary(vocab_path))
  size = proc.GetPieceSize()

  def decode(row: np.ndarray) -> str:
    ids = []
    for t in row.tolist():
      if t in (0, glue_tasks.EOS_ID):
        break
      if t < size:  # sentinel ids have no text
        ids.append(t)
    return proc.DecodeIds(ids)

  return decode


def predict(params, model_config, source: glue_tasks.GlueSource, batch_size: int = 64,
            max_examples: Optional[int] = None, progress: bool = True,
            inference: Optional[mesh_inference.MeshInference] = None) -> list:
  """Greedy-decoded text for the first `max_examples` examples of `source` (all by default).

  Decoded on a mesh (`models.mesh_inference`): `inference` holds the parameters on it (default:
  placed here on every device of every process, by training's logical-axis rules); each global
  batch of `batch_size` rows is split over the `data` axis, and every process gets every text.
  """
  if inference is None:
    inference = mesh_inference.MeshInference(model_config, params=params)
  decode = _decoder(source.vocab_path)
  n = source.num_examples if max_examples is None else min(max_examples, source.num_examples)
  length = source.feature_lengths["targets"]
  inputs = source.get_batch(np.arange(n), 0, n)["encoder_input_tokens"]
  bar = progress_lib.bar(total=n, desc="[evaluate] decoding", unit="examples",
                         disable=not (progress and progress_lib.enabled()))
  tokens = inference.decode(inputs, length, batch_size=batch_size, on_batch=lambda rows, _: bar.update(rows))
  bar.close()
  return [decode(row) for row in tokens]


def _majority(task: glue_registry.GlueTask, eval_labels, glue_dir, tfds_data_dir):
  try:
    train = glue_rows.load_examples(task.name, "train", glue_dir, tfds_data_dir)["labels"]
    origin = "train"
  except DataError:
    train, origin = eval_labels, "evaluated split (no train split found)"
  return glue_metrics.majority_prediction(train, task.is_regression), origin


def score_task(task: glue_registry.GlueTask, predictions_text, labels, glue_dir=None,
               tfds_data_dir=None, bootstrap_samples: int = 0, confidence: float = 0.95) -> Dict[str, Any]:
  """Metrics of one task's decoded predictions, with the majority-class baseline.

  With `bootstrap_samples` > 0 the entry also holds `ci`: the percentile bootstrap interval of
  the headline score over the evaluated examples (`glue_metrics.bootstrap_interval`).
  """
  labels = list(np.asarray(labels)[:len(predictions_text)].tolist())
  predictions = [glue_metrics.postprocess(p, task.label_names) for p in predictions_text]
  metrics = glue_metrics.compute_metrics(task.metric, labels, predictions)
  majority, origin = _majority(task, labels, glue_dir, tfds_data_dir)
  baseline = glue_metrics.compute_metrics(task.metric, labels, [majority] * len(labels))
  invalid = (np.mean([p == -1 for p in predictions]) if not task.is_regression
             else np.mean([p == -1.0 for p in predictions]))
  interval = {}
  if bootstrap_samples:
    interval = {"ci": glue_metrics.bootstrap_interval(task.metric, labels, predictions, bootstrap_samples,
                                                      confidence),
                "ci_confidence": confidence, "bootstrap_samples": bootstrap_samples}
  return {
      **interval,
      "metric": task.metric,
      "metrics": metrics,
      "score": glue_metrics.headline(metrics),
      "num_examples": len(labels),
      "invalid_predictions": float(invalid),
      "majority_baseline": {
          "prediction": task.label_names[majority] if task.label_names else majority,
          "from": origin, "metrics": baseline, "score": glue_metrics.headline(baseline)},
  }


def evaluate_params(params, model_config, task_or_mixture: str, vocab_path: str,
                    feature_lengths: Mapping[str, int], split: str = "validation",
                    glue_dir: Optional[str] = None, tfds_data_dir: Optional[str] = None,
                    batch_size: int = 64, max_examples: Optional[int] = None,
                    progress: bool = True, bootstrap_samples: int = 0,
                    mesh: Optional[jax.sharding.Mesh] = None,
                    rules=sharding.LOGICAL_AXIS_RULES) -> Dict[str, Any]:
  """Evaluates parameters on every evaluation task of `task_or_mixture` (no files written).

  `bootstrap_samples` > 0 adds each task's bootstrap interval (`score_task`). The parameters
  are placed once on `mesh` (default: every device on the `data` axis) by the logical-axis
  `rules`, and every task is decoded there (`predict`).
  """
  inference = mesh_inference.MeshInference(model_config, mesh, params=params, rules=rules)
  results = {"split": split, "task_or_mixture": task_or_mixture, "tasks": {},
             "devices": inference.devices, "mesh_shape": list(sharding.mesh_shape_of(inference.mesh))}
  for task in glue_registry.eval_tasks(task_or_mixture):
    source = glue_tasks.GlueSource(task.name, split, vocab_path, feature_lengths, glue_dir=glue_dir,
                                   tfds_data_dir=tfds_data_dir, vocab_size=model_config.vocab_size,
                                   progress=progress)
    texts = predict(params, model_config, source, batch_size, max_examples, progress, inference)
    entry = score_task(task, texts, source.labels[0], glue_dir, tfds_data_dir, bootstrap_samples)
    entry["examples"] = [{"inputs": source.inputs_text[i], "target": source.targets_text[i],
                          "prediction": texts[i]} for i in range(min(5, len(texts)))]
    results["tasks"][task.name] = entry
    if progress:
      logger.info("[evaluate] %s: %s (majority %.1f)", task.name, entry["metrics"],
                  entry["majority_baseline"]["score"])
  tasks = results["tasks"]
  results["average"] = glue_metrics.average({t: e["score"] for t, e in tasks.items()})
  results["majority_average"] = glue_metrics.average(
      {t: e["majority_baseline"]["score"] for t, e in tasks.items()})
  return results


def results_table(results: Mapping[str, Any], model_name: str) -> str:
  tasks = results["tasks"]
  rows = {model_name: {t: e["score"] for t, e in tasks.items()},
          "majority class": {t: e["majority_baseline"]["score"] for t, e in tasks.items()}}
  return glue_metrics.markdown_table(rows, list(tasks))


def evaluate(model_dir: str, task_or_mixture: str, feature_lengths: Mapping[str, int],
             split: str = "validation", step: Optional[int] = None, vocab_path: Optional[str] = None,
             glue_dir: Optional[str] = None, tfds_data_dir: Optional[str] = None,
             batch_size: int = 64, max_examples: Optional[int] = None,
             output_dir: Optional[str] = None, initial_checkpoint: Optional[str] = None,
             mesh_shape: Sequence[int] = (-1, 1), parameter_sharding: str = sharding.REPLICATED) -> Dict[str, Any]:
  """Evaluates the checkpoint of `model_dir` and writes `<output_dir>/results.{json,md}`.

  Args:
    model_dir: a fine-tuning run's MODEL_DIR (or any directory `load_initial_params` reads:
      a converted or Hugging Face T5 directory, for zero-shot checks).
    task_or_mixture: registered task or mixture name.
    feature_lengths: {"inputs": Li, "targets": Lt} (Lt is the decode length).
    split: split to evaluate ("validation"; "test" for local tasks with labels).
    step: checkpoint step (default latest).
    vocab_path: default: the checkpoint's vocabulary.
    glue_dir, tfds_data_dir: where GLUE data lives (see `data.glue_tasks`).
    batch_size: decoding batch size (global: over all devices, rounded up to a multiple of the
      mesh's `data` axis).
    max_examples: evaluate only the first N examples of each task (quick checks).
    output_dir: default MODEL_DIR/eval.
    initial_checkpoint: a LoRA run whose base moved since training: the base's new directory
      (Gin macro INITIAL_CHECKPOINT, `--initial_checkpoint`, as for `private-t5 train`), which must
      hold the weights the run recorded (checked by SHA-256).
    mesh_shape: (data, model) mesh of the decoding, as training's (default: every device of
      every process on `data`); the results record `devices` and `mesh_shape`.
    parameter_sharding: "replicated" or "fully_sharded", training's logical-axis rules.
  """
  for macro, value in (("MODEL_DIR", model_dir), ("MIXTURE_OR_TASK_NAME", task_or_mixture)):
    if not isinstance(value, str) or not value:
      raise ConfigError(f"{macro} is required: pass --gin.{macro}=...")
  output_dir = output_dir or os.path.join(model_dir, EVAL_SUBDIR)
  check_output_file(os.path.join(output_dir, "results.json"), "evaluate.output_dir")  # before the decoding
  rules = sharding.axis_rules(parameter_sharding)
  mesh = sharding.create_mesh(mesh_shape)
  if hf_convert.is_hf_t5_dir(model_dir):
    if initial_checkpoint:
      raise ConfigError(f"--initial_checkpoint names a moved LoRA base, but {model_dir!r} is not a LoRA run")
    params, model_config = hf_convert.import_hf_t5(model_dir)
    info = {"step": None, "vocab_path": hf_convert.hf_vocabulary_path(model_dir)}
  else:
    params, model_config, info = checkpoint_read.restore_for_inference(model_dir, step, lora_base=initial_checkpoint)
  vocab_path = vocab_path or info.get("vocab_path")
  if not vocab_path:
    raise ConfigError(f"{model_dir!r} records no vocabulary; set evaluate.vocab_path")
  results = evaluate_params(params, model_config, task_or_mixture, vocab_path, feature_lengths, split,
                            glue_dir, tfds_data_dir, batch_size, max_examples, mesh=mesh, rules=rules)
  results.update(model_dir=os.path.abspath(model_dir), step=info.get("step"), vocab_path=vocab_path,
                 model_config=dataclasses.asdict(model_config), feature_lengths=dict(feature_lengths),
                 max_examples=max_examples)
  name = f"{os.path.basename(os.path.abspath(model_dir))} (step {info.get('step')})"
  results["table_markdown"] = results_table(results, name)
  if jax.process_index() != 0:  # several processes: the results are written once
    return results
  os.makedirs(output_dir, exist_ok=True)
  write_json_atomic(os.path.join(output_dir, "results.json"), results)
  write_text_atomic(os.path.join(output_dir, "results.md"),
                    f"# GLUE evaluation ({split}) of {name}\n\n" + results["table_markdown"])
  print(results["table_markdown"])
  return results
