"""docs/events.md read as data: its sections, their tables and code blocks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EVENTS_DOC = REPO / "docs" / "events.md"


@dataclass(frozen=True)
class Section:
    heading: str  # the heading's text, without its #s
    level: int
    body: str  # up to the next heading of any level

    def tables(self) -> list[list[list[str]]]:
        """Each table's rows (the header and the separator left out), cells stripped."""
        tables: list[list[list[str]]] = []
        lines: list[str] = []
        for line in [*self.body.splitlines(), ""]:
            if line.startswith("|"):
                lines.append(line)
                continue
            if len(lines) > 2:
                tables.append([_cells(row) for row in lines[2:]])
            lines = []
        return tables

    def table(self) -> list[list[str]]:
        """The rows of the section's one table."""
        (table,) = self.tables()
        return table

    def code(self, language: str) -> list[str]:
        """The section's fenced code blocks in `language`, in order."""
        return re.findall(rf"^```{language}\n(.*?)^```", self.body, flags=re.S | re.M)


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def sections(path: Path = EVENTS_DOC) -> list[Section]:
    found: list[Section] = []
    text = path.read_text()
    headings = list(re.finditer(r"^(#+) (.+)$", text, flags=re.M))
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        end = following.start() if following is not None else len(text)
        found.append(Section(heading.group(2), len(heading.group(1)), text[heading.end() : end]))
    return found


def section(heading: str, path: Path = EVENTS_DOC) -> Section:
    (found,) = [s for s in sections(path) if s.heading == heading]
    return found


def quoted(cell: str) -> list[str]:
    """The `code spans` of a cell, in order."""
    return re.findall(r"`([^`]+)`", cell)


def example_subscriber() -> str:
    """The runnable subscriber of "A subscriber"."""
    (code,) = section("A subscriber").code("python")
    return code


def example_replay() -> str:
    """The runnable stream reader of "The events stream: replay"."""
    (code,) = section("The events stream: replay").code("python")
    return code
