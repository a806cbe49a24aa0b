"""Code, configs, scripts and docs cite only what the repository holds.

Papers are cited by the short names of docs/references.md, the DP correctness rules by the names
of docs/privacy.md; nothing points at notes or numbered sources outside the repository.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEARCHED = ["private_t5", "docs", "configs", "scripts", "benchmarks", "README.md"]
SUFFIXES = {".py", ".md", ".gin", ".sh", ".txt", ".toml", ".cfg"}
FORBIDDEN = [
    (re.compile(r"\bseed[ _]?0\d\d\b", re.I), "a numbered seed document"),
    (re.compile(r"\bseed paper\b", re.I), "'the seed paper'"),
    (re.compile(r"\bDESIGN(\.md)?\b"), "DESIGN.md"),
    (re.compile(r"\brules? [0-9]\b", re.I), "a numbered rule (cite the rule by its name)"),
    (re.compile(r"\bdesign card\b", re.I), "the design card"),
]
RULES = ("privacy unit is explicit", "sampling matches accounting", "noise on the sum, divide by a public constant",
         "noise keys are secret and never reused", "nothing else leaks", "the ledger survives",
         "every process agrees", "correlated noise is a state")


def _files():
  for name in SEARCHED:
    path = ROOT / name
    if path.is_file():
      yield path
    else:
      yield from (p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES)


def test_no_reference_to_documents_outside_the_repository():
  found = []
  for path in _files():
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
      for pattern, what in FORBIDDEN:
        if pattern.search(line):
          found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()[:100]}")
  assert not found, "\n".join(found)


def test_rules_cited_by_name_are_the_ones_written_out():
  privacy = (ROOT / "docs" / "privacy.md").read_text(encoding="utf-8").lower()
  for rule in RULES:
    assert f"**{rule}.**" in privacy, rule
  cited = set()
  for path in _files():
    for match in re.finditer(r'DP rules? "([^"]+)"(?: and "([^"]+)")?', path.read_text(encoding="utf-8")):
      cited.update(" ".join(m.lower().split()) for m in match.groups() if m)
  assert cited and cited <= set(RULES), sorted(cited - set(RULES))


def test_papers_cited_in_the_code_are_in_the_references():
  references = (ROOT / "docs" / "references.md").read_text(encoding="utf-8")
  listed = set(re.findall(r"^\| ([^|]+? (?:et al\.|& \w+)? ?\d{4}) \|", references, re.M))
  cited = set()
  for path in _files():
    text = path.read_text(encoding="utf-8")
    cited.update(f"{a} et al. {y}" for a, y in re.findall(r"\b([A-Z][a-z]+(?:-[A-Z][a-z]+)?) et al\.,? \(?(\d{4})\b", text))
  missing = sorted(c for c in cited if c not in listed)
  assert not missing, missing
