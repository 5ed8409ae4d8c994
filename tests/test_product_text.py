"""The product speaks of what it does, not of its work history: no issue numbers.

The product is what a user reads or runs: the README, BENCHMARKS.md, every Markdown file
under docs/, the Makefile, setup.py and the source under cognet/, runtime/, export/,
benchmarks/ and tools/. What changed, and why, belongs in CHANGELOG.md and the commit log.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("README.md", "BENCHMARKS.md", "Makefile", "setup.py")
TREES = {
    "docs": ("*.md",),
    **{d: ("*.py", "*.sh") for d in ("cognet", "runtime", "export", "benchmarks", "tools")},
}
# "issue 12", "Issue #12", "issues 13 and 23", "issue-22", "issue22"
ISSUE_NUMBER = re.compile(r"\bissues?[\s#:-]*\d+", flags=re.IGNORECASE)


def product_files() -> list[Path]:
    found = [ROOT / name for name in FILES]
    for tree, patterns in TREES.items():
        for pattern in patterns:
            found += sorted((ROOT / tree).rglob(pattern))
    return [p for p in found if p.is_file()]


def issue_numbers(text: str) -> list[tuple[int, str]]:
    """(line number, match) of every issue number in a text."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in ISSUE_NUMBER.finditer(text)]


def test_the_pattern_finds_the_ways_issues_are_named():
    text = "issue 12\nbefore Issue #22's default\nthe cases of issues 13 and 23\nissue-7"
    assert [m for _, m in issue_numbers(text)] == ["issue 12", "Issue #22", "issues 13", "issue-7"]
    assert issue_numbers("an issue with 12 visits; no issues; tissue 3") == []


def test_the_product_names_no_issue_number():
    hits = [
        f"{path.relative_to(ROOT)}:{line}: {match}"
        for path in product_files()
        for line, match in issue_numbers(path.read_text(errors="replace"))
    ]
    assert not hits, "issue numbers in the product:\n" + "\n".join(hits)
