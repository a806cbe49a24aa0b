"""The corpus stages on a real cluster engine: Beam's DaskRunner on a dask.distributed cluster.

One `distributed.LocalCluster` of 2 worker processes (one thread each) for the module. `private-t5
splits` and `private-t5 store` run with `--runner=DaskRunner --beam_options=--dask_client_address=...`
against it and give what `--runner=local` and the DirectRunner give: the same split file, the same
store entry file for file, the same summary apart from timings, paths and runner names. The
cluster did the work: both worker processes executed tasks of each stage. A failure in a worker is
one error line naming the stage. A seqio Task into its store on Dask (each worker then imports
TensorFlow and seqio) runs with PRIVATE_T5_TEST_DASK_SEQIO=1.
"""
import gzip
import json
import logging
import os

import pytest

from conftest import shared_or_fixture
from test_data_vocab import FORTUNES, small_vocab_path

from private_t5.stages import cli

distributed = pytest.importorskip("distributed", reason="needs dask and distributed (pip install 'private_t5[dask]')")

DIRECT = "--direct_num_workers=2 --direct_running_mode=multi_threading"
SPLIT_FLAGS = ["--num_perm=1280", "--num_bands=128"]


@pytest.fixture(scope="module")
def cluster():
  """(the scheduler's address, a client of the test): 2 worker processes, one thread each."""
  with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0",
                                silence_logs=logging.ERROR) as local:
    with distributed.Client(local) as client:
      yield local.scheduler_address, client


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory, shared_data):
  return small_vocab_path(tmp_path_factory, shared_data)


def _executed(client):
  """Tasks each worker process has run so far, by worker address."""
  return client.run(lambda dask_worker: dask_worker.state.executed_count)


def _run_on_both_workers(client, stage):
  """Runs `stage()`; asserts that both worker processes executed tasks for it; returns its result."""
  before = _executed(client)
  result = stage()
  after = _executed(client)
  assert len(after) == 2 and all(after[w] > before.get(w, 0) for w in after), (before, after)
  return result


def _dask(address):
  return ["--runner=DaskRunner", f"--beam_options=--dask_client_address={address}"]


def _stage(capsys, *argv):
  assert cli.main(list(argv)) == 0, capsys.readouterr().err
  return json.loads(capsys.readouterr().out)


def _corpus_parts(folder, num_parts=3, limit=600):
  """The first `limit` fortunes in `num_parts` JSON lines files (gzipped and not)."""
  with gzip.open(shared_or_fixture(FORTUNES), "rt", encoding="utf-8") as f:
    records = [json.loads(line) for _, line in zip(range(limit), f)]
  os.makedirs(folder, exist_ok=True)
  size = -(-len(records) // num_parts)
  for k in range(num_parts):
    name = os.path.join(folder, f"part-{k}.jsonl" + (".gz" if k % 2 == 0 else ""))
    with (gzip.open if name.endswith(".gz") else open)(name, "wt", encoding="utf-8") as f:
      for r in records[k * size:(k + 1) * size]:
        f.write(json.dumps(r) + "\n")
  return os.path.join(folder, "part-*")


def _files(path):
  out = {}
  for name in sorted(os.listdir(path)):
    if name != "manifest.json":
      with open(os.path.join(path, name), "rb") as f:
        out[name] = f.read()
  return out


def _manifest(path):
  with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
    m = json.load(f)
  for name in ("build_seconds", "created", "runner"):
    m.pop(name, None)
  return m


_TIMINGS = ("path", "runner", "seconds", "build_seconds", "mb_per_s", "documents_per_s", "examples_per_s",
            "tokens_per_s", "counters")


def test_store_on_dask_equals_local_and_direct(tmp_path, cluster, vocab_path, capsys):
  address, client = cluster
  pattern = _corpus_parts(str(tmp_path / "corpus"))
  common = ["store", f"--corpus={pattern}", f"--vocab_path={vocab_path}"]
  local = _stage(capsys, *common, f"--cache_dir={tmp_path}/local")
  direct = _stage(capsys, *common, f"--cache_dir={tmp_path}/direct", "--runner=DirectRunner",
                  f"--beam_options={DIRECT}")
  dask = _run_on_both_workers(client, lambda: _stage(capsys, *common, f"--cache_dir={tmp_path}/dask", *_dask(address)))
  assert dask["runner"] == "DaskRunner" and not dask["reused"]
  assert dask["counters"] == direct["counters"] and dask["counters"]["shards_written"] == 3
  same = lambda summary, skip=(): {k: v for k, v in summary.items() if k not in _TIMINGS + skip}  # pylint: disable=unnecessary-lambda-assignment
  assert same(dask) == same(direct) and same(dask, ("shards",)) == same(local, ("shards",))
  # One cache entry name, the same documents and tokens, file for file (the local build is one shard).
  assert os.path.basename(dask["path"]) == os.path.basename(local["path"]) == os.path.basename(direct["path"])
  assert _files(dask["path"]) == _files(direct["path"]) and _manifest(dask["path"]) == _manifest(direct["path"])
  assert local["documents"] == dask["documents"] and local["tokens"] == dask["tokens"]


def _without_seconds(path):
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  data["stats"].pop("seconds")
  return data


def test_splits_on_dask_equal_local(tmp_path, cluster, shared_data, capsys):
  from test_beam_pipelines import _split_corpora  # pylint: disable=g-import-not-at-top
  address, client = cluster
  train, valid = _split_corpora(tmp_path, shared_data)
  common = ["splits", f"--train_corpus={train}", f"--valid_corpus={valid}", *SPLIT_FLAGS]
  local = _stage(capsys, *common, f"--output={tmp_path}/local/")
  dask = _run_on_both_workers(client, lambda: _stage(capsys, *common, f"--output={tmp_path}/dask/", *_dask(address)))
  assert dask["runner"] == "DaskRunner" and dask["key"] == local["key"] and dask["sizes"] == local["sizes"]
  dask["stats"].pop("seconds"), local["stats"].pop("seconds")
  assert dask["stats"] == local["stats"] and dask["sizes"]["train_dup"] > 0
  assert _without_seconds(dask["output"]) == _without_seconds(local["output"])


def test_a_failure_in_a_worker_is_one_line_naming_the_stage(tmp_path, cluster, vocab_path, capsys):
  address, _ = cluster
  folder = tmp_path / "bad"
  folder.mkdir()
  (folder / "part-0.jsonl").write_text('{"text": "fine words"}\n')
  (folder / "part-1.jsonl").write_text('{"text": "fine words"}\n{not json\n')
  rc = cli.main(["store", f"--corpus={folder}/part-*", f"--vocab_path={vocab_path}", f"--cache_dir={tmp_path}/c",
                 *_dask(address)])
  err = capsys.readouterr().err
  errors = [l for l in err.splitlines() if l.startswith("error:")]
  assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
  assert errors[0].startswith("error: store on DaskRunner: ") and "part-1.jsonl: line 2" in errors[0], errors
  cache = tmp_path / "c"
  assert not cache.exists() or not [n for n in os.listdir(cache) if not n.startswith(".")]  # no entry left


def test_dp_spm_histogram_on_dask_equals_local(tmp_path, cluster):
  from private_t5.data import corpora  # pylint: disable=g-import-not-at-top
  from private_t5.tokenizer import dp_spm_beam  # pylint: disable=g-import-not-at-top
  from private_t5.tokenizer import dp_spm_histogram  # pylint: disable=g-import-not-at-top
  address, client = cluster
  pattern = _corpus_parts(str(tmp_path / "corpus"), num_parts=2, limit=300)
  bound = dp_spm_histogram.ContributionBound("capped", 32)
  texts = [d.text for spec in sorted(corpora.match_pattern(pattern)) for d in corpora.iter_documents(spec)]
  local, s1 = dp_spm_histogram.build_histogram(texts, bound, num_workers=1)
  hist, s2 = _run_on_both_workers(client, lambda: dp_spm_beam.beam_histogram(
      pattern, bound, runner="DaskRunner", beam_options=f"--dask_client_address={address}"))
  assert dict(hist) == dict(local)
  assert (s1.documents, s1.bytes, s1.words_raw, s1.words_counted) == (
      s2.documents, s2.bytes, s2.words_raw, s2.words_counted)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PRIVATE_T5_TEST_DASK_SEQIO"),
                    reason="set PRIVATE_T5_TEST_DASK_SEQIO=1: each Dask worker imports TensorFlow and seqio "
                           "(30-75 s on 2 cores, beyond this module's share of the suite's time)")
def test_a_seqio_task_into_its_store_on_dask_equals_local(tmp_path, cluster, vocab_path, capsys):
  pytest.importorskip("seqio", reason="needs seqio and t5 (private_t5[seqio])")
  pytest.importorskip("t5", reason="needs seqio and t5 (private_t5[seqio])")
  import seqio_tasks  # pylint: disable=g-import-not-at-top  # tests/seqio_tasks.py
  address, client = cluster
  with gzip.open(shared_or_fixture(FORTUNES), "rt", encoding="utf-8") as f:
    texts = [json.loads(line)["text"].replace("\n", " ") for _, line in zip(range(60), f)]
  paths = [str(tmp_path / "part-0.txt"), str(tmp_path / "part-1.txt")]
  for path, part in zip(paths, (texts[:35], texts[35:])):
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(part) + "\n")
  # A user's Task module registers its Tasks in every process that imports it; these are registered
  # from files made here, so here and in each worker process.
  seqio_tasks.register_text_file(paths, vocab_path, name=seqio_tasks.TWO_FILES_TASK)
  client.run(seqio_tasks.register_text_file, paths, vocab_path, name=seqio_tasks.TWO_FILES_TASK)
  common = ["store", f"--mixture_or_task_name={seqio_tasks.TWO_FILES_TASK}", "--mixture_or_task_module=seqio_tasks",
            "--task_feature_lengths={'inputs': 32, 'targets': 8}"]
  local = _stage(capsys, *common, f"--cache_dir={tmp_path}/local")
  dask = _run_on_both_workers(client, lambda: _stage(capsys, *common, f"--cache_dir={tmp_path}/dask", *_dask(address)))
  assert dask["runner"] == "DaskRunner" and dask["counters"]["shards_written"] == 2
  assert dask["counters"]["examples_written"] == local["examples"]
  assert {k: v for k, v in dask.items() if k not in _TIMINGS} == {k: v for k, v in local.items() if k not in _TIMINGS}
  assert _files(dask["path"]) == _files(local["path"]) and _manifest(dask["path"]) == _manifest(local["path"])
