"""TensorBoard event files without TensorFlow: TensorFlow's reader reads ours, ours reads TensorFlow's."""
import os

import pytest

from private_t5 import quiet_tf
from private_t5.train import event_file, metrics


def test_crc32c_check_value():
  assert event_file.crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
  assert event_file.crc32c(b"") == 0


def test_tensorflow_reads_what_the_summary_writer_writes(tmp_path):
  tf = quiet_tf.import_tensorflow()
  writer = metrics.SummaryWriter(str(tmp_path))
  writer.scalars("train", 1, {"nondp/loss": 6.5, "learning_rate": 0.01, "skipped": float("nan"), "none": None})
  writer.scalars("train", 2, {"nondp/loss": 5.25, "privacy/training_epsilon": 0.75})
  writer.scalars("train", 2 ** 40, {"nondp/loss": -1.5})
  writer.close()
  (path,) = [os.path.join(tmp_path, "tensorboard", "train", f)
             for f in os.listdir(tmp_path / "tensorboard" / "train")]
  events = list(tf.compat.v1.train.summary_iterator(path))  # checks every record's CRCs
  assert events[0].file_version == "brain.Event:2"
  seen = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
  assert seen == [(1, "nondp/loss", 6.5), (1, "learning_rate", pytest.approx(0.01)), (2, "nondp/loss", 5.25),
                  (2, "privacy/training_epsilon", 0.75), (2 ** 40, "nondp/loss", -1.5)]
  assert all(e.wall_time > 1e9 for e in events)
  assert metrics.read_scalars(os.path.dirname(path)) == {
      "nondp/loss": [(1, 6.5), (2, 5.25), (2 ** 40, -1.5)], "learning_rate": [(1, pytest.approx(0.01))],
      "privacy/training_epsilon": [(2, 0.75)]}


def test_reads_tensorflows_scalar_summaries(tmp_path):
  """Runs written by TensorFlow's summary writer (tensor-valued scalars) read back too."""
  tf = quiet_tf.import_tensorflow()
  from tensorflow.core.framework import summary_pb2  # pylint: disable=g-import-not-at-top
  metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
  writer = tf.summary.create_file_writer(str(tmp_path))
  with writer.as_default(step=3):
    tf.summary.write("a", tf.constant(1.25, tf.float32), metadata=metadata)
    tf.summary.write("b", tf.constant(-2.5, tf.float64), metadata=metadata)
  writer.close()
  assert event_file.read_scalars(str(tmp_path)) == {"a": [(3, 1.25)], "b": [(3, -2.5)]}


def test_torn_last_record_is_dropped_and_corruption_is_an_error(tmp_path):
  writer = event_file.EventFileWriter(str(tmp_path))
  for step in range(3):
    writer.add_scalars(step, {"x": float(step)})
  writer.close()
  (name,) = os.listdir(tmp_path)
  path = tmp_path / name
  data = path.read_bytes()
  path.write_bytes(data[:-3])  # a writer killed mid-record
  assert event_file.read_scalars(str(tmp_path)) == {"x": [(0, 0.0), (1, 1.0)]}
  corrupt = bytearray(data)
  corrupt[-6] ^= 0xFF
  path.write_bytes(bytes(corrupt))
  with pytest.raises(ValueError, match="corrupt record"):
    event_file.read_scalars(str(tmp_path))
