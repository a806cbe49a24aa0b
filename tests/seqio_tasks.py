"""Small seqio Tasks over real text, registered as a T5X user registers theirs.

`--gin.MIXTURE_OR_TASK_MODULE=seqio_tasks` imports this module, which registers them from the
corpus and vocabulary named by $PRIVATE_T5_SEQIO_CORPUS and $PRIVATE_T5_SEQIO_VOCAB (or call
`register`). Each Task reads texts through a `seqio.FunctionDataSource` and runs t5's
`span_corruption`, as T5X's C4 span-corruption Task does.

Also registered, for the refusals: Mixtures whose rates are NaN, negative, 0 or all 0; Tasks whose
data source or a preprocessor raises; and (`register_other_vocabulary`, with a second vocabulary)
a Task tokenizing with that other vocabulary, one whose 'inputs' use it and its 'targets' not,
and Mixtures mixing it (directly and through a sub-mixture) with the first one.

`register_text_file` registers Tasks over text files (`seqio.TextLineDataSource`: one source shard
per file, the files known), optionally with a preprocessor that raises on a marked line.
"""
import functools
import gzip
import json
import os

import seqio
import t5.data.preprocessors as t5_preprocessors
import tensorflow as tf

TASK = "test_fortunes_span_corruption"
OTHER_TASK = "test_fortunes_span_corruption_b"
FIXED_MIXTURE = "test_fortunes_fixed_rates"
DATA_DEPENDENT_MIXTURE = "test_fortunes_rates_by_size"
NAN_RATE_MIXTURE = "test_fortunes_nan_rate"
NEGATIVE_RATE_MIXTURE = "test_fortunes_negative_rate"
ZERO_RATE_MIXTURE = "test_fortunes_zero_rate"  # OTHER_TASK at rate 0
NESTED_ZERO_RATE_MIXTURE = "test_fortunes_zero_rate_submixture"  # TASK, and FIXED_MIXTURE at rate 0
ALL_ZERO_RATE_MIXTURE = "test_fortunes_all_rates_zero"
BROKEN_SOURCE_TASK = "test_fortunes_broken_source"  # its dataset_fn raises
BROKEN_PREPROCESSOR_TASK = "test_fortunes_broken_preprocessor"  # a preprocessor raises on each row
TRACE_BROKEN_PREPROCESSOR_TASK = "test_fortunes_broken_preprocessor_trace"  # ... when TensorFlow traces it
# With register_other_vocabulary: sorted after TASK, so that a Mixture's first task is TASK.
OTHER_VOCAB_TASK = "test_fortunes_span_corruption_other_vocab"
SPLIT_VOCAB_TASK = "test_fortunes_span_corruption_split_vocab"  # 'inputs' other vocabulary, 'targets' not
OTHER_VOCAB_MIXTURE = "test_fortunes_other_vocab_only"
MIXED_VOCAB_MIXTURE = "test_fortunes_mixed_vocabularies"  # TASK and OTHER_VOCAB_TASK
NESTED_MIXED_VOCAB_MIXTURE = "test_fortunes_mixed_vocabularies_nested"  # FIXED_MIXTURE, OTHER_VOCAB_MIXTURE
TEXT_FILE_TASK = "test_text_file_span_corruption"  # a seqio.TextLineDataSource over a file (`register_text_file`)
TWO_FILES_TASK = "test_text_files_span_corruption"  # ... over two files: two source shards
FAILING_FILES_TASK = "test_text_files_failing"  # ... whose second file holds a line a preprocessor rejects
# Documents of each split: the corpus's first TRAIN rows, then the next VALIDATION rows.
TRAIN, VALIDATION = 300, 40


def read_texts(corpus: str, split: str, offset: int = 0):
  """The texts of `split` (first TRAIN rows, then VALIDATION rows), skipping `offset` rows first."""
  with gzip.open(corpus, "rt") if corpus.endswith(".gz") else open(corpus, encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for _, line in zip(range(offset + TRAIN + VALIDATION), f)][offset:]
  return texts[:TRAIN] if split == "train" else texts[TRAIN:]


def _add_task(name: str, corpus: str, vocab_path: str, offset: int, inputs_vocab_path: str = None,
              broken_source: bool = False, broken_preprocessor: str = "") -> None:
  def dataset_fn(split, shuffle_files, seed=None):
    del shuffle_files, seed
    if broken_source:
      raise RuntimeError(f"the corpus of {split} is gone\n(a second line that must not be printed)")
    return tf.data.Dataset.from_tensor_slices({"text": read_texts(corpus, split, offset)})

  def fail(text):
    raise ValueError("cannot parse this row\n(a second line that must not be printed)")

  def broken(dataset):
    if broken_preprocessor == "trace":  # a Python error in the traced function: TensorFlow's "in user code:"
      return dataset.map(lambda ex: {"text": ex["title"]})
    # Raises on each row, inside TensorFlow, while the examples are read.
    return dataset.map(lambda ex: {"text": tf.reshape(tf.py_function(fail, [ex["text"]], tf.string), [])})

  vocab = seqio.SentencePieceVocabulary(vocab_path, extra_ids=100)
  inputs_vocab = seqio.SentencePieceVocabulary(inputs_vocab_path, extra_ids=100) if inputs_vocab_path else vocab
  seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(dataset_fn, splits=["train", "validation"]),
      preprocessors=[*([broken] if broken_preprocessor else []),
                     functools.partial(t5_preprocessors.rekey, key_map={"inputs": None, "targets": "text"}),
                     seqio.preprocessors.tokenize, t5_preprocessors.span_corruption,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={"inputs": seqio.Feature(inputs_vocab, add_eos=True, required=False),
                       "targets": seqio.Feature(vocab, add_eos=True)},
      metric_fns=[])


def _add_mixture(name: str, tasks, **kwargs) -> None:
  seqio.MixtureRegistry.remove(name)
  seqio.MixtureRegistry.add(name, tasks, **kwargs)


def register(corpus: str, vocab_path: str) -> None:
  """Registers the Tasks and Mixtures on one vocabulary (again: replaces them)."""
  _add_task(TASK, corpus, vocab_path, 0)
  _add_task(OTHER_TASK, corpus, vocab_path, TRAIN + VALIDATION)
  _add_task(BROKEN_SOURCE_TASK, corpus, vocab_path, 0, broken_source=True)
  _add_task(BROKEN_PREPROCESSOR_TASK, corpus, vocab_path, 0, broken_preprocessor="run")
  _add_task(TRACE_BROKEN_PREPROCESSOR_TASK, corpus, vocab_path, 0, broken_preprocessor="trace")
  _add_mixture(FIXED_MIXTURE, [(TASK, 1.0), (OTHER_TASK, 2.0)])
  _add_mixture(DATA_DEPENDENT_MIXTURE, [TASK, OTHER_TASK], default_rate=seqio.mixing_rate_num_examples)
  _add_mixture(NAN_RATE_MIXTURE, [(TASK, 1.0), (OTHER_TASK, float("nan"))])
  _add_mixture(NEGATIVE_RATE_MIXTURE, [(TASK, 1.0), (OTHER_TASK, -1.0)])
  _add_mixture(ZERO_RATE_MIXTURE, [(TASK, 1.0), (OTHER_TASK, 0.0)])
  _add_mixture(NESTED_ZERO_RATE_MIXTURE, [(TASK, 1.0), (FIXED_MIXTURE, 0.0)])
  _add_mixture(ALL_ZERO_RATE_MIXTURE, [(TASK, 0.0), (OTHER_TASK, 0)])


def register_other_vocabulary(corpus: str, vocab_path: str, other_vocab_path: str) -> None:
  """Registers the Tasks and Mixtures that use a second vocabulary (after `register`)."""
  _add_task(OTHER_VOCAB_TASK, corpus, other_vocab_path, TRAIN + VALIDATION)
  _add_task(SPLIT_VOCAB_TASK, corpus, vocab_path, 0, inputs_vocab_path=other_vocab_path)
  _add_mixture(OTHER_VOCAB_MIXTURE, [(OTHER_VOCAB_TASK, 1.0)])
  _add_mixture(MIXED_VOCAB_MIXTURE, [(TASK, 1.0), (OTHER_VOCAB_TASK, 1.0)])
  _add_mixture(NESTED_MIXED_VOCAB_MIXTURE, [(FIXED_MIXTURE, 1.0), (OTHER_VOCAB_MIXTURE, 1.0)])


if os.environ.get("PRIVATE_T5_SEQIO_CORPUS") and os.environ.get("PRIVATE_T5_SEQIO_VOCAB"):
  register(os.environ["PRIVATE_T5_SEQIO_CORPUS"], os.environ["PRIVATE_T5_SEQIO_VOCAB"])


def register_text_file(path, vocab_path: str, name: str = TEXT_FILE_TASK, fail_on: str = "") -> None:
  """Registers `name` (default TEXT_FILE_TASK): span corruption over the lines of the text file(s)
  `path` (a path or a list: one source shard per file; train split), read by a
  `seqio.TextLineDataSource` (a Task whose data files are known). With `fail_on`, a preprocessor
  raises on the first line containing it (a Task whose data fails midway)."""
  vocab = seqio.SentencePieceVocabulary(vocab_path, extra_ids=100)

  def check(line):
    if fail_on and fail_on in line.numpy().decode("utf-8"):
      raise ValueError(f"cannot parse a line containing {fail_on!r}")
    return line

  def to_targets(dataset):
    if fail_on:
      dataset = dataset.map(lambda line: tf.reshape(tf.py_function(check, [line], tf.string), []))
    return dataset.map(lambda line: {"targets": line})

  seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.TextLineDataSource({"train": path}),
      preprocessors=[to_targets, seqio.preprocessors.tokenize, t5_preprocessors.span_corruption,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={"inputs": seqio.Feature(vocab, add_eos=True, required=False),
                       "targets": seqio.Feature(vocab, add_eos=True)},
      metric_fns=[])
