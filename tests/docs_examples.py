"""The examples of README.md and docs/: found, run, and their shown output compared.

A page is read as markdown. Its fenced blocks are examples:

- ```python   run in order, one Python session per page (a block may use what an earlier one made);
- ```pycon    doctest: `>>> ` lines run in the page's session, their output checked (ELLIPSIS, whitespace
              normalized; a blank line inside an output is part of it, no <BLANKLINE> needed);
- ```console  `$ command` lines run in a shell, the lines after each command (up to the next `$ `) its
              expected output; `...` on a line of its own stands for any number of lines, and within a line
              for any text;
- ```toml     with a first line `# file: NAME.toml`, written to NAME.toml in the page's folder first.

An HTML comment `<!-- example: skip (why) -->` on the line before a fence shows it without running it
(the reason is required: each is a promise the text keeps by other means, e.g. CI itself).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"<!--\s*example:\s*skip\s*\((.+?)\)\s*-->\s*$")
RUN = ("python", "pycon", "console", "toml")


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    body: str
    skip: str | None  # why it is shown and not run

    @property
    def where(self) -> str:
        return f"{self.page.name}:{self.line}"


def examples(page: Path) -> list[Example]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        language = match.group(1)
        if language not in RUN:
            continue
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        found.append(Example(page, line, language, match.group(2), skip.group(1) if skip else None))
    return found


def console_commands(body: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for each `$ ` line of a console block."""
    commands: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
    return commands


def output_matches(expected: list[str], actual: str) -> bool:
    """The expected lines against the actual output: `...` alone skips lines, `...` inside a line any text;
    trailing whitespace ignored."""
    pattern = []
    for line in expected:
        if line.strip() == "...":
            pattern.append(r"(?:.*\n)*?")
        else:
            pattern.append("[^\n]*".join(re.escape(part) for part in line.rstrip().split("...")) + r"[ \t]*\n")
    text = "\n".join(line.rstrip() for line in actual.splitlines()) + "\n"
    return re.fullmatch("".join(pattern) + r"\s*", text) is not None if pattern else True
