"""Shared test setup: quiet TensorFlow, 8 fake CPU devices for mesh tests, shared data paths."""
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_HOME", tempfile.mkdtemp(prefix="keras_home_"))
# 8 CPU devices so that mesh/sharding tests run on one machine; must precede `import jax`.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # pylint: disable=g-import-not-at-top

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.abspath(os.path.join(PROJECT_ROOT, "..", "shared", "data"))


@pytest.fixture(scope="session")
def shared_data():
  """Path to ../shared/data (real text: pretrain/*.jsonl.gz, glue_like/*)."""
  if not os.path.isdir(SHARED_DATA):
    pytest.fail(f"../shared/data not found at {SHARED_DATA}")
  return SHARED_DATA
