"""`private-t5 redact`: detect secrets and write the redacted corpus D' with a report.

  private-t5 redact --corpus=/path/train.jsonl.gz --output=/path/train_redacted.jsonl.gz \
      --level=entity --report_levels=all

writes D' (JSONL, one `{"id", "text"[, "user"]}` a line, private spans replaced by typed
placeholders such as <PERSON>, <PHONE>, <EMAIL>, <ID>, <DATE>, <URL>) and, beside it,
`train_redacted.report.json` with the fraction of tokens marked private at each level, the
documents skipped because nothing public was left, and the detector backend of each level
(naming the heuristic fallback when no NER model or POS tagger is installed).
"""
import sys

from private_t5 import io as io_lib
from private_t5.errors import ConfigError
from private_t5.stages import flags


def _parser():
  from private_t5.selective import detectors  # pylint: disable=g-import-not-at-top
  p = flags.StageParser("redact", __doc__.split("\n\n")[0])
  p.add_flag("corpus", help="corpus spec (see private_t5.data.corpora)")
  p.add_flag("output", help="redacted corpus path (.jsonl or .jsonl.gz)")
  p.add_flag("level", default="entity", choices=detectors.LEVELS, help="detector level written")
  p.add_flag("report_levels", default=None,
             help="levels whose private-token fraction is reported: comma-separated or 'all' "
                  "(default: pattern up to --level)")
  p.add_flag("backend", default="auto", choices=detectors.BACKENDS,
             help="auto: NER model / POS tagger when installed, else the named heuristics; heuristic: never; spacy: required")
  p.add_flag("report", default=None, help="report path (default: OUTPUT stem + .report.json)")
  p.add_flag("max_documents", type=int, default=None, help="read at most this many documents")
  p.add_flag("text_field", default="text", help="JSONL/TSV field of the text")
  p.add_flag("user_field", default=None, help="JSONL/TSV field of the user, kept in D'")
  p.add_flag("progress_every", type=int, default=1000, help="progress line every N documents")
  return p


def main(argv) -> int:
  from private_t5.data import corpora  # pylint: disable=g-import-not-at-top
  from private_t5.selective import detectors, redaction  # pylint: disable=g-import-not-at-top
  parser = _parser()
  args = parser.parse_stage_args(argv).args
  flags.check_required(parser, args, ("corpus", "output"))
  if not args.output.endswith((".jsonl", ".jsonl.gz")):
    raise ConfigError(f"--output must end in .jsonl or .jsonl.gz, got {args.output!r}")
  io_lib.check_output_file(args.output)
  io_lib.check_output_file(args.report or redaction.default_report_path(args.output), "--report")
  levels = None
  if args.report_levels:
    levels = (list(detectors.LEVELS) if args.report_levels == "all"
              else [x.strip() for x in args.report_levels.split(",") if x.strip()])
    for lvl in levels:
      if lvl not in detectors.LEVELS:
        raise ConfigError(f"--report_levels: unknown level {lvl!r} (levels: {', '.join(detectors.LEVELS)})")
  docs = corpora.iter_documents(args.corpus, text_field=args.text_field, user_field=args.user_field,
                                max_documents=args.max_documents)
  report = redaction.redact_corpus(docs, args.output, level=args.level, report_levels=levels,
                                   backend=args.backend, report_path=args.report, source=args.corpus,
                                   progress_every=args.progress_every, log=redaction.log_to_stderr)
  print(f"[redact] wrote {report['output']}: {report['documents_written']} of {report['documents_read']} "
        f"documents ({report['fully_redacted_skipped']} fully redacted, skipped), "
        f"{report['documents_per_second']:.0f} documents/s")
  for lvl, s in report["levels"].items():
    print(f"[redact]   {lvl:<16} Pct {s['pct']:.2%} private tokens ({s['private_tokens']} of {s['tokens']})")
  for note in report["fallbacks"]:
    print(f"[redact] fallback: {note}")
  print(f"[redact] report: {report['report_path']}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
