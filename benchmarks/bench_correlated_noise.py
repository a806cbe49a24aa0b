"""Correlated noise against independent Gaussian noise at a fixed ε: what it buys, measured.

  .venv/bin/python benchmarks/bench_correlated_noise.py --output_dir=/tmp/bench_mf
  .venv/bin/python benchmarks/bench_correlated_noise.py --output_dir=/tmp/bench_mf --table   # redraw only

Fills docs/correlated_noise.md, "Measured". For each ε (--epsilons, δ = --delta), each number
of epochs (--epochs) and each seed (--seeds), it trains T5 v1.0 tiny (prefix LM, inputs 32 and
targets 16 tokens) on real text (the first --documents documents of --corpus, 15% held out) with
the same steps, expected batch and compute, under each mechanism of --mechanisms:

* `gaussian`: DP-Adafactor with independent noise (Abadi et al. 2016), Poisson sampling;
* `banded:b`: banded matrix factorization with b bands, amplified by cyclic Poisson sampling over
  b groups (Choquette-Choo et al. 2023);
* `blt:b`: a buffered-linear-Toeplitz strategy with minimum separation b (McKenna et al. 2024;
  Dvijotham et al. 2024), cyclic Poisson sampling over b groups, not amplified.

σ is calibrated for each (mechanism, ε, steps) by the mechanism's own accounting; the learning
rate (constant, Adafactor) is the same for all. Reported per cell: the validation loss and token
accuracy (mean over seeds, 95% CI with Student's t) and σ. The timing part (`--part=timing`)
then trains each mechanism for 40 steps, interleaved over 3 rounds in one process so that the
machine's load falls on all alike, and reports the step time ÷ Gaussian's (median of the rounds)
and the noise state's bytes ÷ the parameters' bytes. The vocabulary is trained on the corpus's
next documents (public to the runs). Results: `correlated_noise.json` and `correlated_noise.md`
in --output_dir; a run that stops resumes from the cells already in the JSON file.
"""
import argparse
import json
import math
import os
import sys
import time

import scipy.stats

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PROJECT_ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _parser():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--output_dir", required=True)
  p.add_argument("--corpus", default=os.path.join(PROJECT_ROOT, "..", "shared", "data", "pretrain",
                                                  "fortunes.jsonl.gz"))
  p.add_argument("--documents", type=int, default=1400, help="documents of the corpus used (--validation_fraction held out)")
  p.add_argument("--validation_fraction", type=float, default=0.15)
  p.add_argument("--expected_batch_size", type=int, default=32, help="expected examples a step, every mechanism")
  p.add_argument("--epsilons", default="2,8")
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--epochs", default="1,4", help="passes over the data: steps = epochs · N / batch")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--mechanisms", default="gaussian,banded:2,banded:4,banded:8,blt:4")
  p.add_argument("--learning_rate", type=float, default=0.05,
                 help="constant Adafactor rate (0.05: the better of 0.01 and 0.05 for Gaussian noise, ε = 8, 1 epoch)")
  p.add_argument("--part", choices=("all", "grid", "timing"), default="all",
                 help="grid: the utility table; timing: step time and noise state, interleaved")
  p.add_argument("--table", action="store_true", help="only print the table from correlated_noise.json")
  return p


def _mechanism(spec: str):
  kind, _, bands = spec.partition(":")
  if kind not in ("gaussian", "banded", "blt"):
    raise SystemExit(f"unknown mechanism {spec!r}: gaussian, banded:b or blt:b")
  return kind, int(bands or 1)


def _ci(values):
  import numpy as np  # pylint: disable=g-import-not-at-top
  v = np.asarray(values, float)
  if len(v) < 2:
    return float(v.mean()), float("nan")
  return float(v.mean()), float(scipy.stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))


def _noise_state_ratio(dp, model_config, num_examples, batch_size, steps):
  """Bytes of the noise transform's state ÷ bytes of the parameters (shapes only, nothing run)."""
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.dp import mechanism as mechanism_lib  # pylint: disable=g-import-not-at-top
  from private_t5.dp import config  # pylint: disable=g-import-not-at-top
  from private_t5.models import network  # pylint: disable=g-import-not-at-top
  params = network.param_shapes(model_config)
  mech = mechanism_lib.build_mechanism(dp, config.ExecutionSettings(), loss_fn=lambda *a, **k: 0.0,
                                       num_examples=num_examples, privacy_unit="document", batch_size=batch_size,
                                       train_steps=steps, sampler_seed=0, log=lambda *_: None)
  state = jax.eval_shape(mech.noise.init, params)
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  return size(state) / size(params)


def _prefix_noise(results: dict) -> dict:
  """Per cell, ÷ Gaussian's at the same ε and steps: the variance of the noise on the running sums
  of the updates, mean over t of Var(Σ_{s≤t} noise_s) (the error each strategy minimises;
  Gaussian's is σ²·t), and the standard deviation of one step's noise (root mean square over
  the steps); from σ, the strategy's sensitivity and C⁻¹."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from private_t5.dp import strategies  # pylint: disable=g-import-not-at-top
  sigma = {(r["epsilon"], r["epochs"], r["mechanism"]): (r["sigma"], r["steps"]) for r in results["rows"]}
  out = {}
  for (eps, epochs, spec), (s, steps) in sigma.items():
    g = sigma.get((eps, epochs, "gaussian"))
    if g is None:
      continue
    kind, bands = _mechanism(spec)
    if kind == "gaussian":
      out[f"{eps:g}|{epochs:g}|{spec}"] = (1.0, 1.0)
      continue
    strategy = strategies.for_run(kind, steps=steps, num_bands=bands, log=lambda *_: None)
    inverse = np.linalg.inv(strategy.dense(steps))
    prefix = np.cumsum(inverse, axis=0)  # row t: Σ_{s≤t} (C⁻¹)_s
    scale = (s * strategy.sensitivity / g[0]) ** 2
    out[f"{eps:g}|{epochs:g}|{spec}"] = (
        float(scale * np.mean(np.sum(prefix ** 2, axis=1)) / np.mean(np.arange(1, steps + 1))),
        float(math.sqrt(scale * np.mean(np.sum(inverse ** 2, axis=1)))))
  return out


def _table(results: dict) -> str:
  rows, timing = results["rows"], results.get("timing", {})
  load = (f"; load during the runs {results['load_before']:.1f} → {results['load_after']:.1f}"
          if results.get("load_after") is not None else "")
  lines = [f"N = {results['num_examples']} training examples{load}", "",
           "| ε | epochs | steps | mechanism | σ | noise variance on the running sums ÷ Gaussian's | "
           "one step's noise std ÷ Gaussian's | validation loss (95% CI) | token accuracy (95% CI) |",
           "|---|---|---|---|---|---|---|---|---|"]
  prefix = results.get("prefix_noise", {})
  cells = {}
  for r in rows:
    cells.setdefault((r["epsilon"], r["epochs"], r["mechanism"]), []).append(r)
  for (eps, epochs, mech), runs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    loss, loss_ci = _ci([r["validation_loss"] for r in runs])
    acc, acc_ci = _ci([r["token_accuracy"] for r in runs])
    sums, step = prefix.get(f"{eps:g}|{epochs:g}|{mech}", (float("nan"), float("nan")))
    lines.append(f"| {eps:g} | {epochs:g} | {runs[0]['steps']} | {mech} | {runs[0]['sigma']:.3f} | {sums:.2f} | {step:.2f} | "
                 f"{loss:.3f} ± {loss_ci:.3f} | {acc:.4f} ± {acc_ci:.4f} |")
  if timing:
    lines += ["", f"Cost ({timing['steps']} steps a run, mechanisms interleaved, {timing['rounds']} rounds; load "
              f"{timing['load_before']:.1f} → {timing['load_after']:.1f}):", "",
              "| mechanism | noise state ÷ parameter bytes | step time ÷ Gaussian's (median of rounds) |",
              "|---|---|---|"]
    base = timing["seconds_per_step"]["gaussian"]
    for mech, per_round in timing["seconds_per_step"].items():
      ratio = sorted(a / b for a, b in zip(per_round, base))[len(base) // 2]
      lines.append(f"| {mech} | {timing['noise_state_ratio'][mech]:.2f} | {ratio:.2f} |")
  return "\n".join(lines) + "\n"


class _Setup:
  """The data, vocabulary and model every run shares (built once in --output_dir)."""

  def __init__(self, args):
    from private_t5.data import corpora, source as source_lib  # pylint: disable=g-import-not-at-top
    from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
    from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
    self.args, self.out = args, os.path.abspath(args.output_dir)
    os.makedirs(self.out, exist_ok=True)
    docs = list(corpora.iter_documents(args.corpus, max_documents=3 * args.documents))
    private, public = docs[:args.documents], docs[args.documents:]
    corpus_path = os.path.join(self.out, "train.jsonl")
    if not os.path.exists(corpus_path):
      with open(corpus_path + ".tmp", "w") as f:
        for d in private:
          f.write(json.dumps({"id": d.id, "text": d.text}) + "\n")
      os.replace(corpus_path + ".tmp", corpus_path)
    self.vocab_path = os.path.join(self.out, "spm.model")
    if not os.path.exists(self.vocab_path):
      spm.train_from_sentences([d.text for d in public], self.vocab_path, vocab_size=1000)
    make = lambda split: source_lib.make_source(
        corpus_path, self.vocab_path, objective="prefix_lm", feature_lengths={"inputs": 32, "targets": 16},
        split=split, validation_fraction=args.validation_fraction, cache_dir=os.path.join(self.out, "cache"),
        progress=False)
    self.train_data, self.validation_data = make("train"), make("validation")
    self.n = self.train_data.num_examples
    vocab_size = int(self.train_data.store.manifest["vocab_size"])
    self.config = config_lib.load_preset("t5_1_0_tiny", vocab_size=-(-vocab_size // 128) * 128)

  def dp_config(self, spec: str, epsilon: float):
    from private_t5.dp import mechanism as mechanism_lib  # pylint: disable=g-import-not-at-top
    from private_t5.dp import config  # pylint: disable=g-import-not-at-top
    kind, bands = _mechanism(spec)
    return config.DPConfig(clip_norm=1.0, target_epsilon=epsilon, delta=self.args.delta,
                                  expected_batch_size=self.args.expected_batch_size, vocab_is_public=True,
                                  **({} if kind == "gaussian" else {"noise": kind, "num_bands": bands}))

  def train(self, dp, steps: int, seed: int, model_dir: str) -> dict:
    from private_t5.train import main as train_main, optimizers  # pylint: disable=g-import-not-at-top
    return train_main.train(
        model_config=self.config, train_data=self.train_data, validation_data=self.validation_data,
        model_dir=model_dir, train_steps=steps, batch_size=self.args.expected_batch_size, dp=dp,
        vocab_path=self.vocab_path, learning_rate=optimizers.constant_schedule(self.args.learning_rate),
        checkpoint_every=steps, eval_examples=512, log_every=max(steps // 2, 1), mesh_shape=(1, 1),
        insecure_deterministic_seed=1000 + seed, log=lambda *_: None)


def _save(results: dict, path: str) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=1)
  os.replace(path + ".tmp", path)


def _grid(setup: _Setup, results: dict, json_path: str) -> None:
  """Every (ε, epochs, mechanism, seed) not yet in `results`: validation loss and accuracy."""
  from private_t5.train import metrics  # pylint: disable=g-import-not-at-top
  args, batch = setup.args, setup.args.expected_batch_size
  done = {(r["epsilon"], r["epochs"], r["mechanism"], r["seed"]) for r in results["rows"]}
  for eps in [float(e) for e in args.epsilons.split(",")]:
    for epochs in [float(e) for e in args.epochs.split(",")]:
      steps = max(int(round(epochs * setup.n / batch)), 1)
      for spec in args.mechanisms.split(","):
        dp = setup.dp_config(spec, eps)
        for seed in [int(s) for s in args.seeds.split(",")]:
          if (eps, epochs, spec, seed) in done:
            continue
          t0, c0 = time.time(), time.process_time()
          summary = setup.train(dp, steps, seed, os.path.join(
              setup.out, "runs", f"eps{eps:g}_ep{epochs:g}_{spec.replace(':', '')}_s{seed}"))
          validation = metrics.validation_metrics(summary)
          row = {"epsilon": eps, "epochs": epochs, "steps": steps, "mechanism": spec, "seed": seed,
                 "sigma": summary.get("noise_multiplier"), "training_epsilon": summary.get("training_epsilon"),
                 "validation_loss": validation["loss"], "token_accuracy": validation["token_accuracy"],
                 "steps_per_second": summary["steps_per_second"], "wall_s": time.time() - t0,
                 "cpu_s": time.process_time() - c0}
          results["rows"].append(row)
          print(f"[bench] {row}", flush=True)
          results["load_after"] = os.getloadavg()[0]
          _save(results, json_path)


def _timing(setup: _Setup, results: dict, json_path: str, steps: int = 40, rounds: int = 3) -> None:
  """Seconds a step of each mechanism (ε = 8, compile excluded), interleaved over `rounds`, and
  the noise state's size; side by side in one process so that the load falls on all alike."""
  specs = setup.args.mechanisms.split(",")
  timing = {"steps": steps, "rounds": rounds, "load_before": os.getloadavg()[0],
            "seconds_per_step": {s: [] for s in specs},
            "noise_state_ratio": {s: _noise_state_ratio(setup.dp_config(s, 8.0), setup.config, setup.n,
                                                        setup.args.expected_batch_size, steps) for s in specs}}
  for r in range(rounds):
    for spec in specs:
      summary = setup.train(setup.dp_config(spec, 8.0), steps, 0,
                            os.path.join(setup.out, "timing", f"{spec.replace(':', '')}_r{r}"))
      timing["seconds_per_step"][spec].append(1.0 / summary["steps_per_second"])
      print(f"[timing] round {r} {spec}: {1.0 / summary['steps_per_second']:.4f} s a step", flush=True)
  timing["load_after"] = os.getloadavg()[0]
  results["timing"] = timing
  _save(results, json_path)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  json_path = os.path.join(os.path.abspath(args.output_dir), "correlated_noise.json")
  if args.table:
    with open(json_path) as f:
      saved = json.load(f)
    print(_table(dict(saved, prefix_noise=_prefix_noise(saved))))
    return 0
  setup = _Setup(args)
  results = {"settings": vars(args), "num_examples": setup.n, "rows": [], "load_before": os.getloadavg()[0]}
  if os.path.exists(json_path):
    with open(json_path) as f:
      saved = json.load(f)
    if saved.get("settings", {}).get("corpus") == args.corpus:
      results.update(rows=saved["rows"], load_before=saved.get("load_before", results["load_before"]),
                     load_after=saved.get("load_after"))
  if args.part in ("all", "grid"):
    _grid(setup, results, json_path)
  if args.part in ("all", "timing"):
    _timing(setup, results, json_path)
  results["prefix_noise"] = _prefix_noise(results)
  _save(results, json_path)
  table = _table(results)
  with open(os.path.join(setup.out, "correlated_noise.md"), "w") as f:
    f.write(table)
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
