"""The registry of text-to-text classification tasks and mixtures, by name.

It holds GLUE's tasks (the official GLUE TSV layouts and TFDS `glue/<task>` names), the three
`glue_like` tasks shipped with the package, and the user's own: any directory of
`{train,validation,test}.tsv` files with a header row, registered with `register_local_tsv_task`
(how a user adds their own classification task in code), pointed at another folder with
`register_task_dir`, or described by its own `task.json` or the command line's flags
(`data.task_dir`, `--task_dir=DIR`). A `GlueTask` says where a task's rows are and how they read;
reading them is `data.glue_rows`.
"""
import dataclasses
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from private_t5.errors import ConfigError

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
# What `register` calls when a task changes (`on_change`).
_ON_CHANGE: List[Callable[[], None]] = []


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
    for callback in _ON_CHANGE:  # Re-registering a name must not serve stale rows.
      callback()
  return task


def on_change(callback: Callable[[], None]) -> None:
  """Calls `callback` whenever `register` changes a task (a cache of rows read by task name)."""
  _ON_CHANGE.append(callback)


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
