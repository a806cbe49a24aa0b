"""GLUE (and GLUE-layout) tasks in T5's text-to-text form, as random-access example sources.

Each task turns a labelled row into `inputs` / `targets` text as t5's GLUE preprocessors do
(`t5.data.preprocessors.glue` / `.stsb`, configured as `t5.data.glue_utils` does; ported,
so no TensorFlow is imported), e.g. `{"sentence": "a gem", "label": 1}` ->
`"sst2 sentence: a gem"` -> `"positive"`, and STS-B scores rounded to the nearest 0.2 ("3.4").
Rows come from

* TFDS `glue/<task>` when it is prepared under `tfds_data_dir` (never downloaded), or
* a local copy of the official GLUE directories (`<glue_dir>/SST-2/train.tsv`, `dev.tsv`, ...),
* or any directory of `{train,validation,test}.tsv` files with a header row, registered with
  `register_local_tsv_task` (how a user adds their own classification task in code; the three
  `glue_like` tasks shipped with the package are registered the same way), or described by its
  own `task.json` or the command line's flags (`data.task_dir`, `--task_dir=DIR`).

`GlueSource` exposes one split of a task or mixture as a `train.main.ExampleSource`
(`num_examples`, `privacy_unit == "example"`: one labelled example is the privacy unit,
`feature_lengths`, `vocab_size`, `get_batch`, `describe`; also `user_ids`), so fine-tuning
runs through the same trainer as pretraining, DP or not. A mixture concatenates its tasks'
examples: uniform (or Poisson) sampling over the concatenation is T5's examples-proportional
mixing (Raffel et al. 2020, Sec. 3.5.2) without a cap, and keeps the DP population explicit.
"""
import csv
import dataclasses
import functools
import logging
import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from private_t5 import vocabulary as vocab_lib
from private_t5.data import source as source_lib
from private_t5.data import tfds as tfds_lib
from private_t5.errors import ConfigError, DataError
from private_t5.io import file_sha256

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
EOS_ID = 1
UNK_ID = 2
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# This project's GLUE-layout tasks: the full set beside a checkout when present, otherwise the
# small copy shipped in the package (private_t5/data/glue_like, package data; the tests'
# tests/data/glue_like is a link to it), so that an installed package has them too.
SHIPPED_GLUE_LIKE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "glue_like")
_FULL_GLUE_LIKE_DIR = os.path.join(os.path.dirname(PROJECT_ROOT), "shared", "data", "glue_like")
DEFAULT_GLUE_LIKE_DIR = (_FULL_GLUE_LIKE_DIR if os.path.isdir(_FULL_GLUE_LIKE_DIR) else SHIPPED_GLUE_LIKE_DIR)
Column = Union[str, int]


@dataclasses.dataclass(frozen=True)
class GlueTask:
  """One text-to-text classification (or STS-B regression) task.

  Attributes:
    name: registry name (`MIXTURE_OR_TASK_NAME`).
    benchmark_name: the prefix of the inputs ("sst2 sentence: ...").
    feature_names: text features in input order (TFDS feature names for GLUE).
    label_names: class names (the targets); None for STS-B regression.
    metric: key of `eval.glue_metrics.TASK_METRICS` ("accuracy", "mrpc", "cola", "stsb", ...).
    tfds_name: TFDS dataset name (`glue/sst2`) or None.
    tfds_splits: our split -> TFDS split.
    local_subdir: directory of the task under a GLUE root (`SST-2`), or an absolute path.
    split_files: our split -> candidate TSV file names, first existing wins.
    header: whether the TSV files have a header row.
    text_columns: feature -> TSV column (header name or 0-based index).
    label_column: TSV column of the label.
    default_root: where the local files are when no directory is given (None: TFDS or
      `glue_dir` needed).
    train_weight: False for evaluation-only views (mnli_matched / mnli_mismatched).
  """
  name: str
  benchmark_name: str
  feature_names: Tuple[str, ...]
  label_names: Optional[Tuple[str, ...]]
  metric: str
  tfds_name: Optional[str]
  tfds_splits: Mapping[str, str]
  local_subdir: str
  split_files: Mapping[str, Tuple[str, ...]]
  header: bool
  text_columns: Mapping[str, Column]
  label_column: Column
  default_root: Optional[str] = None
  train_weight: bool = True

  @property
  def is_regression(self) -> bool:
    return self.label_names is None


# The metric keys a task may name: those of `eval.glue_metrics.TASK_METRICS` (which says what each
# computes; tests/test_task_dir.py checks the two lists agree), named here for the data layer.
METRIC_NAMES = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte",
                "wnli", "accuracy")

_GLUE_FILES = {"train": ("train.tsv",), "validation": ("dev.tsv", "validation.tsv"),
               "test": ("test.tsv",)}
_TFDS_SPLITS = {"train": "train", "validation": "validation", "test": "test"}

_TASKS: Dict[str, GlueTask] = {}
_MIXTURES: Dict[str, Tuple[str, ...]] = {}


def _glue(name, features, labels, metric, subdir, text_columns, label_column, header=True,
          benchmark_name=None, tfds_name=None, split_files=None, tfds_splits=None, train_weight=True):
  _TASKS[name] = GlueTask(
      name=name, benchmark_name=benchmark_name or name, feature_names=tuple(features),
      label_names=None if labels is None else tuple(labels), metric=metric,
      tfds_name=tfds_name or f"glue/{name}", tfds_splits=tfds_splits or _TFDS_SPLITS,
      local_subdir=subdir, split_files=split_files or _GLUE_FILES, header=header,
      text_columns=text_columns, label_column=label_column, train_weight=train_weight)


# The official GLUE TSV layouts (as unpacked by the GLUE download script) and TFDS names.
_glue("cola", ["sentence"], ["unacceptable", "acceptable"], "cola", "CoLA", {"sentence": 3}, 1,
      header=False)
_glue("sst2", ["sentence"], ["negative", "positive"], "sst2", "SST-2", {"sentence": "sentence"}, "label")
_glue("mrpc", ["sentence1", "sentence2"], ["not_equivalent", "equivalent"], "mrpc", "MRPC",
      {"sentence1": "#1 String", "sentence2": "#2 String"}, "Quality")
_glue("qqp", ["question1", "question2"], ["not_duplicate", "duplicate"], "qqp", "QQP",
      {"question1": "question1", "question2": "question2"}, "is_duplicate")
_glue("stsb", ["sentence1", "sentence2"], None, "stsb", "STS-B",
      {"sentence1": "sentence1", "sentence2": "sentence2"}, "score")
_MNLI = dict(features=["premise", "hypothesis"], labels=["entailment", "neutral", "contradiction"],
             subdir="MNLI", text_columns={"premise": "sentence1", "hypothesis": "sentence2"},
             label_column="gold_label", benchmark_name="mnli", tfds_name="glue/mnli")
_glue("mnli", metric="mnli", split_files={**_GLUE_FILES, "validation": ("dev_matched.tsv",)},
      tfds_splits={**_TFDS_SPLITS, "validation": "validation_matched"}, **_MNLI)
_glue("mnli_matched", metric="mnli_matched", train_weight=False,
      split_files={**_GLUE_FILES, "validation": ("dev_matched.tsv",), "test": ("test_matched.tsv",)},
      tfds_splits={**_TFDS_SPLITS, "validation": "validation_matched", "test": "test_matched"}, **_MNLI)
_glue("mnli_mismatched", metric="mnli_mismatched", train_weight=False,
      split_files={**_GLUE_FILES, "validation": ("dev_mismatched.tsv",), "test": ("test_mismatched.tsv",)},
      tfds_splits={**_TFDS_SPLITS, "validation": "validation_mismatched", "test": "test_mismatched"},
      **_MNLI)
_glue("qnli", ["question", "sentence"], ["entailment", "not_entailment"], "qnli", "QNLI",
      {"question": "question", "sentence": "sentence"}, "label")
_glue("rte", ["sentence1", "sentence2"], ["entailment", "not_entailment"], "rte", "RTE",
      {"sentence1": "sentence1", "sentence2": "sentence2"}, "label")
_glue("wnli", ["sentence1", "sentence2"], ["not_entailment", "entailment"], "wnli", "WNLI",
      {"sentence1": "sentence1", "sentence2": "sentence2"}, "label")

GLUE_TASK_NAMES = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli")
# Evaluated views of the GLUE mixture (MNLI is reported on both validation sets, as T5 does).
GLUE_EVAL_TASK_NAMES = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli_matched", "mnli_mismatched",
                        "qnli", "rte", "wnli")


def register_local_tsv_task(name: str, dir: str, text_fields: Union[Sequence[str], Mapping[str, str]],  # pylint: disable=redefined-builtin
                            label_field: str, label_names: Optional[Sequence[str]],
                            metric: str = "accuracy", benchmark_name: Optional[str] = None,
                            split_files: Optional[Mapping[str, Sequence[str]]] = None) -> GlueTask:
  """Registers a classification task read from `dir/{train,validation,test}.tsv`.

  (The command line does the same from a task folder's `task.json` or flags: `data.task_dir`.)

  The files are tab-separated with a header row. A label cell holds a class name from
  `label_names` or its 0-based index. Inputs read `"<name> <feature>: <text> ..."`, targets
  the class name, exactly as T5 formats GLUE.

  Args:
    name: task name (also the input prefix unless `benchmark_name` is given).
    dir: directory with the split files.
    text_fields: the text columns in input order, or a mapping feature name -> column
      (e.g. `{"sentence1": "#1 String", "sentence2": "#2 String"}` for the MRPC layout).
    label_field: the label column.
    label_names: class names (index order); None makes a regression task like STS-B.
    metric: "accuracy" or a GLUE metric key ("mrpc", "cola", ... see `eval.glue_metrics`).
    benchmark_name: input prefix (default `name`).
    split_files: split -> candidate file names (default `<split>.tsv`, `dev.tsv` for
      validation).

  Returns:
    The registered task.
  """
  return register(local_tsv_task(name, dir, text_fields, label_field, label_names, metric, benchmark_name,
                                 split_files))


def local_tsv_task(name: str, dir: str, text_fields: Union[Sequence[str], Mapping[str, str]],  # pylint: disable=redefined-builtin
                   label_field: str, label_names: Optional[Sequence[str]], metric: str = "accuracy",
                   benchmark_name: Optional[str] = None,
                   split_files: Optional[Mapping[str, Sequence[str]]] = None) -> GlueTask:
  """The task `register_local_tsv_task` registers, not registered."""
  if not name or not isinstance(name, str):
    raise ConfigError(f"task name must be a non-empty string, got {name!r}")
  if isinstance(text_fields, str):
    text_fields = [text_fields]
  columns = dict(text_fields) if isinstance(text_fields, Mapping) else {f: f for f in text_fields}
  if not columns:
    raise ConfigError(f"task {name!r}: text_fields is empty")
  if label_names is not None:
    label_names = tuple(str(x) for x in label_names)
    if len(label_names) < 2 or len(set(label_names)) != len(label_names):
      raise ConfigError(f"task {name!r}: label_names must be >= 2 distinct names, got {label_names}")
  files = split_files or {"train": ("train.tsv",), "validation": ("validation.tsv", "dev.tsv"),
                          "test": ("test.tsv",)}
  return GlueTask(
      name=name, benchmark_name=benchmark_name or name, feature_names=tuple(columns),
      label_names=label_names, metric=metric, tfds_name=None, tfds_splits={},
      local_subdir=os.path.abspath(os.path.expanduser(dir)),
      split_files={k: tuple(v) for k, v in files.items()}, header=True, text_columns=columns,
      label_column=label_field, default_root=os.path.abspath(os.path.expanduser(dir)))


def register(task: GlueTask) -> GlueTask:
  """Registers `task` under its name (a task registered again as it was is left as it is)."""
  if _TASKS.get(task.name) != task:
    _TASKS[task.name] = task
    if "_load_rows" in globals():  # Re-registering a name must not serve stale rows.
      _load_rows.cache_clear()
  return task


def task_folder(path: str) -> str:
  """The absolute path of task folder `path`; ConfigError for a missing folder or a file."""
  folder = os.path.abspath(os.path.expanduser(path)) if isinstance(path, str) and path else None
  if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
    raise ConfigError(f"task directory {path!r} is a file, not a folder (give the folder holding "
                      "train.tsv and validation.tsv)")
  if folder is None or not os.path.isdir(folder):
    raise ConfigError(f"task directory not found: {path!r}")
  return folder


def local_task_names() -> List[str]:
  """The registered tasks read from a folder of TSV files (those a task folder may be named like)."""
  return sorted(n for n, t in _TASKS.items() if t.default_root is not None)


def register_task_dir(path: str, name: Optional[str] = None) -> str:
  """Points the local TSV task `name` (default: named like folder `path`) at that folder; returns
  the task's name.

  The registered task of that name gives the layout (columns, labels, metric): e.g.
  `/data/glue_like/rotten_tomatoes` reads like the project's `rotten_tomatoes` task. A folder that
  describes its own task (`task.json`, or flags) is `data.task_dir.register_task_dir`.
  ConfigError for a missing folder, a file, or a name with no local TSV layout.
  """
  folder = task_folder(path)
  name = name or os.path.basename(os.path.normpath(folder))
  known = _TASKS.get(name)
  if known is None or known.default_root is None:
    raise ConfigError(f"task directory {path!r}: no local TSV task is named {name!r} (folders named "
                      f"{', '.join(local_task_names())} are read; register others with register_local_tsv_task)")
  register(dataclasses.replace(known, local_subdir=folder, default_root=folder))
  return name


def register_mixture(name: str, task_names: Sequence[str]) -> None:
  """Registers a mixture (examples-proportional sampling over the tasks' training sets)."""
  for t in task_names:
    get_task(t)
  _MIXTURES[name] = tuple(task_names)


def _register_glue_like(root: str = DEFAULT_GLUE_LIKE_DIR) -> None:
  """The project's GLUE-layout data: SST-2-like, MRPC-like and a 5-class news task."""
  register_local_tsv_task("rotten_tomatoes", os.path.join(root, "rotten_tomatoes"), ["sentence"], "label",
                          ["negative", "positive"], metric="sst2")
  register_local_tsv_task("bible_paraphrase", os.path.join(root, "bible_paraphrase"),
                          {"sentence1": "#1 String", "sentence2": "#2 String"}, "Quality",
                          ["not_equivalent", "equivalent"], metric="mrpc")
  register_local_tsv_task("bbc_news", os.path.join(root, "bbc_news"), ["sentence"], "label",
                          ["business", "entertainment", "politics", "sports", "tech"], metric="accuracy")


_register_glue_like()
_MIXTURES["glue"] = GLUE_TASK_NAMES
_MIXTURES["glue_like"] = ("rotten_tomatoes", "bible_paraphrase", "bbc_news")
# The tasks of the package itself: a task folder's own task may not take one of these names
# with another layout (`data.task_dir`).
BUILTIN_TASK_NAMES = frozenset(_TASKS)
BUILTIN_MIXTURE_NAMES = frozenset(_MIXTURES)


def task_names() -> List[str]:
  return sorted(_TASKS)


def mixture_names() -> List[str]:
  return sorted(_MIXTURES)


def get_task(name: str) -> GlueTask:
  """The registered task `name`; ConfigError listing the valid names otherwise."""
  if name not in _TASKS:
    raise ConfigError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}; "
                      f"mixtures: {', '.join(mixture_names())}")
  return _TASKS[name]


def resolve(name: str) -> Tuple[GlueTask, ...]:
  """The tasks of a task or mixture name."""
  if name in _MIXTURES:
    return tuple(get_task(t) for t in _MIXTURES[name])
  return (get_task(name),)


def eval_tasks(name: str) -> Tuple[GlueTask, ...]:
  """The tasks evaluated for a task or mixture (GLUE: MNLI matched and mismatched)."""
  if name == "glue":
    return tuple(get_task(t) for t in GLUE_EVAL_TASK_NAMES)
  if name == "mnli":
    return (get_task("mnli_matched"), get_task("mnli_mismatched"))
  return resolve(name)


# -- reading rows -------------------------------------------------------------------------------


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
def _load_rows(name: str, split: str, glue_dir: Optional[str], tfds_data_dir: Optional[str], stamp=None):
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


def load_examples(name: str, split: str, glue_dir: Optional[str] = None,
                  tfds_data_dir: Optional[str] = None) -> Dict[str, object]:
  """Text-to-text examples of one task split, in t5's GLUE text-to-text form.

  Returns:
    dict with `inputs`, `targets` (lists of str), `labels` (int64 class ids, or float32
    scores for STS-B), `source` (file or TFDS split) and `task`.
  """
  task = get_task(name)
  (texts, labels), source = _load_rows(name, split, glue_dir, tfds_data_dir, _file_stamp(task, split, glue_dir))
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


# -- tokenized, random-access sources -----------------------------------------------------------


def tokenize(texts: Sequence[str], vocab_path: str, length: int, vocab_size: Optional[int] = None):
  """int32 `[n, length]` token ids with EOS, trimmed to `length` (EOS kept, as T5's
  `append_eos_after_trim`) and zero-padded, plus the untrimmed lengths (with EOS)."""
  vocab = vocab_lib.load_vocabulary(vocab_path)
  proc = vocab_lib.sentencepiece_processor(vocab)
  if vocab_size is not None and vocab.vocab_size > vocab_size:
    raise ConfigError(f"vocabulary {vocab_path} has {vocab.vocab_size} ids (with sentinels) but the "
                      f"model's vocab_size is {vocab_size}")
  ids = proc.EncodeAsIds(list(texts))
  out = np.zeros((len(ids), length), np.int32)
  full = np.zeros((len(ids),), np.int64)
  for row, seq in enumerate(ids):
    seq = seq[:length - 1] + [EOS_ID]
    out[row, :len(seq)] = seq
    full[row] = len(ids[row]) + 1
  return out, full


class GlueSource:
  """One split of a task or mixture as a `train.main.ExampleSource` (privacy unit: one example).

  Args:
    task_or_mixture: registered task or mixture name.
    split: "train", "validation" or "test".
    vocab_path: SentencePiece model of the model being fine-tuned.
    feature_lengths: {"inputs": Li, "targets": Lt}.
    glue_dir: local copy of the official GLUE directories (else TFDS `glue/*`).
    tfds_data_dir: TFDS data directory (default TFDS's own).
    vocab_size: the model's vocabulary size, to refuse a vocabulary that does not fit.
    progress: print loading progress to stderr.
  """

  def __init__(self, task_or_mixture: str, split: str, vocab_path: str,
               feature_lengths: Optional[Mapping[str, int]] = None, glue_dir: Optional[str] = None,
               tfds_data_dir: Optional[str] = None, vocab_size: Optional[int] = None,
               progress: bool = False):
    lengths = dict(feature_lengths or {"inputs": 512, "targets": 8})
    for key in ("inputs", "targets"):
      if not isinstance(lengths.get(key), int) or lengths[key] < 2:
        raise ConfigError(f"feature_lengths[{key!r}] must be an integer >= 2, got {lengths.get(key)!r}")
    if not vocab_path:
      raise ConfigError("vocab_path is required (the vocabulary of the model being fine-tuned)")
    self.name = task_or_mixture
    self.split = split
    self.vocab_path = vocab_path
    self._lengths = {"inputs": lengths["inputs"], "targets": lengths["targets"]}
    tasks = resolve(task_or_mixture)
    if split == "train":
      tasks = tuple(t for t in tasks if t.train_weight)
    self.tasks = tasks
    enc, tgt, task_ids, inputs, targets, labels, sources = [], [], [], [], [], [], []
    self.truncated = {}
    for i, task in enumerate(tasks):
      ex = load_examples(task.name, split, glue_dir, tfds_data_dir)
      e, e_len = tokenize(ex["inputs"], vocab_path, lengths["inputs"], vocab_size)
      t, t_len = tokenize(ex["targets"], vocab_path, lengths["targets"], vocab_size)
      if np.any(t_len > lengths["targets"]):
        raise ConfigError(f"task {task.name!r}: targets need up to {int(t_len.max())} tokens but "
                          f"feature_lengths['targets'] is {lengths['targets']}")
      if np.any(t == UNK_ID):
        bad = sorted({ex["targets"][r] for r in np.nonzero(np.any(t == UNK_ID, axis=1))[0]})
        raise ConfigError(f"task {task.name!r}: target(s) {bad[:3]} contain pieces unknown to the "
                          f"vocabulary {vocab_path}, so the model could never generate them")
      self.truncated[task.name] = float(np.mean(e_len > lengths["inputs"]))
      enc.append(e)
      tgt.append(t)
      task_ids.append(np.full(len(e), i, np.int32))
      inputs.extend(ex["inputs"])
      targets.extend(ex["targets"])
      labels.append(ex["labels"])
      sources.append(ex["source"])
      if progress:
        logger.info("[glue] %s/%s: %d examples from %s", task.name, split, len(e), ex["source"])
    self._enc = np.concatenate(enc)
    self._tgt = np.concatenate(tgt)
    self.task_ids = np.concatenate(task_ids)
    self.inputs_text = inputs
    self.targets_text = targets
    self.labels = labels  # per task
    self.sources = sources
    self.task_sizes = [len(e) for e in enc]

  @property
  def num_examples(self) -> int:
    return int(len(self._enc))

  @property
  def privacy_unit(self) -> str:
    return "example"

  @property
  def feature_lengths(self) -> Dict[str, int]:
    return dict(self._lengths)

  @property
  def vocab_size(self) -> int:
    """0: no id bound is recorded here; the vocabulary was checked against the model's
    `vocab_size` (when given) as the examples were tokenized."""
    return 0

  def user_ids(self) -> np.ndarray:
    return np.arange(self.num_examples, dtype=np.int64)

  def task_slice(self, task_name: str) -> slice:
    """Positions of one task's examples in this source."""
    i = [t.name for t in self.tasks].index(task_name)
    start = sum(self.task_sizes[:i])
    return slice(start, start + self.task_sizes[i])

  def get_batch(self, indices: Sequence[int], seed: int, batch_size: int) -> Dict[str, np.ndarray]:
    """The trainer's batch dict for `indices`, padded to `batch_size` rows (seed unused:
    classification examples have no objective noise)."""
    del seed
    return source_lib.gather_batch(self._enc, self._tgt, indices, batch_size)

  def describe(self) -> Dict[str, object]:
    return {
        "corpus": f"glue:{self.name}",
        "tasks": [t.name for t in self.tasks],
        "task_sizes": dict(zip([t.name for t in self.tasks], self.task_sizes)),
        "data_sources": self.sources,
        "split": self.split,
        "vocab_path": self.vocab_path,
        "vocab_sha256": file_sha256(self.vocab_path),
        "objective": "text_to_text",
        "feature_lengths": self.feature_lengths,
        "privacy_unit": "example",
        "num_examples": self.num_examples,
        "fraction_inputs_truncated": self.truncated,
        "mixing": "examples_proportional" if len(self.tasks) > 1 else "single_task",
    }


def make_glue_source(task_or_mixture: str, split: str = "train", vocab_path: Optional[str] = None,
                     feature_lengths: Optional[Mapping[str, int]] = None, glue_dir: Optional[str] = None,
                     tfds_data_dir: Optional[str] = None, vocab_size: Optional[int] = None,
                     progress: bool = True) -> GlueSource:
  """The Gin-facing factory of `GlueSource`.

  `vocab_path` is the fine-tuned model's vocabulary; the fine-tuning config resolves it
  (from `VOCAB_PATH`, or the vocabulary recorded with `INITIAL_CHECKPOINT`) with
  `train.initial_checkpoint.finetune_vocab_path` before it reaches here.
  """
  return GlueSource(task_or_mixture, split, vocab_path, feature_lengths, glue_dir=glue_dir,
                    tfds_data_dir=tfds_data_dir, vocab_size=vocab_size, progress=progress)
