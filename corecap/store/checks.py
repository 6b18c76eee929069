"""What a reader checks before it trusts a stored sample: its header against its key, the store's
metadata and itself (`header_problems`, `checked_header`), its reference to other samples'
prefixes (`prefix_problems`), the size its states decode to and may take encoded (`stored_size`,
`stored_bytes`), and the stored states' integrity without decoding them (`check_stored`).
Every problem is a CorecapError (or a list of them) naming the sample and the field.
"""

from __future__ import annotations

import numpy as np

from corecap.dtypes import DTYPES
from corecap.errors import CorecapError
from corecap.store import codec as codecs
from corecap.store.format import (
    FP8, KNOWN_CODECS, MAX_KEY_BYTES, SampleHeader, StoreMeta, codecs_may_mix, decode_header, header_crc,
    input_fingerprint,
)


def header_problems(key: str, header: SampleHeader, meta: StoreMeta) -> tuple[list[str], bool]:
    """What is wrong with a sample's header, against its key, the store's metadata and itself,
    and whether its states can still be decoded by it (False: its shape or codec is wrong).
    Every reader checks this before it reads the states the header describes."""
    shape = []
    for name in ("layers", "dtype", "hidden_size"):
        mine, theirs = getattr(header, name), getattr(meta, name)
        if mine != theirs:
            shape.append(f"header has {name}={mine!r}, the store's metadata {theirs!r}")
    if header.codec not in KNOWN_CODECS:
        shape.append(f"header has codec={header.codec!r}, expected one of {list(KNOWN_CODECS)}")
    elif not codecs_may_mix(header.codec, meta.codec):
        shape.append(f"header has codec={header.codec!r}, the store's metadata {meta.codec!r} "
                     "(lossy and exact states mixed)")
    ids_ok = header.num_tokens >= 0 and len(header.input_ids) == 4 * header.num_tokens
    if not ids_ok:
        shape.append(f"header has num_tokens={header.num_tokens} and {len(header.input_ids)} bytes of input_ids, "
                     "expected 4 per token")
    else:
        shape += prefix_problems(key, header)
    if ids_ok and not shape and header.payload_bytes != stored_size(header):
        shape.append(
            f"header has payload_bytes={header.payload_bytes}, expected {stored_size(header)} "
            "(layers x its own tokens x hidden size x itemsize)"
        )
    other = []
    if header.id != key:
        other.append(f"header is for sample {header.id!r}")
    if ids_ok and input_fingerprint(np.frombuffer(header.input_ids, "<i4")) != header.input_fingerprint:
        other.append(
            f"input fingerprint {header.input_fingerprint} does not match its input ids "
            f"({input_fingerprint(np.frombuffer(header.input_ids, '<i4'))})"
        )
    mask = header.loss_mask
    if mask is not None and (len(mask) != header.num_tokens or np.frombuffer(mask, np.uint8).max(initial=0) > 1):
        other.append(f"loss mask of {len(mask)} bytes is not one 0/1 flag per token ({header.num_tokens} tokens)")
    if header.generation is not None and header.generation.problem(header.num_tokens):
        other.append(header.generation.problem(header.num_tokens))
    if header.media is not None:
        problem = header.media.problem(header.num_tokens)
        if problem is None and mask is not None:
            flags = np.frombuffer(mask, np.uint8)
            if any(flags[i.offset:i.offset + i.length].any() for i in header.media.items):
                problem = "loss mask marks an image token (expected 0 on every image token)"
        if problem:
            other.append(problem)
    if header.header_crc is not None and header_crc(header) != header.header_crc:
        other.append(f"header checksum mismatch (header_crc {header.header_crc}, "
                     f"its fields' crc32 {header_crc(header)})")
    return shape + other, not shape


def prefix_problems(key: str, header: SampleHeader) -> list[str]:
    """What is wrong with a header's reference by itself (the samples it names are checked by
    the store: `Store.reference_problems`): segments contiguous from 0, each non-empty, ending
    at most at num_tokens, naming other keys of 1 to MAX_KEY_BYTES bytes."""
    if header.prefix is None:
        return []
    at = 0
    for s in header.prefix:
        raw = s.key.encode(errors="surrogateescape")
        if s.start != at or s.end <= s.start or not 0 < len(raw) <= MAX_KEY_BYTES or s.key == key:
            return [f"header's prefix segment {s.key[:40]!r} [{s.start}, {s.end}) does not continue at position {at} "
                    "(expected segments contiguous from 0, non-empty, naming other keys of 1 to "
                    f"{MAX_KEY_BYTES} bytes)"]
        at = s.end
    if not header.prefix or at > header.num_tokens:
        return [f"header's prefix covers positions [0, {at}), expected 1 to {header.num_tokens} (its num_tokens)"]
    return []


def checked_header(key: str, value, meta: StoreMeta) -> SampleHeader:
    """The header stored under `key`, decoded and checked (`header_problems`), or CorecapError."""
    header = decode_header(key, value)
    problems, _ = header_problems(key, header, meta)
    if problems:
        raise CorecapError(f"sample {key!r}: {'; '.join(problems)}")
    return header


def stored_size(header: SampleHeader) -> int:
    """L*(T - n)*H*itemsize(dtype): the decoded size of the states the header's own payload holds
    (n = 0 unless it refers to other samples for its prefix)."""
    return (len(header.layers) * (header.num_tokens - header.num_prefix) * header.hidden_size
            * DTYPES[header.dtype].itemsize)


def stored_bytes(header: SampleHeader, key: str | None = None) -> tuple[int, int]:
    """(the states' decoded size, the most bytes their encoding may take) by the header alone,
    checked to be consistent before anything is read or allocated (errors name `key`, by default
    the header's id)."""
    key = header.id if key is None else key
    dtype = DTYPES.get(header.dtype)
    if (dtype is None or header.num_tokens < 0 or header.hidden_size <= 0
            or len(header.input_ids) != 4 * header.num_tokens):
        raise CorecapError(
            f"sample {key!r}: inconsistent header (dtype {header.dtype!r}, {header.num_tokens} tokens, "
            f"hidden size {header.hidden_size}, {len(header.input_ids)} id bytes)"
        )
    problems = prefix_problems(key, header)
    if problems:
        raise CorecapError(f"sample {key!r}: {problems[0]}")
    expected = stored_size(header)
    if header.payload_bytes != expected:
        raise CorecapError(f"sample {key!r}: header says {header.payload_bytes} state bytes, expected {expected}")
    if header.codec == FP8:
        rows = len(header.layers) * (header.num_tokens - header.num_prefix)
        return expected, rows * header.hidden_size + 4 * rows
    if header.codec not in codecs.CODECS:
        raise CorecapError(f"sample {key!r}: codec {header.codec!r} is not known to this corecap")
    return expected, codecs.max_encoded_bytes(expected, dtype.itemsize, header.codec)


def check_stored(key: str, header: SampleHeader, payload) -> None:
    """The stored states' integrity without decoding them (what `merge` copies as they are):
    their size, and the crc32 that covers them (raw and fp8: the header's checksum; zstd-planes:
    its container's, which covers every byte after the container's head, whose fields are
    checked against the header)."""
    expected, most = stored_bytes(header, key)
    stored = memoryview(payload).cast("B")
    if header.codec == "zstd-planes":
        try:
            codecs.check_planes(stored, header.dtype, expected)
        except codecs.CodecError as e:
            raise CorecapError(f"sample {key!r}: {e}") from None
        return
    if stored.nbytes != most:  # raw: the states themselves; fp8: values and row scales
        raise CorecapError(f"sample {key!r}: payload is {stored.nbytes} bytes, expected {most}")
    if codecs.crc32(stored) != header.checksum:
        raise CorecapError(f"sample {key!r}: checksum mismatch (stored data is corrupt)")
