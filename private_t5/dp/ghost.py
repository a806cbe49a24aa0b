"""Ghost clipping for T5: DP-SGD clipped sums without per-example gradients (Li et al. 2022, Sec. 4).

One forward pass of the per-example losses records, for every parameterised layer, its
inputs `a_i` (activations or token ids); one backward pass of `sum_i loss_i` gives the
gradient `g_i` of each layer's output. These two suffice for every example's gradient norm
(`ghost_norms`), hence the clip factors `c_i = min(1, C / ||grad loss_i||) w_i`. The clipped
sum `sum_i c_i grad loss_i` then comes either from

* "bookkeeping" (Bu et al. 2023, "Differentially private optimization on large model at
  small cost"): reuse the recorded `(a_i, g_i)` and form `sum_i c_i a_i^T g_i` per layer
  directly, no second backward pass; or
* "second_pass" (Li et al. 2022, ghost clipping proper): a second backward pass of the reweighted
  loss `sum_i c_i loss_i` through the same forward (same activations, same dropout masks).

How layers are recorded: the model is not modified. While the loss function is traced, a
Flax method interceptor (`flax.linen.intercept_methods`) wraps the calls of the four
parameterised layer types of `private_t5.models.layers` (`Dense`, `Embed` lookups and
`attend`, `RMSNorm`, `RelativePositionBias`): it records the inputs and adds a zero
"tap" `delta` to the output; the gradient with respect to `delta` is the output gradient.
Outside the ghost aggregator nothing is intercepted and the model runs unchanged. A scanned
network (`T5Config.scan_layers`) is recorded through its scan hook (`layers.scan_hook`): each
stack takes its layers' taps as per-layer inputs and returns their recorded inputs stacked, and a
scanned layer's norms and sums are computed for its whole stack at once. Every
parameter's gradient must come entirely from recorded layers, otherwise the norms would not
bound what is summed: the abstract trace of one example's loss (its jaxpr) is searched for
every operation that reads a parameter, and a parameter read anywhere but inside a recorded
call of its own layer (an L2 penalty on the embedding, a parameter fed into another layer's
input, a layer type ghost norms do not know) is refused at trace time (`check_coverage`).

Only the parameters being differentiated are recorded: a loss may close over other weights
(LoRA's frozen base, `models.lora`), whose layers run untapped; the adapters' `lora_a` and
`lora_b` are ordinary `Dense` layers, so their per-example norms are the dense-layer identities.

Each example is evaluated as a batch of one under `jax.vmap` with dropout key
`fold_in(dropout_rng, row)`, exactly like `DPAggregator`, so both methods compute the same
function of the batch (same privacy semantics, same division by q N, the same noise transform after it).

Low-precision activations (`T5Config.dtype="bfloat16"`): the recorded inputs and output
gradients are in the activation dtype; the norms and the book-keeping sum both cast those
same values to float32 and compute in float32, so the norm that sets example i's clip factor
is the norm of the term `c_i a_i^T g_i` that is summed, up to float32 rounding. The second
pass instead sums the examples' weight gradients inside one bfloat16 backward pass: its
rounding scales with the whole batch's sum, not with C, so it is refused for such models
(`check_second_pass_dtype`).
"""
import collections
import inspect
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from private_t5.dp import ghost_norms as gn
from private_t5.dp import clipping, ghost_layerwise, schedule
from private_t5.dp.config import BOOKKEEPING, CLIPPED_SUM_METHODS, LAYERWISE, SECOND_PASS
from private_t5.dp.privacy_params import NoisySum
from private_t5.dp.aggregator import DPAggregator
from private_t5.errors import ConfigError
from private_t5.models import layers, network

PyTree = Any
Batch = Dict[str, jax.Array]


# Prefix of the named scope around each recorded layer call (found again in the jaxpr).
_SCOPE_PREFIX = "ghost_use_"

# Kinds of recorded layer use.
DENSE, LOOKUP, ATTEND, SCALE, RELPOS = "dense", "lookup", "attend", "scale", "relpos"


class LayerUse(NamedTuple):
  """Static description of one recorded call of a parameterised layer."""
  kind: str
  param: Tuple[str, ...]  # path of the parameter in the params tree
  buckets: Optional[np.ndarray] = None  # RELPOS: int [q + k - 1], the bucket of each offset k - q
  num_buckets: int = 0  # RELPOS: columns of the table
  # A layer of a scanned stack (`T5Config.scan_layers`): its parameter, recorded inputs and output
  # gradients have a leading layer axis (the inputs and gradients after the examples' axis).
  stacked: bool = False


# What a probe of `Probes` computes: the per-example squared norms, or the weighted sums.
NORMS, SUMS = "norms", "sums"


class Probes(NamedTuple):
  """The layers a layer-by-layer clipped sum (`clipped_sum_method="layerwise"`) probes, and the pass.

  In the NORMS pass a probed layer's tap is a float32 zero per example (`[layers]` per example in a
  scanned stack), whose gradient is the layer's squared norm; in the SUMS pass it is `(scale, acc)`,
  the example's clip scale and a float32 zero shaped like the parameter, whose gradient is the
  weighted sum (`ghost_layerwise`)."""
  mode: str
  keys: frozenset
  norm_method: str

  def apply(self, use: "LayerUse", y: jax.Array, a: jax.Array, tap) -> jax.Array:
    scale = use.kind == SCALE
    if self.mode == NORMS:
      return ghost_layerwise.norm_probe(scale, self.norm_method, y, a, tap)
    s, acc = tap
    return ghost_layerwise.sum_probe(scale, y, a, s, acc)


def probed_keys(uses: Dict[str, "LayerUse"]) -> frozenset:
  """The uses a layer-by-layer clipped sum probes: the dense kernels and norm scales used once (the
  others, embeddings and position biases, are recorded and book-kept as usual)."""
  counts = collections.Counter(use.param for use in uses.values())
  return frozenset(k for k, use in uses.items() if use.kind in (DENSE, SCALE) and counts[use.param] == 1)


class _Frame(NamedTuple):
  """One traced body of a scanned stack: its layer's taps (this layer's slice of the stacked
  deltas) and what the body returns to the stack, stacked by the scan (`layers.stack_outputs`)."""
  taps: Dict[str, jax.Array]
  inputs: Dict[str, jax.Array]
  outputs: Dict[str, jax.Array]


class _Recorder:
  """Flax method interceptor recording layer inputs and tapping layer outputs.

  With `deltas=None` it only records the output shapes (to build the zero taps); otherwise
  it adds `deltas[key]` (zeros) to each output so that `d loss / d delta` is the output
  gradient. Keys are `"<module path>:<kind><call index>"`.

  Inside a scanned stack (`T5Config.scan_layers`) the values of a layer live in the scan's body: the
  recorder is also the network's scan hook (`layers.scan_hook`), which hands each stack the taps of
  its layers as per-layer inputs (stacked deltas, sliced by the scan) and takes the layers' inputs
  (and, for the shapes, their outputs) back as the stack's per-layer outputs, stacked: one key a
  layer of the body, its arrays with a leading layer axis (`LayerUse.stacked`).
  """

  def __init__(self, deltas: Optional[Dict[str, jax.Array]] = None, probes: Optional["Probes"] = None):
    self.deltas = deltas
    self.probes = probes
    self.inputs: Dict[str, jax.Array] = {}
    self.output_shapes: Dict[str, jax.ShapeDtypeStruct] = {}
    self.input_shapes: Dict[str, Tuple[int, ...]] = {}
    self.uses: Dict[str, LayerUse] = {}
    self.scopes: Dict[str, str] = {}  # named scope of each recorded call -> its use key
    self._calls = collections.Counter()
    self._frame: Optional[_Frame] = None  # while a scanned stack's body is traced
    self._stack_calls: Dict[Tuple[str, ...], collections.Counter] = {}  # call counts at a body's start

  # -- the scan hook (`layers.scan_hook`) --

  def stack_inputs(self, path: Tuple[str, ...]) -> Dict[str, jax.Array]:
    prefix = "/".join(path) + "/"
    return {} if self.deltas is None else {k: d for k, d in self.deltas.items() if k.startswith(prefix)}

  def stack_outputs(self, path: Tuple[str, ...], outputs) -> None:
    for key, x in outputs["inputs"].items():
      self.inputs[key] = x
      self.input_shapes[key] = tuple(x.shape[1:])
    for key, y in outputs["outputs"].items():
      self.output_shapes[key] = jax.ShapeDtypeStruct(y.shape, y.dtype)

  def _body(self, module: nn.Module, next_fun, args, kwargs, per_layer) -> Tuple[jax.Array, Dict[str, Any]]:
    """A scanned stack's layer: its recorded values go out with the residual stream. The body may be
    traced more than once: each trace numbers its calls from the same start."""
    start = self._stack_calls.setdefault(tuple(module.path), collections.Counter(self._calls))
    self._calls = collections.Counter(start)
    frame, outer = _Frame(per_layer or {}, {}, {}), self._frame
    self._frame = frame
    try:
      x, _ = next_fun(*args, **kwargs)
    finally:
      self._frame = outer
    return x, {"inputs": frame.inputs, "outputs": frame.outputs}

  def _record(self, key: str, x: Optional[jax.Array], use: LayerUse) -> None:
    if self._frame is not None:
      use = use._replace(stacked=True)
    self.uses[key] = use
    if x is not None:
      (self.inputs if self._frame is None else self._frame.inputs)[key] = x

  def _key(self, module: nn.Module, kind: str) -> str:
    path = "/".join(module.path)
    index = self._calls[(path, kind)]
    self._calls[(path, kind)] += 1
    return f"{path}:{kind}{index}"

  def _run(self, key: str, next_fun, args, kwargs) -> jax.Array:
    """Calls the layer inside a named scope that marks its operations as use `key`."""
    scope = f"{_SCOPE_PREFIX}{len(self.scopes)}"
    self.scopes[scope] = key
    with jax.named_scope(scope):
      return next_fun(*args, **kwargs)

  def _tap(self, key: str, y: jax.Array) -> jax.Array:
    frame = self._frame
    if self.probes is not None and key in self.probes.keys:
      # A probed layer (`ghost_layerwise`): its input goes into the probe, not out with the records.
      a = (self.inputs if frame is None else frame.inputs).pop(key)
      table = self.deltas if frame is None else frame.taps
      return y if key not in table else self.probes.apply(self.uses[key], y, a, table[key])
    if frame is not None:
      if self.deltas is None:
        frame.outputs[key] = y
        return y
      if key not in frame.taps:
        frame.inputs.pop(key, None)
        return y
      return y + frame.taps[key].astype(y.dtype)
    if key in self.inputs:
      self.input_shapes[key] = tuple(self.inputs[key].shape)
    if self.deltas is None:
      self.output_shapes[key] = jax.ShapeDtypeStruct(y.shape, y.dtype)
      return y
    if key not in self.deltas:  # a layer of a parameter not differentiated (a LoRA base weight)
      self.inputs.pop(key, None)
      return y
    return y + self.deltas[key].astype(y.dtype)

  def __call__(self, next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if method == "__call__" and tuple(module.path)[-1:] == (network.STACK,):
      bound = _bind(context, args, kwargs)
      if "per_layer" in bound:
        return self._body(module, next_fun, args, kwargs, bound["per_layer"])
    if isinstance(module, layers.Dense) and method == "__call__":
      x = _bind(context, args, kwargs)["x"]
      key = self._key(module, DENSE)
      self._record(key, x.astype(module.dtype), LayerUse(DENSE, tuple(module.path) + ("kernel",)))
      return self._tap(key, self._run(key, next_fun, args, kwargs))
    if isinstance(module, layers.Embed) and method in ("__call__", "attend"):
      bound = _bind(context, args, kwargs)
      if method == "__call__":
        key = self._key(module, LOOKUP)
        self._record(key, bound["ids"].astype(jnp.int32), LayerUse(LOOKUP, tuple(module.path) + ("embedding",)))
      else:
        key = self._key(module, ATTEND)
        self._record(key, bound["query"].astype(module.dtype), LayerUse(ATTEND, tuple(module.path) + ("embedding",)))
      return self._tap(key, self._run(key, next_fun, args, kwargs))
    if isinstance(module, layers.RMSNorm) and method == "__call__":
      x = _bind(context, args, kwargs)["x"].astype(jnp.float32)
      key = self._key(module, SCALE)
      # x_hat exactly as RMSNorm computes it before the scale (identical ops, shared by XLA).
      variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
      self._record(key, x * jax.lax.rsqrt(variance + module.epsilon), LayerUse(SCALE, tuple(module.path) + ("scale",)))
      return self._tap(key, self._run(key, next_fun, args, kwargs))
    if isinstance(module, layers.RelativePositionBias) and method == "__call__":
      bound = _bind(context, args, kwargs)
      buckets = layers.offset_buckets(int(bound["q_len"]), int(bound["k_len"]), bool(bound["bidirectional"]),
                                      module.num_buckets, module.max_distance)
      key = self._key(module, RELPOS)
      self._record(key, None, LayerUse(RELPOS, tuple(module.path) + ("rel_embedding",), buckets, module.num_buckets))
      return self._tap(key, self._run(key, next_fun, args, kwargs))
    return next_fun(*args, **kwargs)


def _bind(context, args, kwargs) -> Dict[str, Any]:
  """The intercepted call's arguments by parameter name."""
  bound = inspect.signature(context.orig_method).bind(*args, **kwargs)
  bound.apply_defaults()
  return bound.arguments


class Recording(NamedTuple):
  """What one abstract trace of an example's loss records (all static)."""
  uses: Dict[str, LayerUse]
  output_shapes: Dict[str, jax.ShapeDtypeStruct]
  input_shapes: Dict[str, Tuple[int, ...]]
  # Parameter path -> where it is read outside a recorded call of its own layer.
  unrecorded: Dict[Tuple[str, ...], str]


def record_layer_uses(loss_fn, params: PyTree, example: Batch, key: Optional[jax.Array]
                      ) -> Recording:
  """Traces one example's loss abstractly; returns its layer uses, their shapes, and the
  parameter reads that no recorded use accounts for."""
  recorder = _Recorder()

  def run(p, ex, k):
    with nn.intercept_methods(recorder), layers.scan_hook(recorder):
      return clipping.single_example_loss(loss_fn, p, ex, k)

  closed = jax.make_jaxpr(run)(params, example, key)  # params may be ShapeDtypeStructs
  inside = _transform_around_recorded_layers(closed.jaxpr)
  if inside is not None:
    raise ConfigError(f"ghost clipping records each layer's inputs and output gradients outside the layer; this "
                      f"loss computes its layers inside `{inside}` (T5Config.remat_policy of an unrolled network): "
                      "use T5Config.scan_layers=True with it, or train.clipping_method='vmap'")
  paths = [tuple(_key_name(k) for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  param_vars = dict(zip(closed.jaxpr.invars[:len(paths)], paths))
  owner = {scope: recorder.uses[key].param for scope, key in recorder.scopes.items()}
  unrecorded = {}
  _find_unrecorded_reads(closed.jaxpr, param_vars, owner, "", unrecorded)
  # Uses of parameters that are not in `params` (constants of the loss, such as the frozen base
  # weights a LoRA loss closes over) have no gradient to bound: they are neither tapped nor kept.
  trained = {key for key, use in recorder.uses.items() if use.param in set(paths)}
  keep = lambda table: {k: v for k, v in table.items() if k in trained}
  return Recording(keep(recorder.uses), keep(recorder.output_shapes), keep(recorder.input_shapes),
                   unrecorded)


# Transforms whose bodies are traced apart: a layer recorded inside one leaves its values there.
# (A scanned stack's layers hand theirs out through the scan hook; the scan is not one of them.)
_ENCLOSING = ("checkpoint", "remat", "remat2", "while", "custom_vjp_call")


def _transform_around_recorded_layers(jaxpr, enclosing: Optional[str] = None) -> Optional[str]:
  """The first `_ENCLOSING` primitive whose body holds a recorded layer call, or None."""
  for eqn in jaxpr.eqns:
    if enclosing is not None and _SCOPE_PREFIX in str(eqn.source_info.name_stack):
      return enclosing
    name = str(eqn.primitive)
    if name == "scan":
      continue
    for sub in _sub_jaxprs(eqn):
      found = _transform_around_recorded_layers(sub, name if name in _ENCLOSING else enclosing)
      if found is not None:
        return found
  return None


def _key_name(key) -> str:
  """A params-tree path entry (dict key or attribute) as the string `flatten_dict` uses."""
  return str(getattr(key, "key", getattr(key, "name", key)))


def _recorded_scope(name_stack: str) -> Optional[str]:
  """The innermost recorded-call scope in a jaxpr equation's name stack, if any."""
  scopes = [part for part in name_stack.split("/") if part.startswith(_SCOPE_PREFIX)]
  return scopes[-1] if scopes else None


def _sub_jaxprs(eqn) -> List[Any]:
  """The jaxprs nested in an equation's parameters (jit, custom_jvp, remat, cond branches, ...)."""
  found = []
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr, or a Jaxpr
      if hasattr(inner, "eqns") and hasattr(inner, "invars"):
        found.append(inner)
  return found


def _find_unrecorded_reads(jaxpr, param_vars: Dict[Any, Tuple[str, ...]],
                           owner: Dict[str, Tuple[str, ...]], outer_stack: str,
                           unrecorded: Dict[Tuple[str, ...], str]) -> None:
  """Adds to `unrecorded` every parameter that an equation reads outside its own recorded use.

  A read inside a recorded call counts only when the call's use is of that very parameter (a
  `Dense` whose input is computed from the embedding does not account for the embedding's
  gradient through that input). An equation with nested jaxprs outside any recorded call
  (a jit, a custom_jvp) is followed into them when its operands map one to one (or, for
  `cond`, after the branch index); anything else reading a parameter is refused.
  """
  for eqn in jaxpr.eqns:
    stack = "/".join(p for p in (outer_stack, str(eqn.source_info.name_stack)) if p)
    scope = _recorded_scope(stack)
    for position, var in enumerate(eqn.invars):
      path = param_vars.get(var) if not hasattr(var, "val") else None  # skip literals
      if path is None:
        continue
      if scope is not None:
        if owner[scope] != path:
          unrecorded.setdefault(path, f"read inside the recorded layer of {'/'.join(owner[scope])}")
        continue
      subs = _sub_jaxprs(eqn)
      if not subs:
        unrecorded.setdefault(path, f"read by `{eqn.primitive}` outside any recorded layer")
        continue
      offset = 1 if str(eqn.primitive) == "cond" else 0
      for sub in subs:
        if len(sub.invars) + offset != len(eqn.invars):
          unrecorded.setdefault(path, f"passed into `{eqn.primitive}`")
          continue
        inner = {sub.invars[position - offset]: path} if position >= offset else {}
        _find_unrecorded_reads(sub, inner, owner, stack, unrecorded)


def per_example_forward(loss_fn, params: PyTree, batch: Batch, keys: Optional[jax.Array],
                        deltas: Dict[str, jax.Array], spmd_axis_name: Optional[str] = None,
                        probes: Optional[Probes] = None, delta_axes: Any = 0
                        ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """Per-example losses [B] and recorded layer inputs (leading [B]) with output taps `deltas`
  (batched as `delta_axes` says: an `in_axes` of `jax.vmap`), the layers of `probes` probed."""
  def one(delta, example, key):
    recorder = _Recorder(delta, probes)
    with nn.intercept_methods(recorder), layers.scan_hook(recorder):
      loss = clipping.single_example_loss(loss_fn, params, example, key)
    return loss, recorder.inputs

  return jax.vmap(one, in_axes=(delta_axes, 0, None if keys is None else 0),
                  spmd_axis_name=spmd_axis_name)(deltas, batch, keys)


def _group_by_param(uses: Dict[str, LayerUse]) -> Dict[Tuple[str, ...], List[str]]:
  groups = collections.OrderedDict()
  for key in sorted(uses):
    groups.setdefault(uses[key].param, []).append(key)
  return groups


def check_coverage(params: PyTree, recording: Recording) -> None:
  """Raises ConfigError unless every parameter's gradient comes only from recorded layer uses.

  Two ways the ghost norm could miss part of an example's gradient, and so fail to bound
  what is summed: a parameter that no recorded layer uses, and a parameter also read
  elsewhere (`Recording.unrecorded`).
  """
  flat = traverse_util.flatten_dict(params)
  covered = {u.param for u in recording.uses.values()}
  missing = sorted("/".join(p) for p in flat if p not in covered)
  if missing:
    raise ConfigError("ghost clipping cannot compute per-example norms of parameters that no "
                      f"supported layer uses: {missing}; use train.clipping_method='vmap'")
  if recording.unrecorded:
    where = "; ".join(f"{'/'.join(p)} ({why})" for p, why in sorted(recording.unrecorded.items()))
    raise ConfigError("ghost clipping would not bound the whole per-example gradient: these "
                      f"parameters are also used outside their recorded layer: {where}; use "
                      "train.clipping_method='vmap'")


def check_second_pass_dtype(recording: Recording) -> None:
  """Raises ConfigError when the second pass would sum gradients in a low-precision dtype.

  The second pass's backward pass forms `sum_i c_i a_i^T g_i` of each layer in one matmul in
  the activation dtype: with bfloat16 (8-bit mantissa) the rounding of that sum is about 2^-9
  of the whole batch's sum (up to B C 2^-9 for B clipped examples), so adding or removing one
  example can move the result by more than C (docs/model.md, "Activation dtype").
  """
  low = sorted({str(s.dtype) for s in recording.output_shapes.values()} - {"float32"})
  if low:
    raise ConfigError(f"ghost clipping's second pass sums the clipped gradients in {low[0]} "
                      "activations, whose rounding can exceed the clip norm's bound; use "
                      "clipped_sum_method='bookkeeping' (the default) or vmap clipping, which sum "
                      "in float32, or T5Config.dtype='float32'")


def check_layerwise_dtype(recording: Recording) -> None:
  """Raises ConfigError when a layer-by-layer clipped sum would recompute low-precision gradients.

  Its norms and its sums come from two backward passes: in float32 they agree to float32
  rounding, but in bfloat16 a compiler that keeps excess precision in one pass's fusions and not in
  the other's can give output gradients that differ by bfloat16 rounding (2^-9 of themselves), and
  the norm that clips an example would no longer bound what is summed for it.
  """
  low = sorted({str(s.dtype) for s in recording.output_shapes.values()} - {"float32"})
  if low:
    raise ConfigError(f"ghost_clipped_sum='layerwise' recomputes the output gradients in {low[0]} activations, "
                      "where the clipping norm would not bound the recomputed sum; use "
                      "ghost_clipped_sum='bookkeeping' (the default) or T5Config.dtype='float32'")


def _layer_groups(uses: Dict[str, LayerUse], inputs: Dict[str, jax.Array], out_grads: Dict[str, jax.Array],
                  norm_method: str, stack_layers: bool) -> List[Tuple[str, str, List[str]]]:
  """[(group name, method, use keys)]: the dense kernels and norm scales used once, grouped by
  kind, norm method (SCALE for a scale) and the shapes and dtypes of their inputs and output
  gradients. A group's layers are computed together, stacked on a leading layer axis: one
  batched matrix product or reduction for the group where each layer had its own (T5 v1.1
  small's ~170 such parameters fall in ~10 groups). Without `stack_layers`, each layer is a
  group of one (the layer's own kernels, no stacked copies)."""
  counts = collections.Counter(use.param for use in uses.values())
  groups: Dict[Tuple, List[str]] = collections.OrderedDict()
  for key in sorted(uses):
    use = uses[key]
    if use.kind not in (DENSE, SCALE) or counts[use.param] != 1:
      continue
    # (A scanned stack's layer is a group by itself: its arrays are its stack's layers already.)
    a, g = (x[:, 0] if use.stacked else x for x in (inputs[key], out_grads[key]))
    a, g = gn.as_sequence(a, None), gn.as_sequence(g, None)
    method = SCALE if use.kind == SCALE else gn.resolve_method(norm_method, a.shape[1], a.shape[2], g.shape[2])
    group = ((method, a.shape, a.dtype.name, g.shape, g.dtype.name) if stack_layers and not use.stacked
             else (method, key))
    groups.setdefault(group, []).append(key)
  return [(f"layer_group:{i}", key[0], keys) for i, (key, keys) in enumerate(groups.items())]


def _stacked(arrays: Dict[str, jax.Array], keys: List[str], keep: Optional[jax.Array] = None,
             scanned: bool = False) -> jax.Array:
  """[L, B, ...]: the keys' arrays as sequences, stacked on a leading layer axis (`scanned`: the one
  key's own layer axis, after the examples'); with `keep` [B] (bool), the rows of the other
  examples zeroed (`clipping.zero_dropped`, on the stack)."""
  if scanned:
    (key,) = keys
    x = jnp.moveaxis(arrays[key], 1, 0)
    stacked = x.reshape(x.shape[:2] + (-1, x.shape[-1]))
  else:
    stacked = jnp.stack([gn.as_sequence(arrays[k], None) for k in keys])
  return stacked if keep is None else _keep_rows(stacked, keep)


def _scanned(uses: Dict[str, LayerUse], keys: List[str]) -> bool:
  """Whether a group of `_layer_groups` is a scanned stack's layer."""
  return uses[keys[0]].stacked


def _keep_rows(x: jax.Array, keep: jax.Array) -> jax.Array:
  """`x` [L, B, ...] with the rows (axis 1) not kept set to exactly 0 (a NaN row becomes 0)."""
  return jnp.where(keep.reshape((1, -1) + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def per_example_sq_norms(uses: Dict[str, LayerUse], inputs: Dict[str, jax.Array],
                         out_grads: Dict[str, jax.Array], norm_method: str = gn.AUTO,
                         instantiated: Optional[Dict[str, jax.Array]] = None, stack_layers: bool = False
                         ) -> Dict[Tuple[str, ...], jax.Array]:
  """Per-example squared gradient norms [B] of each parameter (all of its uses combined).

  Args:
    uses, inputs, out_grads: the recorded layer uses, their inputs and output gradients.
    norm_method: "auto", "gram" or "instantiate" for dense layers.
    instantiated: when a dict is given, the per-example kernel gradients `[L, B, d_in, d_out]`
      of each group of dense layers whose norms were instantiated (`_layer_groups`) are
      stored in it (by group name), so that book-keeping can reuse them instead of
      recomputing `sum_i c_i a_i^T g_i`.
  """
  # Each use's inputs wait for its output gradient: what the norms compute from the inputs
  # alone (Gram matrices `a a^T`, float32 copies, token-equality matrices) is then formed in
  # the backward pass and reduced at once, not formed in the forward pass and kept
  # (`schedule.after`).
  groups = _layer_groups(uses, inputs, out_grads, norm_method, stack_layers)
  grouped = {k for _, _, keys in groups for k in keys if not uses[k].stacked} if stack_layers else set()
  raw_inputs = inputs
  inputs = {k: x if k in grouped else schedule.after(x, out_grads[k]) for k, x in inputs.items()}
  norms = {}
  for name, method, keys in groups:
    scanned = _scanned(uses, keys)
    g = _stacked(out_grads, keys, scanned=scanned)
    if stack_layers and not scanned:
      # A stacked group's inputs wait for all of its output gradients: one sum of the stack
      # (`schedule.after` reduces its value) for the group, not one a layer.
      a = _stacked({k: schedule.after(raw_inputs[k], g) for k in keys}, keys)
    else:
      a = _stacked(inputs, keys, scanned=scanned)
    layers_, rows = a.shape[:2]
    flat_a, flat_g = a.reshape((-1,) + a.shape[2:]), g.reshape((-1,) + g.shape[2:])
    if method == SCALE:
      sq = jnp.sum(jnp.square(gn.scale_per_example_grads(flat_a, flat_g)), axis=-1)
    elif method == gn.INSTANTIATE:
      per = gn.linear_per_example_grads(flat_a, flat_g)
      sq = jnp.sum(jnp.square(per), axis=(1, 2))
      if instantiated is not None:
        instantiated[name] = per.reshape((layers_, rows) + per.shape[1:])
    else:
      sq = gn.linear_sq_norms(flat_a, flat_g, method)
    sq = sq.reshape(layers_, rows)
    if scanned:  # one parameter, its layers' slices: their squares add up
      norms[uses[keys[0]].param] = jnp.sum(sq, axis=0)
      continue
    for i, k in enumerate(keys):
      norms[uses[k].param] = sq[i]
  for param, keys in _group_by_param(uses).items():
    if param in norms:
      continue
    kinds = {uses[k].kind for k in keys}
    if kinds <= {LOOKUP, ATTEND}:
      lookups = [(inputs[k], out_grads[k]) for k in keys if uses[k].kind == LOOKUP]
      attends = [(inputs[k], out_grads[k]) for k in keys if uses[k].kind == ATTEND]
      norms[param] = gn.tied_embedding_sq_norms(lookups, attends, norm_method)
    elif kinds == {DENSE}:
      raise ValueError(f"dense kernel {'/'.join(param)} is used {len(keys)} times; ghost "
                       "norms support one use per kernel")
    elif kinds == {SCALE}:
      grads = sum(gn.scale_per_example_grads(inputs[k], out_grads[k]) for k in keys)
      norms[param] = jnp.sum(jnp.square(grads), axis=-1)
    elif kinds == {RELPOS}:
      grads = sum(gn.relpos_per_example_grads(_squeeze_inner_batch(out_grads[k]),
                                              uses[k].buckets, uses[k].num_buckets) for k in keys)
      norms[param] = jnp.sum(jnp.square(grads), axis=(1, 2))
    else:
      raise ValueError(f"parameter {'/'.join(param)} has incompatible uses {sorted(kinds)}")
  return norms


def _squeeze_inner_batch(g: jax.Array) -> jax.Array:
  """[B, 1, heads, q, k] (a batch of one per example) -> [B, heads, q, k]."""
  return g.reshape((g.shape[0],) + g.shape[-3:])


def weighted_grad_sum(params: PyTree, uses: Dict[str, LayerUse], inputs: Dict[str, jax.Array],
                      out_grads: Dict[str, jax.Array], weights: jax.Array,
                      instantiated: Optional[Dict[str, jax.Array]] = None, norm_method: str = gn.AUTO,
                      keep: Optional[jax.Array] = None, stack_layers: bool = False) -> PyTree:
  """Book-keeping: `sum_i weights_i grad loss_i` per parameter from the recorded (a, g) [float32].

  The groups of dense layers (`_layer_groups`, with the `norm_method` of the norms) found in
  `instantiated` (per-example kernel gradients kept from the norm computation) are summed
  from those, `sum_i w_i G_i`, the others from `(a, g)`, a group at a time. `keep` [B] (bool):
  the rows of the other examples are zeroed first (a dropped example's NaN would otherwise
  reach the sums as 0 x NaN).
  """
  instantiated = instantiated or {}
  flat_params = traverse_util.flatten_dict(params)
  flat = {}
  for name, method, keys in _layer_groups(uses, inputs, out_grads, norm_method, stack_layers):
    scanned = _scanned(uses, keys)
    if method == SCALE:
      a, g = _stacked(inputs, keys, keep, scanned), _stacked(out_grads, keys, keep, scanned)
      per = gn.scale_per_example_grads(a.reshape((-1,) + a.shape[2:]), g.reshape((-1,) + g.shape[2:]))
      per = per.reshape(a.shape[:2] + per.shape[1:])  # [L, B, d]
      # Formed elementwise, as `contract("b,bd->d", ...)` forms a layer's.
      sums = jnp.sum(weights.astype(jnp.float32)[None, :, None] * per.astype(jnp.float32), axis=1)
    elif name in instantiated:
      per = instantiated[name] if keep is None else _keep_rows(instantiated[name], keep)
      sums = gn.stacked_linear_weighted_sums(None, None, weights, per)
    else:
      sums = gn.stacked_linear_weighted_sums(_stacked(inputs, keys, keep, scanned),
                                             _stacked(out_grads, keys, keep, scanned), weights)
    if scanned:
      flat[uses[keys[0]].param] = sums.reshape(flat_params[uses[keys[0]].param].shape)
      continue
    for i, k in enumerate(keys):
      flat[uses[k].param] = sums[i].reshape(flat_params[uses[k].param].shape)
  for param, keys in _group_by_param(uses).items():
    if param in flat:
      continue
    shape = flat_params[param].shape
    total = jnp.zeros(shape, jnp.float32)
    for k in keys:
      use, a, g = uses[k], inputs.get(k), out_grads[k]
      if keep is not None:
        a, g = clipping.zero_dropped((a, g), keep)
      if use.kind == DENSE:
        total = total + gn.linear_weighted_sum(a, g, weights)
      elif use.kind == LOOKUP:
        total = total + gn.lookup_weighted_sum(a, g, weights, shape[0])
      elif use.kind == ATTEND:
        # z = h E^T: dE = sum_t G_t h_t^T, i.e. the transpose of a dense kernel gradient.
        total = total + gn.linear_weighted_sum(g, a, weights)
      elif use.kind == SCALE:
        total = total + gn.contract("b,bd->d", weights, gn.scale_per_example_grads(a, g))
      elif use.kind == RELPOS:
        total = total + gn.contract("b,bhn->hn", weights, gn.relpos_per_example_grads(
            _squeeze_inner_batch(g), use.buckets, use.num_buckets))
    flat[param] = total
  return traverse_util.unflatten_dict(flat)


def cost_breakdown(recording: Recording) -> List[Dict[str, Any]]:
  """Per dense-like layer use: sequence length, widths, and the cost of each norm method."""
  uses, output_shapes, input_shapes = recording.uses, recording.output_shapes, recording.input_shapes
  rows = []
  for key in sorted(uses):
    use = uses[key]
    if use.kind not in (DENSE, ATTEND):
      continue
    out = output_shapes[key].shape
    seq = int(np.prod(out[:-1]))
    d_in, d_out = int(input_shapes[key][-1]), int(out[-1])
    gram, inst = gn.linear_costs(seq, d_in, d_out)
    rows.append(dict(layer=key, seq_len=seq, d_in=d_in, d_out=d_out, gram_cost=gram,
                     instantiate_cost=inst, method=gn.choose_linear_method(seq, d_in, d_out)))
  return rows


class NormPass(NamedTuple):
  """What the first half of a ghost clipped sum leaves for the second (`GhostDPAggregator`)."""
  losses: jax.Array
  norms: jax.Array
  uses: Dict[str, LayerUse]
  inputs: Dict[str, jax.Array]
  out_grads: Dict[str, jax.Array]
  instantiated: Optional[Dict[str, jax.Array]]
  vjp_fn: Any
  deltas: Dict[str, jax.Array]


class GhostDPAggregator(DPAggregator):
  """`DPAggregator` whose clipped sum uses ghost norms instead of per-example gradients.

  Same constructor arguments and call as `DPAggregator` (clip to C, sum, divide by the public
  q N; the noise transform adds the noise), plus:

  Attributes:
    norm_method: "auto" (per layer, the cheaper of the Gram identity and the instantiated
      per-example gradient), "gram" or "instantiate".
    clipped_sum_method: "bookkeeping" (one backward pass), "second_pass" (ghost clipping
      with a second backward pass of the reweighted loss; float32 activations only) or
      "layerwise" (the norms and the sums of the dense kernels and norm scales formed inside two
      forward and backward passes, layer by layer, `ghost_layerwise`: with full remat a fraction
      of book-keeping's memory, for the compute of a second forward and backward pass; float32
      activations only). All three
      drop an example with a non-finite gradient exactly, as `DPAggregator` does
      (`clipping.clip`); when a batch has one, the second pass recomputes its forward with a
      kept row in the dropped row's place.
    reuse_instantiated: with book-keeping, keep the per-example kernel gradients of the
      layers whose norms are instantiated and sum them with the clip factors (no second
      weight-gradient computation for those layers; memory B x their parameters).
    stack_layers: compute the norms and sums of the dense and norm-scale layers of one shape
      together, stacked on a layer axis (`_layer_groups`): a fraction of the kernel launches
      on a GPU (T5 v1.1 small's DP-ghost step 1.09x the non-DP step's kernels instead of
      1.35x), for the memory of the stacked copies (+11% at batch 256 on an H100 target). Off
      by default; the values are the same up to float32 rounding.
  """

  def __init__(self, loss_fn, noisy_sum: NoisySum, spmd_axis_name: Optional[str] = None, *,
               norm_method: str = gn.AUTO, clipped_sum_method: str = BOOKKEEPING, reuse_instantiated: bool = True,
               stack_layers: bool = False):
    super().__init__(loss_fn, noisy_sum, spmd_axis_name=spmd_axis_name)
    if norm_method not in gn.LINEAR_METHODS:
      raise ConfigError(f"norm_method must be one of {gn.LINEAR_METHODS}, got {norm_method!r}")
    if clipped_sum_method not in CLIPPED_SUM_METHODS:
      raise ConfigError(f"clipped_sum_method must be one of {CLIPPED_SUM_METHODS}, "
                        f"got {clipped_sum_method!r}")
    self.norm_method = norm_method
    self.clipped_sum_method = clipped_sum_method
    self.reuse_instantiated = bool(reuse_instantiated)
    self.stack_layers = bool(stack_layers)

  def norm_pass(self, params: PyTree, batch: Batch, keys: Optional[jax.Array]) -> "NormPass":
    """The first half of a ghost clipped sum: one forward and backward pass of sum_i loss_i,
    and from the recorded layer inputs and output gradients the per-example gradient norms."""
    first = jax.tree.map(lambda x: x[0], batch)
    recording = record_layer_uses(self.loss_fn, params, first, None if keys is None else keys[0])
    check_coverage(params, recording)
    if self.clipped_sum_method == SECOND_PASS:
      check_second_pass_dtype(recording)
    if self.clipped_sum_method == LAYERWISE:
      check_layerwise_dtype(recording)
    uses, shapes = recording.uses, recording.output_shapes
    rows = clipping.num_rows(batch)
    if self.clipped_sum_method == LAYERWISE:
      return self._layerwise_norm_pass(params, batch, keys, uses, shapes, rows)
    deltas = {k: jnp.zeros((rows,) + s.shape, s.dtype) for k, s in shapes.items()}
    losses, vjp_fn, inputs = jax.vjp(lambda p, d: self._forward(p, d, batch, keys), params, deltas,
                                     has_aux=True)
    # Backward of sum_i loss_i: the output gradient of every layer, for every example.
    _, out_grads = vjp_fn(jnp.ones_like(losses))
    reuse = self.clipped_sum_method == BOOKKEEPING and self.reuse_instantiated
    instantiated = {} if reuse else None
    sq = per_example_sq_norms(uses, inputs, out_grads, self.norm_method, instantiated, self.stack_layers)
    return NormPass(losses, jnp.sqrt(jnp.maximum(sum(sq.values()), 0.0)), uses, inputs, out_grads,
                    instantiated, vjp_fn, deltas)

  def _forward(self, p, d, examples, example_keys, probes=None, delta_axes=0):
    return per_example_forward(self.loss_fn, p, examples, example_keys, d, self.spmd_axis_name, probes,
                               delta_axes)

  def _layerwise_norm_pass(self, params, batch, keys, uses, shapes, rows) -> "NormPass":
    """`norm_pass` layer by layer: the probed layers' norms come out of the backward pass as the
    gradients of their zero taps; the other layers are recorded and normed as usual."""
    probes = Probes(NORMS, probed_keys(uses), self.norm_method)
    deltas = {k: (jnp.zeros((rows,) + ((s.shape[0],) if uses[k].stacked else ()), jnp.float32)
                  if k in probes.keys else jnp.zeros((rows,) + s.shape, s.dtype)) for k, s in shapes.items()}
    losses, vjp_fn, inputs = jax.vjp(lambda d: self._forward(params, d, batch, keys, probes), deltas,
                                     has_aux=True)
    (grads,) = vjp_fn(jnp.ones_like(losses))
    recorded = {k: use for k, use in uses.items() if k not in probes.keys}
    out_grads = {k: grads[k] for k in recorded}
    sq = list(per_example_sq_norms(recorded, inputs, out_grads, self.norm_method).values())
    sq += [grads[k] if grads[k].ndim == 1 else jnp.sum(grads[k], axis=1) for k in sorted(probes.keys)]
    return NormPass(losses, jnp.sqrt(jnp.maximum(sum(sq), 0.0)), uses, inputs, out_grads, None, None, deltas)

  def _layerwise_sum(self, params: PyTree, batch: Batch, keys: Optional[jax.Array], npass: "NormPass",
                     c: clipping.Clip) -> PyTree:
    """`sum_pass` layer by layer: the probed layers' weighted sums are the gradients of their zero
    accumulators in a second forward and backward pass (which waits for the clip scales); the
    recorded layers' come from their records (book-keeping)."""
    probes = Probes(SUMS, probed_keys(npass.uses), self.norm_method)
    flat_params = traverse_util.flatten_dict(params)
    scale = c.scale.astype(jnp.float32)
    rows = scale.shape[0]
    data = {k: (jnp.broadcast_to(scale[:, None], (rows, npass.deltas[k].shape[1])) if npass.uses[k].stacked
                else scale) for k in probes.keys}
    accs = {k: jnp.zeros(flat_params[npass.uses[k].param].shape, jnp.float32) for k in probes.keys}
    # The second pass's examples wait for the scales: its forward is not run early, beside the first.
    examples = jax.tree.map(lambda x: schedule.after(x, scale), batch)
    example_keys = None if keys is None else schedule.after(keys, scale)
    axes = {k: (0, None) for k in probes.keys}
    losses, vjp_fn, _ = jax.vjp(
        lambda acc: self._forward(params, {k: (data[k], acc[k]) for k in probes.keys}, examples, example_keys,
                                  probes, axes), accs, has_aux=True)
    (sums,) = vjp_fn(jnp.ones_like(losses))
    recorded = {k: use for k, use in npass.uses.items() if k not in probes.keys}
    flat = traverse_util.flatten_dict(weighted_grad_sum(params, recorded, npass.inputs, npass.out_grads, c.scale,
                                                        None, self.norm_method, keep=c.keep))
    flat.update({npass.uses[k].param: sums[k] for k in probes.keys})
    return traverse_util.unflatten_dict(flat)

  def sum_pass(self, params: PyTree, batch: Batch, keys: Optional[jax.Array], npass: "NormPass",
               c: clipping.Clip) -> PyTree:
    """The second half: sum_i scale_i grad l_i in float32, by book-keeping (the recorded inputs
    and output gradients, no second backward pass) or by a second backward pass."""
    if self.clipped_sum_method == LAYERWISE:
      return self._layerwise_sum(params, batch, keys, npass, c)
    if self.clipped_sum_method == SECOND_PASS:
      losses = npass.losses

      def reuse_forward(_):
        return npass.vjp_fn(c.scale.astype(losses.dtype))[0]

      def replace_dropped(_):
        # A dropped row's zero scale would meet its NaN activations (0 x NaN) in the reused
        # backward pass; recompute the forward with copies of a kept row in its place.
        examples, example_keys = clipping.replace_dropped((batch, keys), c.keep)
        _, vjp_kept, _ = jax.vjp(lambda p, d: self._forward(p, d, examples, example_keys), params,
                                 npass.deltas, has_aux=True)
        grads = vjp_kept(c.scale.astype(losses.dtype))[0]
        return jax.tree.map(lambda g: jnp.where(jnp.any(c.keep), g, jnp.zeros_like(g)), grads)

      grads = jax.lax.cond(jnp.all(jnp.isfinite(c.norms)), reuse_forward, replace_dropped, None)
      return jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    # The recorded rows of dropped examples are zeroed there: 0 * NaN would be NaN in the sums.
    return weighted_grad_sum(params, npass.uses, npass.inputs, npass.out_grads, c.scale, npass.instantiated,
                             self.norm_method, keep=c.keep, stack_layers=self.stack_layers)

  def ghost_clipped_sum(self, params: PyTree, batch: Batch, keys: Optional[jax.Array]
                        ) -> Tuple[PyTree, jax.Array, jax.Array, jax.Array]:
    """(sum_i w_i clip_C(grad l_i) [float32], losses [B], norms [B], factors [B]) of one batch."""
    npass = self.norm_pass(params, batch, keys)
    c = clipping.clip(npass.norms, batch["example_weight"], self.noisy_sum.clip_norm)
    return self.sum_pass(params, batch, keys, npass, c), npass.losses, c.norms, c.factors

  def clipped_sum(self, params: PyTree, batch: Batch, dropout_rng: Optional[jax.Array] = None
                  ) -> Tuple[PyTree, Dict[str, jax.Array]]:
    """Noiseless sum_i w_i clip_C(grad l_i) in float32 and its (non-DP) statistics."""
    batch, row_ids = clipping.split_row_ids(batch)
    keys = clipping.example_keys(dropout_rng, row_ids)
    npass = self.norm_pass(params, batch, keys)
    c = clipping.clip(npass.norms, batch["example_weight"], self.noisy_sum.clip_norm)
    grads = self.sum_pass(params, batch, keys, npass, c)
    stats = clipping.add_stats(clipping.init_stats(), npass.losses, batch["example_weight"], c)
    return grads, clipping.clipping_metrics(batch, *stats)

  def per_example_norms(self, params: PyTree, batch: Batch,
                        dropout_rng: Optional[jax.Array] = None) -> jax.Array:
    """Ghost per-example gradient norms [B] of a whole batch (no microbatching)."""
    rows = jnp.arange(clipping.num_rows(batch), dtype=jnp.int32)
    return self.norm_pass(params, batch, clipping.example_keys(dropout_rng, rows)).norms
