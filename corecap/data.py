"""Reading and validating the input dataset (JSON Lines).

Each non-blank line is an object with an optional "id" (string, or integer taken as its decimal
string; default: the 1-based line number) and either "input_ids" (list of ints) or "text"
(tokenized with the model's tokenizer). `validate` reads the whole file once, cheaply and
before any model loads, so that a bad line 400,000 is reported up front; `read_samples` then
streams the same samples lazily while the engine runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from corecap import CorecapError
from corecap.store import MAX_KEY_BYTES


@dataclass(frozen=True)
class Sample:
    key: str
    line: int
    token_ids: np.ndarray  # int32 [T]


@dataclass(frozen=True)
class DatasetSummary:
    num_samples: int
    num_tokens: int
    num_lines: int


def _key(obj: dict, where: str, line: int) -> str:
    if "id" not in obj:
        return str(line)
    value = obj["id"]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise CorecapError(f"{where}: field 'id' must be a string or an integer, got {type(value).__name__}")
    key = str(value)
    if not key:
        raise CorecapError(f"{where}: field 'id' is empty")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise CorecapError(f"{where}: field 'id' is {len(key.encode())} bytes, at most {MAX_KEY_BYTES} allowed")
    return key


def _token_ids(obj: dict, where: str, tokenizer, vocab_size: int) -> np.ndarray:
    if "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise CorecapError(f"{where}: field 'input_ids' must be a list of integers")
        arr = np.asarray(ids, dtype=np.int64)
    elif "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            raise CorecapError(f"{where}: field 'text' must be a string, got {type(text).__name__}")
        if tokenizer is None:
            raise CorecapError(f"{where}: field 'text' needs a tokenizer, and the model directory has none")
        arr = np.asarray(tokenizer(text, add_special_tokens=True)["input_ids"], dtype=np.int64)
    else:
        raise CorecapError(f"{where}: expected a field 'input_ids' or 'text'")
    if arr.size == 0:
        raise CorecapError(f"{where}: empty sample (no tokens)")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise CorecapError(
            f"{where}: token id {int(arr[i])} at position {i} is outside the vocabulary [0, {vocab_size})"
        )
    return arr.astype(np.int32)


def read_samples(path: str, *, tokenizer, vocab_size: int, max_len: int) -> Iterator[Sample]:
    """Yield every sample of a JSON Lines file, raising CorecapError at the first bad line."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CorecapError(f"--data {path}: cannot open ({e.strerror})") from None
    with f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CorecapError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
            if not isinstance(obj, dict):
                raise CorecapError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            key = _key(obj, where, line_no)
            ids = _token_ids(obj, where, tokenizer, vocab_size)
            if len(ids) > max_len:
                raise CorecapError(f"{where}: sample {key!r} has {len(ids)} tokens, more than --max-len {max_len}")
            yield Sample(key, line_no, ids)


def validate(path: str, *, tokenizer, vocab_size: int, max_len: int) -> DatasetSummary:
    """One streaming pass over the whole file: every check, plus unique ids."""
    first_line: dict[bytes, int] = {}
    num_samples = num_tokens = last_line = 0
    for sample in read_samples(path, tokenizer=tokenizer, vocab_size=vocab_size, max_len=max_len):
        digest = hashlib.blake2b(sample.key.encode(), digest_size=16).digest()
        if digest in first_line:
            raise CorecapError(
                f"{path}:{sample.line}: duplicate id {sample.key!r} (first seen on line {first_line[digest]})"
            )
        first_line[digest] = sample.line
        num_samples += 1
        num_tokens += len(sample.token_ids)
        last_line = sample.line
    if num_samples == 0:
        raise CorecapError(f"--data {path}: no samples (the file is empty)")
    return DatasetSummary(num_samples, num_tokens, last_line)
