"""The jit-compiled train step: accumulate, finish, noise, Adafactor.

A step is plain functions of the run's mechanism (`dp.mechanism.Mechanism`), in the shape of
T5X's `accumulate_grads_microbatched` / `apply_grads`:

  acc = clipped_sum.zero_sum(params)
  acc = clipped_sum.accumulate(params, acc, microbatch, dropout_rng)   # once per microbatch
  grads, metrics = clipped_sum.finish(params, acc)                     # the sum / q N (DP) or the mean
  grads, noise_state = noise.update(grads, noise_state, params, noise_rng=noise_rng)  # once per step
  updates, opt_state = optimizer.update(grads, opt_state, params)      # Adafactor

A non-private run is the same step with `MeanAggregator` and `noise.no_noise()`; DP-Adafactor
(Ponomareva et al. 2022, Sec. 3.2) has `DPAggregator` (per-example clip, sum, divide by the
public q N) or its ghost variant and `noise.noise_transform`. The noise transform is an optax
transform (it chains in front of Adafactor); the trainer applies it and the optimizer in turn so
that the optimizer state holds Adafactor's state alone, and the noise transform's own state is
`TrainState.noise_state`: made once by `noise.init(params)` with the train state, threaded
through every step, sharded like the parameters it follows (`partitioning.noise_state_shardings`),
donated with the rest of the state and saved in every checkpoint (a correlated-noise mechanism's
noise history: DP rule "correlated noise is a state"). Its floating arrays are float32 whatever
the activation dtype, and each step's new state keeps the dtypes of the one it replaces. The
stateless transforms (Gaussian, none) have an empty state, which adds nothing to a checkpoint.

Microbatching is an execution setting: a step's n rows (an untruncated Poisson sample of any
size, or a fixed batch larger than the microbatch size) run as k = ceil(n / m) microbatches of m
rows. The training loop runs them in ONE compiled call, `train_step_stacked` (as T5X's
`accumulate_grads_microbatched`): the microbatches stacked on a leading axis padded to a bucket
of K >= k (`microbatch_bucket`: a power of two, so a run compiles a few shapes), a device loop
over the first k of them (the padding microbatches are never computed), then finish, the noise
once with the step's key, Adafactor. `train.host_microbatches` runs the same functions as k
host-dispatched calls of a compiled accumulate step and one finalize call: the reference the
one-dispatch step is tested against (same order of summation), and what the benchmarks time
microbatch by microbatch. Without microbatching, `train_step` is one fused compiled call of the
same functions.

LoRA (`models.lora`): with `lora` set the state's params are the adapters only (what the
optimizer updates, the clipped sum clips, the noise and its state cover, and checkpoints
store); the frozen base weights are held by the trainer and passed to every compiled step as a
separate argument, never differentiated, donated or updated. The clipped sum's `loss_fn(adapters, batch,
dropout_rng, base)` is bound to them (`functools.partial(..., base=...)`) inside each step.

Keys: the dropout and noise keys of step t are `fold_in(base_key, t)` with t = `state.step`,
derived inside the compiled step, so a resumed run continues the key sequence.
"""
import contextlib
import copy
import functools
import warnings
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from private_t5 import tree_groups
from private_t5.models import config
from private_t5.models import model as model_lib
from private_t5.dp import noise as noise_lib
from private_t5.errors import ConfigError
from private_t5.models import lora as lora_lib
from private_t5.models import network
from private_t5.train import host_microbatches, optimizers, partitioning
from private_t5.models import sharding
from private_t5.train.state import TrainState, step_keys

PyTree = Any
# Host-side bookkeeping columns of a batch that the compiled step does not read.
HOST_ONLY_FEATURES = ("example_index", "is_padding")
# (float32 gradient sum, non-DP sums) of the microbatches of one step so far.
Accumulator = Tuple[PyTree, Dict[str, jax.Array]]


class ClippedSum(Protocol):
  """A step's gradient from its rows, microbatch by microbatch (`dp.aggregator.MeanAggregator`,
  `DPAggregator`, `ghost.GhostDPAggregator`, adaptive DP's wrapper)."""

  def zero_sum(self, params: PyTree) -> Accumulator:
    ...

  def accumulate(self, params: PyTree, acc: Accumulator, micro, dropout_rng: Optional[jax.Array]
                 ) -> Accumulator:
    ...

  def finish(self, params: PyTree, acc: Accumulator) -> Tuple[PyTree, Dict[str, jax.Array]]:
    ...


def make_loss_fn(model_config: config.T5Config, z_loss: float = 0.0,
                 lora: Optional[lora_lib.LoraConfig] = None) -> Callable:
  """`loss_fn(params, batch, dropout_rng) -> loss[B]`, the aggregators' per-example loss
  (`EncoderDecoderModel(model_config, z_loss).per_example_loss`).

  With `lora`: `loss_fn(adapters, batch, dropout_rng, base) -> loss[B]` of the network with
  adapters on the frozen `base` (the trainer binds `base` in each compiled step).
  """
  if lora is None:
    return model_lib.EncoderDecoderModel(model_config, z_loss).per_example_loss
  model = model_lib.EncoderDecoderModel(model_config, z_loss, lora)
  return lambda adapters, batch, dropout_rng=None, base=None: model.per_example_loss(
      lora_lib.combine(base, adapters), batch, dropout_rng)


def device_features(batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
  """The columns of a host batch that go to the devices."""
  return {k: v for k, v in batch.items() if k not in HOST_ONLY_FEATURES}


class Trainer:
  """Holds the compiled train and eval steps of one model on one mesh.

  Attributes:
    model_config: the T5Config.
    aggregator: the `ClippedSum` (e.g. the `clipped_sum` of a `dp.mechanism.Mechanism`).
    optimizer: an optax GradientTransformation (Adafactor).
    noise: the noise transform (`dp.noise.noise_transform`, `no_noise`; the mechanism's `noise`);
      None: the one that matches `aggregator` (`dp.noise.transform_for`).
    mesh: the (data, model) device mesh.
    learning_rate_fn: optional schedule, logged as `learning_rate`.
    rules: the logical-axis rules of the parameters (`partitioning.axis_rules`: replicated over
      `data`, or fully sharded); the optimizer state follows the parameters.
    lora: a `models.lora.LoraConfig` to train adapters on the frozen `base_params`, or None.
  """

  def __init__(self, model_config: config.T5Config, aggregator: ClippedSum,
               optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh,
               learning_rate_fn: Optional[Callable] = None,
               rules=sharding.LOGICAL_AXIS_RULES, *, lora: Optional[lora_lib.LoraConfig] = None,
               base_params: Optional[PyTree] = None,
               noise: Optional[optax.GradientTransformationExtraArgs] = None):
    self.model_config = model_config
    self.lora = lora
    self.model = model_lib.EncoderDecoderModel(model_config, lora=lora)
    self.aggregator = aggregator
    self.noise = noise if noise is not None else noise_lib.transform_for(aggregator)
    if model_config.scan_layers:  # the noise of the unrolled network, drawn leaf by leaf (the same run)
      self.noise = optimizers.unrolled(self.noise)
    self.optimizer = optimizers.per_layer(optimizer) if model_config.scan_layers else optimizer
    self.mesh = mesh
    self.learning_rate_fn = learning_rate_fn
    self.use_dropout = model_config.dropout_rate > 0 or (lora is not None and lora.dropout > 0)
    base_shardings = sharding.param_shardings(
        network.param_logical_axes(model_config), network.param_shapes(model_config), mesh, rules)
    self._replicated = sharding.replicated(mesh)
    if lora is None:
      self.param_shardings, self._base, self._base_shardings = base_shardings, None, None
    else:
      if base_params is None or not hasattr(aggregator, "loss_fn"):
        raise ConfigError("LoRA training needs the base parameters and an aggregator with a loss_fn")
      axes = network.adapter_logical_axes(model_config, lora)
      shapes = jax.eval_shape(functools.partial(network.init_adapters, model_config, lora), jax.random.PRNGKey(0))
      self.param_shardings = sharding.param_shardings(axes, shapes, mesh, rules)
      self._base_shardings = base_shardings
      with self._mesh_context():
        self._base = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x, np.float32), s),
                                  network.to_layout(base_params, model_config.scan_layers), base_shardings)
    self._batch_sharding = sharding.batch_sharding(mesh)
    abstract = jax.eval_shape(self._init_fn, jax.random.PRNGKey(0))
    # Each moment is sharded like its parameter (Adafactor's factored ones like the kept dimensions).
    # The noise transform's state likewise (each array like the parameter it belongs to).
    self.state_shardings = TrainState(
        step=self._replicated, params=self.param_shardings,
        opt_state=partitioning.optimizer_state_shardings(self.optimizer, abstract.opt_state, abstract.params,
                                                         self.param_shardings, mesh),
        noise_state=partitioning.noise_state_shardings(abstract.noise_state, abstract.params,
                                                       self.param_shardings, mesh))
    self._abstract = abstract
    self._init = jax.jit(self._init_fn, out_shardings=self.state_shardings)
    self._init_from = jax.jit(self._init_from_params_fn, in_shardings=(self.param_shardings,),
                              out_shardings=self.state_shardings)
    base = self._base_shardings
    self._train_step = jax.jit(
        self._train_step_fn,
        in_shardings=(self.state_shardings, base, self._batch_sharding, self._replicated, self._replicated),
        out_shardings=(self.state_shardings, self._replicated),
        donate_argnums=(0,))
    # A step's microbatches in one program: stacked [K, m, ...], a device loop over the first `count`.
    self._stacked_sharding = partitioning.stacked_batch_sharding(mesh)
    self._train_step_stacked = jax.jit(
        self._stacked_step_fn,
        in_shardings=(self.state_shardings, base, self._stacked_sharding, self._replicated, self._replicated,
                      self._replicated),
        out_shardings=(self.state_shardings, self._replicated),
        donate_argnums=(0,))
    self._eval_step = jax.jit(
        self._eval_step_fn, in_shardings=(self.param_shardings, base, self._batch_sharding),
        out_shardings=self._replicated)

  # -- pure functions (traced under jit) --------------------------------------------------------

  def _init_fn(self, rng: jax.Array) -> TrainState:
    params = (network.init_params(self.model_config, rng) if self.lora is None
              else network.init_adapters(self.model_config, self.lora, rng))
    return self._init_from_params_fn(params)

  def _init_from_params_fn(self, params) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params),
                      noise_state=_float32(self.noise.init(params)))

  def _bound(self, base) -> ClippedSum:
    """The clipped sum, its loss bound to the frozen LoRA `base` (itself without LoRA)."""
    if self.lora is None:
      return self.aggregator
    bound = copy.copy(self.aggregator)
    bound.loss_fn = functools.partial(self.aggregator.loss_fn, base=base)
    return bound

  def model_params(self, params: PyTree, base=None) -> PyTree:
    """The parameters `self.model` runs on: `params`, or with LoRA the base plus the adapters."""
    if self.lora is None:
      return params
    return lora_lib.combine(self._base if base is None else base, params)

  def _dropout(self, key: jax.Array) -> Optional[jax.Array]:
    return key if self.use_dropout else None

  def _train_step_fn(self, state: TrainState, base, batch, dropout_base_key, noise_base_key):
    """The fused step: the batch is the step's one microbatch."""
    dropout_rng, _ = step_keys(dropout_base_key, noise_base_key, state.step)
    clipped_sum = self._bound(base)
    acc = clipped_sum.accumulate(state.params, clipped_sum.zero_sum(state.params), batch,
                                 self._dropout(dropout_rng))
    return self._apply_fn(state, base, acc, noise_base_key)

  def _stacked_step_fn(self, state: TrainState, base, stacked, count, dropout_base_key, noise_base_key):
    """The step of `count` microbatches stacked in `stacked` ([K, m, ...], K >= count): each
    accumulated in turn (the order of summation of `train.host_microbatches`), then `_apply_fn`."""
    dropout_rng = self._dropout(jax.random.fold_in(dropout_base_key, state.step))  # = step_keys(...)[0]
    clipped_sum = self._bound(base)

    # The loop carries the sums stacked by shape (`tree_groups.stacked`): a microbatch adds its
    # sums into one array a shape, one kernel each instead of one a parameter array.
    zero = clipped_sum.zero_sum(state.params)

    def body(i, carry):
      micro = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), stacked)
      acc = clipped_sum.accumulate(state.params, (tree_groups.unstacked(carry[0], zero[0]), carry[1]),
                                   micro, dropout_rng)
      return tree_groups.stacked(acc[0]), acc[1]

    carry = jax.lax.fori_loop(0, count, body, (tree_groups.stacked(zero[0]), zero[1]))
    acc = tree_groups.unstacked(carry[0], zero[0]), carry[1]
    return self._apply_fn(state, base, acc, noise_base_key)

  def _apply_fn(self, state: TrainState, base, acc, noise_base_key):
    """finish, noise (once, with the step's key), Adafactor."""
    noise_rng = jax.random.fold_in(noise_base_key, state.step)  # = step_keys(...)[1]
    grads, metrics = self._bound(base).finish(state.params, acc)
    grads, noise_state = noise_lib.apply_with_state(self.noise, grads, metrics, state.params, state.noise_state,
                                                    noise_rng)
    # The state keeps its dtypes (float32) and structure from step to step.
    noise_state = jax.tree.map(lambda new, old: new.astype(old.dtype), noise_state, state.noise_state)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics)
    metrics["grad_norm_after_aggregation"] = tree_groups.norm(grads)
    if self.learning_rate_fn is not None:
      metrics["learning_rate"] = jnp.asarray(self.learning_rate_fn(state.step), jnp.float32)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, noise_state=noise_state), metrics

  def _eval_step_fn(self, params, base, batch) -> Dict[str, jax.Array]:
    return self.model.eval_metrics(self.model_params(params, base), batch)

  # -- host API ---------------------------------------------------------------------------------

  def _mesh_context(self):
    set_mesh = getattr(jax, "set_mesh", None)
    return set_mesh(self.mesh) if set_mesh is not None else contextlib.nullcontext()

  def init_state(self, rng: jax.Array, initial_params: Optional[PyTree] = None) -> TrainState:
    """State at step 0: fresh parameters from `rng`, or `initial_params` (e.g. a pretrained
    model to fine-tune), sharded by the logical-axis rules, with a fresh optimizer state and
    noise state (`noise.init(params)`)."""
    if initial_params is not None and self.lora is not None:
      raise ConfigError("a LoRA trainer starts from fresh adapters on its base; initial_params must be None")
    with self._mesh_context():
      if initial_params is None:
        return self._init(rng)
      params = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x, np.float32), s),
                            network.to_layout(initial_params, self.model_config.scan_layers), self.param_shardings)
      return self._init_from(params)

  def num_trainable_params(self) -> int:
    """Parameters the optimizer updates (with LoRA: the adapters only)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(self._abstract.params))

  def abstract_state(self) -> TrainState:
    """ShapeDtypeStructs (with shardings) of the state: the restore target of a checkpoint."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self._abstract, self.state_shardings)

  def state_bytes_per_device(self) -> Dict[str, int]:
    """Bytes one device holds of each part of the train state (`partitioning.bytes_per_device`):
    `params`, `opt_state`, `noise_state` (0 for a stateless noise transform) and the `total`
    (with the step counter)."""
    state = self.abstract_state()
    parts = {name: sharding.bytes_per_device(getattr(state, name))
             for name in ("params", "opt_state", "noise_state")}
    return dict(parts, total=sharding.bytes_per_device(state))

  def local_rows(self, batch_size: int) -> Tuple[int, int]:
    """[start, stop) of the rows of a global batch this process builds (all of them single-host)."""
    return sharding.local_rows(self.mesh, batch_size)

  def place_batch(self, batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
    """Host batch -> device arrays, rows split over the mesh's `data` axis.

    With several processes `batch` holds this process's rows (`local_rows`) only; the global
    array is assembled from every process's rows.
    """
    return partitioning.shard_batch(device_features(batch), self.mesh)

  def train_step(self, state: TrainState, batch, dropout_base_key: jax.Array,
                 noise_base_key: jax.Array) -> Tuple[TrainState, Dict[str, jax.Array]]:
    """One optimizer step; `state` is donated (do not reuse it)."""
    if isinstance(next(iter(batch.values())), np.ndarray):
      batch = self.place_batch(batch)
    with self._mesh_context():
      return self._train_step(state, self._base, batch, dropout_base_key, noise_base_key)

  def place_stacked(self, microbatches: Sequence[Dict[str, np.ndarray]], bucket: Optional[int] = None
                    ) -> Dict[str, jax.Array]:
    """Device arrays [K, m, ...] of a step's k host microbatches (one shape, each with its
    `dp.clipping.ROW_ID` column; with several processes this process's rows of each) stacked
    and padded with zero microbatches to K = `bucket` (default `microbatch_bucket(k)`), the rows
    of each split over the `data` axis. The padding microbatches are never computed."""
    k = len(microbatches)
    if not k:
      raise ValueError("place_stacked needs at least one microbatch (an empty step: one padding microbatch, "
                       "run with count 0)")
    bucket = microbatch_bucket(k) if bucket is None else int(bucket)
    if bucket < k:
      raise ValueError(f"a bucket of {bucket} microbatches cannot hold {k}")
    stacked = {}
    for name, first in device_features(microbatches[0]).items():
      out = np.zeros((bucket,) + np.shape(first), np.asarray(first).dtype)
      for i, micro in enumerate(microbatches):
        out[i] = micro[name]
      stacked[name] = out
    return partitioning.shard_batch(stacked, self.mesh, stacked=True)

  def train_step_stacked(self, state: TrainState, stacked, count: int, dropout_base_key: jax.Array,
                         noise_base_key: jax.Array) -> Tuple[TrainState, Dict[str, jax.Array]]:
    """One optimizer step, one dispatch: the first `count` microbatches of `stacked` (from
    `place_stacked`) accumulated inside the compiled step, then (for DP) the noise added once
    and the update applied; equal to `host_microbatches.train_step_on_microbatches` on them. `state` is
    donated."""
    if isinstance(next(iter(stacked.values())), np.ndarray):
      raise ValueError("train_step_stacked takes placed microbatches (Trainer.place_stacked)")
    with self._mesh_context():
      return self._train_step_stacked(state, self._base, stacked, np.int32(count), dropout_base_key,
                                      noise_base_key)

  def train_step_microbatched(self, state: TrainState, batch, microbatch_size: int, dropout_base_key,
                              noise_base_key) -> Tuple[TrainState, Dict[str, jax.Array]]:
    """Deprecated: `train.host_microbatches.train_step_microbatched(trainer, ...)`."""
    warnings.warn("Trainer.train_step_microbatched is deprecated: use "
                  "private_t5.train.host_microbatches.train_step_microbatched(trainer, ...)", DeprecationWarning, 2)
    return host_microbatches.train_step_microbatched(self, state, batch, microbatch_size, dropout_base_key,
                                                     noise_base_key)

  def eval_batch(self, params: PyTree, batch) -> Dict[str, float]:
    """Teacher-forced sums over the real rows: loss, examples, correct and target tokens."""
    if isinstance(next(iter(batch.values())), np.ndarray):
      batch = self.place_batch(batch)
    with self._mesh_context():
      out = self._eval_step(params, self._base, batch)
    return {k: float(v) for k, v in jax.device_get(out).items()}

  def trace_train_step(self, state: TrainState, batch, dropout_base_key, noise_base_key):
    """The train step traced (JAX's `Traced`: its jaxpr) for `state` (a state, or
    `abstract_state()`) and `batch`; `.lower()` it next. The phases are apart so that a profile
    can time each (`train.step_profile`)."""
    if isinstance(next(iter(batch.values())), np.ndarray):
      batch = self.place_batch(batch)
    with self._mesh_context():
      return self._train_step.trace(state, self._base, batch, dropout_base_key, noise_base_key)

  def lower_train_step(self, state: TrainState, batch, dropout_base_key, noise_base_key,
                       platforms: Optional[Sequence[str]] = None):
    """The train step lowered for `state` (a state, or `abstract_state()` to compile without
    allocating one) and `batch`; `.compile()` it for XLA's memory and cost analyses (the frozen
    LoRA base, if any, is an argument of the lowered step). `platforms` (e.g. `("cuda",)`)
    lowers it for other backends than this process's, to read the program, not to compile it."""
    traced = self.trace_train_step(state, batch, dropout_base_key, noise_base_key)
    with self._mesh_context():
      return traced.lower() if platforms is None else traced.lower(lowering_platforms=tuple(platforms))

  def trace_init(self, rng: jax.Array):
    """`init_state`'s program traced for `rng` (`.lower().compile()`, then call it with `rng`)."""
    with self._mesh_context():
      return self._init.trace(rng)

  def compile_train_step(self, state: TrainState, batch, dropout_base_key, noise_base_key) -> "CompiledStep":
    """Ahead-of-time compilation of the train step (for timing compile cost)."""
    return CompiledStep(self.lower_train_step(state, batch, dropout_base_key, noise_base_key).compile(),
                        self._base)


class CompiledStep:
  """An ahead-of-time compiled train step: `step(state, batch, dropout_base_key, noise_base_key)`
  (the frozen LoRA base, if any, is passed in), with the executable's analyses."""

  def __init__(self, compiled, base):
    self.compiled = compiled
    self.base = base

  def __call__(self, state: TrainState, batch, dropout_base_key, noise_base_key):
    return self.compiled(state, self.base, batch, dropout_base_key, noise_base_key)

  def memory_analysis(self):
    return self.compiled.memory_analysis()

  def cost_analysis(self):
    return self.compiled.cost_analysis()


def _float32(tree: PyTree) -> PyTree:
  """`tree` with its floating arrays in float32 (a noise state, whatever the parameters' dtype)."""
  def one(x):
    x = jnp.asarray(x)
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(one, tree)


def microbatch_bucket(count: int, base: int = 1) -> int:
  """K, the microbatches a step of `count` is stacked to: the smallest base * 2^j >= count.

  The training loop takes `base` from the sample size a step almost never exceeds
  (`train.step_data.stack_base`), so that a run compiles one shape (a sample beyond it: one more, and so on
  doubling); the padding microbatches cost a host buffer and a transfer, not compute."""
  k, base = max(int(count), 1), max(int(base), 1)
  while base < k:
    base *= 2
  return base


# Its former address (`train.host_microbatches` holds the host-dispatched microbatch path).
split_microbatches = host_microbatches.split_microbatches


def summarize_eval(sums: Dict[str, float]) -> Dict[str, float]:
  """Totals from `eval_batch` (summed over batches) -> loss and token accuracy."""
  examples = max(sums.get("examples", 0.0), 1e-12)
  tokens = max(sums.get("target_tokens", 0.0), 1e-12)
  return {"loss": sums.get("loss_sum", 0.0) / examples,
          "token_accuracy": sums.get("correct_tokens", 0.0) / tokens,
          "examples": sums.get("examples", 0.0)}
