"""The train state (params, optimizer state, noise state, step) and the run's secret randomness.

All randomness of a run comes from one 64-bit root seed:

* the parameter initialisation key,
* the dropout and DP-noise base keys; the key of step t is `fold_in(base, t)`, so a resumed
  run continues the sequence and never reuses a step's key (DP rule "noise keys are secret and never reused"),
* the sampler seed (which examples each step draws) and the data seed (the objective's
  random noise, e.g. which spans are corrupted, for step t).

The root seed comes from OS entropy (`secrets.randbits`) unless the run sets an explicit
`insecure_deterministic_seed` (tests, reproductions). It is kept apart from everything a user
publishes, in MODEL_DIR/secrets/run_seeds.json (mode 0600 in a 0700 folder, written before the
first checkpoint: `checkpoints.write_run_seeds`), so that a resumed run continues the same
streams; the checkpoints' metadata only say where it is and whether it was fixed. With the seed
anyone regenerates every step's noise and subtracts it: the secrets file is as private as the
training data. So are the checkpoints of a correlated-noise run (`TrainState.noise_state` holds
recent steps' noise) and those written before the secrets file existed (their metadata held the
seed); release exported parameters only (`private-t5 export`, docs/privacy.md).
"""
import dataclasses
import secrets
from typing import Any, Optional

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

PyTree = Any

# Domain separation between the streams derived from the root seed.
_INIT_STREAM, _DROPOUT_STREAM, _NOISE_STREAM, _SAMPLER_STREAM, _DATA_STREAM = range(5)


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True)
class TrainState:
  """What one train step reads and writes.

  Attributes:
    step: int32 scalar, the number of steps taken (also the data position: batch t is a
      pure function of the sampler seed and t).
    params: the model parameters.
    opt_state: the optimizer (Adafactor) state.
    noise_state: the state of the noise transform (`noise.init(params)`; float32 arrays shaped
      like the parameters for correlated noise, e.g. the previous steps' noise), threaded
      through every step and saved in every checkpoint so that a resumed run continues it
      exactly (which makes such checkpoints private: with it part of the noise can be
      subtracted). A stateless transform's state (`optax.EmptyState()`, None) has no array.
    holds_noise_state: whether `noise_state` is a child of the pytree; by default whether it
      has an array. An empty one is not, so that the checkpoints of stateless runs hold the
      same entries (step, params, opt_state) as before the field existed, and still read back.
      Kept by every tree operation (a tree of the state's shardings, or of Nones, has the same
      structure as the state).
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  noise_state: PyTree = None
  holds_noise_state: Optional[bool] = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    if self.holds_noise_state is None:
      object.__setattr__(self, "holds_noise_state", has_arrays(self.noise_state))

  def tree_flatten_with_keys(self):
    children = [(jax.tree_util.GetAttrKey(name), getattr(self, name)) for name in ("step", "params", "opt_state")]
    if self.holds_noise_state:
      return children + [(jax.tree_util.GetAttrKey("noise_state"), self.noise_state)], ()
    # The empty state's structure (hashable, unlike e.g. an empty dict) is the aux data; in a
    # tuple, which compares unequal to the other aux without comparing a PyTreeDef to ().
    return children, (jax.tree.structure(self.noise_state),)

  @classmethod
  def tree_unflatten(cls, aux, children):
    if not aux:
      return cls(*children, holds_noise_state=True)
    return cls(*children, noise_state=jax.tree.unflatten(aux[0], []), holds_noise_state=False)

  def replace(self, **changes) -> "TrainState":
    if "noise_state" in changes:
      changes.setdefault("holds_noise_state", None)  # decided again for the new state
    return dataclasses.replace(self, **changes)


def has_arrays(tree: PyTree) -> bool:
  """True when `tree` has at least one leaf (an empty state such as `optax.EmptyState()` has none)."""
  return bool(jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class RunSeeds:
  """The root seed and every key/seed derived from it.

  Attributes:
    root_seed: 64-bit integer; secret unless `deterministic`.
    deterministic: True when `root_seed` was given by the user (insecure: no DP noise secrecy).
  """
  root_seed: int
  deterministic: bool = False

  @classmethod
  def create(cls, insecure_deterministic_seed: Optional[int] = None) -> "RunSeeds":
    """From OS entropy, or from `insecure_deterministic_seed` when given."""
    if insecure_deterministic_seed is None:
      return cls(root_seed=secrets.randbits(64), deterministic=False)
    return cls(root_seed=int(insecure_deterministic_seed) % (1 << 64), deterministic=True)

  def shared_across_processes(self) -> "RunSeeds":
    """The seeds of process 0 on every process (itself with one process).

    Several processes must agree on the root seed (same Poisson samples, same noise key): the
    one process 0 drew (OS entropy) or restored is broadcast to the others.
    """
    if jax.process_count() == 1:
      return self
    words = np.asarray([self.root_seed >> 32, self.root_seed & 0xFFFFFFFF, int(self.deterministic)], np.uint32)
    words = np.asarray(multihost_utils.broadcast_one_to_all(words))
    return RunSeeds(root_seed=int(words[0]) << 32 | int(words[1]), deterministic=bool(words[2]))

  def _stream_key(self, stream: int) -> jax.Array:
    # A raw threefry key from all 64 bits of the seed (PRNGKey(int) keeps only 32 bits
    # without x64), then one fold_in per stream.
    raw = jnp.asarray([self.root_seed >> 32, self.root_seed & 0xFFFFFFFF], dtype=jnp.uint32)
    return jax.random.fold_in(raw, stream)

  @property
  def init_key(self) -> jax.Array:
    return self._stream_key(_INIT_STREAM)

  @property
  def dropout_base_key(self) -> jax.Array:
    return self._stream_key(_DROPOUT_STREAM)

  @property
  def noise_base_key(self) -> jax.Array:
    return self._stream_key(_NOISE_STREAM)

  def _host_seed(self, stream: int, *extra: int) -> int:
    state = np.random.SeedSequence([self.root_seed, stream, *extra]).generate_state(2, np.uint32)
    return int(state[0]) << 32 | int(state[1])

  @property
  def sampler_seed(self) -> int:
    """Seed of the batch sampler (secret in a DP run: amplification by sampling needs it)."""
    return self._host_seed(_SAMPLER_STREAM)

  def data_seed(self, step: int) -> int:
    """Seed of the objective's randomness for the batch of `step` (fresh every step)."""
    return self._host_seed(_DATA_STREAM, int(step)) & 0x7FFFFFFF

  def to_dict(self) -> dict:
    """The seeds as JSON (the content of the secrets file; secret unless `deterministic`)."""
    return {"root_seed": str(self.root_seed), "deterministic": self.deterministic}

  @classmethod
  def from_dict(cls, d: dict) -> "RunSeeds":
    return cls(root_seed=int(d["root_seed"]), deterministic=bool(d["deterministic"]))


def step_keys(dropout_base_key: jax.Array, noise_base_key: jax.Array, step: jax.Array):
  """(dropout key, noise key) of step `step`: `fold_in(base, step)` (traceable under jit)."""
  return jax.random.fold_in(dropout_base_key, step), jax.random.fold_in(noise_base_key, step)
