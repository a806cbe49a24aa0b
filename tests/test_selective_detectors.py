"""Secret detectors and `private-t5 redact` on real text from ../shared/data."""
import json
import os

import numpy as np
import pytest

from private_t5.stages import cli
from private_t5.data import corpora
from private_t5.errors import ConfigError
from private_t5.selective import detectors, redaction
from conftest import shared_or_fixture


@pytest.fixture(scope="module")
def fortunes(shared_data):
  path = os.path.join(shared_data, "pretrain", "fortunes.jsonl.gz")
  return [d.text for d in corpora.iter_documents(path, max_documents=400)]


@pytest.fixture(scope="module")
def linux_docs(shared_data):
  path = shared_or_fixture("pretrain/linux_docs.jsonl.gz")
  return [d.text for d in corpora.iter_documents(path, max_documents=25)]


def _random_secret(rng, kind):
  digits = lambda n: "".join(str(d) for d in rng.integers(0, 10, n))
  if kind == "PHONE":
    area = str(rng.integers(201, 990))
    style = rng.integers(4)
    if style == 0:
      return f"({area}) {digits(3)}-{digits(4)}"
    if style == 1:
      return f"{area}-{digits(3)}-{digits(4)}"
    if style == 2:
      return f"+1 {area} {digits(3)} {digits(4)}"
    return f"+44 20 {digits(4)} {digits(4)}"
  if kind == "EMAIL":
    user = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6))
    return f"{user}.{digits(2)}@{rng.choice(['example.com', 'mail.example.org', 'corp.co.uk'])}"
  if kind == "ID":
    style = rng.integers(3)
    if style == 0:
      return digits(6 + int(rng.integers(5)))
    if style == 1:
      return f"{digits(3)}-{digits(2)}-{digits(4)}"
    return "AB" + digits(7)
  raise ValueError(kind)


def _clean(detector, texts):
  """Real documents in which the detector finds nothing."""
  return [t for t in texts if not detector.detect(t)]


def test_planted_secrets_found_with_high_recall_and_nothing_else_changes(fortunes):
  detector = detectors.SecretDetector("pattern")
  clean = _clean(detector, fortunes)[:150]
  assert len(clean) >= 100
  rng = np.random.default_rng(0)
  found = total = 0
  for i, text in enumerate(clean):
    kind = ("PHONE", "EMAIL", "ID")[i % 3]
    secret = _random_secret(rng, kind)
    cue = {"PHONE": "Call me at", "EMAIL": "Write to", "ID": "My account number is"}[kind]
    words = text.split(" ")
    cut = int(rng.integers(len(words) + 1))
    planted = " ".join(words[:cut] + [f"{cue} {secret} ."] + words[cut:])
    redacted = detector.redact(planted)
    total += 1
    expected = planted.replace(secret, f"<{kind}>")
    found += redacted == expected
  recall = found / total
  assert recall >= 0.97, f"recall {recall:.3f} of planted secrets (exact typed placeholder)"


def test_text_without_secrets_is_unchanged(fortunes, linux_docs):
  # Real prose without digits, '@' or URLs has nothing for the pattern level to find.
  detector = detectors.SecretDetector("pattern")
  plain = [t for t in fortunes + linux_docs
           if not any(c.isdigit() for c in t) and "@" not in t and "://" not in t and "www." not in t]
  assert len(plain) > 100
  changed = [t for t in plain if detector.redact(t) != t]
  assert not changed, changed[:3]
  # Numbers that are not secrets stay: versions, counts, years, hex.
  prose = "Linux 2.6.32 has 1,000 users since 1991; see section 4.2 at 0xffff0000 and 65536 pages."
  assert detector.redact(prose) == prose


@pytest.mark.parametrize("level", detectors.LEVELS)
def test_redaction_is_idempotent_on_real_text(level, fortunes, linux_docs):
  detector = detectors.SecretDetector(level, backend="heuristic")
  for text in fortunes[:150] + linux_docs[:10]:
    once = detector.redact(text)
    assert detector.redact(once) == once


def test_levels_are_nested_and_typed():
  text = ("Hello my name is Jessie and I am with customer support. My name is Lucy, and order number "
          "is 716-8829. My phone is 123-456-7890, mail lucy@example.com, see https://example.com/a. "
          "Did you hear Alice is getting divorced? Dr. Smith met her on October 12, 2023.")
  out = {lvl: detectors.SecretDetector(lvl, backend="heuristic").redact(text) for lvl in detectors.LEVELS}
  assert "<ID>" in out["pattern"] and "716-8829" not in out["pattern"]
  for token in ("<PHONE>", "<EMAIL>", "<URL>", "<DATE>"):
    assert token in out["pattern"]
  assert "Lucy" in out["pattern"] and "Lucy" not in out["entity"]
  assert out["entity"].count("<PERSON>") >= 4  # Jessie, Lucy, Alice, Smith
  assert "you" in out["entity"] and "Did <PRON> hear <PERSON>" in out["low_contextual"]
  assert "<VERB>" in out["high_contextual"] and "<VERB>" not in out["low_contextual"]
  fractions = [detectors.SecretDetector(lvl, backend="heuristic").analyze(text).num_private
               for lvl in detectors.LEVELS]
  assert fractions == sorted(fractions) and fractions[0] < fractions[-1]


def test_policy_function_masks_tokens_of_spans():
  detector = detectors.SecretDetector("pattern")
  text = "Ring 555-0123 or 555-0199 today"
  d = detector.analyze(text)
  tokens = [text[s:e] for s, e in d.token_offsets]
  assert tokens == ["Ring", "555", "-", "0123", "or", "555", "-", "0199", "today"]
  np.testing.assert_array_equal(detector.policy(text), [1, 0, 0, 0, 1, 0, 0, 0, 1])
  assert d.redacted() == "Ring <PHONE> or <PHONE> today"


def test_card_numbers_need_a_valid_checksum():
  detector = detectors.SecretDetector("pattern")
  assert detectors.luhn_valid("4111111111111111") and not detectors.luhn_valid("4111111111111112")
  assert detector.redact("card 4111 1111 1111 1111 ok") == "card <ID> ok"
  assert "<ID>" not in detector.redact("groups 1234 5678 9012 3457 ok")


def test_entity_level_names_its_fallback():
  detector = detectors.SecretDetector("high_contextual")
  backends = detector.backends
  assert backends["pattern"] == "regular expressions"
  if detectors._spacy_pipeline() is None:  # pylint: disable=protected-access
    assert backends["entity"] == detectors.HEURISTIC_ENTITY
    with pytest.raises(ConfigError, match="needs spaCy"):
      detectors.SecretDetector("entity", backend="spacy")


def test_bad_level_is_a_config_error():
  with pytest.raises(ConfigError, match="detector level"):
    detectors.SecretDetector("sentence")


def _write_jsonl(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def test_redact_cli_writes_corpus_and_report(tmp_path, fortunes, capsys):
  corpus = tmp_path / "in.jsonl"
  records = [{"id": f"f{i}", "text": t} for i, t in enumerate(fortunes[:60])]
  records.append({"id": "secret-only", "text": "lucy@example.com 555-0123"})
  records.append({"id": "with-phone", "text": "Call Lucy at (212) 555-0123 tomorrow."})
  _write_jsonl(corpus, records)
  output = tmp_path / "out" / "redacted.jsonl.gz"
  rc = cli.main(["redact", f"--corpus={corpus}", f"--output={output}", "--level=entity",
                 "--report_levels=all", "--backend=heuristic"])
  assert rc == 0
  assert "fully redacted" in capsys.readouterr().out
  report = json.load(open(tmp_path / "out" / "redacted.report.json"))
  assert report["documents_read"] == 62 and report["documents_written"] == 61
  assert report["fully_redacted_skipped"] == 1 and report["fully_redacted_ids"] == ["secret-only"]
  assert set(report["levels"]) == set(detectors.LEVELS)
  pcts = [report["levels"][lvl]["pct"] for lvl in detectors.LEVELS]
  assert pcts == sorted(pcts) and 0 < pcts[0] < pcts[-1] < 1
  assert detectors.HEURISTIC_ENTITY in report["fallbacks"]
  assert set(os.listdir(tmp_path / "out")) == {"redacted.jsonl.gz", "redacted.report.json"}  # no temp files
  out = redaction.read_redacted(str(output))
  by_id = {r["id"]: r["text"] for r in out}
  assert by_id["with-phone"] == "Call <PERSON> at <PHONE> tomorrow."
  # Redacting D' again changes nothing (corpus-level idempotence).
  again = tmp_path / "again.jsonl"
  cli.main(["redact", f"--corpus={output}", f"--output={again}", "--level=entity", "--backend=heuristic"])
  assert {r["id"]: r["text"] for r in redaction.read_redacted(str(again))} == by_id


def test_redact_cli_errors(tmp_path, capsys):
  corpus = tmp_path / "in.jsonl"
  _write_jsonl(corpus, [{"id": "a", "text": "bob@example.com"}])
  assert cli.main(["redact", f"--corpus={corpus}", f"--output={tmp_path / 'o.txt'}"]) == 2
  assert "--output must end in" in capsys.readouterr().err
  assert cli.main(["redact", f"--corpus={corpus}", f"--output={tmp_path / 'o.jsonl'}",
                   "--report_levels=pattern,nouns"]) == 2
  assert "unknown level 'nouns'" in capsys.readouterr().err
  assert cli.main(["redact", f"--corpus={corpus}", f"--output={tmp_path / 'o.jsonl'}"]) == 2
  assert "fully redacted" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "o.jsonl")
