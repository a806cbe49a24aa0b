"""A user's own GLUE-layout task folder, described by a `task.json` beside its TSV files or by flags.

  /data/my_task/train.tsv, validation.tsv (or dev.tsv), test.tsv   (tab-separated, a header row)
  /data/my_task/task.json  {"text_fields": ["sentence"], "label_field": "label",
                            "label_names": ["old", "new"], "metric": "accuracy"}

`register_task_dir` registers the folder's task with `glue_tasks` (what a Python launcher calling
`glue_tasks.register_local_tsv_task` did) and returns its name, so that `private-t5 train`,
`evaluate` and `study --part=utility` read it by `--task_dir=DIR` alone. The keys of `task.json`
(`TASK_FILE_KEYS`), each also a flag of those stages that overrides it:

* `text_fields` (`--text_fields=a,b`): the text columns in input order; in `task.json` also a
  mapping feature -> column (`{"sentence1": "#1 String", "sentence2": "#2 String"}`);
* `label_field` (`--label_field`): the label column; a label cell holds a name or its index;
* `label_names` (`--label_names=old,new`): the class names in index order (the targets); absent for
  the regression metric `stsb` (a score per row, STS-B's layout `sentence1`, `sentence2`);
* `metric` (`--metric`, default `accuracy`): a key of `eval.glue_metrics.TASK_METRICS`
  (`glue_tasks.METRIC_NAMES`);
* `name` (`--task` / `MIXTURE_OR_TASK_NAME` overrides it): the task's name and input prefix, by
  default the folder's name. A built-in task's name is refused unless the layout is that task's.

A folder with neither `task.json` nor a described flag is read like the local task of its name,
as before (`glue_tasks.register_task_dir`: `.../rotten_tomatoes`). Every problem (a file that is
not JSON, an unknown key, a value of the wrong type, a missing key, an unknown metric, a column
missing from a header, a label found in a file that is no label name) is a one-line ConfigError
naming it, raised before any training.

`task_name` is the Gin-facing entry (`glue_task` in the Gin table): it imports `TASK_MODULE`
first (modules that register tasks in code, also imported in every worker process of the run,
`user_modules.pool_kwargs`), then registers `TASK_DIR` when one is given.
"""
import json
import logging
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from private_t5 import user_modules
from private_t5.data import glue_registry
from private_t5.data import glue_rows
from private_t5.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

TASK_FILE = "task.json"
TASK_FILE_KEYS = ("name", "text_fields", "label_field", "label_names", "metric")
DESCRIPTION_FLAGS = ("text_fields", "label_field", "label_names", "metric")
DEFAULT_METRIC = "accuracy"
REGRESSION_METRICS = ("stsb",)
StringList = Union[None, str, Sequence[str]]


def _show(value) -> str:
  return f"{value!r} ({type(value).__name__})"


def read_task_file(folder: str) -> Dict[str, object]:
  """The description in `folder/task.json` ({} when there is none); ConfigError when it is not a
  JSON object of the known keys."""
  path = os.path.join(folder, TASK_FILE)
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding="utf-8-sig") as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path} is not JSON: invalid UTF-8 ({e.reason})") from None
  except OSError as e:
    raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
  if not isinstance(data, dict):
    raise ConfigError(f"{path} must hold a JSON object such as {{\"text_fields\": [\"sentence\"], "
                      f"\"label_field\": \"label\", \"label_names\": [\"no\", \"yes\"]}}, got a JSON "
                      f"{type(data).__name__}")
  unknown = [k for k in data if k not in TASK_FILE_KEYS]
  if unknown:
    raise ConfigError(f"{path}: unknown key(s) {', '.join(repr(k) for k in unknown)} "
                      f"(the keys are {', '.join(TASK_FILE_KEYS)})")
  return data


def _names(value, key: str) -> Tuple[str, ...]:
  """A list of non-empty strings, or one string of comma-separated names; `key` names the setting."""
  if isinstance(value, str):
    value = value.split(",")
  if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
    raise ConfigError(f"{key} must be a list of strings (or one string of comma-separated names), got {_show(value)}")
  names = tuple(v.strip() for v in value)
  if not names or not all(names):
    raise ConfigError(f"{key} must name at least one column or class, none empty, got {list(value)!r}")
  if len(set(names)) != len(names):
    raise ConfigError(f"{key} names one entry twice: {list(names)!r}")
  return names


def _text_fields(value, key: str) -> Dict[str, str]:
  """feature -> column of the `text_fields` value (a list of columns, or a mapping in task.json)."""
  if isinstance(value, Mapping):
    if not value or not all(isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip()
                            for k, v in value.items()):
      raise ConfigError(f"{key} as a mapping must map feature names to column names (non-empty strings), "
                        f"got {dict(value)!r}")
    return {k.strip(): v.strip() for k, v in value.items()}
  return {name: name for name in _names(value, key)}


def _string(value, key: str) -> str:
  if not isinstance(value, str) or not value.strip():
    raise ConfigError(f"{key} must be a non-empty string, got {_show(value)}")
  return value.strip()


def description(folder: str, *, text_fields: StringList = None, label_field: Optional[str] = None,
                label_names: StringList = None, metric: Optional[str] = None) -> Optional[Dict[str, object]]:
  """The folder's description: `task.json` with the given flags over it; None when neither describes it."""
  data = dict(read_task_file(folder))
  flags = {"text_fields": text_fields, "label_field": label_field, "label_names": label_names, "metric": metric}
  given = {k: v for k, v in flags.items() if v is not None}
  if not data and not given:
    return None
  data.update(given)
  return data


def _label_column_values(task: glue_registry.GlueTask, path: str) -> List[Tuple[int, str]]:
  """(line, label cell) of a split file, after checking that the header has every column named and
  that every row has as many cells as the header (a ragged row is named as such, not as a bad label)."""
  header, rows = glue_rows.read_tsv(path, True)
  columns = [task.text_columns[f] for f in task.feature_names] + [task.label_column]
  missing = [c for c in columns if c not in header]
  if missing:
    raise ConfigError(f"task {task.name!r}: {path} has no column {', '.join(repr(c) for c in missing)} "
                      f"(its header: {', '.join(header)}); text_fields and label_field name header columns")
  for line, row in rows:
    if len(row) != len(header):
      raise ConfigError(f"task {task.name!r}: {path}: line {line} is a ragged row: {len(row)} tab-separated "
                        f"columns, the header has {len(header)} (a tab inside a text, or a missing cell?)")
  index = header.index(task.label_column)
  return [(line, row[index]) for line, row in rows]


def check_labels(task: glue_registry.GlueTask) -> None:
  """Every label cell of the train and validation files is a label name (or its index), or a number
  for a regression task; one ConfigError listing those found that are not."""
  for split in ("train", "validation"):
    try:
      path = glue_rows.split_path(task, split, None)
    except DataError:
      continue  # a missing split is named when it is read (evaluation needs no train split)
    bad = {}
    for line, value in _label_column_values(task, path):
      try:
        glue_rows.parse_label(task, value, f"{path}:{line}")
      except DataError:
        bad.setdefault(value.strip(), line)
    if bad:
      shown = ", ".join(repr(v) for v in list(bad)[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
      if task.is_regression:
        raise ConfigError(f"task {task.name!r}: {path} has label(s) {shown} that are not numbers (metric "
                          f"{task.metric!r} is a regression: a score per row)")
      raise ConfigError(f"task {task.name!r}: the label(s) {shown} found in {path} (first at line "
                        f"{min(bad.values())}) are not among label_names {', '.join(task.label_names)} "
                        f"(nor 0..{len(task.label_names) - 1})")


def layout(task: glue_registry.GlueTask) -> Dict[str, object]:
  """The description of `task` as JSON (what a utility study records of a task of its own description)."""
  return {"name": task.name, "text_fields": {f: task.text_columns[f] for f in task.feature_names},
          "label_field": task.label_column, "label_names": list(task.label_names) if task.label_names else None,
          "metric": task.metric}


def _same_layout(a: glue_registry.GlueTask, b: glue_registry.GlueTask) -> bool:
  keys = ("benchmark_name", "feature_names", "label_names", "metric", "text_columns", "label_column", "header")
  return all(getattr(a, k) == getattr(b, k) for k in keys)


def _layout(task: glue_registry.GlueTask) -> str:
  labels = ", ".join(task.label_names) if task.label_names else "a score (regression)"
  return (f"text fields {', '.join(str(task.text_columns[f]) for f in task.feature_names)}, label field "
          f"{task.label_column}, labels {labels}, metric {task.metric}")


def task_from_description(folder: str, described: Mapping[str, object], name: Optional[str] = None,
                          flags: Sequence[str] = ()) -> glue_registry.GlueTask:
  """The task a description gives (not registered): its keys checked, its name, its metric.

  `flags`: the keys given as flags (named `--key` in messages; the others `key` of task.json).
  """
  task_file = os.path.join(folder, TASK_FILE)

  def where(key: str) -> str:
    return f"--{key}" if key in flags else f"{key} of {task_file}"

  name = _string(name, "--task") if name is not None else _string(described.get("name", os.path.basename(folder)),
                                                                  where("name"))
  source = f"{task_file} or as --text_fields=..., --label_field=..., --label_names=..."
  metric = _string(described.get("metric", DEFAULT_METRIC), where("metric"))
  if metric not in glue_registry.METRIC_NAMES:
    raise ConfigError(f"task {name!r}: unknown metric {metric!r} (one of {', '.join(sorted(glue_registry.METRIC_NAMES))})")
  regression = metric in REGRESSION_METRICS
  required = ("text_fields", "label_field") + (() if regression else ("label_names",))
  missing = [k for k in required if described.get(k) is None]
  if missing:
    raise ConfigError(f"task {name!r} of {folder}: missing {', '.join(missing)} (give {'them' if len(missing) > 1 else 'it'} "
                      f"in {source})")
  columns = _text_fields(described["text_fields"], where("text_fields"))
  label_names = None
  if regression:
    if described.get("label_names") is not None:
      raise ConfigError(f"task {name!r}: metric {metric!r} is a regression (a score per row): give no label_names")
    if tuple(columns) != ("sentence1", "sentence2"):
      raise ConfigError(f"task {name!r}: metric {metric!r} reads STS-B's layout, text_fields sentence1, sentence2 "
                        f"(a mapping to your columns in {TASK_FILE}), got {', '.join(columns)}")
  else:
    label_names = _names(described["label_names"], where("label_names"))
    if len(label_names) < 2:
      raise ConfigError(f"task {name!r}: label_names must name at least 2 classes, got {list(label_names)!r}")
  return glue_registry.local_tsv_task(name, folder, columns, _string(described["label_field"], where("label_field")),
                                   label_names, metric=metric)


def register_task_dir(path: str, *, name: Optional[str] = None, text_fields: StringList = None,
                      label_field: Optional[str] = None, label_names: StringList = None,
                      metric: Optional[str] = None) -> str:
  """Registers the task of folder `path` (described by its `task.json` and the flags given, which
  override it; else named like a local task) and returns its name; ConfigError in one line."""
  folder = glue_registry.task_folder(path)
  described = description(folder, text_fields=text_fields, label_field=label_field, label_names=label_names,
                          metric=metric)
  if described is None:
    default = name or os.path.basename(os.path.normpath(folder))
    if default not in glue_registry.local_task_names():
      raise ConfigError(
          f"task directory {path!r}: no {TASK_FILE} and no --text_fields, --label_field, --label_names describe "
          f"task {default!r}; write {os.path.join(folder, TASK_FILE)} (docs/finetuning.md, \"Your own task\") or "
          f"name the folder like a local task ({', '.join(glue_registry.local_task_names())})")
    return glue_registry.register_task_dir(folder, default)
  flags = [k for k, v in (("text_fields", text_fields), ("label_field", label_field), ("label_names", label_names),
                          ("metric", metric)) if v is not None]
  task = task_from_description(folder, described, name, flags)
  known = glue_registry.BUILTIN_TASK_NAMES | glue_registry.BUILTIN_MIXTURE_NAMES
  if task.name in known:
    builtin = glue_registry.get_task(task.name) if task.name in glue_registry.BUILTIN_TASK_NAMES else None
    if builtin is None or not _same_layout(builtin, task):
      what = f"a built-in task of another layout ({_layout(builtin)})" if builtin else "a built-in mixture"
      how = "the folder's name" if name is None and "name" not in described else "its name"
      raise ConfigError(f"task directory {path!r}: {task.name!r} ({how}) is {what}; give your task another "
                        f"name (\"name\" in {TASK_FILE}, or --task=NAME)")
  check_labels(task)
  if task.name not in glue_registry.task_names() or glue_registry.get_task(task.name) != task:  # newly registered
    logger.info("task %r of %s (%s): %s", task.name, folder,
                ", ".join([TASK_FILE] * os.path.isfile(os.path.join(folder, TASK_FILE)) + [f"--{k}" for k in flags])
                or TASK_FILE, _layout(task))
  glue_registry.register(task)
  return task.name


def task_name(name: Optional[str] = None, task_dir: Optional[str] = None,
              module: Union[None, str, Sequence[str]] = None, text_fields: StringList = None,
              label_field: Optional[str] = None, label_names: StringList = None,
              metric: Optional[str] = None) -> str:
  """The task or mixture a fine-tuning or evaluation run reads (Gin: `glue_task`, whose value is
  `MIXTURE_OR_TASK_NAME` for the data): imports `module` (TASK_MODULE), registers `task_dir`
  (TASK_DIR, with the description flags) and returns the name; else checks `name` is registered."""
  user_modules.import_modules(module, "TASK_MODULE", in_workers=True)
  if task_dir is not None:
    return register_task_dir(task_dir, name=name, text_fields=text_fields, label_field=label_field,
                             label_names=label_names, metric=metric)
  given = [f"--{k}" for k, v in (("text_fields", text_fields), ("label_field", label_field),
                                 ("label_names", label_names), ("metric", metric)) if v is not None]
  if given:
    raise ConfigError(f"{', '.join(given)} {'describes' if len(given) == 1 else 'describe'} the task of a folder: "
                      "give --task_dir=DIR too")
  if not isinstance(name, str) or not name:
    raise ConfigError("MIXTURE_OR_TASK_NAME is required: pass --gin.MIXTURE_OR_TASK_NAME=... (a registered task "
                      "or mixture) or --task_dir=DIR (a task folder)")
  glue_registry.resolve(name)  # an unknown name lists the valid ones
  return name
