"""seqio Tasks for the two pretraining objectives, for users who stream with seqio.

The trainer itself samples with `source.ExampleSource` (random access, needed for Poisson
sampling); these Tasks give the same objectives as a seqio stream, built from
`t5.data.preprocessors`:

* span corruption: one uniformly placed window of the raw length per document (document
  mode) or `split_tokens` (example mode: consecutive chunks), then
  `denoise` with `random_spans_noise_mask`, `noise_span_to_unique_sentinel` (inputs) and
  `nonnoise_span_to_unique_sentinel` (targets): T5's `span_corruption` without packing;
* prefix LM: the same windows split into `inputs_length-1` context tokens and the rest.

Every example keeps its document id in the `id` feature. The user privacy unit needs random
access (one document per user per draw) and is only offered by `source.make_source`.
"""
import functools
from typing import Mapping, Optional

from private_t5 import vocabulary as vocab_lib
from private_t5.data import corpora
from private_t5.data import objectives as objectives_lib
from private_t5.data import source as source_lib
from private_t5.errors import ConfigError

STREAM_PRIVACY_UNITS = ("document", "example")


def _dataset_fn(corpus, text_field, id_field, data_dir, validation_fraction, max_documents):
  """A seqio dataset_fn yielding {"id", "text"} for split train/validation/all."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def dataset_fn(split, shuffle_files=False, seed=None):
    del shuffle_files, seed  # the corpus order is fixed; shuffle downstream if wanted

    def generate():
      for doc in corpora.iter_documents(corpus, text_field=text_field, id_field=id_field, data_dir=data_dir,
                                        max_documents=max_documents):
        if split == "all" or source_lib.in_validation(doc.id, validation_fraction) == (split == "validation"):
          yield {"id": doc.id, "text": doc.text}

    return tf.data.Dataset.from_generator(
        generate, output_signature={"id": tf.TensorSpec([], tf.string), "text": tf.TensorSpec([], tf.string)})

  return dataset_fn


def _random_window(raw_length: int):
  """seqio map: one window of `raw_length` tokens at a uniform start (whole doc if shorter).

  Same rule as `ExampleSource` in document mode. (t5's `select_random_chunk` either aligns
  windows to multiples of the length or, with `uniform_random_start`, also cuts partial
  windows at the ends, so it is not used here.)
  """
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @seqio.map_over_dataset(num_seeds=1)
  def window(x, seed):
    tokens = x["targets"]
    last_start = tf.maximum(tf.size(tokens) - raw_length, 0)
    start = tf.random.stateless_uniform([], seed=seed, minval=0, maxval=last_start + 1, dtype=tf.int32)
    return {"id": x["id"], "targets": tokens[start:start + raw_length]}

  return window


def _split_prefix(inputs_length: int, targets_length: int):
  """seqio map: context then continuation, split as `objectives.PrefixLM` does."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @seqio.map_over_dataset(num_seeds=1)
  def split(x, seed):
    tokens = x["targets"]
    n = tf.size(tokens)
    # Full window: inputs_length-1 context tokens. Shorter: a random split keeping both sides
    # within their lengths and at least one target token.
    low = tf.maximum(1, n - (targets_length - 1))
    high = tf.minimum(inputs_length - 1, n - 1)
    fallback = tf.minimum(tf.maximum(n - (targets_length - 1), 0), inputs_length - 1)
    random_cut = tf.random.stateless_uniform([], seed=seed, minval=low, maxval=tf.maximum(high, low) + 1,
                                             dtype=tf.int32)
    cut = tf.where(n >= inputs_length + targets_length - 2, inputs_length - 1,
                   tf.where((n >= 2) & (high >= low), random_cut, fallback))
    return {"id": x["id"], "inputs": tokens[:cut], "targets": tokens[cut:]}

  return split


def build_preprocessors(objective, raw_length: int, inputs_length: int, targets_length: int, privacy_unit: str,
                        noise_density: float, mean_noise_span_length: float):
  """The seqio preprocessor list after tokenization, for one objective and privacy unit."""
  import seqio  # pylint: disable=g-import-not-at-top
  from t5.data import preprocessors as t5_pre  # pylint: disable=g-import-not-at-top
  if privacy_unit == "document":
    windows = _random_window(raw_length)  # one example per document per pass
  else:
    windows = functools.partial(t5_pre.split_tokens, max_tokens_per_segment=raw_length,
                                passthrough_feature_keys=["id"])
  steps = [windows]
  if objective == objectives_lib.SPAN_CORRUPTION:
    steps.append(functools.partial(
        t5_pre.denoise, noise_density=noise_density,
        noise_mask_fn=functools.partial(t5_pre.random_spans_noise_mask, mean_noise_span_length=mean_noise_span_length),
        inputs_fn=t5_pre.noise_span_to_unique_sentinel, targets_fn=t5_pre.nonnoise_span_to_unique_sentinel,
        passthrough_feature_keys=["id"]))
  else:
    steps.append(_split_prefix(inputs_length, targets_length))
  steps.append(seqio.preprocessors.append_eos_after_trim)
  return steps


def register_pretrain_task(name: str, corpus: str, vocab_path: str, objective: str = "span_corruption",
                           feature_lengths: Optional[Mapping[str, int]] = None, privacy_unit: str = "document", *,
                           text_field: str = "text", id_field: str = "id", data_dir: Optional[str] = None,
                           validation_fraction: float = 0.0, max_documents: Optional[int] = None,
                           noise_density: float = 0.15, mean_noise_span_length: float = 3.0):
  """Registers (replacing any previous one) and returns the seqio Task `name`.

  Splits: "train", "validation" (by the hash of the document id, as `make_source`) and "all".
  Use `task.get_dataset(sequence_length=feature_lengths, split=..., seed=...)`.
  """
  import seqio  # pylint: disable=g-import-not-at-top
  if privacy_unit not in STREAM_PRIVACY_UNITS:
    raise ConfigError(f"seqio tasks support privacy_unit in {STREAM_PRIVACY_UNITS}, got {privacy_unit!r}; "
                      "user-level sampling needs source.make_source")
  feature_lengths = dict(feature_lengths or {"inputs": 512, "targets": 114})
  vocab = vocab_lib.load_vocabulary(vocab_path)
  obj = objectives_lib.make_objective(objective, feature_lengths, vocab.vocab_size, noise_density=noise_density,
                                      mean_noise_span_length=mean_noise_span_length)
  output_features = {
      "inputs": seqio.Feature(vocabulary=vocab, add_eos=True, required=False),
      "targets": seqio.Feature(vocabulary=vocab, add_eos=True),
  }
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(
          _dataset_fn(corpus, text_field, id_field, data_dir, validation_fraction, max_documents),
          splits=("train", "validation", "all")),
      preprocessors=[
          functools.partial(seqio.preprocessors.rekey, key_map={"id": "id", "targets": "text"}),
          seqio.preprocessors.tokenize,
          *build_preprocessors(obj.name, obj.raw_length, obj.inputs_length, obj.targets_length, privacy_unit,
                               noise_density, mean_noise_span_length),
      ],
      output_features=output_features,
      metric_fns=[],
  )
