"""Small seqio Tasks over real text, registered as a T5X user registers theirs.

`--gin.MIXTURE_OR_TASK_MODULE=seqio_tasks` imports this module, which registers them from the
corpus and vocabulary named by $PRIVATE_T5_SEQIO_CORPUS and $PRIVATE_T5_SEQIO_VOCAB (or call
`register`). Each Task reads texts through a `seqio.FunctionDataSource` and runs t5's
`span_corruption`, as T5X's C4 span-corruption Task does.
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
# Documents of each split: the corpus's first TRAIN rows, then the next VALIDATION rows.
TRAIN, VALIDATION = 300, 40


def read_texts(corpus: str, split: str, offset: int = 0):
  """The texts of `split` (first TRAIN rows, then VALIDATION rows), skipping `offset` rows first."""
  with gzip.open(corpus, "rt") if corpus.endswith(".gz") else open(corpus, encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for _, line in zip(range(offset + TRAIN + VALIDATION), f)][offset:]
  return texts[:TRAIN] if split == "train" else texts[TRAIN:]


def _add_task(name: str, corpus: str, vocab_path: str, offset: int) -> None:
  def dataset_fn(split, shuffle_files, seed=None):
    del shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({"text": read_texts(corpus, split, offset)})

  vocab = seqio.SentencePieceVocabulary(vocab_path, extra_ids=100)
  seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(dataset_fn, splits=["train", "validation"]),
      preprocessors=[functools.partial(t5_preprocessors.rekey, key_map={"inputs": None, "targets": "text"}),
                     seqio.preprocessors.tokenize, t5_preprocessors.span_corruption,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={"inputs": seqio.Feature(vocab, add_eos=True, required=False),
                       "targets": seqio.Feature(vocab, add_eos=True)},
      metric_fns=[])


def register(corpus: str, vocab_path: str) -> None:
  """Registers the two Tasks and two Mixtures (again: replaces them)."""
  _add_task(TASK, corpus, vocab_path, 0)
  _add_task(OTHER_TASK, corpus, vocab_path, TRAIN + VALIDATION)
  for name in (FIXED_MIXTURE, DATA_DEPENDENT_MIXTURE):
    seqio.MixtureRegistry.remove(name)
  seqio.MixtureRegistry.add(FIXED_MIXTURE, [(TASK, 1.0), (OTHER_TASK, 2.0)])
  seqio.MixtureRegistry.add(DATA_DEPENDENT_MIXTURE, [TASK, OTHER_TASK],
                            default_rate=seqio.mixing_rate_num_examples)


if os.environ.get("PRIVATE_T5_SEQIO_CORPUS") and os.environ.get("PRIVATE_T5_SEQIO_VOCAB"):
  register(os.environ["PRIVATE_T5_SEQIO_CORPUS"], os.environ["PRIVATE_T5_SEQIO_VOCAB"])
