"""Rows of an input file, as (number, where, object): JSON Lines, a JSON array, or Parquet.

The number is the row's 1-based line, element or row number; `where` names the row in messages
("data.jsonl: line 7"); a row that is not valid JSON comes as a RowError in place of its object,
so that the caller's policy decides what happens to it (corecap/data/samples.py).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

from corecap.errors import CorecapError

# a row has one; Parquet reads only these, id, loss_mask
INPUT_FIELDS = ("input_ids", "text", "messages", "conversations")
UNITS = {"jsonl": "line", "json": "element", "parquet": "row"}
_CHUNK = 1 << 20  # JSON array reader: characters read at a time


class RowError(CorecapError):
    """A problem confined to one row: the run stops on it, or skips the row under a skip policy."""

    def __init__(self, where: str, message: str, reason: str):
        super().__init__(f"{where}: {message}")
        self.reason = reason


@contextmanager
def open_rows(path: str) -> Iterator[tuple[str, Iterator[tuple[int, str, object]]]]:
    """(unit, rows) of the file: its unit ("line", "element" or "row") and its rows, in order."""
    f = _open(path)
    with f:
        fmt = _format(path, f)
        yield UNITS[fmt], {"jsonl": _jsonl_rows, "json": _json_array_rows, "parquet": _parquet_rows}[fmt](path, f)


def _open(path: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise CorecapError(f"--data {path}: cannot open ({e.strerror})") from None


def _format(path: str, f) -> str:
    lower = path.lower()
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    if lower.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    f.seek(0)
    return "json" if head.startswith(b"[") else "jsonl"


def _jsonl_rows(path: str, f) -> Iterator[tuple[int, str, object]]:
    for line_no, raw in enumerate(f, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            obj = RowError(where, f"not valid JSON ({getattr(e, 'msg', e)})", "not valid JSON")
        yield line_no, where, obj


class _ArrayReader:
    """Streams the elements of one top-level JSON array: a ShareGPT dump of a million
    conversations is gigabytes of text, and many times that as Python objects if loaded whole."""

    _NON_SPACE = re.compile(r"[^ \t\r\n]")

    def __init__(self, path: str, f):
        self.path = path
        self.text = io.TextIOWrapper(f, encoding="utf-8-sig")
        self.decoder = json.JSONDecoder()
        self.buf, self.pos, self.eof = "", 0, False
        self.line = 1  # line number of buf[0]

    def _fill(self, size: int = 0) -> bool:
        if self.eof:
            return False
        try:
            chunk = self.text.read(max(size, _CHUNK))
        except UnicodeDecodeError as e:
            raise CorecapError(f"{self.path}: not UTF-8 text ({e.reason})") from None
        if not chunk:
            self.eof = True
            return False
        self.line += self.buf.count("\n", 0, self.pos)
        self.buf, self.pos = self.buf[self.pos :] + chunk, 0
        return True

    def _line_at(self, pos: int) -> int:
        return self.line + self.buf.count("\n", 0, pos)

    def _peek(self) -> str | None:
        """The next non-blank character (not consumed), None at the end of the file."""
        while True:
            m = self._NON_SPACE.search(self.buf, self.pos)
            if m:
                self.pos = m.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if not self._fill():
                return None

    def _decode(self, n: int):
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self._fill(len(self.buf)):  # the element may go on past the buffer: read more
                    continue
                raise CorecapError(
                    f"{self.path}: element {n}: not valid JSON ({e.msg}, line {self._line_at(e.pos)})"
                ) from None
            if end == len(self.buf) and self._fill():  # a number may go on past the buffer
                continue
            self.pos = end
            return value

    def rows(self) -> Iterator[tuple[int, str, object]]:
        if self._peek() != "[":
            raise CorecapError(f"{self.path}: expected a JSON array of objects or JSON Lines")
        self.pos += 1
        n = 0
        if self._peek() == "]":
            self.pos += 1
        else:
            while True:
                n += 1
                if self._peek() is None:
                    raise CorecapError(f"{self.path}: element {n}: the file ends inside the array")
                yield n, f"{self.path}: element {n}", self._decode(n)
                c = self._peek()
                self.pos += 1
                if c == "]":
                    break
                if c != ",":
                    where = f"line {self._line_at(self.pos - 1)}" if c else "end of file"
                    raise CorecapError(f"{self.path}: element {n}: expected ',' or ']' after it ({where})")
        if self._peek() is not None:
            raise CorecapError(f"{self.path}: text after the closing ']' (line {self._line_at(self.pos)})")


def _json_array_rows(path: str, f) -> Iterator[tuple[int, str, object]]:
    return _ArrayReader(path, f).rows()


def _parquet_rows(path: str, f) -> Iterator[tuple[int, str, object]]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise CorecapError(
            f"--data {path}: reading Parquet needs pyarrow (pip install 'corecap[parquet]' or pip install pyarrow)"
        ) from None
    try:
        pf = pq.ParquetFile(f)
    except pyarrow.ArrowException as e:
        raise CorecapError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    if not any(name in names for name in INPUT_FIELDS):
        raise CorecapError(f"{path}: no column {', '.join(map(repr, INPUT_FIELDS))} (columns: {', '.join(names)})")
    columns = [name for name in names if name in ("id", "loss_mask") + INPUT_FIELDS]
    n = 0
    for batch in pf.iter_batches(batch_size=1024, columns=columns):
        for row in batch.to_pylist():
            n += 1
            # Columns are shared by all rows, so a field a row does not use is null.
            yield n, f"{path}: row {n}", {k: v for k, v in row.items() if v is not None}
