"""The example store: one split of a seqio Task or Mixture written once to disk, read by random access.

A C4-sized Task (hundreds of GB of examples) does not fit in memory. Its split is written once,
streaming (never held: each batch of examples goes to disk as it comes), into a cache entry;
training then reads the examples it samples from memory-mapped files, so the memory a run holds
does not grow with the Task (a few integers per shard, nothing per example).

Layout of a store directory (built in a temp dir under the cache, then renamed: complete or
absent; a killed build leaves only a `.building-*` folder that the next build removes):

  inputs-SSSSS-of-KKKKK.int32    shard S of K: the 'inputs' tokens of its examples back to back
                                 (each trimmed to the feature length, not padded), little-endian
  inputs-SSSSS-of-KKKKK.int64    n_S + 1 offsets: local example j is tokens[offsets[j]:offsets[j+1]]
  targets-SSSSS-of-KKKKK.int32   the same for 'targets'
  targets-SSSSS-of-KKKKK.int64
  manifest.json                  format version, the Task or Mixture, module, split, feature lengths,
                                 seed, the examples of each task, the tasks left out (rate 0), the
                                 vocabulary (path, SHA-256, size), the shard index (`shards`: task,
                                 source shard, files, examples, tokens and SHA-256 of each;
                                 `shard_starts`: K + 1 cumulative example counts), `tokens_sha256`,
                                 `checksums` (size and SHA-256 of every file: `store_files.check_entry`
                                 compares the sizes on open, `private-t5 store --verify` the
                                 digests; a damaged entry is refused, or rebuilt by the stage),
                                 build time and runner

One store shard per source shard (`seqio_read.read_split`): the tasks in order, each task's
source shards in seqio's order (`list_shards`: a file of a file or TFDS source; the whole split
of a function source), each read with its own `shard_info` and seed. Example i is shard S with
shard_starts[S] <= i < shard_starts[S + 1], local example i - shard_starts[S].

Example order, local and Beam: the local build reads the shards one after another in that order;
the Beam build gives each worker whole shards (one `task.get_dataset(..., shard_info=...)` per
shard, as seqio's `cache_tasks_main` reads a Task), each written to its own files, and the
launching process orders them by shard index. Both builds read every shard the same way and
index them the same way, so their stores are identical, file for file (tested). They are the
same examples, in the same order, as `seqio_source.SeqioSource` holds in memory. (seqio's
sharded reading cannot give the order of one unsharded read of a multi-file source, which
interleaves its files, so the one read order is the sharded one, for every storage.)

Cache key: the Task or Mixture name, its module(s), split, feature lengths, seed, use_cached,
max_examples, the vocabulary's SHA-256, the format version, and for each task read its name,
its preprocessors' names and its source shards (a local file with its size and modification
time). Not in it: the code of the Task's functions (a Task changed under the same name and
files needs its entry deleted) and the contents of remote files.

Bytes held per example when reading: none. The offsets are memory-mapped, not loaded; a batch
is a binary search over the K + 1 shard starts, two offsets and a slice of each feature.
"""
import hashlib
import json
import logging
import os
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from private_t5 import progress as progress_lib
from private_t5.data import beam_runner
from private_t5.data import beam_pipeline
from private_t5.data import seqio_lookup, seqio_read, seqio_source
from private_t5.data import store as store_lib
from private_t5.data import store_files
from private_t5.errors import ConfigError, DataError
from private_t5.io import atomic_open, file_sha256, write_json_atomic

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
KIND = "seqio_examples"
KEY_PREFIX = "seqio-"
MANIFEST_FILE = "manifest.json"
FEATURES = ("inputs", "targets")
_SIDE_FILE = "shard-{:05d}.json"  # a Beam worker's entry of the shard index


def shard_file_names(index: int, num_shards: int) -> Dict[str, Tuple[str, str]]:
  """Feature -> (tokens file, offsets file) of shard `index` of `num_shards`."""
  suffix = f"{index:05d}-of-{num_shards:05d}"
  return {f: (f"{f}-{suffix}.int32", f"{f}-{suffix}.int64") for f in FEATURES}


# --- reading -----------------------------------------------------------------------------------

class ExampleStore:
  """Read-only view of a built example store; shard files are memory-mapped on first use.

  Opening checks the files' sizes against the manifest's record (`verify`: their SHA-256 too);
  a damaged entry raises `store.DamagedStoreError`.
  """

  def __init__(self, path: str, verify: bool = False):
    self.path = path
    try:
      with open(os.path.join(path, MANIFEST_FILE), encoding="utf-8") as f:
        self.manifest = json.load(f)
    except (OSError, ValueError) as e:
      raise DataError(f"{path} is not a seqio example store: {e}") from e
    if self.manifest.get("kind") != KIND or self.manifest.get("format_version") != FORMAT_VERSION:
      raise DataError(f"{path}: not a seqio example store of format {FORMAT_VERSION}")
    recorded = store_files.check_entry(path, self.manifest, checksum=verify)
    self.shards = self.manifest["shards"]
    self._starts = np.asarray(self.manifest["shard_starts"], dtype=np.int64)  # K + 1 integers
    if len(self._starts) != len(self.shards) + 1 or self._starts[0] != 0:
      raise DataError(f"{path}: the shard index does not match its {len(self.shards)} shards")
    for shard in self.shards:
      for feature in FEATURES:
        name = shard["files"][feature]["offsets"]
        try:
          size = os.path.getsize(os.path.join(path, name))
        except OSError as e:
          raise DataError(f"{path}: missing shard file {name}") from e
        if size != (int(shard["examples"]) + 1) * 8:
          raise DataError(f"{path}: {name} holds {size // 8} offsets, not {int(shard['examples']) + 1}")
        if not recorded:  # an entry built before the record: the tokens checked against their offsets
          store_files.check_tokens_file(path, shard["files"][feature]["tokens"], name)
    self._maps: Dict[int, Dict[str, Tuple[np.ndarray, np.ndarray]]] = {}
    self.reused = False  # set by `store.open_cached`: found in the cache rather than built
    self.rebuilt: Optional[str] = None  # why a damaged entry was rebuilt, if it was

  @property
  def num_examples(self) -> int:
    return int(self._starts[-1])

  @property
  def num_shards(self) -> int:
    return len(self.shards)

  @property
  def task_sizes(self) -> Dict[str, int]:
    return dict(self.manifest["tasks"])

  def _shard(self, k: int) -> Dict[str, Tuple[store_files.MappedFile, store_files.MappedFile]]:
    """Feature -> (tokens, offsets) of shard `k`, memory-mapped (an empty token file: an empty array)."""
    maps = self._maps.get(k)
    if maps is None:
      maps = {}
      for feature in FEATURES:
        files = self.shards[k]["files"][feature]
        # Mapped once their sizes match the manifest's offsets (`store_files.MappedFile`: checked
        # again before each read, and a file shrunk under the run is one line, not a bus error).
        offsets = store_files.MappedFile(os.path.join(self.path, files["offsets"]), "<i8", random_access=True)
        if not len(offsets.array):
          raise store_files.DamagedStoreError(self.path, f"{files['offsets']} is empty")
        n = int(offsets.array[-1])
        tokens = store_files.MappedFile(os.path.join(self.path, files["tokens"]), "<i4", 4 * n, random_access=True)
        maps[feature] = (tokens, offsets)
      self._maps[k] = maps
    return maps

  def fill_rows(self, indices: np.ndarray, out: Mapping[str, np.ndarray]) -> None:
    """Writes examples `indices` into the first rows of `out[feature]` (zeroed, [rows, length]);
    tokens past a row's length are dropped (a store is trimmed to its lengths already)."""
    indices = np.asarray(indices, dtype=np.int64)
    shard_of = np.searchsorted(self._starts, indices, side="right") - 1
    for k in np.unique(shard_of):
      rows = np.flatnonzero(shard_of == k)
      local = indices[rows] - self._starts[k]
      for feature, arr in out.items():
        tokens_file, offsets_file = self._shard(int(k))[feature]
        tokens_file.check()
        offsets_file.check()
        tokens, offsets = tokens_file.array, offsets_file.array
        begins, ends = np.asarray(offsets[local]), np.asarray(offsets[local + 1])
        ends = np.minimum(ends, begins + arr.shape[1])
        for row, begin, end in zip(rows, begins, ends):
          arr[row, :end - begin] = tokens[begin:end]

  def examples(self, indices: Sequence[int], lengths: Mapping[str, int]) -> Dict[str, np.ndarray]:
    """Feature -> int32 [len(indices), length]: the examples zero-padded to `lengths`."""
    out = {f: np.zeros((len(indices), int(lengths[f])), np.int32) for f in FEATURES}
    self.fill_rows(np.asarray(indices, dtype=np.int64), out)
    return out


class SeqioStoreSource(seqio_source.SeqioExamples):
  """One split of a seqio Task or Mixture as a `train.main.ExampleSource`, read from its example
  store (built on first use, or by `private-t5 store`, in `cache_dir`); the same examples at the
  same indices as `seqio_source.SeqioSource`, with nothing held in memory per example.

  Args: those of `seqio_source.SeqioSource`, and
    cache_dir: the store cache (the run's DATA_CACHE_DIR; default `store.default_cache_dir()`).
    progress: a progress bar while the store is built (on a terminal).
  """

  def __init__(self, mixture_or_task_name: str, split: str, feature_lengths: Mapping[str, int],
               module: Union[None, str, Sequence[str]] = None, one_example_per_document: bool = False,
               dp=None, seed: int = 0, use_cached: bool = False, max_examples: Optional[int] = None,
               documents_per_example: Optional[int] = None, cache_dir: Optional[str] = None,
               progress: bool = True):
    super().__init__(mixture_or_task_name, split, feature_lengths, module, one_example_per_document, dp,
                     documents_per_example)
    self.store, _ = build_example_store(mixture_or_task_name, split, self._lengths, module=module, seed=seed,
                                        use_cached=use_cached, max_examples=max_examples, cache_dir=cache_dir,
                                        progress=progress, resolved=self.resolved)
    self._count_examples(self.store.task_sizes)

  def _fill_rows(self, indices: np.ndarray, enc: np.ndarray, tgt: np.ndarray) -> None:
    self.store.fill_rows(indices, {"inputs": enc, "targets": tgt})

  def _storage(self) -> Dict[str, object]:
    return {"storage": "store", "store": self.store.path, "tokens_sha256": self.store.manifest["tokens_sha256"]}


# --- the cache entry ---------------------------------------------------------------------------

def _modules(module: Union[None, str, Sequence[str]]) -> Optional[List[str]]:
  return None if not module else ([module] if isinstance(module, str) else list(module))


def _shard_fingerprint(name: str):
  """A source shard as it enters the cache key: a local file with its size and modification time
  (an edited file is read again), anything else (a remote file, a split name) by its name."""
  if "://" not in name and os.path.isfile(name):
    st = os.stat(name)
    return [os.path.abspath(name), st.st_size, st.st_mtime_ns]
  return name


def _preprocessor_names(task) -> List[str]:
  utils = seqio_lookup.seqio.utils
  return [utils.function_name(p) for p in getattr(task, "preprocessors", ())]


class ExampleStoreTarget:
  """Where the store of (Task or Mixture, split, settings) lives in a cache, and its build.

  `plan`: the source shards to read, in store order (one store shard each).
  """

  def __init__(self, resolved: seqio_source.Resolved, split: str, lengths: Mapping[str, int], *,
               module=None, seed: int = 0, use_cached: bool = False, max_examples: Optional[int] = None,
               cache_dir: Optional[str] = None):
    self.resolved, self.split, self.lengths = resolved, split, dict(lengths)
    self.module, self.seed, self.use_cached, self.max_examples = module, seed, use_cached, max_examples
    self.plan: List[seqio_read.Shard] = [shard for task in resolved.tasks
                                         for shard in seqio_read.task_shards(task, split, use_cached)]
    self.vocab_sha256 = file_sha256(resolved.vocab_path)
    self.settings = {"mixture_or_task_name": resolved.name, "module": _modules(module), "split": split,
                     "feature_lengths": self.lengths, "seed": seed, "use_cached": use_cached,
                     "max_examples": max_examples}
    payload = {"format_version": FORMAT_VERSION, "kind": KIND, **self.settings, "vocab_sha256": self.vocab_sha256,
               "tasks": [{"name": t.name, "preprocessors": _preprocessor_names(t),
                          "shards": [_shard_fingerprint(s.name) for s in self.plan if s.task == t.name]}
                         for t in resolved.tasks]}
    key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]
    self.cache_dir = os.path.abspath(os.path.expanduser(cache_dir or store_lib.default_cache_dir()))
    store_lib.check_cache_dir(self.cache_dir)
    self.final = os.path.join(self.cache_dir, KEY_PREFIX + key)
    self.rebuilt: Optional[str] = None

  def exists(self) -> bool:
    return os.path.isfile(os.path.join(self.final, MANIFEST_FILE))

  def open(self, verify: bool = False, rebuild_damaged: bool = False) -> Optional[ExampleStore]:
    """The cached store (`store.open_cached`), or None when it must be built (absent, or damaged and removed)."""
    store, self.rebuilt = store_lib.open_cached(self.cache_dir, self.final, ExampleStore, verify, rebuild_damaged)
    return store

  def build(self, write, runner: str = beam_runner.LOCAL_RUNNER) -> ExampleStore:
    """Runs `write(build_dir) -> shard entries` in a fresh build directory in the cache, writes the
    manifest, then renames the directory into place (`store.build_in_cache`: a failed or
    interrupted build leaves the cache as it was)."""
    start = time.time()
    store_lib.build_in_cache(self.cache_dir, self.final,
                             lambda tmp: dict(self.manifest(write(tmp), start), runner=runner))
    store = ExampleStore(self.final)
    store.rebuilt = self.rebuilt
    return store

  def manifest(self, entries: Sequence[Dict[str, object]], start: float) -> Dict[str, object]:
    """The manifest of a build whose shards are `entries` (in plan order); DataError when empty."""
    starts, sizes = [0], {t.name: 0 for t in self.resolved.tasks}
    checksums: Dict[str, Dict[str, object]] = {}
    for entry in entries:
      checksums.update(entry.pop("checksums", {}))  # hashed while written
      starts.append(starts[-1] + int(entry["examples"]))
      sizes[entry["task"]] += int(entry["examples"])
    if not starts[-1]:
      raise DataError(f"seqio {self.resolved.name!r} split {self.split!r} has no examples")
    return {
        "format_version": FORMAT_VERSION, "kind": KIND, **self.settings,
        "tasks": sizes, "excluded_tasks": dict(self.resolved.excluded_tasks),
        "vocab_path": os.path.abspath(self.resolved.vocab_path), "vocab_sha256": self.vocab_sha256,
        "vocab_size": self.resolved.vocab_size, "num_examples": starts[-1],
        "num_tokens": {f: int(sum(int(e["tokens"][f]) for e in entries)) for f in FEATURES},
        "num_shards": len(entries), "shards": list(entries), "shard_starts": starts,
        # Of the per-shard digests (computed while writing), so the same whichever process wrote a shard.
        "tokens_sha256": hashlib.sha256("\n".join(e["sha256"] for e in entries).encode()).hexdigest(),
        store_files.CHECKSUMS_KEY: checksums,
        "build_seconds": round(time.time() - start, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# --- writing -----------------------------------------------------------------------------------

class ShardWriter:
  """Writes one store shard from batches of `seqio_read.read_shard`, streaming: four files
  (tokens and offsets of each feature), each through `atomic_open` (complete or absent, so a
  retried Beam bundle overwrites it whole), hashed as they are written."""

  def __init__(self, out_dir: str, index: int, num_shards: int):
    self.files = shard_file_names(index, num_shards)
    self.examples = 0
    self._ends = {f: 0 for f in FEATURES}
    self._open: List = []
    self._handles, self._hashes, self._sizes = {}, {}, {}
    try:
      for feature in FEATURES:
        for name in self.files[feature]:
          context = atomic_open(os.path.join(out_dir, name), "wb")
          self._handles[name] = context.__enter__()
          self._open.append(context)
          self._hashes[name] = hashlib.sha256()
          self._sizes[name] = 0
        self._write(self.files[feature][1], np.zeros((1,), "<i8"))
    except BaseException:
      self.abort()
      raise

  def _write(self, name: str, array: np.ndarray) -> None:
    data = array.tobytes()
    self._handles[name].write(data)
    self._hashes[name].update(data)
    self._sizes[name] += len(data)

  def add(self, batch: Mapping[str, np.ndarray]) -> int:
    """Appends a batch (padded rows and their lengths); returns its number of examples."""
    n = len(batch["inputs"])
    if not n:
      return 0
    for feature in FEATURES:
      rows, lengths = batch[feature], np.asarray(batch[f"{feature}_length"], dtype=np.int64)
      mask = np.arange(rows.shape[1]) < lengths[:, None]
      tokens_file, offsets_file = self.files[feature]
      self._write(tokens_file, np.ascontiguousarray(rows[mask], dtype="<i4"))  # row by row, each unpadded
      ends = self._ends[feature] + np.cumsum(lengths)
      self._write(offsets_file, ends.astype("<i8"))
      self._ends[feature] = int(ends[-1])
    self.examples += n
    return n

  def close(self, shard: seqio_read.Shard) -> Dict[str, object]:
    """Finishes the four files; returns the shard's entry of the manifest index."""
    while self._open:
      self._open.pop(0).__exit__(None, None, None)
    digest = hashlib.sha256("".join(self._hashes[name].hexdigest() for feature in FEATURES
                                    for name in self.files[feature]).encode()).hexdigest()
    return {"task": shard.task, "source_shard": shard.name, "source_shard_index": shard.index,
            "num_source_shards": shard.num_shards, "examples": self.examples,
            "files": {f: {"tokens": self.files[f][0], "offsets": self.files[f][1]} for f in FEATURES},
            "tokens": dict(self._ends), "sha256": digest,
            "checksums": {name: {"size": self._sizes[name], "sha256": self._hashes[name].hexdigest()}
                          for name in self._hashes}}

  def abort(self) -> None:
    """Removes the unfinished files (after an error)."""
    error = DataError("shard aborted")
    while self._open:
      try:
        self._open.pop().__exit__(DataError, error, None)
      except DataError:
        pass


def _write_shard(out_dir: str, k: int, num_shards: int, shard: seqio_read.Shard, batches, bar=None):
  writer = ShardWriter(out_dir, k, num_shards)
  try:
    for batch in batches:
      n = writer.add(batch)
      if bar is not None:
        bar.update(n)
    return writer.close(shard)
  except BaseException:
    writer.abort()
    raise


def _write_local(out_dir: str, target: ExampleStoreTarget, progress: bool) -> List[Dict[str, object]]:
  """Reads the split in this process (`seqio_read.read_split`) and writes one shard per source shard."""
  bar = progress_lib.bar(desc="[store] seqio examples", unit="examples",
                         disable=not (progress and progress_lib.enabled()))
  entries = []
  read = seqio_read.read_split(target.resolved.tasks, target.split, target.lengths, target.seed,
                                 target.use_cached, target.max_examples)
  for k, (_, shard, batches) in enumerate(read):
    if k >= len(target.plan) or shard != target.plan[k]:
      raise DataError(f"seqio Task {shard.task!r}: its source shards changed while its examples were read")
    entries.append(_write_shard(out_dir, k, len(target.plan), shard, batches, bar))
  bar.close()
  return entries


class _BeamShardBody:
  """DoFn body: (k, source shard) -> reads that shard in a worker, writes store shard k of K and
  its entry of the shard index (a side file the launching process reads)."""

  def __init__(self, out_dir: str, num_shards: int, module, split: str, lengths: Dict[str, int], seed: int,
               use_cached: bool):
    self.out_dir, self.num_shards, self.module, self.split = out_dir, num_shards, module, split
    self.lengths, self.seed, self.use_cached = lengths, seed, use_cached

  def setup(self):
    seqio_lookup.import_task_modules(self.module)  # registers the Tasks in a worker process

  def process(self, element):
    k, shard = element
    task = seqio_lookup.get_mixture_or_task(shard.task, self.module)
    batches = seqio_read.read_shard(task, shard, self.split, self.lengths, self.seed, self.use_cached)
    entry = _write_shard(self.out_dir, k, self.num_shards, shard, batches)
    write_json_atomic(os.path.join(self.out_dir, _SIDE_FILE.format(k)), entry, indent=None, sort_keys=False)
    beam_pipeline.counter("examples_written").inc(int(entry["examples"]))
    beam_pipeline.counter("tokens_written").inc(int(sum(entry["tokens"].values())))
    beam_pipeline.counter("shards_written").inc()
    yield k


def _write_beam(out_dir: str, target: ExampleStoreTarget, options, counters: Dict[str, int]):
  """Spreads the source shards over the Beam workers (one shard per element); each writes its own
  store shard into `out_dir`. Returns the shard entries in plan order."""
  beam = beam_runner.import_beam()
  body = _BeamShardBody(out_dir, len(target.plan), target.module, target.split, target.lengths, target.seed,
                        target.use_cached)
  pipeline = beam.Pipeline(options=options)
  _ = (pipeline
       | "source shards" >> beam.Create(list(enumerate(target.plan)))
       | "reshuffle" >> beam.Reshuffle()
       | "read and write shards" >> beam.ParDo(beam_pipeline.do_fn(beam, body)))
  beam_pipeline.run_pipeline(pipeline, stage="store (seqio)", runner=beam_runner.runner_name(options))
  entries = []
  for k, shard in enumerate(target.plan):
    side = os.path.join(out_dir, _SIDE_FILE.format(k))
    try:
      with open(side, encoding="utf-8") as f:
        entries.append(json.load(f))
    except OSError as e:
      raise DataError(f"the Beam build wrote no shard {k} ({shard.task!r} {shard.name}): {e}") from e
    os.remove(side)
  # Summed from the side files rather than read from Beam's metrics: the same on every runner.
  counters.update({"examples_written": sum(int(e["examples"]) for e in entries),
                   "tokens_written": sum(int(sum(e["tokens"].values())) for e in entries),
                   "shards_written": len(entries)})
  return entries


def build_example_store(mixture_or_task_name: str, split: str, feature_lengths: Mapping[str, int], *,
                        module: Union[None, str, Sequence[str]] = None, seed: int = 0, use_cached: bool = False,
                        max_examples: Optional[int] = None, cache_dir: Optional[str] = None,
                        runner: str = beam_runner.LOCAL_RUNNER, beam_options: Union[str, Sequence[str]] = "",
                        progress: bool = True, resolved: Optional[seqio_source.Resolved] = None,
                        verify: bool = False, rebuild_damaged: bool = False
                        ) -> Tuple[ExampleStore, Dict[str, int]]:
  """Builds (or reuses) the example store of one split; returns it and the Beam counters.

  Args:
    mixture_or_task_name, split, feature_lengths, module, seed, use_cached, max_examples: as
      `seqio_source.SeqioSource` reads the split (`max_examples`: local runner only).
    cache_dir: the store cache (default `store.default_cache_dir()`).
    runner, beam_options: "local" (this process) or a Beam runner and its `PipelineOptions`
      flags; on Beam, `cache_dir` must be writable by every worker.
    resolved: the checked Task or Mixture, when the caller has it.
    verify, rebuild_damaged: how a cached entry is checked (sizes; `verify`: SHA-256 too), and
      whether a damaged one is built again (else it is refused).

  Raises:
    ConfigError: bad settings (one line), `max_examples` on a Beam runner.
    DataError: the Task's code raised, an empty split, an unwritable cache; nothing is left behind.
      A damaged cached entry (`store.DamagedStoreError`, without `rebuild_damaged`).
  """
  lengths = seqio_source.check_feature_lengths(feature_lengths)
  beam = beam_runner.is_beam(runner)
  if beam and max_examples is not None:
    raise ConfigError("max_examples applies to --runner=local only (Beam workers read whole source shards)")
  options = beam_runner.pipeline_options(runner, beam_options) if beam else None
  resolved = resolved or seqio_source.resolve(mixture_or_task_name, module)
  target = ExampleStoreTarget(resolved, split, lengths, module=module, seed=seed, use_cached=use_cached,
                              max_examples=max_examples, cache_dir=cache_dir)
  cached = target.open(verify=verify, rebuild_damaged=rebuild_damaged)
  if cached is not None:
    return cached, {}
  counters: Dict[str, int] = {}
  if beam:
    store = target.build(lambda tmp: _write_beam(tmp, target, options, counters), runner)
  else:
    store = target.build(lambda tmp: _write_local(tmp, target, progress))
  if progress:
    logger.info("[store] seqio %s split %s on %s: %d examples, %d shards in %.1fs", mixture_or_task_name, split,
                store.manifest["runner"], store.num_examples, store.num_shards, store.manifest["build_seconds"])
  return store, counters


def store_summary(store: ExampleStore, seconds: float, counters: Mapping[str, int]) -> Dict[str, object]:
  """`private-t5 store`'s JSON summary of a seqio example store (`seconds`: the whole stage)."""
  m = store.manifest
  reused = store.reused
  build = None if reused else float(m.get("build_seconds") or 0.0)
  tokens = int(sum(m["num_tokens"].values()))
  return {
      "path": store.path, "runner": m.get("runner", beam_runner.LOCAL_RUNNER), "reused": reused,
      "rebuilt": store.rebuilt,
      "mixture_or_task_name": m["mixture_or_task_name"], "split": m["split"], "tasks": m["tasks"],
      "examples": store.num_examples, "tokens": tokens, "shards": store.num_shards,
      "seconds": round(seconds, 3), "build_seconds": build,
      "examples_per_s": round(store.num_examples / build, 1) if build else None,
      "tokens_per_s": round(tokens / build, 1) if build else None,
      "counters": dict(counters),
  }


def make_seqio_source(mixture_or_task_name: str, split: str = "train",
                      feature_lengths: Optional[Mapping[str, int]] = None,
                      module: Union[None, str, Sequence[str]] = None, one_example_per_document: bool = False,
                      dp=None, seed: int = 0, use_cached: bool = False, max_examples: Optional[int] = None,
                      required: bool = True, documents_per_example: Optional[int] = None,
                      storage: str = "auto", cache_dir: Optional[str] = None) -> Optional["seqio_source.SeqioExamples"]:
  """The Gin-facing factory of the source of a seqio split (configs/runs/seqio.gin binds it).

  `storage`: "memory" (`seqio_source.SeqioSource`), "store" (`SeqioStoreSource`: the split written
  once into an example store under `cache_dir`, the run's DATA_CACHE_DIR, and read from disk), or
  "auto" (`seqio_source.choose_storage`: memory only for a split known to hold at most AUTO_MEMORY_EXAMPLES
  examples). Both give the same examples at the same indices. `required=False` (the validation
  data): None when no task of it has `split`.
  """
  if max_examples is not None and (isinstance(max_examples, bool) or not isinstance(max_examples, int)
                                   or max_examples < 1):
    raise ConfigError(f"max_examples must be a positive integer (or None for all), got {max_examples!r}")
  sampled = seqio_lookup.sampled_tasks(seqio_lookup.get_mixture_or_task(mixture_or_task_name, module))
  if not required and not any(split in task.splits for task in sampled):
    return None
  lengths = feature_lengths or {"inputs": 512, "targets": 114}
  options = dict(module=module, one_example_per_document=one_example_per_document, dp=dp, seed=seed,
                 use_cached=use_cached, max_examples=max_examples, documents_per_example=documents_per_example)
  if seqio_source.choose_storage(storage, sampled, split, max_examples) == "memory":
    return seqio_source.SeqioSource(mixture_or_task_name, split, lengths, **options)
  return SeqioStoreSource(mixture_or_task_name, split, lengths, cache_dir=cache_dir, **options)
