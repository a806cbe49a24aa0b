"""The training run: `train()` and the builders the other training runs share.

`train` checks every setting, builds the privacy mechanism (`dp.mechanism`), the trainer and the
checkpoint manager, runs the loop and writes the run's summary. It is plain Python: the
`private-t5 train` stage (`private_t5.stages.train`) binds it with Gin; fine-tuning, JFT and
adaptive DP call it with their own arguments. Re-running the same run resumes from the latest
checkpoint in MODEL_DIR.

`ExampleSource` is what a run reads from its training and validation data; `PrivacyHook` and
`PrivacyOverride` are how JFT and adaptive DP change the run once its DP mechanism is fixed.
"""
import dataclasses
import inspect
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Protocol, Sequence, Tuple

import jax

from private_t5 import io as io_lib
from private_t5.models import network
from private_t5.dp import config as dp_config
from private_t5.dp import mechanism as mechanism_lib
from private_t5.dp import privacy_report
from private_t5.dp.config import DPConfig
from private_t5.errors import CheckpointError, ConfigError
from private_t5.models import checkpoints, run_dir
from private_t5.models import config as config_lib
from private_t5.models import lora as lora_lib
from private_t5.tokenizer import public_declaration
from private_t5.train import initial_checkpoint as initial_lib
from private_t5.train import loop, metrics, optimizers, partitioning, step_data
from private_t5.models import sharding
from private_t5.train.state import RunSeeds
from private_t5.train.trainer import Trainer, make_loss_fn

if TYPE_CHECKING:
  from private_t5.dp.mechanism import Mechanism


class ExampleSource(Protocol):
  """The examples of a run, addressed by index in [0, num_examples) (training or validation).

  Conforming: `data.source.CorpusSource` (a token store under an objective),
  `data.glue_tasks.GlueSource` (GLUE splits) and `selective.adaptive.AdaptiveSource` (adds each
  row's privacy probability).
  """

  @property
  def num_examples(self) -> int:
    """N, the population DP sampling draws from."""

  @property
  def privacy_unit(self) -> str:
    """What one example is: "document", "example" or "user"."""

  @property
  def feature_lengths(self) -> Mapping[str, int]:
    """{"inputs": Li, "targets": Lt} of every batch."""

  @property
  def vocab_size(self) -> int:
    """Token ids the data uses, sentinels included; 0 when the source records no bound."""

  def get_batch(self, indices: Sequence[int], seed: int, batch_size: int) -> Dict[str, Any]:
    """The trainer's batch of `indices` padded to `batch_size` rows; `seed` draws objective noise."""

  def describe(self) -> Dict[str, Any]:
    """Public facts about the data (JSON-able) for fingerprints, metadata and reports."""


@dataclasses.dataclass(frozen=True)
class PrivacyOverride:
  """What another training entry point changes in a run once its DP mechanism is fixed.

  Attributes:
    mechanism: the `Mechanism` the run trains with.
    source: the training `ExampleSource` the loop reads.
    extra: JSON-able entries added to the checkpoint fingerprint's privacy entry and to the
      checkpoint metadata ("optimizer" also names the optimizer in the logs).
    summarize: `summarize(summary) -> dict` of entries added to the finished run's summary
      before it is written (summary.json is written once, complete); None: none.
  """
  mechanism: "Mechanism"
  source: ExampleSource
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  summarize: Optional[Callable[[dict], dict]] = None


class PrivacyHook(Protocol):
  """`train`'s privacy_hook: the run's override given the built mechanism and training data."""

  def __call__(self, mechanism: "Mechanism", train_data: ExampleSource) -> PrivacyOverride:
    ...


def _fingerprint_data(description: Mapping[str, Any]) -> dict:
  """The facts about the data a checkpoint depends on (not where its cache lies)."""
  keep = ("corpus", "vocab_sha256", "objective", "feature_lengths", "privacy_unit", "num_examples",
          "split", "validation_fraction")
  return {k: description.get(k) for k in keep}


# --- builders: the steps of `train`, shared with the other training entry points ---------------

def validate_train_args(*, model_config, train_data: ExampleSource, train_steps: int, batch_size: int, dp=None,
                        checkpoint_every: int = 1000, keep_checkpoints: int = 3, eval_every: int = 0,
                        eval_examples: int = 256, log_every: int = 50,
                        prefetch_depth: int = step_data.DEFAULT_PREFETCH_DEPTH,
                        data_workers: int = step_data.DEFAULT_DATA_WORKERS) -> None:
  """Checks every setting of a training run; raises ConfigError, creates nothing.

  A `DPConfig` checked its own values when it was made; the rules that need the data (batch
  sizes against N, the δ of a truncation) are checked once, when the mechanism is built
  (`dp.mechanism.build_mechanism`).
  """
  if not isinstance(model_config, config_lib.T5Config):
    raise ConfigError(f"model_config must be a T5Config (e.g. %MODEL_CONFIG), got {type(model_config).__name__}")
  for name, value, minimum in (("train_steps", train_steps, 1), ("batch_size", batch_size, 1),
                               ("checkpoint_every", checkpoint_every, 1), ("log_every", log_every, 1),
                               ("keep_checkpoints", keep_checkpoints, 1),
                               ("eval_every", eval_every, 0), ("eval_examples", eval_examples, 0),
                               ("prefetch_depth", prefetch_depth, 0), ("data_workers", data_workers, 0)):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
  vocab_size = train_data.vocab_size
  if vocab_size > model_config.vocab_size:
    raise ConfigError(f"the vocabulary has {vocab_size} ids (with sentinels) but the model's vocab_size is "
                      f"{model_config.vocab_size}; set --gin.VOCAB_SIZE={-(-vocab_size // 128) * 128}")
  if dp is not None and not isinstance(dp, DPConfig):
    raise ConfigError(f"dp must be a DPConfig (@DPConfig()) or None, got {type(dp).__name__}")
  if model_config.dtype == "float16":
    raise ConfigError("T5Config.dtype (ACTIVATION_DTYPE) 'float16' is not supported for training: T5's activations "
                      "overflow float16's range (max 65504) and the loss turns to inf/NaN; use 'bfloat16' (the same "
                      "memory, float32's range) or 'float32'")
  check_attention_backend(model_config)


def check_attention_backend(model_config) -> None:
  """ConfigError (one line) unless this process runs `model_config.attention`: 'cudnn' needs a GPU and
  a head dimension (`d_kv`) that cuDNN's fused kernel takes, a multiple of 8 up to 128 (256 from
  compute capability 9.0). Its dtypes are checked by `T5Config.validate` (bfloat16 or float16)."""
  if model_config.attention != "cudnn":
    return
  backend, d_kv = jax.default_backend(), model_config.d_kv
  if backend != "gpu":
    raise ConfigError(f"T5Config.attention 'cudnn' is NVIDIA's fused attention kernel and needs a GPU; this run's "
                      f"JAX backend is {backend!r}: use attention='xla' or 'einsum'")
  capability = str(getattr(jax.devices()[0], "compute_capability", "0.0"))
  max_head_dim = 256 if tuple(int(x) for x in capability.split(".")[:2]) >= (9, 0) else 128
  if d_kv % 8 or d_kv > max_head_dim:
    raise ConfigError(f"T5Config.attention 'cudnn': cuDNN's fused attention takes head dimensions that are multiples "
                      f"of 8 up to {max_head_dim} on this GPU (compute capability {capability}), but d_kv is {d_kv}: "
                      "use attention='xla' or 'einsum'")


def check_train_kwargs(kwargs: Mapping[str, Any], caller: str) -> None:
  """Refuses keyword arguments that `train` does not take (a typo in a Gin binding)."""
  unknown = sorted(set(kwargs) - set(inspect.signature(train).parameters))
  if unknown:
    raise ConfigError(f"{caller} passes unknown training argument(s) {', '.join(unknown)} to train "
                      f"(see private_t5.train.main.train)")


def build_mesh(mesh_shape: Sequence[int], batch_size: int, microbatch_size: Optional[int] = None,
               log: Callable[[str], None] = print):
  """The (data, model) device mesh; the batch and a microbatch must split evenly over its data
  axis (every global microbatch is spread over the data positions of all processes). A mesh
  that leaves devices idle is logged as a warning."""
  mesh = sharding.create_mesh(mesh_shape)
  if mesh.devices.size < len(jax.devices()):
    log(f"[train] WARNING: mesh_shape {tuple(mesh_shape)} uses {mesh.devices.size} of the {len(jax.devices())} "
        "devices; the others stay idle (mesh_shape=(-1, 1) uses them all)")
  sharding.check_batch_divisible(batch_size, mesh)
  if microbatch_size is not None and microbatch_size % mesh.shape[sharding.DATA_AXIS]:
    raise ConfigError(f"microbatch_size={microbatch_size} must be a multiple of the mesh's data axis "
                      f"({mesh.shape[sharding.DATA_AXIS]} devices): each microbatch is split over it")
  return mesh


def moved_paths(manager, train_data, lora) -> Tuple[str, ...]:
  """The fingerprint entries a resume need not match because they are paths to contents named by
  hash: a LoRA run's base (its SHA-256), a corpus whose token store has the checkpoint's digest."""
  moved = ("initial_checkpoint", "privacy.lora.base.path") if lora is not None else ()
  _, saved = manager.latest_metadata()
  digest = train_data.describe().get("tokens_sha256")
  if saved and digest and (saved.get("data") or {}).get("tokens_sha256") == digest:
    moved += ("data.corpus",)
  return moved


def resume_hints(dp, manager=None) -> Dict[str, str]:
  """What a refused resume says: a changed num_bands, named with its old and new value (`manager`'s
  latest checkpoint read); σ, calibrated from target_epsilon, that differs from the checkpoint's."""
  saved = manager.latest_metadata()[1] if manager is not None else None
  changed_bands = dp_config.num_bands_resume_hint(dp, ((saved or {}).get("fingerprint") or {}).get("privacy"))
  if changed_bands:
    return dict.fromkeys(dp_config.NUM_BANDS_ENTRIES, changed_bands)
  if dp is None or dp.noise_multiplier is not None or dp.target_epsilon is None:
    return {}
  return {"privacy.noise_multiplier": (
      f"σ was calibrated for target_epsilon={dp.target_epsilon:g} over the checkpoint run's own TRAIN_STEPS (and "
      "data and batch), so another TRAIN_STEPS gives another σ: to resume, keep the original TRAIN_STEPS; to "
      "extend the run, fix σ to the checkpoint's (--gin.DPConfig.noise_multiplier=<the checkpoint's σ> "
      "--gin.DPConfig.target_epsilon=None) with the new TRAIN_STEPS, and ε then grows past the target")}


def build_seeds(manager, insecure_deterministic_seed: Optional[int] = None):
  """The run's seeds: those its checkpoints continue (resume: MODEL_DIR/secrets/run_seeds.json, or
  the metadata of a checkpoint written before that file), else fresh (or the fixed test seed).

  A run directory has one root seed: a secrets file left by an earlier start that saved no
  checkpoint is used again, and refused (CheckpointError) when this run asks for another seed.
  With several processes the seeds of process 0 are sent to all the others before the first
  step, so that every process samples the same batches and draws the same noise key.
  """
  saved = checkpoints.saved_seeds(manager)
  if not saved:
    return RunSeeds.create(insecure_deterministic_seed).shared_across_processes()
  seeds = RunSeeds.from_dict(saved)
  if not manager.all_steps():  # the secrets file of an earlier start that saved no checkpoint
    asked = None if insecure_deterministic_seed is None else RunSeeds.create(insecure_deterministic_seed)
    if (asked is None) == seeds.deterministic or (asked is not None and asked != seeds):
      what = "a secret seed" if asked is None else "another fixed seed" if seeds.deterministic else "a fixed seed"
      raise CheckpointError(
          f"{run_dir.run_seeds_path(manager.model_dir)} holds the root seed of an earlier start of this run "
          f"(which saved no checkpoint) and this run asks for {what}: a run directory has one root seed; "
          "train into a fresh MODEL_DIR")
  return seeds.shared_across_processes()


def build_fingerprint(model_config, train_data, mechanism: Mapping[str, Any], extra: Mapping[str, Any],
                      initial_checkpoint: Optional[str]) -> dict:
  """What the checkpoints of a run belong to: a directory with another fingerprint is refused."""
  return {"model_config": config_lib.network_fields(model_config),
          "data": _fingerprint_data(train_data.describe()),
          "privacy": dict(mechanism, **extra),
          "initial_checkpoint": os.path.abspath(initial_checkpoint) if initial_checkpoint else None}


def build_optimizer(optimizer=None, learning_rate=None, lora=None):
  """(optimizer, schedule): default Adafactor with `learning_rate` (default the T5X rsqrt schedule).

  With `lora` the default Adafactor takes absolute steps (`multiply_by_parameter_scale=False`):
  T5's steps relative to a parameter's RMS would barely move LoRA's zero-initialised B (its scale
  is floored at 1e-3), so the adapters would stay at the base model.
  """
  if optimizer is not None:
    return optimizer, (learning_rate if callable(learning_rate) else None)
  lr = optimizers.rsqrt_schedule(base_learning_rate=0.5, warmup_steps=1000) if learning_rate is None else learning_rate
  return optimizers.adafactor(lr, multiply_by_parameter_scale=lora is None), (lr if callable(lr) else None)


def build_metadata(*, model_config, train_data, vocab_path: Optional[str], num_params: int, batch_size: int,
                   extra: Mapping[str, Any], initial_checkpoint: Optional[str] = None) -> dict:
  """The JSON metadata stored with every checkpoint (what inference needs to rebuild the model)."""
  metadata = {"model_config": dataclasses.asdict(model_config),
              "vocab_path": os.path.abspath(vocab_path) if vocab_path else None,
              "feature_lengths": dict(train_data.feature_lengths), "data": train_data.describe(),
              "num_params": num_params, "batch_size": batch_size, **extra}
  if initial_checkpoint:
    metadata["initial_checkpoint"] = initial_lib.describe_initial_checkpoint(initial_checkpoint)
  return metadata


@dataclasses.dataclass(frozen=True)
class LoraBase:
  """The frozen base of a LoRA run: its parameters and the `lora` record of its checkpoints."""
  params: Any
  record: Dict[str, Any]


def build_lora(lora, initial_checkpoint: Optional[str], model_config) -> Optional[LoraBase]:
  """The base weights a LoRA run adapts (None without `lora`), read once and hashed.

  The hash goes into the fingerprint and the metadata of every checkpoint: a resumed run, an
  evaluation or an export refuses a base whose weights changed.
  """
  if lora is None:
    return None
  if not isinstance(lora, lora_lib.LoraConfig):
    raise ConfigError(f"lora must be a LoraConfig (@LoraConfig()) or None, got {type(lora).__name__}")
  if not initial_checkpoint:
    raise ConfigError("LoRA adapts pretrained weights: set INITIAL_CHECKPOINT (--initial_checkpoint, "
                      "train.initial_checkpoint), the LoRA base checkpoint")
  lora.check_fits(model_config)
  params = initial_lib.load_initial_params(initial_checkpoint, model_config)
  record = lora_lib.base_record(os.path.abspath(initial_checkpoint), lora_lib.params_sha256(params), lora)
  return LoraBase(params, record)


def clipping_method_for(model_config, dp, clipping_method: Optional[str], log) -> Optional[str]:
  """`clipping_method`, or "vmap" for a DP run of a rematerialised unrolled network that names none:
  ghost clipping records each layer's inputs and output gradients outside the layer, which
  `remat_policy` keeps inside it unless the layers are scanned (`scan_layers`, whose stacks hand
  them out); refused when asked for by name."""
  if dp is None or model_config.remat_policy == "none" or model_config.scan_layers:
    return clipping_method
  chosen = clipping_method or dp.method
  if chosen == dp_config.GHOST:
    raise ConfigError(f"clipping_method='ghost' does not run inside remat_policy={model_config.remat_policy!r} "
                      "of an unrolled network; set T5Config.scan_layers=True with it, or clipping_method='vmap'")
  if chosen is None:
    log(f"[train] remat_policy={model_config.remat_policy!r} without scan_layers: the DP clipped sum is computed "
        "by 'vmap' (per-example gradients); ghost clipping runs inside remat with scan_layers=True")
    return "vmap"
  return clipping_method


def initial_params_loader(initial_checkpoint: Optional[str], model_config) -> Optional[Callable]:
  """A function returning the fine-tuning start parameters, or None (random init)."""
  if not initial_checkpoint:
    return None
  return lambda: initial_lib.load_initial_params(initial_checkpoint, model_config)


def describe_run(model_config, mesh, parameter_sharding: str, train_data, batch_size: int,
                 optimizer_name: str) -> str:
  """The one-line summary logged when a run starts."""
  return (f"[train] model: {network.num_params(model_config) / 1e6:.2f}M parameters, mesh {dict(mesh.shape)} "
          f"({parameter_sharding.replace('_', '-')} parameters) on "
          f"{len(jax.devices())} {jax.devices()[0].platform} device(s); data: {train_data.num_examples} "
          f"examples ({train_data.privacy_unit} unit), batch {batch_size}; {optimizer_name}")


def _kept_validation(kept_path: str, summary: Dict[str, Any]) -> Dict[str, Any]:
  """The validation figures the kept summary.json of a finished run recorded at its final step, for
  the summary returned when it is started again (which evaluates nothing)."""
  try:
    with open(kept_path, encoding="utf-8") as f:
      kept = json.load(f)
  except (OSError, ValueError):
    return {}
  if not isinstance(kept, dict) or kept.get("final_step") != summary["final_step"]:
    return {}
  keys = (metrics.validation_key(private) for private in (False, True))
  return {k: kept[k] for k in keys if k in summary and summary[k] is None and kept.get(k) is not None}


def train(*, model_config, train_data: ExampleSource, validation_data: Optional[ExampleSource] = None,
          model_dir: str, train_steps: int,
          batch_size: int, microbatch_size: Optional[int] = None, clipping_method: Optional[str] = None,
          ghost_stack_layers: bool = False, ghost_clipped_sum: str = "bookkeeping", optimizer=None, learning_rate=None, dp=None, vocab_path: Optional[str] = None,
          vocab_public_unchecked: bool = False, checkpoint_every: int = 1000,
          keep_checkpoints: int = 3, eval_every: int = 0, eval_examples: int = 256, log_every: int = 50,
          mesh_shape: Sequence[int] = (-1, 1), parameter_sharding: str = sharding.REPLICATED,
          z_loss: float = 0.0, initial_checkpoint: Optional[str] = None, insecure_deterministic_seed: Optional[int] = None,
          log: Callable[[str], None] = print, privacy_hook: Optional[PrivacyHook] = None,
          operative_config: Optional[Callable[[], str]] = None,
          lora: Optional[lora_lib.LoraConfig] = None, prefetch_depth: int = step_data.DEFAULT_PREFETCH_DEPTH,
          data_workers: int = step_data.DEFAULT_DATA_WORKERS) -> dict:
  """Trains `model_config` on `train_data`; returns the summary also written to summary.json.

  Every setting is checked before anything is written to `model_dir`; what only the built
  mechanism can refuse (the privacy rules that need the data, an unreachable target ε) leaves
  nothing behind.

  Args:
    model_config: a `models.T5Config` (Gin: `%MODEL_CONFIG`).
    train_data: the training `ExampleSource` (Gin: `@training/make_source()`).
    validation_data: held-out `ExampleSource` for the periodic teacher-forced evaluation.
    model_dir: where checkpoints, config.gin, TensorBoard files and reports go.
    train_steps: total optimizer steps (a resumed run continues up to it).
    batch_size: rows of every batch (the padded size; for DP the Poisson truncation cap).
    microbatch_size: examples per accumulation step (memory knob; the trainer's accumulate loop).
    clipping_method: how the DP clipped sum is computed, "ghost" (default) or "vmap" (speed
      only: the same mechanism and ledger; `dp.mechanism.ExecutionSettings`).
    ghost_stack_layers: ghost clipping with the layers of one shape stacked (fewer kernel
      launches on an accelerator, more memory; `ExecutionSettings.stack_layers`).
    ghost_clipped_sum: "bookkeeping" (default) or "layerwise" (ghost clipping in two forward and
      backward passes: with full remat a fraction of book-keeping's memory; float32 activations
      only; `ExecutionSettings.ghost_clipped_sum`).
    optimizer: optax GradientTransformation; default Adafactor with `learning_rate`.
    learning_rate: schedule or float for the default Adafactor; default T5X rsqrt with base 0.5, 1000 warm-up steps.
    dp: `DPConfig` for DP-Adafactor, or None for the non-private baseline.
    vocab_path: the SentencePiece model (recorded for inference; a DP-SentencePiece privacy
      report beside it is composed into the ledger).
    vocab_public_unchecked: accept a DP-SentencePiece vocabulary declared public
      (`DPConfig.vocab_is_public`) where whether this run trains on documents it was built from
      cannot be checked (`tokenizer.public_declaration`; Gin `VOCAB_PUBLIC_UNCHECKED`): logged,
      and said in the vocabulary's record.
    checkpoint_every, keep_checkpoints: checkpoint every N steps, keep the last K.
    eval_every, eval_examples: validation every N steps (0: only at the end) on K examples.
    log_every: console/TensorBoard progress every N steps.
    mesh_shape: (data, model) mesh; -1 takes the remaining devices.
    parameter_sharding: "replicated" (each position of the data axis holds the whole
      parameters and optimizer state, split over `model` only) or "fully_sharded" (also split
      over `data`, ZeRO-3 / FSDP: about 1/D of them per device on a (D, 1) mesh);
      `train.partitioning.axis_rules`. A run may resume with another mesh or sharding.
    z_loss: auxiliary log(Z)^2 coefficient of the loss.
    initial_checkpoint: start from these parameters instead of a random init (fine-tuning): a
      private_t5 MODEL_DIR or imported weights (`train.initial_checkpoint`); the optimizer
      state and the privacy ledger start fresh. Ignored when MODEL_DIR already has a checkpoint.
    insecure_deterministic_seed: fix every seed (init, dropout, DP noise, sampling) for tests
      and reproductions. INSECURE for DP: the noise is then predictable (and config.gin names the
      seed). Default: OS entropy. Either way the root seed is kept in
      MODEL_DIR/secrets/run_seeds.json, private, which a resumed run reads.
    log: progress output.
    privacy_hook: for other training entry points (JFT, adaptive DP), not a Gin knob: a
      `PrivacyHook`, called once the DP mechanism is built, whose `PrivacyOverride` gives the
      mechanism and training source the run uses, the entries added to its fingerprint and
      metadata, and those added to its summary.
    operative_config: returns the text of the run's configuration, written to
      MODEL_DIR/config.gin by process 0 once the mechanism is fixed (the training stages pass
      Gin's operative config); None: no config.gin is written.
    lora: a `models.lora.LoraConfig` (Gin: `@LoraConfig()`): train only low-rank adapters on
      the frozen weights of `initial_checkpoint` (required). Checkpoints hold the adapters and
      their optimizer state; the base is referenced by path and SHA-256 (`build_lora`).
    prefetch_depth: steps whose batches are built and placed on the devices ahead, while the
      device runs the current step (0: each built in line); speed only (`train.step_data`).
    data_workers: worker processes building the batches' host rows (`train.worker_pool`: whole
      steps each, without JAX, handed back in shared memory; the batches do not change with
      their number); 0: built by a thread of this process. Speed only.
  """

  validate_train_args(model_config=model_config, train_data=train_data, train_steps=train_steps,
                      batch_size=batch_size, dp=dp, checkpoint_every=checkpoint_every,
                      keep_checkpoints=keep_checkpoints, eval_every=eval_every, eval_examples=eval_examples,
                      log_every=log_every, prefetch_depth=prefetch_depth, data_workers=data_workers)
  rules, base, execution, layout, mesh = _execution_plan(
      model_config, dp, parameter_sharding, lora, initial_checkpoint, clipping_method, microbatch_size,
      ghost_stack_layers, ghost_clipped_sum, batch_size, insecure_deterministic_seed, mesh_shape, log)
  manager = checkpoints.CheckpointManager(model_dir, keep=keep_checkpoints)
  failed = True  # until the loop returns: a run that fails before its first save leaves nothing
  try:
    seeds = build_seeds(manager, insecure_deterministic_seed)
    override, extra = _checked_mechanism(
        dp, execution, model_config, z_loss, lora, base, train_data, batch_size, train_steps, seeds, vocab_path,
        vocab_public_unchecked, mesh, privacy_hook, initial_checkpoint, manager, log)
    setup, source = override.mechanism, override.source
    finished_before = (manager.latest_step() or 0) >= train_steps  # started again: its config.gin is kept
    if operative_config is not None and partitioning.is_primary() and not finished_before:
      io_lib.write_text_atomic(run_dir.config_path(model_dir), operative_config())
    trainer, num_params, metadata = _built_trainer(
        model_config, setup, extra, optimizer, learning_rate, lora, base, mesh, rules, parameter_sharding,
        train_data, batch_size, vocab_path, initial_checkpoint, log)
    summary = loop.run(
        trainer=trainer, privacy=setup, layout=layout, source=source, validation_source=validation_data,
        seeds=seeds, manager=manager,
        config=loop.LoopConfig(model_dir=model_dir, train_steps=train_steps, checkpoint_every=checkpoint_every,
                               eval_every=eval_every, eval_examples=eval_examples, log_every=log_every,
                               prefetch_depth=prefetch_depth, data_workers=data_workers),
        metadata=metadata, log=log,
        initial_params_fn=None if lora is not None else initial_params_loader(initial_checkpoint, model_config))
    failed = False
  finally:
    manager.close(discard_if_unused=failed)
  return _completed_summary(summary, model_dir, num_params, metadata, operative_config, override, extra, lora,
                            base, log)


def _execution_plan(model_config, dp, parameter_sharding: str, lora, initial_checkpoint: Optional[str],
                    clipping_method: Optional[str], microbatch_size: Optional[int], ghost_stack_layers: bool,
                    ghost_clipped_sum: str, batch_size: int, insecure_deterministic_seed: Optional[int],
                    mesh_shape: Sequence[int], log: Callable[[str], None]):
  """(axis rules, LoRA base, execution settings, batch layout, mesh) of a run, before anything is written."""
  rules = sharding.axis_rules(parameter_sharding)
  base = build_lora(lora, initial_checkpoint, model_config)
  clipping_method = clipping_method_for(model_config, dp, clipping_method, log)
  execution = dp_config.ExecutionSettings.for_run(dp, clipping_method, microbatch_size, log,
                                                      stack_layers=ghost_stack_layers,
                                                      ghost_clipped_sum=ghost_clipped_sum)
  layout = dp_config.BatchLayout.for_run(dp, execution, batch_size)
  if insecure_deterministic_seed is not None:
    log("[train] WARNING: insecure_deterministic_seed is set: noise and sampling are predictable "
        "(tests and reproductions only; the DP guarantee does not hold)")
  mesh = build_mesh(mesh_shape, batch_size, execution.microbatch_size, log)
  return rules, base, execution, layout, mesh


def _checked_mechanism(dp, execution, model_config, z_loss: float, lora, base, train_data: ExampleSource,
                       batch_size: int, train_steps: int, seeds: RunSeeds, vocab_path: Optional[str],
                       vocab_public_unchecked: bool, mesh, privacy_hook: Optional[PrivacyHook],
                       initial_checkpoint: Optional[str], manager,
                       log: Callable[[str], None]) -> Tuple[PrivacyOverride, Mapping[str, Any]]:
  """Builds the run's mechanism and checks MODEL_DIR's checkpoints against its fingerprint: (override, extra)."""
  described = train_data.describe()
  # A vocabulary declared public is checked against the training documents by content first.
  declaration = public_declaration.check_declaration(dp, vocab_path, train_data,
                                                     allow_unchecked=vocab_public_unchecked, log=log)
  setup = mechanism_lib.build_mechanism(
      declaration.dp, execution, loss_fn=make_loss_fn(model_config, z_loss, lora), num_examples=train_data.num_examples,
      privacy_unit=train_data.privacy_unit, batch_size=batch_size, train_steps=train_steps,
      sampler_seed=seeds.sampler_seed, vocab_path=vocab_path,
      spmd_axis_name=sharding.DATA_AXIS if mesh.shape[sharding.DATA_AXIS] > 1 else None,
      noise_secret=not seeds.deterministic, population=described.get("population"),
      corpus=described.get("corpus"), data_files=described.get("data_files"),
      unknown_files=described.get("data_files_unknown"), log=log)
  declaration.confirm(setup.ledger)
  mechanism = setup.fingerprint()
  override = (PrivacyOverride(mechanism=setup, source=train_data) if privacy_hook is None
              else privacy_hook(setup, train_data))
  extra = override.extra
  if lora is not None:
    extra = dict(extra, lora=base.record)
  fingerprint = build_fingerprint(model_config, train_data, mechanism, extra, initial_checkpoint)
  manager.fingerprint = fingerprint
  manager.check_compatible(fingerprint, hints=resume_hints(dp, manager), ignore=moved_paths(manager, train_data, lora))
  return override, extra


def _built_trainer(model_config, setup, extra: Mapping[str, Any], optimizer, learning_rate, lora, base, mesh,
                   rules, parameter_sharding: str, train_data: ExampleSource, batch_size: int,
                   vocab_path: Optional[str], initial_checkpoint: Optional[str], log: Callable[[str], None]):
  """Builds the trainer and the checkpoints' metadata and logs the run's description: (trainer, params, metadata)."""
  optimizer, schedule = build_optimizer(optimizer, learning_rate, lora)
  trainer = Trainer(model_config, setup.clipped_sum, optimizer, mesh, learning_rate_fn=schedule, rules=rules,
                    lora=lora, base_params=None if lora is None else base.params, noise=setup.noise)
  num_params = trainer.num_trainable_params()
  log(describe_run(model_config, mesh, parameter_sharding, train_data, batch_size,
                   extra.get("optimizer") or ("DP-Adafactor" if setup.private else "non-private Adafactor")))
  metadata = build_metadata(model_config=model_config, train_data=train_data, vocab_path=vocab_path,
                            num_params=num_params, batch_size=batch_size, extra=extra,
                            initial_checkpoint=initial_checkpoint)
  if lora is not None:
    log(f"[train] LoRA (rank {lora.rank}, alpha {lora.alpha:g}, on {', '.join(lora.targets)}): {num_params} "
        f"trainable adapter parameters on the frozen {initial_checkpoint} (sha256 {base.record['base']['sha256'][:12]})")
  elif initial_checkpoint:
    log(f"[train] initial parameters from {initial_checkpoint} (used unless MODEL_DIR has a checkpoint)")
  return trainer, num_params, metadata


def _completed_summary(summary: dict, model_dir: str, num_params: int, metadata: Mapping[str, Any],
                       operative_config: Optional[Callable[[], str]], override: PrivacyOverride,
                       extra: Mapping[str, Any], lora, base, log: Callable[[str], None]) -> dict:
  """Completes the loop's summary, writes it to summary.json (process 0) and logs where the run's files are."""
  setup = override.mechanism
  summary.update(num_params=num_params, model_config=metadata["model_config"], vocab_path=metadata["vocab_path"],
                 config_gin=(os.path.abspath(run_dir.config_path(model_dir)) if operative_config is not None
                             else None),
                 noise_multiplier=setup.noise_multiplier)
  if lora is not None:
    summary["lora"] = base.record
  if override.summarize is not None:
    summary.update(override.summarize(summary))
  kept_path = privacy_report.summary_path(model_dir)
  finished = summary["steps_this_run"] == 0 and os.path.isfile(kept_path)
  if finished:  # a finished run started again: its summary (throughput, metrics) is kept
    log(f"[train] the run was already at step {summary['final_step']}: nothing trained, {kept_path} kept")
    summary.update(_kept_validation(kept_path, summary))
  elif partitioning.is_primary():
    privacy_report.write_summary(model_dir, summary)
  print_final(summary, setup.ledger, log, extra.get("optimizer"))
  return summary


def print_final(summary: dict, ledger, log, optimizer_name: Optional[str] = None) -> None:
  """Logs where a finished run's files are and its privacy guarantee."""
  log(f"[train] done: step {summary['final_step']} in {summary['model_dir']}")
  log(f"  checkpoints:    {summary['checkpoint_dir']}")
  if os.path.isfile(run_dir.run_seeds_path(summary["model_dir"])):
    log(f"  secrets:        {run_dir.secrets_dir(summary['model_dir'])} (the root seed: private, never publish; "
        "publish the output of private-t5 export)")
  if summary.get("config_gin"):
    log(f"  config:         {summary['config_gin']}")
  log(f"  tensorboard:    {summary['tensorboard_dir']}")
  log(f"  summary:        {privacy_report.summary_path(summary['model_dir'])}")
  log(f"  privacy report: {summary['privacy_report']}")
  if summary.get("real_row_fraction") is not None:
    log(f"  real rows:      {100.0 * summary['real_row_fraction']:.1f}% of the rows computed (the rest padding)"
        f"{' (not DP)' if summary['private'] else ''}")
  validation = summary.get("validation_not_dp") or summary.get("validation")
  if validation:
    label = " (held-out private documents, not DP)" if summary.get("validation_not_dp") else ""
    log(f"  validation token accuracy: {validation['token_accuracy']:.4f}{label}")
  if summary["private"]:
    vocabulary = {"dp": "DP vocabulary included", "public": "vocabulary declared public, not counted",
                  "not private": "vocabulary NOT private"}.get(ledger.vocabulary_status(), "no vocabulary")
    training = (f"DP-Adafactor ε = {ledger.training_epsilon():.4g} at δ = {ledger.training_delta():.3g} "
                f"({ledger.privacy_unit}-level, {(ledger.accountant_used() or ledger.accountant).upper()}, σ = {ledger.noise_multiplier:.4g}, "
                f"q = {ledger.sampling_rate:.4g}, {ledger.steps} steps)")
    if summary["epsilon"] is None and ledger.vocabulary_status() == "not private":
      log(f"  privacy: ε = ∞ ({vocabulary}: no DP-SentencePiece report names it; run dp-spm or set "
          f"VOCAB_IS_PUBLIC=True if it was built without the private data); {training}")
    elif summary["epsilon"] is None:
      log(f"  privacy: ε = ∞ ({vocabulary}; see the warning below); {training}")
    else:
      log(f"  privacy: ε = {summary['epsilon']:.4g} at δ = {summary['delta']:.3g} ({vocabulary}); {training}")
      if ledger.composition():
        log(f"  ε composed {ledger.composition()}")
    for line in ledger.warnings():
      log(f"  WARNING: {line}")
  elif optimizer_name:
    log(f"  privacy: {optimizer_name}: no formal DP guarantee (the ledger records ε = ∞)")
  else:
    log("  privacy: NON-PRIVATE baseline (ε = ∞)")
