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


# -- cited sections exist ----------------------------------------------------------------
# A citation names a page and a section of it: `README "Set decoding"`, `README's "Python
# API"`, `README §Results`, `user guide "Training recipe"`, `docs/DESIGN.md "Beam search"`,
# `BENCHMARKS.md, "Method"`. ("DESIGN.md §N" citations are checked by tools/check_layout.py.)
CITATION = re.compile(
    r"(?P<page>[\w./-]*\b[\w-]+\.md|\bREADME|\buser guide)(?:'s)?,?[ \t]+"
    r"(?:\"(?P<quoted>[^\"\n]+)\"|§(?P<section>[A-Za-z]{2}[^,;:.)\"`\n]*))"
)
GUIDE = ROOT / "docs" / "guide"
FENCE = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)


def headings(page: Path) -> set[str]:
    """Every heading of a Markdown page (outside fenced blocks), as written and without its
    "N. " number, its closing "(...)" or what follows its colon."""
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip()
            found |= {text, re.sub(r"^\d+\.\s+", "", text), re.sub(r"\s+\(.*\)$", "", text)}
            found.add(text.split(":")[0])
    return found


def cited_pages(page: str, citing: Path) -> list[Path]:
    """The pages a citation can mean: README.md for README, any page of the guide for "user
    guide", else the file named (from the root, beside the citing file, docs/ or the guide)."""
    if page in ("README", "README.md"):
        return [ROOT / "README.md"]
    if page == "user guide":
        return sorted(GUIDE.glob("*.md"))
    for base in (ROOT, citing.parent, ROOT / "docs", GUIDE):
        if (base / page).is_file():
            return [base / page]
    return []


def citations(text: str) -> list[tuple[int, str, str]]:
    """(line number, page, section) of every section citation in a text."""
    out = []
    for m in CITATION.finditer(text):
        section = (m.group("quoted") or m.group("section")).lstrip("#").strip()
        out.append((text.count("\n", 0, m.start()) + 1, m.group("page"), section))
    return out


def citing_files() -> list[Path]:
    """The product files and the tests; the record of past benchmark runs is left as it was."""
    history = ROOT / "docs" / "benchmarks" / "history"
    found = product_files() + sorted((ROOT / "tests").glob("*.py"))
    here = Path(__file__).resolve()  # its examples above are not citations
    return [p for p in found if history not in p.parents and p.resolve() != here]


def test_the_citation_pattern_reads_the_ways_sections_are_cited():
    text = (
        'see README "Set decoding": cost\n(README\'s "## Python API" section)\n'
        'README §Results and more; (BENCHMARKS.md, "Method") and docs/DESIGN.md "Beam search"\n'
        'user guide "Training recipe"; DESIGN.md §2, DESIGN.md §N; open("README.md", "w")'
    )
    assert [(page, section) for _, page, section in citations(text)] == [
        ("README", "Set decoding"),
        ("README", "Python API"),
        ("README", "Results and more"),
        ("BENCHMARKS.md", "Method"),
        ("docs/DESIGN.md", "Beam search"),
        ("user guide", "Training recipe"),
    ]


def test_every_cited_section_exists():
    """A README, guide, BENCHMARKS.md or docs/ section that code, a test, a document or a
    `--help` text cites is a heading of the page it names."""
    missing = []
    for path in citing_files():
        for line, page, section in citations(path.read_text(errors="replace")):
            pages = cited_pages(page, path)
            if not any(section in headings(p) for p in pages):
                where = "no such page" if not pages else "no such heading"
                missing.append(f'{path.relative_to(ROOT)}:{line}: {page} "{section}": {where}')
    assert not missing, "cited sections that do not exist:\n" + "\n".join(missing)


# -- the README stays readable -----------------------------------------------------------
MAX_PARAGRAPH_WORDS = 150


def test_no_readme_paragraph_is_a_wall():
    """No paragraph of the README (its prose: code blocks and tables left out) passes 150
    words; a longer one belongs in the user guide or a table."""
    prose = FENCE.sub("", (ROOT / "README.md").read_text())
    long = []
    for block in re.split(r"\n\s*\n", prose):
        words = " ".join(x for x in block.splitlines() if not x.lstrip().startswith("|")).split()
        if len(words) > MAX_PARAGRAPH_WORDS:
            long.append(f"{len(words)} words: {' '.join(words[:12])} ...")
    assert not long, "README paragraphs over 150 words:\n" + "\n".join(long)
