"""A user's own task from the command line: a GLUE-layout folder described by `task.json` or by flags.

The folder the tests create is named like no built-in task (`my_task`, labels `old` / `new`, as a
new user would write it). A DP fine-tuning run by `--task_dir` gives exactly the run of the Python
launcher it replaces (`register_local_tsv_task`, then the stage); the flags describe the same
examples as `task.json`; every bad description is one line; `TASK_MODULE` registers tasks in code
(in the workers of a pool too); `epsilon` without --delta uses training's default δ. The utility
study on a folder described by `task.json` is tests/test_study_utility.py's smoke run.
"""
import ast
import json
import multiprocessing
import os
import pathlib

import jax
import numpy as np
import pytest

from private_t5 import user_modules
from private_t5.data import glue_registry
from private_t5.data import glue_rows
from private_t5.data import task_dir
from private_t5.errors import ConfigError
from private_t5.stages import cli
from private_t5.stages import train as train_stage

from conftest import shared_or_fixture

TRAIN_ROWS, VALIDATION_ROWS = 200, 40
DESCRIPTION = {"text_fields": ["sentence"], "label_field": "label", "label_names": ["old", "new"],
               "metric": "accuracy"}
FLAGS = ["--text_fields=sentence", "--label_field=label", "--label_names=old,new", "--metric=accuracy"]
# The micro T5 of tests/micro_run.py on configs/runs/finetune_dp.gin: a few steps of DP-Adafactor
# from scratch, σ fixed (no calibration), fixed seeds (insecure: tests only).
MICRO_FINETUNE_ARGS = [
    "--gin_file=configs/models/t5_1_0_tiny.gin", "--gin_file=configs/runs/finetune_dp.gin",
    "--gin.INITIAL_CHECKPOINT=None", "--gin.VOCAB_SIZE=512", "--gin.T5Config.d_model=32",
    "--gin.T5Config.num_heads=2", "--gin.T5Config.d_ff=64", "--gin.T5Config.num_encoder_layers=1",
    "--gin.T5Config.num_decoder_layers=1", "--gin.BATCH_SIZE=8", "--gin.TRAIN_STEPS=2",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 4}", "--gin.train.mesh_shape=(1, 1)",
    "--gin.train.eval_examples=16", "--gin.train.insecure_deterministic_seed=1234",
    "--gin.DPConfig.target_epsilon=None", "--gin.DPConfig.noise_multiplier=1.0",
    "--gin.DPConfig.expected_batch_size=None", "--gin.train.microbatch_size=8", "--gin.train.clipping_method='vmap'"]


def make_task_folder(root: pathlib.Path, name: str = "my_task", description=None) -> pathlib.Path:
  """`root/name/{train,validation,test}.tsv` (header `sentence<TAB>label`, labels old / new: the
  rows of rotten_tomatoes), with `task.json` when a description is given."""
  with open(shared_or_fixture("glue_like/rotten_tomatoes/train.tsv"), encoding="utf-8") as f:
    rows = [line.rstrip("\n").split("\t") for line in f][1:TRAIN_ROWS + 2 * VALIDATION_ROWS + 1]
  folder = root / name
  folder.mkdir(parents=True)
  parts = {"train": rows[:TRAIN_ROWS], "validation": rows[TRAIN_ROWS:TRAIN_ROWS + VALIDATION_ROWS],
           "test": rows[TRAIN_ROWS + VALIDATION_ROWS:]}
  for split, part in parts.items():
    (folder / f"{split}.tsv").write_text(
        "sentence\tlabel\n" + "".join(f"{s}\t{'new' if label == '1' else 'old'}\n" for s, label in part),
        encoding="utf-8")
  if description is not None:
    (folder / task_dir.TASK_FILE).write_text(json.dumps(description), encoding="utf-8")
  return folder


def _examples(name: str, split: str = "train"):
  ex = glue_rows.load_examples(name, split)
  return ex["inputs"], ex["targets"], ex["labels"].tolist()


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  assert "Traceback" not in err
  lines = [l for l in err.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1, err
  return lines[0]


# -- the description ----------------------------------------------------------------------------


def test_task_json_flags_and_the_launcher_give_the_same_examples(tmp_path):
  launcher = glue_registry.register_local_tsv_task("my_task", str(make_task_folder(tmp_path / "a")), ["sentence"],
                                                "label", ["old", "new"])
  want = {split: _examples("my_task", split) for split in ("train", "validation")}
  inputs, targets, labels = want["train"]
  assert len(inputs) == TRAIN_ROWS and inputs[0].startswith("my_task sentence: ") and set(targets) == {"old", "new"}
  by_file = make_task_folder(tmp_path / "b", description=DESCRIPTION)
  assert task_dir.register_task_dir(str(by_file)) == "my_task"
  assert {s: _examples("my_task", s) for s in want} == want
  assert glue_registry.get_task("my_task").metric == "accuracy"
  # The same description as flags, on a folder without task.json (the train/evaluate/study flags).
  by_flags = make_task_folder(tmp_path / "c")
  assert task_dir.task_name(None, str(by_flags), None, "sentence", "label", "old,new", "accuracy") == "my_task"
  assert {s: _examples("my_task", s) for s in want} == want
  assert glue_registry.get_task("my_task") == glue_registry.local_tsv_task(
      "my_task", str(by_flags), ["sentence"], "label", ["old", "new"]) != launcher  # only the folder differs


def test_the_study_takes_the_flags_too(tmp_path, capsys):
  """`study --part=utility` with the flags registers the task of task.json's examples before its
  first phase (the study itself runs on a task.json folder in tests/test_study_utility.py)."""
  want = make_task_folder(tmp_path / "a", description=DESCRIPTION)
  task_dir.register_task_dir(str(want))
  examples = {split: _examples("my_task", split) for split in ("train", "validation")}
  bare = make_task_folder(tmp_path / "b")
  assert cli.main(["study", "--part=utility", f"--corpus={tmp_path}/none.jsonl", f"--output={tmp_path}/out",
                   f"--task_dir={bare}", *FLAGS]) == 2
  assert _one_error_line(capsys) == f"error: corpus not found: {tmp_path}/none.jsonl"  # past the task
  assert glue_registry.get_task("my_task").local_subdir == str(bare)
  assert {split: _examples("my_task", split) for split in examples} == examples


def test_flags_override_task_json_and_name_the_task(tmp_path):
  folder = make_task_folder(tmp_path, description={**DESCRIPTION, "label_names": ["a", "b"], "name": "reviews"})
  with pytest.raises(ConfigError, match=r"the label\(s\) 'new', 'old' found in .*train.tsv .*not among label_names a, b"):
    task_dir.register_task_dir(str(folder))
  assert task_dir.register_task_dir(str(folder), label_names="old,new", metric="sst2") == "reviews"
  task = glue_registry.get_task("reviews")
  assert task.label_names == ("old", "new") and task.metric == "sst2"
  assert _examples("reviews")[0][0].startswith("reviews sentence: ")
  # MIXTURE_OR_TASK_NAME (--task) names it over task.json's "name".
  assert task_dir.register_task_dir(str(folder), name="mine", label_names="old,new") == "mine"


def test_a_folder_named_like_a_builtin_task_keeps_its_layout(tmp_path):
  folder = tmp_path / "rotten_tomatoes"
  folder.mkdir()
  for split in ("train", "validation"):
    folder.joinpath(f"{split}.tsv").write_text("sentence\tlabel\na gem\t1\na dud\tnegative\n", encoding="utf-8")
  try:
    assert task_dir.task_name(None, str(folder)) == "rotten_tomatoes"
    assert _examples("rotten_tomatoes") == (["rotten_tomatoes sentence: a gem", "rotten_tomatoes sentence: a dud"],
                                            ["positive", "negative"], [1, 0])
    # The same layout described again is that task; another layout under its name is refused.
    same = {"text_fields": ["sentence"], "label_field": "label", "label_names": ["negative", "positive"],
            "metric": "sst2"}
    assert task_dir.register_task_dir(str(folder), **same) == "rotten_tomatoes"
    with pytest.raises(ConfigError) as error:
      task_dir.register_task_dir(str(folder), **{**same, "metric": "accuracy"})
    assert str(error.value) == (
        f"task directory {str(folder)!r}: 'rotten_tomatoes' (the folder's name) is a built-in task of another "
        "layout (text fields sentence, label field label, labels negative, positive, metric sst2); give your "
        "task another name (\"name\" in task.json, or --task=NAME)")
  finally:
    glue_registry._register_glue_like()  # pylint: disable=protected-access  # the built-in folder again


# (task.json text or None, flags, a part of the one line). The folder is named like no task any
# test registers (a folder named like a registered local task needs no description).
BAD_TASK = "t5test_bad_task"
BAD_DESCRIPTIONS = [
    (None, [], "no task.json and no --text_fields, --label_field, --label_names describe task '{name}'"),
    ("{'text_fields': 1}", [], "task.json is not JSON: Expecting property name enclosed in double quotes"),
    ("[1, 2]", [], "task.json must hold a JSON object"),
    (json.dumps({**DESCRIPTION, "labels": ["old", "new"]}), [], "task.json: unknown key(s) 'labels'"),
    (json.dumps({"text_fields": ["sentence"], "label_names": ["old", "new"]}), [],
     "task '{name}' of {folder}: missing label_field (give it in {folder}/task.json or as --text_fields=..."),
    (None, ["--text_fields=sentence"], "task '{name}' of {folder}: missing label_field, label_names"),
    (json.dumps(DESCRIPTION), ["--metric=f1"], "task '{name}': unknown metric 'f1' (one of accuracy, cola, mnli"),
    (json.dumps(DESCRIPTION), ["--label_names=old,newer"],
     "task '{name}': the label(s) 'new' found in {folder}/train.tsv (first at line 2) are not among label_names "
     "old, newer (nor 0..1)"),
    (json.dumps(DESCRIPTION), ["--text_fields=review"], "task '{name}': {folder}/train.tsv has no column 'review' "
     "(its header: sentence, label)"),
    (json.dumps({**DESCRIPTION, "label_names": "old"}), [], "task '{name}': label_names must name at least 2 classes"),
    (json.dumps({**DESCRIPTION, "label_names": [0, 1]}), [],
     "label_names of {folder}/task.json must be a list of strings (or one string of comma-separated names), "
     "got [0, 1] (list)"),
    (json.dumps({**DESCRIPTION, "label_field": True}), [],
     "label_field of {folder}/task.json must be a non-empty string, got True (bool)"),
    (json.dumps({**DESCRIPTION, "name": "glue"}), [], "'glue' (its name) is a built-in mixture"),
    (json.dumps(DESCRIPTION), ["--metric=stsb"], "metric 'stsb' is a regression (a score per row): give no label_names"),
]


@pytest.mark.parametrize("stage", ["evaluate", "train", "study"])
def test_every_bad_description_is_one_line_and_writes_nothing(stage, tmp_path, capsys):
  for k, (task_json, flags, message) in enumerate(BAD_DESCRIPTIONS):
    folder = make_task_folder(tmp_path / str(k), BAD_TASK)
    if task_json is not None:
      (folder / task_dir.TASK_FILE).write_text(task_json, encoding="utf-8")
    out = tmp_path / f"out{k}"
    argv = {"evaluate": ["evaluate", "--gin_file=configs/runs/eval.gin", f"--model_dir={out}"],
            "train": ["train", *MICRO_FINETUNE_ARGS, f"--model_dir={out}", f"--vocab_path={tmp_path}/none.model"],
            "study": ["study", "--part=utility", f"--corpus={tmp_path}/none.jsonl", f"--output={out}"]}[stage]
    assert cli.main([*argv, f"--task_dir={folder}", *flags]) == 2
    line = _one_error_line(capsys)
    assert message.format(folder=folder, name=BAD_TASK) in line, (message, line)
    assert not out.exists()


def test_a_ragged_row_is_named_as_such_not_as_a_bad_label(tmp_path, capsys):
  folder = make_task_folder(tmp_path, BAD_TASK, DESCRIPTION)
  with open(folder / "train.tsv", "a", encoding="utf-8") as f:
    f.write("a review\twith a tab\tnew\n")  # line TRAIN_ROWS + 2
  out = tmp_path / "out"
  assert cli.main(["evaluate", "--gin_file=configs/runs/eval.gin", f"--model_dir={out}", f"--task_dir={folder}"]) == 2
  assert _one_error_line(capsys) == (
      f"error: task {BAD_TASK!r}: {folder}/train.tsv: line {TRAIN_ROWS + 2} is a ragged row: 3 tab-separated columns, "
      "the header has 2 (a tab inside a text, or a missing cell?)")
  assert not out.exists()


@pytest.mark.parametrize("gin_file,entry", [
    ("configs/runs/finetune.gin", "train"), ("configs/runs/finetune_dp.gin", "train"),
    ("configs/runs/finetune_lora.gin", "train"), ("configs/runs/finetune_lora_dp.gin", "train"),
    ("configs/runs/eval.gin", "evaluate")])
def test_every_finetuning_and_evaluation_config_reads_the_folder(gin_file, entry, tmp_path):
  from private_t5.stages import gin_utils  # pylint: disable=g-import-not-at-top
  folder = make_task_folder(tmp_path)
  bindings = train_stage.with_task_dir_name([f"TASK_DIR={str(folder)!r}", "TASK_TEXT_FIELDS='sentence'",
                                             "TASK_LABEL_FIELD='label'", "TASK_LABEL_NAMES='old,new'"])
  gin_utils.parse(["configs/models/t5_1_0_tiny.gin", gin_file], bindings, check_required=False, entry=entry)
  assert gin_utils.configured("glue_task")() == "my_task"
  assert glue_registry.get_task("my_task").local_subdir == str(folder)


def test_a_task_needs_a_name_or_a_folder(capsys):
  with pytest.raises(ConfigError, match="MIXTURE_OR_TASK_NAME is required: pass --gin.MIXTURE_OR_TASK_NAME=... "):
    task_dir.task_name(None)
  with pytest.raises(ConfigError, match=r"^--label_names describes the task of a folder: give --task_dir=DIR too$"):
    task_dir.task_name("sst2", label_names="a,b")
  # Without --task_dir the stages still say which macro is missing.
  assert cli.main(["evaluate", "--gin_file=configs/runs/eval.gin", "--model_dir=/tmp/x"]) == 2
  assert "missing required Gin macro(s): MIXTURE_OR_TASK_NAME" in _one_error_line(capsys)
  # A folder's description without the folder (and without a task name) is named as such.
  assert cli.main(["evaluate", "--gin_file=configs/runs/eval.gin", "--model_dir=/tmp/x", "--label_names=x,y"]) == 2
  assert _one_error_line(capsys) == "error: --label_names describes the task of a folder: give --task_dir=DIR too"
  assert cli.main(["train", "--gin_file=configs/models/t5_1_0_tiny.gin", "--gin_file=configs/runs/finetune.gin",
                   "--model_dir=/tmp/x", "--label_names=x,y", "--metric=mrpc"]) == 2
  assert _one_error_line(capsys) == ("error: --label_names, --metric describe the task of a folder: give "
                                     "--task_dir=DIR too")
  assert train_stage.with_task_dir_name(["TASK_DIR='/d'"])[-1] == "MIXTURE_OR_TASK_NAME=None"
  assert train_stage.with_task_dir_name(["TASK_DIR='/d'", "MIXTURE_OR_TASK_NAME='t'"]) == [
      "TASK_DIR='/d'", "MIXTURE_OR_TASK_NAME='t'"]


def test_the_data_layer_knows_every_metric():
  from private_t5.eval import glue_metrics  # pylint: disable=g-import-not-at-top
  assert set(glue_registry.METRIC_NAMES) == set(glue_metrics.TASK_METRICS)


# -- TASK_MODULE --------------------------------------------------------------------------------


def _write_task_module(directory: pathlib.Path, folder: pathlib.Path, name: str) -> None:
  """A user's module that registers `t5test_module_task` and notes each process importing it."""
  (directory / f"{name}.py").write_text(
      "import os\nfrom private_t5.data import glue_tasks\n"
      f"glue_tasks.register_local_tsv_task('t5test_module_task', {str(folder)!r}, ['sentence'], 'label', "
      "['old', 'new'])\n"
      f"with open({str(directory / 'imported_in')!r}, 'a') as f:\n  f.write(f'{{os.getpid()}}\\n')\n")


def test_task_module_registers_tasks_here_and_in_every_worker(tmp_path, monkeypatch, capsys):
  folder = make_task_folder(tmp_path)
  _write_task_module(tmp_path, folder, "t5test_user_tasks")
  monkeypatch.chdir(tmp_path)  # found in the current folder, as from `private-t5 ...` run there
  monkeypatch.setattr(user_modules, "_IN_WORKERS", [])
  monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
  assert task_dir.task_name("t5test_module_task", None, "t5test_user_tasks") == "t5test_module_task"
  assert set(_examples("t5test_module_task")[1]) == {"old", "new"}
  assert user_modules.worker_modules() == ["t5test_user_tasks"]
  # A pool's workers import it too ("spawn": each worker is a fresh interpreter), those of the
  # study's DP-SentencePiece histogram ("forkserver") included.
  with multiprocessing.get_context("spawn").Pool(1, **user_modules.pool_kwargs()) as pool:
    worker = pool.apply(os.getpid)
  assert str(worker) in (tmp_path / "imported_in").read_text().split()
  from private_t5.tokenizer import dp_spm_histogram  # pylint: disable=g-import-not-at-top
  before = set((tmp_path / "imported_in").read_text().split())
  dp_spm_histogram.build_histogram([f"old and new text {k}" for k in range(8)], dp_spm_histogram.ContributionBound("paper", 16),
                         num_workers=2, chunk_size=2)
  # (A worker the pool terminates before its start-up ends need not have written: at least one did.)
  assert len(set((tmp_path / "imported_in").read_text().split()) - before - {str(os.getpid())}) >= 1
  # A module that is missing or raises: one line naming TASK_MODULE.
  (tmp_path / "t5test_broken_tasks.py").write_text("raise RuntimeError('no such bucket\\nsecond line')\n")
  for module, what in (("t5test_no_such_tasks", "No module named 't5test_no_such_tasks'"),
                       ("t5test_broken_tasks", "RuntimeError: no such bucket")):
    assert cli.main(["evaluate", "--gin_file=configs/runs/eval.gin", "--model_dir=/tmp/x", "--task=t",
                     f"--gin.TASK_MODULE={module}"]) == 2
    assert _one_error_line(capsys) == f"error: cannot import TASK_MODULE {module!r}: {what}"


# -- fine-tuning and evaluation from the command line -------------------------------------------


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
  """A DP fine-tuning run the launcher's way, then the same run by `--task_dir` with task.json;
  the second compiles nothing (JAX's persistent cache, in a temporary folder)."""
  from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
  saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                "jax_persistent_cache_min_compile_time_secs")}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  root = tmp_path_factory.mktemp("task_dir")
  folder = make_task_folder(root, description=DESCRIPTION)
  lines = [row.split("\t")[0] for row in (folder / "train.tsv").read_text().splitlines()[1:]]
  vocab = spm.train_from_sentences(lines + ["old new my_task sentence:"] * 100, str(root / "spm.model"), 300)
  argv = [*MICRO_FINETUNE_ARGS, f"--vocab_path={vocab}"]
  try:
    # The launcher of docs/finetuning.md before --task_dir: register, then the stage.
    glue_registry.register_local_tsv_task("my_task", str(folder), ["sentence"], "label", ["old", "new"])
    assert train_stage.main([*argv, f"--model_dir={root / 'launcher'}", "--gin.MIXTURE_OR_TASK_NAME=my_task"]) == 0
    assert cli.main(["train", *argv, f"--model_dir={root / 'task_dir'}", f"--task_dir={folder}"]) == 0
    yield root, folder
  finally:
    for key, value in saved.items():
      jax.config.update(key, value)


def test_dp_finetuning_by_task_dir_is_the_launchers_run(finetuned):
  from private_t5.models import checkpoint_read  # pylint: disable=g-import-not-at-top
  root, folder = finetuned
  reports = [json.loads((root / run / "privacy_report.json").read_text()) for run in ("launcher", "task_dir")]
  for report in reports:
    assert report["dp"] and report["privacy_unit"] == "example" and report["num_examples"] == TRAIN_ROWS
  assert reports[0]["training_epsilon"] == reports[1]["training_epsilon"] > 0
  params = [checkpoint_read.restore_for_inference(str(root / run))[0] for run in ("launcher", "task_dir")]
  jax.tree.map(np.testing.assert_array_equal, params[0], params[1])
  summaries = [json.loads((root / run / "summary.json").read_text()) for run in ("launcher", "task_dir")]
  assert summaries[0]["final_step"] == summaries[1]["final_step"] == 2
  # The run's config names the folder it read.
  assert repr(str(folder)) in (root / "task_dir" / "config.gin").read_text()


def test_evaluate_reads_the_folder_described_by_flags(finetuned, tmp_path):
  root, folder = finetuned
  bare = make_task_folder(tmp_path)  # the same rows, no task.json: the flags describe it
  out = tmp_path / "eval"
  assert cli.main(["evaluate", "--gin_file=configs/runs/eval.gin", f"--model_dir={root / 'task_dir'}",
                   f"--task_dir={bare}", *FLAGS, f"--output={out}", "--gin.evaluate.max_examples=8",
                   "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 4}"]) == 0
  results = json.loads((out / "results.json").read_text())
  task = results["tasks"]["my_task"]
  assert task["metric"] == "accuracy" and task["num_examples"] == 8
  assert task["examples"][0]["inputs"].startswith("my_task sentence: ") and task["examples"][0]["target"] in (
      "old", "new")
  del folder


# -- epsilon's default δ and module loggers -----------------------------------------------------


def test_epsilon_without_delta_uses_and_says_the_training_default(capsys):
  from private_t5.dp import config  # pylint: disable=g-import-not-at-top
  argv = ["epsilon", "--noise_multiplier=1.0", "--batch_size=256", "--num_examples=60000", "--steps=1000"]
  assert cli.main(argv) == 0
  captured = capsys.readouterr()
  out = json.loads(captured.out)
  assert out["delta"] == config.default_delta(60000) == pytest.approx(60000 ** -1.1)
  assert out["delta_source"] == "training default min(1e-5, 1/N^1.1)"
  assert "no --delta: δ = 5.54669e-06, training's default min(1e-5, 1/N^1.1) for N = 60000" in captured.err
  assert cli.main([*argv, "--delta=1e-6"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["delta"] == 1e-6 and out["delta_source"] == "--delta"
  assert cli.main(["epsilon", "--noise_multiplier=1.0", "--sampling_rate=0.01", "--steps=10"]) == 2
  assert _one_error_line(capsys) == ("error: give --delta, or --num_examples for training's default "
                                     "δ = min(1e-5, 1/N^1.1)")


def test_nothing_logs_through_the_root_logger():
  """Each module logs through its own logger (`logging.getLogger(__name__)`), so a line names it."""
  root = pathlib.Path(__file__).resolve().parents[1] / "private_t5"
  calls = ("debug", "info", "warning", "error", "exception", "critical", "log")
  bad = []
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in calls
          and isinstance(node.func.value, ast.Name) and node.func.value.id == "logging"):
        bad.append(f"{path.relative_to(root.parent)}:{node.lineno}")
  assert not bad, "root-logger calls (use logger = logging.getLogger(__name__)): " + ", ".join(bad)
