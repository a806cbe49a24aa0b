"""Adaptive DP (ADP, Wu et al. 2022): noise scaled by the batch's estimated privacy probability.

1. Privacy probability (Wu et al. 2022, Sec. 4.1, Eqs. 3-4): each training example s is scored by
   its perplexity P(s) = exp(mean token cross-entropy) under a public *reference* model (a
   private_t5 checkpoint trained on public data), and rho(s) = normalize(P(s)) in [0, 1]: text
   the reference model finds surprising is more likely to be private.
2. Privacy weight (Eq. 5): gamma_B = mean of rho over the real rows of batch B.
3. Adaptive noise (Eq. 6): the DP-SGD sum of clipped gradients gets N(0, (gamma_B sigma C)^2)
   noise instead of N(0, (sigma C)^2); everything else (clip C, division by the public q N,
   Adafactor) is unchanged. This is Adaptive-DP-Adafactor.

Privacy: gamma_B is computed from the private batch, so the noise scale itself depends on the
data. The mechanism is therefore NOT (epsilon, delta)-DP as stated for DP-SGD; its report gives
the formal guarantee as none (epsilon = infinity in the ledger) and, as Wu et al. (2022) do, the
epsilon that the per-step effective noise multipliers sigma * gamma_t WOULD imply if they had
been fixed in advance. That number is a heuristic summary, never a DP guarantee.
"""
import copy
import dataclasses
import json
import math
import os
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from private_t5.models import model
from private_t5.dp import accounting
from private_t5.dp import aggregator as aggregator_lib
from private_t5.dp import privacy_report
from private_t5.dp import noise as noise_lib
from private_t5.errors import CheckpointError, ConfigError, DataError
from private_t5.io import atomic_open, file_sha256
from private_t5.models import checkpoint_read

NORMALIZATIONS = ("max", "minmax", "rank")
# Batch column added by `AdaptiveSource`: rho of each row (0 for padding rows).
PRIVACY_PROBABILITY = "privacy_probability"
METRIC_PRIVACY_WEIGHT = noise_lib.NOISE_SCALE_METRIC  # "nondp/privacy_weight": γ_B scales the noise
REPORT_FILENAME = privacy_report.ADAPTIVE_REPORT_FILENAME
PROBABILITIES_FILENAME = "privacy_probabilities.npz"
FORMAL_GUARANTEE = (
    "none: the noise std sigma*gamma_B*C depends on the private batch through gamma_B, so the "
    "(epsilon, delta)-DP guarantee of DP-SGD does not hold as stated; the ledger records "
    "epsilon = infinity")
IMPLIED_EPSILON_NOTE = (
    "implied_epsilon composes, with the same accountant, one Poisson-sampled Gaussian step of "
    "noise multiplier sigma*gamma_t for every step t, as if each gamma_t had been fixed before "
    "training (Wu et al. 2022, Table 1). It is a heuristic comparison number, NOT a DP guarantee.")


# -- privacy probabilities (Eqs. 3-4) -------------------------------------------------------------

def normalize(perplexities: np.ndarray, method: str = "max") -> np.ndarray:
  """rho = normalize(P) in [0, 1] (Wu et al. 2022, Eq. 4; the paper leaves the operator open).

  * "max":    rho = P / max P (proportional to P, as Wu et al.'s rho(s) ∝ P(s)).
  * "minmax": rho = (P - min P) / (max P - min P).
  * "rank":   rho = empirical CDF of P (robust to a few extreme perplexities).
  """
  p = np.asarray(perplexities, np.float64)
  if p.size == 0 or not np.all(np.isfinite(p)) or np.any(p <= 0):
    raise DataError("perplexities must be a non-empty array of finite positive numbers")
  if method == "max":
    rho = p / p.max()
  elif method == "minmax":
    span = p.max() - p.min()
    rho = (p - p.min()) / span if span > 0 else np.ones_like(p)
  elif method == "rank":
    order = np.argsort(np.argsort(p, kind="stable"), kind="stable")
    rho = (order + 1) / len(p)
  else:
    raise ConfigError(f"normalization must be one of {NORMALIZATIONS}, got {method!r}")
  return np.clip(rho, 0.0, 1.0).astype(np.float32)


@dataclasses.dataclass
class PrivacyProbabilities:
  """rho of every training example, with the perplexities it came from."""
  perplexity: np.ndarray
  rho: np.ndarray
  normalization: str
  reference_model_dir: str
  seed: int

  def save(self, path: str) -> str:
    with atomic_open(path, "wb") as f:
      np.savez(f, perplexity=self.perplexity, rho=self.rho,
               meta=json.dumps({"normalization": self.normalization,
                                "reference_model_dir": self.reference_model_dir, "seed": self.seed}))
    return path

  @classmethod
  def load(cls, path: str) -> "PrivacyProbabilities":
    if not os.path.isfile(path):
      raise DataError(f"privacy probabilities not found: {path}")
    with np.load(path) as z:
      meta = json.loads(str(z["meta"]))
      return cls(perplexity=z["perplexity"], rho=z["rho"], **meta)

  def summary(self) -> Dict[str, float]:
    return {"num_examples": int(len(self.rho)), "rho_mean": float(self.rho.mean()),
            "rho_min": float(self.rho.min()), "rho_max": float(self.rho.max()),
            "perplexity_median": float(np.median(self.perplexity)),
            "perplexity_max": float(self.perplexity.max()), "normalization": self.normalization,
            "reference_model_dir": self.reference_model_dir}


def _perplexity_fn(model_config):
  # Eq. 3: exp of the mean token negative log-likelihood.
  return jax.jit(model.EncoderDecoderModel(model_config).per_example_perplexity)


def example_perplexities(params, model_config, source, *, batch_size: int = 64, seed: int = 0,
                         log: Callable[[str], None] = print) -> np.ndarray:
  """P(s) of one draw (objective seed `seed`) of every example of `source`, float64[N]."""
  fn = _perplexity_fn(model_config)
  n = source.num_examples
  out = np.zeros(n, np.float64)
  keys = ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")
  for start in range(0, n, batch_size):
    indices = np.arange(start, min(start + batch_size, n), dtype=np.int64)
    batch = source.get_batch(indices, seed, batch_size)
    values = np.asarray(fn(params, {k: batch[k] for k in keys}))
    out[indices] = values[:len(indices)]
    done = start + len(indices)
    if done == n or (start // batch_size) % 50 == 49:
      log(f"[adaptive] perplexity of {done}/{n} examples under the reference model")
  return out


def estimate_privacy_probabilities(reference_model_dir: Optional[str], source, *,
                                   normalization: str = "max", batch_size: int = 64, seed: int = 0,
                                   log: Callable[[str], None] = print) -> PrivacyProbabilities:
  """rho(s) of every example of `source` under the public reference model in `reference_model_dir`.

  Raises:
    ConfigError: no reference model given, or its vocabulary does not cover the data's.
    CheckpointError: `reference_model_dir` has no readable checkpoint.
  """
  if not reference_model_dir:
    raise ConfigError("adaptive DP needs a public reference model checkpoint (reference_model_dir) to "
                      "estimate privacy probabilities from perplexity; none was given")
  if normalization not in NORMALIZATIONS:
    raise ConfigError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
  if not os.path.isdir(reference_model_dir):
    raise CheckpointError(f"reference model checkpoint not found: {reference_model_dir!r}")
  params, model_config, info = checkpoint_read.restore_for_inference(reference_model_dir)
  vocab_size = source.vocab_size
  if vocab_size > model_config.vocab_size:
    raise ConfigError(f"reference model {reference_model_dir} has vocab_size {model_config.vocab_size} but the "
                      f"training data uses {vocab_size} ids: it must share the training vocabulary")
  data_vocab = source.describe().get("vocab_path")
  if info.get("vocab_path") and data_vocab and _sha256(info["vocab_path"]) != _sha256(data_vocab):
    raise ConfigError(f"reference model {reference_model_dir} was trained with vocabulary {info['vocab_path']}, "
                      f"the training data with {data_vocab}: perplexities would be meaningless")
  log(f"[adaptive] scoring {source.num_examples} examples with the reference model {reference_model_dir} "
      f"(step {info['step']})")
  perplexity = example_perplexities(params, model_config, source, batch_size=batch_size, seed=seed, log=log)
  return PrivacyProbabilities(perplexity=perplexity, rho=normalize(perplexity, normalization),
                              normalization=normalization, reference_model_dir=os.path.abspath(reference_model_dir),
                              seed=seed)


def _sha256(path: str) -> Optional[str]:
  return file_sha256(path) if os.path.isfile(path) else None


class AdaptiveSource:
  """The `train.main.ExampleSource` `source` whose batches carry each row's rho in `privacy_probability`."""

  def __init__(self, source, rho: np.ndarray):
    rho = np.asarray(rho, np.float32)
    if rho.shape != (source.num_examples,):
      raise DataError(f"privacy probabilities cover {rho.shape[0] if rho.ndim else 0} examples but the "
                      f"source has {source.num_examples}; recompute them for this data")
    if not np.all((rho >= 0) & (rho <= 1)):
      raise DataError("privacy probabilities must lie in [0, 1]")
    self.source = source
    self.rho = rho

  @property
  def num_examples(self) -> int:
    return self.source.num_examples

  @property
  def privacy_unit(self) -> str:
    return self.source.privacy_unit

  @property
  def feature_lengths(self) -> Mapping[str, int]:
    return self.source.feature_lengths

  @property
  def vocab_size(self) -> int:
    return self.source.vocab_size

  def describe(self) -> Dict[str, Any]:
    return self.source.describe()

  def get_batch(self, indices, seed: int, batch_size: int) -> Dict[str, np.ndarray]:
    batch = self.source.get_batch(indices, seed, batch_size)
    index = batch["example_index"]
    batch[PRIVACY_PROBABILITY] = np.where(index >= 0, self.rho[np.maximum(index, 0)], 0.0).astype(np.float32)
    return batch


# -- adaptive noise (Eqs. 5-6) --------------------------------------------------------------------

def privacy_weight(rho: jax.Array, example_weight: jax.Array) -> jax.Array:
  """gamma_B = sum_i w_i rho_i / sum_i w_i over the real rows (Eq. 5); 1 for an empty batch.

  An empty batch gets the full noise (gamma = 1): its sum is zero, and lowering the noise
  there would only reveal that the batch was empty.
  """
  w = example_weight.astype(jnp.float32)
  return privacy_weight_from_sums(jnp.sum(w * rho.astype(jnp.float32)), jnp.sum(w))


def privacy_weight_from_sums(rho_sum: jax.Array, weight_sum: jax.Array) -> jax.Array:
  """`privacy_weight` from sum_i w_i rho_i and sum_i w_i (added over a step's microbatches)."""
  gamma = rho_sum / jnp.maximum(weight_sum, 1.0)
  return jnp.where(weight_sum > 0, jnp.clip(gamma, 0.0, 1.0), 1.0)


class AdaptiveDPAggregator:
  """Adaptive DP's clipped sum: the DP clipped sum, and γ_B for the noise transform.

  A clipped-sum function like `dp.aggregator.DPAggregator` (`zero_sum`, `accumulate`, `finish`,
  or a call on one batch) whose batches carry `privacy_probability` (AdaptiveSource). It
  accumulates sum_i w_i rho_i and sum_i w_i over the step's microbatches beside the clipped sum,
  and `finish` reports γ_B (Eq. 5) as the metric `dp.noise.NOISE_SCALE_METRIC`: the run's
  noise transform (`dp.noise.noise_transform`, the same as DP training's) scales its std by it,
  z = γ_B · N(0, σ²C²) on the sum (Eq. 6). Clip, sum and the public divisor q N are DP-SGD's.
  """

  def __init__(self, dp_aggregator: aggregator_lib.DPAggregator):
    if not isinstance(dp_aggregator, aggregator_lib.DPAggregator):
      raise ConfigError(f"AdaptiveDPAggregator wraps a DPAggregator, got {type(dp_aggregator).__name__}")
    self.dp = dp_aggregator

  @property
  def noisy_sum(self):
    """The wrapped clipped sum's σ, C and q N (what the noise transform reads)."""
    return self.dp.noisy_sum

  @property
  def loss_fn(self):
    return self.dp.loss_fn

  @loss_fn.setter
  def loss_fn(self, value):  # the trainer binds a LoRA base here
    self.dp = copy.copy(self.dp)
    self.dp.loss_fn = value

  # The accumulator is the DP clipped sum's, its sums dict with two more entries.
  _SUMS = ("rho_sum", "rho_weight_sum")

  def _split(self, acc):
    grad_sum, sums = acc
    return (grad_sum, {k: v for k, v in sums.items() if k not in self._SUMS}), [sums[k] for k in self._SUMS]

  def zero_sum(self, params):
    grad_sum, sums = self.dp.zero_sum(params)
    return grad_sum, dict(sums, **{k: jnp.float32(0) for k in self._SUMS})

  def accumulate(self, params, acc, micro, dropout_rng: Optional[jax.Array]):
    if PRIVACY_PROBABILITY not in micro:
      raise ConfigError(f"adaptive DP batches need a {PRIVACY_PROBABILITY!r} column (wrap the source "
                        "in AdaptiveSource)")
    inner, (rho_sum, weight_sum) = self._split(acc)
    model_batch = {k: v for k, v in micro.items() if k != PRIVACY_PROBABILITY}
    w = micro["example_weight"].astype(jnp.float32)
    grad_sum, sums = self.dp.accumulate(params, inner, model_batch, dropout_rng)
    rho_sum = rho_sum + jnp.sum(w * micro[PRIVACY_PROBABILITY].astype(jnp.float32))
    return grad_sum, dict(sums, rho_sum=rho_sum, rho_weight_sum=weight_sum + jnp.sum(w))

  def finish(self, params, acc):
    inner, (rho_sum, weight_sum) = self._split(acc)
    grads, metrics = self.dp.finish(params, inner)
    metrics = dict(metrics)
    metrics[METRIC_PRIVACY_WEIGHT] = privacy_weight_from_sums(rho_sum, weight_sum)
    return grads, metrics

  def __call__(self, params, batch, *, dropout_rng: Optional[jax.Array] = None):
    """(the noiseless clipped sum of one batch / q N, its metrics with γ_B)."""
    return self.finish(params, self.accumulate(params, self.zero_sum(params), batch, dropout_rng))


# -- what the run may claim -----------------------------------------------------------------------

def step_privacy_weights(sampler, rho: np.ndarray, steps: int) -> np.ndarray:
  """gamma_t of steps 0..steps-1, recomputed from the stateless sampler (resume-safe)."""
  out = np.ones(steps, np.float64)
  for t in range(steps):
    idx = sampler.indices_for_step(t)
    if len(idx):
      out[t] = float(np.clip(np.mean(rho[idx]), 0.0, 1.0))
  return out


def implied_epsilon(noise_multiplier: float, gammas: Sequence[float], sampling_rate: float, delta: float,
                    accountant: str = "rdp", resolution: float = 1e-3) -> float:
  """epsilon of composing one sampled-Gaussian step with multiplier sigma*gamma_t per step.

  gamma_t are rounded down to `resolution` (less noise: a larger, conservative number) and
  equal values are self-composed. Infinite when some step has no noise.
  """
  gammas = np.floor(np.asarray(gammas, np.float64) / resolution) * resolution
  if len(gammas) == 0:
    return 0.0
  if np.any(gammas <= 0):
    return math.inf
  return accounting.varying_noise_epsilon(noise_multiplier * gammas, sampling_rate, delta, accountant)


def adaptive_report(*, noise_multiplier: float, clip_norm: float, sampling_rate: float, delta: float,
                    accountant: str, gammas: np.ndarray, probabilities: PrivacyProbabilities,
                    privacy_unit: str, num_examples: int) -> Dict[str, Any]:
  """The ADP privacy report: no formal guarantee, plus Wu et al.'s (2022) implied-epsilon number."""
  steps = int(len(gammas))
  nominal = accounting.compute_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant) if steps else 0.0
  implied = implied_epsilon(noise_multiplier, gammas, sampling_rate, delta, accountant)
  return {
      "mechanism": "adaptive DP (Wu et al. 2022): DP-SGD clip/sum/divide-by-qN with noise std sigma*gamma_B*C, "
                   "gamma_B = mean privacy probability of the batch's real rows",
      "dp": False,
      "formal_guarantee": FORMAL_GUARANTEE,
      "epsilon": None,
      "implied_epsilon": None if math.isinf(implied) else implied,
      "implied_epsilon_note": IMPLIED_EPSILON_NOTE,
      "epsilon_of_nominal_sigma_not_achieved": nominal,
      "delta": delta,
      "accountant": accountant,
      "noise_multiplier": noise_multiplier,
      "clip_norm": clip_norm,
      "sampling_rate": sampling_rate,
      "steps": steps,
      "privacy_unit": privacy_unit,
      "num_examples": num_examples,
      "privacy_weight": ({"mean": float(np.mean(gammas)), "min": float(np.min(gammas)),
                          "max": float(np.max(gammas))} if steps else None),
      "effective_noise_multiplier": ({"mean": float(noise_multiplier * np.mean(gammas)),
                                      "min": float(noise_multiplier * np.min(gammas))} if steps else None),
      "privacy_probabilities": probabilities.summary(),
  }
