"""The tables and the figure of `private-t5 study`: results.json, results.md, figure.png.

results.md holds a Table-3-like memorization table (greedy EM / TA / MED per split, as in
Ponomareva et al. 2022, Table 3) and a Table-2-like utility table (teacher-forced validation
token accuracy), each row with its ε and δ. figure.png shows EM per split per model and
validation accuracy against ε (matplotlib; skipped with a warning when it is not installed).
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


def pct(value: Optional[float]) -> str:
  return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}"


def num(value: Optional[float]) -> str:
  return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:g}"


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


def memorization_table(results: dict) -> List[str]:
  """Table-3-like: one row per model; EM % / TA % / MED (n) per split."""
  header = "| model | objective | ε | δ | " + " | ".join(f"{SPLIT_TITLES[s]} EM % / TA % / MED (n)" for s in SPLITS) + " |"
  lines = [header, "|" + "---|" * (4 + len(SPLITS))]
  for name, m in results["models"].items():
    eps, delta = privacy_text(m)
    cells = []
    for s in SPLITS:
      v = m["splits"][s]
      cells.append(f"{pct(v['em'])} / {pct(v['ta'])} / {num(v['med'])} ({v['n']})")
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


def audit_table(results: dict) -> List[str]:
  """The one-run privacy audit of each model: the ε lower bound beside the ledger's ε."""
  rows = [(name, m) for name, m in results["models"].items() if m.get("audit")]
  if not rows:
    return []
  lines = ["| model | ε lower bound | confidence | correct / guesses | canaries | ledger ε | |",
           "|---|---:|---:|---:|---:|---|---|"]
  for name, m in rows:
    a = m["audit"]
    ledger = "∞" if a.get("ledger_epsilon") is None else f"{a['ledger_epsilon']:.3g}"
    lines.append(f"| {name} | {a['epsilon_lower_bound']:.3f} | {100 * a['confidence']:g}% | {a['correct']} / "
                 f"{a['guesses']} | {a['num_canaries']} | {ledger} | "
                 f"{'**FAILED: bound > ledger ε**' if a.get('violation') else ''} |")
  return lines


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
           f"P = {settings.get('prompt_length')}-token prompt; EM exact match, TA token accuracy, MED median "
           "edit distance (tokens); n documents evaluated per split.",
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
    lines += ["", "## Privacy audit (Steinke, Nasr and Jagielski 2023, one training run)", "",
              "Audit canaries, each included once with probability 1/2; the lowest-loss canaries guessed in, "
              "the highest-loss out. A DP model's bound must not exceed its ε.", ""]
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


def write_figure(results: dict, path: str) -> Optional[str]:
  """figure.png: EM per split per model (bars), validation accuracy vs ε (points)."""
  plt = pyplot()
  if plt is None:
    return None
  models = list(results["models"])
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
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
