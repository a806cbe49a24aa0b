"""`private-t5 store`: tokenize a corpus into the token store cache ahead of training.

  private-t5 store --corpus='data/train-*.jsonl.gz' --vocab_path=vocab/spm.model --cache_dir=cache/
  private-t5 store --corpus='data/train-*.jsonl.gz' --vocab_path=vocab/spm.model --cache_dir=cache/ \\
      --runner=DirectRunner --beam_options="--direct_num_workers=2 --direct_running_mode=multi_processing"

Builds the store (see `private_t5.data.store`) in-process (`--runner=local`, one shard) or on
Apache Beam (one shard per input file, written by the workers; `private_t5.data.store_beam`)
into the cache entry that training looks up for the same corpus, vocabulary and reader
options: `private-t5 train` with DATA_CACHE_DIR set to the same folder reuses it. An entry
already built is reused. Prints a JSON summary (path, documents, tokens, shards, seconds, and
the build's MB/s and documents/s) and the Beam counters.
"""
import inspect
import json
import sys
import time
from typing import List, Optional

import gin

from private_t5.data import beam_io
from private_t5.data import store as store_lib
from private_t5.errors import ConfigError
from private_t5.stages import flags
from private_t5.stages import gin_utils

# Reader options: the Gin files' `make_source.NAME` bindings, else make_source's own defaults.
_READER_OPTIONS = ("text_field", "id_field", "user_field", "errors", "max_documents", "data_dir")


def _reader_defaults() -> dict:
  """make_source's defaults of the reader options (read from its signature, not copied)."""
  params = inspect.signature(gin_utils.resolve(gin_utils.CONFIGURABLES["make_source"])).parameters
  return {name: params[name].default for name in _READER_OPTIONS}


def _parser() -> flags.StageParser:
  p = flags.StageParser("store", __doc__.split("\n\n")[0], epilog=(
      "With --gin_file (e.g. runs/pretrain.gin plus the run's overrides) the corpus, vocabulary and "
      "cache folder default to its CORPUS, VOCAB_PATH and DATA_CACHE_DIR, and the reader options to its "
      "make_source bindings, so the store lands in the cache entry that run's training looks up."),
      macro_entry="train", macros_from_bindings=True)
  # The Gin macros of configs/runs/pretrain.gin give the defaults of these three.
  p.add_flag("corpus", help="corpus spec or file pattern (train-*.jsonl.gz)")
  p.add_flag("vocab_path", aliases=("vocab",), help="SentencePiece model (T5 layout)")
  p.add_flag("cache_dir", macro="DATA_CACHE_DIR",
             help="store cache folder (default $PRIVATE_T5_CACHE/stores or ~/.cache/private_t5/stores)")
  p.add_flag("text_field", macro=False, help="field / column holding the text (default text)")
  p.add_flag("id_field", macro=False, help="field holding the document id (default id)")
  p.add_flag("user_field", macro=False, help="field holding the user id (user-level DP)")
  p.add_flag("errors", choices=("strict", "replace"), macro=False,
             help="invalid UTF-8: stop (strict, default) or substitute U+FFFD (replace)")
  p.add_flag("max_documents", type=int, macro=False, help="read at most this many documents (local runner)")
  p.add_flag("data_dir", macro=False, help="TFDS data directory for tfds: specs")
  p.add_flag("num_threads", type=int, macro=False,
             help="SentencePiece threads (local: default all cores; Beam: per worker, default 1)")
  beam_io.add_runner_flags(p.flag_group)
  return p


def _settings(argv: List[str]):
  args, files, bindings = _parser().parse_stage_args(argv)
  if files or bindings:  # parsed by parse_stage_args (the plain flags' macros)
    for name in _READER_OPTIONS:
      if getattr(args, name) is None:
        try:
          setattr(args, name, gin.query_parameter(f"make_source.{name}"))
        except ValueError:
          pass
  for name, default in _reader_defaults().items():
    if getattr(args, name) is None:
      setattr(args, name, default)
  flags.check_required(_parser(), args, ("corpus", "vocab_path"))
  if args.skip_bad_lines:
    raise ConfigError("private-t5 store: --skip_bad_lines is not supported (the store keeps every document "
                      "of the corpus, as training reads it); fix or remove the malformed lines")
  return args


def main(argv: Optional[List[str]] = None) -> int:
  args = _settings(list(sys.argv[1:] if argv is None else argv))
  reader = dict(text_field=args.text_field, id_field=args.id_field, user_field=args.user_field,
                errors=args.errors, max_documents=args.max_documents, data_dir=args.data_dir)
  reused = store_lib.cache_target(args.corpus, args.vocab_path, store_lib.reader_options_of(**reader),
                                  args.cache_dir).exists()
  start = time.time()
  counters = {}
  if beam_io.is_beam(args.runner):
    from private_t5.data import store_beam  # pylint: disable=g-import-not-at-top
    beam_io.log_to_stderr_once()
    store, counters = store_beam.build_store_beam(args.corpus, args.vocab_path, runner=args.runner,
                                                  beam_options=args.beam_options, cache_dir=args.cache_dir,
                                                  num_threads=args.num_threads or 1, **reader)
  else:
    store = store_lib.build_store(args.corpus, args.vocab_path, cache_dir=args.cache_dir,
                                  num_threads=args.num_threads, **reader)
  seconds = time.time() - start
  m = store.manifest
  text_mb = int(m.get("text_bytes", 0)) / 1e6
  # Rates of the build itself (read + tokenize + write + index), without loading the vocabulary.
  build = None if reused else float(m.get("build_seconds") or 0.0)
  summary = {
      "path": store.path,
      "runner": m.get("runner", "local"),
      "reused": reused,
      "documents": store.num_documents,
      "tokens": store.num_tokens,
      "shards": store.num_shards,
      "text_mb": round(text_mb, 3),
      "seconds": round(seconds, 3),
      "build_seconds": build,
      "mb_per_s": round(text_mb / build, 3) if build else None,
      "documents_per_s": round(store.num_documents / build, 1) if build else None,
      "counters": counters,
  }
  json.dump(summary, sys.stdout, indent=2)
  print()
  return 0


if __name__ == "__main__":
  sys.exit(main())
