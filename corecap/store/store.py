"""The store: a directory with one LMDB environment (metadata, sample headers, pointers) and
append-only state files (the hidden states themselves; corecap/store/segments.py says why).

Named LMDB databases keep metadata outside the sample key space:
  meta     b"store" → JSON `StoreMeta` (format version, model identity, layers, dtype, ...)
           b"states_end" → the committed end of the state files (`segments.END`)
  headers  id (UTF-8, ≤ 511 bytes) → msgpack `SampleHeader` (input ids, codec, checksum, ...)
  samples  id → `segments.POINTER` to the sample's states [L, T, H] (stored dtype, encoded by
           its codec) in states-NNNNNN.bin
The records are in corecap/store/format.py; the layout, with a literal example, in
docs/store.md. Readers check the format version and refuse what they do not understand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import lmdb
import msgspec

from corecap.errors import CorecapError
from corecap.store import segments
from corecap.store.format import (
    FORMAT_VERSION, Record, Sample, StoreMeta, decode_header, decode_meta, decode_sample, stored_bytes,
)

_INITIAL_MAP_SIZE = 1 << 30


@dataclass(frozen=True)
class Appended:
    """Records whose states are written (not yet durable) and where: `Store.commit` them."""

    records: list[Record]
    pointers: list[bytes]
    end: tuple[int, int]


class Store:
    """An open store. `Store.create_or_open` for writers, `Store.open` for readers."""

    def __init__(self, path: str, env: lmdb.Environment, meta: StoreMeta):
        self.path = path
        self.env = env
        self.headers_db = env.open_db(b"headers", create=False)
        self.samples_db = env.open_db(b"samples", create=False)
        self.meta_db = env.open_db(b"meta", create=False)
        self.meta = meta
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
            if "already open in this process" in str(e):  # py-lmdb's guard: LMDB's locks are per process
                raise CorecapError(f"{path}: the store is already open in this process (LMDB allows one open at a time)") from None
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
            return decode_sample(key, header, self.states(key, decode_header(key, header), value), len(self.meta.layers))

    def states(self, key: str, header, value) -> bytearray:
        """A sample's encoded states from its `samples` value (read inside the same txn), at most
        as many bytes as its header allows (`format.stored_bytes`)."""
        _, most = stored_bytes(header)
        try:
            return self.reader.read(value, most)
        except CorecapError as e:
            raise CorecapError(f"sample {key!r}: {e}") from None

    def append(self, records: list[Record]) -> Appended:
        """First half of a commit: write the records' states to the state files (page cache)."""
        if self.writer is None:
            with self.env.begin() as txn:
                end = txn.get(b"states_end", db=self.meta_db)
            self.writer = segments.SegmentWriter(self.path, segments.END.unpack(end) if end else (0, 0))
        return Appended(records, self.writer.append(r.parts for r in records), self.writer.end)

    def commit(self, appended: Appended) -> int:
        """Second half: make the states durable, then commit headers and pointers in one durable
        transaction (growing the map as needed). Returns the bytes committed."""
        records = appended.records
        self.writer.sync()
        nbytes = sum(r.nbytes for r in records)
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for r, pointer in zip(records, appended.pointers):
                        txn.put(r.key.encode(), r.header, db=self.headers_db)
                        txn.put(r.key.encode(), pointer, db=self.samples_db)
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
    try:
        meta_db = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            raw = txn.get(b"store", db=meta_db)
    except lmdb.Error as e:
        raise CorecapError(f"{path}: not a corecap store ({e})") from None
    if raw is None:
        raise CorecapError(f"{path}: not a corecap store (no corecap metadata)")
    return decode_meta(raw, path)
