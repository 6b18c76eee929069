"""Lossless codecs for stored hidden states: raw bytes and byte-plane zstd (lossy fp8 is
corecap/store/fp8.py's).

Lossless (`encode` / `decode`, bit-exact, NaN/Inf payloads included; `encode_parts` is `encode`
without the final join):
  "raw"          the tensor's little-endian bytes, unchanged.
  "zstd-planes"  the bytes of each element are split into planes (byte k of every element,
                 k = 0 .. itemsize-1), and each plane is zstd-compressed on its own. The plane
                 holding sign and exponent is low-entropy (about 3 bits per byte on real bf16
                 activations) while mantissa planes are noise; mixing them, as plain zstd does,
                 hides the structure. zstd runs with a small hash table and min-match 7, which
                 makes it almost pure Huffman: faster than level 1 and smaller on this data
                 (numbers and method in docs/codec.md). Planes that do not compress are stored
                 as they are.

"zstd-planes" buffer layout, little-endian (version 1):
  b"CZP1"  itemsize:u8  num_planes:u8  0:u16  nbytes:u64  crc32:u32
  num_planes x (method:u8, size:u64)      method 0 = stored, 1 = zstd frame
  the planes' payloads, in order (byte 0 of each element first)
crc32 covers everything after itself, so any damage to the buffer is a CodecError rather than
wrong states. `decode` needs the original size (`nbytes`) from the caller too, and checks it
against the buffer's own.

Thread safety: all functions may be called from several threads at once. zstd contexts are not
thread-safe, so each thread keeps its own compressor and decompressors (threading.local);
zstandard, crc32 and the numpy plane copies release the GIL, so a thread pool over samples
scales with free cores (measured: docs/codec.md; docs/benchmarks.md, "Figures the code cites").
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from corecap.dtypes import ITEMSIZE, crc32

CODECS = ("raw", "zstd-planes")  # the default is corecap.config.DEFAULT_CODEC

_MAGIC = b"CZP1"
_HEAD = struct.Struct("<4sBBHQI")  # magic, itemsize, num_planes, reserved, nbytes, crc32
_PLANE = struct.Struct("<BQ")  # method, stored size
_STORED, _ZSTD = 0, 1
# Mostly-Huffman zstd: exponent planes have few long repeats, so a tiny match finder saves time
# and, with fewer poor short matches, also a little size (docs/codec.md, "zstd parameters").
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7
)
# A large plane is first tried on one probe slice: mantissa planes are noise, and not running
# zstd over them saves a share of the encode time on bf16 (measured: docs/codec.md, and the table
# "Figures the code cites" in docs/benchmarks.md).
_PROBE_BYTES = 1 << 17
_PROBE_MIN_SAVING = 0.03
# decode_into joins planes this many values at a time: small enough that the decompressed slices
# stay in L2, large enough to keep per-slice overhead small (a range of sizes measured alike:
# docs/benchmarks.md, "Figures the code cites").
_JOIN_BYTES = 1 << 17

_local = threading.local()


class CodecError(ValueError):
    """A buffer that does not decode to what the caller declared (corrupt, truncated, mismatched)."""


def _compressor() -> zstandard.ZstdCompressor:
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS)
    return cctx


def _check_args(dtype: str, codec: str) -> int:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}, expected one of {list(CODECS)}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"codec {codec!r}: unknown dtype {dtype!r}, expected one of {sorted(ITEMSIZE)}")
    return ITEMSIZE[dtype]


def _declared(nbytes: int, dtype: str, codec: str) -> int:
    """The itemsize of `dtype`, once `nbytes` is found to be a size of whole values of it."""
    itemsize = _check_args(dtype, codec)
    if nbytes < 0 or nbytes % itemsize:
        raise CodecError(f"codec {codec!r}: declared size {nbytes} is not a whole number of {dtype} values")
    return itemsize


def _as_uint8(raw) -> np.ndarray:
    if isinstance(raw, np.ndarray):
        return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    return np.frombuffer(raw, dtype=np.uint8)


def encode(raw, dtype: str, codec: str) -> bytes:
    """Encode a tensor's little-endian bytes (`raw`: bytes, memoryview or uint8 array)."""
    return b"".join(encode_parts(raw, dtype, codec))


def encode_parts(raw, dtype: str, codec: str) -> list:
    """`encode` as a list of buffers whose concatenation is the encoded bytes.

    For a caller that can write a list of buffers (saving the join's copy of the compressed
    bytes); with "raw" the only part is `raw` itself, uncopied.
    """
    itemsize = _check_args(dtype, codec)
    data = _as_uint8(raw)
    if data.nbytes % itemsize:
        raise ValueError(f"codec {codec!r}: {data.nbytes} bytes is not a whole number of {dtype} values")
    if codec == "raw":
        return [data]
    planes = _split_planes(data, itemsize)
    table, payloads = [], []
    for plane in planes:
        method, payload = _compress_plane(plane)
        table.append(_PLANE.pack(method, len(payload)))
        payloads.append(payload)
    crc = 0
    for part in (*table, *payloads):
        crc = crc32(part, crc)
    return [_HEAD.pack(_MAGIC, itemsize, itemsize, 0, data.nbytes, crc), *table, *payloads]


def _split_planes(data: np.ndarray, itemsize: int) -> np.ndarray:
    """[itemsize, n]: row k is byte k of every (little-endian) element. For 2-byte elements, a
    narrowing cast and a shift of the elements as words, faster than the strided copy of a
    transpose, which stays for 4-byte elements, where the shifts were slower (measured:
    docs/benchmarks.md, "Figures the code cites")."""
    if itemsize != 2:
        return np.ascontiguousarray(data.reshape(-1, itemsize).T)
    words = data.view("<u2")
    planes = np.empty((2, words.size), np.uint8)
    np.copyto(planes[0], words, casting="unsafe")  # keeps the low byte
    np.right_shift(words, 8, out=planes[1], casting="unsafe")
    return planes


def _compress_plane(plane: np.ndarray) -> tuple[int, bytes | np.ndarray]:
    cctx = _compressor()
    if plane.nbytes > 4 * _PROBE_BYTES:
        start = (plane.nbytes // 2) & ~(_PROBE_BYTES - 1)
        probe = len(cctx.compress(plane[start : start + _PROBE_BYTES]))
        if probe > (1 - _PROBE_MIN_SAVING) * _PROBE_BYTES:
            return _STORED, plane
    frame = cctx.compress(plane)
    if len(frame) >= plane.nbytes:
        return _STORED, plane
    return _ZSTD, frame


def max_encoded_bytes(nbytes: int, itemsize: int, codec: str) -> int:
    """The most bytes `encode` can make of `nbytes`: a plane that does not shrink is stored, so
    "zstd-planes" adds only its header and plane table. A reader bounds what it reads by this."""
    if codec == "raw":
        return nbytes
    return _HEAD.size + itemsize * _PLANE.size + nbytes


def decode(buf, dtype: str, nbytes: int, codec: str):
    """Inverse of `encode`: a writable buffer of exactly `nbytes` (the original size): a
    bytearray (raw) or a flat uint8 numpy array (zstd-planes)."""
    _declared(nbytes, dtype, codec)
    if codec == "raw":
        return bytearray(_raw(buf, nbytes))
    out = np.empty(nbytes, dtype=np.uint8)  # not zero-filled: decode_into writes every byte
    decode_into(buf, dtype, nbytes, codec, out)
    return out


def decode_into(buf, dtype: str, nbytes: int, codec: str, out: np.ndarray) -> int:
    """`decode` into `out` (a writable uint8 array of `nbytes`), returning the crc32 of the
    decoded bytes. zstd-planes planes are decompressed and joined a slice at a time, so the
    decompressed slices stay in cache and `out` is written once: into memory already touched,
    faster than a `decode` into fresh memory and its crc32 (measured: docs/benchmarks.md,
    "Export")."""
    itemsize = _declared(nbytes, dtype, codec)
    if out.dtype != np.uint8 or out.nbytes != nbytes or not out.flags.c_contiguous:
        raise ValueError(f"codec {codec!r}: out must be {nbytes} contiguous uint8 bytes, got {out.dtype} {out.shape}")
    if codec == "raw":
        out[:] = np.frombuffer(_raw(buf, nbytes), dtype=np.uint8)
        return crc32(out)
    mv = memoryview(buf).cast("B")
    planes = check_planes(mv, dtype, nbytes)
    plane_bytes = nbytes // itemsize
    slices = [_slices(payload, method, k, plane_bytes, f"(buffer of {mv.nbytes} bytes, expected {nbytes} decoded)")
              for k, (method, payload) in enumerate(planes)]
    columns, crc = out.reshape(-1, itemsize), 0
    for start, part in zip(range(0, plane_bytes, _JOIN_BYTES), zip(*slices)):
        rows = columns[start : start + len(part[0])]
        if itemsize == 2:  # word shifts: faster than a strided byte copy per plane (see _split_planes)
            words = rows.view("<u2").reshape(-1)
            np.left_shift(part[1], 8, out=words, dtype=np.uint16)
            np.bitwise_or(words, part[0], out=words)
        else:
            for k, plane in enumerate(part):
                rows[:, k] = plane
        crc = crc32(rows, crc)
    for s in slices:  # each zstd frame's end: its epilogue read and checked, nothing after it
        next(s, None)
    return crc


def _raw(buf, nbytes: int) -> memoryview:
    mv = memoryview(buf).cast("B")
    if mv.nbytes != nbytes:
        raise CodecError(f"codec 'raw': buffer is {mv.nbytes} bytes, expected {nbytes}")
    return mv


def check_planes(buf, dtype: str, nbytes: int) -> list[tuple[int, memoryview]]:
    """A "zstd-planes" buffer's container checked without decompressing it: magic, itemsize,
    the declared size against `nbytes`, the crc32 over everything after the head, every plane's
    size (a stored plane holds exactly its bytes, a zstd frame declares exactly them) and no byte
    left over. Returns (method, payload) per plane. Decoding allocates only after this, so a
    damaged or crafted buffer cannot make it allocate more than `nbytes` (plus one plane)."""
    itemsize = _check_args(dtype, "zstd-planes")
    mv = memoryview(buf).cast("B")

    def fail(what: str) -> CodecError:
        return CodecError(f"codec 'zstd-planes': {what} (buffer of {mv.nbytes} bytes, expected {nbytes} decoded)")

    if nbytes < 0 or nbytes % itemsize:
        raise fail(f"declared size {nbytes} is not a whole number of {dtype} values")
    table_end = _HEAD.size + itemsize * _PLANE.size
    if mv.nbytes < table_end:
        raise fail(f"truncated header (needs {table_end} bytes)")
    magic, size, num_planes, reserved, declared, crc = _HEAD.unpack_from(mv)
    if magic != _MAGIC or reserved:
        raise fail(f"bad magic {bytes(magic)!r} or reserved field {reserved}, expected {_MAGIC!r} and 0")
    if (size, num_planes) != (itemsize, itemsize):
        raise fail(f"{num_planes} planes of itemsize {size}, expected {itemsize}")
    if declared != nbytes:
        raise fail(f"buffer holds {declared} bytes")
    if crc32(mv[_HEAD.size :]) != crc:
        raise fail("checksum mismatch (corrupt data)")
    plane_bytes = nbytes // itemsize
    planes, offset = [], table_end
    for k in range(itemsize):
        method, stored = _PLANE.unpack_from(mv, _HEAD.size + k * _PLANE.size)
        if stored > mv.nbytes - offset:
            raise fail(f"plane {k} truncated: {mv.nbytes - offset} of {stored} bytes")
        payload = mv[offset : offset + stored]
        offset += stored
        if method == _STORED:
            size = stored
        elif method == _ZSTD:
            try:
                size = zstandard.frame_content_size(payload)  # -1 when the frame does not say
            except zstandard.ZstdError as e:
                raise fail(f"plane {k}: {e}") from None
        else:
            raise fail(f"plane {k} has unknown method {method}")
        if size != plane_bytes:  # checked before decompressing: no decompression bombs
            raise fail(f"plane {k} {'is' if method == _STORED else 'declares'} {size} bytes, expected {plane_bytes}")
        planes.append((method, payload))
    if offset != mv.nbytes:
        raise fail(f"{mv.nbytes - offset} trailing bytes")
    return planes


def _slices(payload: memoryview, method: int, k: int, plane_bytes: int, where: str):
    """Plane k in consecutive slices of _JOIN_BYTES (the last shorter); a zstd frame (declaring
    `plane_bytes`: `check_planes`) decompressed into one buffer of this thread's for plane k."""
    if method == _STORED:
        yield from (np.frombuffer(payload[i : i + _JOIN_BYTES], dtype=np.uint8)
                    for i in range(0, plane_bytes, _JOIN_BYTES))
        return
    buf, dctx = getattr(_local, f"plane{k}", (None, None))
    if buf is None:  # a decompressor per plane: one runs one stream at a time
        buf, dctx = np.empty(_JOIN_BYTES, np.uint8), zstandard.ZstdDecompressor()
        setattr(_local, f"plane{k}", (buf, dctx))
    reader = dctx.stream_reader(payload, read_size=_JOIN_BYTES)
    try:
        for start in range(0, plane_bytes, _JOIN_BYTES):
            view, done = memoryview(buf)[: min(_JOIN_BYTES, plane_bytes - start)], 0
            while done < view.nbytes:
                got = reader.readinto(view[done:])
                if not got:
                    raise CodecError(f"codec 'zstd-planes': plane {k}: frame ends at byte {start + done} "
                                     f"of {plane_bytes} {where}")
                done += got
            yield buf[:done]
        if reader.readinto(memoryview(buf)[:1]):
            raise CodecError(f"codec 'zstd-planes': plane {k}: frame holds more than its declared "
                             f"{plane_bytes} bytes {where}")
    except zstandard.ZstdError as e:
        raise CodecError(f"codec 'zstd-planes': plane {k}: {e} {where}") from None
