"""The examples of one task split, read and put in T5's text-to-text form.

Each task turns a labelled row into `inputs` / `targets` text as t5's GLUE preprocessors do
(`t5.data.preprocessors.glue` / `.stsb`, configured as `t5.data.glue_utils` does; ported,
so no TensorFlow is imported), e.g. `{"sentence": "a gem", "label": 1}` ->
`"sst2 sentence: a gem"` -> `"positive"`, and STS-B scores rounded to the nearest 0.2 ("3.4").
Rows come from

* TFDS `glue/<task>` when it is prepared under `tfds_data_dir` (never downloaded), or
* a local copy of the official GLUE directories (`<glue_dir>/SST-2/train.tsv`, `dev.tsv`, ...),
* or the folder of a local TSV task (`data.glue_registry`).

A split's rows are read once and kept (`load_rows`) until its file changes or its task is
registered anew.
"""
import csv
import functools
import os
import sys
from typing import Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from private_t5.data import glue_registry
from private_t5.data import tfds as tfds_lib
from private_t5.data.glue_registry import Column, GlueTask, get_task
from private_t5.errors import ConfigError, DataError

SPLITS = ("train", "validation", "test")


def split_path(task: GlueTask, split: str, glue_dir: Optional[str]) -> str:
  if split not in SPLITS:
    raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
  if split not in task.split_files:
    raise ConfigError(f"task {task.name!r} has no {split!r} split")
  if os.path.isabs(task.local_subdir) and task.default_root:
    directory = task.local_subdir
  else:
    directory = os.path.join(glue_dir, task.local_subdir)
  candidates = [os.path.join(directory, f) for f in task.split_files[split]]
  for path in candidates:
    if os.path.isfile(path):
      return path
  raise DataError(f"task {task.name!r}: no {split} file; looked for {', '.join(candidates)}")


def _column_index(header: Optional[List[str]], column: Column, path: str) -> int:
  if isinstance(column, int):
    return column
  if header is None or column not in header:
    raise DataError(f"{path}: no column {column!r} in the header {header}")
  return header.index(column)


def parse_label(task: GlueTask, value: str, where: str) -> Union[int, float]:
  """A label cell -> the class index (a name or an index) or the regression target; `where` names the cell."""
  value = value.strip()
  if task.is_regression:
    try:
      return float(value)
    except ValueError:
      raise DataError(f"{where}: label {value!r} of task {task.name!r} is not a number") from None
  if value in task.label_names:
    return task.label_names.index(value)
  try:
    index = int(value)
  except ValueError:
    index = -1
  if 0 <= index < len(task.label_names):
    return index
  raise DataError(f"{where}: invalid label {value!r}, not in the label set of task {task.name!r} "
                  f"({', '.join(task.label_names)} or 0..{len(task.label_names) - 1})")


def read_tsv(path: str, has_header: bool) -> Tuple[Optional[List[str]], List[Tuple[int, List[str]]]]:
  """(header or None, [(line number, cells)]) of a GLUE TSV: no quoting, BOM tolerated, blank rows skipped."""
  csv.field_size_limit(sys.maxsize)
  try:
    with open(path, encoding="utf-8-sig", newline="") as f:
      rows = [(i, row) for i, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), start=1)]
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: invalid UTF-8 ({e.reason})") from None
  rows = [(i, r) for i, r in rows if any(c.strip() for c in r)]
  if not rows:
    raise DataError(f"{path}: empty file" + (" (expected a header row)" if has_header else ""))
  if has_header:
    return [c.strip() for c in rows[0][1]], rows[1:]
  return None, rows


def read_tsv_rows(task: GlueTask, path: str) -> Tuple[Dict[str, List[str]], np.ndarray]:
  """(texts per feature, labels) of a GLUE-layout TSV file."""
  header, rows = read_tsv(path, task.header)
  texts = {f: [] for f in task.feature_names}
  labels = []
  text_idx = {feat: _column_index(header, task.text_columns[feat], path) for feat in task.feature_names}
  label_idx = _column_index(header, task.label_column, path)
  need = max(list(text_idx.values()) + [label_idx]) + 1
  for line_no, row in rows:
    if len(row) < need:
      raise DataError(f"{path}:{line_no}: {len(row)} columns, expected at least {need}")
    for feat, i in text_idx.items():
      texts[feat].append(row[i])
    labels.append(parse_label(task, row[label_idx], f"{path}:{line_no}"))
  if not labels:
    raise DataError(f"{path} has no examples")
  dtype = np.float32 if task.is_regression else np.int64
  return texts, np.asarray(labels, dtype=dtype)


def _tfds_rows(task: GlueTask, split: str, tfds_data_dir: Optional[str]):
  """Rows from a prepared TFDS dataset, or None when it is not prepared (never downloads)."""
  if not task.tfds_name or split not in task.tfds_splits:
    return None
  try:
    builder = tfds_lib.prepared_builder(task.tfds_name, tfds_data_dir)
    ds = tfds_lib.split_dataset(builder, task.tfds_name, task.tfds_splits[split])
  except Exception:  # pylint: disable=broad-except
    return None  # TFDS missing, unknown name or not prepared: fall back to local files.
  texts = {f: [] for f in task.feature_names}
  labels = []
  for ex in ds.as_numpy_iterator():
    for feat in task.feature_names:
      texts[feat].append(ex[feat].decode("utf-8"))
    labels.append(ex["label"])
  dtype = np.float32 if task.is_regression else np.int64
  labels = np.asarray(labels, dtype=dtype)
  if not task.is_regression and np.any(labels >= len(task.label_names)):
    raise DataError(f"TFDS {task.tfds_name}:{split} has labels outside {task.label_names}")
  return texts, labels


def _file_stamp(task: GlueTask, split: str, glue_dir: Optional[str]):
  """(path, mtime, size) of a local split file, so that a file changed since it was read is read
  again; None for TFDS data or a file not found (then reading it names the problem)."""
  if task.default_root is None and glue_dir is None:
    return None
  try:
    path = split_path(task, split, glue_dir)
    stat = os.stat(path)
  except (ConfigError, DataError, OSError):
    return None
  return path, stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=32)
def load_rows(name: str, split: str, glue_dir: Optional[str], tfds_data_dir: Optional[str], stamp=None):
  """((texts per feature, labels), source) of one task split, cached by its arguments; `stamp`
  (`_file_stamp`) makes a local file changed since it was read be read again."""
  del stamp  # part of the cache's key only
  task = get_task(name)
  if task.default_root is None and glue_dir is None:
    rows = _tfds_rows(task, split, tfds_data_dir)
    if rows is None:
      raise DataError(f"task {name!r}: TFDS {task.tfds_name} is not prepared"
                      f"{' in ' + tfds_data_dir if tfds_data_dir else ''} and no glue_dir was given; "
                      f"pass glue_dir=<a local copy of the GLUE data with {task.local_subdir}/>")
    return rows, f"tfds:{task.tfds_name}:{task.tfds_splits[split]}"
  path = split_path(task, split, glue_dir)
  return read_tsv_rows(task, path), path


glue_registry.on_change(load_rows.cache_clear)


def load_examples(name: str, split: str, glue_dir: Optional[str] = None,
                  tfds_data_dir: Optional[str] = None) -> Dict[str, object]:
  """Text-to-text examples of one task split, in t5's GLUE text-to-text form.

  Returns:
    dict with `inputs`, `targets` (lists of str), `labels` (int64 class ids, or float32
    scores for STS-B), `source` (file or TFDS split) and `task`.
  """
  task = get_task(name)
  (texts, labels), source = load_rows(name, split, glue_dir, tfds_data_dir, _file_stamp(task, split, glue_dir))
  inputs, targets = text_to_text(task, texts, labels)
  return {"task": task, "inputs": inputs, "targets": targets, "labels": labels, "source": source}


def text_to_text(task: GlueTask, texts: Mapping[str, List[str]], labels: np.ndarray):
  """T5's text-to-text form of the rows: `t5.data.preprocessors.glue` / `.stsb` (configured as
  `t5.data.glue_utils` does), ported to plain Python so that no TensorFlow is needed;
  tests/test_glue_tasks.py checks it against t5's own preprocessors."""
  if task.is_regression:
    if task.feature_names != ("sentence1", "sentence2"):
      raise ConfigError(f"task {task.name!r}: regression tasks use the STS-B layout "
                        "(sentence1, sentence2)")
    inputs = [f"stsb sentence1: {a} sentence2: {b}" for a, b in zip(texts["sentence1"], texts["sentence2"])]
    # The score rounded to the nearest 0.2 in float32, halves to even (as tf.round), one decimal.
    rounded = np.round(np.asarray(labels, np.float32) * np.float32(5)) / np.float32(5)
    return inputs, [f"{score:.1f}" for score in rounded]
  # GLUE tasks use t5's default order (feature names sorted, e.g. MNLI "hypothesis: ...
  # premise: ..."); a registered local task keeps the order its user gave.
  keys = sorted(task.feature_names) if task.tfds_name else list(task.feature_names)
  inputs = [" ".join([task.benchmark_name] + [part for key in keys for part in (f"{key}:", texts[key][i])])
            for i in range(len(labels))]
  # A row without a label (-1, GLUE's test splits) gets "<unk>", as in t5.
  targets = ["<unk>" if label == -1 else task.label_names[label] for label in labels.tolist()]
  return inputs, targets
