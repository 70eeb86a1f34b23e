"""The README's numbers come from the reports: a table copied from a report must still be in it, row for row, and
every speedup or parameter count quoted in the prose must appear in some report. A speedup quoted in prose
summarises a table, so it must be a figure of a table (of the README or of a report its paragraph links to, else of
any report), and both ends of a quoted range must be figures of one table. Regenerating a report without updating
the README fails here."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
TABLE = re.compile(r"<!-- table from (?P<path>\S+) -->\n(?P<rows>.*?)\n<!-- end table -->", re.S)
FENCE = re.compile(r"```.*?```", re.S)
# A quoted result: a speedup (`2.07×`), a range end (`0.64×–0.97×` is two) or a parameter count (`8.42M`).
QUOTED = re.compile(r"(?<![\w.])(\d+\.\d+)(×|M\b)")
SPEEDUP = re.compile(r"(?<![\w.])(\d+\.\d+)×")
# A quoted range of speedups: `0.64×–0.97×` or `1.01–1.36×`.
RANGE = re.compile(r"(?<![\w.])(\d+\.\d+)×?–(\d+\.\d+)×")


LINK = re.compile(r"\]\((reports/[^)#\s]+)")


def report_files(paragraph: str) -> list[Path]:
    """The reports a paragraph links to (a folder means its README), else every report."""
    linked = [REPO / link for link in LINK.findall(paragraph)]
    linked = [path / "README.md" if path.is_dir() else path for path in linked]
    return linked or sorted((REPO / "reports").rglob("*.md")) + sorted((REPO / "reports").rglob("*.json"))


def tables(text: str) -> list[str]:
    """The markdown tables of ``text``: each a block of consecutive lines that start with ``|``."""
    blocks, current = [], []
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("|"):
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    return blocks


def has_figure(table: str, number: str) -> bool:
    """Whether ``number`` (``"1.13"``) is a figure of ``table`` (``1.13×``, ``1.13× ±1%`` or a bare ``1.13``)."""
    return re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", table) is not None


def prose_paragraphs() -> list[str]:
    """The README's paragraphs outside copied tables and code blocks."""
    return FENCE.sub("", TABLE.sub("", README)).split("\n\n")


def test_copied_tables_are_the_reports_own_rows():
    tables = list(TABLE.finditer(README))
    assert len(tables) >= 2, "the README quotes the SmolLM2 and bundled tables from their reports"
    for table in tables:
        report = (REPO / table["path"]).read_text(encoding="utf-8").splitlines()
        stale = [row for row in table["rows"].splitlines() if row not in report]
        assert not stale, f"README rows not in {table['path']} (regenerate the README table):\n" + "\n".join(stale)


def test_quoted_numbers_appear_in_the_reports_their_paragraph_links():
    missing, quoted = [], 0
    for paragraph in prose_paragraphs():
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


def test_speedups_quoted_in_prose_are_figures_of_a_table():
    """A speedup in prose is a table's figure, and a range's two ends are figures of one table: a paragraph cannot
    quote a number from a report's prose, or mix two tables (two runs) into one range, without this failing."""
    readme_tables = tables(README)
    problems, ranges = [], 0
    for paragraph in prose_paragraphs():
        if not SPEEDUP.search(paragraph):
            continue
        files = [path for path in report_files(paragraph) if path.suffix == ".md"]
        candidates = readme_tables + [table for path in files for table in tables(path.read_text(encoding="utf-8"))]
        where = "the README's tables or " + ", ".join(str(f.relative_to(REPO)) for f in files[:3])
        for number in sorted(set(SPEEDUP.findall(paragraph))):
            if not any(has_figure(table, number) for table in candidates):
                problems.append(f"{number}× is no figure of {where}")
        for low, high in RANGE.findall(paragraph):
            ranges += 1
            if not any(has_figure(table, low) and has_figure(table, high) for table in candidates):
                problems.append(f"{low}–{high}×: no table of {where} has both ends")
    assert ranges, "the README quotes ranges"
    assert not problems, "README prose figures that no table holds:\n" + "\n".join(problems)
