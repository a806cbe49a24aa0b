"""A seqio Task of any size through its on-disk example store: the same examples, N and privacy unit
as in memory; the Beam build (2 workers) identical to the local one, shard by shard in source-file
order; a failed or interrupted build leaves nothing; `private-t5 store --mixture_or_task_name=...`
writes the entry training reads; nothing held in memory per example; a short DP run on the store."""
import json
import mmap
import os
import socket
import subprocess
import types

import numpy as np
import pytest

from private_t5.data import seqio_read, seqio_source
from private_t5.data.store_files import DamagedStoreError
from private_t5.errors import ConfigError, DataError
from private_t5.stages import cli
from private_t5.stages import train as train_stage

# The Tasks, fixtures and helpers of the in-memory path's tests (seqio, t5 and TensorFlow are
# imported by the fixtures, not when the tests are collected).
from test_seqio_source import LENGTHS, _pretrain, _uncorrupted, pytestmark, seqio_tasks, task_data, train_source  # pylint: disable=unused-import

TWO_THREADS = "--direct_num_workers=2 --direct_running_mode=multi_threading"


def _seqio_store():
  from private_t5.data import seqio_store  # pylint: disable=g-import-not-at-top  # imports TensorFlow
  return seqio_store


def _store_source(cache, name, split="train", **kwargs):
  return _seqio_store().SeqioStoreSource(name, split, LENGTHS, module="seqio_tasks", cache_dir=str(cache),
                                         progress=False, **kwargs)


def _entries(cache):
  return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


@pytest.fixture(scope="module")
def two_files(task_data, seqio_tasks, tmp_path_factory):
  """TWO_FILES_TASK over two text files of 40 and 30 fortunes (two source shards), and the files."""
  corpus, _, vocab = task_data
  texts = seqio_tasks.read_texts(corpus, "train")
  folder = tmp_path_factory.mktemp("two_files")
  paths = [str(folder / "part-0.txt"), str(folder / "part-1.txt")]
  for path, part in zip(paths, (texts[:40], texts[40:70])):
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(t.replace("\n", " ") for t in part) + "\n")
  seqio_tasks.register_text_file(paths, vocab, name=seqio_tasks.TWO_FILES_TASK)
  return paths


def test_a_task_read_through_its_store_is_the_same_examples_as_in_memory(task_data, train_source, seqio_tasks,
                                                                         tmp_path):
  cache = tmp_path / "cache"
  stored = _store_source(cache, seqio_tasks.TASK)
  assert (stored.num_examples, stored.privacy_unit) == (train_source.num_examples, "example")
  assert stored.population() == train_source.population()
  everything = np.arange(stored.num_examples)
  batch, expected = (s.get_batch(everything, seed=0, batch_size=len(everything) + 3) for s in (stored, train_source))
  for key in expected:
    np.testing.assert_array_equal(batch[key], expected[key])
  described, in_memory = stored.describe(), train_source.describe()
  assert described["storage"] == "store" and in_memory["storage"] == "memory"
  where = ("storage", "store", "tokens_sha256")
  assert {k: v for k, v in described.items() if k not in where} == {k: v for k, v in in_memory.items() if k not in where}
  assert described["store"] == os.path.join(str(cache), _entries(cache)[0])
  # A later run reuses the entry; another seed is another entry.
  again = _store_source(cache, seqio_tasks.TASK)
  assert again.store.reused and again.describe()["tokens_sha256"] == described["tokens_sha256"]
  assert len(_entries(cache)) == 1
  _store_source(cache, seqio_tasks.TASK, max_examples=5, seed=1)
  assert len(_entries(cache)) == 2
  # A Mixture: its tasks in order, a task of rate 0 left out, as in memory.
  options = dict(split="validation", dp=object(), max_examples=30)
  mixture = _store_source(cache, seqio_tasks.ZERO_RATE_MIXTURE, **options)
  expected = seqio_source.SeqioSource(seqio_tasks.ZERO_RATE_MIXTURE, module="seqio_tasks",
                                      feature_lengths=LENGTHS, **options)
  assert mixture.population() == expected.population() and mixture.num_examples == 30
  assert mixture.store.manifest["excluded_tasks"] == {seqio_tasks.OTHER_TASK: seqio_source.ZERO_RATE}
  np.testing.assert_array_equal(mixture.get_batch(range(30), 0, 30)["decoder_target_tokens"],
                                expected.examples()[1])


def test_auto_keeps_in_memory_only_a_split_known_to_be_small(task_data, seqio_tasks, tmp_path):
  def task(declared):
    return types.SimpleNamespace(source=types.SimpleNamespace(num_input_examples=lambda split: declared))

  choose = seqio_source.choose_storage
  assert choose("auto", [task(None)], "train", None) == "store"  # a size not declared
  assert choose("auto", [task(6000), task(6000)], "train", None) == "store"
  assert choose("auto", [task(6000), task(4000)], "train", None) == "memory"
  assert choose("auto", [task(None)] * 2, "train", seqio_source.AUTO_MEMORY_EXAMPLES // 2) == "memory"
  assert choose("memory", [task(None)], "train", None) == "memory"
  with pytest.raises(ConfigError, match="storage must be one of 'auto', 'memory', 'store', got 'disk'"):
    choose("disk", [task(None)], "train", None)
  made = _seqio_store().make_seqio_source(seqio_tasks.TASK, "validation", LENGTHS, module="seqio_tasks",
                                        cache_dir=str(tmp_path / "cache"))
  assert made.describe()["storage"] == "store"  # a function source declares no size
  small = _seqio_store().make_seqio_source(seqio_tasks.TASK, "validation", LENGTHS, module="seqio_tasks",
                                         max_examples=4, cache_dir=str(tmp_path / "cache"))
  assert small.describe()["storage"] == "memory" and small.num_examples == 4
  for bad in (0, -3):  # refused as given, not as "split has no examples"
    with pytest.raises(ConfigError, match=f"^max_examples must be a positive integer \\(or None for all\\), got {bad}$"):
      _seqio_store().make_seqio_source(seqio_tasks.TASK, "validation", LENGTHS, module="seqio_tasks", max_examples=bad)


def test_beam_and_local_stores_of_a_task_are_identical_shard_by_shard(task_data, two_files, seqio_tasks, tmp_path):
  _, _, vocab = task_data
  store_lib = _seqio_store()
  local, _ = store_lib.build_example_store(seqio_tasks.TWO_FILES_TASK, "train", LENGTHS, module="seqio_tasks",
                                           cache_dir=str(tmp_path / "local"), progress=False)
  beam, counters = store_lib.build_example_store(
      seqio_tasks.TWO_FILES_TASK, "train", LENGTHS, module="seqio_tasks", cache_dir=str(tmp_path / "beam"),
      runner="DirectRunner", beam_options=TWO_THREADS, progress=False)
  assert counters["shards_written"] == 2 and counters["examples_written"] == local.num_examples
  assert local.num_shards == 2 and os.path.basename(local.path) == os.path.basename(beam.path)  # one cache key
  skip = ("build_seconds", "created", "runner")
  assert {k: v for k, v in beam.manifest.items() if k not in skip} == \
      {k: v for k, v in local.manifest.items() if k not in skip}
  assert beam.manifest["runner"] == "DirectRunner" and local.manifest["runner"] == "local"
  for shard in local.shards:
    for feature in store_lib.FEATURES:
      for name in shard["files"][feature].values():
        with open(os.path.join(local.path, name), "rb") as a, open(os.path.join(beam.path, name), "rb") as b:
          assert a.read() == b.read(), name
  # Store order: shard S is source file S, read whole (span corruption joins its lines only).
  import sentencepiece  # pylint: disable=g-import-not-at-top
  pieces = sentencepiece.SentencePieceProcessor(model_file=vocab)
  starts = local.manifest["shard_starts"]
  for k, path in enumerate(two_files):
    rows = local.examples(range(starts[k], starts[k + 1]), LENGTHS)
    seen = [t for e, t in zip(rows["inputs"], rows["targets"]) for t in _uncorrupted(e, t)]
    with open(path, encoding="utf-8") as f:
      assert seen == [t for line in f.read().splitlines() for t in pieces.encode(line)]
  # The in-memory source reads the same shards the same way: the same examples at the same indices.
  in_memory = seqio_source.SeqioSource(seqio_tasks.TWO_FILES_TASK, "train", LENGTHS, module="seqio_tasks")
  inputs, targets = in_memory.examples()
  everything = local.examples(range(local.num_examples), LENGTHS)
  np.testing.assert_array_equal(everything["inputs"], inputs)
  np.testing.assert_array_equal(everything["targets"], targets)
  with pytest.raises(ConfigError, match="max_examples applies to --runner=local only"):
    store_lib.build_example_store(seqio_tasks.TWO_FILES_TASK, "train", LENGTHS, module="seqio_tasks",
                                  max_examples=3, runner="DirectRunner", cache_dir=str(tmp_path / "x"))
  assert not os.path.exists(tmp_path / "x")


def test_a_build_that_fails_or_is_interrupted_midway_leaves_nothing(task_data, two_files, seqio_tasks, tmp_path,
                                                                    monkeypatch):
  _, _, vocab = task_data
  failing = tmp_path / "failing.txt"
  with open(two_files[1], encoding="utf-8") as f:
    lines = f.read().splitlines()
  failing.write_text("\n".join(lines[:20] + ["BOOM"] + lines[20:]) + "\n")
  seqio_tasks.register_text_file([two_files[0], str(failing)], vocab, name=seqio_tasks.FAILING_FILES_TASK,
                                 fail_on="BOOM")
  monkeypatch.setattr(seqio_read, "READ_BATCH", 2)  # shard 0 written, shard 1's files open when it fails
  written = []
  real_add = _seqio_store().ShardWriter.add
  monkeypatch.setattr(_seqio_store().ShardWriter, "add", lambda self, batch: written.append(1) or real_add(self, batch))
  cache = tmp_path / "cache" / "stores"
  with pytest.raises(DataError) as error:
    _store_source(cache, seqio_tasks.FAILING_FILES_TASK)
  assert str(error.value).startswith(f"seqio Task {seqio_tasks.FAILING_FILES_TASK!r} split 'train': reading its "
                                     "examples failed") and "ValueError: cannot parse a line containing 'BOOM'" \
      in str(error.value) and "\n" not in str(error.value)
  assert len(written) > 5 and not os.path.exists(tmp_path / "cache")  # nothing left, not even the folders

  def interrupted(self, batch):
    if len(written) > 3:
      raise KeyboardInterrupt
    return written.append(1) or real_add(self, batch)

  written.clear()
  monkeypatch.setattr(_seqio_store().ShardWriter, "add", interrupted)
  with pytest.raises(KeyboardInterrupt):  # Ctrl-C midway
    _store_source(cache, seqio_tasks.TWO_FILES_TASK)
  assert not os.path.exists(tmp_path / "cache")
  # A killed build leaves its build folder, which the next build in the cache removes.
  dead = subprocess.Popen(["true"])
  dead.wait()
  os.makedirs(cache / f".building-{socket.gethostname()}-{dead.pid}-0123456789ab" / "inputs-00000-of-00002.int32")
  monkeypatch.setattr(_seqio_store().ShardWriter, "add", real_add)
  built = _store_source(cache, seqio_tasks.TWO_FILES_TASK)
  assert _entries(cache) == [os.path.basename(built.store.path)]


def test_the_reader_holds_nothing_per_example(task_data, two_files, seqio_tasks, tmp_path):
  source = _store_source(tmp_path / "cache", seqio_tasks.TWO_FILES_TASK)
  source.get_batch([0, source.num_examples - 1], seed=0, batch_size=2)  # maps both shards
  arrays = []

  def visit(value, depth=0):
    if isinstance(value, np.ndarray):
      arrays.append(value)
    elif isinstance(value, dict) and depth < 8:
      for v in value.values():
        visit(v, depth + 1)
    elif isinstance(value, (list, tuple)) and depth < 8:
      for v in value:
        visit(v, depth + 1)
    elif type(value).__module__.startswith("private_t5") and depth < 8:
      visit(vars(value), depth + 1)

  visit(vars(source))
  is_mapped = lambda a: isinstance(a, np.memmap) or isinstance(getattr(a.base, "obj", None), mmap.mmap)
  mapped = [a for a in arrays if is_mapped(a)]
  assert len(mapped) == 2 * 4  # tokens and offsets of both features of both shards
  assert all(a.size <= source.store.num_shards + 1 for a in arrays if not is_mapped(a))
  # A file that shrinks under the reader: the next read names it, in one line (no bus error).
  tokens = os.path.join(source.store.path, source.store.shards[0]["files"]["inputs"]["tokens"])
  os.truncate(tokens, 4)
  with pytest.raises(DamagedStoreError, match=r"is damaged: .*inputs.* holds 4 bytes, expected \d+ \(it changed"):
    source.get_batch([0], seed=0, batch_size=1)


def test_the_store_stage_writes_the_entry_a_dp_run_then_trains_on(task_data, train_source, seqio_tasks, tmp_path,
                                                                  capsys):
  cache = tmp_path / "cache"
  task = ["--mixture_or_task_name", seqio_tasks.TASK, "--mixture_or_task_module=seqio_tasks"]
  lengths = "--task_feature_lengths={'inputs': 32, 'targets': 8}"
  assert cli.main(["store", *task, lengths, f"--cache_dir={cache}", "-q"]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert (summary["examples"], summary["split"], summary["reused"]) == (train_source.num_examples, "train", False)
  assert summary["tasks"] == {seqio_tasks.TASK: train_source.num_examples} and summary["shards"] == 1
  assert summary["examples_per_s"] > 0 and _entries(cache) == [os.path.basename(summary["path"])]
  # A damaged entry: refused when a run opens it (one line naming the file), rebuilt by the stage.
  tokens = os.path.join(summary["path"], "targets-00000-of-00001.int32")
  size = os.path.getsize(tokens)
  with open(tokens, "r+b") as f:
    f.truncate(size - 4)
  with pytest.raises(DataError, match=f"is damaged: targets-00000-of-00001.int32 holds {size - 4} bytes, expected "
                                      f"{size}; run `private-t5 store` with the same settings to rebuild it"):
    _seqio_store().build_example_store(seqio_tasks.TASK, "train", {"inputs": 32, "targets": 8}, module="seqio_tasks",
                                       cache_dir=str(cache), progress=False)
  assert cli.main(["store", *task, lengths, f"--cache_dir={cache}", "-q"]) == 0
  rebuilt = json.loads(capsys.readouterr().out)
  assert (rebuilt["reused"], rebuilt["rebuilt"]) == (False, f"targets-00000-of-00001.int32 holds {size - 4} bytes, "
                                                            f"expected {size}")
  assert os.path.getsize(tokens) == size and _entries(cache) == [os.path.basename(summary["path"])]
  # Bad inputs: one line, exit status 2, nothing in the cache.
  for argv, message in (([lengths], "--corpus or --mixture_or_task_name, not both"),
                        ([lengths, "--runner=DirectRunner", "--max_examples=3"], "applies to --runner=local only"),
                        ([], "missing --task_feature_lengths"),
                        ([lengths, "--max_examples=0"], "--max_examples must be a positive integer (or None for all), "
                         "got 0"),
                        ([lengths, "--max_examples=-3"], "--max_examples must be a positive integer"),
                        (["--task_feature_lengths=512"], "feature_lengths must be a dict such as"),
                        (["--task_feature_lengths={'inputs': 1, 'targets': 8}"], "feature_lengths['inputs'] must be an "
                         "integer >= 2, got 1")):
    extra = ["--corpus=x.txt"] if "not both" in message else []
    assert cli.main(["store", *task, *argv, *extra, f"--cache_dir={tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
  assert cli.main(["store", "--mixture_or_task_name=no_such_task", lengths, f"--cache_dir={tmp_path / 'bad'}"]) == 2
  assert "no seqio Task or Mixture named 'no_such_task'" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "bad")

  # The run's Gin flags name the same entry; a DP run reads it (and writes the validation split's).
  run = _pretrain(tmp_path / "dp", seqio_tasks.TASK, 1, f"--gin.DATA_CACHE_DIR={cache}",
                  "--gin.SEQIO_STORAGE='store'")
  gin_flags = [a for a in run if a.startswith(("--gin_file", "--gin.MIXTURE", "--gin.TASK_FEATURE", "--gin.DATA"))]
  assert cli.main(["store", *gin_flags, "-q"]) == 0
  assert json.loads(capsys.readouterr().out)["reused"]
  result = train_stage.run_from_args(run)
  assert result["final_step"] == 1 and result["private"]
  report = json.loads((tmp_path / "dp" / "privacy_report.json").read_text())
  assert (report["num_examples"], report["privacy_unit"]) == (train_source.num_examples, "example")
  assert len(_entries(cache)) == 2 and summary["path"] in {str(cache / e) for e in _entries(cache)}
