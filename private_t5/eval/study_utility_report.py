"""The tables, text and figure of `private-t5 study --part=utility`: results.json, results.md, figure.png.

results.md holds the utility table (each model's ε and δ, its pretraining validation token
accuracy, its fine-tuned validation metric with a bootstrap interval, publicly and with DP
fine-tuning; as Tables 1 and 2 of Ponomareva et al. 2022), the batch sweep (validation token
accuracy against the expected batch at a fixed ε and a fixed number of examples, with σ and
σ / expected batch, as Appendix D and McKenna et al. 2025), and a text that reads the orderings
off the numbers: whether each model's interval overlaps the non-private model's, and whether
larger batches narrow the DP gap. figure.png: pretraining accuracy against the fine-tuned
metric per model; validation accuracy against the expected batch.
"""
import logging
from typing import List, Optional

from private_t5.eval import study_report

logger = logging.getLogger(__name__)

REFERENCE = "nondp_span"


def _ci(entry: Optional[dict]) -> str:
  if not entry:
    return "–"
  return f"{entry['value']:.1f} [{entry['ci'][0]:.1f}, {entry['ci'][1]:.1f}]"


def overlaps(a: dict, b: dict) -> bool:
  """Whether two fine-tuned results' intervals overlap (no difference shown at that confidence)."""
  return a["ci"][0] <= b["ci"][1] and b["ci"][0] <= a["ci"][1]


def _run_text(run: dict) -> str:
  lr = run.get("learning_rate")
  return f"{run.get('steps')} steps of {run.get('batch_size')}" + (f" at rate {lr:g}" if lr is not None else "")


def models_table(utility: dict) -> List[str]:
  """One row per model: privacy, pretraining accuracy, fine-tuned metric (public, DP) with intervals."""
  models = utility["models"]
  any_dp = any("finetuned_dp" in m for m in models.values())
  metric = next((m[k]["metric"] for m in models.values() for k in ("finetuned", "finetuned_dp") if k in m), "")
  header = (f"| model | vocabulary | pretraining ε (corpus) | δ | pretraining validation token accuracy % (not DP) | "
            f"fine-tuned {metric} [95% CI] |")
  if any_dp:
    dp_eps = next((m["finetuned_dp"]["epsilon"] for m in models.values() if "finetuned_dp" in m), None)
    header += f" DP fine-tuned (ε {dp_eps:.3g} on the task) {metric} [95% CI] |"
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for name, m in models.items():
    eps, delta = study_report.privacy_text(m)
    if name == "scratch":
      eps, delta = "–", "–"
    vocab = {"spm": "SentencePiece", "dp_spm": "DP-SentencePiece"}.get(m.get("vocabulary"), m.get("vocabulary"))
    acc = m.get("pretrain_validation_token_accuracy")
    row = (f"| {name} | {vocab} | {eps} | {delta} | "
           f"{'not pretrained' if name == 'scratch' else study_report.pct(acc)} | {_ci(m.get('finetuned'))} |")
    if any_dp:
      row += f" {_ci(m.get('finetuned_dp'))} |"
    lines.append(row)
  base = next((m[k].get("majority_baseline") for m in models.values() for k in ("finetuned", "finetuned_dp")
               if k in m), None)
  if base is not None:
    lines.append(f"| majority class | | | | | {base:.1f} |" + (f" {base:.1f} |" if any_dp else ""))
  return lines


def sweep_table(utility: dict) -> List[str]:
  rows = utility.get("batch_sweep") or []
  if not rows:
    return []
  lines = ["| expected batch | steps | examples | private | σ | σ / batch | ε | validation token accuracy % (not DP) |",
           "|---:|---:|---:|---|---:|---:|---:|---:|"]
  for r in rows:
    sigma = "–" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.3f}"
    ratio = "–" if r.get("noise_batch_ratio") is None else f"{r['noise_batch_ratio']:.2e}"
    eps = "∞" if r["epsilon"] is None else f"{r['epsilon']:.3g}"
    lines.append(f"| {r['expected_batch_size']} | {r['steps']} | {r['examples']} | {'DP' if r['private'] else 'no'} | "
                 f"{sigma} | {ratio} | {eps} | {study_report.pct(r['validation_token_accuracy'])} |")
  return lines


def findings(utility: dict) -> List[str]:
  """Plain statements of what the numbers show, computed from them (no claim the data do not make)."""
  models = utility["models"]
  out = []
  ref = models.get(REFERENCE)
  acc_ref = ref.get("pretrain_validation_token_accuracy") if ref else None
  for name in ("dp_span", "fulldp_span"):
    m = models.get(name)
    if m and acc_ref is not None and m.get("pretrain_validation_token_accuracy") is not None:
      out.append(f"* Pretraining: {name} reaches {100 * m['pretrain_validation_token_accuracy']:.2f}% validation token "
                 f"accuracy against {100 * acc_ref:.2f}% without DP "
                 f"({'lower' if m['pretrain_validation_token_accuracy'] < acc_ref else 'not lower'}).")
  for key, label in (("finetuned", "public fine-tuning"), ("finetuned_dp", "DP fine-tuning")):
    chance = [name for name, m in models.items()
              if key in m and m[key]["ci"][0] <= m[key].get("majority_baseline", float("-inf")) + 1e-9]
    if chance:
      base = next(m[key]["majority_baseline"] for m in models.values() if key in m)
      out.append(f"* {label}: {', '.join(chance)} {'does' if len(chance) == 1 else 'do'} not beat the majority-class "
                 f"baseline ({base:.1f}, every example given the most frequent training label) at 95%: "
                 f"{'that model has' if len(chance) == 1 else 'those models have'} not learned the task at this "
                 "scale, so an overlap with another such model says nothing about pretraining.")
    if not ref or key not in ref:
      continue
    for name, m in models.items():
      if name == REFERENCE or key not in m:
        continue
      same = overlaps(m[key], ref[key])
      out.append(f"* {label}: {name} {_ci(m[key])} against {REFERENCE} {_ci(ref[key])}: "
                 + ("the intervals overlap, no difference is shown at this size of validation set."
                    if same else ("significantly lower." if m[key]["value"] < ref[key]["value"]
                                  else "significantly higher.")))
  if ref and "finetuned" in ref and "scratch" in models and "finetuned" in models["scratch"]:
    gain = ref["finetuned"]["value"] - models["scratch"]["finetuned"]["value"]
    out.append(f"* Pretraining's value on this task: {REFERENCE} minus scratch = {gain:+.1f} points "
               f"({'intervals overlap: pretraining at this scale is not shown to help' if overlaps(ref['finetuned'], models['scratch']['finetuned']) else 'intervals disjoint'}).")
  sweep = utility.get("batch_sweep") or []
  dp = {r["expected_batch_size"]: r for r in sweep if r["private"] and r["validation_token_accuracy"] is not None}
  nondp = {r["expected_batch_size"]: r for r in sweep if not r["private"] and r["validation_token_accuracy"] is not None}
  common = sorted(set(dp) & set(nondp))
  if len(common) >= 2:
    gaps = {b: nondp[b]["validation_token_accuracy"] - dp[b]["validation_token_accuracy"] for b in common}
    text = ", ".join(f"{b}: {100 * gaps[b]:.2f}" for b in common)
    lo, hi = common[0], common[-1]
    out.append(f"* Batch sweep (same ε, same examples): the DP gap in validation token accuracy (points, non-DP "
               f"minus DP) by expected batch is {text}; from batch {lo} to {hi} it "
               + ("narrows." if gaps[hi] < gaps[lo] else "does not narrow.")
               + f" σ / batch falls from {dp[lo]['noise_batch_ratio']:.2e} to {dp[hi]['noise_batch_ratio']:.2e}.")
  elif dp:
    best = max(dp, key=lambda b: dp[b]["validation_token_accuracy"])
    out.append(f"* Batch sweep: the best DP validation token accuracy is at expected batch {best}.")
  return out


def results_markdown(results: dict) -> str:
  u = results["utility"]
  data, s = u.get("data", {}), u.get("settings", {})
  ft = s.get("finetune", {})
  sw = s.get("batch_sweep", {})
  lines = ["# Utility study", "",
           f"Pretraining corpus `{u.get('corpus')}`: {data.get('train_documents')} training and "
           f"{data.get('valid_documents')} validation documents; span corruption. Fine-tuning task `{u.get('task')}` "
           f"(lengths {ft.get('feature_lengths')}; public: {_run_text(ft)}; DP: {_run_text(ft.get('dp') or ft)}, "
           f"expected batch, untruncated Poisson sampling), metric by greedy decoding of the validation examples, "
           f"with a 95% percentile bootstrap interval ({ft.get('bootstrap_samples')} resamples of the validation "
           "examples).", "",
           "## Pretraining and fine-tuning (Tables 1 and 2 of Ponomareva et al. 2022)", ""]
  lines += models_table(u)
  lines += ["", "Two guarantees over two datasets. Pretraining ε, δ: over the corpus's documents (\"(training)\": "
            "DP-Adafactor alone, the SentencePiece vocabulary being non-private; fulldp_span: composed with "
            "DP-SentencePiece); fine-tuning does not touch the corpus. DP fine-tuning's ε: over the task's training "
            "examples, its own ledger; the vocabulary and the pretrained weights were built from the corpus, "
            "which does not hold the task's examples, so they are public for it. Public fine-tuning gives the "
            "task's examples no guarantee. Validation accuracy of the private corpus is not DP.", ""]
  sweep = sweep_table(u)
  if sweep:
    lines += ["## Batch size at a fixed ε (Appendix D; McKenna et al. 2025)", "",
              f"Every run processes {sw.get('examples')} examples (steps = examples / expected batch); DP runs "
              f"use untruncated Poisson sampling in microbatches of up to {sw.get('microbatch_size')} rows, σ "
              f"calibrated to ε = {sw.get('epsilon')} each.", ""]
    lines += sweep + [""]
  lines += ["## What the numbers show", ""] + findings(u) + [""]
  t = u.get("time_this_run", {})
  lines += [f"This run: {t.get('wall_seconds')} s wall, {t.get('cpu_seconds')} s CPU (phases reused from an "
            "earlier run are not counted).", ""]
  return "\n".join(lines)


def write_figure(results: dict, path: str) -> Optional[str]:
  """figure.png: fine-tuned metric against pretraining accuracy per model; accuracy against batch."""
  plt = study_report.pyplot()
  if plt is None:
    return None
  u = results["utility"]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for key, marker in (("finetuned", "o"), ("finetuned_dp", "s")):
    for name, m in u["models"].items():
      if key not in m:
        continue
      x = 100 * (m.get("pretrain_validation_token_accuracy") or 0.0)
      r = m[key]
      ax1.errorbar([x], [r["value"]], yerr=[[r["value"] - r["ci"][0]], [r["ci"][1] - r["value"]]], fmt=marker,
                   capsize=3, label=f"{name} ({'DP' if key == 'finetuned_dp' else 'public'} fine-tuning)")
  ax1.set_xlabel("pretraining validation token accuracy (%; scratch at 0)")
  ax1.set_ylabel("fine-tuned validation metric (95% CI)")
  ax1.set_title(f"Fine-tuning on {u.get('task')}")
  ax1.legend(fontsize=7)
  for private, label in ((True, "DP"), (False, "non-DP")):
    rows = sorted((r for r in u.get("batch_sweep", []) if r["private"] == private
                   and r["validation_token_accuracy"] is not None), key=lambda r: r["expected_batch_size"])
    if rows:
      ax2.plot([r["expected_batch_size"] for r in rows], [100 * r["validation_token_accuracy"] for r in rows],
               marker="o", label=label)
  ax2.set_xscale("log", base=2)
  ax2.set_xlabel("expected batch size (same ε, same examples processed)")
  ax2.set_ylabel("validation token accuracy (%, not DP)")
  ax2.set_title("Batch size at a fixed ε")
  ax2.legend(fontsize=8)
  return study_report.save_figure(plt, fig, path)


def write_results(results: dict, output_dir: str) -> List[str]:
  """Writes results.json, results.md and figure.png to `output_dir`; returns the paths written."""
  return study_report.write_results(results, output_dir, results_markdown, write_figure)
