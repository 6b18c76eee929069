"""The rows of an input file that a run refuses, reported together in one error: a file with
three bad rows takes one run to fix, not three (corecap/data/samples.py, `validate`; the rows
`corecap export --data` cannot join to the stored samples, corecap/data/conversations.py)."""

from __future__ import annotations

from corecap.errors import CorecapError

MAX_PROBLEMS = 20  # rows listed in the one error; the rest are counted
RUN_REFUSED = "rows cannot be captured (--invalid skip leaves out the invalid ones)"


class Problems:
    """The rows a run refuses, reported together: up to MAX_PROBLEMS lines, then a count."""

    def __init__(self, path: str, refused: str = RUN_REFUSED):
        self.path = path
        self.refused = refused  # the error's first line: "--data PATH: N {refused}:"
        self.lines: list[str] = []
        self.num = 0

    def add(self, line: str) -> None:
        self.num += 1
        if len(self.lines) < MAX_PROBLEMS:
            self.lines.append(line)

    def raise_if_any(self) -> None:
        if self.num == 1:
            raise CorecapError(self.lines[0])
        if self.num:
            more = [f"  and {self.num - len(self.lines)} more"] if self.num > len(self.lines) else []
            raise CorecapError("\n".join([f"--data {self.path}: {self.num} {self.refused}:",
                                          *(f"  {line}" for line in self.lines), *more]))
