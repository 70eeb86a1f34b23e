"""The README's numbers come from the reports: a table copied from a report must still be in it, row for row, and
every speedup or parameter count quoted in the prose must appear in some report. Regenerating a report without
updating the README fails here."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
TABLE = re.compile(r"<!-- table from (?P<path>\S+) -->\n(?P<rows>.*?)\n<!-- end table -->", re.S)
FENCE = re.compile(r"```.*?```", re.S)
# A quoted result: a speedup (`2.07×`), a range end (`0.64×–0.97×` is two) or a parameter count (`8.42M`).
QUOTED = re.compile(r"(?<![\w.])(\d+\.\d+)(×|M\b)")


LINK = re.compile(r"\]\((reports/[^)#\s]+)")


def report_files(paragraph: str) -> list[Path]:
    """The reports a paragraph links to (a folder means its README), else every report."""
    linked = [REPO / link for link in LINK.findall(paragraph)]
    linked = [path / "README.md" if path.is_dir() else path for path in linked]
    return linked or sorted((REPO / "reports").rglob("*.md")) + sorted((REPO / "reports").rglob("*.json"))


def test_copied_tables_are_the_reports_own_rows():
    tables = list(TABLE.finditer(README))
    assert len(tables) >= 2, "the README quotes the SmolLM2 and bundled tables from their reports"
    for table in tables:
        report = (REPO / table["path"]).read_text(encoding="utf-8").splitlines()
        stale = [row for row in table["rows"].splitlines() if row not in report]
        assert not stale, f"README rows not in {table['path']} (regenerate the README table):\n" + "\n".join(stale)


def test_quoted_numbers_appear_in_the_reports_their_paragraph_links():
    prose = FENCE.sub("", TABLE.sub("", README))
    missing, quoted = [], 0
    for paragraph in prose.split("\n\n"):
        numbers = {match.group(0) for match in QUOTED.finditer(paragraph)}
        if not numbers:
            continue
        quoted += len(numbers)
        files = report_files(paragraph)
        text = "\n".join(path.read_text(encoding="utf-8") for path in files)
        missing += [
            f"{number} (not in {', '.join(str(f.relative_to(REPO)) for f in files[:3])})"
            for number in sorted(numbers)
            if number not in text
        ]
    assert quoted, "the README quotes results"
    assert not missing, "README numbers that their reports do not contain:\n" + "\n".join(missing)
