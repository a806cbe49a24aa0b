#!/usr/bin/env bash
# The quickstart main job: install (if needed), train a DP-SentencePiece vocabulary on the corpus
# (if none exists yet), then pretrain a tiny T5 with span corruption and DP-Adafactor, evaluate
# it on held-out documents, checkpoint it, and print where everything is and the ε spent (the
# vocabulary's ε and training's, composed).
#
#   bash scripts/quickstart.sh                          # embedded corpus (builtin:python_docs)
#   bash scripts/quickstart.sh path/to/corpus.jsonl.gz  # your corpus (see docs/data.md)
#   bash scripts/quickstart.sh builtin:python_docs --gin.DP=None   # non-private baseline
#
# Arguments after the corpus are passed to `private-t5 train` (--gin.NAME=VALUE overrides).
# Environment: QUICKSTART_DIR (default: ./runs/quickstart), QUICKSTART_VOCAB_SIZE (2000),
# QUICKSTART_VOCAB_EPSILON (8: the vocabulary's ε; a small corpus keeps few words at small ε).
# About 5-10 minutes on 2 CPU cores. Re-running resumes from the latest checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/install.sh"

CORPUS="builtin:python_docs"
if [[ $# -gt 0 && "$1" != --* ]]; then
  CORPUS="$1"
  shift
fi
WORK_DIR="$(mkdir -p "${QUICKSTART_DIR:-$ROOT/runs/quickstart}" && cd "${QUICKSTART_DIR:-$ROOT/runs/quickstart}" && pwd)"
VOCAB_SIZE="${QUICKSTART_VOCAB_SIZE:-2000}"
# One vocabulary and one run per corpus: a name derived from the corpus spec.
SLUG="$(printf '%s' "$CORPUS" | tr -c 'A-Za-z0-9._-' '_' | tail -c 60)"
VOCAB_EPSILON="${QUICKSTART_VOCAB_EPSILON:-8}"
VOCAB="$WORK_DIR/$SLUG/vocab/dp_spm_${VOCAB_SIZE}_eps${VOCAB_EPSILON}.model"
MODEL_DIR="$WORK_DIR/$SLUG/model"
PT5="$VENV/bin/private-t5"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
cd "$ROOT"

if [[ ! -f "$VOCAB" ]]; then
  # DP-SentencePiece: the vocabulary is computed from the private corpus too, so it must be DP;
  # its privacy report (beside it, naming it by hash) is composed into the training ledger.
  # Capped sensitivity (each word once, at most 64 words per document) keeps more words.
  echo "[quickstart] training a $VOCAB_SIZE-piece SentencePiece vocabulary on $CORPUS (DP-SentencePiece, ε = $VOCAB_EPSILON)"
  "$PT5" dp-spm --gin_file=configs/runs/dp_spm.gin --corpus="$CORPUS" --vocab_size="$VOCAB_SIZE" \
    --output="$VOCAB" --target_epsilon="$VOCAB_EPSILON" --sensitivity=capped --max_words=64 > /dev/null
  echo "[quickstart] privacy report of the vocabulary: $(dirname "$VOCAB")/privacy_report.json"
else
  echo "[quickstart] reusing vocabulary $VOCAB"
fi
# The model's embedding must hold the pieces plus T5's 100 sentinels, rounded up to 128.
MODEL_VOCAB=$(( (VOCAB_SIZE + 100 + 127) / 128 * 128 ))

echo "[quickstart] pretraining a tiny T5 (span corruption, DP-Adafactor) in $MODEL_DIR"
"$PT5" train \
  --gin_file=configs/experiments/quickstart.gin \
  --gin.MODEL_DIR="$MODEL_DIR" \
  --gin.CORPUS="$CORPUS" \
  --gin.VOCAB_PATH="$VOCAB" \
  --gin.VOCAB_SIZE="$MODEL_VOCAB" \
  "$@"

# The memorization stage compares the documents training read with held-out documents of the
# same corpus: write both, split as the run split them (its operative VALIDATION_FRACTION).
SPLIT_DIR="$WORK_DIR/$SLUG/corpus"
"$VENV/bin/python" - "$CORPUS" "$MODEL_DIR/config.gin" "$SPLIT_DIR" <<'PY'
import json, os, re, sys
from private_t5.data import corpora, source
corpus, config, out = sys.argv[1:]
with open(config, encoding="utf-8") as f:
  fraction = float(re.search(r"^VALIDATION_FRACTION = (.+)$", f.read(), re.M).group(1))
docs, _ = corpora.read_corpus(corpus)
os.makedirs(out, exist_ok=True)
files = {False: open(os.path.join(out, "train.jsonl"), "w", encoding="utf-8"),
         True: open(os.path.join(out, "valid.jsonl"), "w", encoding="utf-8")}
for d in docs:
  files[source.in_validation(d.id, fraction)].write(json.dumps({"id": d.id, "text": d.text}) + "\n")
for f in files.values():
  f.close()
PY

echo "[quickstart] vocabulary:   $VOCAB"
echo "[quickstart] model dir:    $MODEL_DIR"
echo "[quickstart] documents:    $SPLIT_DIR/train.jsonl (trained on), $SPLIT_DIR/valid.jsonl (held out)"
echo "[quickstart] next, how much training text the model regenerates (docs/memorization.md):"
echo "  $PT5 memorization --gin_file=configs/runs/memorization.gin --gin.MODEL_DIR=$MODEL_DIR \\"
echo "    --gin.TRAIN_CORPUS=$SPLIT_DIR/train.jsonl --gin.VALID_CORPUS=$SPLIT_DIR/valid.jsonl \\"
echo "    --gin.OUTPUT_DIR=$WORK_DIR/$SLUG/memorization --gin.PROMPT_LENGTH=64 --gin.GENERATION_LENGTH=32"
echo "[quickstart] fine-tuning and export: docs/finetuning.md, docs/training.md"
