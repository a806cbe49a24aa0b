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
