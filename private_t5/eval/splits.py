"""The four memorization splits of Lee et al. (2021) and Ponomareva et al. 2022 (§4, Table 3).

* train dup: training documents with a near-duplicate elsewhere in the training set;
* train unique: the other training documents;
* valid in train: validation documents with a near-duplicate in the training set;
* valid unique: the other validation documents.

Two documents are near-duplicates (Lee et al. 2021, "Deduplicating Training Data Makes
Language Models Better", §4) when either
  * NearDup: MinHash LSH over lower-cased, space-tokenized word 5-grams puts them in one
    bucket (9,000 permutations in 450 bands of 20 rows: a pair with Jaccard similarity s is a
    candidate with probability 1 - (1 - s^20)^450, 0.994 at s = 0.8) and the candidate pair
    has an edit similarity over words of at least 0.8; or
  * ExactSubstr: they share a substring of at least 50 tokens (found here with a 64-bit
    rolling hash of every 50-token window instead of a suffix array).

Near-duplicates of a document with itself (a boilerplate paragraph repeated inside one
document) do not count. This module is the entry point: `load_or_build_splits` reuses the
split file of the same corpora and settings or builds it, and the names of the modules below
are importable from here too:

  split_types   SPLIT_NAMES, SplitConfig, Splits (a flag a document), check_nonempty
  near_dup      words, shingles, MinHash band keys, window hashes, edit similarity
  lsh_pairs     candidate pairs of the LSH buckets, counted and ranked
  split_search  build_splits_streaming / build_splits: the in-process search (texts on disk)
  split_files   the split file: its key, format, reading and writing
"""
from typing import Callable, Optional, Sequence

# pylint: disable=unused-import
from private_t5.eval.split_files import load_split_file, split_file_path, splits_key, write_split_file
from private_t5.eval.split_search import build_splits_streaming
from private_t5.eval.split_types import SplitConfig
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.eval.split_search': ('build_splits',),
})
# pylint: enable=unused-import


def load_or_build_splits(out_dir: str, train_docs: Sequence, valid_docs: Sequence,
                         cfg: SplitConfig = SplitConfig(),
                         tokenize: Optional[Callable[[str], Sequence[int]]] = None,
                         tokenizer_id: Optional[str] = None, specs: Optional[dict] = None,
                         verbose: bool = False):
  """Reads `out_dir/splits_<key>.json` when it exists, else builds and writes it (documents in memory).

  Returns:
    (splits with ids, path, reused).
  """
  key = splits_key(train_docs, valid_docs, cfg, tokenizer_id if tokenize else None)
  path = split_file_path(out_dir, key)
  splits = load_split_file(path, key, verbose)
  reused = splits is not None
  if not reused:
    splits = build_splits_streaming(train_docs, valid_docs, cfg, tokenize=tokenize, verbose=verbose)
    write_split_file(path, splits, key, cfg, tokenizer_id, specs)
  return splits.with_ids((d.id for d in train_docs), (d.id for d in valid_docs)), path, reused
