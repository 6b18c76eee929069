"""What a store holds, record by record: its metadata, each sample's header, and the encoding
of a sample into (header bytes, states parts); the records decoded. docs/store.md has literal
examples.

Everything is checked as it is read: a store is input like any other, and a record that does not
fit its declared shape is a CorecapError naming the sample and the field (the checks of a header
and of its states: corecap/store/checks.py; the states decoded: corecap/store/decode.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from corecap.dtypes import DTYPES
from corecap.errors import CorecapError
from corecap.config import FP8_CODEC, PRENORM, Layer
from corecap.store import codec as codecs, fp8, fp8rows
from corecap.store.generated import Generation
from corecap.store.media import Media, with_images
from corecap.store.record import Record

FORMAT_VERSION = 3  # 3: a layer may be "prenorm"; 2: integer layers only (still read and resumed)
REFERENCE_VERSION = 4  # 4: samples may refer to others for their prefix; a store becomes 4 with its first such sample
READABLE_VERSIONS = (2, 3, 4)
MAX_KEY_BYTES = 511  # LMDB's default key size limit
LAYER_MEANING = (
    "index k is HF transformers' output_hidden_states[k]: 0 = token embeddings, "
    "k = output of decoder layer k (residual stream), N = output of the final norm; "
    "prenorm = the residual stream after the last decoder layer, before the final norm "
    "(vLLM's aux index N, speculators' verifier state)"
)
FP8 = FP8_CODEC  # opt-in lossy storage (`--store-dtype fp8`): see corecap/store/fp8.py
KNOWN_CODECS = (*codecs.CODECS, FP8)


class ModelIdentity(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    architecture: str
    config_hash: str  # blake2b of the canonical config.json
    weights_fingerprint: str  # see corecap.model.weights_fingerprint
    num_layers: int
    hidden_size: int
    vocab_size: int
    # The checkpoint's quantization as its config.json declares it (corecap.model.quantization);
    # None: unquantized, or a store written before corecap recorded it (format 3 all the same).
    quantization: str | None = None


class StoreMeta(msgspec.Struct, frozen=True, kw_only=True):
    format_version: int
    model: ModelIdentity
    layers: tuple[Layer, ...]
    layer_meaning: str
    dtype: str
    hidden_size: int
    corecap_version: str
    vllm_version: str
    codec: str = "raw"

    def check_compatible(self, other: "StoreMeta", path: str) -> None:
        """Raise naming the first field where a resumed run disagrees with the store."""
        for name in ("layers", "dtype", "hidden_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise CorecapError(f"{path}: store has {name}={theirs!r}, this run has {mine!r}")
        if not codecs_may_mix(self.codec, other.codec):
            raise CorecapError(f"{path}: store has codec={other.codec!r}, this run has {self.codec!r} "
                               "(lossy and exact states must not mix)")
        for name in ("config_hash", "weights_fingerprint"):
            mine, theirs = getattr(self.model, name), getattr(other.model, name)
            if mine != theirs:
                raise CorecapError(
                    f"{path}: store was made by another model ({name} {theirs}, this run {mine})"
                )


def codecs_may_mix(a: str, b: str) -> bool:
    """Each sample records its own codec, so lossless codecs may mix in a store; lossy (fp8) and
    exact states may not."""
    return (a == FP8) == (b == FP8)


def decode_meta(raw, path: str) -> StoreMeta:
    """The store's metadata from its JSON, every field checked; a version this corecap does not
    read is refused."""
    try:
        version = msgspec.json.decode(raw).get("format_version")
    except (msgspec.DecodeError, AttributeError, RecursionError):
        raise CorecapError(f"{path}: the store's metadata (meta database, key 'store') is not a JSON object") from None
    if version not in READABLE_VERSIONS or not isinstance(version, int):
        raise CorecapError(f"{path}: store format version {version!r}, this corecap reads {list(READABLE_VERSIONS)}")
    try:
        meta = msgspec.json.decode(raw, type=StoreMeta)
    except (msgspec.DecodeError, RecursionError) as e:
        raise CorecapError(f"{path}: the store's metadata is damaged ({e})") from None
    bad_layers = [x for x in meta.layers if not (x == PRENORM or isinstance(x, int) and x >= 0)]
    if bad_layers or not meta.layers or len(set(meta.layers)) != len(meta.layers):
        raise CorecapError(f"{path}: the store's metadata is damaged (layers {list(meta.layers)}: "
                           f"expected distinct indices >= 0 or {PRENORM!r})")
    if meta.hidden_size <= 0 or meta.dtype not in DTYPES or meta.codec not in KNOWN_CODECS:
        raise CorecapError(f"{path}: the store's metadata is damaged "
                           f"(hidden_size {meta.hidden_size}, dtype {meta.dtype!r}, codec {meta.codec!r}: "
                           f"expected hidden_size > 0, dtype one of {list(DTYPES)}, codec one of {list(KNOWN_CODECS)})")
    return meta


class Segment(msgspec.Struct, array_like=True, frozen=True):
    """Positions [start, end) of a sample are positions [start, end) of sample `key`, which stores
    them in its own payload (never by a reference of its own: readers never recurse)."""

    key: str
    start: int
    end: int


class SampleHeader(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    id: str
    num_tokens: int
    layers: tuple[Layer, ...]
    dtype: str
    hidden_size: int
    input_fingerprint: str
    input_ids: bytes  # int32 little-endian [T]
    codec: str
    checksum: int  # crc32 of the raw states bytes (lossless codecs) or of the stored payload (fp8)
    payload_bytes: int  # size of the states as readers get them, L*T*H*itemsize(dtype)
    loss_mask: bytes | None = None  # uint8 [T]: 1 where a token is trained on (assistant turns)
    nonfinite: bool = False  # stored under `--nonfinite store` although it holds NaN/Inf
    # crc32 of this header's msgpack with header_crc nil: the one check covering the loss mask
    # and the flags (ids have the fingerprint, states the checksum). None: written before it.
    header_crc: int | None = None
    # Format 4 ("stored once"): positions [0, n) come from other samples' own payloads, segment by
    # segment, and this sample's payload holds positions [n, T) only (checksum and payload_bytes
    # are the payload's). None: the payload holds every position.
    prefix: tuple[Segment, ...] | None = None
    generation: Generation | None = None  # the model wrote the sample's response (corecap run --max-tokens)
    media: Media | None = None  # the sample's images: their token spans, hashes and references (store/media.py)

    @property
    def num_prefix(self) -> int:  # n: the leading positions that other samples store
        return self.prefix[-1].end if self.prefix else 0


@dataclass(frozen=True)
class Sample:
    header: SampleHeader
    input_ids: np.ndarray  # int32 [T]
    hidden_states: torch.Tensor  # [L, T, H]

    @property
    def loss_mask(self) -> np.ndarray | None:
        m = self.header.loss_mask
        return None if m is None else np.frombuffer(m, dtype=np.uint8).copy()


def input_fingerprint(token_ids: np.ndarray) -> str:
    return hashlib.blake2b(np.asarray(token_ids, dtype="<i4").tobytes(), digest_size=16).hexdigest()


def prompt_fingerprint(header: SampleHeader) -> str:
    """The fingerprint of what the sample's input was: its prompt where the model wrote the rest,
    and its images' bytes."""
    if header.generation is None:
        return with_images(header.input_fingerprint, header.media)
    return with_images(input_fingerprint(np.frombuffer(header.input_ids, "<i4")[: header.generation.num_prompt]),
                       header.media)


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(SampleHeader)


def encode_sample(
    key: str,
    token_ids: np.ndarray,
    states: torch.Tensor,
    layers: tuple[Layer, ...],
    codec: str = "raw",
    loss_mask: np.ndarray | None = None,
    nonfinite: bool = False,
    prefix: tuple[Segment, ...] | None = None,
    dtype: str | None = None,
    generation: Generation | None = None,
    media: Media | None = None,
) -> Record:
    """Encode one sample for the store (the expensive part, compression, runs here: call it off
    the critical path). `codec` is one of `CODECS` or `FP8`. With `prefix` (segments covering
    [0, n)), `states` may be the whole sample [L, T, H] or its own part [L, T - n, H]; only
    positions [n, T) are encoded. FP8 also takes the workers' rows (fp8rows.py) of `dtype` states."""
    ids = np.ascontiguousarray(token_ids, dtype="<i4")
    n = prefix[-1].end if prefix else 0
    states = (states[:, n:] if n and states.shape[1] == len(ids) else states).contiguous()
    rows = states.dtype == torch.uint8
    assert not rows or (codec == FP8 and dtype in DTYPES), (codec, dtype)
    dtype = dtype if rows else str(states.dtype).removeprefix("torch.")
    raw = states.view(torch.uint8).numpy() if states.numel() else np.empty(0, np.uint8)
    if codec == FP8:
        parts = (fp8rows.fp8_payload(states) if rows else fp8.quantize_fp8(states),)
        checksum = codecs.crc32(parts[0])
    elif codec not in codecs.CODECS:
        raise CorecapError(f"codec {codec!r}: expected one of {list(codecs.CODECS) + [FP8]}")
    else:
        checksum = codecs.crc32(raw)
        parts = tuple(codecs.encode_parts(raw, dtype, codec))
    header = _sample_header(
        key, ids, layers, dtype, fp8rows.hidden_size(states) if rows else states.shape[-1], codec, checksum,
        fp8rows.captured_nbytes(states, dtype) if rows else raw.nbytes, loss_mask, nonfinite, prefix, generation,
        media,
    )
    return Record(key, header, parts, n)


def _sample_header(
    key: str, ids: np.ndarray, layers, dtype: str, hidden_size: int, codec: str, checksum: int, payload_bytes: int,
    loss_mask: np.ndarray | None, nonfinite: bool, prefix=None, generation: Generation | None = None,
    media: Media | None = None,
) -> bytes:
    """A sample's encoded header, its header_crc set (`encode_sample`'s and `spilled_record`'s)."""
    if loss_mask is not None and len(loss_mask) != len(ids):
        raise CorecapError(f"sample {key!r}: loss mask has {len(loss_mask)} entries for {len(ids)} tokens")
    header = SampleHeader(
        id=key,
        num_tokens=len(ids),
        layers=tuple(layers),
        dtype=dtype,
        hidden_size=hidden_size,
        input_fingerprint=input_fingerprint(ids),
        input_ids=ids.tobytes(),
        codec=codec,
        checksum=checksum,
        payload_bytes=payload_bytes,
        loss_mask=None if loss_mask is None else np.asarray(loss_mask, dtype=np.uint8).tobytes(),
        nonfinite=nonfinite,
        prefix=tuple(prefix) if prefix else None,
        generation=generation,
        media=media,
    )
    return _header_encoder.encode(msgspec.structs.replace(header, header_crc=header_crc(header)))


def spilled_record(
    key: str, token_ids: np.ndarray, layers: tuple[Layer, ...], dtype: str, hidden_size: int, checksum: int,
    spilled, loss_mask: np.ndarray | None = None, nonfinite: bool = False, codec: str = "raw",
    payload_bytes: int = 0, media: Media | None = None,
) -> Record:
    """The record of a long sample whose payload is the file `spilled` (spill.Spilled,
    checksummed as it was read back): raw `[L, T, H]` states, or `FP8`'s payload, whose decoded
    size is `payload_bytes`. Its header is `encode_sample`'s for that codec, so every reader
    reads it as any other sample."""
    ids = np.ascontiguousarray(token_ids, dtype="<i4")
    header = _sample_header(key, ids, layers, dtype, hidden_size, codec, checksum, payload_bytes or spilled.nbytes,
                            loss_mask, nonfinite, media=media)
    return Record(key, header, (), 0, spilled)


def encode_header(header: SampleHeader) -> bytes:
    """A header's bytes with its header_crc recomputed (merge rewrites a reference's segments)."""
    return _header_encoder.encode(msgspec.structs.replace(header, header_crc=header_crc(header)))


def header_crc(header: SampleHeader) -> int:
    """crc32 of the header's msgpack with `header_crc` nil: over its values (msgspec encodes
    equal values to equal bytes), whatever encoding the stored bytes used."""
    return codecs.crc32(_header_encoder.encode(msgspec.structs.replace(header, header_crc=None)))


def decode_header(key: str, value) -> SampleHeader:
    try:
        return _header_decoder.decode(value)
    except msgspec.DecodeError as e:  # ValidationError included: a field of the wrong type
        raise CorecapError(f"sample {key!r}: unreadable header ({e})") from None
