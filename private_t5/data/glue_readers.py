"""Raw GLUE rows as dicts: the official GLUE download, GLUE-like TSV folders and TFDS `glue/*`.

The text-to-text tasks of `glue_tasks` read the columns they need; this reader returns whole
rows with T5's GLUE field names (those of TFDS `glue/<task>`, which `t5.data.glue_utils` and
the T5 GLUE tasks use): e.g. SST-2 -> {"sentence", "label", "idx"}, MRPC -> {"sentence1",
"sentence2", "label", "idx"}, MNLI -> {"premise", "hypothesis", "label", "idx"}. Unlabelled
test rows get label -1 (as in TFDS). The official layouts (folder, columns, label names) are
those of the `glue_tasks` registry.

Supported layouts:

* the official GLUE download (`SST-2/train.tsv`, `CoLA/dev.tsv` without header,
  `MRPC/msr_paraphrase_train.txt`, `MNLI/dev_matched.tsv`, …): split "validation" reads `dev`;
* a GLUE-like folder `<task>/{train,validation,test}.tsv` with a header row (as in
  ../shared/data/glue_like); columns named like a GLUE task (MRPC's `Quality`, `#1 String`,
  `#2 String`; SST-2's `sentence`, `label`) are mapped, other columns are kept by name;
* `tfds:glue/<task>` (TFDS must have it prepared under `data_dir`).
"""
import os
from typing import Dict, List, Optional, Sequence

from private_t5.data import glue_registry
from private_t5.data import glue_rows
from private_t5.data import tfds as tfds_lib
from private_t5.errors import ConfigError, DataError


_ALIASES = {glue_registry.get_task(name).local_subdir.lower(): name for name in glue_registry.GLUE_TASK_NAMES}
_ALIASES.update({"sst-2": "sst2", "sts-b": "stsb"})
SPLITS = ("train", "validation", "test", "validation_matched", "validation_mismatched", "test_matched",
          "test_mismatched")


def canonical_task_name(name: str) -> Optional[str]:
  """'SST-2' / 'sst2' / 'glue/sst2' -> 'sst2'; None for a task that is not GLUE's."""
  key = name.strip().lower().split("/")[-1]
  if key in glue_registry.GLUE_TASK_NAMES:
    return key
  return _ALIASES.get(key)


def _split_files(task: Optional[str], split: str) -> Sequence[str]:
  """Candidate file names for a split, GLUE-like names first, then the official ones."""
  official = {"validation": "dev", "validation_matched": "dev_matched",
              "validation_mismatched": "dev_mismatched"}.get(split, split)
  names = [f"{split}.tsv", f"{official}.tsv"]
  if task == "mrpc":
    names.append({"train": "msr_paraphrase_train.txt", "test": "msr_paraphrase_test.txt"}.get(split, ""))
  if task == "mnli" and split in ("validation", "test"):
    names.append(f"{official}_matched.tsv")
  return [n for n in dict.fromkeys(names) if n]


def _convert_label(value: str, task: Optional[glue_registry.GlueTask], where: str):
  if task is not None:
    return glue_rows.parse_label(task, value, where)
  value = value.strip()  # a GLUE-like task of its own: keep class names, numbers as numbers
  try:
    return int(value)
  except ValueError:
    try:
      return float(value)
    except ValueError:
      return value


# Column names of GLUE-like TSVs mapped onto T5 field names (MRPC's layout).
_GENERIC_RENAMES = {"Quality": "label", "#1 String": "sentence1", "#2 String": "sentence2"}


def _examples_from_file(path: str, task: Optional[str], max_examples: Optional[int]) -> List[Dict[str, object]]:
  layout = glue_registry.get_task(task) if task else None
  header_row = True
  if layout is not None and not layout.header:
    # CoLA train/dev have no header; its test.tsv has one ("index", "sentence").
    with open(path, encoding="utf-8-sig") as f:
      first = f.readline().split("\t")
    header_row = first[0].strip() == "index"
  header, rows = glue_rows.read_tsv(path, header_row)
  examples = []
  for idx, (lineno, row) in enumerate(rows):
    if max_examples is not None and idx >= max_examples:
      break
    where = f"{path}: line {lineno}"

    def cell(column, required=True):
      if isinstance(column, int):
        pos = column
      elif header is not None and column in header:
        pos = header.index(column)
      elif not required:
        return None
      else:
        raise DataError(f"{path}: no column {column!r} (columns: {header})")
      if pos >= len(row):  # a file without a header (with one, every row was checked above)
        raise DataError(f"{where}: ragged row: {len(row)} tab-separated columns, expected at least {pos + 1}")
      return row[pos]

    if header is not None and len(row) != len(header):  # named as such, not as a bad label or text
      raise DataError(f"{where}: ragged row: {len(row)} tab-separated columns, the header has {len(header)}")
    if layout is not None:
      fields, label_column = layout.text_columns, layout.label_column
      if header is not None and not layout.header:  # CoLA's test.tsv: named columns
        fields, label_column = {f: f for f in fields}, "label"
      ex = {field: cell(column) for field, column in fields.items()}
      # Only official test files lack labels; elsewhere a missing label column is an error.
      unlabelled = os.path.basename(path).startswith("test")
      label = cell(label_column, required=not unlabelled)
      ex["label"] = -1 if label is None else _convert_label(label, layout, where)
    else:
      if header is None:
        raise DataError(f"{path}: a header row is required")
      ex = {_GENERIC_RENAMES.get(name, name): value for name, value in zip(header, row)}
      if "label" in ex:
        ex["label"] = _convert_label(ex["label"], None, where)
    ex["idx"] = idx
    examples.append(ex)
  return examples


def _from_tfds(name: str, split: str, data_dir: Optional[str], max_examples: Optional[int]):
  ds = tfds_lib.split_dataset(tfds_lib.prepared_builder(name, data_dir), name, split)
  if max_examples is not None:
    ds = ds.take(max_examples)
  out = []
  for ex in ds.as_numpy_iterator():
    out.append({k: (v.decode("utf-8") if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v)
                for k, v in ex.items()})
  return out


def load_glue(task: str, split: str = "train", *, data_dir: Optional[str] = None,
              max_examples: Optional[int] = None) -> List[Dict[str, object]]:
  """Reads one split of a GLUE(-like) task.

  Args:
    task: a folder (`/data/glue/SST-2`, `../shared/data/glue_like/rotten_tomatoes`), a task
      name found under `data_dir` (`sst2`, `SST-2`, `bible_paraphrase`), or `tfds:glue/sst2`.
    split: "train", "validation", "test" (MNLI: also "validation_matched", …).
    data_dir: the folder holding task folders (or the TFDS data dir for `tfds:`).
    max_examples: read at most this many rows.

  Returns:
    A list of dicts with T5's GLUE field names and `idx`.

  Raises:
    DataError: missing folder/file/column, malformed row or label.
    ConfigError: an unknown split.
  """
  if split not in SPLITS:
    raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
  if task.startswith("tfds:"):
    return _from_tfds(task[len("tfds:"):], split, data_dir, max_examples)
  folder = os.path.expanduser(task)
  if not os.path.isdir(folder):
    candidates = [os.path.join(data_dir, task)] if data_dir else []
    canonical = canonical_task_name(task)
    if data_dir and canonical:
      candidates.append(os.path.join(data_dir, glue_registry.get_task(canonical).local_subdir))
    folder = next((c for c in candidates if os.path.isdir(c)), None)
    if folder is None:
      raise DataError(f"GLUE task folder not found: {task!r}" + (f" (looked in {data_dir})" if data_dir else ""))
  name = canonical_task_name(os.path.basename(os.path.normpath(folder)))
  for file_name in _split_files(name, split):
    path = os.path.join(folder, file_name)
    if os.path.isfile(path):
      examples = _examples_from_file(path, name, max_examples)
      if not examples:
        raise DataError(f"{path}: no examples")
      return examples
  raise DataError(f"{folder}: no file for split {split!r} (tried {', '.join(_split_files(name, split))}; "
                  f"found {sorted(os.listdir(folder))})")
