"""`private-t5 <stage> --help` imports neither JAX nor TensorFlow: the dispatcher imports a stage's
module only when that stage runs, and a stage module's library (bench's and study's re-exported
names included) is imported only when it is used."""
import json
import os
import subprocess
import sys

import pytest

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import contextlib, io, json, sys
from private_t5.stages import cli
with contextlib.redirect_stdout(io.StringIO()) as out:
  try:
    code = cli.main([sys.argv[1], "--help"])
  except SystemExit as e:
    code = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"jax", "tensorflow", "flax", "seqio"})
print(json.dumps({"code": code, "heavy": heavy, "usage": "usage:" in out.getvalue()}))
"""


@pytest.mark.parametrize("stage", ["bench", "study", "train", "epsilon", "splits"])
def test_stage_help_imports_no_jax(stage):
  done = subprocess.run([sys.executable, "-c", SCRIPT, stage], cwd=PROJECT_ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=PROJECT_ROOT), timeout=120, check=True)
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result["code"] in (0, None) and result["usage"], result
  assert result["heavy"] == [], f"`private-t5 {stage} --help` imported {result['heavy']}"


def test_bench_and_study_names_still_import_from_their_stage_module_with_a_warning():
  from private_t5.stages import bench, study  # pylint: disable=g-import-not-at-top
  from private_t5.experiments import benchmark_case, study as study_lib  # pylint: disable=g-import-not-at-top
  with pytest.warns(DeprecationWarning, match="private_t5.stages.bench.run_case moved to "
                                                "private_t5.experiments.benchmark_case.run_case"):
    assert getattr(bench, "run_case") is benchmark_case.run_case  # (getattr: read on purpose at the old address)
  with pytest.warns(DeprecationWarning):
    assert getattr(study, "em_by_repetitions") is study_lib.em_by_repetitions
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    bench.no_such_name  # pylint: disable=pointless-statement
