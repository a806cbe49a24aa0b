"""Checkpoints with orbax: every N steps, keep the last K, atomic, resume from the latest.

The one reader and writer of MODEL_DIR/checkpoints/ (the layout is in `run_dir`): training
saves and resumes through `CheckpointManager`; evaluation, memorization, adaptive DP,
fine-tuning and export read parameters through `restore_for_inference`.

Atomicity: orbax writes a step into a temporary directory and renames it once every item is
complete, so a process killed at any moment (also during a save) leaves only complete steps
visible; `latest_step` ignores unfinished temporaries and the next run that holds the model
directory's lock removes them (never a process without the lock: it may be another run's save).
The step of a checkpoint is also the data position (batches are a pure function of the
sampler seed and the step), so a resumed run neither skips nor repeats a batch.

A checkpoint directory holds the run's secret seeds (noise and sampling keys): keep it as
private as the training data; release parameters only (`restore_for_inference`). A new
MODEL_DIR/checkpoints/ is therefore created readable by its owner only (0o700), whatever the
umask; the run's other files follow the umask.
"""
import copy
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import numpy as np

from private_t5.errors import CheckpointError, ConfigError
from private_t5.io import json_default
from private_t5.models import hf_convert, run_dir, run_lock
from private_t5.models import lora as lora_lib
from private_t5.models import config as config_lib

logger = logging.getLogger(__name__)

PyTree = Any
STATE_ITEM = "state"
METADATA_ITEM = "metadata"
FORMAT_VERSION = 1


def _ocp():
  # Lazy: Orbax is slow to import and its loggers are quieted right after (`_quiet_orbax_errors`).
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  _quiet_orbax_errors()
  return ocp


# Warnings orbax logs on every read-only checkpoint read: routine, not for users.
_ROUTINE_ORBAX_WARNINGS = ("CheckpointManagerOptions.read_only=True", "Given directory is read only",
                           "Metadata file does not exist")


class _OrbaxErrorFilter(logging.Filter):
  """Drops orbax's own error logs, and its routine warnings of a read, unless private_t5 logs at
  DEBUG (`--verbosity=debug`).

  A failed save makes orbax log the same error with a full traceback from each of its
  background threads; `CheckpointManager.save`/`wait` report it as one CheckpointError line.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    routine = record.levelno == logging.WARNING and str(record.msg).startswith(_ROUTINE_ORBAX_WARNINGS)
    if (record.levelno < logging.ERROR and not routine) or not _called_from_orbax(record):
      return True
    return logging.getLogger("private_t5").isEnabledFor(logging.DEBUG)


def _called_from_orbax(record: logging.LogRecord) -> bool:
  # `record.pathname` names orbax only once absl's logger class is set up (it skips absl's own
  # frames); otherwise the caller is found on the stack of the logging call.
  orbax_dir = f"{os.sep}orbax{os.sep}"
  if orbax_dir in record.pathname:
    return True
  frame = inspect.currentframe()
  while frame is not None:
    if orbax_dir in frame.f_code.co_filename:
      return True
    frame = frame.f_back
  return False


_ORBAX_ERROR_FILTER = _OrbaxErrorFilter()


def _quiet_orbax_errors() -> None:
  absl_logger = logging.getLogger("absl")  # orbax logs through absl
  if _ORBAX_ERROR_FILTER not in absl_logger.filters:
    absl_logger.addFilter(_ORBAX_ERROR_FILTER)


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
    # What this manager creates, removed again by `close(discard_if_unused=True)`.
    self._created_model_dir = not os.path.exists(model_dir)
    self._created_checkpoints = not os.path.exists(run_dir.checkpoints_dir(model_dir))
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
    ocp = _ocp()
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
    ocp = _ocp()
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
    ocp = _ocp()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()}))
      return _metadata_dict(restored[METADATA_ITEM])
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable: {_cause(e)}") from e

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
    ocp = _ocp()
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
    raise CheckpointError(f"saving {what} to {self.directory} failed: {_cause(error)}; "
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
    ocp = _ocp()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardRestore(abstract_state), METADATA_ITEM: ocp.args.JsonRestore()}))
      metadata = _metadata_dict(restored[METADATA_ITEM])
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable or does not match "
                            f"this model: {_cause(e)}") from e
    return restored[STATE_ITEM], metadata

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
    opening created, if it is still empty: `checkpoints/`, and MODEL_DIR with its `.lock` when
    this manager created it. A directory that held anything before is never touched.
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
    try:
      if self._created_checkpoints and os.path.isdir(self.directory) and not os.listdir(self.directory):
        os.rmdir(self.directory)
      lock_file = run_dir.lock_path(self.model_dir)
      if self._created_model_dir and os.listdir(self.model_dir) == [run_dir.LOCK_FILENAME]:
        os.remove(lock_file)
        os.rmdir(self.model_dir)
    except OSError:
      pass  # best effort: leftovers are empty and harmless


def _make_private_dir(path: str) -> None:
  """Creates `path`, if missing, readable by its owner only (it will hold the run's secret seeds)."""
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


# TensorStore (orbax's array writer) ends an OS failure with the errno: "... [os_error_code='28']".
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_MAX_CAUSE_CHARS = 200


def _chain(error: BaseException):
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _cause(error: BaseException) -> str:
  """One short line: the OS reason of an OSError (also one that orbax or TensorStore wrapped in
  a long message, e.g. "No space left on device"), else the exception's type and first line."""
  for e in _chain(error):
    if isinstance(e, OSError) and e.strerror:
      return e.strerror
  for e in _chain(error):
    match = _OS_ERROR_CODE.search(str(e))
    if match:
      return os.strerror(int(match.group(1)))
  text = str(error).strip().splitlines()
  line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
  return line if len(line) <= _MAX_CAUSE_CHARS else line[:_MAX_CAUSE_CHARS - 3] + "..."


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


# How often the latest checkpoint is read again when a running training rotates it away.
ROTATION_RETRIES = 5


def restore_for_inference(model_dir: str, step: Optional[int] = None, *, merge_adapters: bool = True,
                          lora_base: Optional[str] = None):
  """Parameters of a trained model, for evaluation, memorization tests, fine-tuning and export.

  A LoRA run's checkpoint holds only adapters: its base (the `lora` entry of the metadata: path
  and SHA-256 of the frozen weights) is read too, checked against the hash, and the adapters are
  merged into it (`lora.merge`), so every reader gets plain T5 parameters; `merge_adapters=False`
  returns the adapters themselves (for an adapter export). `lora_base` names the base's new
  place when it moved (`--initial_checkpoint` of evaluate and export, as of train): it must hold
  the recorded weights (same SHA-256), and `info["lora"]` then names it.

  Reading the latest checkpoint of a running training is safe: a checkpoint that its
  `keep_checkpoints` rotation deletes while it is read is read again from the new latest (up to
  `ROTATION_RETRIES` times). A given `step` is read once. When the latest is unreadable
  (damaged metadata or state), the newest older checkpoint that reads is used, with a warning, as
  a resumed training does.

  Args:
    model_dir: a training run's MODEL_DIR.
    step: checkpoint step; None for the latest.
    lora_base: a LoRA run's base, moved from the recorded path (None: the recorded path).

  Returns:
    (params, model_config, info): params as a nested dict of jax arrays (no optimizer state,
    no seeds), the `models.T5Config`, and a dict with `vocab_path`, `step`, `privacy_report`
    (the ledger's report at that step, or None), `feature_lengths`, the training data's
    `objective`, `vocab_sha256` and `privacy_unit`, and `lora` (a LoRA run's settings and base,
    else None).

  Raises:
    CheckpointError: no checkpoint (or not that step) in `model_dir`, or an unreadable one; a
      LoRA run whose base is missing or has changed.
  """
  attempt = 0
  while True:
    before = run_dir.checkpoint_step_names(model_dir)
    try:
      params, config, info = _read_newest_readable(model_dir, before) if step is None else _read_for_inference(
          model_dir, step)
      if lora_base and not info.get("lora"):
        raise ConfigError(f"--initial_checkpoint names a moved LoRA base, but {model_dir!r} is not a LoRA run")
      if info.get("lora") and lora_base:
        record = info["lora"]
        info = dict(info, lora=dict(record, base=dict(record["base"], path=os.path.abspath(lora_base))))
      if info.get("lora") and merge_adapters:
        params = lora_lib.merge(read_lora_base(info["lora"], model_dir), params, lora_lib.config_of(info["lora"]))
      return params, config, info
    except CheckpointError:
      attempt += 1
      if step is not None or attempt >= ROTATION_RETRIES or run_dir.checkpoint_step_names(model_dir) == before:
        raise
      logger.info("a checkpoint of %s was rotated away while it was read; reading the new latest", model_dir)


def _read_newest_readable(model_dir: str, step_names):
  """`_read_for_inference` of the latest checkpoint, else of the newest older one (of `step_names`) that reads."""
  try:
    return _read_for_inference(model_dir, None)
  except CheckpointError as error:
    for older in sorted((int(n) for n in step_names), reverse=True)[1:]:
      try:
        result = _read_for_inference(model_dir, older)
      except CheckpointError:
        continue
      logger.warning("%s; read checkpoint %d instead, the newest one that reads", error, older)
      return result
    raise


def _read_for_inference(model_dir: str, step: Optional[int]):
  """One reading of `restore_for_inference`."""
  ocp = _ocp()
  directory = os.path.abspath(run_dir.checkpoints_dir(model_dir))
  if not os.path.isdir(directory):
    raise CheckpointError(f"no checkpoints in {model_dir!r} (expected {directory})")
  manager = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
      item_names=(STATE_ITEM, METADATA_ITEM))
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise CheckpointError(f"no complete checkpoint in {directory}")
    if step is None:
      step = steps[-1]
    elif int(step) not in steps:
      raise CheckpointError(f"checkpoint step {step} not found in {directory} (have {steps})")
    metadata = manager.restore(step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()}))
    metadata = dict(metadata[METADATA_ITEM])
    step_dir = os.path.join(directory, str(step), STATE_ITEM)
    tree_meta = ocp.PyTreeCheckpointer().metadata(step_dir)
    tree_meta = getattr(tree_meta, "item_metadata", tree_meta)
    tree_meta = getattr(tree_meta, "tree", tree_meta)
    params_meta = tree_meta["params"]
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), params_meta)
    restored = ocp.PyTreeCheckpointer().restore(
        step_dir, args=ocp.args.PyTreeRestore(
            item={"params": params_meta}, restore_args={"params": restore_args},
            partial_restore=True))
  except CheckpointError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"cannot read checkpoint {step} in {directory}: {_cause(e)}") from e
  finally:
    manager.close()
  params = jax.tree.map(np.asarray, restored["params"])
  model_config = config_lib.from_saved(metadata["model_config"])
  info = {
      "step": int(step),
      "vocab_path": metadata.get("vocab_path"),
      "privacy_report": metadata.get("privacy_report"),
      "feature_lengths": metadata.get("feature_lengths"),
      "model_dir": os.path.abspath(model_dir),
      "lora": metadata.get("lora"),
  }
  data = (metadata.get("fingerprint") or {}).get("data") or {}
  info.update(objective=data.get("objective"), vocab_sha256=data.get("vocab_sha256"),
              privacy_unit=data.get("privacy_unit"))
  return params, model_config, info


def read_model_dir(path: str):
  """(params, T5Config, info) of a private_t5 MODEL_DIR (`restore_for_inference`, latest step) or
  of a Hugging Face T5 directory (info: `kind`, `path`, `step` None, `vocab_path`,
  `privacy_report` None)."""
  if hf_convert.is_hf_t5_dir(path):
    params, config = hf_convert.import_hf_t5(path)
    return params, config, {"kind": "huggingface", "path": os.path.abspath(path), "step": None,
                            "vocab_path": hf_convert.hf_vocabulary_path(path), "privacy_report": None}
  params, config, info = restore_for_inference(path)
  return params, config, dict(info, kind="private_t5", path=os.path.abspath(path))


def read_lora_base(record: Dict[str, Any], model_dir: str):
  """The frozen base parameters of a LoRA run (its metadata's `lora` record), hash checked.

  `record["base"]["path"]` is where the run recorded its base, or where `restore_for_inference`'s
  `lora_base` says it moved; either way its weights must have the recorded SHA-256.
  """
  path, sha256 = record["base"]["path"], record["base"]["sha256"]
  if os.path.exists(path) and not os.path.isdir(path):
    raise CheckpointError(f"the LoRA base {path!r} of the run {model_dir!r} is a file, not a checkpoint directory")
  if not os.path.isdir(path):
    raise CheckpointError(f"the LoRA run {model_dir!r} adapts the weights in {path!r}, which are missing; "
                          "if they moved, name their new place with --initial_checkpoint=DIR (train, evaluate, export; "
                          "checked by SHA-256)")
  params = read_model_dir(path)[0]
  if lora_lib.params_sha256(params) != sha256:
    raise CheckpointError(f"the base weights in {path!r} changed since the LoRA run {model_dir!r} was trained "
                          f"(SHA-256 {sha256[:12]}... expected)")
  return params


def saved_seeds(manager: CheckpointManager) -> Optional[Dict[str, Any]]:
  """The run seeds stored in the latest checkpoint (to continue its streams), or None."""
  step, metadata = manager.latest_metadata()
  if step is None:
    return None
  seeds = metadata.get("seeds")
  if not isinstance(seeds, dict):
    raise CheckpointError(f"checkpoint {step} in {manager.directory} has no run seeds")
  return seeds
