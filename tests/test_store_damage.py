"""A damaged store is one line in every stage: the project's errors with arguments of their own
come through Gin's wrapping whole (class, message, attributes); an offsets file overwritten at the
same size is found when the entry is reused (the SHA-256 of everything but the token files is
compared on open); a file truncated while a run reads it is a DamagedStoreError before the next
read, and a bus error in one line (exit status 2) when it was cut between the check and the read."""
import ast
import glob
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import gin
import numpy as np
import pytest

from private_t5 import errors
from private_t5.data import store as store_lib
from private_t5.data import store_reader
from private_t5.data.store_files import DamagedStoreError
from private_t5.stages import cli, gin_utils
from private_t5.stages import gin_errors
from micro_run import MICRO_TRAIN_ARGS
from test_data_vocab import vocab_path  # pylint: disable=unused-import
from test_store_beam import _fortunes, _write_parts

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The arguments of each error class whose __init__ takes more than a message.
ERROR_ARGUMENTS = {
    "DamagedStoreError": ("/cache/0123456789abcdef01234567", "tokens-00000-of-00001.int32 holds 4 bytes, expected 8"),
    "UnreachableTargetError": ("target_epsilon=0.01 is unreachable", {"rdp": 2.5, "pld": 2.25}),
}


def _error_classes():
  """Every subclass of PrivateT5Error the package defines (found in its source, then imported)."""
  names, defined = {"PrivateT5Error"}, {}
  for path in glob.glob(os.path.join(PROJECT_ROOT, "private_t5", "**", "*.py"), recursive=True):
    module = os.path.relpath(path, PROJECT_ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
    with open(path, encoding="utf-8") as f:
      for node in ast.walk(ast.parse(f.read())):
        if isinstance(node, ast.ClassDef):
          bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
          defined[(module, node.name)] = bases
  while True:  # the classes deriving from one already found, to a fixed point
    more = {name for (_, name), bases in defined.items() if bases & names} - names
    if not more:
      break
    names |= more
  found = [getattr(importlib.import_module(m), name, None) for (m, name) in defined if name in names]
  return sorted({c for c in found if isinstance(c, type) and issubclass(c, errors.PrivateT5Error)},
                key=lambda c: c.__name__)


def _takes_arguments(cls) -> bool:
  return any("__init__" in c.__dict__ for c in cls.__mro__[:cls.__mro__.index(errors.PrivateT5Error)])


@gin.configurable("store_damage_test_raise")
def _raise(error):
  raise error


@gin.configurable("store_damage_test_outer")
def _outer(error):
  _raise(error)  # two configurables: two Gin proxies around the error


def test_every_error_class_comes_through_gin_with_its_message_and_attributes():
  classes = _error_classes()
  with_arguments = {c.__name__ for c in classes if _takes_arguments(c)}
  assert with_arguments == set(ERROR_ARGUMENTS), "give ERROR_ARGUMENTS the arguments of each such class"
  assert {"DataError", "ConfigError", "MissingLibrary", "BadLine"} <= {c.__name__ for c in classes}
  for cls in classes:
    error = cls(*ERROR_ARGUMENTS.get(cls.__name__, (f"a {cls.__name__} for the test",)))
    for fn in (_raise, _outer):
      with pytest.raises(cls) as info:
        gin_utils.call_configured(fn, error)
      clean = info.value
      assert type(clean) is cls, cls
      assert str(clean) == str(error) == gin_errors.error_message(clean), cls
      assert vars(clean) == vars(error), cls
  damaged = DamagedStoreError(*ERROR_ARGUMENTS["DamagedStoreError"])
  with pytest.raises(DamagedStoreError) as info:
    gin_utils.call_configured(_outer, damaged)
  assert (info.value.path, info.value.reason) == ERROR_ARGUMENTS["DamagedStoreError"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_data):
  return _write_parts(str(tmp_path_factory.mktemp("damage") / "corpus"), _fortunes(shared_data, 40), 1)


def _garble(path):
  """Overwrites `path` with as many bytes of garbage."""
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.write(np.full(size // 8, -7, np.int64).tobytes())


def test_an_offsets_file_overwritten_at_the_same_size_is_found_on_reuse(tmp_path, corpus, vocab_path, capsys,
                                                                         caplog):
  cache = str(tmp_path / "cache")
  store = store_lib.build_store(corpus, vocab_path, cache_dir=cache, progress=False)
  offsets = store.manifest["shards"][0]["offsets"]
  _garble(os.path.join(store.path, offsets))
  size = os.path.getsize(os.path.join(store.path, offsets))
  reason = f"{offsets} has the expected size ({size} bytes) but not the SHA-256 recorded when it was built"
  with pytest.raises(DamagedStoreError) as info:  # as training opens it
    store_lib.build_store(corpus, vocab_path, cache_dir=cache, progress=False)
  assert info.value.reason == reason
  with caplog.at_level(logging.WARNING, logger="private_t5.data.store"):
    assert cli.main(["store", f"--corpus={corpus}", f"--vocab_path={vocab_path}", f"--cache_dir={cache}"]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert not summary["reused"] and summary["rebuilt"] == reason
  assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
      f"[store] rebuilding the damaged entry {store.path}: {reason}"]
  rebuilt = store_reader.DocumentStore(summary["path"])
  assert [rebuilt.document_length(i) for i in range(3)] == [store.document_length(i) for i in range(3)]


def test_training_on_a_damaged_store_is_one_line(tmp_path, corpus, vocab_path, capsys):
  """`private-t5 train` (the store opened inside Gin's configurables): one error line, no traceback."""
  cache = str(tmp_path / "cache")
  store = store_lib.build_store(corpus, vocab_path, cache_dir=cache, max_documents=300, progress=False)
  offsets = store.manifest["shards"][0]["offsets"]
  _garble(os.path.join(store.path, offsets))
  size = os.path.getsize(os.path.join(store.path, offsets))
  args = ["--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={tmp_path / 'run'}",
          f"--gin.CORPUS='{corpus}'", f"--gin.VOCAB_PATH={vocab_path}", "--gin.TRAIN_STEPS=1",
          *MICRO_TRAIN_ARGS, f"--gin.DATA_CACHE_DIR={cache}"]
  assert cli.main(["train", *args]) == 2
  err = capsys.readouterr().err
  assert [l for l in err.splitlines() if l.startswith("error:")] == [
      f"error: store {store.path} is damaged: {offsets} has the expected size ({size} bytes) but not the SHA-256 "
      "recorded when it was built; run `private-t5 store` with the same settings to rebuild it (or delete that "
      "folder)"], err
  assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_file_truncated_while_it_is_read_is_a_damaged_store_error(tmp_path, corpus, vocab_path):
  store = store_lib.build_store(corpus, vocab_path, cache_dir=str(tmp_path / "cache"), progress=False)
  tokens, offsets = (store.manifest["shards"][0][k] for k in ("tokens", "offsets"))
  size = os.path.getsize(os.path.join(store.path, tokens))
  first = np.array(store.document_tokens(0))
  assert len(first) and len(store.offsets) == store.num_documents + 1
  os.truncate(os.path.join(store.path, tokens), 8)  # after it was mapped
  with pytest.raises(DamagedStoreError) as info:
    store.document_tokens(1)
  assert info.value.reason == f"{tokens} holds 8 bytes, expected {size} (it changed while this run read it)"
  os.truncate(os.path.join(store.path, offsets), 16)
  for read in (lambda: store.offsets, lambda: store.document_length(2)):
    with pytest.raises(DamagedStoreError, match=f"{offsets} holds 16 bytes, expected"):
      read()
  with pytest.raises(DamagedStoreError, match=f"{offsets} holds 16 bytes, fewer than the"):
    list(store.lengths_of(np.arange(store.num_documents)))


# Reads a shard's tokens from its mapping after the file was truncated, as a read does that the
# file's check let through just before the truncation: the bus error is one line, exit status 2.
_READ_AFTER_TRUNCATION = """
import os, sys
import numpy as np
from private_t5.data import store_files, store_reader
store_path, other = sys.argv[1:]
store = store_reader.DocumentStore(store_path)
view = store.document_tokens(store.num_documents - 1)  # checked and mapped
path = os.path.join(store_path, store.manifest["shards"][0]["tokens"])
if other:  # a file that is not a store's: its bus error is not the guard's to report
  np.arange(1 << 16, dtype=np.int32).tofile(other)
  view, path = np.memmap(other, dtype=np.int32, mode="r"), other
os.truncate(path, 0)
print(int(np.asarray(view).sum()))
"""


def _read_after_truncation(path, other=""):
  env = dict(os.environ, PYTHONPATH=PROJECT_ROOT)
  env.pop("PYTHONFAULTHANDLER", None)
  return subprocess.run([sys.executable, "-c", textwrap.dedent(_READ_AFTER_TRUNCATION), path, other], cwd=PROJECT_ROOT,
                        env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="no SIGBUS on this platform")
def test_a_bus_error_on_a_truncated_store_file_is_one_line(tmp_path, corpus, vocab_path):
  store = store_lib.build_store(corpus, vocab_path, cache_dir=str(tmp_path / "cache"), progress=False)
  tokens = store.manifest["shards"][0]["tokens"]
  size = os.path.getsize(os.path.join(store.path, tokens))
  # A bus error of another file is left to the handler that was there before (the default): no hang.
  other = _read_after_truncation(store.path, str(tmp_path / "other.int32"))
  assert other.returncode == -signal.SIGBUS and "error:" not in other.stderr, other
  proc = _read_after_truncation(store.path)
  assert proc.returncode == 2 and proc.stdout == "", proc
  assert proc.stderr == (f"error: store {store.path} is damaged: {tokens} shrank to 0 bytes (from {size}) while "
                         "this run read it; run `private-t5 store` with the same settings to rebuild it (or delete "
                         "that folder)\n")
