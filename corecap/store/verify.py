"""`corecap verify`: check every sample of a store and say which ones are wrong, and how.

    corecap verify --store out.lmdb      # exit 0: all good; 1: problems (listed); 2: not a store

A sample is good when it has both its header and its states, its header agrees with the store's
metadata (layers, dtype, hidden size, codec) and with its own key, its states can be read (the
state file its pointer names holds them) and decode (sizes and checksum), its input fingerprint
matches its stored input ids, and its states hold no NaN/Inf and no layer that is exactly zero
everywhere (a capture that never happened looks like that).

Every check runs before what it guards is read or allocated (docs/store.md, "What readers check"),
so whatever the damage each bad sample is reported, naming the field, what was expected and what
was found, and the walk goes on. Damage that belongs to no one sample is reported for the store:
a damaged LMDB page (which ends the walk: its cursor cannot go on) and a missing or malformed
`states_end` (pointers are then bounded by their files alone).

The two databases are walked together in key order inside one read transaction, so that a run
that is writing the store meanwhile is neither blocked nor seen half-way (LMDB readers see a
snapshot). The walking thread reads each sample's header and states; a pool of threads decodes
and checks them (decoding is most of the time: `python -m tools.bench.verify`; docs/benchmarks.md,
"CPU"), with at most two samples
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
import torch

from corecap.errors import CorecapError
from corecap.store import Store, decode_header, refs, segments
from corecap.store.checks import header_problems
from corecap.store.decode import decode_states
from corecap.store.format import SampleHeader
from corecap.store.store import key_text, lmdb_errors, lmdb_message, prefixed


@dataclass(kw_only=True)
class VerifyReport:
    store: str
    num_samples: int = 0
    num_tokens: int = 0  # of the samples whose header could be read and agrees with its ids
    num_referring: int = 0  # samples whose prefix other samples store (format 4)
    problems: dict[str, list[str]] = field(default_factory=dict)  # key → what is wrong with it
    store_problems: list[str] = field(default_factory=list)  # damage to no one sample: the LMDB, states_end

    @property
    def ok(self) -> bool:
        return not self.problems and not self.store_problems

    def line(self) -> str:
        if self.ok:
            referring = (f", {self.num_referring} of them stored once: their prefix refers to other samples"
                         if self.num_referring else "")
            return f"{self.store}: {self.num_samples} samples OK ({self.num_tokens} tokens{referring})"
        line = f"{self.store}: {len(self.problems)} of {self.num_samples} samples have problems"
        return line + (f"; the store itself has {len(self.store_problems)}" if self.store_problems else "")


def default_threads() -> int:
    return min(8, os.cpu_count() or 1)


def verify_store(
    path: str, on_problem: Callable[[str, list[str]], None] | None = None, num_threads: int | None = None,
) -> VerifyReport:
    """Check every sample of the store at `path`; `on_problem(key, problems)` as each is found,
    in key order. `num_threads` decode and check (default: `default_threads()`). Damage that
    belongs to no one sample (a damaged LMDB page, which ends the walk; `states_end`) goes to
    `report.store_problems`. Whatever the damage, the result is a report, never another error.

    Raises CorecapError when `path` is not a readable corecap store at all."""
    store = Store.open(path)
    report = VerifyReport(store=store.path)
    num_threads = num_threads or default_threads()
    pending: deque = deque()  # (key, its problems or the future of them), in key order
    referrers: dict[str, list[str]] = {}  # key → the samples its prefix comes from
    reference_problems: dict[str, list[str]] = {}  # key → the problems of its own reference

    def collect_oldest() -> None:
        key, problems = pending.popleft()
        if isinstance(problems, Future):
            problems = problems.result()
        if problems:
            report.problems[key] = problems
            if on_problem is not None:
                on_problem(key, problems)

    with store, ThreadPoolExecutor(num_threads) as pool:
        try:
            with store.env.begin(buffers=True) as txn:
                try:
                    end = store.committed_end(txn)
                except CorecapError as e:  # pointers are then bounded by their files alone
                    report.store_problems.append(str(e).removeprefix(f"{store.path}: "))
                    end = None
                for raw_key, header, value in _walk(txn, store):
                    report.num_samples += 1
                    key = raw_key.decode("utf-8", errors="backslashreplace")
                    read = _read(raw_key, key, header, value, store, end, report, txn, referrers, reference_problems)
                    found = isinstance(read, list)  # wrong without decoding
                    pending.append((key, read if found else pool.submit(_check_decoded, key, *read, store)))
                    while len(pending) > 2 * num_threads:
                        collect_oldest()
        except lmdb.Error as e:
            report.store_problems.append(f"{lmdb_message(e)}; "
                                         f"the samples after the first {report.num_samples} were not checked")
        while pending:
            collect_oldest()
    # A reference to a sample whose own states or header are damaged is damaged (a read of it
    # fails); that sample's own reference is not read through it (refs.py: one level).
    damaged = {k for k, p in report.problems.items() if len(p) > len(reference_problems.get(k, ()))}
    for key, owners in referrers.items():
        bad = [owner for owner in owners if owner in damaged]
        if bad:
            problems = [f"its prefix comes from sample {bad[0]!r}, which has problems"]
            report.problems.setdefault(key, []).extend(problems)
            if on_problem is not None:
                on_problem(key, problems)
    return report


def _walk(txn, store: Store) -> Iterator[tuple[bytes, object, object]]:
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
            yield hkey, headers.value(), payloads.value() if same else None
            has_header = headers.next()
            if same:
                has_payload = payloads.next()
        else:
            yield pkey, None, payloads.value()
            has_payload = payloads.next()


def _read(raw_key: bytes, key: str, header_value, value, store: Store, end, report: VerifyReport, txn, referrers,
          reference_problems):
    """In the walking thread: the sample's problems when it is wrong without decoding its states,
    else (its problems so far, header, states bytes) for `_check_decoded`. A reference is checked
    against the samples it names (headers only: their states are checked where they are)."""
    if not _is_utf8(raw_key):
        return [f"key {raw_key!r} is not UTF-8"]
    if header_value is None:
        return ["states but no header (an incomplete sample)"]
    try:
        header = decode_header(key, header_value)
    except CorecapError as e:
        return [_strip(e, key)]
    problems, decodable = header_problems(key, header, store.meta)
    if decodable:
        report.num_tokens += header.num_tokens
    if value is None:
        problems.append("header but no states (an incomplete sample)")
    if decodable and header.prefix:
        report.num_referring += 1
        reference_problems[key] = refs.reference_problems(store, txn, key, header)[0]
        problems += reference_problems[key]
        referrers[key] = list(refs.owners(header))
    if not decodable or value is None:  # decoding against the header would only restate these
        return problems
    try:
        return problems, header, store.states(key, header, value, end)
    except CorecapError as e:
        return problems + [_strip(e, key, store.path)]


def _check_decoded(key: str, problems: list[str], header, states: bytes, store: Store) -> list[str]:
    """On a pool thread: decode the states and check them against the header."""
    try:
        sample = decode_states(key, header, states)
    except CorecapError as e:
        return problems + [_strip(e, key)]
    states_problems = _check_states(sample.hidden_states, store.meta.layers)
    if states_problems and header.nonfinite:  # stored under `--nonfinite store`
        states_problems[0] += " (flagged at capture)"
    return problems + states_problems


def _check_states(states: torch.Tensor, layers: tuple[int, ...]) -> list[str]:
    """NaN/Inf and all-zero layers, one layer at a time (bounds the temporaries). One sum per
    layer settles both for nearly every layer: a finite sum means no NaN/Inf (they propagate
    through it, writer.all_finite), and a sum other than zero means some value is not zero.
    Only an overflowed or zero sum is looked at element by element (`python -m tools.bench.verify`;
    docs/benchmarks.md, "CPU")."""
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


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def _strip(error: CorecapError, key: str, path: str | None = None) -> str:
    """The error's message without the store and the sample it names (verify lists by key)."""
    text = str(error)
    if path is not None:
        text = text.removeprefix(f"{path}: ")
    return text.removeprefix(f"sample {key!r}: ")


def contents(store: Store) -> dict:
    """What a store holds, from the headers alone (`corecap info`): its samples' tokens, those in
    their own payloads (the rest, samples refer to others for: stored once, format 4), the
    samples that refer, the samples whose response the model wrote (their tokens, by finish
    reason), the samples with images (their images and image tokens) and the bytes of its state
    files on disk."""
    num_tokens = num_referred = num_referring = num_generated = num_generated_tokens = 0
    num_image_samples = num_images = num_image_tokens = 0
    reasons: dict[str, int] = {}
    for _, header in headers(store):
        if header.media is not None:
            num_image_samples += 1
            num_images += len(header.media.items)
            num_image_tokens += sum(i.length for i in header.media.items)
        num_tokens += header.num_tokens
        num_referred += header.num_prefix
        num_referring += header.prefix is not None
        if header.generation is not None:
            num_generated += 1
            num_generated_tokens += header.generation.num_generated
            reasons[header.generation.finish_reason] = reasons.get(header.generation.finish_reason, 0) + 1
    state_bytes = sum(os.path.getsize(segments.segment_path(store.path, n))
                      for n in segments.segment_numbers(store.path))
    return {"num_tokens": num_tokens, "num_stored_tokens": num_tokens - num_referred,
            "num_referring_samples": num_referring,
            "num_generated_samples": num_generated, "num_generated_tokens": num_generated_tokens,
            "finish_reasons": dict(sorted(reasons.items())),
            "num_image_samples": num_image_samples, "num_images": num_images, "num_image_tokens": num_image_tokens,
            "state_file_bytes": state_bytes}


def headers(store: Store, utf8_keys: bool = False) -> Iterator[tuple[str, SampleHeader]]:
    """(key, decoded header) of every sample in key order, in one read transaction (`corecap ls
    --long`, `contents`); no states are read. A key that is not UTF-8 is damage with `utf8_keys`
    (as `ls` names it), else shown escaped."""
    with lmdb_errors(store.path, "the headers database"), store.env.begin(buffers=True) as txn:
        for k, v in txn.cursor(db=store.headers_db):
            key = key_text(store.path, bytes(k)) if utf8_keys else bytes(k).decode(errors="backslashreplace")
            yield key, prefixed(store.path, decode_header, key, v)
