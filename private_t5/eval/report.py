"""The memorization report: report.json, report.md and PNG plots (matplotlib, Agg backend).

report.json holds, per split, n / skipped / EM / TA / MED and the exact and approximate match
rates with their Clopper-Pearson intervals for every decoding method (with the training sample
"train_sample" when one was drawn, and "overall": the four splits pooled), and each pass's
decoding time and prompts per second ("decoding"); per
canary its repetitions, rank and exposure; the checkpoint's ε from its privacy ledger; with
audit canaries, the one-run audit's ε lower bound beside it ("audit"); the split sizes and the
decoding throughput.
"""
import json
import math
import os
from typing import List, Optional

from private_t5.eval.split_types import SPLIT_NAMES
from private_t5.io import atomic_open, write_text_atomic
from private_t5.lazy_imports import lazy_module

# Matplotlib is imported by the first plot: it takes about a second to import, and the Agg
# backend must be chosen before `matplotlib.pyplot` is.
matplotlib = lazy_module("matplotlib", needed_for="the memorization report's plots",
                         install="matplotlib (requirements.txt)")
plt = lazy_module("matplotlib.pyplot", needed_for="the memorization report's plots",
                  install="matplotlib (requirements.txt)")

SPLIT_TITLES = {"train_dup": "Train dup", "train_unique": "Train unique",
                "valid_in_train": "Valid in train", "valid_unique": "Valid unique"}
# The rows of the extraction tables after the four splits: the uniform training sample and the
# four splits pooled.
GROUP_TITLES = {**SPLIT_TITLES, "overall": "All four splits", "train_sample": "Train sample (uniform)"}
TABLE_ROWS = tuple(SPLIT_NAMES) + ("overall", "train_sample")


def _clean(x):
  """JSON-safe: NaN / inf -> None, recursively."""
  if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
    return None
  if isinstance(x, dict):
    return {k: _clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_clean(v) for v in x]
  return x


def epsilon_text(privacy_report: Optional[dict]) -> str:
  """'ε = 6.06 (δ = 1e-06)', 'ε = ∞ (non-private)' or 'ε unknown (no privacy ledger)'."""
  if not privacy_report:
    return "ε unknown (no privacy ledger in the checkpoint)"
  if not privacy_report.get("dp", True) or privacy_report.get("non_private"):
    return "ε = ∞ (non-private baseline)"
  eps = privacy_report.get("epsilon")
  if eps is None:
    return "ε = ∞"
  delta = privacy_report.get("delta")
  text = f"ε = {eps:.4g}" + (f" (δ = {delta:.3g})" if delta is not None else "")
  if privacy_report.get("noise_secret") is False:
    text += ", NO GUARANTEE: the noise came from a fixed seed"
  return text


def _pct(x) -> str:
  return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}"


def _num(x) -> str:
  return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:g}"


def _interval(ci) -> str:
  if not ci or any(x is None or (isinstance(x, float) and math.isnan(x)) for x in ci):
    return "–"
  return f"{100 * ci[0]:.2f}–{100 * ci[1]:.2f}"


def _prompts_per_second(report: dict, method: str, name: str) -> str:
  stats = (report.get("decoding") or {}).get(f"{method}/{name}") or {}
  return f"{stats['prompts_per_second']:.1f}" if stats.get("prompts") and "prompts_per_second" in stats else "–"


def markdown(report: dict) -> str:
  """A Markdown rendering: Table 3 columns per split and method, then the canaries."""
  lines = ["# Memorization report", "",
           f"- checkpoint: `{report.get('checkpoint', {}).get('model_dir', '?')}` step "
           f"{report.get('checkpoint', {}).get('step', '?')}",
           f"- privacy: {report.get('epsilon_text', '')}",
           f"- prompt P = {report['settings']['prompt_length']} tokens, generation T = "
           f"{report['settings']['generation_length']} tokens"]
  sample = report.get("train_sample")
  if sample:
    lines.append(f"- training sample: {sample['evaluated']} documents drawn uniformly (seed {sample['seed']}) from "
                 f"the {sample['eligible']} of {sample['documents']} training documents with at least "
                 f"{sample['min_length']} tokens")
  lines.append("")
  if report.get("audit"):
    lines += audit_markdown(report["audit"])
  for method, per_split in report.get("extraction", {}).items():
    first = next(iter(per_split.values()), {}) or {}
    threshold, confidence = first.get("approximate_threshold"), first.get("confidence")
    lines += [f"## Extraction ({method})", "",
              f"| split | n | skipped | EM % | TA % | MED | EM {_num(100 * confidence if confidence else None)}% CI | "
              f"approx. % (≤ {_num(threshold)}) | approx. CI | prompts/s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in TABLE_ROWS:
      m = per_split.get(name)
      if m is None:
        continue
      lines.append(f"| {GROUP_TITLES[name]} | {m['n']} | {m['skipped']} | {_pct(m['exact_match'])} | "
                   f"{_pct(m['token_accuracy'])} | {_num(m['median_edit_distance'])} | "
                   f"{_interval(m.get('exact_match_ci'))} | {_pct(m.get('approximate_match'))} | "
                   f"{_interval(m.get('approximate_match_ci'))} | {_prompts_per_second(report, method, name)} |")
    lines += ["", "EM and approx.: exact and approximate match rates (approximate: token edit distance / T at "
              "most the threshold), with Clopper-Pearson intervals; \"All four splits\" pools the splits' "
              "documents (no pooled median).", ""]
  if report.get("canaries"):
    lines += ["## Canary exposure", "", f"- format: `{report['canary_format']['template']}`, |R| = "
              f"{report['canary_space_size']} (max exposure {math.log2(report['canary_space_size']):.2f} bits)", "",
              "| canary | repetitions | rank | exposure (bits) | method | extracted |", "|---|---:|---:|---:|---|---|"]
    for c in report["canaries"]:
      extracted = {True: "yes", False: "no"}.get(c.get("extracted"), "–")
      lines.append(f"| {c['id']} | {c['repetitions']} | {c['rank']:.4g} | {c['exposure']:.2f} | {c['method']} | "
                   f"{extracted} |")
    lines += ["", "Extracted: the model's greedy continuation of the canaries' prefix is the canary's secret.", ""]
  sizes = report.get("splits", {}).get("sizes")
  if sizes:
    lines += ["## Splits", "", "| split | documents |", "|---|---:|"]
    lines += [f"| {SPLIT_TITLES[k]} | {sizes.get(k, 0)} |" for k in SPLIT_NAMES]
    lines.append("")
  if report.get("throughput"):
    t = report["throughput"]
    lines += ["## Decoding throughput", "",
              f"{t.get('tokens_per_second_steady', 0):.0f} generated tokens/s (steady state), "
              f"{t.get('generated_tokens', 0)} tokens in {t.get('seconds', 0):.1f} s"
              + (f", {t['prompts']} prompts: {t['prompts_per_second']:.1f} prompts/s" if t.get("prompts") else ""), ""]
  if report.get("warnings"):
    lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
  return "\n".join(lines)


def audit_markdown(audit: dict) -> List[str]:
  """The privacy-audit section: the ε lower bound beside the ledger's ε, loud when it exceeds it."""
  ledger = "∞ (non-private)" if audit.get("ledger_epsilon") is None else \
      f"{audit['ledger_epsilon']:.4g} ({audit.get('ledger_scope', '')})"
  lines = []
  if audit.get("violation"):
    lines += [f"> **PRIVACY AUDIT FAILED**: the ε lower bound {audit['epsilon_lower_bound']:.3f} exceeds the "
              f"ledger's ε = {audit['ledger_epsilon']:.4g}. The DP implementation or its privacy accounting is "
              f"wrong (or, with probability at most {1 - audit['confidence']:.2g}, this is a false alarm).", ""]
  lines += ["## Privacy audit (one training run)", "",
            "Each audit canary was included with probability 1/2; a canary's score is minus its loss. The ε lower "
            "bounds come from the scores of the included and the held-out canaries: "
            f"{audit.get('method') or 'Steinke, Nasr and Jagielski, Privacy Auditing with One (1) Training Run, 2023'}"
            + (f"; and {audit['method_fdp']}" if audit.get("method_fdp") else "")
            + f". If training were (ε, δ)-DP for an ε below the bound, scores this separated would occur with "
            f"probability at most {1 - audit['confidence']:.2g}.", "",
            "| ε lower bound (one run) | f-DP | confidence | δ | canaries (included) | ledger ε |",
            "|---:|---:|---:|---:|---:|---|",
            f"| {audit['epsilon_lower_bound']:.3f} | {_num(audit.get('epsilon_lower_bound_fdp'))} | "
            f"{100 * audit['confidence']:g}% | {audit['delta']:.3g} | "
            f"{audit['num_canaries']} ({audit.get('num_included', '?')}) | {ledger} |", "",
            f"- largest bound these canaries could give (every included canary scored above every held-out one): "
            f"{audit.get('max_lower_bound', float('nan')):.3f}"
            + (f" (f-DP: {audit['max_lower_bound_fdp']:.3f})" if audit.get("max_lower_bound_fdp") is not None else "")]
  if audit.get("saturation"):
    lines.append(f"- **saturated**: {audit['saturation']}")
  for t in audit.get("tpr_at_fpr") or []:
    interval = t.get("interval")
    lines.append(f"- attack TPR at FPR {100 * t['fpr']:g}%: {t['tpr']:.3g}"
                 + (f" ({interval[0]:.3g} to {interval[1]:.3g})" if interval else ""))
  if audit.get("auroc") is not None:
    interval = audit.get("auroc_interval")
    lines.append(f"- attack AUROC: {audit['auroc']:.3g}" + (f" ({interval[0]:.3g} to {interval[1]:.3g})" if interval else ""))
  own = audit.get("steinke") or {}
  if own:
    lines.append(f"- cross-check, k a side ({own.get('method', 'private_t5.dp.auditing')}): ε ≥ "
                 f"{_num(own.get('epsilon_lower_bound'))}, {audit.get('correct', '?')} of {audit.get('guesses', '?')} "
                 "guesses right")
  lines.append(f"- mean canary loss: included {_num(audit.get('mean_loss_included'))}, excluded "
               f"{_num(audit.get('mean_loss_excluded'))} nats/token")
  if audit.get("repetitions", 1) > 1:
    lines.append(f"- each included canary was inserted {audit['repetitions']} times: the bound concerns a group "
                 "of documents, so it is not compared with the per-document ledger ε")
  if audit.get("by_kind"):
    fprs = [t["fpr"] for t in next(iter(audit["by_kind"].values()))["tpr_at_fpr"]]
    lines += ["", "Each kind of canary alone (the same training run):", "",
              "| kind | canaries (included) | ε lower bound (cap) | f-DP | "
              + " | ".join(f"TPR at FPR {100 * f:g}%" for f in fprs) + " | AUROC |",
              "|---|---:|---:|---:|" + "---:|" * len(fprs) + "---:|"]
    for name, kind in audit["by_kind"].items():
      lines.append(f"| {name} | {kind['num_canaries']} ({kind['num_included']}) | "
                   f"{kind['epsilon_lower_bound']:.3f} ({kind['max_lower_bound']:.3f})"
                   + (" **above the ledger's ε**" if kind.get("exceeds_ledger") else "")
                   + f" | {_num(kind.get('epsilon_lower_bound_fdp'))} | "
                   + " | ".join(f"{t['tpr']:.3g}" for t in kind["tpr_at_fpr"]) + f" | {kind['auroc']:.3g} |")
  return lines + [""]


def plot_audit(report: dict, path: str) -> Optional[str]:
  """Histogram of canary losses, included vs excluded, with the bound and the ledger's ε."""
  matplotlib.use("Agg")
  audit = report.get("audit") or {}
  hist = audit.get("histogram")
  if not hist or len(hist.get("edges", [])) < 2:
    return None
  edges = hist["edges"]
  fig, ax = plt.subplots(figsize=(5.5, 3.8))
  for key, label in (("included", "included (trained on)"), ("excluded", "excluded")):
    ax.stairs(hist[key], edges, label=label, fill=True, alpha=0.5)
  ax.set_xlabel("canary loss (nats/token)")
  ax.set_ylabel("canaries")
  ledger = "∞" if audit.get("ledger_epsilon") is None else f"{audit['ledger_epsilon']:.3g}"
  ax.set_title(f"Privacy audit: ε ≥ {audit['epsilon_lower_bound']:.2f} at {100 * audit['confidence']:g}% "
               f"(ledger ε = {ledger})" + ("  FAILED" if audit.get("violation") else ""), fontsize=9)
  ax.legend()
  fig.tight_layout()
  _save(fig, path)
  plt.close(fig)
  return path


def plot_extraction(report: dict, path: str) -> Optional[str]:
  """Grouped bars of EM and TA (%) per split, one group per decoding method."""
  matplotlib.use("Agg")
  extraction = report.get("extraction") or {}
  if not extraction:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  methods = list(extraction)
  width = 0.8 / max(1, len(methods))
  for ax, key, title in ((axes[0], "exact_match", "Exact match (%)"), (axes[1], "token_accuracy", "Token accuracy (%)")):
    top = 0.0
    for k, method in enumerate(methods):
      values = []
      for name in SPLIT_NAMES:
        v = (extraction[method].get(name) or {}).get(key)
        values.append(0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else 100 * v)
      xs = [i + k * width for i in range(len(SPLIT_NAMES))]
      bars = ax.bar(xs, values, width=width, label=method)
      ax.bar_label(bars, fmt="%.2f", fontsize=7)
      top = max([top] + values)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(SPLIT_NAMES))])
    ax.set_xticklabels([SPLIT_TITLES[n] for n in SPLIT_NAMES], rotation=15)
    ax.set_title(title)
    # Memorization rates are often a few percent (Ponomareva et al. 2022, Table 3): scale to the data.
    ax.set_ylim(0, min(100.0, max(1.0, 1.25 * top)))
  axes[0].legend()
  fig.suptitle(f"Extraction: {report.get('epsilon_text', '')}")
  fig.tight_layout()
  _save(fig, path)
  plt.close(fig)
  return path


def plot_exposure(report: dict, path: str) -> Optional[str]:
  """Exposure (bits) against the number of inserted copies (0 = reference canaries)."""
  matplotlib.use("Agg")
  canaries = report.get("canaries") or []
  if not canaries:
    return None
  fig, ax = plt.subplots(figsize=(5, 3.8))
  reps = [c["repetitions"] for c in canaries]
  # Symlog keeps the never-inserted references (0 copies) on the same axis as 1, 10, 100 ….
  ax.scatter(reps, [c["exposure"] for c in canaries], zorder=3)
  ax.set_xscale("symlog", linthresh=1)
  ax.axhline(math.log2(report["canary_space_size"]), color="gray", linestyle="--", label="log2 |R|")
  ax.set_ylim(0, 1.08 * math.log2(report["canary_space_size"]))
  ax.set_xlabel("copies inserted in training")
  ax.set_ylabel("exposure (bits)")
  ax.set_title(f"Canary exposure: {report.get('epsilon_text', '')}", fontsize=9)
  ax.legend()
  fig.tight_layout()
  _save(fig, path)
  plt.close(fig)
  return path


def _save(fig, path: str) -> None:
  with atomic_open(path, "wb") as f:
    fig.savefig(f, format="png", dpi=110)


def write_report(report: dict, out_dir: str) -> List[str]:
  """Writes report.json, report.md and the plots into `out_dir`; returns the paths."""
  os.makedirs(out_dir, exist_ok=True)
  report = _clean(report)
  paths = []
  json_path = os.path.join(out_dir, "report.json")
  write_text_atomic(json_path, json.dumps(report, indent=2, ensure_ascii=False))
  paths.append(json_path)
  md_path = os.path.join(out_dir, "report.md")
  write_text_atomic(md_path, markdown(report))
  paths.append(md_path)
  for fn, name in ((plot_extraction, "extraction.png"), (plot_exposure, "exposure.png"), (plot_audit, "audit.png")):
    p = fn(report, os.path.join(out_dir, name))
    if p:
      paths.append(p)
  return paths
