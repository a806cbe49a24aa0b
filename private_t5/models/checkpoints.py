"""Checkpoints of a training run with orbax: every N steps, keep the last K, atomic, resume from
the latest.

The one writer of MODEL_DIR/checkpoints/ (the layout is in `run_dir`): training saves and resumes
through `CheckpointManager`; evaluation, memorization, adaptive DP, fine-tuning and export read
parameters through `restore_for_inference` (`models.checkpoint_read`, re-exported here).

Atomicity: orbax writes a step into a temporary directory and renames it once every item is
complete, so a process killed at any moment (also during a save) leaves only complete steps
visible; `latest_step` ignores unfinished temporaries and the next run that holds the model
directory's lock removes them (never a process without the lock: it may be another run's save).
The step of a checkpoint is also the data position (batches are a pure function of the
sampler seed and the step), so a resumed run neither skips nor repeats a batch.

The run's secret root seed (noise and sampling keys derive from it) lives apart from the
checkpoints, in MODEL_DIR/secrets/run_seeds.json (`write_run_seeds`: folder 0o700, file 0o600,
written once by the lock holder before the first checkpoint, never replaced by another seed); a
checkpoint's metadata only says where it is (`seeds_entry`) and a resume reads it there
(`saved_seeds`). A missing secrets file is one CheckpointError, never a new seed: the noise
streams of the checkpoints cannot be continued without it. Checkpoints written before the
secrets file existed hold the seed in their metadata (`"seeds": {"root_seed": ...}`): they still
resume, and the first checkpoint saved after them writes the secrets file and omits the seed.

A checkpoint directory is still private: a correlated-noise run's state holds recent steps'
noise, older checkpoints' metadata hold the root seed; release parameters only
(`restore_for_inference`, `private-t5 export`). A new MODEL_DIR/checkpoints/ is therefore
created readable by its owner only (0o700), whatever the umask; the run's other files follow
the umask.
"""
import copy
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import numpy as np

from private_t5.errors import CheckpointError
from private_t5.io import atomic_open, json_default
from private_t5.models import network, run_dir, run_lock
from private_t5.models.checkpoint_orbax import METADATA_ITEM, STATE_ITEM, cause, ocp
# Reading parameters for inference has its own module; its names are also read from here.
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.models.checkpoint_read': ('restore_for_inference',),
})

PyTree = Any
FORMAT_VERSION = 1
RUN_SEEDS_FORMAT_VERSION = 1
# What the secrets file says about itself (it is plain JSON, and a folder gets copied whole).
RUN_SEEDS_NOTE = ("PRIVATE: the root seed of the run in this MODEL_DIR; with it anyone regenerates every step's "
                  "DP noise and subtracts it. Never publish this file or its folder; publish the output of "
                  "`private-t5 export`.")


def check_writable(model_dir: str) -> None:
  """Raises CheckpointError unless `model_dir` can be created and written."""
  try:
    os.makedirs(model_dir, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=model_dir, prefix=".write_probe_")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise CheckpointError(f"model_dir {model_dir!r} is not writable: {e.strerror or e}") from e


def _first_difference(a: Any, b: Any, prefix: str = "") -> Optional[str]:
  """Dotted path of the first value that differs between two JSON-like trees, or None."""
  if isinstance(a, dict) and isinstance(b, dict):
    for key in sorted(set(a) | set(b)):
      if key not in a or key not in b:
        return f"{prefix}{key}"
      diff = _first_difference(a[key], b[key], f"{prefix}{key}.")
      if diff:
        return diff
    return None
  return None if a == b else prefix.rstrip(".") or "(value)"


class CheckpointManager:
  """Saves and restores the train state of one run in `MODEL_DIR/checkpoints`.

  Args:
    model_dir: the run's directory.
    keep: number of most recent checkpoints kept (older ones are deleted).
    fingerprint: JSON-able description of what the checkpoints belong to (model config, data
      description, privacy mechanism); a directory holding checkpoints with another
      fingerprint is refused.
    async_save: write checkpoints in a background thread (the step loop continues).

  The manager holds the exclusive lock of `model_dir` (`run_lock`) from construction until
  `close`: a second run opening the same directory gets a CheckpointError naming the holder.
  In a multi-process run process 0 holds the lock for the run, and every process waits for its
  verdict before touching `model_dir` (`run_lock.acquire_on_process_0`): a refused run stops on
  all processes at once. Only the lock holder removes temporaries of interrupted saves.
  """

  def __init__(self, model_dir: str, *, keep: int = 3, fingerprint: Optional[Dict[str, Any]] = None,
               async_save: bool = True):
    if keep is not None and int(keep) < 1:
      raise CheckpointError(f"keep_checkpoints must be >= 1, got {keep}")
    self._created = _Created.before_opening(model_dir)  # removed by `close(discard_if_unused=True)`
    # One lock per run: in a multi-process run process 0 holds it for all of them.
    self._lock = run_lock.acquire_on_process_0(model_dir, before=lambda: check_writable(model_dir))
    try:
      if self._lock is None:  # another process holds the lock for this run
        check_writable(model_dir)
      self._open(model_dir, keep, fingerprint, async_save)
    except BaseException:
      if self._lock is not None:
        run_lock.release(self._lock)
      raise

  def _open(self, model_dir, keep, fingerprint, async_save) -> None:
    self.model_dir = model_dir
    self.directory = os.path.abspath(run_dir.checkpoints_dir(model_dir))
    self.fingerprint = fingerprint
    self._pending: Optional[Tuple[int, Optional[Callable[[], None]]]] = None
    _make_private_dir(self.directory)
    self._remove_unfinished()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        # Step directories are created before `save` returns, so a failed save leaves no
        # background work behind that could recreate its temporaries after the cleanup.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    self._options = options
    self._manager = self._open_orbax()
    if fingerprint is not None:
      self.check_compatible(fingerprint)

  def _open_orbax(self):
    try:
      return ocp.CheckpointManager(self.directory, options=self._options,
                                   item_names=(STATE_ITEM, METADATA_ITEM))
    except OSError as e:
      raise CheckpointError(f"cannot open checkpoints in {self.directory}: {e}") from e

  def _remove_unfinished(self) -> None:
    """Deletes temporaries of saves interrupted by a crash (never complete steps).

    Only the holder of the model directory's lock does: without it, a temporary may be the
    save in progress of another run.
    """
    if self._lock is None or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if ".orbax-checkpoint-tmp" in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  # -- queries ----------------------------------------------------------------------------------

  def all_steps(self):
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def _readable_step(self, step: Optional[int]) -> int:
    """`step` (default: the latest), once no file of it is empty; CheckpointError otherwise."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.directory}")
    _check_no_empty_file(os.path.join(self.directory, str(int(step))), step, self.directory)
    return step

  def read_metadata(self, step: Optional[int] = None) -> Dict[str, Any]:
    step = self._readable_step(step)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()}))
      return _metadata_dict(restored[METADATA_ITEM])
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable: {cause(e)}") from e

  def latest_metadata(self) -> Tuple[Optional[int], Optional[Dict[str, Any]]]:
    """(step, metadata) of the newest checkpoint whose metadata reads; (None, None) if none.

    Newer checkpoints with an unreadable metadata file (emptied, truncated, missing) are
    skipped, as the training loop skips (and sets aside) unreadable checkpoints when it
    resumes; if no checkpoint's metadata reads, the newest one's error is raised.
    """
    first_error = None
    for step in reversed(self.all_steps()):
      try:
        return step, self.read_metadata(step)
      except CheckpointError as e:
        first_error = first_error or e
    if first_error is not None:
      raise first_error
    return None, None

  def check_compatible(self, fingerprint: Dict[str, Any], hints: Optional[Dict[str, str]] = None,
                       ignore: Sequence[str] = ()) -> None:
    """Raises CheckpointError if the latest checkpoint belongs to another model/config/data.

    `hints` maps a fingerprint entry ("privacy.noise_multiplier") to what the message says when
    that entry is the first difference (instead of the generic advice). The entries in `ignore`
    (dotted paths, e.g. a path whose content another entry names by hash) are not compared.
    """
    step, metadata = self.latest_metadata()
    if step is None:
      return
    saved = _without(metadata.get("fingerprint"), ignore)
    fingerprint = _without(json.loads(json.dumps(fingerprint, default=json_default)), ignore)
    if saved != fingerprint:
      where = _first_difference(saved, fingerprint) if isinstance(saved, dict) else "fingerprint"
      advice = (hints or {}).get(where, "use a new model_dir, or restore the original configuration to resume")
      raise CheckpointError(
          f"{self.model_dir} holds checkpoints of another run (first difference: {where!r}: "
          f"checkpoint has {_lookup(saved, where)!r}, this run has {_lookup(fingerprint, where)!r}); {advice}")

  # -- save / restore ---------------------------------------------------------------------------

  def save(self, step: int, state: PyTree, metadata: Dict[str, Any],
           on_commit: Optional[Callable[[], None]] = None) -> bool:
    """Starts saving `state` and `metadata` (with the fingerprint) as checkpoint `step`.

    The previous (background) save is completed and checked first. `on_commit` runs once this
    checkpoint is complete on disk (in the next `save`, `wait`, `poll` or `close`), never before:
    files that describe the checkpoint (the privacy report) must not run ahead of it.

    Raises:
      CheckpointError: this save or the previous one failed (directory not writable, disk
        full, ...): one line naming the step and the cause; the failed step never becomes
        visible, its temporaries are removed, and earlier checkpoints stay intact.
    """
    self.wait()
    _check_free_space(self.directory, int(step), state)
    metadata = dict(metadata, step=int(step), fingerprint=self.fingerprint, format_version=FORMAT_VERSION)
    metadata = json.loads(json.dumps(metadata, default=json_default))
    try:
      saved = self._manager.save(int(step), args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardSave(state), METADATA_ITEM: ocp.args.JsonSave(metadata)}),
          force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._failed(int(step), e)
    self._pending = (int(step), on_commit)
    return saved

  def keep_run_seeds(self, seeds: Dict[str, Any]) -> Dict[str, Any]:
    """Keeps the run's `seeds` (`RunSeeds.to_dict()`) in the secrets file; returns the entry the
    checkpoints' metadata holds instead (`seeds_entry`: no seed).

    Call it before the first save of a session. The lock holder (process 0) writes the file unless
    it holds these seeds already (`write_run_seeds`); the other processes of a multi-process run
    write nothing.

    Raises:
      CheckpointError: the file holds another root seed, or cannot be written.
    """
    if self._lock is not None:
      had_folder = os.path.isdir(run_dir.secrets_dir(self.model_dir))
      if write_run_seeds(self.model_dir, seeds):
        self._created.secrets = "file" if had_folder else "folder"
    return seeds_entry(seeds)

  def _failed(self, step: Optional[int], error: BaseException) -> None:
    """Cleans up after a failed save of `step` and raises its one-line CheckpointError."""
    # Let orbax's background work of the failed save end, remove the step's temporaries and
    # continue with a fresh orbax manager (the next start removes any temporaries left too).
    try:
      self._manager.wait_until_finished()
    except Exception:  # pylint: disable=broad-except
      pass  # the save's own error is the one reported
    self._pending = None
    for _ in range(5):  # writers of the other items may still be closing their files
      self._remove_unfinished()
      time.sleep(0.2)
    self._remove_unfinished()
    self._manager = self._open_orbax()
    what = "a checkpoint" if step is None else f"checkpoint {step}"
    raise CheckpointError(f"saving {what} to {self.directory} failed: {cause(error)}; "
                          "training stopped, earlier checkpoints are intact") from error

  def wait(self) -> None:
    """Blocks until the background save is complete, then runs its `on_commit`.

    Raises:
      CheckpointError: the background save failed (naming its step and the cause).
    """
    step, on_commit = self._pending if self._pending is not None else (None, None)
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._failed(step, e)
    self._pending = None
    if on_commit is not None:
      on_commit()

  def poll(self) -> None:
    """Runs the pending `on_commit` if the background save has finished (never blocks long)."""
    if self._pending is not None and not self._manager.is_saving_in_progress():
      self.wait()

  def restore(self, abstract_state: PyTree, step: Optional[int] = None) -> Tuple[PyTree, Dict[str, Any]]:
    """(state, metadata) of checkpoint `step` (default: latest), placed as `abstract_state`."""
    step = self._readable_step(step)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardRestore(abstract_state), METADATA_ITEM: ocp.args.JsonRestore()}))
      metadata = _metadata_dict(restored[METADATA_ITEM])
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable or does not match "
                            f"this model: {cause(e)}") from e
    return restored[STATE_ITEM], metadata

  def params_scanned(self, step: int) -> Optional[bool]:
    """Whether checkpoint `step` holds its parameters in the scanned layout (`T5Config.scan_layers`,
    `network.to_layout`), read from its tree metadata; None when that cannot be read (the restore
    that follows then says why)."""
    try:
      tree = ocp.PyTreeCheckpointer().metadata(os.path.join(self.directory, str(step), STATE_ITEM))
      tree = getattr(getattr(tree, "item_metadata", tree), "tree", getattr(tree, "item_metadata", tree))
      return network.is_scanned(tree["params"])
    except Exception:  # pylint: disable=broad-except
      return None

  def set_aside(self, step: int) -> str:
    """Moves unreadable checkpoint `step` out of the step sequence (kept for inspection).

    It becomes `checkpoints/unreadable-<step>-<time>`, which orbax does not list, so the run
    can fall back to an earlier step and later save `step` again. Returns the new path.
    """
    source = os.path.join(self.directory, str(int(step)))
    target = os.path.join(self.directory, f"unreadable-{int(step)}-{int(time.time())}")
    try:
      os.rename(source, target)
    except OSError as e:
      raise CheckpointError(f"cannot move unreadable checkpoint {source} aside: {e.strerror or e}") from e
    self._manager.reload()
    return target

  def __del__(self):
    # A manager dropped without `close` (a query, an error path) gives its lock back.
    lock = getattr(self, "_lock", None)
    if lock is not None:
      self._lock = None
      try:
        run_lock.release(lock)
      except Exception:  # pylint: disable=broad-except
        pass  # interpreter shutdown

  def close(self, discard_if_unused: bool = False) -> None:
    """Completes the pending save, closes orbax and releases the model directory's lock.

    `discard_if_unused=True` (a run that failed before its first save): also removes what
    opening created, if it is still empty: `checkpoints/`, the secrets file this manager wrote
    when no checkpoint uses it, and MODEL_DIR with its `.lock` when this manager created it. A
    directory that held anything before is never touched.
    """
    try:
      self.wait()
      self._manager.close()
    finally:
      lock, self._lock = self._lock, None
      if lock is not None:
        run_lock.release(lock)
      if discard_if_unused and lock is not None:
        self._discard_if_unused()

  def _discard_if_unused(self) -> None:
    # orbax cleans stale temporaries of `checkpoints/` in a background thread started when it
    # opened, and `close` does not wait for it: let it finish before the folder goes away.
    cleanup = getattr(self._manager, "_cleanup_tmp_directory_future", None)
    try:
      if cleanup is not None:
        cleanup.result()
    except Exception:  # pylint: disable=broad-except
      pass  # its failure changes nothing here
    self._created.discard_if_unused(self.model_dir, self.directory)


class _Created:
  """What opening a run's checkpoints created (MODEL_DIR, `checkpoints/`, the secrets file or its
  folder), removed again while unused by `CheckpointManager.close(discard_if_unused=True)`."""

  def __init__(self, model_dir_made: bool, checkpoints_made: bool):
    self.model_dir_made, self.checkpoints_made = model_dir_made, checkpoints_made
    self.secrets: Optional[str] = None  # what `keep_run_seeds` created: "file", "folder" (and file) or None

  @classmethod
  def before_opening(cls, model_dir: str) -> "_Created":
    return cls(not os.path.exists(model_dir), not os.path.exists(run_dir.checkpoints_dir(model_dir)))

  def discard_if_unused(self, model_dir: str, directory: str) -> None:
    """Removes what was created, if still empty (`directory`: the checkpoints); best effort."""
    try:
      if self.secrets and (not os.path.isdir(directory) or not os.listdir(directory)):
        os.remove(run_dir.run_seeds_path(model_dir))  # no checkpoint continues its seed
        if self.secrets == "folder":
          os.rmdir(run_dir.secrets_dir(model_dir))
    except OSError:
      pass  # best effort, as below
    try:
      if self.checkpoints_made and os.path.isdir(directory) and not os.listdir(directory):
        os.rmdir(directory)
      lock_file = run_dir.lock_path(model_dir)
      if self.model_dir_made and os.listdir(model_dir) == [run_dir.LOCK_FILENAME]:
        os.remove(lock_file)
        os.rmdir(model_dir)
    except OSError:
      pass  # best effort: leftovers are empty and harmless


def _make_private_dir(path: str) -> None:
  """Creates `path`, if missing, readable by its owner only (checkpoints hold private state)."""
  try:
    os.mkdir(path, 0o700)
  except OSError:
    pass  # it exists, or orbax names the problem when it opens the directory


# Room kept beyond the arrays' bytes for a checkpoint's metadata, sharding and index files
# (about 100 KiB for a small model): a fixed part and a share of the arrays.
_SAVE_MARGIN_BYTES = 256 << 10
_SAVE_MARGIN_SHARE = 0.05


def _bytes_to_write(state: PyTree) -> int:
  """The array bytes this process writes for `state` (one copy of each of its shards)."""
  total = 0
  for leaf in jax.tree.leaves(state):
    shards = getattr(leaf, "addressable_shards", None)
    if shards is not None:
      total += sum(s.data.nbytes for s in shards if s.replica_id == 0)
    else:
      total += int(np.asarray(leaf).nbytes)
  return total


def _check_free_space(directory: str, step: int, state: PyTree) -> None:
  """Refuses a save that cannot fit, before the storage layer starts writing.

  A save that runs out of space half-way fails inside the storage layer's writer threads, which
  print stray tracebacks beside the one-line error; a disk already too full is named here.
  """
  try:
    free = shutil.disk_usage(directory).free
  except OSError:
    return  # the save itself names the problem
  arrays = _bytes_to_write(state)
  need = int(arrays * (1 + _SAVE_MARGIN_SHARE)) + _SAVE_MARGIN_BYTES
  if free < need:
    raise CheckpointError(
        f"saving checkpoint {step} to {directory} failed: {os.strerror(28)} (needs about "
        f"{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free); training stopped, earlier "
        "checkpoints are intact")


def _check_no_empty_file(step_dir: str, step: int, directory: str) -> None:
  """Raises CheckpointError when a file of a checkpoint is empty (cut short by a crash or a copy).

  Every file orbax commits holds data, so an empty one means the checkpoint is damaged. Found
  here, before the storage layer starts its many parallel reads, the checkpoint is set aside
  with one line; a read that fails half-way instead leaves the storage threads printing stray
  tracebacks after the restore has given up.
  """
  for root, _, files in os.walk(step_dir):
    for name in sorted(files):
      path = os.path.join(root, name)
      try:
        empty = os.path.getsize(path) == 0
      except OSError:
        continue  # gone meanwhile: the restore names it
      if empty:
        raise CheckpointError(f"checkpoint {step} in {directory} is unreadable: "
                              f"{os.path.relpath(path, step_dir)} is empty")


def _metadata_dict(metadata: Any) -> Dict[str, Any]:
  if not isinstance(metadata, dict):
    raise ValueError(f"the metadata is a JSON {type(metadata).__name__}, not an object")
  return dict(metadata)


def _without(tree: Any, dotted_paths: Sequence[str]) -> Any:
  """A copy of a JSON tree without the entries at `dotted_paths` (those absent are skipped)."""
  tree = copy.deepcopy(tree)
  for dotted in dotted_paths:
    *parents, last = dotted.split(".")
    node = _lookup(tree, ".".join(parents)) if parents else tree
    if isinstance(node, dict):
      node.pop(last, None)
  return tree


def _lookup(tree: Any, dotted: Optional[str]) -> Any:
  if not dotted or not isinstance(tree, dict):
    return tree
  node = tree
  for part in dotted.split("."):
    if not isinstance(node, dict) or part not in node:
      return None
    node = node[part]
  return node


# -- the run's secret seeds ------------------------------------------------------------------------

def seeds_entry(seeds: Dict[str, Any]) -> Dict[str, Any]:
  """What a checkpoint's metadata says about the run's seeds: whether they were fixed by the user
  and where the root seed is kept (relative to MODEL_DIR); never the seed, nor a hash of it (a
  64-bit seed's hash is searched through)."""
  return {"deterministic": bool(seeds["deterministic"]), "secrets": run_dir.RUN_SEEDS_RELPATH}


def holds_root_seed(metadata: Dict[str, Any]) -> bool:
  """Whether a checkpoint's metadata holds the root seed itself (written before the secrets file)."""
  entry = metadata.get("seeds")
  return isinstance(entry, dict) and "root_seed" in entry


def _read_seeds_file(path: str) -> Tuple[Optional[Dict[str, Any]], str]:
  """(seeds, "") from the secrets file at `path`; (None, why) when it is missing or unreadable."""
  try:
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
  except FileNotFoundError:
    return None, "it is missing"
  except OSError as e:
    return None, e.strerror or str(e)
  except ValueError as e:
    return None, f"not JSON: {e}"
  try:
    if not isinstance(d, dict) or not isinstance(d.get("deterministic"), bool):
      raise ValueError
    return {"root_seed": str(int(d["root_seed"])), "deterministic": d["deterministic"]}, ""
  except (KeyError, TypeError, ValueError):
    return None, "it is not a run seeds file (a root_seed and a deterministic entry)"


def read_run_seeds(model_dir: str) -> Optional[Dict[str, Any]]:
  """The seeds in MODEL_DIR/secrets/run_seeds.json ({"root_seed": str, "deterministic": bool}),
  or None when there is no such file.

  Raises:
    CheckpointError: the file is there but cannot be read, or is not a seeds file.
  """
  path = run_dir.run_seeds_path(model_dir)
  seeds, why = _read_seeds_file(path)
  if seeds is None and os.path.lexists(path):
    raise CheckpointError(f"the run's root seed cannot be read from {path}: {why}; restore the file, "
                          "or train into a fresh MODEL_DIR")
  return seeds


def write_run_seeds(model_dir: str, seeds: Dict[str, Any]) -> bool:
  """Writes `seeds` into MODEL_DIR/secrets/run_seeds.json unless it holds them already; True
  when it wrote them.

  The folder is made with mode 0o700, the file written atomically with mode 0o600 (before any
  byte of the seed). A run directory has one root seed: a file holding another is never replaced.

  Raises:
    CheckpointError: the file holds another root seed or cannot be read, or it cannot be written.
  """
  path = run_dir.run_seeds_path(model_dir)
  kept = read_run_seeds(model_dir)
  if kept is not None:
    if int(kept["root_seed"]) == int(seeds["root_seed"]) and kept["deterministic"] == bool(seeds["deterministic"]):
      return False
    raise CheckpointError(f"{path} holds another root seed than this run's: a run directory has one root seed, "
                          "which is never replaced; train into a fresh MODEL_DIR")
  content = {"root_seed": str(int(seeds["root_seed"])), "deterministic": bool(seeds["deterministic"]),
             "format_version": RUN_SEEDS_FORMAT_VERSION, "note": RUN_SEEDS_NOTE}
  folder = run_dir.secrets_dir(model_dir)
  try:
    os.makedirs(model_dir, exist_ok=True)
    try:
      os.mkdir(folder, 0o700)
    except FileExistsError:
      pass
    with atomic_open(path, "w", encoding="utf-8") as f:
      os.fchmod(f.fileno(), 0o600)
      f.write(json.dumps(content, indent=2) + "\n")
  except OSError as e:
    raise CheckpointError(f"cannot write the run's root seed to {path}: {e.strerror or e}") from e
  return True


def checkpoint_seeds(model_dir: str, step: int, metadata: Dict[str, Any]) -> Dict[str, Any]:
  """The run seeds that checkpoint `step` (its `metadata`) continues: its own entry when it was
  written before the secrets file (the seed in the metadata), else the secrets file's.

  Raises:
    CheckpointError (one line): the secrets file is missing or unreadable (the checkpoint's noise
      streams cannot be continued without it), or it holds another seed than the checkpoint.
  """
  path = run_dir.run_seeds_path(model_dir)
  entry = metadata.get("seeds")
  if holds_root_seed(metadata):
    kept = read_run_seeds(model_dir)
    if kept is not None and int(kept["root_seed"]) != int(entry["root_seed"]):
      raise CheckpointError(f"checkpoint {step} in {run_dir.checkpoints_dir(model_dir)} holds another root seed "
                            f"than {path}: a run directory has one root seed; restore this run's secrets file, "
                            "or train into a fresh MODEL_DIR")
    return dict(entry)
  kept, why = _read_seeds_file(path)
  if kept is None:
    raise CheckpointError(
        f"the run's root seed cannot be read from {path} ({why}), and the DP noise streams of the checkpoints "
        f"in {run_dir.checkpoints_dir(model_dir)} (latest step {step}) cannot be continued without it (a new "
        "seed is never drawn for them): restore the file, or train into a fresh MODEL_DIR")
  if isinstance(entry, dict) and "deterministic" in entry and bool(entry["deterministic"]) != kept["deterministic"]:
    kinds = {True: "a fixed (insecure_deterministic_seed)", False: "a secret"}
    raise CheckpointError(f"checkpoint {step} in {run_dir.checkpoints_dir(model_dir)} was written with "
                          f"{kinds[bool(entry['deterministic'])]} root seed but {path} holds "
                          f"{kinds[kept['deterministic']]} one: it is another run's; restore this run's "
                          "secrets file, or train into a fresh MODEL_DIR")
  return kept


def saved_seeds(manager: CheckpointManager) -> Optional[Dict[str, Any]]:
  """The run seeds a run in `manager`'s directory continues, or None for a new run.

  Those of the latest checkpoint whose metadata reads (`checkpoint_seeds`); without a
  checkpoint, those of a secrets file an earlier start wrote before it saved none (a run
  directory has one root seed); None when there is neither.
  """
  step, metadata = manager.latest_metadata()
  if step is None:
    return read_run_seeds(manager.model_dir)
  return checkpoint_seeds(manager.model_dir, step, metadata)
