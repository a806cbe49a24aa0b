"""`private-t5 store`: tokenize a corpus (or write a seqio Task's examples) into the store cache ahead of training.

  private-t5 store --corpus='data/train-*.jsonl.gz' --vocab_path=vocab/spm.model --cache_dir=cache/
  private-t5 store --corpus='data/train-*.jsonl.gz' --vocab_path=vocab/spm.model --cache_dir=cache/ \\
      --runner=DirectRunner --beam_options="--direct_num_workers=2 --direct_running_mode=multi_processing"
  private-t5 store --mixture_or_task_name=c4_v220_span_corruption --mixture_or_task_module=t5.data.mixtures \\
      --task_feature_lengths="{'inputs': 512, 'targets': 114}" --cache_dir=cache/ [--runner=DataflowRunner ...]
  private-t5 store --corpus='/shared/c4/train-*.jsonl.gz' --vocab_path=/shared/vocab/spm.model \
      --cache_dir=/shared/cache/ --runner=DaskRunner --beam_options="--dask_client_address=HOST:8786"

Builds the store (see `private_t5.data.store`) in-process (`--runner=local`, one shard) or on
Apache Beam (one shard per input file, written by the workers; `private_t5.data.store_beam`; on
a cluster, Dask's included, the corpus and the cache folder on storage every worker reads and writes)
into the cache entry that training looks up for the same corpus, vocabulary and reader
options: `private-t5 train` with DATA_CACHE_DIR set to the same folder reuses it. An entry
already built is reused once its files are checked against the record made when it was built:
every file's size, and the SHA-256 of the offsets and index files (all but the token files; with
--verify the token files' too, the whole entry read once); a damaged entry (a file truncated,
missing or altered) is built again, with one log line naming the file. Prints a JSON summary
(path, documents, tokens, shards, seconds, "reused", "rebuilt": why a damaged entry was rebuilt,
and the build's MB/s and documents/s) and the Beam counters.

With --mixture_or_task_name (T5X's flag; or the MIXTURE_OR_TASK_NAME macro of the run's Gin files)
it writes one split of a seqio Task or Mixture into its example store (`data/seqio_store.py`), the
cache entry a run with the same Task, TASK_FEATURE_LENGTHS and DATA_CACHE_DIR reads: locally, or on
Beam with one source shard per worker. Seed, use_cached and max_examples: the Gin files'
`make_seqio_source` bindings, else its defaults, as training reads them.
"""
import ast
import inspect
import json
import sys
import time
from typing import List, Optional

import gin

from private_t5.data import beam_runner
from private_t5.data import beam_pipeline
from private_t5.data import store as store_lib
from private_t5.errors import ConfigError
from private_t5.stages import flags
from private_t5.stages import gin_utils
from private_t5.stages import gin_args
from private_t5.stages import gin_table
from private_t5.stages import train as train_stage

# Reader options: the Gin files' `make_source.NAME` bindings, else make_source's own defaults;
# for a seqio Task, those of `make_seqio_source`.
_READER_OPTIONS = ("text_field", "id_field", "user_field", "errors", "max_documents", "data_dir")
_SEQIO_OPTIONS = ("split", "seed", "use_cached", "max_examples")


def _fill_options(args, configurable: str, names, configured: bool) -> None:
  """Sets each of `names` left unset: the Gin files' `configurable.NAME` binding, else its default
  (read from the signature, not copied)."""
  params = inspect.signature(gin_utils.resolve(gin_table.CONFIGURABLES[configurable])).parameters
  for name in names:
    if getattr(args, name, None) is None and configured:
      try:
        setattr(args, name, gin.query_parameter(f"{configurable}.{name}"))
      except ValueError:
        pass
    if getattr(args, name, None) is None:
      setattr(args, name, params[name].default)


def _feature_lengths(value):
  """--task_feature_lengths="{'inputs': 512, 'targets': 114}" (or the macro's dict)."""
  try:
    return ast.literal_eval(value) if isinstance(value, str) else value
  except (ValueError, SyntaxError):
    raise ConfigError(f"--task_feature_lengths must be a dict such as \"{{'inputs': 512, 'targets': 114}}\", "
                      f"got {value!r}") from None


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
  p.add_flag("mixture_or_task_name", help="a registered seqio Task or Mixture (instead of --corpus)")
  p.add_flag("mixture_or_task_module", action="append", help="seqio: module registering it (repeatable)")
  p.add_flag("task_feature_lengths", type=_feature_lengths, help="seqio: \"{'inputs': Li, 'targets': Lt}\"")
  p.add_flag("split", macro=False, help="seqio: the split to write (default train)")
  p.add_flag("max_examples", type=int, macro=False, help="seqio: at most this many examples a task (local runner)")
  p.add_flag("verify", action="store_true", default=False, macro=False,
             help="also compare the SHA-256 of a cached entry's token files with its record (reads the whole "
                  "entry; the sizes of every file and the SHA-256 of the others are always compared)")
  beam_runner.add_runner_flags(p.flag_group)
  return p


def _settings(argv: List[str]):
  _, files, bindings = gin_args.split_gin_args(argv)
  if train_stage.with_seqio_layer(files, bindings) != files:  # layered as training layers it
    argv = argv + [f"--gin_file={train_stage.SEQIO_GIN}"]
  args, files, bindings = _parser().parse_stage_args(argv)
  configured = bool(files or bindings)  # parsed by parse_stage_args (the plain flags' macros)
  if args.mixture_or_task_name:
    if any(a.split("=", 1)[0] == "--corpus" for a in argv):
      raise ConfigError("private-t5 store: give --corpus or --mixture_or_task_name, not both")
    _fill_options(args, "make_seqio_source", _SEQIO_OPTIONS, configured)
    flags.check_required(_parser(), args, ("task_feature_lengths",))
  else:
    _fill_options(args, "make_source", _READER_OPTIONS, configured)
    flags.check_required(_parser(), args, ("corpus", "vocab_path"))
  for name in ("max_examples", "max_documents"):
    value = getattr(args, name, None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise ConfigError(f"--{name} must be a positive integer (or None for all), got {value!r}")
  if args.skip_bad_lines:
    raise ConfigError("private-t5 store: --skip_bad_lines is not supported (the store keeps every document "
                      "of the corpus, as training reads it); fix or remove the malformed lines")
  return args


def _seqio_summary(args) -> dict:
  from private_t5.data import seqio_store  # pylint: disable=g-import-not-at-top  # imports TensorFlow
  if beam_runner.is_beam(args.runner):
    beam_pipeline.log_to_stderr_once()
  start = time.time()
  store, counters = seqio_store.build_example_store(
      args.mixture_or_task_name, args.split, args.task_feature_lengths, module=args.mixture_or_task_module,
      seed=args.seed, use_cached=args.use_cached, max_examples=args.max_examples, cache_dir=args.cache_dir,
      runner=args.runner, beam_options=args.beam_options, verify=args.verify, rebuild_damaged=True)
  return seqio_store.store_summary(store, time.time() - start, counters)


def main(argv: Optional[List[str]] = None) -> int:
  args = _settings(list(sys.argv[1:] if argv is None else argv))
  if args.mixture_or_task_name:
    json.dump(_seqio_summary(args), sys.stdout, indent=2)
    print()
    return 0
  reader = dict(text_field=args.text_field, id_field=args.id_field, user_field=args.user_field,
                errors=args.errors, max_documents=args.max_documents, data_dir=args.data_dir)
  start = time.time()
  counters = {}
  if beam_runner.is_beam(args.runner):
    from private_t5.data import store_beam  # pylint: disable=g-import-not-at-top
    beam_pipeline.log_to_stderr_once()
    store, counters = store_beam.build_store_beam(args.corpus, args.vocab_path, runner=args.runner,
                                                  beam_options=args.beam_options, cache_dir=args.cache_dir,
                                                  num_threads=args.num_threads or 1, verify=args.verify,
                                                  rebuild_damaged=True, **reader)
  else:
    store = store_lib.build_store(args.corpus, args.vocab_path, cache_dir=args.cache_dir,
                                  num_threads=args.num_threads, verify=args.verify, rebuild_damaged=True,
                                  **reader)
  reused = store.reused
  seconds = time.time() - start
  m = store.manifest
  text_mb = int(m.get("text_bytes", 0)) / 1e6
  # Rates of the build itself (read + tokenize + write + index), without loading the vocabulary.
  build = None if reused else float(m.get("build_seconds") or 0.0)
  summary = {
      "path": store.path,
      "runner": m.get("runner", "local"),
      "reused": reused,
      "rebuilt": store.rebuilt,
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
