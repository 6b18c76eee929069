"""Reading and validating the input dataset: JSON Lines, a JSON array, or Parquet.

Each row is an object with an optional "id" (string, or integer taken as its decimal string;
default: the row's 1-based line, element or row number) and exactly one of
  input_ids      list of ints, with an optional "loss_mask" (0/1 per token)
  text           tokenized with the model's tokenizer
  messages       OpenAI style: [{"role": "system"|"user"|"assistant", "content": str}, ...]
  conversations  ShareGPT style: [{"from": "human"|"gpt"|"system", "value": str}, ...]
Conversations are rendered with the model's own chat template; their loss mask marks the
assistant's tokens. docs/datasets.md has literal examples, the mask method and the policies.
The file formats' readers are in corecap/data/rows.py, the conversations' in corecap/data/chat.py.

`validate` reads the whole file once, cheaply and before any model loads, so that a bad row
400,000 is reported up front; `read_samples` then streams the same samples lazily while the
engine runs. Both apply the same policies (overflow, invalid rows, shard), so they agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from corecap.errors import CorecapError
from corecap.data.chat import ChatRenderer, answer_points, first_prompt_images, parse_messages
from corecap.data.outcomes import DatasetSummary
from corecap.data.media import checked_images, expanded, too_long_with_images
from corecap.data.problems import Problems
from corecap.data.rows import INPUT_FIELDS, RowError, open_rows
from corecap.store import MAX_KEY_BYTES

OVERFLOW_POLICIES = ("error", "truncate", "skip")
# Refusing is the default: a run never silently changes or drops training data, and the check
# costs seconds because it runs before the model loads; --overflow truncate|skip is a choice.
DEFAULT_OVERFLOW = "error"
INVALID_POLICIES = ("error", "skip")
_NUM_SKIP_EXAMPLES = 10
_NO_LIMIT = 1 << 62  # check_rows: lengths are checked once --max-len is known


@dataclass(frozen=True)
class Sample:
    key: str
    line: int  # 1-based line (JSON Lines), element (JSON array) or row (Parquet)
    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray | None = None  # uint8 [T], 1 = train on this token; None: no mask given
    where: str = ""  # "data.jsonl:7", "data.json: element 7", "data.parquet: row 7"
    max_tokens: int = 0  # > 0: the model writes up to this many tokens after token_ids (the prompt)
    # `--rewrite-turns all`, a conversation: its turns, where the model answers (chat.answer_points),
    # and token_ids is the prompt of the first answer (the later ones are made as the answers come).
    messages: tuple | None = None
    points: tuple[int, ...] = ()
    # With images: their sources (data.media.ImageRef, in order), what the store keeps (store.Media);
    # a rewritten conversation's are all of its images, `media` its first prompt's
    images: tuple = ()
    media: object = None
    digests: tuple[str, ...] = ()  # the images' SHA-256, in order


# ---------------------------------------------------------------------------------------------
# Policies and sharding


def parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None or not int(m[1]) < int(m[2]):
        raise CorecapError(f"--shard {text!r}: expected K/N with 0 <= K < N")
    return int(m[1]), int(m[2])


def shard_of(key: str, num_shards: int) -> int:
    """The shard of a key: blake2b of its UTF-8 bytes, stable across processes, machines and
    Python versions (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


def _check_policies(overflow: str, invalid: str | None, shard) -> str:
    if overflow not in OVERFLOW_POLICIES:
        raise CorecapError(f"--overflow {overflow!r}: expected one of {', '.join(OVERFLOW_POLICIES)}")
    if invalid is None:  # one skip policy by default: a run told to skip long rows skips broken ones too
        invalid = "skip" if overflow == "skip" else "error"
    if invalid not in INVALID_POLICIES:
        raise CorecapError(f"--invalid {invalid!r}: expected one of {', '.join(INVALID_POLICIES)}")
    if shard is not None:
        k, n = shard
        if not (type(k) is int and type(n) is int and 0 <= k < n):
            raise CorecapError(f"--shard {k}/{n}: expected K/N with 0 <= K < N")
    return invalid


# ---------------------------------------------------------------------------------------------
# One row → key, token ids, loss mask


def row_key(obj: dict, where: str, line: int) -> str:
    """The key `corecap run` gives a row: its `id`, else its line (element, row) number."""
    if "id" not in obj:
        return str(line)
    value = obj["id"]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(where, f"field 'id' must be a string or an integer, got {type(value).__name__}", "bad id")
    key = str(value)
    if not key:
        raise RowError(where, "field 'id' is empty", "bad id")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise RowError(where, f"field 'id' is {len(key.encode())} bytes, at most {MAX_KEY_BYTES} allowed", "bad id")
    return key


def _input_ids(obj: dict, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise RowError(where, "field 'input_ids' must be a list of integers", "bad input_ids")
    if "loss_mask" not in obj:
        return np.asarray(ids, dtype=np.int64), None
    mask = obj["loss_mask"]
    if not isinstance(mask, list) or not all(type(v) in (int, bool) and v in (0, 1) for v in mask):
        raise RowError(where, "field 'loss_mask' must be a list of 0s and 1s", "bad loss_mask")
    if len(mask) != len(ids):
        raise RowError(where, f"field 'loss_mask' has {len(mask)} entries, 'input_ids' has {len(ids)}", "bad loss_mask")
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def _tokens(obj: dict, where: str, tokenizer, vocab_size: int, chat: dict,
            generate: bool, render: bool = True) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The row's token ids and loss mask; `generate`: the prompt the model answers, whose
    tokens are not trained on (the response's are). With every turn rewritten, a conversation's
    turns and answer points go to `chat["turns"]` (read by the caller). Without `render`, a text
    or a conversation is checked but not tokenized: (None, None)."""
    present = [name for name in INPUT_FIELDS if name in obj]
    if not present:
        raise RowError(
            where, "expected a field 'input_ids' or 'text', or a conversation in 'messages' or 'conversations'",
            "no input field",
        )
    if len(present) > 1:
        raise RowError(where, f"fields {' and '.join(map(repr, present))} both given, expected exactly one",
                       "several input fields")
    name = present[0]
    if "loss_mask" in obj and name != "input_ids":
        raise RowError(where, f"field 'loss_mask' goes with 'input_ids', not with {name!r}", "bad loss_mask")
    mask = None
    if name == "input_ids":
        arr, mask = _input_ids(obj, where)
    elif name == "text":
        text = obj["text"]
        if not isinstance(text, str):
            raise RowError(where, f"field 'text' must be a string, got {type(text).__name__}", "bad text")
        if not render:
            return None, None
        if tokenizer is None:
            raise CorecapError(f"{where}: field 'text' needs a tokenizer, and the model directory has none")
        arr = np.asarray(tokenizer(text, add_special_tokens=True)["input_ids"], dtype=np.int64)
    else:
        messages = parse_messages(obj, name, where, generate, chat.get("images"), chat["found"])
        chat["found"] = checked_images(chat["found"], chat["images"], where)
        if not render:
            return None, None
        if "renderer" not in chat:  # made on first use: text-only datasets need no chat template
            chat["renderer"] = ChatRenderer(tokenizer, where, name, chat.get("template_kwargs"))
        if generate and chat.get("all_turns"):
            points = answer_points(messages)
            chat["turns"] = (tuple(messages), tuple(points))
            arr = chat["renderer"].prompt(messages, where, messages[: points[0]])
        elif generate:
            arr = chat["renderer"].prompt(messages, where)
        else:
            arr, mask = chat["renderer"].render(messages, where)
    if generate:
        mask = np.zeros(len(arr), np.uint8)
    if arr.size == 0:
        raise RowError(where, "empty sample (no tokens)", "empty sample")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise RowError(
            where, f"token id {int(arr[i])} at position {i} is outside the vocabulary [0, {vocab_size})",
            "token outside the vocabulary",
        )
    if mask is not None and not mask.any() and not generate:
        raise RowError(where, "the loss mask marks no token (nothing to train on)", "empty loss mask")
    return arr.astype(np.int32), mask


# ---------------------------------------------------------------------------------------------
# The whole file


def _outcomes(path, *, tokenizer, vocab_size, max_len, overflow, invalid, shard, max_tokens=0, template_kwargs=None,
              all_turns=False, render=True, images=None, expand=None):
    """Yield ("unit", "line" | "element" | "row") first; then per row ("sample" | "truncated",
    Sample), ("skipped", RowError), ("invalid", RowError: a problem the policies refuse) or
    ("other shard", None); and ("rows", last row number) last. `max_tokens` > 0: each sample is a
    prompt the model answers with up to that many tokens, all within `max_len`. Without `render`,
    texts and conversations are checked but not tokenized, and no length is checked: their
    samples have no token ids. `images`, `expand`: data/media.py's Images and `expanded`."""
    path = os.fspath(path)
    with open_rows(path) as (unit, rows):
        yield "unit", unit
        chat: dict = {"template_kwargs": template_kwargs, "all_turns": all_turns, "images": images}
        last = 0
        for n, where, obj in rows:
            last = n
            try:
                if isinstance(obj, RowError):
                    raise obj
                if not isinstance(obj, dict):
                    raise RowError(where, f"expected a JSON object, got {type(obj).__name__}", "not an object")
                key = row_key(obj, where, n)
            except RowError as e:
                # A row without a readable key belongs to the shard of its line number.
                if shard is not None and shard_of(str(n), shard[1]) != shard[0]:
                    yield "other shard", None
                else:
                    yield "skipped" if invalid == "skip" else "invalid", e
                continue
            if shard is not None and shard_of(key, shard[1]) != shard[0]:
                yield "other shard", None
                continue
            try:
                chat.pop("turns", None)
                chat["found"] = []  # the row's images (parse_messages), then with their hashes (checked_images)
                ids, mask = _tokens(obj, where, tokenizer, vocab_size, chat, max_tokens > 0, render)
                found = first_prompt_images(chat["found"], chat.get("turns"), chat.get("renderer"), expand, where)
                ids, mask, media = expanded(ids, mask, found, expand, where)
            except RowError as e:
                yield "skipped" if invalid == "skip" else "invalid", e
                continue
            sources = tuple(image for image, _ in chat["found"])
            digests = tuple(digest for _, digest in chat["found"])
            if ids is None:
                yield "sample", Sample(key, n, np.empty(0, np.int32), None, where, images=sources)
                continue
            if max_tokens:
                messages, points = chat.get("turns", (None, ()))
                yield _prompt_outcome(Sample(key, n, ids, mask, where, max_tokens, messages, points, images=sources,
                                             media=media, digests=digests), max_len, overflow)
                continue
            if len(ids) <= max_len:
                yield "sample", Sample(key, n, ids, mask, where, images=sources, media=media)
                continue
            if media is not None:  # never cut: not what the model saw
                yield too_long_with_images(key, len(ids), max_len, overflow, where)
                continue
            too_long = f"sample {key!r} has {len(ids)} tokens, more than --max-len {max_len}"
            if overflow == "error":
                yield "invalid", RowError(where, f"{too_long} (--overflow truncate or skip lets the run go on)",
                                          "longer than --max-len")
                continue
            if overflow == "skip":
                yield "skipped", RowError(where, too_long, "longer than --max-len")
                continue
            if mask is not None and not mask[:max_len].any():
                yield "skipped", RowError(
                    where, f"{too_long}, and none of the first {max_len} is trained on",
                    "no trained token within --max-len",
                )
                continue
            yield "truncated", Sample(key, n, ids[:max_len], None if mask is None else mask[:max_len], where)
        yield "rows", last


def _prompt_outcome(sample: Sample, max_len: int, overflow: str) -> tuple[str, object]:
    """A prompt and its response must fit in `max_len`: what `overflow` does with one that
    leaves too little room (error: stop; skip: leave it out; truncate: a shorter response)."""
    room = max_len - len(sample.token_ids)
    if room >= sample.max_tokens:
        return "sample", sample
    too_long = (f"sample {sample.key!r} has a prompt of {len(sample.token_ids)} tokens, and --max-tokens "
                f"{sample.max_tokens} after it makes more than --max-len {max_len}")
    if overflow == "error":
        return "invalid", RowError(sample.where, f"{too_long} (--overflow truncate writes a shorter response, "
                                   "skip leaves it out)", "longer than --max-len")
    if overflow == "skip":
        return "skipped", RowError(sample.where, too_long, "longer than --max-len")
    if room < 1:
        return "skipped", RowError(sample.where, f"{too_long}, and leaves no room for a response",
                                   "no room for a response")
    return "truncated", dataclasses.replace(sample, max_tokens=room)


def read_samples(
    path: str, *, tokenizer, vocab_size: int, max_len: int, overflow: str = DEFAULT_OVERFLOW,
    invalid: str | None = None, shard: tuple[int, int] | None = None, max_tokens: int = 0,
    template_kwargs: dict | None = None, all_turns: bool = False, images=None, expand=None,
) -> Iterator[Sample]:
    """Yield every sample of the file (of shard K of N: `shard=(K, N)`), raising CorecapError at
    the first problem the policies refuse. `overflow` says what happens to a sample longer than
    `max_len` (error, truncate, skip); `invalid` to an invalid row (error, skip; default: skip
    under overflow="skip", else error). `max_tokens` > 0: prompts the model answers (`_prompt_outcome`)."""
    invalid = _check_policies(overflow, invalid, shard)
    for kind, value in _outcomes(
        path, tokenizer=tokenizer, vocab_size=vocab_size, max_len=max_len, overflow=overflow, invalid=invalid,
        shard=shard, max_tokens=max_tokens, template_kwargs=template_kwargs, all_turns=all_turns, images=images,
        expand=expand,
    ):
        if kind in ("sample", "truncated"):
            yield value
        elif kind == "invalid":
            raise value


def check_rows(path: str, *, vocab_size: int, overflow: str = DEFAULT_OVERFLOW, invalid: str | None = None,
               shard: tuple[int, int] | None = None, max_tokens: int = 0, all_turns: bool = False,
               images=None) -> DatasetSummary:
    """Every check that needs neither the tokenizer nor the engine's --max-len, over the whole
    file, before vLLM is imported: a file's bad rows are all reported within seconds (JSON,
    fields, roles and turns, ids and their uniqueness, given token ids, images read and
    decoded: `images`, a data.media.Images), not after a model load."""
    return validate(path, tokenizer=None, vocab_size=vocab_size, max_len=_NO_LIMIT, overflow=overflow,
                    invalid=invalid, shard=shard, max_tokens=max_tokens, all_turns=all_turns, render=False,
                    images=images)


def validate(
    path: str, *, tokenizer, vocab_size: int, max_len: int, overflow: str = DEFAULT_OVERFLOW,
    invalid: str | None = None, shard: tuple[int, int] | None = None, on_skip: Callable[[str], None] | None = None,
    on_sample: Callable[[Sample], None] | None = None, max_tokens: int = 0, template_kwargs: dict | None = None,
    all_turns: bool = False, render: bool = True, images=None, expand=None,
) -> DatasetSummary:
    """One streaming pass over the whole file: every check, unique ids, and the count of each
    outcome. `on_skip` is called with each skipped row's message (e.g. to log them all),
    `on_sample` with each sample kept (e.g. to check it against a store), in the same pass.
    Every row the policies refuse is reported in one CorecapError at the end (corecap/data/problems.py).
    Without `render` (`check_rows`), texts and conversations are not tokenized."""
    invalid = _check_policies(overflow, invalid, shard)
    first: dict[bytes, int] = {}  # id digest → row number: 16 bytes a key, not the key itself
    counts: Counter = Counter()
    reasons: Counter = Counter()
    examples: list[str] = []
    problems = Problems(path)
    num_tokens = num_images = 0
    unit, last = "line", 0
    for kind, value in _outcomes(
        path, tokenizer=tokenizer, vocab_size=vocab_size, max_len=max_len, overflow=overflow, invalid=invalid,
        shard=shard, max_tokens=max_tokens, template_kwargs=template_kwargs, all_turns=all_turns, render=render,
        images=images, expand=expand,
    ):
        counts[kind] += 1
        if kind == "unit":
            unit = value
        elif kind == "rows":
            last = value
        elif kind == "invalid":
            problems.add(str(value))
        elif kind == "skipped":
            reasons[value.reason] += 1
            if len(examples) < _NUM_SKIP_EXAMPLES:
                examples.append(str(value))
            if on_skip is not None:
                on_skip(str(value))
        elif kind in ("sample", "truncated"):
            digest = hashlib.blake2b(value.key.encode(), digest_size=16).digest()
            if digest in first:
                seen = f"{'on' if unit == 'line' else 'at'} {unit} {first[digest]}"
                problems.add(f"{value.where}: duplicate id {value.key!r} (first seen {seen})")
                continue
            first[digest] = value.line
            num_tokens += len(value.token_ids)
            num_images += len(value.images)
            if on_sample is not None:
                on_sample(value)
    problems.raise_if_any()
    num_samples = counts["sample"] + counts["truncated"]
    if num_samples + counts["skipped"] + counts["other shard"] == 0:
        raise CorecapError(f"--data {path}: no samples (the file is empty)")
    summary = DatasetSummary(
        num_samples=num_samples,
        num_tokens=num_tokens,
        num_lines=last,
        num_truncated=counts["truncated"],
        num_skipped=counts["skipped"],
        skip_reasons=dict(reasons),
        skip_examples=tuple(examples),
        num_other_shards=counts["other shard"],
        num_images=num_images,
    )
    if num_samples == 0 and counts["skipped"]:
        raise CorecapError(f"--data {path}: no samples left: {summary.outcomes()}")
    return summary

