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

import contextlib
import functools
import os
from dataclasses import dataclass

import lmdb
import msgspec

from corecap.errors import CorecapError
from corecap.store import refs, segments
from corecap.store.envs import readers as _readers
from corecap.store.checks import checked_header, stored_bytes
from corecap.store.decode import decode_states
from corecap.store.format import (
    DTYPES, MAX_KEY_BYTES, REFERENCE_VERSION, Record, Sample, SampleHeader, StoreMeta, decode_header, decode_meta,
    prompt_fingerprint,
)

_INITIAL_MAP_SIZE = 1 << 30
# a run given an existing directory logs there before the store exists, and locks it first (corecap/writer_lock.py)
_OWN_FILES = {"corecap.log", segments.LOCK_FILE}


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
        try:
            self.headers_db = env.open_db(b"headers", create=False)
            self.samples_db = env.open_db(b"samples", create=False)
            self.meta_db = env.open_db(b"meta", create=False)
        except lmdb.Error as e:  # NotFoundError, IncompatibleError (a name that is not a database), ...
            raise CorecapError(f"{path}: not a corecap store (its headers, samples and meta databases: {e})") from None
        self.meta = meta
        self.reader = segments.SegmentReader(path)
        self.writer: segments.SegmentWriter | None = None  # made by the first append
        self.shared_env = False  # a reader's environment, shared with this process's other readers (store/envs.py)

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
        if not os.path.lexists(path):
            raise CorecapError(f"{path}: not a corecap store (the path does not exist)")
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb")):
            raise CorecapError(f"{path}: not a corecap store (no LMDB data.mdb there)")
        if not os.path.isfile(os.path.join(path, "data.mdb")) or not os.path.getsize(os.path.join(path, "data.mdb")):
            raise CorecapError(f"{path}: not a corecap store (its data.mdb is empty or not a file)")
        try:
            env = _readers.open(path, functools.partial(cls._open_env, path, readonly=True))
        except lmdb.InvalidError as e:  # MDB_INVALID: not an LMDB file at all
            raise CorecapError(f"{path}: not a corecap store ({e})") from None
        except lmdb.Error as e:
            if "already open in this process" in str(e):  # py-lmdb's guard: LMDB's locks are per process
                raise CorecapError(f"{path}: the store is already open in this process "
                                   "(LMDB allows one open at a time)") from None
            raise CorecapError(f"{path}: cannot open the store's LMDB ({type(e).__name__}: {e})") from None
        try:
            with lmdb_errors(path, "its metadata"):
                store = cls(path, env, _read_meta(env, path))
        except BaseException:
            _readers.close(path, env)
            raise
        store.shared_env = True
        return store

    @classmethod
    def create_or_open(cls, path: str, meta: StoreMeta) -> "Store":
        """Open for writing; a new store gets `meta`, an existing one must agree with it."""
        path = os.fspath(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise CorecapError(f"{path}: not a corecap store (it is a file, expected a directory)")
        if (os.path.isdir(path) and set(os.listdir(path)) - _OWN_FILES
                and not os.path.exists(os.path.join(path, "data.mdb"))):
            raise CorecapError(f"{path}: not a corecap store (a non-empty directory without data.mdb)")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise CorecapError(f"--store {path}: cannot make the store's directory ({e.strerror})") from None
        try:
            env = cls._open_env(path, readonly=False)
        except lmdb.Error as e:
            raise CorecapError(f"{path}: cannot open the store's LMDB ({type(e).__name__}: {e})") from None
        try:
            with lmdb_errors(path, "its metadata"):
                existing = _read_meta(env, path, missing_ok=True)
                foreign = existing is None and (_has_named_db(env, b"samples") or env.stat()["entries"])
            if foreign:
                raise CorecapError(f"{path}: not a corecap store (an LMDB without corecap metadata)")
            if existing is None:
                with env.begin(write=True) as txn:
                    meta_db = env.open_db(b"meta", txn=txn)
                    env.open_db(b"headers", txn=txn)
                    env.open_db(b"samples", txn=txn)
                    txn.put(b"store", msgspec.json.encode(meta), db=meta_db)
                existing = meta
            meta.check_compatible(existing, path)
            segments.check_unlocked(path)
            return cls(path, env, existing)
        except BaseException:
            env.close()
            raise

    @classmethod
    def open_for_writing(cls, path: str) -> "Store":
        """Open an existing store (made by `create_or_open`) to append samples."""
        env = cls._open_env(path, readonly=False)
        return cls(path, env, _read_meta(env, path))

    def __len__(self) -> int:
        with lmdb_errors(self.path, "the headers database"), self.env.begin() as txn:
            return txn.stat(self.headers_db)["entries"]

    def __contains__(self, key: str) -> bool:
        with lmdb_errors(self.path, f"sample {key!r}"), self.env.begin() as txn:
            return txn.get(self._key(key), db=self.headers_db) is not None

    def _key(self, key: str) -> bytes:
        raw = key.encode(errors="surrogateescape")  # a key typed as bytes that are not UTF-8
        if not 0 < len(raw) <= MAX_KEY_BYTES:
            raise CorecapError(f"{self.path}: no sample with key {key!r} (a key is 1 to {MAX_KEY_BYTES} bytes)")
        return raw

    def keys(self):
        with lmdb_errors(self.path, "the headers database"), self.env.begin() as txn:
            for k in txn.cursor(db=self.headers_db).iternext(keys=True, values=False):
                yield key_text(self.path, bytes(k))

    def fingerprints(self) -> dict[str, str]:
        """key → input fingerprint of every committed sample (headers only)."""
        out = {}
        with lmdb_errors(self.path, "the headers database"), self.env.begin(buffers=True) as txn:
            for k, v in txn.cursor(db=self.headers_db):
                key = key_text(self.path, bytes(k))
                out[key] = prompt_fingerprint(prefixed(self.path, decode_header, key, v))
        return out

    def get(self, key: str, alloc=None) -> Sample:
        """The sample `key`, every field of its records checked before its states are read
        (docs/store.md, "What readers check"); CorecapError naming the store, the key and the
        field when anything is wrong. `alloc(shape, dtype)`, when given, returns the contiguous
        tensor the states are decoded into (corecap/training/pool.py's pool)."""
        raw_key = self._key(key)
        with lmdb_errors(self.path, f"sample {key!r}"), self.env.begin(buffers=True) as txn:
            header_value = txn.get(raw_key, db=self.headers_db)
            if header_value is None:
                raise CorecapError(f"{self.path}: no sample with key {key!r}")
            value = txn.get(raw_key, db=self.samples_db)
            if value is None:
                raise CorecapError(f"{self.path}: sample {key!r} has a header but no states")
            header = prefixed(self.path, checked_header, key, header_value, self.meta)
            end = self.committed_end(txn)
            states = self.states(key, header, value, end)
            parts = refs.read_owners(self, txn, key, header, end) if header.prefix else ()
        return self.decode(key, header, states, parts, alloc)

    def decode(self, key: str, header: SampleHeader, states, parts=(), alloc=None) -> Sample:
        """The sample from its stored states and, when it refers to others, their stored parts
        (`refs.read_owners`, read in the same transaction), into `alloc`'s tensor (`get`)."""
        out = (None if alloc is None
               else alloc((len(header.layers), header.num_tokens, header.hidden_size), DTYPES[header.dtype]))
        if header.prefix:
            sample = prefixed(self.path, decode_states, key, header, states)
            return prefixed(self.path, refs.assemble, key, sample, parts, out)
        return prefixed(self.path, decode_states, key, header, states, out)

    def committed_end(self, txn) -> tuple[int, int] | None:
        """The committed end of the state files (`segments.END`) as `txn` sees it; None in a store
        without samples. A store with samples and no end, or an end of the wrong size, is damaged."""
        raw = txn.get(b"states_end", db=self.meta_db)
        if raw is None:
            if txn.stat(self.samples_db)["entries"]:
                raise CorecapError(f"{self.path}: no states_end in the meta database, "
                                   "although the store holds samples (damaged)")
            return None
        if len(raw) != segments.END.size:
            raise CorecapError(f"{self.path}: states_end (meta database) is {len(raw)} bytes, "
                               f"expected {segments.END.size}")
        return segments.END.unpack(raw)

    def states(self, key: str, header: SampleHeader, value, end: tuple[int, int] | None):
        """A sample's encoded states from its `samples` value (read inside the same txn as `end`,
        `committed_end`), at most as many bytes as its header allows (`checks.stored_bytes`)."""
        _, most = prefixed(self.path, stored_bytes, header, key)
        try:
            return self.reader.read(value, most, end)
        except CorecapError as e:
            raise CorecapError(f"{self.path}: sample {key!r}: {e}") from None

    def append(self, records: list[Record]) -> Appended:
        """First half of a commit: write the records' states to the state files (page cache)."""
        if self.writer is None:
            with lmdb_errors(self.path, "states_end"), self.env.begin() as txn:
                end = self.committed_end(txn) or (0, 0)
                self._check_end(txn, end)
            self.writer = segments.SegmentWriter(self.path, end)
        payloads = (r.parts if r.spilled is None else r.spilled for r in records)
        return Appended(records, self.writer.append(payloads), self.writer.end)

    def _check_end(self, txn, end: tuple[int, int]) -> None:
        """A writer cuts the state files back to the committed end: refuse when the end lies past
        its file (cut short: committed states are gone) or a committed pointer names bytes past it
        that are on disk (a damaged states_end would make the writer destroy them). One pass over
        the pointers, once per writer."""
        sizes = {n: os.path.getsize(segments.segment_path(self.path, n)) for n in segments.segment_numbers(self.path)}
        if end != (0, 0) and sizes.get(end[0], 0) < end[1]:
            raise CorecapError(
                f"{self.path}: states_end (meta database) says byte {end[1]} of states-{end[0]:06d}.bin, which has "
                f"{sizes.get(end[0], 0)}: the state file was cut short; refusing to write "
                "(`corecap verify` lists the samples it lost)"
            )
        for key, value in txn.cursor(db=self.samples_db):
            if len(value) != segments.POINTER.size:
                continue  # a damaged pointer names no bytes of its own
            segment, offset, length = segments.POINTER.unpack(value)
            if (segment, offset + length) > end and offset + length <= sizes.get(segment, -1):
                raise CorecapError(
                    f"{self.path}: states_end (meta database) says byte {end[1]} of states-{end[0]:06d}.bin, "
                    f"but sample {bytes(key).decode(errors='backslashreplace')!r} "
                    f"lies at bytes {offset}..{offset + length} of states-{segment:06d}.bin: refusing to write "
                    "(cutting the state files back to states_end would destroy committed states)"
                )

    def commit(self, appended: Appended) -> int:
        """Second half: make the states durable, then commit headers and pointers in one durable
        transaction (growing the map as needed). Returns the bytes committed."""
        records = appended.records
        self.writer.sync()
        nbytes = sum(r.nbytes for r in records)
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    meta = self._refer(txn, any(r.num_prefix for r in records))
                    for r, pointer in zip(records, appended.pointers):
                        txn.put(r.key.encode(), r.header, db=self.headers_db)
                        txn.put(r.key.encode(), pointer, db=self.samples_db)
                    txn.put(b"states_end", segments.END.pack(*appended.end), db=self.meta_db)
                self.meta = meta
                return nbytes
            except lmdb.MapFullError:
                self.env.set_mapsize(max(2 * self.env.info()["map_size"], 2 * nbytes))

    def _refer(self, txn, refers: bool) -> StoreMeta:
        """The metadata once `txn` commits: in the transaction that commits a store's first
        sample with a reference the store becomes format 4 (older readers then refuse the store
        as a whole rather than one sample's header)."""
        if not refers or self.meta.format_version >= REFERENCE_VERSION:
            return self.meta
        meta = msgspec.structs.replace(self.meta, format_version=REFERENCE_VERSION)
        txn.put(b"store", msgspec.json.encode(meta), db=self.meta_db)
        return meta

    def put_many(self, records: list[Record]) -> int:
        """Commit whole records durably (append, then commit); returns the bytes committed."""
        return self.commit(self.append(records))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.reader.close()
        if self.shared_env:
            _readers.close(self.path, self.env)
        else:
            self.env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def key_text(path: str, key: bytes) -> str:
    """A stored key as text; keys are UTF-8, so one that is not is damage."""
    try:
        return key.decode()
    except UnicodeDecodeError:
        raise CorecapError(f"{path}: key {key!r} (headers database) is not UTF-8") from None


# What LMDB raises on a damaged data.mdb (a page of the wrong type, a page number past the file).
LMDB_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError)


def lmdb_message(error: lmdb.Error) -> str:
    state = "is damaged" if isinstance(error, LMDB_DAMAGE) else "failed"
    return f"its LMDB {state} ({type(error).__name__}: {error})"


@contextlib.contextmanager
def lmdb_errors(path: str, what: str):
    """LMDB's own errors (a damaged page of data.mdb, too many readers, ...) as one line naming
    the store and what was being read."""
    try:
        yield
    except lmdb.Error as e:
        raise CorecapError(f"{path}: reading {what}, {lmdb_message(e)}") from None


def prefixed(path: str, fn, *args):
    """fn(*args), its CorecapError (which names the sample) prefixed with the store's path."""
    try:
        return fn(*args)
    except CorecapError as e:
        raise CorecapError(f"{path}: {e}") from None


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
