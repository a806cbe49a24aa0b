"""The tables and the figure of `private-t5 study`: results.json, results.md, figure.png.

results.md holds a Table-3-like memorization table (greedy EM / TA / MED per split, as in
Ponomareva et al. 2022, Table 3, with the approximate-match rate where the results have it) and
a Table-2-like utility table (teacher-forced validation token accuracy), each row with its ε and
δ, and with an audit each model's one-run privacy audit. figure.png shows EM per split per
model, validation accuracy against ε, and with an audit the one-run and f-DP ε lower bounds
beside the ledger's ε (matplotlib; skipped with a warning when it is not installed). Results
written before a figure existed render without it ("–").
"""
import io
import logging
import math
import os
from typing import Callable, List, Optional

from private_t5 import io as io_lib
from private_t5.lazy_imports import import_now, lazy_module

logger = logging.getLogger(__name__)

# Matplotlib takes about a second to import, and the Agg backend must be chosen first (`pyplot`).
matplotlib = lazy_module("matplotlib", needed_for="the study's figure", install="matplotlib (requirements.txt)")
_pyplot = lazy_module("matplotlib.pyplot", needed_for="the study's figure", install="matplotlib (requirements.txt)")

SPLITS = ("train_dup", "train_unique", "valid_in_train", "valid_unique")
SPLIT_TITLES = {"train_dup": "train dup", "train_unique": "train unique", "valid_in_train": "valid in train",
                "valid_unique": "valid unique"}
# Extraction groups besides the splits shown in the memorization table when a model has them.
GROUP_TITLES = {"train_sample": "train sample"}
AUDIT_FPR = 0.01  # the audit table's TPR column


def pct(value: Optional[float]) -> str:
  return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}"


def num(value: Optional[float]) -> str:
  return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:g}"


def finite(value) -> Optional[float]:
  """`value` as a float when it is a finite number, else None."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    return None
  return float(value)


def bound(value) -> str:
  return "–" if finite(value) is None else f"{value:.3f}"


def interval_text(values) -> str:
  """" [lo, hi]" of a two-number interval, "" when there is none."""
  if not values or len(values) != 2 or finite(values[0]) is None or finite(values[1]) is None:
    return ""
  return f" [{values[0]:.3g}, {values[1]:.3g}]"


def privacy_text(model: dict) -> tuple:
  """(ε, δ) cells of a model's row: ∞ / – for a non-private model."""
  if not model.get("private"):
    return "∞", "–"
  eps = model.get("epsilon")
  eps_text = "∞" if eps is None else f"{eps:.3g}"
  if model.get("epsilon_scope", "").startswith("training only"):
    eps_text += " (training)"
  delta = model.get("delta")
  return eps_text, ("–" if delta is None else f"{delta:.2g}")


def windows_text(training_windows: Optional[int], units: List[str]) -> str:
  """What training saw of each document, beside the privacy unit, in one sentence."""
  unit = f" Privacy unit: {', '.join(units)}." if units else ""
  if training_windows is None:
    return ("Training drew one window at a random position of a longer document: on long documents the "
            "prompted opening is rarely trained on." + unit)
  if training_windows == 1:
    return "Training drew each document's opening window, the window the prompts come from." + unit
  return (f"Training drew one of each document's first {training_windows} grid windows; the prompts come from "
          f"the first, trained on in 1/{training_windows} of a document's draws." + unit)


def has_approximate(results: dict) -> bool:
  """Whether any model's split or group has an approximate-match rate ("am")."""
  return any(v.get("am") is not None for m in results["models"].values()
             for v in [*m["splits"].values(), *(m.get("groups") or {}).values()])


def memorization_table(results: dict) -> List[str]:
  """Table-3-like: one row per model; EM % / TA % / MED (n) per split (and per group of
  `GROUP_TITLES` a model has), with AM % (approximate match) after EM where the results have it."""
  approximate = has_approximate(results)
  groups = [g for g in GROUP_TITLES if any(g in (m.get("groups") or {}) for m in results["models"].values())]
  what = "EM % / AM % / TA % / MED (n)" if approximate else "EM % / TA % / MED (n)"
  titles = [SPLIT_TITLES[s] for s in SPLITS] + [GROUP_TITLES[g] for g in groups]
  header = "| model | objective | ε | δ | " + " | ".join(f"{t} {what}" for t in titles) + " |"
  lines = [header, "|" + "---|" * (4 + len(titles))]
  for name, m in results["models"].items():
    eps, delta = privacy_text(m)
    cells = []
    for v in [m["splits"][s] for s in SPLITS] + [(m.get("groups") or {}).get(g) for g in groups]:
      if v is None:
        cells.append("–")
        continue
      am = f" / {pct(v.get('am'))}" if approximate else ""
      cells.append(f"{pct(v['em'])}{am} / {pct(v['ta'])} / {num(v['med'])} ({v['n']})")
    lines.append(f"| {name} | {m['objective']} | {eps} | {delta} | " + " | ".join(cells) + " |")
  return lines


def utility_table(results: dict) -> List[str]:
  """Table-2-like: validation token accuracy (teacher forced) with ε and δ.

  The validation documents are held out of the private corpus, so their accuracy and loss are
  not DP: the columns say so.
  """
  lines = ["| model | objective | vocabulary | ε | δ | validation token accuracy % (not DP) | "
           "validation loss (not DP) |",
           "|---|---|---|---|---|---|---|"]
  for name, m in results["models"].items():
    eps, delta = privacy_text(m)
    vocab = {"spm": "SentencePiece", "dp_spm": "DP-SentencePiece"}.get(m.get("vocabulary"), m.get("vocabulary"))
    lines.append(f"| {name} | {m['objective']} | {vocab} | {eps} | {delta} | "
                 f"{pct(m.get('validation_token_accuracy'))} | {num(m.get('validation_loss'))} |")
  return lines


def repetition_table(results: dict) -> List[str]:
  """Greedy EM % of the train-dup documents by how often they occur in the training corpus."""
  groups = []
  for m in results["models"].values():
    for g in m.get("train_dup_by_repetitions", {}):
      if g not in groups:
        groups.append(g)
  if not groups:
    return []
  title = {"natural": "duplicates of the corpus itself"}
  lines = ["| model | objective | ε | " + " | ".join(f"{title.get(g, f'{g}× in training')} EM % (n)" for g in groups) + " |",
           "|" + "---|" * (3 + len(groups))]
  for name, m in results["models"].items():
    by = m.get("train_dup_by_repetitions", {})
    cells = [f"{pct(by[g]['em'])} ({by[g]['n']})" if g in by else "–" for g in groups]
    lines.append(f"| {name} | {m['objective']} | {privacy_text(m)[0]} | " + " | ".join(cells) + " |")
  return lines


def tpr_at(audit: dict, fpr: float = AUDIT_FPR) -> Optional[dict]:
  """The audit's {"fpr", "tpr", "interval"} at `fpr`, or None."""
  for t in audit.get("tpr_at_fpr") or []:
    if finite(t.get("fpr")) is not None and math.isclose(t["fpr"], fpr):
      return t
  return None


def audit_table(results: dict) -> List[str]:
  """The one-run privacy audit of each model: the ε lower bounds (one run with its cap, f-DP),
  the attack's TPR at FPR 1% and AUROC, whether the bound saturated, beside the ledger's ε; then
  a line for each saturated audit. Keys an older results.json lacks show as "–"."""
  rows = [(name, m) for name, m in results["models"].items() if m.get("audit")]
  if not rows:
    return []
  lines = [f"| model | ε lower bound (one run) | cap | ε lower bound (f-DP) | TPR at FPR {100 * AUDIT_FPR:g}% | "
           "AUROC | saturated | confidence | correct / guesses | canaries | ledger ε | |",
           "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|"]
  notes = []
  for name, m in rows:
    a = m["audit"]
    ledger = "∞" if a.get("ledger_epsilon") is None else f"{a['ledger_epsilon']:.3g}"
    fdp_cap = finite(a.get("max_lower_bound_fdp"))
    fdp = bound(a.get("epsilon_lower_bound_fdp")) + (f" (cap {fdp_cap:.3f})" if fdp_cap is not None else "")
    t = tpr_at(a)
    tpr = "–" if t is None or finite(t.get("tpr")) is None else f"{t['tpr']:.3g}{interval_text(t.get('interval'))}"
    auroc = "–" if finite(a.get("auroc")) is None else f"{a['auroc']:.3g}{interval_text(a.get('auroc_interval'))}"
    saturated = {True: "yes", False: "no"}.get(a.get("saturated"), "–")
    confidence = "–" if finite(a.get("confidence")) is None else f"{100 * a['confidence']:g}%"
    flag = ("**FAILED: bound > ledger ε**" if a.get("violation")
            else "f-DP bound > ledger ε" if a.get("fdp_exceeds_ledger") else "")
    lines.append(f"| {name} | {bound(a.get('epsilon_lower_bound'))} | {bound(a.get('max_lower_bound'))} | {fdp} | "
                 f"{tpr} | {auroc} | {saturated} | {confidence} | {a.get('correct', '–')} / {a.get('guesses', '–')} | "
                 f"{a.get('num_canaries', '–')} | {ledger} | {flag} |")
    if a.get("saturation"):
      notes.append(f"- {name}: saturated: {a['saturation']}")
  return lines + ([""] + notes if notes else [])


def results_markdown(results: dict) -> str:
  data = results.get("data", {})
  settings = results.get("settings", {})
  dup = settings.get("duplication", {})
  lines = ["# Memorization study", "",
           f"Corpus `{results.get('corpus')}`: {data.get('train_documents')} training documents "
           f"({data.get('train_documents_with_copies')} with the planted copies), "
           f"{data.get('valid_documents')} validation documents; {data.get('repeated_documents')} training "
           f"documents repeated (total occurrences: {data.get('repeated_by_count')}), "
           f"fraction {dup.get('fraction')}.",
           f"Greedy decoding of T = {settings.get('generation_length')} tokens after a "
           f"P = {settings.get('prompt_length')}-token prompt; EM exact match, "
           + (f"AM approximate match (normalized token edit distance at most {approximate_threshold(results)}), "
              if has_approximate(results) else "")
           + "TA token accuracy, MED median edit distance (tokens); n documents evaluated per split"
           + ("; train sample: a uniform sample of the training documents." if any(
               "train_sample" in (m.get("groups") or {}) for m in results["models"].values()) else "."),
           windows_text(settings.get("training_windows"),
                        sorted({m.get("privacy_unit") for m in results["models"].values() if m.get("privacy_unit")})),
           "",
           "## Memorization (Table 3 of Ponomareva et al. 2022)", ""]
  lines += memorization_table(results)
  by_repetitions = repetition_table(results)
  if by_repetitions:
    lines += ["", "## Extraction by number of repetitions", "",
              "Greedy EM of the train-dup documents evaluated above, each document counted once "
              "(its copies share its prompt), grouped by how often it occurs in the training corpus.", ""]
    lines += by_repetitions
  audit = audit_table(results)
  if audit:
    lines += ["", "## Privacy audit (one training run: Steinke, Nasr and Jagielski 2023; Mahloujifar, Melis and "
              "Chaudhuri 2025, via jax-privacy's CanaryScoreAuditor)", "",
              "Audit canaries, each included once with probability 1/2, scored by minus their loss. The one-run "
              "ε lower bound (Steinke, Nasr and Jagielski 2023) and its cap (the largest bound these canaries "
              "can give), the one-run f-DP bound (Mahloujifar, Melis and Chaudhuri 2025), the attack's TPR and "
              "AUROC (bootstrap intervals) come from jax-privacy's CanaryScoreAuditor; correct / guesses is "
              "the k-a-side cross-check (the lowest-loss canaries guessed in, the highest-loss out). "
              "A DP model's one-run bound must not exceed its ε.", ""]
    lines += audit
  lines += ["", "## Utility (Table 2 of Ponomareva et al. 2022)", ""]
  lines += utility_table(results)
  lines += ["", "ε of a DP model with a non-private vocabulary covers training only (marked "
            "\"(training)\"); a DP-SentencePiece vocabulary's ε is composed into its model's ε. "
            "Validation accuracy and loss are measured on held-out documents of the private corpus "
            "and are not covered by ε (not DP).", ""]
  walls = [f"{name} {m['wall_seconds'].get('train', 0):.0f} s + {m['wall_seconds'].get('memorization', 0):.0f} s"
           for name, m in results["models"].items() if m.get("wall_seconds")]
  if walls:
    lines += ["Wall time (training + memorization): " + "; ".join(walls) + ".", ""]
  return "\n".join(lines)


def approximate_threshold(results: dict) -> str:
  """The approximate-match threshold the models state (the first one that does), as text."""
  for m in results["models"].values():
    if finite(m.get("approximate_threshold")) is not None:
      return f"{m['approximate_threshold']:g}"
  return "the report's threshold"


def audit_panel(ax, results: dict, names: List[str]) -> None:
  """Bars per audited model: the one-run and f-DP ε lower bounds beside the ledger's ε (∞ written)."""
  series = (("epsilon_lower_bound", "one-run bound"), ("epsilon_lower_bound_fdp", "f-DP bound"),
            ("ledger_epsilon", "ledger ε"))
  width = 0.8 / len(series)
  for j, (key, label) in enumerate(series):
    points = [(i + j * width, finite(results["models"][n]["audit"].get(key))) for i, n in enumerate(names)]
    points = [(x, y) for x, y in points if y is not None]
    if points:
      ax.bar([x for x, _ in points], [y for _, y in points], width, label=label)
  for i, n in enumerate(names):
    if results["models"][n]["audit"].get("ledger_epsilon") is None:
      ax.text(i + 2 * width, 0, "ledger ε = ∞", ha="center", va="bottom", rotation=90, fontsize=7)
  ax.set_xticks([i + width for i in range(len(names))])
  ax.set_xticklabels(names, rotation=20, fontsize=8)
  ax.set_ylabel("ε")
  ax.set_title("Privacy audit: ε lower bounds")
  ax.legend(fontsize=8)


def write_figure(results: dict, path: str) -> Optional[str]:
  """figure.png: EM per split per model (bars), validation accuracy vs ε (points), and when a
  model has an audit its ε lower bounds beside the ledger's ε (bars)."""
  plt = pyplot()
  if plt is None:
    return None
  models = list(results["models"])
  audited = [n for n in models if results["models"][n].get("audit")]
  fig, axes = plt.subplots(1, 3 if audited else 2, figsize=(16 if audited else 11, 4))
  ax1, ax2 = axes[0], axes[1]
  width = 0.8 / max(len(models), 1)
  top = 1.0
  for k, name in enumerate(models):
    ems = [100 * (results["models"][name]["splits"][s]["em"] or 0.0) for s in SPLITS]
    ax1.bar([i + k * width for i in range(len(SPLITS))], ems, width, label=name)
    top = max([top] + ems)
  ax1.set_ylim(0, 1.1 * top)
  ax1.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(SPLITS))])
  ax1.set_xticklabels([SPLIT_TITLES[s] for s in SPLITS])
  ax1.set_ylabel("exact match (%)")
  ax1.set_title("Memorization (greedy EM)")
  ax1.legend(fontsize=8)
  finite = [results["models"][n]["epsilon"] for n in models if results["models"][n].get("epsilon")]
  right = 2 * max(finite) if finite else 10.0
  for name in models:
    m = results["models"][name]
    acc = m.get("validation_token_accuracy")
    if acc is None:
      continue
    eps = m.get("epsilon") if m.get("private") else None
    ax2.scatter([eps if eps is not None else right], [100 * acc], label=name)
  ax2.axvline(right, color="grey", lw=0.5, ls=":")
  ax2.set_xlabel("ε (non-private models at the dotted line, ε = ∞)")
  ax2.set_ylabel("validation token accuracy (%, not DP)")
  ax2.set_title("Utility vs ε")
  ax2.legend(fontsize=8)
  if audited:
    audit_panel(axes[2], results, audited)
  return save_figure(plt, fig, path)


def pyplot():
  """matplotlib.pyplot with the Agg backend, or None (with a warning) when it is not installed."""
  try:
    matplotlib.use("Agg")
    plt = import_now(_pyplot)
  except ImportError:  # `MissingLibrary` is one
    logger.warning("matplotlib is not installed: no figure written")
    return None
  return plt


def save_figure(plt, fig, path: str) -> str:
  """Writes `fig` as a PNG to `path` atomically and closes it; returns the path."""
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=100)
  plt.close(fig)
  return io_lib.write_bytes_atomic(path, buf.getvalue())


def write_results(results: dict, output_dir: str, markdown: Callable[[dict], str] = None,
                  figure: Callable[[dict, str], Optional[str]] = None) -> List[str]:
  """Writes results.json, results.md and figure.png to `output_dir`; returns the paths written.

  `markdown` and `figure` make results.md and figure.png (default: the memorization part's).
  """
  markdown, figure = markdown or results_markdown, figure or write_figure
  paths = [io_lib.write_json_atomic(os.path.join(output_dir, "results.json"), results),
           io_lib.write_text_atomic(os.path.join(output_dir, "results.md"), markdown(results))]
  written = figure(results, os.path.join(output_dir, "figure.png"))
  if written:
    paths.append(written)
  return paths
