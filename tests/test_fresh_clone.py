"""A fresh clone of the committed tree, with nothing beside it, passes a quick subset of the tests.

The clone has no ../shared/data, so the data tests in it run on the fixtures in tests/data.
"""
import os
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT

# Quick tests that read real text (corpora, GLUE layout, vocabularies, token stores, splits).
SUBSET = ["tests/test_corpora.py", "tests/test_glue_readers.py", "tests/test_glue_tasks.py",
          "tests/test_splits.py", "tests/test_no_outside_references.py"]


def _git(*args, cwd=PROJECT_ROOT):
  return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
def test_fresh_clone_runs_the_data_tests_on_its_fixtures(tmp_path):
  head = _git("rev-parse", "HEAD")
  clone = tmp_path / "private_t5"
  _git("clone", "--quiet", "--no-checkout", PROJECT_ROOT, str(clone))
  _git("checkout", "--quiet", head, cwd=str(clone))
  assert not os.path.exists(tmp_path / "shared")
  env = dict(os.environ, PYTHONPATH=str(clone), TF_CPP_MIN_LOG_LEVEL="2", KERAS_HOME=str(tmp_path / "keras"))
  where = subprocess.run([sys.executable, "-c", "import private_t5, sys; sys.stdout.write(private_t5.__file__)"],
                         cwd=str(clone), env=env, check=True, capture_output=True, text=True).stdout
  assert where.startswith(str(clone))
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-m", "not slow",
                         *SUBSET], cwd=str(clone), env=env, capture_output=True, text=True, timeout=1200)
  summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  assert " passed" in summary and "error" not in summary and "skipped" not in summary, summary
