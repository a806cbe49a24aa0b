"""Canary generation, insertion into a real corpus, the record, the CLI and exposure math."""
import gzip
import json
import math
import os

import numpy as np
import pytest

from private_t5.errors import ConfigError, DataError
from private_t5.eval import canaries as canaries_lib
from private_t5.eval import exposure


def test_format_enumerates_the_secret_space():
  fmt = canaries_lib.CanaryFormat(template="My ID is {secret}", length=3).validate()
  assert fmt.space_size == 1000
  assert fmt.secret_at(0) == "000" and fmt.secret_at(7) == "007" and fmt.secret_at(999) == "999"
  assert len(set(fmt.secrets_at(range(1000)))) == 1000
  assert fmt.render("042") == "My ID is 042" and fmt.prefix == "My ID is "
  hexfmt = canaries_lib.CanaryFormat(template="key={secret}", alphabet="0123456789abcdef", length=2)
  assert hexfmt.space_size == 256 and hexfmt.secret_at(255) == "ff"


@pytest.mark.parametrize("kwargs, match", [
    (dict(template="no placeholder"), "exactly once"),
    (dict(template="{secret} first"), "prefix"),
    (dict(alphabet="aa"), "distinct"),
    (dict(length=0), "length"),
])
def test_bad_formats_are_rejected(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    canaries_lib.CanaryFormat(**kwargs).validate()


def test_make_canaries_distinct_with_repetitions_and_references():
  fmt = canaries_lib.CanaryFormat(length=4)
  cans, seed = canaries_lib.make_canaries(fmt, (1, 10, 100), per_repetition=2, num_reference=3, seed=5)
  assert seed == 5
  assert sorted(c.repetitions for c in cans) == [0, 0, 0, 1, 1, 10, 10, 100, 100]
  assert len({c.secret for c in cans}) == 9
  assert all(c.text == fmt.render(c.secret) for c in cans)
  again, _ = canaries_lib.make_canaries(fmt, (1, 10, 100), per_repetition=2, num_reference=3, seed=5)
  assert again == cans
  _, fresh_seed = canaries_lib.make_canaries(fmt, (1,))
  assert isinstance(fresh_seed, int)
  with pytest.raises(ConfigError, match="do not fit"):
    canaries_lib.make_canaries(canaries_lib.CanaryFormat(length=1), (1,) * 11, num_reference=0)


def test_insert_and_record_on_a_real_corpus(tmp_path, shared_data):
  from private_t5.data import corpora
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  docs = list(corpora.iter_documents(src, max_documents=500))
  fmt = canaries_lib.CanaryFormat()
  cans, seed = canaries_lib.make_canaries(fmt, (1, 10, 100), seed=11)
  out = str(tmp_path / "with_canaries.jsonl.gz")
  corpus, record, n = canaries_lib.write_canary_corpus(docs, out, fmt, cans, seed, source=src)
  assert n == 500 + 111 and record == str(tmp_path / "with_canaries.canaries.json")
  with gzip.open(corpus, "rt") as f:
    rows = [json.loads(line) for line in f]
  texts = [r["text"] for r in rows]
  for c in cans:
    assert texts.count(c.text) == c.repetitions
  # Original documents keep their order; canary copies are spread over the corpus.
  originals = [r["id"] for r in rows if not r["id"].startswith("canary-")]
  assert originals == [d.id for d in docs]
  positions = [k for k, r in enumerate(rows) if r["id"].startswith("canary-0/") or r["id"].startswith("canary-2/")]
  assert max(positions) - min(positions) > len(rows) // 2
  fmt2, cans2 = canaries_lib.load_canaries(record)
  assert fmt2 == fmt and cans2 == cans
  rec = json.loads(open(record).read())
  assert rec["seed"] == 11 and rec["space_size"] == 10 ** 6 and rec["documents"] == n


def test_tampered_or_missing_record_is_a_data_error(tmp_path):
  fmt = canaries_lib.CanaryFormat(length=3)
  cans, seed = canaries_lib.make_canaries(fmt, (2,), seed=1)
  _, record, _ = canaries_lib.write_canary_corpus([], str(tmp_path / "c.jsonl"), fmt, cans, seed)
  rec = json.loads(open(record).read())
  rec["canaries"][0]["text"] = "My ID is xyz"
  open(record, "w").write(json.dumps(rec))
  with pytest.raises(DataError, match="does not match the format"):
    canaries_lib.load_canaries(record)
  with pytest.raises(DataError, match="not found"):
    canaries_lib.load_canaries(str(tmp_path / "missing.canaries.json"))


def test_canaries_cli(tmp_path, shared_data, capsys):
  from private_t5.stages import cli
  src = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  small = tmp_path / "small.jsonl"
  with gzip.open(src, "rt") as f:
    small.write_text("".join(next(f) for _ in range(200)))
  out = tmp_path / "train_canaries.jsonl"
  rc = cli.main(["canaries", f"--input={small}", f"--output={out}", "--template=The code is {secret}",
                 "--secret_length=5", "--repetitions=1,10", "--num_reference=2", "--seed=3"])
  assert rc == 0
  assert "211 documents" in capsys.readouterr().out
  fmt, cans = canaries_lib.load_canaries(str(tmp_path / "train_canaries.canaries.json"))
  assert fmt.template == "The code is {secret}" and fmt.length == 5
  assert sorted(c.repetitions for c in cans) == [0, 0, 1, 10]
  assert len(out.read_text().splitlines()) == 211
  assert cli.main(["canaries", f"--input={small}", f"--output={tmp_path / 'x.txt'}"]) == 2
  assert cli.main(["canaries", f"--input={small}", f"--output={out}", "--repetitions=a"]) == 2


def test_exposure_from_exact_rank():
  assert exposure.exposure_from_rank(1, 1000) == pytest.approx(math.log2(1000))
  assert exposure.exposure_from_rank(1000, 1000) == 0.0
  lp = np.array([5.0, 1.0, 3.0, 3.0, 9.0])
  assert exposure.exact_rank(1.0, lp) == 1
  assert exposure.exact_rank(3.0, lp) == 2  # ties count in the canary's favour
  assert exposure.exact_rank(9.0, lp) == 5


def test_skewnorm_extrapolation_recovers_known_tail_probabilities():
  from scipy import stats
  rng = np.random.default_rng(0)
  a, loc, scale = 4.0, 10.0, 3.0
  sample = stats.skewnorm.rvs(a, loc, scale, size=20_000, random_state=rng)
  space = 10 ** 9
  # Deeper in the tail the fitted parameters' error is amplified: looser tolerance there.
  for p, tol_bits in ((1e-3, 0.6), (1e-6, 1.5)):
    x = stats.skewnorm.ppf(p, a, loc, scale)
    exp_bits, rank, fit = exposure.skewnorm_exposure(x, sample, space)
    assert exp_bits == pytest.approx(-math.log2(p), abs=tol_bits)
    assert rank == pytest.approx(space * p, rel=2 ** tol_bits - 1)
    assert fit["sample_size"] == 20_000
  # Far beyond the space: capped at log2 |R|.
  assert exposure.skewnorm_exposure(-1e3, sample, 1000)[0] == pytest.approx(math.log2(1000))
  # A typical candidate has exposure about 1 bit.
  assert exposure.skewnorm_exposure(float(np.median(sample)), sample, space)[0] == pytest.approx(1.0, abs=0.1)


def test_canaries_cli_refuses_empty_input_and_input_as_output(tmp_path, capsys):
  from private_t5.stages import cli
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  assert cli.main(["canaries", f"--corpus={empty}", f"--output={tmp_path / 'out.jsonl.gz'}", "--seed=1"]) == 2
  err = capsys.readouterr().err
  assert "empty" in err and len(err.strip().splitlines()) == 1
  assert os.listdir(tmp_path) == ["empty.jsonl"]  # no corpus, no record, no .tmp

  corpus = tmp_path / "corpus.jsonl"
  text = "".join(json.dumps({"id": str(i), "text": f"document {i}"}) + "\n" for i in range(5))
  corpus.write_text(text)
  for output in (str(corpus), os.path.join(str(tmp_path), ".", "corpus.jsonl")):
    assert cli.main(["canaries", f"--corpus={corpus}", f"--output={output}", "--seed=1"]) == 2
    err = capsys.readouterr().err
    assert "is the input corpus" in err and len(err.strip().splitlines()) == 1
  assert corpus.read_text() == text
  assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl", "empty.jsonl"]


def test_gzip_canary_corpus_round_trips(tmp_path):
  from private_t5.data import corpora
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"id": str(i), "text": f"document {i}"}) + "\n" for i in range(5)))
  fmt = canaries_lib.CanaryFormat(template="id {secret}", length=3).validate()
  cans, seed = canaries_lib.make_canaries(fmt, [2], 1, 0, 5)
  out = str(tmp_path / "with.jsonl.gz")
  _, record, n = canaries_lib.write_canary_corpus(corpora.iter_documents(str(corpus)), out, fmt, cans, seed)
  assert n == 7 and len(list(corpora.iter_documents(out))) == 7
  assert json.load(open(record))["documents"] == 7


def test_canaries_never_write_a_duplicate_id(tmp_path, capsys):
  """A corpus repeating an id, or holding a canary's id (canaries inserted twice), is refused before
  anything is written: the store would refuse the corpus the stage wrote."""
  from private_t5.stages import cli
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"id": str(i % 4), "text": f"document {i}"}) + "\n" for i in range(6)))
  out = tmp_path / "out.jsonl"
  assert cli.main(["canaries", f"--corpus={corpus}", f"--output={out}", "--seed=1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: the corpus uses the document id '0' twice (ids define the privacy unit; the store refuses "
                 "such a corpus): give its documents distinct ids"]
  corpus.write_text("".join(json.dumps({"id": str(i), "text": f"document {i}"}) + "\n" for i in range(6)))
  assert cli.main(["canaries", f"--corpus={corpus}", f"--output={out}", "--seed=1", "--repetitions=2"]) == 0
  capsys.readouterr()
  ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
  assert len(ids) == len(set(ids)) == 8
  again = tmp_path / "again.jsonl"
  assert cli.main(["canaries", f"--corpus={out}", f"--output={again}", "--seed=2", "--repetitions=2"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: the corpus already has a document with the canary id 'canary-0/")
  assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl", "out.canaries.json", "out.jsonl"]
