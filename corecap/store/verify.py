"""`corecap verify`: check every sample of a store and say which ones are wrong, and how.

    corecap verify --store out.lmdb      # exit 0: all good; 1: problems (listed); 2: not a store

A sample is good when it has both its header and its states, its header agrees with the store's
metadata (layers, dtype, hidden size, codec) and with its own key, its states can be read (the
state file its pointer names holds them) and decode (sizes and checksum), its input fingerprint
matches its stored input ids, and its states hold no NaN/Inf and no layer that is exactly zero
everywhere (a capture that never happened looks like that).

The two databases are walked together in key order inside one read transaction, so that a run
that is writing the store meanwhile is neither blocked nor seen half-way (LMDB readers see a
snapshot). The walking thread reads each sample's header and states; a pool of threads decodes
and checks them (decoding is most of the time: tools/bench_verify.py), with at most two samples
per thread in flight, so memory stays at a few samples however large the store. Problems are
reported in key order.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import lmdb
import numpy as np
import torch

from corecap.errors import CorecapError
from corecap.store import Store, codecs_may_mix, decode_header, decode_sample, input_fingerprint


@dataclass
class VerifyReport:
    store: str
    num_samples: int = 0
    num_tokens: int = 0  # of the samples whose header could be read
    problems: dict[str, list[str]] = field(default_factory=dict)  # key → what is wrong with it

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        if self.ok:
            return f"{self.store}: {self.num_samples} samples OK ({self.num_tokens} tokens)"
        return f"{self.store}: {len(self.problems)} of {self.num_samples} samples have problems"


def default_threads() -> int:
    return min(8, os.cpu_count() or 1)


def verify_store(
    path: str, on_problem: Callable[[str, list[str]], None] | None = None, num_threads: int | None = None,
) -> VerifyReport:
    """Check every sample of the store at `path`; `on_problem(key, problems)` as each is found,
    in key order. `num_threads` decode and check (default: `default_threads()`).

    Raises CorecapError when `path` is not a readable corecap store at all."""
    try:
        store = Store.open(path)
    except lmdb.Error as e:  # e.g. a corecap meta db but no headers/samples db
        raise CorecapError(f"{path}: not a corecap store ({e})") from None
    report = VerifyReport(store.path)
    num_threads = num_threads or default_threads()
    pending: deque = deque()  # (key, its problems or the future of them), in key order

    def collect_oldest() -> None:
        key, problems = pending.popleft()
        if isinstance(problems, Future):
            problems = problems.result()
        if problems:
            report.problems[key] = problems
            if on_problem is not None:
                on_problem(key, problems)

    try:
        with store, store.env.begin(buffers=True) as txn, ThreadPoolExecutor(num_threads) as pool:
            for key, header, value in _walk(txn, store):
                report.num_samples += 1
                read = _read(key, header, value, store, report)
                found = isinstance(read, list)  # wrong without decoding
                pending.append((key, read if found else pool.submit(_check_decoded, key, *read, store)))
                while len(pending) > 2 * num_threads:
                    collect_oldest()
            while pending:
                collect_oldest()
    except lmdb.Error as e:
        raise CorecapError(f"{path}: the LMDB itself is damaged ({e}); checked {report.num_samples} samples before it") from None
    return report


def _walk(txn, store: Store) -> Iterator[tuple[str, object, object]]:
    """(key, header or None, states value or None) over the union of both dbs' keys, in key order.

    Both cursors run in LMDB's key order (bytewise, as Python compares bytes), so a merge finds
    the keys that one db has and the other lacks without holding any key set in memory."""
    headers, payloads = txn.cursor(db=store.headers_db), txn.cursor(db=store.samples_db)
    has_header, has_payload = headers.first(), payloads.first()
    while has_header or has_payload:
        hkey = bytes(headers.key()) if has_header else None
        pkey = bytes(payloads.key()) if has_payload else None
        if has_header and (not has_payload or hkey <= pkey):
            same = has_payload and hkey == pkey
            yield _text(hkey), headers.value(), payloads.value() if same else None
            has_header = headers.next()
            if same:
                has_payload = payloads.next()
        else:
            yield _text(pkey), None, payloads.value()
            has_payload = payloads.next()


def _text(key: bytes) -> str:
    return key.decode("utf-8", errors="backslashreplace")


def _read(key: str, header_value, value, store: Store, report: VerifyReport):
    """In the walking thread: the sample's problems when it is wrong without decoding its states,
    else (header, header bytes, states bytes) for `_check_decoded`."""
    meta = store.meta
    if header_value is None:
        return ["states but no header (an incomplete sample)"]
    try:
        header = decode_header(key, header_value)
    except CorecapError as e:
        return [_strip(e, key)]
    report.num_tokens += header.num_tokens
    problems = []
    if header.id != key:
        problems.append(f"header is for sample {header.id!r}")
    for name in ("layers", "dtype", "hidden_size"):
        mine, store_value = getattr(header, name), getattr(meta, name)
        if mine != store_value:
            problems.append(f"header has {name}={mine!r}, the store's metadata {store_value!r}")
    if not codecs_may_mix(header.codec, meta.codec):
        problems.append(f"header has codec={header.codec!r}, the store's metadata {meta.codec!r} (lossy and exact states mixed)")
    if value is None:
        problems.append("header but no states (an incomplete sample)")
    if problems:  # decoding against the metadata would only restate these
        return problems
    try:
        return header, bytes(header_value), store.states(key, header, value)
    except CorecapError as e:
        return [_strip(e, key)]


def _check_decoded(key: str, header, header_value: bytes, states: bytes, store: Store) -> list[str]:
    """On a pool thread: decode the states and check them against the header."""
    meta = store.meta
    problems = []
    try:
        sample = decode_sample(key, header_value, states, len(meta.layers))
    except CorecapError as e:
        return [_strip(e, key)]
    if input_fingerprint(sample.input_ids) != header.input_fingerprint:
        problems.append(
            f"input fingerprint {header.input_fingerprint} does not match its input ids ({input_fingerprint(sample.input_ids)})"
        )
    mask = header.loss_mask
    if mask is not None and (len(mask) != header.num_tokens or np.frombuffer(mask, np.uint8).max(initial=0) > 1):
        problems.append(f"loss mask of {len(mask)} bytes is not one 0/1 flag per token ({header.num_tokens} tokens)")
    states_problems = _check_states(sample.hidden_states, meta.layers)
    if states_problems and getattr(header, "nonfinite", False):  # stored under `--nonfinite store`
        states_problems[0] += " (flagged at capture)"
    return problems + states_problems


def _check_states(states: torch.Tensor, layers: tuple[int, ...]) -> list[str]:
    """NaN/Inf and all-zero layers, one layer at a time (bounds the temporaries). One sum per
    layer settles both for nearly every layer: a finite sum means no NaN/Inf (they propagate
    through it, writer.all_finite), and a sum other than zero means some value is not zero.
    Only an overflowed or zero sum is looked at element by element (tools/bench_verify.py)."""
    problems = []
    for i, layer in enumerate(layers):
        x = states[i]
        if x.numel() == 0:
            continue
        total = x.sum()
        if bool(torch.isfinite(total)) and bool(total != 0):
            continue
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            num_nan, num_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            first = int(torch.nonzero(~finite.all(dim=-1))[0, 0])
            problems.append(f"layer {layer}: {num_nan} NaN and {num_inf} Inf values (first at token {first})")
        elif not bool(x.any()):
            problems.append(f"layer {layer}: all {x.shape[0]} tokens are exactly zero (never captured?)")
    return problems


def _strip(error: CorecapError, key: str) -> str:
    return str(error).removeprefix(f"sample {key!r}: ")
