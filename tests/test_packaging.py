"""`pip install .` of the committed tree ships the Gin configs (found by name from any directory)
and the built-in GLUE-layout tasks, and builds without setuptools warnings."""
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import PROJECT_ROOT


def _run(args, **kwargs):
  return subprocess.run(args, check=True, capture_output=True, text=True, **kwargs).stdout


def test_configs_path_is_a_link_into_the_package():
  mode = _run(["git", "ls-files", "-s", "configs"], cwd=PROJECT_ROOT).split()[0]
  assert mode == "120000"  # a symbolic link in git
  assert os.path.realpath(os.path.join(PROJECT_ROOT, "configs")) == os.path.join(PROJECT_ROOT, "private_t5", "configs")


@pytest.mark.slow
def test_pip_install_outside_the_repository_finds_configs_by_name(tmp_path):
  clone = tmp_path / "src"
  _run(["git", "clone", "--quiet", "--no-checkout", PROJECT_ROOT, str(clone)])
  _run(["git", "checkout", "--quiet", _run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT).strip()], cwd=str(clone))
  target = tmp_path / "site"
  # No download: the dependencies are those of the running environment.
  _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
        "--target", str(target), str(clone)], cwd=str(tmp_path))
  shipped = sorted(p.name for p in (target / "private_t5" / "configs" / "models").iterdir())
  assert "t5_1_0_small.gin" in shipped and "t5_1_1_base.gin" in shipped
  env = dict(os.environ, PYTHONPATH=str(target), TF_CPP_MIN_LOG_LEVEL="2")
  where = _run([sys.executable, "-c", "import private_t5, sys; sys.stdout.write(private_t5.__file__)"], cwd="/", env=env)
  assert where.startswith(str(target))
  for name in ("models/t5_1_0_small.gin", "configs/models/t5_1_0_small.gin"):
    out = _run([sys.executable, "-m", "private_t5.stages.cli", "info", f"--gin_file={name}"], cwd="/", env=env)
    assert '"num_params": 60506624' in out, out[:300]
  # The built-in local tasks read the copy shipped in the installed package.
  script = ("from private_t5.data import glue_tasks as g\n"
            "for name in ('rotten_tomatoes', 'bible_paraphrase', 'bbc_news'):\n"
            "  ex = g.load_examples(name, 'validation')\n"
            "  print(name, len(ex['inputs']), ex['source'])\n")
  out = _run([sys.executable, "-c", script], cwd="/", env=env).splitlines()
  assert len(out) == 3, out
  for line in out:
    name, n, source = line.split(" ", 2)
    assert int(n) > 0 and source.startswith(str(target / "private_t5" / "data" / "glue_like" / name)), line


def _tracked(*patterns):
  return sorted(_run(["git", "ls-files", "--", *patterns], cwd=PROJECT_ROOT).split())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """(pip's output, the names in the wheel) of `pip wheel` on a clone of the committed tree."""
  tmp = tmp_path_factory.mktemp("wheel")
  clone = tmp / "src"
  _run(["git", "clone", "--quiet", "--no-checkout", PROJECT_ROOT, str(clone)])
  _run(["git", "checkout", "--quiet", _run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT).strip()], cwd=str(clone))
  done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                         "-w", str(tmp / "dist"), str(clone)], cwd=str(tmp), capture_output=True, text=True,
                        check=True)
  (path,) = (tmp / "dist").glob("private_t5-*.whl")
  with zipfile.ZipFile(path) as z:
    return done.stdout + done.stderr, set(z.namelist())


def test_wheel_builds_without_setuptools_warnings(wheel):
  output, _ = wheel
  assert "would be ignored" not in output and "Warning" not in output, output[-3000:]


def test_wheel_holds_every_gin_config_and_the_builtin_tasks(wheel):
  _, names = wheel
  gin = _tracked("private_t5/configs/*.gin")
  tasks = _tracked("private_t5/data/glue_like/*.tsv")
  assert len(gin) >= 30 and len(tasks) == 9
  assert not set(gin + tasks) - names, sorted(set(gin + tasks) - names)
  assert not any("__pycache__" in n or n.startswith("tests/") for n in names)


def test_metadata_declares_ranges_that_hold_the_tested_stack(tmp_path):
  """setup.py's metadata builds; its dependencies are ranges (no exact pins), each holding the
  version this environment (requirements.txt's pinned stack) runs the tests on; the core needs
  no TensorFlow, seqio, t5 or PyTorch (extras tf, seqio and hf have them)."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  from packaging.requirements import Requirement  # pylint: disable=g-import-not-at-top
  _run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=PROJECT_ROOT)
  metadata = importlib.metadata.Distribution.at(str(tmp_path / "private_t5.egg-info"))
  requirements = [Requirement(r) for r in metadata.requires]
  extras = {}
  for req in requirements:
    extra = next((e for e in ("cuda12", "cuda13", "tpu", "beam", "hf", "tf", "seqio")
                  if req.marker and req.marker.evaluate({"extra": e})), None)
    extras.setdefault(extra, []).append(req)
  assert set(extras) == {None, "cuda12", "cuda13", "tpu", "beam", "hf", "tf", "seqio"}
  assert not {r.name for r in extras[None]} & {"tensorflow", "tensorflow-datasets", "seqio", "t5", "torch",
                                               "transformers", "apache-beam"}
  assert {r.name for r in extras["tf"]} == {"tensorflow", "tensorflow-datasets"}
  assert {"seqio", "t5", "tensorflow"} <= {r.name for r in extras["seqio"]}
  assert [(r.name, r.extras) for r in extras["cuda12"]] == [("jax", {"cuda12"})]
  for req in requirements:
    assert not any(spec.operator == "==" for spec in req.specifier), req
    assert req.specifier.contains(importlib.metadata.version(req.name)), (req, importlib.metadata.version(req.name))
