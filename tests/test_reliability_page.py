"""docs/reliability.md names, for every claim, the test that checks it.

Every bullet and table row of the page must cite at least one test
(``tests/<file>.py::<test>``) or bad-input row (``row `<id>```), and every citation must
exist: a renamed or deleted test breaks this test, not silently the page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reliability.md"
TEST_REFERENCE = re.compile(r"tests/(?P<file>test_\w+\.py)::(?P<name>test_\w+)")
ROW_REFERENCE = re.compile(r"rows? ((?:`[\w*-]+`(?:, | and |,? )?)+)")
ROW_NAME = re.compile(r"`([\w*-]+)`")


def claims(text: str) -> list[str]:
    """The page's bullets (with their continuation lines) and table body rows (a row
    followed by the ``|---|`` separator is a header, not a claim)."""
    lines = text.splitlines()
    found: list[str] = []
    in_bullet = False
    for index, line in enumerate(lines):
        if line.startswith("- "):
            found.append(line.strip())
            in_bullet = True
        elif in_bullet and line.startswith("  ") and line.strip():
            found[-1] += " " + line.strip()
        else:
            in_bullet = False
            following = lines[index + 1] if index + 1 < len(lines) else ""
            is_row = line.startswith("|") and not set(line) <= set("|-: ")
            if is_row and not following.startswith("|---"):
                found.append(line)
    return found


def bad_input_ids() -> set[str]:
    source = (ROOT / "tests" / "test_bad_inputs.py").read_text()
    return set(re.findall(r'BadInput\(\s*"([\w-]+)"', source))


def test_every_claim_cites_a_test() -> None:
    uncited = [
        claim for claim in claims(PAGE.read_text())
        if not TEST_REFERENCE.search(claim) and not ROW_REFERENCE.search(claim)
    ]
    assert uncited == []


@pytest.mark.parametrize("reference", sorted({m.group(0) for m in TEST_REFERENCE.finditer(PAGE.read_text())}))
def test_every_cited_test_exists(reference: str) -> None:
    match = TEST_REFERENCE.fullmatch(reference)
    assert match is not None
    source = (ROOT / "tests" / match["file"]).read_text()
    assert re.search(rf"^def {match['name']}\(", source, re.MULTILINE), f"{reference} is not a test"


def test_every_cited_bad_input_row_exists() -> None:
    ids = bad_input_ids()
    assert len(ids) > 50  # the pattern really reads the table
    cited = {
        name
        for match in ROW_REFERENCE.finditer(PAGE.read_text())
        for name in ROW_NAME.findall(match.group(1))
    }
    assert cited
    for name in cited:
        if name.endswith("*"):
            assert any(row.startswith(name[:-1]) for row in ids), name
        else:
            assert name in ids, name


def test_the_claim_reader_sees_bullets_rows_and_citations() -> None:
    text = "intro\n- a claim\n  that goes on. Test: `tests/test_x.py::test_y`.\n- bare\n\n| a | b |\n|---|---|\n| c | d |\n"
    assert claims(text) == ["- a claim that goes on. Test: `tests/test_x.py::test_y`.", "- bare", "| c | d |"]


def test_the_attack_count_is_the_number_of_attack_rows() -> None:
    # Prepare: section 8's tables, each headed "| attack | behaviour now | test |".
    text = PAGE.read_text()
    section = text[text.index("## 8. Attacks tried"):]
    stated = re.search(r"\*\*(\d+) attacks tried\*\*", section)
    # Execute: count the body rows of every attack table.
    rows, in_table = 0, False
    for line in section.splitlines():
        if line.startswith("| attack |"):
            in_table = True
        elif in_table and line.startswith("|") and not line.startswith("|---"):
            rows += 1
        elif not line.startswith("|"):
            in_table = False
    # Assert
    assert stated is not None and rows > 50
    assert int(stated.group(1)) == rows
