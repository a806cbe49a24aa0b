"""`private-t5 canaries`: insert random canaries into a training corpus and record them.

  private-t5 canaries --corpus=/path/train.jsonl.gz --output=/path/train_canaries.jsonl.gz \
      --template="My ID is {secret}" --secret_length=6 --repetitions=1,10,100

writes the new corpus (JSONL, gzip when the name ends in .gz) and, next to it,
`train_canaries.canaries.json` with the format, the secrets, their repetitions and the seed.
Give that record to `private-t5 memorization` (--gin.CANARIES=...) to measure exposure.

  private-t5 canaries --audit --corpus=/path/train.jsonl.gz --output=/path/train_audit.jsonl.gz \
      --num_canaries=1000 --canary_kind=words [--repetitions=1]

plants canaries for the one-run privacy audit (Steinke, Nasr and Jagielski 2023): m random
documents (--canary_kind: `words` of the corpus, `tokens` of --vocab_path, or draws from the
corpus's rarest pieces of --vocab_path, `rare_tokens`, or its rarest words, `rare_words`; several
kinds joined by commas, `words,rare_tokens`, share the m canaries in turn and the audit reports
each kind alone as well, on the same training run), each
included with probability 1/2 by a secret seed (OS entropy unless --seed), every included one
--repetitions times; the secret membership record `train_audit.audit.json` (mode 0600) goes
beside the new corpus. Give it to `private-t5 memorization` (--gin.AUDIT=...).
"""
import os
import string
import sys

from private_t5 import io as io_lib
from private_t5.errors import ConfigError
from private_t5.stages import flags


def _parser():
  p = flags.StageParser("canaries", __doc__.split("\n\n")[0])
  p.add_flag("corpus", aliases=("input",), help="corpus spec of the training corpus (required)")
  p.add_flag("output", help="path of the new corpus (.jsonl or .jsonl.gz) (required)")
  p.add_flag("template", default="My ID is {secret}", help="canary format with one {secret}")
  p.add_flag("secret_length", type=int, default=6, help="symbols in a secret (default 6)")
  p.add_flag("alphabet", default=string.digits, help="symbols of the secret (default digits)")
  p.add_flag("repetitions", default=None, help="copies of each canary, comma-separated (default 1,10,100; "
             "with --audit: one number, copies of each included canary, default 1)")
  p.add_flag("per_repetition", type=int, default=1, help="canaries for each repetition count")
  p.add_flag("num_reference", type=int, default=1, help="never-inserted reference canaries")
  p.add_flag("seed", type=int, default=None, help="secret/position seed (default: OS entropy)")
  p.add_flag("text_field", default="text", help="JSONL/TSV field of the text")
  p.add_flag("audit", action="store_true", default=False,
             help="plant privacy-audit canaries, each included with probability 1/2 (see above)")
  p.add_flag("num_canaries", type=int, default=1000, help="with --audit: m, the number of canaries")
  p.add_flag("canary_kind", default="words", help="with --audit: 'words' (random words of the corpus), "
             "'tokens' (random pieces of --vocab_path), 'rare_tokens' (random pieces among the corpus's rarest "
             "pieces of --vocab_path) or 'rare_words' (random words among the corpus's rarest words); several "
             "joined by commas (words,rare_tokens) split the m canaries between them, each kind audited alone too")
  p.add_flag("canary_length", type=int, default=8, help="with --audit: words or pieces in a canary")
  p.add_flag("vocab_path", default=None,
             help="with --audit --canary_kind=tokens or rare_tokens: the SentencePiece model")
  return p


def main(argv) -> int:
  from private_t5.data import corpora  # pylint: disable=g-import-not-at-top
  from private_t5.eval import audit, canaries as canaries_lib  # pylint: disable=g-import-not-at-top
  parser = _parser()
  args = parser.parse_stage_args(argv).args
  flags.check_required(parser, args, ("corpus", "output"))
  try:
    repetitions = [int(x) for x in (args.repetitions or "1,10,100").split(",") if x.strip()]
  except ValueError:
    raise ConfigError(f"--repetitions must be comma-separated integers, got {args.repetitions!r}") from None
  if not args.output.endswith((".jsonl", ".jsonl.gz")):
    raise ConfigError(f"--output must end in .jsonl or .jsonl.gz, got {args.output!r}")
  if os.path.exists(args.output) and os.path.exists(args.corpus) and os.path.samefile(args.corpus, args.output):
    raise ConfigError(f"--output {args.output!r} is the input corpus; write the corpus with canaries "
                      "to a new file")
  if args.audit:
    audit.check_outside_model_dir(args.output)
    if args.num_canaries < audit.MIN_CANARIES:
      raise ConfigError(f"with --audit, --num_canaries must be >= {audit.MIN_CANARIES} (an audit guesses at least "
                        f"one canary in and one out), got {args.num_canaries}")
  record = (audit.record_path if args.audit else canaries_lib.record_path)(args.output)
  for path in (args.output, record):  # both files can be written, before the corpus is read
    io_lib.check_output_file(path)
  if args.audit:
    return _plant_audit(args)
  fmt = canaries_lib.CanaryFormat(template=args.template, alphabet=args.alphabet,
                                  length=args.secret_length).validate()
  canaries, seed = canaries_lib.make_canaries(fmt, repetitions, args.per_repetition, args.num_reference,
                                              args.seed)
  open_docs = lambda: corpora.iter_documents(args.corpus, text_field=args.text_field)
  # Two passes, nothing held a document: the count (an empty or unreadable corpus, or ids that
  # repeat or equal a canary's, are refused before anything is written), then the copy.
  corpus, record, n = canaries_lib.write_canary_corpus(open_docs, args.output, fmt, canaries, seed, source=args.corpus,
                                                       num_documents=canaries_lib.count_documents(open_docs, canaries))
  copies = sum(c.repetitions for c in canaries)
  print(f"[canaries] wrote {corpus}: {n} documents ({copies} canary copies of {len(canaries)} canaries, "
        f"|R| = {fmt.space_size})")
  print(f"[canaries] record: {record}")
  return 0


def _plant_audit(args) -> int:
  """`--audit`: m canaries, each in with probability 1/2, and the secret membership record."""
  from private_t5.data import corpora  # pylint: disable=g-import-not-at-top
  from private_t5.eval import audit  # pylint: disable=g-import-not-at-top
  reps = (args.repetitions or "1").strip()
  if not reps.isdigit() or int(reps) < 1:
    raise ConfigError(f"with --audit, --repetitions is one positive integer (copies of each included canary), "
                      f"got {args.repetitions!r}")
  try:
    kinds = audit.parse_kinds(args.canary_kind)
  except ConfigError:
    raise ConfigError(f"--canary_kind must be one of {', '.join(audit.KINDS)}, or several joined by commas "
                      f"(words,rare_tokens), got {args.canary_kind!r}") from None
  vocab = None
  if set(kinds) & set(audit.VOCAB_KINDS):
    if not args.vocab_path:
      raise ConfigError(f"--canary_kind={args.canary_kind} needs --vocab_path (a SentencePiece model)")
    from private_t5 import vocabulary  # pylint: disable=g-import-not-at-top
    vocab = vocabulary.load_vocabulary(args.vocab_path)
  # The corpus is read, never held: its words or pieces counted (kinds "words", "rare_words",
  # "rare_tokens"), its documents counted, then the copy.
  open_docs = lambda: corpora.iter_documents(args.corpus, text_field=args.text_field)
  corpus, record, n, rec = audit.plant(open_docs, args.output, num_canaries=args.num_canaries, kind=args.canary_kind,
                                       length=args.canary_length, repetitions=int(reps), seed=args.seed,
                                       vocab=vocab, source=args.corpus)
  included = int(rec.included.sum())
  print(f"[canaries] wrote {corpus}: {n} documents ({included} of {rec.num_canaries} audit canaries included, "
        f"{int(reps)} cop{'y' if int(reps) == 1 else 'ies'} each)")
  print(f"[canaries] secret membership record (mode 0600; keep it out of model directories): {record}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
