"""Secret detectors: the policy functions F of selective DP (Shi et al. 2022, Definition 3).

A policy function maps a record to one bit per token: F(r)_i = 1 when token i is public and
0 when it is private. The detectors below find private spans of a text at the four levels of
Shi et al.'s (2022) table, each level containing the ones before it:

* `pattern`: e-mail addresses, URLs, IP addresses, dates, phone numbers and ID / order /
  account / card numbers, found with the regular expressions of this module.
* `entity`: pattern + names of people (and organisations / places when an NER model is
  installed). Without an NER model the *capitalised-name heuristic* is used: a capitalised
  word after a title (Mr., Dr., ...), after "my name is" / "I'm" / "called", or starting
  with a common first name, together with the capitalised words that follow it.
* `low_contextual`: entity + pronouns (a closed word list) + proper nouns. Without a POS
  tagger the *capitalised-word heuristic* marks a capitalised word that does not start a
  sentence as a proper noun.
* `high_contextual`: low_contextual + verbs. Without a POS tagger the *verb-list heuristic*
  marks common verbs and lower-case words ending in -ing / -ed.

Backends: "auto" uses spaCy (`en_core_web_sm`) for entities and POS tags when it is installed,
NLTK's perceptron tagger for POS tags when its data is installed, the heuristics above
otherwise; "heuristic" always uses the heuristics; "spacy" requires spaCy (ConfigError if missing).
`SecretDetector.backends` names the one in use, so that reports say which fallback ran.

Redaction replaces each private span by a typed placeholder (`<PERSON>`, `<PHONE>`,
`<EMAIL>`, `<ID>`, `<DATE>`, `<URL>`, `<IP>`, `<ORG>`, `<LOC>`, `<PRON>`, `<PROPN>`,
`<VERB>`). Placeholders already in a text are never detected again, so redaction is
idempotent: redact(redact(x)) == redact(x).
"""
import dataclasses
import functools
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from private_t5.errors import ConfigError
from private_t5.lazy_imports import lazy_module

# Optional backends, imported on first use by the detectors that try them (absent: heuristics).
spacy = lazy_module("spacy", needed_for="the spaCy detector backend",
                    install="spacy and its en_core_web_sm model")
nltk = lazy_module("nltk", needed_for="the NLTK POS tagger", install="nltk and its perceptron tagger data")

LEVELS = ("pattern", "entity", "low_contextual", "high_contextual")
BACKENDS = ("auto", "heuristic", "spacy")

PLACEHOLDER_RE = re.compile(r"<[A-Z]+>")
# Word-level tokens of the policy function: runs of word characters, and single punctuation.
TOKEN_RE = re.compile(r"\w+|[^\w\s]")

# -- pattern level ------------------------------------------------------------------------------

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
_URL = re.compile(r"\b(?:(?:https?|ftp)://|www\.)[^\s<>\"'`)\]}]+")
_URL_TRAILING = ".,;:!?'\""
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IP = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w.]|\.\d)")
_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
          r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_DAY = r"(?:[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?"
_DATES = [
    # 2023-10-12, 2023-10-12T08:30(:00)
    re.compile(r"(?<![\w-])\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?:[T ]\d{2}:\d{2}(?::\d{2})?)?(?![\w-])"),
    # 10/12/2023, 12/10/23, 12-10-2023, 12.10.2023
    re.compile(r"(?<![\w/.-])\d{1,2}/\d{1,2}/(?:\d{4}|\d{2})(?![\w/])"),
    re.compile(r"(?<![\w.-])\d{1,2}[-.]\d{1,2}[-.]\d{4}(?![\w.-]|\.\d)"),
    # October 12, 2023 / Oct. 12th / 12 October 2023 / 12th of Oct / October 2023
    re.compile(rf"\b{_MONTH}\.?\s+{_DAY}(?:,?\s+\d{{4}})?(?![\w:])"),
    re.compile(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH}\b(?:,?\s+\d{{4}})?(?!\w)"),
    re.compile(rf"\b{_MONTH}\.?,?\s+\d{{4}}(?!\w)"),
]
_PHONES = [
    # North American: (212) 555-0123, 212-555-0123, 212.555.0123, +1 212 555 0123
    re.compile(r"(?<![\w+/.-])(?:\+?1[ .-]?)?(?:\(\d{3}\)\s?|\d{3}[ .-])\d{3}[ .-]\d{4}(?![\w-]|\.\d)"),
    # International: +44 20 7946 0958, +49-30-123456 (8 to 15 digits, checked below)
    re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(?\d{1,5}\)?){1,5}(?![\w-])"),
    # Local seven digits: 555-0123
    re.compile(r"(?<![\w/.-])\d{3}-\d{4}(?![\w-]|\.\d)"),
]
_ID_KEYWORD = re.compile(
    r"\b(?:id|order|account|acct|card|ssn|passport|licen[cs]e|customer|member|employee|invoice|"
    r"ticket|reference|ref|tracking|confirmation|serial|pin|policy|case|booking|reservation|"
    r"student|patient)(?:\s+(?:number|no\.?|num|#|code|id))?\s*(?:is|was|:|#|=)?\s*"
    r"(?P<value>[A-Za-z]{0,4}\d[\w-]*\d|\d)", re.IGNORECASE)
_IDS = [
    re.compile(r"(?<![\w-])\d{3}-\d{2}-\d{4}(?![\w-])"),  # US social security number layout
    re.compile(r"(?<![\w.,/-])(?:\d{4}[ -]){3}\d{1,7}(?![\w-])"),  # grouped card numbers
    re.compile(r"(?<![\w.,/-])\d{6,}(?![\w,/-]|\.\d)"),  # long digit runs (account, order, card)
    re.compile(r"\b[A-Z]{1,3}-?\d{5,}\b"),  # letter-prefixed IDs: AB1234567, X-123456
]

# -- entity level -------------------------------------------------------------------------------

# A capitalised word with at least one lower-case letter: "Lucy", "McDowell", "Kroah-Hartman".
_NAME_WORD = r"[A-Z][A-Za-z'-]*[a-z][A-Za-z'-]*\b"
# Capitalised words on one line, with optional middle initials: "John F. Kennedy".
_NAME_RUN = rf"{_NAME_WORD}(?:[ \t]+(?:[A-Z]\.[ \t]+)?{_NAME_WORD})*"
_TITLE_NAME = re.compile(rf"\b(?:Mr|Mrs|Ms|Mx|Miss|Dr|Prof|Sir|Dame|Lady|Lord|Rev|Capt|Sgt)\.?[ \t]+(?P<value>{_NAME_RUN})")
_INTRO_NAME = re.compile(rf"\b(?:[Mm]y name is|[Nn]ame is|[Nn]ame's|I am|I'm|[Cc]all me)[ \t]+"
                         rf"(?P<value>{_NAME_WORD}(?:[ \t]+{_NAME_WORD})?)")
_CAPITALISED_RUN = re.compile(rf"\b{_NAME_RUN}")
# Common English first names (a public list of frequent given names): a capitalised run that
# starts with one of these is taken as a person's name.
FIRST_NAMES = frozenset("""
aaron adam alan albert alex alexander alice amanda amy andrew angela ann anna anne anthony
arthur ashley barbara ben benjamin betty beth bill billy bob bobby brandon brenda brian bruce
carl carol caroline catherine charles charlie charlotte chris christina christine christopher
cindy claire daniel david deborah debra dennis diana diane donald donna dorothy doug douglas
edward elizabeth emily emma eric frank fred gary george gerald grace greg gregory hannah harold
harry heather helen henry jack jacob james jane janet jason jean jeff jeffrey jennifer jeremy
jerry jessica jessie jim jimmy joan joe john johnny jonathan jose joseph joshua joyce judith judy
julia julie justin karen kate katherine kathleen kathy keith kelly kenneth kevin kimberly larry
laura lauren lawrence linda lisa louis lucy margaret maria marie mark martha martin mary matthew
megan melissa michael michelle mike nancy nathan nicholas nicole olivia pamela patricia patrick
paul peter philip rachel ralph randy raymond rebecca richard robert roger ronald rose roy russell
ruth ryan samantha samuel sandra sara sarah scott sean sharon shirley sophia stephanie stephen
steve steven susan teresa terry thomas timothy tom tony victoria virginia walter wayne william
""".split())

# -- contextual levels --------------------------------------------------------------------------

PRONOUNS = frozenset("""
i me my mine myself you your yours yourself yourselves he him his himself she her hers herself
it its itself we us our ours ourselves they them their theirs themselves what who whom whose
someone somebody anyone anybody everyone everybody nobody
""".split())
_WORD = re.compile(r"\b[A-Za-z][A-Za-z'-]*\b")
# Capitalised words that are not proper nouns when they do not start a sentence.
_NOT_PROPER = frozenset("i a an the this that these those and or but if then else".split())
COMMON_VERBS = frozenset("""
do does did done doing go goes went gone get gets got gotten make makes made know knows knew
known think thinks thought take takes took taken see sees saw seen come comes came want wants
look looks use uses find finds found give gives gave given tell tells told work works call calls
try tries tried ask asks need needs feel feels felt leave leaves left put puts mean means meant
keep keeps kept let lets begin begins began seem seems help helps talk talks turn turns start
starts show shows hear hears heard play plays run runs ran move moves like likes live lives
believe believes bring brings brought happen happens write writes wrote written provide provides
sit sits sat stand stands stood lose loses lost pay pays paid meet meets met include includes
continue set sets learn learns change changes lead leads led understand understands watch
follow follows stop stops create creates speak speaks spoke read reads allow allows add adds
spend spends spent grow grows grew open opens walk walks win wins won offer offers remember
love loves consider appear buy buys bought wait waits serve die dies send sends sent expect
build builds built stay stays fall falls fell cut cuts reach kill remain remains say says said
""".split())
_NOT_VERBS = frozenset("""
thing things nothing something anything everything morning evening during ceiling string strings
king ring wing sing bring spring spring building hundred indeed embed seed need speed feed red bed
shed weed breed greed bleed sled fed wed
""".split())

_LABEL_ORDER = ("EMAIL", "URL", "IP", "DATE", "PHONE", "ID", "PERSON", "ORG", "LOC", "PRON",
                "PROPN", "VERB")


@dataclasses.dataclass(frozen=True)
class Span:
  """A private span of a text: characters [start, end), its placeholder label and level."""
  start: int
  end: int
  label: str
  level: str

  @property
  def placeholder(self) -> str:
    return f"<{self.label}>"


@dataclasses.dataclass
class Detection:
  """The policy function applied to one text.

  Attributes:
    text: the input.
    spans: private spans, sorted, non-overlapping.
    token_offsets: int32[T, 2], character [start, end) of each token (TOKEN_RE).
    private_mask: bool[T], True for a private token (F(r)_i = 0 in Shi et al.'s (2022) notation).
  """
  text: str
  spans: List[Span]
  token_offsets: np.ndarray
  private_mask: np.ndarray

  @property
  def public_mask(self) -> np.ndarray:
    """F(r): 1 for a public token, 0 for a private one (Shi et al. 2022, Definition 3)."""
    return ~self.private_mask

  @property
  def num_tokens(self) -> int:
    return int(len(self.private_mask))

  @property
  def num_private(self) -> int:
    return int(self.private_mask.sum())

  def redacted(self) -> str:
    return redact_spans(self.text, self.spans)

  def fully_private(self) -> bool:
    """True when no word token is public (redaction would leave only placeholders)."""
    words = [i for i, (s, _) in enumerate(self.token_offsets)
             if (self.text[s].isalnum() or self.text[s] == "_") and not _inside_placeholder(self.text, s)]
    return all(self.private_mask[i] for i in words)


def _inside_placeholder(text: str, start: int) -> bool:
  return start > 0 and text[start - 1] == "<" and PLACEHOLDER_RE.match(text, start - 1) is not None


def tokenize(text: str) -> np.ndarray:
  """int32[T, 2]: [start, end) of each word or punctuation token."""
  offsets = [(m.start(), m.end()) for m in TOKEN_RE.finditer(text)]
  return np.asarray(offsets, dtype=np.int32).reshape(-1, 2)


def redact_spans(text: str, spans: Sequence[Span]) -> str:
  """`text` with every span replaced by its placeholder (spans sorted, non-overlapping)."""
  out, last = [], 0
  for span in spans:
    out.append(text[last:span.start])
    out.append(span.placeholder)
    last = span.end
  out.append(text[last:])
  return "".join(out)


def luhn_valid(digits: str) -> bool:
  """The Luhn checksum of payment card numbers (ISO/IEC 7812)."""
  total = 0
  for i, ch in enumerate(reversed(digits)):
    d = int(ch)
    if i % 2 == 1:
      d = d * 2 - 9 if d > 4 else d * 2
    total += d
  return total % 10 == 0


class _Accepted:
  """Non-overlapping character intervals accepted so far (placeholders included)."""

  def __init__(self, blocked: Iterable[Tuple[int, int]]):
    self._taken = np.zeros(0, dtype=bool)
    self.spans: List[Span] = []
    self._blocked = list(blocked)

  def bind(self, length: int) -> None:
    self._taken = np.zeros(length + 1, dtype=bool)
    for s, e in self._blocked:
      self._taken[s:e] = True

  def add(self, start: int, end: int, label: str, level: str) -> bool:
    if end <= start or self._taken[start:end].any():
      return False
    self._taken[start:end] = True
    self.spans.append(Span(start, end, label, level))
    return True


def _sentence_start(text: str, start: int) -> bool:
  """True when the word at `start` begins a sentence, a line item or the text."""
  i = start - 1
  while i >= 0 and text[i] in " \t\"'([*-#>`":
    i -= 1
  return i < 0 or text[i] in ".!?:;\n\r"


@functools.lru_cache(maxsize=None)
def _spacy_pipeline():
  """The spaCy English pipeline when both spaCy and `en_core_web_sm` are installed, else None."""
  try:
    return spacy.load("en_core_web_sm")
  except Exception:  # pylint: disable=broad-except  (not installed, or the model is missing)
    return None


@functools.lru_cache(maxsize=None)
def _nltk_tagger():
  """NLTK's `pos_tag` when NLTK and its perceptron tagger data are installed, else None."""
  try:
    nltk.pos_tag(["a", "test"])
    return nltk.pos_tag
  except Exception:  # pylint: disable=broad-except  (not installed, or the tagger data is missing)
    return None


HEURISTIC_ENTITY = "capitalised-name heuristic (no NER model installed)"
HEURISTIC_POS = "capitalised-word / verb-list heuristic (no POS tagger installed)"


class SecretDetector:
  """The policy function F of one level (see the module docstring)."""

  def __init__(self, level: str = "entity", backend: str = "auto"):
    if level not in LEVELS:
      raise ConfigError(f"detector level must be one of {LEVELS}, got {level!r}")
    if backend not in BACKENDS:
      raise ConfigError(f"detector backend must be one of {BACKENDS}, got {backend!r}")
    self.level = level
    self.rank = LEVELS.index(level)
    self._spacy = _spacy_pipeline() if backend in ("auto", "spacy") and self.rank >= 1 else None
    if backend == "spacy" and self.rank >= 1 and self._spacy is None:
      raise ConfigError("detector backend 'spacy' needs spaCy and its en_core_web_sm model, which are not "
                        "installed; use backend='auto' (falls back to the named heuristics) or install them")
    self._tagger = None
    if backend == "auto" and self.rank >= 2 and self._spacy is None:
      self._tagger = _nltk_tagger()

  @property
  def backends(self) -> Dict[str, str]:
    """What finds each level's secrets: the model in use or the named fallback."""
    out = {"pattern": "regular expressions"}
    if self.rank >= 1:
      out["entity"] = "spaCy en_core_web_sm NER" if self._spacy is not None else HEURISTIC_ENTITY
    if self.rank >= 2:
      if self._spacy is not None:
        out["contextual"] = "spaCy en_core_web_sm POS tags"
      elif self._tagger is not None:
        out["contextual"] = "NLTK perceptron POS tagger"
      else:
        out["contextual"] = HEURISTIC_POS
    return out

  # -- detection ----------------------------------------------------------------------------------

  def detect(self, text: str) -> List[Span]:
    """Private spans of `text`: sorted, non-overlapping, existing placeholders excluded."""
    acc = _Accepted((m.start(), m.end()) for m in PLACEHOLDER_RE.finditer(text))
    acc.bind(len(text))
    _pattern_spans(text, acc)
    doc = self._spacy(text) if self._spacy is not None else None
    if self.rank >= 1:
      self._entity_spans(text, acc, doc)
    if self.rank >= 2:
      self._contextual_spans(text, acc, doc)
    return _merge_adjacent(text, sorted(acc.spans, key=lambda s: s.start))

  def analyze(self, text: str) -> Detection:
    """Spans plus the per-token private mask."""
    spans = self.detect(text)
    offsets = tokenize(text)
    covered = np.zeros(len(text) + 1, dtype=bool)
    for s in spans:
      covered[s.start:s.end] = True
    if len(offsets):
      cum = np.concatenate([[0], np.cumsum(covered)])
      mask = (cum[offsets[:, 1]] - cum[offsets[:, 0]]) > 0
    else:
      mask = np.zeros(0, dtype=bool)
    return Detection(text, spans, offsets, mask)

  def policy(self, text: str) -> np.ndarray:
    """F(r) of Shi et al. 2022: int8[T], 1 for a public token and 0 for a private one."""
    return self.analyze(text).public_mask.astype(np.int8)

  def redact(self, text: str) -> str:
    """`text` with every private span replaced by its typed placeholder (idempotent)."""
    return redact_spans(text, self.detect(text))

  def _entity_spans(self, text: str, acc: _Accepted, doc) -> None:
    if doc is not None:
      labels = {"PERSON": "PERSON", "ORG": "ORG", "GPE": "LOC", "LOC": "LOC", "FAC": "LOC", "NORP": "ORG"}
      for ent in doc.ents:
        if ent.label_ in labels:
          acc.add(ent.start_char, ent.end_char, labels[ent.label_], "entity")
      return
    for rx in (_TITLE_NAME, _INTRO_NAME):
      for m in rx.finditer(text):
        acc.add(m.start("value"), m.end("value"), "PERSON", "entity")
    for m in _CAPITALISED_RUN.finditer(text):
      # The name starts at the first common first name of the run ("Actor Edward G. Robinson").
      for word in re.finditer(r"\S+", m.group(0)):
        if word.group(0).lower() in FIRST_NAMES:
          acc.add(m.start() + word.start(), m.end(), "PERSON", "entity")
          break

  def _contextual_spans(self, text: str, acc: _Accepted, doc) -> None:
    high = self.rank >= 3
    if doc is not None:
      for tok in doc:
        label = {"PRON": "PRON", "PROPN": "PROPN", "VERB": "VERB"}.get(tok.pos_)
        if label and (label != "VERB" or high):
          acc.add(tok.idx, tok.idx + len(tok.text), label, "contextual")
      return
    words = list(_WORD.finditer(text))
    if self._tagger is not None:
      tags = self._tagger([m.group(0) for m in words])
      for m, (_, tag) in zip(words, tags):
        label = ("PRON" if tag in ("PRP", "PRP$", "WP", "WP$") else "PROPN" if tag.startswith("NNP")
                 else "VERB" if tag.startswith("VB") and high else None)
        if label:
          acc.add(m.start(), m.end(), label, "contextual")
      return
    for m in words:
      word = m.group(0)
      lower = word.lower()
      if lower in PRONOUNS and (word.islower() or word.istitle() or word == "I"):
        acc.add(m.start(), m.end(), "PRON", "contextual")
      elif (word[0].isupper() and not word.isupper() and lower not in _NOT_PROPER
            and not _sentence_start(text, m.start())):
        acc.add(m.start(), m.end(), "PROPN", "contextual")
      elif high and word.islower() and (lower in COMMON_VERBS or (
          len(lower) >= 5 and lower.endswith(("ing", "ed")) and lower not in _NOT_VERBS)):
        acc.add(m.start(), m.end(), "VERB", "contextual")


def _pattern_spans(text: str, acc: _Accepted) -> None:
  """Adds the pattern-level spans in priority order (e-mail before URL before ... ID)."""
  if "@" in text:
    for m in _EMAIL.finditer(text):
      acc.add(m.start(), m.end(), "EMAIL", "pattern")
  if "://" in text or "www." in text:
    for m in _URL.finditer(text):
      end = m.end()
      while end > m.start() and text[end - 1] in _URL_TRAILING:
        end -= 1
      acc.add(m.start(), end, "URL", "pattern")
  has_digit = any(c.isdigit() for c in text)
  if not has_digit:
    return
  for m in _IP.finditer(text):
    acc.add(m.start(), m.end(), "IP", "pattern")
  for rx in _DATES:
    for m in rx.finditer(text):
      acc.add(m.start(), m.end(), "DATE", "pattern")
  # Card numbers (Luhn-checked) and SSNs before the keyword rule, which would take their first group.
  for rx in _IDS[:2]:
    for m in rx.finditer(text):
      digits = "".join(c for c in m.group(0) if c.isdigit())
      if rx is _IDS[1] and not (13 <= len(digits) <= 19 and len(set(digits)) > 1 and luhn_valid(digits)):
        continue
      acc.add(m.start(), m.end(), "ID", "pattern")
  # "order number is 716-8829": a keyword names the number an ID, before the phone rules.
  for m in _ID_KEYWORD.finditer(text):
    value = m.group("value")
    if sum(c.isdigit() for c in value) >= 3:
      acc.add(m.start("value"), m.end("value"), "ID", "pattern")
  for rx in _PHONES:
    for m in rx.finditer(text):
      digits = sum(c.isdigit() for c in m.group(0))
      if 7 <= digits <= 15:
        acc.add(m.start(), m.end(), "PHONE", "pattern")
  for rx in _IDS[2:]:
    for m in rx.finditer(text):
      acc.add(m.start(), m.end(), "ID", "pattern")


def _merge_adjacent(text: str, spans: List[Span]) -> List[Span]:
  """Joins spans of the same label separated only by spaces ("New York" -> one <PROPN>)."""
  out: List[Span] = []
  for span in spans:
    if out and out[-1].label == span.label and not text[out[-1].end:span.start].strip(" \t"):
      out[-1] = Span(out[-1].start, span.end, span.label, out[-1].level)
    else:
      out.append(span)
  return out


def make_detector(level: str = "entity", backend: str = "auto") -> SecretDetector:
  """The policy function of `level` (one of LEVELS)."""
  return SecretDetector(level, backend)


def levels_up_to(level: str) -> Tuple[str, ...]:
  """The levels from `pattern` up to and including `level`."""
  if level not in LEVELS:
    raise ConfigError(f"detector level must be one of {LEVELS}, got {level!r}")
  return LEVELS[:LEVELS.index(level) + 1]


def private_fraction(detector: SecretDetector, texts: Iterable[str]) -> Dict[str, float]:
  """Fraction of tokens marked private over `texts` (Shi et al.'s (2022) "Pct" column)."""
  private = total = 0
  for text in texts:
    d = detector.analyze(text)
    private += d.num_private
    total += d.num_tokens
  return {"private_tokens": private, "tokens": total, "pct": private / total if total else 0.0}


def first_secret_missed(detector: SecretDetector, text: str, secrets: Sequence[str]) -> Optional[str]:
  """The first of `secrets` (substrings of `text`) that the detector leaves public, or None."""
  redacted = detector.redact(text)
  for s in secrets:
    if s in redacted:
      return s
  return None
