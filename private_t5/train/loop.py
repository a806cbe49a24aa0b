"""The training loop: resume, sample, step, log, evaluate, checkpoint, account.

Order of one step t (t = the state's step = the data position), with `mechanism` the run's
`dp.mechanism.Mechanism` and `layout` its `dp.mechanism.BatchLayout` (an execution setting):
  indices = mechanism.indices_for_step(t); rows = layout.rows_for_step(len(indices));
  batch = source.get_batch(indices, data_seed(t), rows);
  state = train_step(state, batch) (keys fold_in(base, t)); ledger.record_steps(1).
`rows` is the fixed batch size B, or with untruncated Poisson sampling the n sampled examples
padded to ceil(n / m) m rows. With `layout.microbatch_size` = m set, the rows run as
microbatches of m rows inside one compiled call (`Trainer.train_step_stacked`: the microbatches
stacked, a device loop accumulates them, the noise is added once); else as one fused compiled
step (`Trainer.train_step`). Either way a step is one dispatch. The batches are built and placed
on the devices `prefetch_depth` steps ahead by worker threads (`train.step_data`): the batch of
step t is a pure function of (seeds, t), so prefetching changes nothing the run computes, and
nothing is read back from the devices except on the steps that log (every `log_every`) and at
the first step (its compile time). The loop is the same for a private and a non-private
mechanism (their parts differ, not the loop).
Every `checkpoint_every` steps the state and the ledger are saved together, so
a checkpoint at step s holds a ledger of exactly s steps; the root seed is not in it: before the
first save of a session it is kept in MODEL_DIR/secrets/run_seeds.json (process 0,
`CheckpointManager.keep_run_seeds`), and the metadata only says where. The privacy report in
MODEL_DIR is rewritten only once that checkpoint is committed (complete on disk), so it never claims more
steps than the latest checkpoint holds. A save that fails stops the run with one
CheckpointError naming the step. An unreadable latest checkpoint is set aside with a warning
and the run resumes from the newest readable one (state, seeds and ledger all from that one
checkpoint; its seeds from the secrets file, or from its metadata if it was written before the
secrets file existed). After a crash the run restarts from the latest complete
checkpoint s and recomputes steps s+1, ... with the same batches and keys, producing the same
updates (nothing new is released).

Several processes (multi-host): every process draws the same indices (same sampler seed), builds
only its own rows of the batch (`trainer.local_rows`; the real rows spread round-robin over the
`data` axis, `step_data.local_batch`; each row carries its position in the step's sample, which its
dropout key folds in, so the step equals the one-process microbatched step on the same sample)
and the global batch is assembled on the devices; the run's files
(privacy report, TensorBoard) are written by process 0 only, checkpoints by orbax on all processes
together; the caller writes the summary the loop returns (`dp.ledger.write_summary`).
"""
import dataclasses
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional

import jax
import numpy as np

from private_t5 import progress as progress_lib
from private_t5.dp import privacy_report
from private_t5.dp.ledger import PrivacyLedger
from private_t5.dp.config import BatchLayout
from private_t5.dp.mechanism import Mechanism
from private_t5.models import checkpoints as checkpoints_lib
from private_t5 import errors as errors_lib
from private_t5.models import network, run_dir
from private_t5.train import metrics as metrics_lib
from private_t5.train import partitioning
from private_t5.train import step_data
from private_t5.train import step_rows
from private_t5.train.state import RunSeeds
from private_t5.train.trainer import Trainer, summarize_eval

# Fixed seed of the validation batches: the same held-out examples (and the same objective
# noise) at every evaluation, so that the numbers are comparable across steps.
VALIDATION_SEED = 0


@dataclasses.dataclass
class LoopConfig:
  """Schedule of the loop (all in steps)."""
  model_dir: str
  train_steps: int
  checkpoint_every: int = 1000
  eval_every: int = 0
  eval_examples: int = 256
  log_every: int = 50
  prefetch_depth: int = step_data.DEFAULT_PREFETCH_DEPTH  # steps whose batches are built ahead (0: in line)
  data_workers: int = step_data.DEFAULT_DATA_WORKERS  # processes building them (0: a thread of this one)


def _validation_batches(source, batch_size: int, eval_examples: int,
                        rows: Optional[range] = None) -> List[Dict[str, np.ndarray]]:
  """The fixed validation batches; `rows`: this process's rows of each (default: all)."""
  n = min(int(eval_examples), source.num_examples)
  # A fixed random subset, not the first n: validation files may be ordered (GLUE dev sets
  # sorted by label, corpora by source), and the first n would be a biased sample.
  indices = np.sort(np.random.default_rng(VALIDATION_SEED).permutation(source.num_examples)[:n])
  indices = indices.astype(np.int64)
  rows = range(batch_size) if rows is None else rows
  return [source.get_batch(indices[i:i + batch_size][rows.start:rows.stop], VALIDATION_SEED, len(rows))
          for i in range(0, n, batch_size)]


# Where they were first defined (tests and tools import them from here).
sample_positions = step_rows.sample_positions
local_batch = step_data.local_batch


def _shape_name(shape) -> str:
  if shape[0] == "step":
    return f"one batch of {shape[1]} rows"
  return f"{shape[1]} microbatches of {shape[2]} rows"


def evaluate(trainer: Trainer, params, batches) -> Dict[str, float]:
  """Teacher-forced loss and token accuracy (the paper's "Pretrain" column) over `batches`."""
  totals: Dict[str, float] = {}
  for batch in batches:
    for k, v in trainer.eval_batch(params, batch).items():
      totals[k] = totals.get(k, 0.0) + v
  return summarize_eval(totals)


def _finite(x: Optional[float]) -> Optional[float]:
  return None if x is None or not math.isfinite(x) else float(x)


def _restore_latest_readable(manager: checkpoints_lib.CheckpointManager, abstract_state, log):
  """(step, state, metadata) of the newest readable checkpoint, or (None, None, None) if none.

  Unreadable newer checkpoints (a truncated or emptied array file) are set aside with a
  warning; if none is readable, the newest one's error is raised.
  """
  errors: Dict[int, errors_lib.CheckpointError] = {}
  for step in reversed(manager.all_steps()):
    try:
      state, saved = _restore_in_layout(manager, abstract_state, step, log)
    except errors_lib.CheckpointError as e:
      errors[step] = e
      continue
    for bad in [s for s in manager.all_steps() if s > step]:
      moved = manager.set_aside(bad)
      reason = errors.get(bad, f"checkpoint {bad} in {manager.directory} is unreadable")
      log(f"[train] WARNING: {reason}; moved to {moved}; resuming from checkpoint {step}")
    return step, state, saved
  if errors:
    raise errors[max(errors)]
  return None, None, None


def _restore_in_layout(manager: checkpoints_lib.CheckpointManager, abstract_state, step: int, log):
  """`manager.restore(abstract_state, step)`; a checkpoint of the other parameter layout (a run
  resumed with another `T5Config.scan_layers`) is read in its own layout and converted."""
  params = getattr(abstract_state, "params", None)  # (a train state; other trees are read as they are)
  wanted = params is not None and network.is_scanned(params)
  stored = None if params is None else manager.params_scanned(step)
  if stored is None or stored == wanted:
    return manager.restore(abstract_state, step)
  state, saved = manager.restore(_in_layout(abstract_state, stored), step)
  log(f"[train] checkpoint {step} holds {'scanned' if stored else 'unrolled'} layers; converted to the "
      f"{'scanned' if wanted else 'unrolled'} layout of this run")
  shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
  return jax.device_put(_in_layout(state, wanted), shardings), saved


def _in_layout(state, scanned: bool):
  """A train state (or its abstract shapes) with its parameter-shaped parts in a layout."""
  return state.replace(**{name: network.to_layout(getattr(state, name), scanned)
                          for name in ("params", "opt_state", "noise_state")})


def privacy_so_far(ledger: PrivacyLedger) -> Dict[str, Any]:
  """The run's privacy numbers for its logs and summary: total and training ε and δ, the
  vocabulary's status; all None for a ledger without a formal guarantee (ε ∞ is kept: a
  vocabulary that is not private)."""
  if ledger.non_private:
    return dict.fromkeys(("epsilon", "delta", "training_epsilon", "training_delta", "vocabulary"))
  return {"epsilon": ledger.total_epsilon(), "delta": ledger.total_delta(),
          "training_epsilon": ledger.training_epsilon(), "training_delta": ledger.training_delta(),
          "vocabulary": ledger.vocabulary_status()}


def _resume_or_init(trainer: Trainer, privacy: Mechanism, seeds: RunSeeds,
                    manager: checkpoints_lib.CheckpointManager, model_dir: str,
                    initial_params_fn: Optional[Callable[[], Any]], log: Callable[[str], None]):
  """(start step, state, ledger): from the latest readable checkpoint, or fresh; sets the ledger on `privacy`."""
  ledger: PrivacyLedger = privacy.ledger
  start_step, state, saved = _restore_latest_readable(manager, trainer.abstract_state(), log)
  if start_step is not None:
    if RunSeeds.from_dict(checkpoints_lib.checkpoint_seeds(model_dir, start_step, saved)) != seeds:
      raise errors_lib.CheckpointError(
          f"checkpoint {start_step} in {model_dir} was written with other seeds; pass the seeds "
          "read from it (checkpoints.saved_seeds)")
    if checkpoints_lib.holds_root_seed(saved):
      log(f"[train] checkpoint {start_step} holds the root seed in its metadata (written before "
          f"{run_dir.RUN_SEEDS_RELPATH} existed): the next checkpoint saved writes it to "
          f"{run_dir.run_seeds_path(model_dir)} and omits it; the metadata of the older checkpoints still "
          "holds it: keep them private")
    ledger = ledger.resume_from(PrivacyLedger.from_dict(saved["ledger"]))
    if ledger.steps != start_step:
      raise errors_lib.CheckpointError(
          f"checkpoint {start_step} in {model_dir} has a ledger of {ledger.steps} steps")
    log(f"[train] resuming from checkpoint step {start_step} in {manager.directory}")
  else:
    start_step = 0
    initial_params = initial_params_fn() if initial_params_fn is not None else None
    state = trainer.init_state(seeds.init_key, initial_params)
  privacy.ledger = ledger
  return start_step, state, ledger


def _batch_accuracy(trainer: Trainer, params, data) -> float:
  """The token accuracy of the parameters on a step's batch (all its microbatches)."""
  sums: Dict[str, float] = {}
  for chunk in ([data.placed] if data.count is None else data.host):
    for k, v in trainer.eval_batch(params, chunk).items():
      sums[k] = sums.get(k, 0.0) + v
  return sums.get("correct_tokens", 0.0) / max(sums.get("target_tokens", 0.0), 1e-12)


def _log_train_step(step: int, step_metrics, batch_accuracy: float, ledger: PrivacyLedger,
                    writer: metrics_lib.SummaryWriter, bar, printer: metrics_lib.ProgressPrinter, not_dp: bool,
                    log: Callable[[str], None]) -> Dict[str, float]:
  """Reads a logged step's metrics back and writes them (TensorBoard, progress bar, log line); returns them."""
  values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
  so_far = privacy_so_far(ledger)
  epsilon = so_far["epsilon"]  # ∞: vocabulary not private
  loss = values.get("nondp/loss")
  last_train = {"loss": loss, "token_accuracy": batch_accuracy, "step": step}
  tb = dict(values)
  tb["nondp/token_accuracy"] = batch_accuracy
  if epsilon is not None:
    tb["privacy/epsilon"] = _finite(epsilon)
    tb["privacy/training_epsilon"] = so_far["training_epsilon"]
  writer.scalars("train", step, tb)
  bar.set_postfix_str(", ".join(([] if loss is None else [f"loss {loss:.4g}"])
                                + ([] if epsilon is None else [f"ε so far {epsilon:.4g}"])), refresh=False)
  log(printer.line(step, loss, batch_accuracy, epsilon=epsilon, private=not_dp,
                   learning_rate=values.get("learning_rate"), training_epsilon=so_far["training_epsilon"]))
  return last_train


def _log_session(shapes_compiled, examples_seen: float, rows_run: int, not_dp: bool,
                 log: Callable[[str], None]) -> None:
  """Logs the train-step shapes compiled and the real rows run this session."""
  if shapes_compiled:
    log(f"[train] compiled train-step shapes this session: {len(shapes_compiled)} ("
        + ", ".join(_shape_name(shape) for shape in sorted(shapes_compiled)) + ")")
  if rows_run:
    real_fraction = examples_seen / rows_run
    log(f"[train] real rows: {int(examples_seen)} of {rows_run} rows run this session "
        f"({100.0 * real_fraction:.1f}% real, the rest padding{', not DP' if not_dp else ''})")


def _summary(model_dir: str, step: int, start_step: int, elapsed: float, first_step_time: Optional[float],
             examples_seen: float, rows_run: int, last_train: Dict[str, float], last_eval: Optional[Dict[str, float]],
             privacy: Mechanism, ledger: PrivacyLedger, manager: checkpoints_lib.CheckpointManager,
             writer: metrics_lib.SummaryWriter, seeds: RunSeeds) -> Dict[str, Any]:
  """The summary of the session that `run` returns."""
  not_dp = privacy.private
  steps_run = step - start_step
  real_fraction = examples_seen / rows_run if rows_run else None
  timed = max(elapsed - (first_step_time or 0.0), 1e-9)
  summary = {
      "model_dir": os.path.abspath(model_dir),
      "final_step": int(step),
      "steps_this_run": int(steps_run),
      "resumed_from_step": int(start_step) if start_step else None,
      "wall_time_s": elapsed,
      "steps_per_second": (steps_run - 1) / timed if steps_run > 1 else None,
      "examples_per_second": examples_seen / elapsed if elapsed > 0 else None,
      "real_row_fraction": real_fraction,
      "train_batch_metrics_not_dp" if not_dp else "train_batch_metrics": last_train,
      metrics_lib.validation_key(not_dp): last_eval,
      "private": privacy.private,
      **{k: _finite(v) if k.endswith("epsilon") else v for k, v in privacy_so_far(ledger).items()},
      "privacy_report": os.path.abspath(privacy_report.report_path(model_dir)),
      "checkpoint_dir": manager.directory,
      "tensorboard_dir": os.path.abspath(writer.log_dir),
      "deterministic_seed": seeds.deterministic,
  }
  if not_dp:  # statistics of the private data, outside the guarantee
    summary["not_dp"] = [k for k in metrics_lib.NOT_DP_SUMMARY_KEYS if k in summary]
  return summary


def run(*, trainer: Trainer, privacy: Mechanism, source, validation_source, seeds: RunSeeds,
        manager: checkpoints_lib.CheckpointManager, config: LoopConfig, metadata: Dict[str, Any],
        layout: BatchLayout, initial_params_fn: Optional[Callable[[], Any]] = None,
        log: Callable[[str], None] = print) -> Dict[str, Any]:
  """Trains to `config.train_steps`, resuming from the latest checkpoint; returns the summary
  (written to summary.json by the caller, once it is complete).

  `source` and `validation_source` (or None) are `train.main.ExampleSource`s: the loop reads their
  `num_examples` and `get_batch`. `layout` says how each step's sample runs (an execution
  setting, `BatchLayout.for_run`). `initial_params_fn` (fine-tuning)
  supplies the step-0 parameters of a fresh run; a resumed run ignores it and continues from
  its own checkpoint. The loop is the same for every mechanism; whether it is private changes
  only the wording of its logs and summary (`privacy.private`: "not DP" labels).
  """
  model_dir = config.model_dir
  start_step, state, ledger = _resume_or_init(trainer, privacy, seeds, manager, model_dir, initial_params_fn, log)
  not_dp = privacy.private  # the wording of the statistics of private data
  dropout_key, noise_key = seeds.dropout_base_key, seeds.noise_base_key
  padded = layout.batch_rows
  rows = range(*trainer.local_rows(padded))  # this process's rows of every batch
  primary = partitioning.is_primary()  # the one process that writes the run's files

  writer = metrics_lib.SummaryWriter(model_dir, enabled=primary)
  printer = metrics_lib.ProgressPrinter(config.train_steps, start_step)
  bar = progress_lib.bar(total=config.train_steps, initial=start_step, desc="[train]", unit="step")
  validation_batches = None
  if validation_source is not None and config.eval_examples > 0:
    validation_batches = _validation_batches(validation_source, padded, config.eval_examples, rows)

  seeds_entry: Dict[str, Any] = {}  # where the checkpoints say the seed is, once it is kept there

  def save(step: int, state) -> None:
    if not seeds_entry:  # the secrets file is written before the first checkpoint of a session
      seeds_entry.update(manager.keep_run_seeds(seeds.to_dict()))
    report = ledger.report()
    report_path = privacy_report.report_path(model_dir)
    # The report is written once the checkpoint it describes is committed, never before.
    manager.save(step, state, dict(metadata, seeds=dict(seeds_entry), ledger=ledger.to_dict(),
                                   privacy_report=report),
                 on_commit=(lambda: privacy_report.write_report(report_path, report)) if primary else None)

  def run_eval(step: int, params) -> Dict[str, float]:
    result = evaluate(trainer, params, validation_batches)
    writer.scalars("validation", step, {metrics_lib.NOT_DP_PREFIX + "loss": result["loss"],
                                        metrics_lib.NOT_DP_PREFIX + "token_accuracy": result["token_accuracy"]})
    log(f"[eval] step {step}: validation token accuracy {result['token_accuracy']:.4f}, "
        f"loss {result['loss']:.4f} ({int(result['examples'])} held-out examples"
        f"{', not DP' if not_dp else ''})")
    return result

  last_train: Dict[str, float] = {}
  last_eval: Optional[Dict[str, float]] = None
  t_start = time.time()
  examples_seen = 0.0
  rows_run = 0
  step = start_step
  first_step_time = None
  shapes_compiled = set()  # the compiled train-step shapes of this session (`StepBatch.shape`)
  # The batches of the next steps are built and placed while the device runs this one.
  builder = step_data.StepBatchBuilder(privacy=privacy, layout=layout, source=source, seeds=seeds, trainer=trainer,
                                       processes=config.data_workers)
  prefetcher = step_data.Prefetcher(builder, start_step, config.train_steps, config.prefetch_depth)
  try:
    while step < config.train_steps:
      if first_step_time is None:
        # The first step's time holds all that happens once: its batch, the compilation of the
        # step and of the logged step's evaluation, so that `steps_per_second` is the steady rate.
        t0 = time.time()
      data = prefetcher.get(step)
      if data.shape not in shapes_compiled:
        shapes_compiled.add(data.shape)
        if len(shapes_compiled) > 1:
          log(f"[train] step {step + 1}: a new compiled shape, {_shape_name(data.shape)} "
              f"({len(shapes_compiled)} this session)")
      real_rows = float(min(data.num_sampled, data.rows))
      rows_run += data.rows
      log_now = (step + 1) % config.log_every == 0 or step + 1 == config.train_steps or step == start_step
      # Accuracy before the update, like the loss the aggregator reports.
      batch_accuracy = _batch_accuracy(trainer, state.params, data) if log_now else None
      # One dispatch: the step (all its microbatches) is one compiled call; nothing is read back
      # from the device unless this step logs.
      if data.count is None:
        state, step_metrics = trainer.train_step(state, data.placed, dropout_key, noise_key)
      else:
        state, step_metrics = trainer.train_step_stacked(state, data.placed, data.count, dropout_key, noise_key)
      del data
      step += 1
      ledger.record_steps(1)
      examples_seen += real_rows
      printer.add_examples(real_rows)
      if first_step_time is None:
        jax.block_until_ready(state.step)
        first_step_time = time.time() - t0
        log(f"[train] first step (compilation included) took {first_step_time:.1f}s")
        printer.restart(step)  # rates and ETA from the steps after compilation
        bar.unpause()
      bar.update(1)
      if log_now:
        last_train = _log_train_step(step, step_metrics, batch_accuracy, ledger, writer, bar, printer, not_dp, log)
      if validation_batches and config.eval_every and step % config.eval_every == 0 and step < config.train_steps:
        last_eval = run_eval(step, state.params)
      if step % config.checkpoint_every == 0 or step == config.train_steps:
        save(step, state)
      else:
        manager.poll()  # the report of a finished background save; raises if it failed
  finally:
    prefetcher.close()
  bar.close()
  elapsed = time.time() - t_start
  if step == start_step and manager.latest_step() is None:  # nothing trained, nothing saved yet
    save(step, state)
  manager.wait()
  if validation_batches and step > start_step:  # (a finished run started again evaluates nothing)
    last_eval = run_eval(step, state.params)
  writer.close()
  _log_session(shapes_compiled, examples_seen, rows_run, not_dp, log)
  return _summary(model_dir, step, start_step, elapsed, first_step_time, examples_seen, rows_run, last_train,
                  last_eval, privacy, ledger, manager, writer, seeds)
