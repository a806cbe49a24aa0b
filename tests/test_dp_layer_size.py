"""docs/dp_training.md states the size of the privacy layer (to within 5%); keep it true."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def dp_layer_lines() -> int:
  files = sorted((ROOT / "private_t5" / "dp").glob("*.py"))
  return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)


def test_docs_state_the_privacy_layer_line_count():
  doc = (ROOT / "docs" / "dp_training.md").read_text(encoding="utf-8")
  match = re.search(r"The privacy layer is about ([\d,]+) lines", doc)
  assert match, "docs/dp_training.md must say 'The privacy layer is about N lines'"
  stated = int(match.group(1).replace(",", ""))
  # "about": within 5% (to the nearest hundred lines), so that small edits need no doc change.
  assert abs(stated - dp_layer_lines()) <= 0.05 * dp_layer_lines(), (
      f"docs/dp_training.md says {stated} lines, private_t5/dp/*.py has"
      f" {dp_layer_lines()}: update the sentence")
