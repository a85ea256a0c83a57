"""docs/troubleshooting.md has one row for every reason preshard reports, and no other.

A reason added to `preshard.contract.reasons` without a row on that page fails here, and so
does a row for a reason that was removed or renamed; the exit-code table must match
`outcome.EXIT_CODES`.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Final

from preshard.contract import reasons
from preshard.contract.outcome import EXIT_CODES

ROOT: Final = Path(__file__).resolve().parents[2]
PAGE: Final = ROOT / "docs" / "troubleshooting.md"
REASON_CELL: Final = re.compile(r"^`([A-Za-z0-9]+)`")

Table = tuple[list[str], list[list[str]]]


def reason_constants() -> dict[str, str]:
    """Every reason constant of `preshard.contract.reasons`, by its name."""
    return {
        name: value
        for name, value in vars(reasons).items()
        if name.isupper() and isinstance(value, str)
    }


def cells(line: str) -> list[str]:
    """The cells of one Markdown table row."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(text: str) -> list[Table]:
    """Every Markdown table of a page: its header and its rows."""
    found: list[Table] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines) - 1:
        header, separator = lines[index], lines[index + 1]
        if header.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", separator.strip()):
            rows: list[list[str]] = []
            index += 2
            while index < len(lines) and lines[index].startswith("|"):
                rows.append(cells(lines[index]))
                index += 1
            found.append((cells(header), rows))
        else:
            index += 1
    return found


def named(header: str) -> list[Table]:
    """The page's tables whose first column is `header`."""
    return [t for t in tables(PAGE.read_text()) if t[0][0].lower() == header]


def reason_rows() -> list[str]:
    """The reason each row of the page's reason tables is about."""
    found: list[str] = []
    for _, rows in named("reason"):
        for row in rows:
            match = REASON_CELL.fullmatch(row[0])
            assert match is not None, f"a reason row starts with one `Reason`: {row}"
            found.append(match.group(1))
    return found


def test_every_reason_has_a_row() -> None:
    documented = set(reason_rows())
    missing = sorted(
        f"{name} ({value})" for name, value in reason_constants().items() if value not in documented
    )

    assert missing == [], f"reasons without a row in {PAGE.name}: {', '.join(missing)}"


def test_every_row_names_a_reason_that_exists() -> None:
    known = set(reason_constants().values())
    unknown = sorted(set(reason_rows()) - known)

    assert unknown == [], f"rows in {PAGE.name} for reasons preshard no longer has: {unknown}"


def test_each_reason_has_one_row_and_every_row_is_filled_in() -> None:
    repeated = sorted(r for r, count in Counter(reason_rows()).items() if count > 1)
    reason_tables = named("reason")

    assert repeated == []
    assert len(reason_tables) >= 5
    for header, rows in reason_tables:
        assert header == ["reason", "where", "meaning and what to check", "what preshard does next"]
        for row in rows:
            assert len(row) == len(header), f"a row with another number of cells: {row}"
            assert all(row), f"a row with an empty cell: {row}"


def test_the_exit_code_table_is_the_data_planes() -> None:
    (table,) = named("exit code")
    documented: dict[str, int] = {}
    for row in table[1]:
        match = REASON_CELL.match(row[1])
        assert match is not None, row
        assert match.group(1) not in documented, row
        documented[match.group(1)] = int(row[0])

    assert documented == EXIT_CODES


def test_the_page_is_linked_from_the_readme_and_the_architecture() -> None:
    assert "(docs/troubleshooting.md)" in (ROOT / "README.md").read_text()
    assert "(troubleshooting.md)" in (ROOT / "docs" / "architecture.md").read_text()
