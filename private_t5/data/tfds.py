"""The one loader of prepared TFDS datasets (never downloads), for corpora and GLUE tasks."""
import os
from typing import Optional

from private_t5 import quiet_tf
from private_t5.errors import DataError
from private_t5.lazy_imports import import_now, lazy_module

# tensorflow_datasets imports TensorFlow, which `data.corpora` and `data.source` must not:
# imported on first use, TensorFlow first with its start-up lines silenced.
tfds = lazy_module("tensorflow_datasets", needed_for="a TFDS dataset",
                   install="tensorflow-datasets (pip install 'private_t5[tf]')",
                   before=quiet_tf.import_tensorflow)


def prepared_builder(name_or_dir: str, data_dir: Optional[str] = None):
  """A TFDS builder from a prepared dataset name (under `data_dir`) or a builder directory.

  Raises:
    DataError: unknown dataset, not a builder directory, or not prepared under `data_dir`.
    MissingLibrary: TensorFlow Datasets (or TensorFlow) is not importable.
  """
  import_now(tfds)  # imported now, so that a missing TFDS is not taken for a bad name
  if os.path.isdir(name_or_dir):
    try:
      return tfds.builder_from_directory(name_or_dir)
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f"{name_or_dir} is not a TFDS builder directory: {e}") from e
  try:
    builder = tfds.builder(name_or_dir, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"unknown TFDS dataset {name_or_dir!r}: {str(e).splitlines()[0]}") from e
  if not os.path.exists(os.path.join(builder.data_dir, "dataset_info.json")):
    raise DataError(f"TFDS dataset {name_or_dir!r} is not prepared under data_dir={data_dir!r} "
                    f"(looked in {builder.data_dir}); download/prepare it there first")
  return builder


def split_dataset(builder, name: str, split: str):
  """The unshuffled `tf.data.Dataset` of one split; DataError naming the splits if absent."""
  if split not in builder.info.splits:
    raise DataError(f"TFDS dataset {name!r} has no split {split!r} (splits: {sorted(builder.info.splits)})")
  return builder.as_dataset(split=split, shuffle_files=False)
