"""DP-SentencePiece: a differentially private word histogram, then SentencePiece (Ponomareva et al. 2022, §3.1).

Algorithm 1 of Ponomareva et al. 2022, with each document's contribution bounded first:

1. Every document (the privacy unit) becomes a word histogram (whitespace-separated words,
   unnormalised), bounded so that one document changes the summed histogram by at most
   k in L2 norm and m in L∞ norm, and touches at most `n` distinct words:
   * "paper": counts with multiplicity over at most N words (N = 256 by default; longer
     documents keep N evenly spaced word positions): k = m = n = N.
   * "capped": each word counted at most once, at most W distinct words (the W most frequent
     in the document): k = √W, m = 1, n = W.
2. The histograms are summed (streaming, in parallel over chunks of documents).
3. N(0, σ²) is added to every observed count; a word is kept when its noisy count ≥ T.
4. SentencePiece is trained on the kept words only (`spm.model_from_word_counts`), optionally
   merged with the exact word counts of a public corpus (`merge_public`), always with byte
   fallback and a public base character set (`base_characters`): pieces that no private data
   chose, so that no text ever becomes `<unk>` and they cost no privacy.

The four steps are separate functions (`bounded_counts` → `build_histogram` →
`private_histogram` → `merge_public`), so each can be run by another executor.

Privacy (add/remove one document; Wilson et al. 2020, Hoory et al. 2021 Theorem 1): words
already in the corpus form a Gaussian mechanism with L2 sensitivity k, (ε, δ_g)-DP; a word
present only in the added document is released only if m + Z ≥ T, so by a union bound over its
≤ n distinct words the release differs with probability at most δ_t = n·Q((T − m)/σ), where Q is
the standard normal tail. The whole release is (ε, δ_g + δ_t)-DP. We split δ equally, as the
paper's 2.5/δ = 1.25/(δ/2) does: δ_g = δ_t = δ/2, hence

  T = m + σ·Φ⁻¹(1 − δ/(2n)) = m + σ·√2·erf⁻¹(1 − δ/n).

The paper prints T = m + σ·erf⁻¹(1 − δ/(2N)), which drops the √2 (`accounting.threshold_tail`
checks numerically how much δ that threshold really spends). The paper's
ε = (k/σ)·√(2 ln(2.5/δ)) is the classical Gaussian bound (Dwork & Roth Thm A.1) at δ/2, valid
only for ε < 1 (beyond it the formula UNDERSTATES ε: σ = 58.9, k = 256 gives 27.0 by the
formula, 33.7 in truth); `epsilon` is the tight Gaussian-mechanism ε (the exact hockey-stick
divergence of noise multiplier σ/k at δ/2), valid for every ε. The accounting lives in
`dp.accounting` and the report's privacy fields in `dp.privacy_report` (`vocabulary_report`).

The steps live in their own modules: the bounded histograms and their parallel sum in
`dp_spm_histogram`, the privacy parameters, noise, threshold and public merge in `dp_spm_release`,
SentencePiece on the kept words in `dp_spm_train`, and the report's diagnostics of the trained
vocabulary in `dp_spm_measures`. This module runs them in order (`train_dp_vocabulary`) and writes
the model with its privacy report.
"""
import itertools
import logging
import os
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

from private_t5 import doc_fingerprints
from private_t5.data import corpora
from private_t5.dp import privacy_report, public_vocabulary
from private_t5.dp.privacy_params import MeaninglessGuaranteeWarning
from private_t5.errors import ConfigError, DataError
from private_t5.io import check_output_file, write_bytes_atomic
from private_t5.tokenizer.dp_spm_histogram import (
    DEFAULT_MAX_WORDS,
    DEFAULT_SENSITIVITY,
    ContributionBound,
    HistogramStats,
    build_histogram,
)
from private_t5.tokenizer.dp_spm_measures import piece_sources, tokenization_utility
from private_t5.tokenizer.dp_spm_release import merge_public, noise_generator, privacy_parameters, private_histogram
from private_t5.tokenizer.dp_spm_train import (
    BYTE_PIECES,
    MAX_TRAINER_TOTAL_COUNT,
    MODEL_TYPES,
    SPECIAL_PIECES,
    UnsupportedSize,
    base_characters,
    min_vocab_size,
    processor,
    scale_counts,
    train_capped,
)
from private_t5 import moved_names

# Documented at this address before they moved to their own modules: one more release, with a
# DeprecationWarning naming the new address (`private_t5.moved_names`).
__getattr__ = moved_names.moved(__name__, {
    'private_t5.tokenizer.dp_spm_histogram': ('bounded_counts',),
    'private_t5.tokenizer.spm': ('builtin_dp_is_ignored',),
})

logger = logging.getLogger(__name__)

NONPRIVATE_LABEL = ("non-private: a SentencePiece of the requested size trained without noise or threshold on "
                    "the same bounded word histogram; for comparison only, never written or released")
# Report fields computed from the raw corpus (diagnostics, not covered by the guarantee). The
# digests of the corpus files identify them (whoever holds a candidate file can test it): not
# for release either.
NOT_DP_FIELDS = ("words_total", "words_dropped_fraction", "documents", "histogram", "corpus_file_digests")


def _iter_corpus_texts(corpus: Union[str, Sequence[str]], max_documents: Optional[int], text_field: str,
                       errors: str, data_dir: Optional[str]) -> Iterator[str]:
  specs = [corpus] if isinstance(corpus, str) else list(corpus)
  if not specs:
    raise ConfigError("no corpus given")
  for spec in specs:
    for doc in corpora.iter_documents(spec, text_field=text_field, errors=errors, data_dir=data_dir,
                                      max_documents=max_documents):
      yield doc.text


def _knobs(params: Dict[str, Any], bound: ContributionBound, public_corpus) -> str:
  words = "N" if bound.mode == "paper" else "W"
  return (f"ε={params['epsilon']:.3g}, sensitivity={bound.mode}, {words}={bound.max_words} words per document, "
          f"public corpus: {', '.join(public_corpus) if public_corpus else 'none'}")


def _as_specs(value, name: str, required: bool) -> Optional[List[str]]:
  if value is None or value == [] or value == ():
    if required:
      raise ConfigError(f"missing {name}: set a corpus spec (--{name} or --gin.{name.upper()})")
    return None
  if isinstance(value, str) and value:
    return [value]
  if isinstance(value, (list, tuple)) and all(isinstance(c, str) and c for c in value):
    return list(value)
  raise ConfigError(f"{name} must be a corpus spec or a list of them, got {value!r}")


def _sample_texts(specs: List[str], documents: int, text_field: str, errors: str,
                  data_dir: Optional[str]) -> List[str]:
  return list(itertools.islice(_iter_corpus_texts(specs, documents, text_field, errors, data_dir), documents))


def train_dp_vocabulary(corpus: Union[str, Sequence[str]], output: str, *, vocab_size: int = 32000,
                        model_type: str = "unigram", delta: float = 1e-8,
                        target_epsilon: Optional[float] = None, noise_std: Optional[float] = None,
                        sensitivity: str = DEFAULT_SENSITIVITY, max_words_per_document: int = DEFAULT_MAX_WORDS,
                        insecure_seed: Optional[int] = None, num_workers: Optional[int] = None,
                        chunk_size: int = 256, allow_vocab_cap: bool = True, strict_vocab_size: bool = False,
                        extra_characters: Optional[str] = "", public_corpus: Union[None, str, Sequence[str]] = None,
                        eval_corpus: Union[None, str, Sequence[str]] = None, eval_documents: int = 200,
                        nonprivate_baseline: bool = True,
                        character_coverage: float = 0.9995, max_documents: Optional[int] = None,
                        text_field: str = "text", errors: str = "strict", data_dir: Optional[str] = None,
                        report_path: Optional[str] = None, private_dir: Optional[str] = None,
                        verbose: bool = True,
                        histogram_fn: Optional[Callable[..., Tuple[Dict[str, int], HistogramStats]]] = None
                        ) -> Dict[str, Any]:
  """Trains a DP SentencePiece model at `output` and writes its privacy report beside it.

  Apart from it, private to the data owner (folder mode 0700, files 0600, never released): the keyed
  signatures of the documents read and their secret key, computed in the same pass
  (`doc_fingerprints`), in `<output's folder>.private/<output's name>/` (or `private_dir`), never in
  the folder of the `.model` file, which a user publishes; the report names that folder (relative to
  the model) and each file by SHA-256, never the key. A training run that declares this vocabulary
  public looks its own documents up in them (`public_declaration`).

  Every vocabulary has byte fallback (256 byte pieces) and the base characters (printable ASCII
  plus `extra_characters`): no text becomes `<unk>`, and `decode(encode(text)) == text`. These
  pieces are data-independent and count towards `vocab_size`.

  Args:
    corpus: a corpus spec (see `private_t5.data.corpora`) or a list of them.
    output: path of the `.model` file.
    vocab_size: requested SentencePiece pieces, including the 3 special, 256 byte and base
      character pieces (T5's 100 sentinels come on top, added by `load_vocabulary`).
    model_type: "unigram" (default), "bpe" or "char".
    delta: total δ (half to the Gaussian counts, half to the threshold).
    target_epsilon: calibrate σ for this ε (tight accounting); or give `noise_std`.
    noise_std: σ of the Gaussian noise on each count.
    sensitivity: "capped" (default; k = √W, m = 1) or "paper" (k = m = N).
    max_words_per_document: N (paper) or W (capped).
    insecure_seed: fixed noise seed, for deterministic tests only; default OS entropy.
    num_workers: histogram processes (default: all cores).
    allow_vocab_cap: when the kept words cannot support `vocab_size`, train the largest size
      SentencePiece accepts (one warning, reported) instead of failing.
    strict_vocab_size: fail (`DataError`) instead (same as `allow_vocab_cap=False`).
    extra_characters: characters added to the public base character set.
    public_corpus: optional public corpus spec(s): its words, counted exactly under the same
      per-document bound, are merged with the private noisy histogram (no privacy cost).
    eval_corpus: corpus spec(s) for the utility sample; default the training corpus (then the
      utility numbers are statistics of the private corpus, not DP).
    eval_documents: documents in the utility sample (0: no utility report).
    nonprivate_baseline: also measure a non-private SentencePiece of the requested size trained
      on the same bounded histogram (for comparison only; it is never written).
    report_path: default `privacy_report.json` in the model's folder.
    private_dir: where the private folder of the documents' signatures and key is made (default:
      the model's folder with `.private` appended); must be outside the model's folder.
    histogram_fn: builds the noiseless bounded histogram elsewhere (e.g. on Apache Beam,
      `dp_spm_beam.beam_histogram_fn`): called as `histogram_fn(corpus, bound, text_field=...,
      errors=..., data_dir=..., max_documents=...)`, returns (histogram, HistogramStats) as
      `build_histogram` does. Noise and threshold are still applied here, once.

  Returns:
    The privacy report (also written as JSON).
  """
  start = time.time()
  corpus_specs, public_specs, eval_specs, signatures_dir, base = _checked_inputs(
      corpus, output, public_corpus, eval_corpus, model_type, report_path, private_dir, eval_documents,
      vocab_size, extra_characters)
  allow_vocab_cap = bool(allow_vocab_cap) and not strict_vocab_size
  bound = ContributionBound(sensitivity, max_words_per_document)
  # Privacy parameters are fixed before the data is read (no data-dependent choices).
  params = privacy_parameters(delta, bound, sigma=noise_std, target_epsilon=target_epsilon)
  log = logger.info if verbose else (lambda msg: None)
  log(f"dp-spm: σ={params['noise_std']:.4g} threshold={params['threshold']:.4g} ε={params['epsilon']:.4g} "
      f"(paper formula {params['epsilon_paper_formula']:.4g}) δ={delta:g}, sensitivity {bound.as_dict()}")

  # The keyed fingerprints of the documents read (`doc_fingerprints`), computed in the same pass:
  # training checks a public declaration of this vocabulary against them, by content.
  fingerprints = doc_fingerprints.FingerprintWriter(doc_fingerprints.new_key(),
                                                    directory=os.path.dirname(os.path.abspath(output)))
  reading = _Reading(text_field, errors, data_dir, max_documents, num_workers, chunk_size, log)
  histogram, hstats = _corpus_histogram(corpus, corpus_specs, bound, delta, fingerprints, histogram_fn, reading)
  release = _release_words(histogram, params, bound, public_specs, insecure_seed, model_type, base, reading)
  trained_size, model, actual_size, size_warning = _train_model(
      release.word_counts, vocab_size, model_type, allow_vocab_cap, character_coverage, base, params, bound,
      public_specs)
  sources = piece_sources(model, release.kept, release.public_counts or (), base)
  utility, not_dp = _utility(model, histogram, corpus_specs, eval_specs, eval_documents, nonprivate_baseline,
                             vocab_size, model_type, character_coverage, base, reading)
  del histogram
  fingerprint_record = _write_fingerprints(fingerprints, output, signatures_dir, hstats.documents)

  report = _report(
      params, model, corpus, corpus_specs, output, insecure_seed, bound, hstats, release, public_specs,
      sizes=(actual_size, vocab_size, trained_size, size_warning), base=base, sources=sources,
      model_type=model_type, fingerprint_record=fingerprint_record, utility=utility, start=start, not_dp=not_dp)
  report_path = report_path or privacy_report.vocabulary_report_path(output)
  # The pair is written as one unit: the report (naming the model by its hash) is committed
  # first, then the model, already on disk, is renamed into place. A kill leaves no model
  # without its report; at worst (between the two renames) the old model beside the new report,
  # which names another vocabulary, so training does not compose it.
  write_bytes_atomic(output, model,
                     before_rename=lambda: privacy_report.write_report(report_path, report, sort_keys=False))
  report["report_path"] = os.path.abspath(report_path)
  _log_outcome(log, sources, utility, eval_specs, actual_size, output, report_path, report["seconds"],
               signatures_dir)
  return report


class _Reading(NamedTuple):
  """How the corpora are read and counted, and where progress is logged."""
  text_field: str
  errors: str
  data_dir: Optional[str]
  max_documents: Optional[int]
  num_workers: Optional[int]
  chunk_size: int
  log: Callable[[str], None]


class _Release(NamedTuple):
  """The words kept from the noisy histogram, the public counts merged with them, and what the trainer gets."""
  words_total: int
  kept: Dict[str, float]
  public_counts: Optional[Dict[str, int]]
  public_stats: Optional[HistogramStats]
  word_counts: List[Tuple[str, float]]
  count_scale: float


def _checked_inputs(corpus, output, public_corpus, eval_corpus, model_type: str, report_path: Optional[str],
                    private_dir: Optional[str], eval_documents, vocab_size,
                    extra_characters: Optional[str]) -> Tuple[List[str], Optional[List[str]], Optional[List[str]],
                                                              str, str]:
  """Checks the arguments and output paths before the corpus is read: (specs, private folder, base characters)."""
  if not isinstance(output, str) or not output:
    raise ConfigError("missing output: set the .model path (--output or --gin.OUTPUT)")
  corpus_specs = _as_specs(corpus, "corpus", required=True)
  public_specs = _as_specs(public_corpus, "public_corpus", required=False)
  eval_specs = _as_specs(eval_corpus, "eval_corpus", required=False)
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
  if not str(output).endswith(".model"):
    raise ConfigError(f"output must end with .model, got {output!r}")
  # The model, its report and its private signature files can be written, before the corpus is read.
  signatures_dir = doc_fingerprints.private_dir(str(output), private_dir)
  model_folder = os.path.dirname(os.path.abspath(output))
  if os.path.commonpath([model_folder, signatures_dir]) == model_folder:
    raise ConfigError(f"private_dir {private_dir!r} is inside the folder of the vocabulary {output!r}: the "
                      "documents' signatures and their key must not be published with it; choose a folder outside it")
  for path in filter(None, (output, report_path)):
    check_output_file(path, "output")
  check_output_file(os.path.join(signatures_dir, doc_fingerprints.KEY_FILE), "private_dir")
  if isinstance(eval_documents, bool) or not isinstance(eval_documents, int) or eval_documents < 0:
    raise ConfigError(f"eval_documents must be an integer >= 0, got {eval_documents!r}")
  base = base_characters(extra_characters)
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < min_vocab_size(base):
    raise ConfigError(f"vocab_size must be an integer >= {min_vocab_size(base)} ({SPECIAL_PIECES} special + "
                      f"{BYTE_PIECES} byte pieces + the word boundary + {len(base)} base characters), "
                      f"got {vocab_size!r}")
  return corpus_specs, public_specs, eval_specs, signatures_dir, base


def _corpus_histogram(corpus, corpus_specs: List[str], bound: ContributionBound, delta: float,
                      fingerprints: doc_fingerprints.FingerprintWriter, histogram_fn,
                      reading: _Reading) -> Tuple[Dict[str, int], HistogramStats]:
  """Builds the noiseless bounded word histogram of the private corpus, fingerprinting its documents on the way."""
  log = reading.log
  if histogram_fn is not None:
    histogram, hstats = histogram_fn(corpus_specs, bound, text_field=reading.text_field, errors=reading.errors,
                                     data_dir=reading.data_dir, max_documents=reading.max_documents,
                                     fingerprints=fingerprints)
  else:
    texts = _iter_corpus_texts(corpus_specs, reading.max_documents, reading.text_field, reading.errors,
                               reading.data_dir)
    progress = lambda s: log(f"dp-spm: {s.documents} documents, {s.bytes / 1e6:.1f} MB, "
                             f"{s.bytes / 1e6 / max(s.seconds, 1e-9):.1f} MB/s")
    histogram, hstats = build_histogram(texts, bound, num_workers=reading.num_workers,
                                        chunk_size=reading.chunk_size, progress=progress, fingerprints=fingerprints)
  if hstats.documents == 0 or not histogram:
    raise DataError(f"corpus {corpus!r} has no words")
  if delta >= 1.0 / hstats.documents:
    # stacklevel 3: the caller of train_dp_vocabulary.
    warnings.warn(f"delta={delta:g} >= 1/number of documents={1.0 / hstats.documents:g}: the (ε, δ) "
                  "guarantee is meaningless; use δ << 1/number of documents", MeaninglessGuaranteeWarning,
                  stacklevel=3)
    logger.warning("delta=%g >= 1/%d documents: meaningless guarantee", delta, hstats.documents)
  log(f"dp-spm: histogram of {len(histogram)} words from {hstats.documents} documents "
      f"({hstats.bytes / 1e6:.1f} MB in {hstats.seconds:.1f} s)")
  return histogram, hstats


def _release_words(histogram: Dict[str, int], params: Dict[str, Any], bound: ContributionBound,
                   public_specs: Optional[List[str]], insecure_seed: Optional[int], model_type: str, base: str,
                   reading: _Reading) -> _Release:
  """Adds the noise, keeps the words over the threshold, merges the public counts and scales them for the trainer."""
  log = reading.log
  rng = noise_generator(insecure_seed)
  kept = private_histogram(histogram, params["noise_std"], params["threshold"], rng)
  words_total = len(histogram)
  public_counts, public_stats = None, None
  if public_specs:
    # Public text: counted exactly (no noise, no threshold) under the same bound, so that its
    # counts are on the private histogram's scale.
    public_counts, public_stats = build_histogram(
        _iter_corpus_texts(public_specs, reading.max_documents, reading.text_field, reading.errors,
                           reading.data_dir), bound,
        num_workers=reading.num_workers, chunk_size=reading.chunk_size)
    log(f"dp-spm: public corpus: {len(public_counts)} words from {public_stats.documents} documents")
  if not kept and not public_counts:
    hint = "" if bound.mode == "capped" else "sensitivity='capped', "
    raise DataError(
        f"every word was dropped: no noisy count reached the threshold {params['threshold']:.4g} "
        f"(σ={params['noise_std']:.4g}); raise the privacy budget (target_epsilon), use "
        f"{hint}a smaller max_words_per_document, a public corpus (public_corpus) or a larger corpus")
  word_counts, count_scale = scale_counts(merge_public(kept, public_counts))
  if count_scale < 1.0:
    log(f"dp-spm: the kept counts are scaled by {count_scale:.3g} for SentencePiece's trainer (its memory "
        f"grows with their total; at most {MAX_TRAINER_TOTAL_COUNT:,})")
  log(f"dp-spm: kept {len(kept)} of {words_total} words"
      + (f" + {len(public_counts)} public words" if public_counts else "")
      + f"; training {model_type} SentencePiece (byte fallback, {len(base)} base characters)")
  return _Release(words_total, kept, public_counts, public_stats, word_counts, count_scale)


def _train_model(word_counts, vocab_size: int, model_type: str, allow_vocab_cap: bool, character_coverage: float,
                 base: str, params: Dict[str, Any], bound: ContributionBound,
                 public_specs: Optional[List[str]]) -> Tuple[int, bytes, int, Optional[str]]:
  """Trains SentencePiece on the released words: (size trained, model, its pieces, any size warning)."""
  try:
    trained_size, model = train_capped(word_counts, vocab_size, model_type, allow_vocab_cap,
                                       character_coverage, base)
  except UnsupportedSize as e:
    raise DataError(f"the {len(word_counts)} training words support at most {e.cap} pieces, fewer than "
                    f"vocab_size={vocab_size} ({_knobs(params, bound, public_specs)}); lower vocab_size, raise "
                    "epsilon, use sensitivity='capped' or fewer words per document, add a public corpus, or "
                    "allow a smaller vocabulary (drop --strict_vocab_size)") from None
  actual_size = processor(model).get_piece_size()
  size_warning = None
  if actual_size < vocab_size:
    fix = "raise ε, " + ("use sensitivity=capped, " if bound.mode == "paper" else "") + (
        "use fewer words per document, " + ("add more public text" if public_specs else "add --public_corpus"))
    size_warning = (f"dp-spm: only {actual_size} of the {vocab_size} requested pieces: the kept words support "
                    f"no more ({_knobs(params, bound, public_specs)}); {fix} (--strict_vocab_size makes this "
                    "an error)")
    logger.warning("%s", size_warning)
  return trained_size, model, actual_size, size_warning


def _utility(model: bytes, histogram: Dict[str, int], corpus_specs: List[str], eval_specs: Optional[List[str]],
             eval_documents: int, nonprivate_baseline: bool, vocab_size: int, model_type: str,
             character_coverage: float, base: str, reading: _Reading) -> Tuple[Optional[Dict[str, Any]], List[str]]:
  """Measures the vocabulary (and a non-private one) on a text sample: (utility, the not-DP fields)."""
  utility = None
  not_dp = list(NOT_DP_FIELDS)
  if eval_documents:
    sample = _sample_texts(eval_specs or corpus_specs, eval_documents, reading.text_field, reading.errors,
                           reading.data_dir)
    utility = {"sample": {
        "source": "eval_corpus" if eval_specs else "training_corpus",
        "corpus": eval_specs or corpus_specs,
        "documents": len(sample),
        "dp_statistic": bool(eval_specs),
        "note": ("a sample of the private training corpus: these numbers are NOT differentially private"
                 if not eval_specs else "statistics of the evaluation corpus"),
    }, "dp_vocabulary": tokenization_utility(model, sample)}
    if not eval_specs:
      not_dp += ["utility.sample", "utility.dp_vocabulary"]
    if nonprivate_baseline:
      exact_counts = sorted(histogram.items(), key=lambda x: -x[1])
      _, nonprivate = train_capped(scale_counts(exact_counts)[0], vocab_size, model_type, True, character_coverage,
                                   base)
      utility["nonprivate_baseline"] = {**tokenization_utility(nonprivate, sample), "label": NONPRIVATE_LABEL}
      not_dp.append("utility.nonprivate_baseline")
  return utility, not_dp


def _report(params: Dict[str, Any], model: bytes, corpus, corpus_specs: List[str], output: str,
            insecure_seed: Optional[int], bound: ContributionBound, hstats: HistogramStats, release: _Release,
            public_specs: Optional[List[str]], *, sizes: Tuple[int, int, int, Optional[str]], base: str,
            sources, model_type: str, fingerprint_record: Dict[str, Any], utility: Optional[Dict[str, Any]],
            start: float, not_dp: List[str]) -> Dict[str, Any]:
  """Builds the vocabulary's privacy report (and logs its first warning)."""
  actual_size, vocab_size, trained_size, size_warning = sizes
  kept, public_counts, public_stats = release.kept, release.public_counts, release.public_stats
  corpus_files = [f for spec in corpus_specs for f in corpora.corpus_files(spec)]
  report = privacy_report.vocabulary_report(
      params, model_bytes=model, insecure_seed=insecure_seed,
      sensitivity=bound.as_dict(),
      words_total=release.words_total,
      words_kept=len(kept),
      words_dropped_fraction=1.0 - len(kept) / release.words_total,
      documents=hstats.documents,
      histogram=hstats.as_dict(),
      vocab_size=actual_size,
      vocab_size_requested=vocab_size,
      vocab_size_capped=trained_size != vocab_size,
      vocab_size_warning=size_warning,
      byte_fallback=True,
      base_characters=base,
      public_corpus=public_specs,
      public_words=len(public_counts) if public_counts else 0,
      public_documents=public_stats.documents if public_stats else 0,
      pieces_by_source=sources,
      model_type=model_type,
      model=os.path.abspath(output),
      corpus=corpus if isinstance(corpus, str) else list(corpus),
      corpus_files=corpus_files,
      trainer_count_scale=release.count_scale,
      # Path, size and SHA-256 of each local file read: a public declaration of this vocabulary is
      # checked against a run's training files by content (`dp.public_vocabulary`).
      corpus_file_digests=public_vocabulary.file_digests(corpus_files),
      # The private folder of the documents' keyed signatures (where, and each file's SHA-256, never
      # the key): a public declaration of this vocabulary is checked against a run's documents.
      document_fingerprints=fingerprint_record,
      utility=utility,
      seconds=round(time.time() - start, 2),
      # Exact statistics of the private corpus: NOT differentially private. Keep the report with
      # the data owner, or drop these fields before publishing it (the model itself is DP).
      not_dp_fields=not_dp)
  if report["warnings"]:
    logger.warning("dp-spm: %s", report["warnings"][0])
  return report


def _log_outcome(log: Callable[[str], None], sources, utility: Optional[Dict[str, Any]],
                 eval_specs: Optional[List[str]], actual_size: int, output: str, report_path: str, seconds: float,
                 signatures_dir: str) -> None:
  """Logs the pieces by source, the utility numbers and the files written."""
  log(f"dp-spm: pieces by source: {sources}")
  if utility:
    dp_u, label = utility["dp_vocabulary"], utility["sample"]["source"].replace("_", " ")
    if not eval_specs:
      label += ", NOT a DP statistic"
    log(f"dp-spm: utility on {dp_u['documents']} documents ({label}): <unk> rate {dp_u['unk_rate']:.2%}, "
        f"{dp_u['tokens_per_word']:.2f} tokens/word ({actual_size} pieces)")
    base_u = utility.get("nonprivate_baseline")
    if base_u:
      log(f"dp-spm: non-private SentencePiece (comparison only, never released): <unk> rate "
          f"{base_u['unk_rate']:.2%}, {base_u['tokens_per_word']:.2f} tokens/word ({base_u['vocab_size']} pieces)")
  log(f"dp-spm: wrote {output} ({actual_size} pieces) and {report_path} in {seconds} s; apart from "
      f"them, private (never release it): {signatures_dir} (the documents' keyed signatures and their key)")


def _write_fingerprints(fingerprints: doc_fingerprints.FingerprintWriter, output: str, directory: str,
                        documents: int) -> Dict[str, Any]:
  """Writes the documents' keyed signatures and their secret key into the private `directory`;
  returns what the privacy report records of them: the folder (relative to the model's), each
  file's name and SHA-256, how the signatures are made and a check value of the key, never the key."""
  if fingerprints.count != documents:
    fingerprints.close()
    raise DataError(f"dp-spm read {documents} documents but fingerprinted {fingerprints.count}")
  record = fingerprints.write(directory)
  return {"directory": os.path.relpath(directory, os.path.dirname(os.path.abspath(output))), **record,
          "note": ("private to the data owner: never release this folder (with its key, anyone holding a text "
                   "can test whether it was one of the vocabulary's documents); the report holds neither the key "
                   "nor any signature")}
