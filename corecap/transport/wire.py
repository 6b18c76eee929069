"""The worker → sink wire format: one ZeroMQ multipart message per engine step.

Frame 0 is a msgpack-encoded `Chunk` header (versioned, no pickle) followed by its own CRC-32
(4 bytes, little-endian); frames 1..3 are raw,
zero-copy tensor bytes: token ids (int32 [T]), positions (int32 [T]) and the captured hidden
states ([L, T, H] in `dtype`, little-endian; bf16 travels as its raw two bytes; with `fp8`,
uint8 [L, T, H + 4] rows quantised by the worker, corecap/store/fp8rows.py). When the header
names a `ring` slot (corecap/transport/ring.py), frame 3 is empty and the states are in that
shared-memory slot instead. `segments` say which request owns which run of the T tokens, in
order. A worker that fails sends a `WorkerError` instead, so that the sink can name it.

The decoder trusts nothing: a wrong version, frame count, or size for the declared shape is a
`WireError`, never a stored sample. The header's own CRC and its `crcs` (which the worker
computes once the states are on the host) cover the token ids, the positions and each (layer,
segment) run of the states (of each layer, for a chunk of many segments: `crc_per_layer`), so a
flipped byte anywhere is caught: the header, ids and positions in `decode`, the states runs where
they are copied into their samples (corecap/sink/collect.py, on several threads) or, when asked
(`check_states`), in `decode` too.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import msgspec
import numpy as np
import torch

from corecap.config import Layer
from corecap.dtypes import DTYPE_NAMES, DTYPES, FP8_ROW_EXTRA, crc32

WIRE_VERSION = 5  # 3: CRC-32s of every part; a layer may be "prenorm". 4: fp8 rows. 5: a CRC a layer for many segments

# A chunk of this many segments or more (a decode step: a token for each of many requests) has one
# CRC-32 a layer, over all its rows, instead of one a (layer, segment) run: thousands of small
# checks a step were most of both ends' cost per request (docs/benchmarks.md,
# "Generation"). Fewer segments (prefill chunks) keep one a run, so that a
# damaged run names its request.
PER_LAYER_SEGMENTS = 8

_IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux

__all__ = ["DTYPE_NAMES", "DTYPES"]  # re-exported for the workers


def private_ipc_dir(prefix: str, longest_name: int = 40) -> str:
    """A new 0700 directory for IPC sockets, in the temp dir, or in /tmp where the temp dir's
    path is too long for a socket path (`longest_name`: the longest file name to go in it)."""
    base = tempfile.gettempdir()
    if len(base) + len(prefix) + 10 + longest_name > _IPC_PATH_MAX and os.path.isdir("/tmp"):
        base = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


class WireError(ValueError):
    """A message that does not match the wire format."""


class Segment(msgspec.Struct, array_like=True, frozen=True, gc=False):
    req_id: str
    num_tokens: int


class Chunk(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=1, kw_only=True):
    version: int
    rank: int
    step: int
    dtype: str
    layers: tuple[Layer, ...]
    hidden_size: int
    num_tokens: int
    segments: tuple[Segment, ...]
    # Worker-side timings (seconds, time.time() clock) for the trace: copy start/end, send.
    t_copy: float = 0.0
    t_ready: float = 0.0
    # Where the states are when not in frame 3: a slot of a shared-memory ring.
    ring: str = ""
    slot: int = -1
    slot_bytes: int = 0
    # CRC-32 of the ids frame, of the positions frame, then of each states run in the order of
    # `state_runs` (layer-major, then segment), or of each layer's rows (`crc_per_layer`).
    crcs: tuple[int, ...] = ()
    # The states are fp8 rows (uint8 [L, T, H + 4]) of states captured in `dtype`.
    fp8: bool = False


class WorkerError(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=2):
    version: int
    rank: int
    pid: int
    message: str


Message = Chunk | WorkerError
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_chunk(header: Chunk, token_ids, positions, states) -> list:
    """Frames for one step. Tensors must be contiguous CPU buffers; they are not copied."""
    return [encode_header(header), _as_buffer(token_ids), _as_buffer(positions), _as_buffer(states)]


def encode_error(error: WorkerError) -> list:
    return [encode_header(error)]


def encode_header(message) -> bytes:
    raw = _encoder.encode(message)
    return raw + crc32(raw).to_bytes(4, "little")


def _unsealed(frame) -> memoryview:
    view = memoryview(frame).cast("B")
    if view.nbytes < 4 or crc32(view[:-4]) != int.from_bytes(view[-4:], "little"):
        raise WireError("the header arrived damaged: CRC-32 mismatch")
    return view[:-4]


def _as_buffer(t):
    if isinstance(t, np.ndarray) and t.flags.c_contiguous:
        return t
    if isinstance(t, torch.Tensor):
        assert t.is_contiguous() and t.device.type == "cpu"
        return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
    return memoryview(np.ascontiguousarray(t)).cast("B")


def crc_per_layer(num_segments: int) -> bool:
    """Whether a chunk of `num_segments` segments has one states CRC a layer (else one a run)."""
    return num_segments >= PER_LAYER_SEGMENTS


def state_runs(segments, num_layers: int, num_tokens: int):
    """(layer index, segment index, first row, end row) of each checksummed run of a [L, T, H]
    chunk, rows counted over its flattened [L * T] axis: the order of `Chunk.crcs[2:]`. With
    `crc_per_layer`, a run is a whole layer and its segment index -1."""
    if crc_per_layer(len(segments)):
        for i in range(num_layers):
            yield i, -1, i * num_tokens, (i + 1) * num_tokens
        return
    for i in range(num_layers):
        row = i * num_tokens
        for j, seg in enumerate(segments):
            yield i, j, row, row + seg.num_tokens
            row += seg.num_tokens


def checksums(segments, token_ids, positions, states: torch.Tensor) -> tuple[int, ...]:
    """`Chunk.crcs` of host tensors (states [L, T, H])."""
    raw = _as_buffer(states)
    row_bytes = states.shape[-1] * states.element_size()
    crcs = [crc32(_as_buffer(token_ids)), crc32(_as_buffer(positions))]
    for _, _, lo, hi in state_runs(segments, states.shape[0], states.shape[1]):
        crcs.append(crc32(raw[lo * row_bytes : hi * row_bytes]))
    return tuple(crcs)


class DecodedChunk(msgspec.Struct, frozen=True):
    header: Chunk
    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    states: torch.Tensor  # [L, T, H], header.dtype; fp8: uint8 [L, T, H + 4] rows

    def check_run(self, i: int, j: int, run) -> None:
        """Raise WireError unless `run` (states of layer i, segment j, as received: a contiguous
        view of `states`, or of `state_rows()`) has the CRC the worker sent. With
        `crc_per_layer`, j is -1 and the run is the layer's every row."""
        h = self.header
        per_layer = j < 0
        if crc32(_as_buffer(run)) != h.crcs[2 + (i if per_layer else i * len(h.segments) + j)]:
            whose = f"{len(h.segments)} requests" if per_layer else f"request {h.segments[j].req_id!r}"
            raise WireError(f"states of {whose} (layer {h.layers[i]}, step {h.step}) arrived damaged: CRC-32 mismatch")

    def state_rows(self) -> np.ndarray:
        """The states as bytes, uint8 [L, T, bytes a row]: a decode step's many one-token runs are
        checked and copied through numpy, without a torch operation's cost for each."""
        s = self.states
        return s.view(torch.uint8).numpy().reshape(s.shape[0], s.shape[1], -1)


def decode(frames: list, ring=None, check_states: bool = False) -> DecodedChunk | WorkerError:
    """Check and rebuild one message; raises WireError on anything malformed. `ring`: the
    sink's `ring.RingReader`, for states sent in a shared-memory slot."""
    if not frames:
        raise WireError("empty message")
    try:
        msg = _decoder.decode(_unsealed(frames[0]))
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"bad header: {e}") from None
    if msg.version != WIRE_VERSION:
        raise WireError(f"wire version {msg.version}, expected {WIRE_VERSION}")
    if isinstance(msg, WorkerError):
        if len(frames) != 1:
            raise WireError(f"worker error with {len(frames)} frames, expected 1")
        return msg
    if len(frames) != 4:
        raise WireError(f"chunk with {len(frames)} frames, expected 4")
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"dtype {msg.dtype!r}, expected one of {sorted(DTYPES)}")
    num_tokens, num_layers, hidden = msg.num_tokens, len(msg.layers), msg.hidden_size
    if num_tokens < 0 or hidden <= 0 or num_layers == 0:
        raise WireError(f"bad shape: tokens={num_tokens} layers={num_layers} hidden={hidden}")
    if sum(s.num_tokens for s in msg.segments) != num_tokens or any(s.num_tokens <= 0 for s in msg.segments):
        raise WireError(f"segments {[s.num_tokens for s in msg.segments]} do not cover {num_tokens} tokens")
    num_runs = num_layers * (1 if crc_per_layer(len(msg.segments)) else len(msg.segments))
    if len(msg.crcs) != 2 + num_runs:
        raise WireError(f"{len(msg.crcs)} checksums, expected {2 + num_runs}")
    sizes = [memoryview(f).nbytes for f in frames[1:]]
    if msg.fp8:  # the rows' bytes, as uint8
        dtype, hidden = torch.uint8, hidden + FP8_ROW_EXTRA
    states_bytes = num_layers * num_tokens * hidden * dtype.itemsize
    expected = [4 * num_tokens, 4 * num_tokens, 0 if msg.ring else states_bytes]
    if sizes != expected:
        raise WireError(f"frame sizes {sizes}, expected {expected} for the declared shape and dtype")
    if (crc32(frames[1]), crc32(frames[2])) != msg.crcs[:2]:
        raise WireError("token ids or positions arrived damaged: CRC-32 mismatch")
    token_ids = np.frombuffer(frames[1], dtype="<i4")
    positions = np.frombuffer(frames[2], dtype="<i4")
    buffer = frames[3]
    if msg.ring:
        if ring is None:
            raise WireError(f"states in ring {msg.ring!r}, but this receiver has no ring reader")
        try:
            buffer = ring.view(msg.ring, msg.slot, msg.slot_bytes, states_bytes)
        except ValueError as e:
            raise WireError(str(e)) from None
    if states_bytes:
        with warnings.catch_warnings():  # frames and ring slots are read-only; readers only read them
            warnings.simplefilter("ignore", UserWarning)
            states = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
    else:
        states = torch.empty(0, dtype=dtype)
    chunk = DecodedChunk(msg, token_ids, positions, states.view(num_layers, num_tokens, hidden))
    if check_states:
        flat = chunk.states.view(num_layers * num_tokens, hidden)
        for i, j, lo, hi in state_runs(msg.segments, num_layers, num_tokens):
            chunk.check_run(i, j, flat[lo:hi])
    return chunk
