"""Bad inputs to the stages: each is one `error:` line and exit status 2, before any work, with
nothing written (the stages run in-process, each case fails in well under a second)."""
import json
import os

import pytest

from private_t5.errors import DataError
from private_t5.stages import cli

from conftest import shared_or_fixture

CORPUS = shared_or_fixture("pretrain/fortunes.jsonl.gz")


def one_error_line(argv, capsys) -> str:
  """Runs `private-t5 ARGV`; asserts exit status 2 and exactly one `error:` line, no traceback."""
  rc = cli.main(argv)
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
  return errors[0]


def files_under(folder) -> list:
  return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


@pytest.mark.parametrize("bad, message", [
    (["--target_epsilon=nan"], "target_epsilon must be finite"),
    (["--target_epsilon=inf"], "target_epsilon must be finite"),
    (["--noise_std=nan"], "noise_std must be finite"),
    (["--gin.train_dp_vocabulary.target_epsilon=inf"], "target_epsilon must be finite"),
    (["--gin.train_dp_vocabulary.noise_std=nan", "--gin.train_dp_vocabulary.target_epsilon=None"],
     "noise_std must be finite"),
    (["--delta=nan"], "delta must be finite"),
])
def test_dp_spm_refuses_non_finite_privacy_parameters(bad, message, tmp_path, capsys):
  line = one_error_line(["dp-spm", "--gin_file=runs/dp_spm.gin", f"--corpus={CORPUS}",
                         f"--output={tmp_path}/v.model", *bad], capsys)
  assert message in line
  assert files_under(tmp_path) == []


def test_dp_spm_refuses_an_output_it_cannot_write_before_reading(tmp_path, capsys, read_only):
  base = ["dp-spm", "--gin_file=runs/dp_spm.gin", f"--corpus={CORPUS}"]
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  assert "cannot be written" in one_error_line(base + [f"--output={tmp_path}/ro/v.model"], capsys)
  (tmp_path / "a_file").write_text("")
  assert "Not a directory" in one_error_line(base + [f"--output={tmp_path}/a_file/v.model"], capsys)
  (tmp_path / "v.model").mkdir()
  assert "Is a directory" in one_error_line(base + [f"--output={tmp_path}/v.model"], capsys)
  assert files_under(tmp_path) == ["a_file"]


@pytest.mark.parametrize("output", ["ro/r.jsonl", "a_file/r.jsonl", "r.jsonl"])
def test_redact_refuses_an_output_it_cannot_write_before_reading(output, tmp_path, capsys, read_only):
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  (tmp_path / "a_file").write_text("")
  (tmp_path / "r.report.json").mkdir()  # the default report beside r.jsonl is a folder
  line = one_error_line(["redact", f"--corpus={CORPUS}", f"--output={tmp_path / output}", "--backend=heuristic"],
                        capsys)
  assert "cannot be written" in line
  assert files_under(tmp_path) == ["a_file"]


def test_splits_refuses_an_output_it_cannot_write_before_the_work(tmp_path, capsys, read_only):
  base = ["splits", f"--train_corpus={CORPUS}", f"--valid_corpus={CORPUS}"]
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  assert "cannot be written" in one_error_line(base + [f"--output={tmp_path}/ro/s.json"], capsys)
  assert "cannot be written" in one_error_line(base + [f"--output={tmp_path}/ro/"], capsys)
  (tmp_path / "a_file").write_text("")
  assert "Not a directory" in one_error_line(base + [f"--output={tmp_path}/a_file/s.json"], capsys)
  assert files_under(tmp_path) == ["a_file"]


@pytest.mark.parametrize("audit", [[], ["--audit", "--num_canaries=10"]])
def test_canaries_refuse_an_output_they_cannot_write_before_reading(audit, tmp_path, capsys, read_only):
  base = ["canaries", *audit, f"--corpus={CORPUS}"]
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  assert "cannot be written" in one_error_line(base + [f"--output={tmp_path}/ro/c.jsonl"], capsys)
  (tmp_path / "c.jsonl").mkdir()  # the output is a folder
  assert "Is a directory" in one_error_line(base + [f"--output={tmp_path}/c.jsonl"], capsys)
  record = "d.audit.json" if audit else "d.canaries.json"
  (tmp_path / record).mkdir()  # the record beside it is a folder
  assert "Is a directory" in one_error_line(base + [f"--output={tmp_path}/d.jsonl"], capsys)
  assert files_under(tmp_path) == []


def test_canaries_audit_refuses_fewer_than_two_canaries_up_front(tmp_path, capsys):
  line = one_error_line(["canaries", "--audit", f"--corpus={CORPUS}", f"--output={tmp_path}/a.jsonl",
                         "--num_canaries=1"], capsys)
  assert "--num_canaries must be >= 2" in line
  assert files_under(tmp_path) == []


@pytest.mark.parametrize("inside", ["checkpoints", "tensorboard/train", "sub/deeper"])
def test_canaries_audit_refuses_anywhere_inside_a_model_directory(inside, tmp_path, capsys):
  model_dir = tmp_path / "run"
  (model_dir / "checkpoints" / "10").mkdir(parents=True)
  (model_dir / "privacy_report.json").write_text("{}")
  (model_dir / inside).mkdir(parents=True, exist_ok=True)
  before = files_under(tmp_path)
  line = one_error_line(["canaries", "--audit", f"--corpus={CORPUS}", f"--output={model_dir / inside}/a.jsonl",
                         "--num_canaries=10"], capsys)
  assert "inside the model directory" in line and str(model_dir) in line
  assert files_under(tmp_path) == before


def test_memorization_refuses_an_audit_record_that_is_a_folder(tmp_path, capsys):
  (tmp_path / "x.audit.json").mkdir()
  line = one_error_line(["memorization", "--gin_file=configs/runs/memorization.gin",
                         f"--gin.MODEL_DIR={tmp_path}/none", f"--gin.TRAIN_CORPUS={CORPUS}",
                         f"--gin.VALID_CORPUS={CORPUS}", f"--gin.OUTPUT_DIR={tmp_path}/out",
                         f"--gin.AUDIT={tmp_path}/x.audit.json"], capsys)
  assert "is a folder" in line
  assert not (tmp_path / "out").exists()


def test_memorization_refuses_an_output_dir_it_cannot_write_before_loading(tmp_path, capsys, read_only):
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  line = one_error_line(["memorization", "--gin_file=configs/runs/memorization.gin",
                         f"--gin.MODEL_DIR={tmp_path}/none", f"--gin.TRAIN_CORPUS={CORPUS}",
                         f"--gin.VALID_CORPUS={CORPUS}", f"--gin.OUTPUT_DIR={tmp_path}/ro/out"], capsys)
  assert "OUTPUT_DIR" in line and "cannot be written" in line


def test_evaluate_refuses_an_output_dir_it_cannot_write_before_loading(tmp_path, capsys, read_only):
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  line = one_error_line(["evaluate", "--gin_file=configs/runs/eval.gin", f"--model_dir={tmp_path}/none",
                         "--task=rotten_tomatoes", f"--output={tmp_path}/ro/eval"], capsys)
  assert "evaluate.output_dir" in line and "cannot be written" in line


def _record(**changes):
  rec = {"kind": "private_t5 audit canaries", "canary_kind": "words", "length": 3, "seed": 1, "repetitions": 1,
         "canaries": [{"id": f"audit-{k}", "text": f"canary number {k}", "included": k % 2 == 0} for k in range(8)]}
  rec.update(changes)
  return rec


@pytest.mark.parametrize("change, message", [
    (lambda r: r["canaries"][1].update(included="false"), "canary 1's 'included' must be True or False, got 'false'"),
    (lambda r: r["canaries"][1].update(included="maybe"), "'included' must be True or False"),
    (lambda r: r["canaries"][1].update(included=1), "'included' must be True or False"),
    (lambda r: r["canaries"][1].update(text=7), "string 'text'"),
    (lambda r: r.update(repetitions=-2), "'repetitions' must be >= 0"),
    (lambda r: r.update(repetitions=1.5), "'repetitions' must be an integer"),
    (lambda r: r.update(repetitions=0), "at least one included canary"),
    (lambda r: r.update(seed="7"), "'seed' must be an integer"),
    (lambda r: [c.update(included=False) for c in r["canaries"]], "at least one included canary"),
    (lambda r: r.update(canaries={"a": 1}), "'canaries' must be a list"),
])
def test_audit_record_schema_is_strict(change, message, tmp_path):
  from private_t5.eval import audit
  rec = _record()
  change(rec)
  path = tmp_path / "r.audit.json"
  path.write_text(json.dumps(rec))
  with pytest.raises(DataError) as e:
    audit.load_record(str(path))
  assert message in str(e.value)


def test_audit_record_as_written_is_read_back(tmp_path):
  from private_t5.eval import audit
  path = tmp_path / "r.audit.json"
  path.write_text(json.dumps(_record()))
  rec = audit.load_record(str(path))
  assert rec.included.tolist() == [k % 2 == 0 for k in range(8)] and rec.repetitions == 1


BENCH = ["bench", "--gin_file=bench/quick.gin"]


@pytest.mark.parametrize("bad, message", [
    (["--gin.benchmark.shapes=[]"], "non-empty list"),
    (["--gin.benchmark.shapes=7"], "non-empty list"),
    (["--gin.benchmark.shapes=[5]"], "of integers >= 1, got 5"),
    (["--gin.benchmark.shapes=['abc']"], "of integers >= 1, got 'abc'"),
    (["--gin.benchmark.shapes=[(32.5, 8, 2)]"], "of integers >= 1"),
    (["--gin.benchmark.shapes=[(32, 8)]"], "of integers >= 1"),
    (["--gin.benchmark.shapes=[(32, 8, 0)]"], "of integers >= 1"),
    (["--gin.benchmark.shapes=[(1000000, 1000000, 1000000)]"], "tokens per step"),
    (["--noise_multiplier=-1"], "noise_multiplier (σ) must be >= 0"),
    (["--noise_multiplier=nan"], "noise_multiplier must be finite"),
    (["--gin.benchmark.clip_norm=0.0"], "clip_norm (C) must be > 0"),
    (["--gin.benchmark.steps='x'"], "benchmark.steps must be an integer, got 'x' (str)"),
    (["--gin.benchmark.warmup=-1"], "benchmark.warmup must be an integer >= 0"),
    (["--gin.benchmark.microbatch_size=-1"], "benchmark.microbatch_size must be an integer >= 1"),
])
def test_bench_refuses_bad_inputs_before_any_work(bad, message, tmp_path, capsys):
  assert message in one_error_line(BENCH + [f"--output={tmp_path}/b", *bad], capsys)
  assert files_under(tmp_path) == []


def test_bench_refuses_an_output_it_cannot_write(tmp_path, capsys, read_only):
  read_only(tmp_path)
  assert "cannot be written" in one_error_line(BENCH + [f"--output={tmp_path}/b"], capsys)
  assert files_under(tmp_path) == []


def test_an_initial_checkpoint_that_is_a_file_is_named_as_such(tmp_path, capsys):
  (tmp_path / "a_file").write_text("")
  line = one_error_line(["train", "--gin_file=configs/models/t5_1_0_tiny.gin", "--gin_file=configs/runs/finetune.gin",
                         f"--model_dir={tmp_path}/run", "--gin.MIXTURE_OR_TASK_NAME=rotten_tomatoes",
                         f"--initial_checkpoint={tmp_path}/a_file"], capsys)
  assert f"initial checkpoint '{tmp_path}/a_file' is a file, not a checkpoint directory" in line
  assert "does not exist" not in line and files_under(tmp_path) == ["a_file"]


def test_a_task_dir_that_is_a_file_is_named_as_such(tmp_path, capsys):
  (tmp_path / "a_file").write_text("")
  line = one_error_line(["study", "--part=utility", f"--corpus={CORPUS}", f"--task_dir={tmp_path}/a_file",
                         f"--output={tmp_path}/out"], capsys)
  assert f"task directory '{tmp_path}/a_file' is a file, not a folder" in line and "not found" not in line
  assert files_under(tmp_path) == ["a_file"]


def test_invalid_utf8_suggests_only_options_that_exist(tmp_path, capsys):
  """The splits stage reads strictly (it has no errors option): its message says to re-encode the
  file, and names the stages that can substitute U+FFFD, not an option it lacks."""
  bad, good = tmp_path / "bad.jsonl", tmp_path / "good.jsonl"
  bad.write_bytes(b'{"id": "a", "text": "fine"}\n{"id": "b", "text": "caf\xe9"}\n')
  good.write_text('{"id": "c", "text": "fine too"}\n')
  line = one_error_line(["splits", f"--train_corpus={bad}", f"--valid_corpus={good}",
                         f"--output={tmp_path}/out/splits.json"], capsys)
  assert line.startswith(f"error: {bad}: line 2: invalid UTF-8 at byte ") and "pass errors=" not in line
  assert line.endswith("re-encode the file as UTF-8, or substitute U+FFFD where a stage offers it: `private-t5 "
                       "store` / `spm` --errors=replace, training's make_source.errors='replace'")
  assert files_under(tmp_path) == ["bad.jsonl", "good.jsonl"]
