"""Release-safe run folders: the root seed lives in MODEL_DIR/secrets/run_seeds.json (0700/0600)
only; checkpoints name the file, a resume reads it, a missing file is one error line; checkpoints
that hold the seed in their metadata (written before the file existed) still resume; the export
holds no secret."""
import json
import logging
import os
import shutil
import stat

import numpy as np
import pytest

from private_t5.errors import CheckpointError
from private_t5.models import checkpoints, run_dir
from private_t5.models import checkpoint_read
from private_t5.stages import cli
from private_t5.stages import export as export_stage
from private_t5.stages import train as train_stage
from private_t5.train import main
from private_t5.train.state import RunSeeds

from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab

QUICKSTART = "configs/experiments/quickstart.gin"


@pytest.fixture(scope="module")
def corpus_and_vocab(shared_data, tmp_path_factory):
  return fortunes_corpus_and_vocab(shared_data, str(tmp_path_factory.mktemp("vocab")))


def _args(model_dir, corpus, vocab, steps):
  # The seed from OS entropy (a 64-bit number): config.gin then names no seed.
  return ["--gin_file=" + QUICKSTART, f"--gin.MODEL_DIR={model_dir}", f"--gin.CORPUS={corpus}",
          f"--gin.VOCAB_PATH={vocab}", f"--gin.TRAIN_STEPS={steps}",
          f"--gin.DATA_CACHE_DIR={os.path.dirname(vocab)}/cache", *MICRO_TRAIN_ARGS,
          "--gin.train.insecure_deterministic_seed=None", "--gin.train.checkpoint_every=1",
          "--gin.train.keep_checkpoints=3", "--gin.train.eval_examples=0", "--gin.train.log_every=10"]


def _mode(path) -> int:
  return stat.S_IMODE(os.lstat(path).st_mode)


def _files(root: str):
  return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)


def _holding(root: str, seed: int):
  """The files under `root` whose bytes hold `seed` in decimal or as 16 hex digits."""
  needles = (str(seed).encode(), f"{seed:016x}".encode())
  out = []
  for path in _files(root):
    with open(path, "rb") as f:
      data = f.read()
    if any(n in data for n in needles):
      out.append(os.path.relpath(path, root))
  return out


def _metadata_path(model_dir: str, step: int) -> str:
  return os.path.join(model_dir, "checkpoints", str(step), "metadata", "metadata")


def _params(model_dir: str, step: int):
  return checkpoint_read.restore_for_inference(model_dir, step)[0]


@pytest.fixture(scope="module")
def secret_run(corpus_and_vocab, tmp_path_factory):
  """A 3-step DP run with a secret seed, checkpoints at 1, 2, 3 (umask 022)."""
  corpus, vocab = corpus_and_vocab
  model_dir = str(tmp_path_factory.mktemp("secret") / "run")
  old = os.umask(0o022)
  try:
    train_stage.run_from_args(_args(model_dir, corpus, vocab, 3))
  finally:
    os.umask(old)
  return model_dir


def test_the_root_seed_is_in_the_secrets_file_only(secret_run):
  path = run_dir.run_seeds_path(secret_run)
  assert _mode(run_dir.secrets_dir(secret_run)) == 0o700 and _mode(path) == 0o600
  assert os.listdir(run_dir.secrets_dir(secret_run)) == ["run_seeds.json"]
  saved = json.load(open(path))
  seed = int(saved["root_seed"])
  assert saved["deterministic"] is False and seed >= 1 << 40 and "PRIVATE" in saved["note"]
  assert _holding(secret_run, seed) == [os.path.join("secrets", "run_seeds.json")]
  for step in (1, 2, 3):
    assert json.load(open(_metadata_path(secret_run, step)))["seeds"] == {
        "deterministic": False, "secrets": "secrets/run_seeds.json"}
  manager = checkpoints.CheckpointManager(secret_run)
  assert checkpoints.saved_seeds(manager) == {"root_seed": str(seed), "deterministic": False}
  manager.close()


def test_export_writes_no_secret_and_warns_of_a_dp_vocabularys_private_files(secret_run, corpus_and_vocab,
                                                                             tmp_path, caplog):
  seed = int(json.load(open(run_dir.run_seeds_path(secret_run)))["root_seed"])
  out = str(tmp_path / "export")
  assert cli.main(["export", f"--model_dir={secret_run}", f"--output={out}"]) == 0
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "privacy_report.json", "spiece.model"]
  assert _holding(out, seed) == [] and "privacy" not in caplog.text
  # A DP-SentencePiece vocabulary's fingerprints and key beside it: named in a warning, never copied.
  vocab_dir = tmp_path / "dp_vocab"
  vocab_dir.mkdir()
  vocab = str(vocab_dir / "dp.model")
  shutil.copyfile(corpus_and_vocab[1], vocab)
  for suffix in (".doc_fingerprints.npy", ".fingerprint_key"):
    (vocab_dir / ("dp.model" + suffix)).write_bytes(b"private")
  with caplog.at_level(logging.WARNING, logger=export_stage.logger.name):
    export_stage.export_model_dir(secret_run, str(tmp_path / "export2"), vocab_path=vocab)
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "dp.model.doc_fingerprints.npy, dp.model.fingerprint_key" in warnings[0]
  assert "never publish that folder" in warnings[0]
  assert sorted(os.listdir(tmp_path / "export2")) == sorted(os.listdir(out))


def test_a_missing_secrets_file_is_one_error_line(secret_run, corpus_and_vocab, tmp_path, capsys):
  corpus, vocab = corpus_and_vocab
  copy = str(tmp_path / "copy")
  shutil.copytree(secret_run, copy, ignore=shutil.ignore_patterns(run_dir.SECRETS_SUBDIR, ".lock"))
  assert cli.main(["train", *_args(copy, corpus, vocab, 4)]) == 2
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in err, err
  assert "run_seeds.json (it is missing)" in errors[0] and "cannot be continued without it" in errors[0]
  assert "restore the file, or train into a fresh MODEL_DIR" in errors[0]
  assert not os.path.exists(run_dir.secrets_dir(copy))  # no new seed was drawn
  open(os.path.join(copy, "secrets"), "w").close()  # unreadable: a file where the folder belongs
  assert cli.main(["train", *_args(copy, corpus, vocab, 4)]) == 2
  assert "cannot be continued without it" in capsys.readouterr().err


def test_checkpoints_with_the_seed_in_their_metadata_resume_and_the_next_omits_it(secret_run, corpus_and_vocab,
                                                                                 tmp_path, capsys):
  """Checkpoints 1 and 2 as written before the secrets file (the seed in the metadata, no file):
  the run resumes from 2 to the very parameters of the run that wrote 3, writes the secrets file,
  and checkpoint 3's metadata has no seed."""
  corpus, vocab = corpus_and_vocab
  seeds = json.load(open(run_dir.run_seeds_path(secret_run)))
  legacy = str(tmp_path / "legacy")
  shutil.copytree(secret_run, legacy, ignore=shutil.ignore_patterns(run_dir.SECRETS_SUBDIR, ".lock"))
  shutil.rmtree(os.path.join(legacy, "checkpoints", "3"))
  for step in (1, 2):
    metadata = json.load(open(_metadata_path(legacy, step)))
    metadata["seeds"] = {"root_seed": seeds["root_seed"], "deterministic": False}
    json.dump(metadata, open(_metadata_path(legacy, step), "w"))
  summary = train_stage.run_from_args(_args(legacy, corpus, vocab, 3))
  assert summary["resumed_from_step"] == 2 and summary["final_step"] == 3
  out = capsys.readouterr().out
  assert "checkpoint 2 holds the root seed in its metadata" in out and "  secrets:        " in out
  assert json.load(open(run_dir.run_seeds_path(legacy)))["root_seed"] == seeds["root_seed"]
  assert _mode(run_dir.run_seeds_path(legacy)) == 0o600
  assert json.load(open(_metadata_path(legacy, 3)))["seeds"] == {"deterministic": False,
                                                                 "secrets": "secrets/run_seeds.json"}
  for want, got in zip(*(sorted(_flat(_params(d, 3))) for d in (secret_run, legacy))):
    assert want[0] == got[0]
    np.testing.assert_array_equal(want[1], got[1])


def _flat(tree, prefix=""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flat(v, f"{prefix}/{k}")
  else:
    yield prefix, np.asarray(tree)


# -- without training -----------------------------------------------------------------------------

def _state(value: float):
  return {"step": np.int32(value), "params": {"w": np.full((2, 2), value, np.float32)}}


def test_one_root_seed_per_run_directory(tmp_path):
  model_dir = str(tmp_path / "run")
  seeds = RunSeeds.create()
  manager = checkpoints.CheckpointManager(model_dir, async_save=False)
  assert main.build_seeds(manager) != seeds  # no checkpoint, no file: a fresh seed
  entry = manager.keep_run_seeds(seeds.to_dict())
  assert entry == {"deterministic": False, "secrets": "secrets/run_seeds.json"}
  assert manager.keep_run_seeds(seeds.to_dict()) == entry  # the same seed again: nothing changes
  with pytest.raises(CheckpointError, match="holds another root seed than this run's: a run directory has one"):
    manager.keep_run_seeds(RunSeeds.create().to_dict())
  # A start that saved no checkpoint: its secrets file is the run directory's seed.
  assert main.build_seeds(manager) == seeds
  with pytest.raises(CheckpointError, match="earlier start of this run .* asks for a fixed seed"):
    main.build_seeds(manager, insecure_deterministic_seed=3)
  manager.save(1, _state(1), {"seeds": entry})
  manager.close()
  reopened = checkpoints.CheckpointManager(model_dir)
  assert main.build_seeds(reopened, insecure_deterministic_seed=3) == seeds  # resumed: the checkpoint's
  reopened.close()
  # Another run's secrets file beside these checkpoints: refused.
  checkpoints.write_run_seeds(str(tmp_path / "other"), RunSeeds.create(5).to_dict())
  shutil.copyfile(os.path.join(tmp_path, "other", "secrets", "run_seeds.json"), run_dir.run_seeds_path(model_dir))
  reopened = checkpoints.CheckpointManager(model_dir)
  with pytest.raises(CheckpointError, match=r"written with a secret root seed but .* holds a fixed "
                                            r"\(insecure_deterministic_seed\) one: it is another run's"):
    checkpoints.saved_seeds(reopened)
  reopened.close()


def test_a_failed_start_takes_its_secrets_file_away(tmp_path):
  model_dir = tmp_path / "run"
  manager = checkpoints.CheckpointManager(str(model_dir))
  manager.keep_run_seeds(RunSeeds.create().to_dict())
  assert os.path.isfile(run_dir.run_seeds_path(str(model_dir)))
  manager.close(discard_if_unused=True)
  assert not model_dir.exists()
