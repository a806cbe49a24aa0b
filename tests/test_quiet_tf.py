"""TensorFlow's C++ start-up lines stay off the console; the rest of stderr does not."""
import os
import subprocess
import sys

from private_t5 import quiet_tf

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_UP_LINES = ("absl::InitializeLog", "oneDNN", "cuda drivers", "cuInit")


def test_silenced_stderr_holds_back_file_descriptor_2_only_inside(capfd):
  os.write(2, b"before\n")
  with quiet_tf.silenced_stderr():
    os.write(2, b"inside\n")  # as TensorFlow's C++ code writes
  os.write(2, b"after\n")
  assert capfd.readouterr().err == "before\nafter\n"


def test_importing_tensorflow_and_hiding_its_gpus_print_nothing(tmp_path):
  """In a fresh process, as `private-t5 train` does: import (through seqio too), hide the GPUs,
  run an op. Nothing of TensorFlow's start-up reaches stderr; a later error still does."""
  script = ("from private_t5 import quiet_tf\n"
            "from private_t5.train import partitioning\n"
            "tf = quiet_tf.import_tensorflow()\n"
            "import seqio\n"
            "partitioning.hide_accelerators_from_tensorflow()\n"
            "assert int(tf.constant(2) + 3) == 5\n"
            "import sys; print('still heard', file=sys.stderr)\n")
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  env.update(PYTHONPATH=PROJECT_ROOT, KERAS_HOME=str(tmp_path / "keras"))
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert not [line for line in done.stderr.splitlines() if any(s in line for s in START_UP_LINES)], done.stderr
  assert "still heard" in done.stderr


def test_tensorflow_is_hidden_from_the_gpus_when_imported_and_never_imported_to_do_so(tmp_path):
  """With a stand-in `tensorflow` that records its calls: `hide_accelerators` imports nothing
  while TensorFlow is not imported, and `import_tensorflow` hides the GPUs once, on import."""
  fake = tmp_path / "fake" / "tensorflow"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text(
      "calls = []\n"
      "class config:  # pylint: disable=invalid-name\n"
      "  @staticmethod\n"
      "  def set_visible_devices(devices, kind=None):\n"
      "    calls.append((list(devices), kind))\n")
  script = ("import sys\n"
            "from private_t5 import quiet_tf\n"
            "from private_t5.train import partitioning\n"
            "partitioning.hide_accelerators_from_tensorflow()\n"
            "assert 'tensorflow' not in sys.modules\n"
            "tf = quiet_tf.import_tensorflow()\n"
            "assert tf.calls == [([], 'GPU')], tf.calls\n"
            "quiet_tf.import_tensorflow()\n"
            "partitioning.hide_accelerators_from_tensorflow()\n"
            "assert tf.calls == [([], 'GPU')] * 2, tf.calls\n"
            "print('ok')\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), PROJECT_ROOT]))
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                        check=False)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
