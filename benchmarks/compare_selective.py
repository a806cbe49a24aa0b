"""Non-DP vs DP vs Just Fine-tune Twice vs Adaptive DP on a corpus with inserted canaries.

  .venv/bin/python benchmarks/compare_selective.py --output_dir=/tmp/compare_selective
  .venv/bin/python benchmarks/compare_selective.py --gin_file=configs/experiments/compare_selective.gin \
      [--gin.compare_selective.steps=400] [--output_dir=...]

Settings come from flags, or from a Gin file binding `compare_selective.<flag>` (flags given on
the command line win over the Gin file).

Steps (a tiny model, short lengths: minutes on a laptop CPU):
1. Training corpus: the first --documents documents of --corpus with canaries
   "My ID is NNNN" inserted 1, 10 and 100 times (`eval.canaries`); public data: the next
   --documents documents (never trained on privately), which also give the vocabulary.
2. D' = the canary corpus redacted at --level (`selective.redaction`).
3. Four models, same architecture, steps and batch:
   * non-DP: Adafactor on the canary corpus;
   * DP: DP-Adafactor (sigma = --sigma) on it;
   * JFT: phase 1 non-private on D', phase 2 DP (same sigma and steps as DP) from phase 1;
   * ADP: a public reference model (non-private, public data) gives rho; Adaptive-DP-Adafactor
     with the same sigma, steps and batch as DP.
4. Utility: teacher-forced validation loss and token accuracy on held-out documents.
   Memorization: exact exposure of every canary (all |R| = 10^4 secrets scored).
5. One table (Markdown and JSON) and one plot (PNG) in --output_dir.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PROJECT_ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

METHODS = ("non-DP", "DP", "JFT", "ADP")


def _parser():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--output_dir", required=True)
  p.add_argument("--corpus", default=os.path.join(PROJECT_ROOT, "..", "shared", "data", "pretrain",
                                                  "fortunes.jsonl.gz"))
  p.add_argument("--documents", type=int, default=2000, help="training documents (and as many public ones)")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--expected_batch_size", type=float, default=None,
                 help="q N; default: the largest with truncation probability <= 1e-6 per step")
  p.add_argument("--sigma", type=float, default=0.6)
  p.add_argument("--level", default="entity", help="detector level of D'")
  p.add_argument("--normalization", default="rank", help="ADP's perplexity -> rho normalization")
  p.add_argument("--repetitions", default="1,10,100")
  p.add_argument("--learning_rate", type=float, default=0.01)
  p.add_argument("--seed", type=int, default=0, help="insecure deterministic seed (a benchmark)")
  p.add_argument("--replot", action="store_true", help="only redraw the plot from compare_selective.json")
  return p


def _model_config(vocab_size):
  from private_t5.models.config import T5Config  # pylint: disable=g-import-not-at-top
  return T5Config(vocab_size=-(-vocab_size // 128) * 128, d_model=64, num_heads=2, d_ff=128,
                  num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0)


def _exposures(model_dir, vocab, fmt, canaries):
  from private_t5.eval import exposure, memorization  # pylint: disable=g-import-not-at-top
  from private_t5.models import checkpoint_read  # pylint: disable=g-import-not-at-top
  params, config, _ = checkpoint_read.restore_for_inference(model_dir)
  evaluator = exposure.ExposureEvaluator(memorization.make_scorer(params, config),
                                         exposure.CandidateEncoder(vocab, fmt, exposure.PREFIX_SCORING),
                                         batch_size=1000)
  return evaluator.evaluate(canaries)


def plot(rows, reps_sorted, max_exposure, png_path):
  """Utility bars and exposure-vs-repetitions lines, side by side, written to `png_path`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  xs = np.arange(len(rows))
  ax1.bar(xs, [r["validation_token_accuracy"] for r in rows], color=["grey", "C0", "C1", "C2"])
  ax1.set_xticks(xs, [r["method"] for r in rows])
  ax1.set_ylabel("validation token accuracy")
  ax1.set_title("Utility")
  for k, row in enumerate(rows):
    ys = [row["exposure_by_repetitions"][r] for r in reps_sorted]
    ax2.plot([int(r) for r in reps_sorted], ys, marker="o", label=row["method"],
             color=["grey", "C0", "C1", "C2"][k])
  ax2.axhline(max_exposure, ls="--", color="k", lw=0.8, label="max exposure")
  ax2.set_xscale("symlog", linthresh=1)
  ax2.set_xlim(left=0)
  ax2.set_xticks([int(r) for r in reps_sorted], reps_sorted)
  ax2.set_xlabel("canary repetitions (0 = never inserted)")
  ax2.set_ylabel("exposure (bits)")
  ax2.set_title("Canary exposure")
  ax2.legend()
  fig.tight_layout()
  fig.savefig(png_path + ".tmp.png", dpi=120)
  os.replace(png_path + ".tmp.png", png_path)
  plt.close(fig)
  return png_path


def _gin_defaults(argv):
  """(argv without Gin flags, {flag: value} bound to `compare_selective` in the Gin files)."""
  from private_t5.stages import gin_utils  # pylint: disable=g-import-not-at-top
  from private_t5.stages import gin_args  # pylint: disable=g-import-not-at-top
  from private_t5.errors import ConfigError  # pylint: disable=g-import-not-at-top
  rest, files, bindings = gin_args.split_gin_args(sys.argv[1:] if argv is None else argv)
  if not files and not bindings:
    return rest, {}
  import gin  # pylint: disable=g-import-not-at-top
  gin_utils.external(lambda **kwargs: kwargs, "compare_selective")
  try:
    gin_utils.parse(files, bindings)
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  values = dict(gin.get_bindings("compare_selective"))
  flags = {a.dest for a in _parser()._actions}  # pylint: disable=protected-access
  unknown = sorted(set(values) - flags)
  if unknown:
    raise SystemExit(f"error: compare_selective has no setting(s) {unknown}; valid: {sorted(flags - {'help'})}")
  if isinstance(values.get("repetitions"), (list, tuple)):
    values["repetitions"] = ",".join(str(r) for r in values["repetitions"])
  return rest, values


def main(argv=None):
  argv, defaults = _gin_defaults(argv)
  parser = _parser()
  parser.set_defaults(**defaults)
  if "output_dir" in defaults:
    for action in parser._actions:  # pylint: disable=protected-access
      if action.dest == "output_dir":
        action.required = False
  args = parser.parse_args(argv)
  from private_t5.data import corpora, source as source_lib  # pylint: disable=g-import-not-at-top
  from private_t5.eval import canaries as canaries_lib  # pylint: disable=g-import-not-at-top
  from private_t5.selective import adaptive_train, jft, redaction  # pylint: disable=g-import-not-at-top
  from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
  from private_t5.dp import config as config_lib  # pylint: disable=g-import-not-at-top
  from private_t5.train import main as train_main, metrics, optimizers  # pylint: disable=g-import-not-at-top

  out = os.path.abspath(args.output_dir)
  if args.replot:
    with open(os.path.join(out, "compare_selective.json")) as f:
      saved = json.load(f)
    reps = sorted({r for row in saved["rows"] for r in row["exposure_by_repetitions"]}, key=int)
    print(plot(saved["rows"], reps, saved["max_exposure"], os.path.join(out, "compare_selective.png")))
    return 0
  os.makedirs(out, exist_ok=True)
  t_start = time.time()
  log = lambda msg: print(msg, flush=True)
  docs = list(corpora.iter_documents(args.corpus, max_documents=2 * args.documents))
  private_docs, public_docs = docs[:args.documents], docs[args.documents:]

  # 1. Data: canary corpus, public corpus, vocabulary from public text only.
  public_path = os.path.join(out, "public.jsonl")
  with open(public_path + ".tmp", "w") as f:
    for d in public_docs:
      f.write(json.dumps({"id": d.id, "text": d.text}) + "\n")
  os.replace(public_path + ".tmp", public_path)
  vocab_path = os.path.join(out, "spm.model")
  if not os.path.exists(vocab_path):
    spm.train_from_sentences([d.text for d in public_docs] + ["My ID is 0123456789"], vocab_path, vocab_size=1000)
  fmt = canaries_lib.CanaryFormat(template="My ID is {secret}", length=4).validate()
  reps = [int(r) for r in args.repetitions.split(",")]
  canaries, seed = canaries_lib.make_canaries(fmt, reps, per_repetition=2, num_reference=2, seed=args.seed)
  corpus_path, record_path, n_docs = canaries_lib.write_canary_corpus(
      private_docs, os.path.join(out, "train_canaries.jsonl"), fmt, canaries, seed, source=args.corpus)
  log(f"[compare] canary corpus: {n_docs} documents, canaries {[(c.secret, c.repetitions) for c in canaries]}")

  # 2. D' for JFT.
  redacted_path = os.path.join(out, "train_canaries_redacted.jsonl")
  red = redaction.redact_corpus(corpora.iter_documents(corpus_path), redacted_path, level=args.level,
                                progress_every=0, log=log)
  leaked = [c.secret for c in canaries if c.repetitions and any(
      c.text in r["text"] for r in redaction.read_redacted(redacted_path))]
  log(f"[compare] D' at level {args.level}: Pct {red['levels'][args.level]['pct']:.2%}, canaries left in D': {leaked}")

  lengths = {"inputs": 32, "targets": 16}
  cache = os.path.join(out, "cache")
  make = lambda corpus, split: source_lib.make_source(
      corpus, vocab_path, objective="prefix_lm", feature_lengths=lengths, split=split,
      validation_fraction=0.05 if split != "all" else 0.0, cache_dir=cache, progress=False)
  train_data, validation_data = make(corpus_path, "train"), make(corpus_path, "validation")
  redacted_data, public_data = make(redacted_path, "train"), make(public_path, "all")
  config = _model_config(int(train_data.store.manifest["vocab_size"]))
  common = dict(model_config=config, batch_size=args.batch_size, validation_data=validation_data,
                vocab_path=vocab_path, learning_rate=optimizers.constant_schedule(args.learning_rate),
                checkpoint_every=args.steps, eval_examples=256, log_every=max(args.steps // 4, 1),
                mesh_shape=(1, 1), insecure_deterministic_seed=args.seed, log=log)
  dp = config_lib.DPConfig(clip_norm=1.0, noise_multiplier=args.sigma, expected_batch_size=args.expected_batch_size)
  runs, timings = {}, {}

  def timed(name, fn):
    t0 = time.time()
    runs[name] = fn()
    timings[name] = time.time() - t0
    log(f"[compare] {name} done in {timings[name]:.0f}s")

  timed("non-DP", lambda: train_main.train(train_data=train_data, model_dir=os.path.join(out, "nondp"),
                                           train_steps=args.steps, dp=None, **common))
  timed("DP", lambda: train_main.train(train_data=train_data, model_dir=os.path.join(out, "dp"),
                                       train_steps=args.steps, dp=dp, **common))
  timed("JFT", lambda: jft.just_fine_tune_twice(
      model_dir=os.path.join(out, "jft"), redacted_data=redacted_data, full_data=train_data,
      phase1_steps=args.steps, phase2_steps=args.steps, phase2_dp=dp, phase1_dp=None,
      redaction_report_path=red["report_path"], **common))
  reference_dir = os.path.join(out, "reference_public")
  timed("ADP", lambda: (train_main.train(train_data=public_data, model_dir=reference_dir, train_steps=args.steps,
                                         dp=None, **dict(common, validation_data=None)),
                        adaptive_train.train_adaptive(reference_model_dir=reference_dir, train_data=train_data,
                                                      model_dir=os.path.join(out, "adp"), train_steps=args.steps,
                                                      dp=dp, normalization=args.normalization, **common))[1])

  # 3. Utility and exposure.
  from private_t5 import vocabulary  # pylint: disable=g-import-not-at-top
  vocab = vocabulary.load_vocabulary(vocab_path)
  model_dirs = {"non-DP": os.path.join(out, "nondp"), "DP": os.path.join(out, "dp"),
                "JFT": os.path.join(out, "jft", jft.PHASE2_DIR), "ADP": os.path.join(out, "adp")}
  rows = []
  for name in METHODS:
    summary = runs[name]
    validation = summary["phase2_validation"] if name == "JFT" else metrics.validation_metrics(summary)
    results = _exposures(model_dirs[name], vocab, fmt, canaries)
    by_rep = {}
    for r in results:
      by_rep.setdefault(r.repetitions, []).append(r.exposure)
    if name == "non-DP":
      privacy_text, eps = "none (ε = ∞)", None
    elif name == "DP":
      # The vocabulary here is trained on the public side of the comparison; report DP-Adafactor's ε.
      eps = summary.get("training_epsilon", summary["epsilon"])
      privacy_text = f"ε = {eps:.3g} (DP training)"
    elif name == "JFT":
      eps = summary["epsilon_s"]
      privacy_text = f"ε_s = {eps:.3g} (selective DP; assumes the detector missed nothing)"
    else:
      eps = summary["adaptive_dp"]["implied_epsilon"]
      privacy_text = f"no formal guarantee; implied ε ≈ {eps:.3g} (not DP)"
    extra = {}
    if name == "JFT":  # phase 1 saw only D': a caught canary cannot be memorized there
      phase1 = _exposures(os.path.join(out, "jft", jft.PHASE1_DIR), vocab, fmt, canaries)
      extra["phase1_exposure_by_repetitions"] = {
          str(k): float(np.mean([r.exposure for r in phase1 if r.repetitions == k]))
          for k in sorted({r.repetitions for r in phase1})}
    rows.append({**extra, "method": name, "validation_loss": validation["loss"],
                 "validation_token_accuracy": validation["token_accuracy"], "epsilon": eps,
                 "privacy": privacy_text,
                 "exposure_by_repetitions": {str(k): float(np.mean(v)) for k, v in sorted(by_rep.items())},
                 "canaries": [r.as_dict() for r in results], "wall_time_s": timings[name]})
    log(f"[compare] {name}: validation loss {validation['loss']:.3f}, token accuracy "
        f"{validation['token_accuracy']:.3f}, exposure {rows[-1]['exposure_by_repetitions']}")

  # 4. Table and plot.
  reps_sorted = sorted({str(r) for row in rows for r in row["exposure_by_repetitions"]}, key=int)
  max_exposure = float(np.log2(fmt.space_size))
  header = ("| method | validation loss | token accuracy | " +
            " | ".join(f"exposure ×{r}" if r != "0" else "exposure (reference)" for r in reps_sorted) +
            " | privacy |")
  lines = [header, "|" + "---|" * (4 + len(reps_sorted))]
  for row in rows:
    cells = [f"{row['exposure_by_repetitions'].get(r, float('nan')):.2f}" for r in reps_sorted]
    lines.append(f"| {row['method']} | {row['validation_loss']:.3f} | {row['validation_token_accuracy']:.3f} | "
                 + " | ".join(cells) + f" | {row['privacy']} |")
  table = "\n".join(lines)
  result = {"rows": rows, "table_markdown": table, "max_exposure": max_exposure,
            "settings": vars(args), "redaction": {"level": args.level, "pct": red["levels"][args.level]["pct"],
                                                  "canaries_left_in_redacted_corpus": leaked},
            "jft_report": runs["JFT"].get("report_path"),
            "adp_report": runs["ADP"].get("adaptive_dp_report"), "wall_time_s": time.time() - t_start}
  json_path = os.path.join(out, "compare_selective.json")
  with open(json_path + ".tmp", "w") as f:
    json.dump(result, f, indent=2, default=float)
  os.replace(json_path + ".tmp", json_path)
  md_path = os.path.join(out, "compare_selective.md")
  phase1 = rows[METHODS.index("JFT")]["phase1_exposure_by_repetitions"]
  with open(md_path + ".tmp", "w") as f:
    f.write(table + f"\n\nExposure: log2|R| - log2 rank, max {max_exposure:.2f} (|R| = {fmt.space_size}); "
            "reference canaries were never inserted. JFT phase 1 alone (trained on D'): "
            + ", ".join(f"×{k}: {v:.2f}" for k, v in phase1.items()) + "\n")
  os.replace(md_path + ".tmp", md_path)

  png_path = plot(rows, reps_sorted, max_exposure, os.path.join(out, "compare_selective.png"))
  print(table)
  print(f"[compare] {json_path}\n[compare] {md_path}\n[compare] {png_path}\n"
        f"[compare] total {time.time() - t_start:.0f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
