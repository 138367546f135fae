"""The README and docs/ hold what the code says: generated blocks are current, every `Note [...]` named
exists, every relative link and anchor resolves, and the README's test command is CI's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.docs.generated import (
    DOCS,
    NOTE_SOURCES,
    NOTES_BLOCK,
    OPTIONS_BLOCK,
    ROOT,
    note_definitions,
    note_references,
    notes_index,
    options_table,
)

README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Every Markdown file a reader reaches from the README.
LINKED_FILES = [*PAGES, ROOT / "examples" / "README.md", ROOT / "benchmarks" / "README.md"]
LINKED_FILES.append(ROOT / "benchmarks" / "results" / "NOTES.md")
MAX_README_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def test_the_readme_is_a_front_door_of_at_most_200_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    text = README.read_text()
    assert [page.name for page in DOCS.glob("*.md") if f"(docs/{page.name}" not in text] == []


def test_the_readme_runs_the_tests_as_ci_does() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    (ci_command,) = re.findall(r"^TEST_CMD=\((.*)\)$", ci, re.M)
    for page in (README, DOCS / "contributing.md"):
        commands = [
            shlex.split(line.split("&&")[-1]) for line in page.read_text().splitlines() if "-m pytest" in line
        ]
        assert shlex.split(ci_command) in commands, f"{page.name}: keep its test command .ci/run's"


def test_generated_blocks_are_current() -> None:
    fix = "run: python -m tests.docs.generated"
    assert NOTES_BLOCK.current() == notes_index(), fix
    assert OPTIONS_BLOCK.current() == options_table(), fix


def test_every_note_referenced_exists() -> None:
    defined = set(note_definitions())
    texts = {path: path.read_text() for source in NOTE_SOURCES for path in source.rglob("*.py")}
    texts |= {path: path.read_text() for path in LINKED_FILES}
    missing = {
        f"{path.relative_to(ROOT)}: Note [{name}]"
        for path, text in texts.items()
        for name in note_references(text)
        if name not in defined and name != "..."
    }
    assert missing == set()


def test_notes_named_with_their_file_in_the_docs_name_the_right_file() -> None:
    defined = note_definitions()
    wrong = []
    for path in LINKED_FILES:
        text = re.sub(r"\s*\n\s*", " ", path.read_text())
        for name, file in re.findall(r"Note \[([^\]]+)\] in `([^`]+)`", text):
            if name in defined and not str(defined[name]).endswith(file):
                wrong.append(f"{path.name}: Note [{name}] is in {defined[name]}, not {file}")
    assert wrong == []


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", LINKED_FILES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_and_their_anchors_resolve(page: Path) -> None:
    broken = []
    for match in LINK.finditer(FENCE.sub("", page.read_text())):
        target = match["target"]
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        missing_anchor = anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)
        if not resolved.exists() or missing_anchor:
            broken.append(target)
    assert broken == []
