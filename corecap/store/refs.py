"""Stored once: a sample whose prefix another committed sample already stores refers to it and
stores only its own tail (format 4; docs/store.md, docs/design.md "Store once").

A header's `prefix` lists segments (key, start, end) covering its positions [0, n): positions
[start, end) are positions [start, end) of sample `key` (a shared prefix sits at the same
positions in both), which holds them in its *own payload*. A segment never names another
sample's reference: the writer flattens (`within(layout(...))`), so a read decodes one level,
each sample it names once, and can never recurse or loop. That costs a header one segment per
distinct owner (turn k of a conversation stored one sample per turn names the k - 1 turns
before it, a few dozen bytes each) and buys reads that cost what the positions cost.

Every segment's owner is checked when it is read (`reference_problems`): it exists with its
states, its header is sound, it holds [start, end) itself, and its token ids there are this
sample's. The owner's own states are then decoded and checked by its own header's checksum.
Owners are decoded one at a time, so a read holds its result, the owners' stored bytes and one
owner's decoded states.

Why no cycle and no dangling reference: a segment lies in its owner's own positions [n_K, T_K)
and in the referrer's [0, n_R), so n_K < n_R: every owner has a shorter prefix than its
referrer. Writers commit an owner before, or in the same LMDB transaction as, any sample that
refers to it (the sink refers only to samples it has already handed to the writer, whose
commits keep their order; merge commits in order of n), and corecap never deletes a sample.
"""

from __future__ import annotations

import numpy as np
import torch

from corecap.errors import CorecapError
from corecap.store.checks import header_problems
from corecap.store.decode import decode_states
from corecap.store.format import DTYPES, Sample, SampleHeader, Segment, decode_header


def layout(key: str, prefix, num_prefix: int, num_tokens: int) -> tuple[Segment, ...]:
    """Where each position of sample `key` is stored: its prefix's segments, then its own part."""
    own = (Segment(key, num_prefix, num_tokens),) if num_tokens > num_prefix else ()
    return tuple(prefix or ()) + own


def within(segments, start: int, end: int) -> tuple[Segment, ...]:
    """The segments clipped to positions [start, end), empty ones left out."""
    return tuple(Segment(s.key, max(s.start, start), min(s.end, end))
                 for s in segments if s.start < end and s.end > start)


def owners(header: SampleHeader) -> dict[str, list[Segment]]:
    """The samples a header's prefix names, each with its segments, in order of first mention."""
    out: dict[str, list[Segment]] = {}
    for s in header.prefix or ():
        out.setdefault(s.key, []).append(s)
    return out


def reference_problems(store, txn, key: str, header: SampleHeader) -> tuple[list[str], dict]:
    """What is wrong with a (sound) header's reference, against the samples it names, as `txn`
    sees them; and owner key → (its header, its samples value) for those found sound."""
    problems, found = [], {}
    ids = np.frombuffer(header.input_ids, "<i4")
    for owner, segments in owners(header).items():
        where = f"positions [{segments[0].start}, {segments[-1].end}) come from sample {owner!r}"
        raw = owner.encode(errors="surrogateescape")
        header_value, value = txn.get(raw, db=store.headers_db), txn.get(raw, db=store.samples_db)
        if header_value is None or value is None:
            problems.append(f"{where}, which is {'not in the store' if header_value is None else 'without states'}")
            continue
        try:
            theirs = decode_header(owner, header_value)
        except CorecapError as e:
            problems.append(f"{where}, whose header is unreadable ({e})")
            continue
        wrong, _ = header_problems(owner, theirs, store.meta)
        if wrong:
            problems.append(f"{where}, whose header is damaged ({wrong[0]})")
            continue
        n, their_ids = theirs.num_prefix, np.frombuffer(theirs.input_ids, "<i4")
        for s in segments:
            if s.start < n or s.end > theirs.num_tokens:
                problems.append(f"{where}, which stores positions [{n}, {theirs.num_tokens}) itself, "
                                f"not [{s.start}, {s.end})")
                break
            if not np.array_equal(their_ids[s.start : s.end], ids[s.start : s.end]):
                problems.append(f"{where}, whose token ids at [{s.start}, {s.end}) differ from this sample's")
                break
        else:
            found[owner] = (theirs, value)
    return problems, found


def read_owners(store, txn, key: str, header: SampleHeader, end) -> list[tuple[SampleHeader, object, list[Segment]]]:
    """(owner header, owner's stored states, segments) for every sample `header` refers to, each
    checked (`reference_problems`), or CorecapError naming the first problem."""
    problems, found = reference_problems(store, txn, key, header)
    if problems:
        raise CorecapError(f"{store.path}: sample {key!r}: {problems[0]}")
    return [(found[o][0], store.states(o, *found[o], end), segs) for o, segs in owners(header).items()]


def assemble(key: str, own: Sample, parts, out: torch.Tensor | None = None) -> Sample:
    """The whole sample from its own decoded part and its owners' stored parts (`read_owners`),
    each owner decoded (its checksum checked) and dropped in turn, into `out` or new memory."""
    header = own.header
    n, dtype = header.num_prefix, DTYPES[header.dtype]
    try:
        states = (torch.empty((len(header.layers), header.num_tokens, header.hidden_size), dtype=dtype)
                  if out is None else out)
    except RuntimeError:
        raise CorecapError(f"sample {key!r}: its states do not fit in memory") from None
    states[:, n:] = own.hidden_states
    for theirs, stored, segments in parts:
        try:
            their_states = decode_states(theirs.id, theirs, stored).hidden_states
        except CorecapError as e:
            raise CorecapError(f"sample {key!r}: positions [{segments[0].start}, {segments[-1].end}) "
                               f"come from {e}") from None
        for s in segments:
            states[:, s.start : s.end] = their_states[:, s.start - theirs.num_prefix : s.end - theirs.num_prefix]
        del their_states
    return Sample(header, own.input_ids, states)
