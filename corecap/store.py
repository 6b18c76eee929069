"""The store: a directory with one LMDB environment (metadata, sample headers, pointers) and
append-only state files (the hidden states themselves; corecap/segments.py says why).

Named LMDB databases keep metadata outside the sample key space:
  meta     b"store" → JSON `StoreMeta` (format version, model identity, layers, dtype, ...)
           b"states_end" → the committed end of the state files (`segments.END`)
  headers  id (UTF-8, ≤ 511 bytes) → msgpack `SampleHeader` (input ids, codec, checksum, ...)
  samples  id → `segments.POINTER` to the sample's states [L, T, H] (stored dtype, encoded by
           its codec) in states-NNNNNN.bin; format 1 stores kept the states here inline.
The layout is documented with a literal example in docs/store.md. Readers check the format
version and refuse what they do not understand; format 1 stores stay readable and writable.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import lmdb
import msgspec
import numpy as np
import torch

from corecap import CorecapError
from corecap import codec as codecs
from corecap import segments
from corecap.wire import DTYPES

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: states inline in LMDB
MAX_KEY_BYTES = 511  # LMDB's default key size limit
LAYER_MEANING = (
    "index k is HF transformers' output_hidden_states[k]: 0 = token embeddings, "
    "k = output of decoder layer k (residual stream), N = output of the final norm"
)
_INITIAL_MAP_SIZE = 1 << 30
FP8 = "fp8-e4m3-rowscale"  # opt-in lossy storage (`--store-dtype fp8`): see corecap/codec.py


class ModelIdentity(msgspec.Struct, frozen=True):
    path: str
    architecture: str
    config_hash: str  # blake2b of the canonical config.json
    weights_fingerprint: str  # see corecap.model.weights_fingerprint
    num_layers: int
    hidden_size: int
    vocab_size: int


class StoreMeta(msgspec.Struct, frozen=True):
    format_version: int
    model: ModelIdentity
    layers: tuple[int, ...]
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
            raise CorecapError(f"{path}: store has codec={other.codec!r}, this run has {self.codec!r} (lossy and exact states must not mix)")
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


class SampleHeader(msgspec.Struct, array_like=True, frozen=True):
    id: str
    num_tokens: int
    layers: tuple[int, ...]
    dtype: str
    hidden_size: int
    input_fingerprint: str
    input_ids: bytes  # int32 little-endian [T]
    codec: str
    checksum: int  # crc32 of the raw states bytes (lossless codecs) or of the stored payload (fp8)
    payload_bytes: int  # size of the states as readers get them, L*T*H*itemsize(dtype)
    loss_mask: bytes | None = None  # uint8 [T]: 1 where a token is trained on (assistant turns)
    nonfinite: bool = False  # stored under `--nonfinite store` although it holds NaN/Inf


@dataclass(frozen=True)
class Record:
    """One sample ready to commit: its header and its encoded states as buffers whose
    concatenation is the payload (the codec's parts: writing them one after another saves joining
    them, a copy of the whole payload that took 10-15 ms of a 56-61 ms bf16 encode here;
    tools/bench_sink.py --only parts)."""

    key: str
    header: bytes
    parts: tuple  # buffers

    @property
    def payload(self):
        """The parts joined (one part: itself)."""
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(memoryview(p).nbytes for p in self.parts)


@dataclass(frozen=True)
class Appended:
    """Records whose states are written (not yet durable) and where: `Store.commit` them."""

    records: list[Record]
    pointers: list[bytes] | None  # None: a format 1 store, states go inline
    end: tuple[int, int] | None


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


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(SampleHeader)


def encode_sample(
    key: str,
    token_ids: np.ndarray,
    states: torch.Tensor,
    layers: tuple[int, ...],
    codec: str = "raw",
    loss_mask: np.ndarray | None = None,
    nonfinite: bool = False,
) -> Record:
    """Encode one sample for the store (the expensive part, compression, runs here: call it off
    the critical path). `codec` is one of `CODECS` or `FP8`."""
    ids = np.ascontiguousarray(token_ids, dtype="<i4")
    states = states.contiguous()
    dtype = str(states.dtype).removeprefix("torch.")
    raw = states.view(torch.uint8).numpy() if states.numel() else np.empty(0, np.uint8)
    if codec == FP8:
        payload = codecs.quantize_fp8(states)
        checksum = codecs.crc32(payload)
        parts = (payload,)
    else:
        if codec not in codecs.CODECS:
            raise CorecapError(f"codec {codec!r}: expected one of {list(codecs.CODECS) + [FP8]}")
        checksum = codecs.crc32(raw)
        parts = tuple(codecs.encode_parts(raw, dtype, codec))
    if loss_mask is not None and len(loss_mask) != len(ids):
        raise CorecapError(f"sample {key!r}: loss mask has {len(loss_mask)} entries for {len(ids)} tokens")
    header = SampleHeader(
        id=key,
        num_tokens=len(ids),
        layers=tuple(layers),
        dtype=dtype,
        hidden_size=states.shape[-1],
        input_fingerprint=input_fingerprint(ids),
        input_ids=ids.tobytes(),
        codec=codec,
        checksum=checksum,
        payload_bytes=raw.nbytes,
        loss_mask=None if loss_mask is None else np.asarray(loss_mask, dtype=np.uint8).tobytes(),
        nonfinite=nonfinite,
    )
    return Record(key, _header_encoder.encode(header), parts)


def decode_header(key: str, value) -> SampleHeader:
    try:
        return _header_decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorecapError(f"sample {key!r}: unreadable header ({e})") from None


def decode_sample(key: str, header_value, payload, num_layers: int) -> Sample:
    header = decode_header(key, header_value)
    dtype = DTYPES.get(header.dtype)
    if dtype is None or len(header.input_ids) != 4 * header.num_tokens:
        raise CorecapError(f"sample {key!r}: inconsistent header (dtype {header.dtype!r}, {len(header.input_ids)} id bytes)")
    shape = (num_layers, header.num_tokens, header.hidden_size)
    expected = shape[0] * shape[1] * shape[2] * dtype.itemsize
    if header.payload_bytes != expected:
        raise CorecapError(f"sample {key!r}: header says {header.payload_bytes} state bytes, expected {expected}")
    ids = np.frombuffer(header.input_ids, dtype="<i4").copy()
    if header.codec == FP8:
        stored = memoryview(payload)
        rows = shape[0] * shape[1]
        if stored.nbytes != rows * shape[2] + 4 * rows:
            raise CorecapError(f"sample {key!r}: fp8 payload is {stored.nbytes} bytes, expected {rows * (shape[2] + 4)}")
        if codecs.crc32(stored) != header.checksum:
            raise CorecapError(f"sample {key!r}: checksum mismatch (stored data is corrupt)")
        states = codecs.dequantize_fp8(stored, shape, dtype)
        return Sample(header, ids, states)
    if header.codec not in codecs.CODECS:
        raise CorecapError(f"sample {key!r}: codec {header.codec!r} is not known to this corecap")
    if header.codec == "raw":
        raw = bytearray(payload)
        if len(raw) != expected:
            raise CorecapError(f"sample {key!r}: payload is {len(raw)} bytes, expected {expected}")
    else:
        try:
            raw = codecs.decode(payload, header.dtype, expected, header.codec)
        except ValueError as e:
            raise CorecapError(f"sample {key!r}: {e}") from None
    if codecs.crc32(raw) != header.checksum:
        raise CorecapError(f"sample {key!r}: checksum mismatch (stored data is corrupt)")
    states = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return Sample(header, ids, states.view(shape))


class Store:
    """An open store. `Store.create_or_open` for writers, `Store.open` for readers."""

    def __init__(self, path: str, env: lmdb.Environment, meta: StoreMeta):
        self.path = path
        self.env = env
        self.headers_db = env.open_db(b"headers", create=False)
        self.samples_db = env.open_db(b"samples", create=False)
        self.meta_db = env.open_db(b"meta", create=False)
        self.meta = meta
        self.inline = meta.format_version == 1
        self.reader = segments.SegmentReader(path)
        self.writer: segments.SegmentWriter | None = None  # made by the first append

    @staticmethod
    def _open_env(path: str, readonly: bool) -> lmdb.Environment:
        size = os.path.getsize(os.path.join(path, "data.mdb")) if os.path.exists(os.path.join(path, "data.mdb")) else 0
        return lmdb.open(
            path,
            subdir=True,
            readonly=readonly,
            lock=True,  # readers too: a store may be read while a run writes it
            max_dbs=4,
            map_size=max(_INITIAL_MAP_SIZE, 2 * size),
            readahead=False,
            meminit=False,
            create=not readonly,
        )

    @classmethod
    def open(cls, path: str) -> "Store":
        path = os.fspath(path)
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb")):
            raise CorecapError(f"{path}: not a corecap store (no LMDB data.mdb there)")
        try:
            env = cls._open_env(path, readonly=True)
        except lmdb.Error as e:
            raise CorecapError(f"{path}: not a corecap store ({e})") from None
        return cls(path, env, _read_meta(env, path))

    @classmethod
    def create_or_open(cls, path: str, meta: StoreMeta) -> "Store":
        """Open for writing; a new store gets `meta`, an existing one must agree with it."""
        path = os.fspath(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise CorecapError(f"{path}: not a corecap store (it is a file, expected a directory)")
        if os.path.isdir(path) and os.listdir(path) and not os.path.exists(os.path.join(path, "data.mdb")):
            raise CorecapError(f"{path}: not a corecap store (a non-empty directory without data.mdb)")
        os.makedirs(path, exist_ok=True)
        env = cls._open_env(path, readonly=False)
        existing = _read_meta(env, path, missing_ok=True)
        if existing is None:
            if _has_named_db(env, b"samples") or env.stat()["entries"]:
                env.close()
                raise CorecapError(f"{path}: not a corecap store (an LMDB without corecap metadata)")
            with env.begin(write=True) as txn:
                meta_db = env.open_db(b"meta", txn=txn)
                env.open_db(b"headers", txn=txn)
                env.open_db(b"samples", txn=txn)
                txn.put(b"store", msgspec.json.encode(meta), db=meta_db)
            existing = meta
        try:
            meta.check_compatible(existing, path)
            segments.check_unlocked(path)
        except CorecapError:
            env.close()
            raise
        return cls(path, env, existing)

    @classmethod
    def open_for_writing(cls, path: str) -> "Store":
        """Open an existing store (made by `create_or_open`) to append samples."""
        env = cls._open_env(path, readonly=False)
        return cls(path, env, _read_meta(env, path))

    def __len__(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.headers_db)["entries"]

    def __contains__(self, key: str) -> bool:
        with self.env.begin() as txn:
            return txn.get(key.encode(), db=self.headers_db) is not None

    def keys(self):
        with self.env.begin() as txn:
            for k in txn.cursor(db=self.headers_db).iternext(keys=True, values=False):
                yield bytes(k).decode()

    def fingerprints(self) -> dict[str, str]:
        """key → input fingerprint of every committed sample (headers only)."""
        out = {}
        with self.env.begin(buffers=True) as txn:
            for k, v in txn.cursor(db=self.headers_db):
                key = bytes(k).decode()
                out[key] = decode_header(key, v).input_fingerprint
        return out

    def get(self, key: str) -> Sample:
        with self.env.begin(buffers=True) as txn:
            header = txn.get(key.encode(), db=self.headers_db)
            if header is None:
                raise CorecapError(f"{self.path}: no sample with key {key!r}")
            value = txn.get(key.encode(), db=self.samples_db)
            if value is None:
                raise CorecapError(f"{self.path}: sample {key!r} has a header but no states")
            return decode_sample(key, header, self.states(key, value), len(self.meta.layers))

    def states(self, key: str, value):
        """A sample's encoded states from its `samples` value (read inside the same txn)."""
        if self.inline:
            return value
        try:
            return self.reader.read(value)
        except CorecapError as e:
            raise CorecapError(f"sample {key!r}: {e}") from None

    def append(self, records: list[Record]) -> Appended:
        """First half of a commit: write the records' states to the state files (page cache)."""
        if self.inline:
            return Appended(records, None, None)
        if self.writer is None:
            with self.env.begin() as txn:
                end = txn.get(b"states_end", db=self.meta_db)
            self.writer = segments.SegmentWriter(self.path, segments.END.unpack(end) if end else (0, 0))
        return Appended(records, self.writer.append(r.parts for r in records), self.writer.end)

    def commit(self, appended: Appended) -> int:
        """Second half: make the states durable, then commit headers and pointers in one durable
        transaction (growing the map as needed). Returns the bytes committed."""
        records = appended.records
        if not self.inline:
            self.writer.sync()
        nbytes = sum(r.nbytes for r in records)
        values = [r.payload for r in records] if self.inline else appended.pointers
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for r, value in zip(records, values):
                        txn.put(r.key.encode(), r.header, db=self.headers_db)
                        txn.put(r.key.encode(), value, db=self.samples_db)
                    if appended.end is not None:
                        txn.put(b"states_end", segments.END.pack(*appended.end), db=self.meta_db)
                return nbytes
            except lmdb.MapFullError:
                self.env.set_mapsize(max(2 * self.env.info()["map_size"], 2 * nbytes))

    def put_many(self, records: list[Record]) -> int:
        """Commit whole records durably (append, then commit); returns the bytes committed."""
        return self.commit(self.append(records))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.reader.close()
        self.env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _has_named_db(env: lmdb.Environment, name: bytes) -> bool:
    with env.begin() as txn:
        return txn.get(name) is not None


def _read_meta(env: lmdb.Environment, path: str, missing_ok: bool = False) -> StoreMeta | None:
    if not _has_named_db(env, b"meta"):
        if missing_ok:
            return None
        raise CorecapError(f"{path}: not a corecap store (no corecap metadata)")
    meta_db = env.open_db(b"meta", create=False)
    with env.begin() as txn:
        raw = txn.get(b"store", db=meta_db)
    if raw is None:
        raise CorecapError(f"{path}: not a corecap store (no corecap metadata)")
    version = msgspec.json.decode(raw).get("format_version")
    if version not in READABLE_VERSIONS:
        raise CorecapError(f"{path}: store format version {version}, this corecap reads {READABLE_VERSIONS}")
    return msgspec.json.decode(raw, type=StoreMeta)
