"""`corecap merge OUT IN...`: combine stores (e.g. the shards of one `--shard K/N` run) into one.

    corecap merge all.lmdb shard0.lmdb shard1.lmdb shard2.lmdb

Every check runs before anything is written, so a refused merge leaves OUT as it was:
- the stores' metadata must agree on every field except corecap_version, vllm_version,
  format_version (OUT keeps its own) and model.path (the same model may sit in another
  directory on another machine);
- a key held by two stores (OUT included, when it exists) must have the same input
  fingerprint in both; such identical duplicates are kept once.
Records are copied as stored (header and encoded states, no decoding, no re-encoding), but not
unchecked: a damaged input must not spread into OUT. Each copied record passes every check that
needs no decoding (its header against its key, the metadata and its own input ids; its pointer
against the committed end and the file; the crc32 over its stored bytes, or for zstd-planes its
container's, which covers every byte after the container's head), which costs a crc32 pass
(far faster than decoding: docs/benchmarks.md, "Figures the code cites");
`corecap verify` decodes. A damaged record
refuses the merge with one line naming the input, the key and the field, and OUT is left as it
was: every record is copied and checked before any of their headers is committed (a new OUT is
removed again); the headers then go in in batches (`put_all`), owners of references
before the samples that refer to them. A sample stored once (a `prefix` of references,
corecap/store/refs.py) is copied only if its input satisfies the reference; when the record OUT
keeps for a referred key is another store's (a duplicate), the segments are resolved again
through it and the header rewritten. LMDB keeps keys
sorted, so the duplicate check is a k-way merge of the stores' key cursors, in memory
independent of the number of samples.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import lmdb
import msgspec

from corecap.errors import CorecapError
from corecap.store import FORMAT_VERSION, Record, Store, StoreMeta, decode_header, refs, segments
from corecap.store.checks import check_stored, checked_header
from corecap.store.format import encode_header
from corecap.store.segments import LOCK_FILE, segment_numbers, segment_path
from corecap.store.store import key_text, lmdb_errors, prefixed

IGNORED_FIELDS = ("corecap_version", "vllm_version", "format_version", "model.path")
_BATCH_BYTES = 256 << 20  # states read before they are written out


@dataclass(frozen=True, kw_only=True)
class MergeSummary:
    store: str
    num_inputs: int
    num_copied: int  # records written to OUT
    num_duplicates: int  # keys found in more than one store with the same input, kept once
    num_samples: int  # samples in OUT after the merge
    nbytes: int  # bytes copied

    def line(self) -> str:
        return (
            f"{self.store}: {self.num_samples} samples after merging "
            f"{self.num_inputs} store{'s' if self.num_inputs != 1 else ''}: copied "
            f"{self.num_copied} ({self.nbytes / 1e6:.1f} MB), {self.num_duplicates} identical duplicates kept once"
        )


def _fields(meta: StoreMeta) -> dict:
    flat = {}
    for name, value in msgspec.structs.asdict(meta).items():
        if isinstance(value, msgspec.Struct):
            flat.update({f"{name}.{k}": v for k, v in msgspec.structs.asdict(value).items()})
        else:
            flat[name] = value
    return {k: v for k, v in flat.items() if k not in IGNORED_FIELDS}


def _check_meta(ref: Store, other: Store) -> None:
    mine, theirs = _fields(ref.meta), _fields(other.meta)
    for name in mine.keys() | theirs.keys():
        if mine.get(name) != theirs.get(name):
            raise CorecapError(
                f"{other.path}: metadata disagrees with {ref.path}: {name} is {theirs.get(name)!r} there, "
                f"{mine.get(name)!r} in {ref.path}"
            )


def _keys(store: Store, txn, index: int):
    with lmdb_errors(store.path, "its keys"):
        for key in txn.cursor(db=store.headers_db).iternext(keys=True, values=False):
            yield key, index


@dataclass(frozen=True)
class _Winner:
    """The record OUT keeps for a key held by several stores: the first store's."""

    index: int  # into the list given to _check_keys
    prefix: tuple | None
    num_prefix: int
    num_tokens: int


def _check_keys(stores: list[Store]) -> tuple[int, dict[str, _Winner]]:
    """Refuse a key held by two stores with different inputs; return the number of duplicates
    and, for each such key, the record OUT keeps."""
    num_duplicates, winners = 0, {}
    with contextlib.ExitStack() as stack:
        txns = [stack.enter_context(s.env.begin()) for s in stores]
        group: list[int] = []
        previous = None
        for key, i in heapq.merge(*(_keys(s, txn, i) for i, (s, txn) in enumerate(zip(stores, txns)))):
            if key != previous:
                previous, group = key, [i]
                continue
            num_duplicates += 1
            first = group[0]
            (fp_first, kept), (fp, _) = (_fingerprint(stores[j], txns[j], key) for j in (first, i))
            winners[key_text(stores[first].path, key)] = _Winner(first, kept.prefix, kept.num_prefix, kept.num_tokens)
            if fp != fp_first:
                raise CorecapError(
                    f"key {key.decode()!r} is in {stores[first].path} (input fingerprint {fp_first}) and in "
                    f"{stores[i].path} (input fingerprint {fp}): different inputs under one key"
                )
            group.append(i)
    return num_duplicates, winners


def _fingerprint(store: Store, txn, key: bytes):
    text = key_text(store.path, key)
    with lmdb_errors(store.path, f"sample {text!r}"):
        header = prefixed(store.path, decode_header, text, txn.get(key, db=store.headers_db))
    return header.input_fingerprint, header


class _References:
    """A record's prefix as OUT will hold it. A segment names a key whose record in OUT may be
    another store's (a duplicate kept once): its own payload may then cover other positions, so
    the segment is resolved again through that record's layout in OUT (refs.py)."""

    def __init__(self, winners: dict[str, _Winner]):
        self.winners = winners
        self.layouts: dict[str, tuple] = {}

    def prefix(self, index: int, prefix) -> tuple:
        out = []
        for s in prefix:
            w = self.winners.get(s.key)
            out += [s] if w is None or w.index == index else refs.within(self.layout(s.key), s.start, s.end)
        return tuple(out)

    def layout(self, key: str) -> tuple:
        if key not in self.layouts:
            w = self.winners[key]
            self.layouts[key] = refs.layout(key, self.prefix(w.index, w.prefix or ()), w.num_prefix, w.num_tokens)
        return self.layouts[key]

    def header(self, index: int, header_value) -> bytes:
        header = decode_header("", header_value)
        if not header.prefix:
            return bytes(header_value)
        prefix = self.prefix(index, header.prefix)
        return (bytes(header_value) if prefix == header.prefix
                else encode_header(msgspec.structs.replace(header, prefix=prefix)))


def _entries(src: Store, index: int, references: _References):
    """(key, load) of every sample of `src`, in key order; load() reads its record and checks it
    (the module docstring says what), raising CorecapError naming `src`, the key and the field."""
    # buffers=True: values are views into src's map, valid while this read txn lives: the
    # record's header is copied, its states are read into a buffer of their own.
    with lmdb_errors(src.path, "its keys"), src.env.begin(buffers=True) as txn:
        end = src.committed_end(txn)
        for key in txn.cursor(db=src.headers_db).iternext(keys=True, values=False):
            text = key_text(src.path, bytes(key))

            def load(key=bytes(key), text=text) -> Record:
                with lmdb_errors(src.path, f"sample {text!r}"):
                    value = txn.get(key, db=src.samples_db)
                    header_value = txn.get(key, db=src.headers_db)
                if value is None:
                    raise CorecapError(f"{src.path}: sample {text!r} has a header but no states")
                header = prefixed(src.path, checked_header, text, header_value, src.meta)
                states = src.states(text, header, value, end)
                prefixed(src.path, check_stored, text, header, states)
                if header.prefix:  # a reference that src itself does not hold refuses the merge
                    with lmdb_errors(src.path, f"sample {text!r}"):
                        problems, _ = refs.reference_problems(src, txn, text, header)
                    if problems:
                        raise CorecapError(f"{src.path}: sample {text!r}: {problems[0]}")
                return Record(text, references.header(index, header_value), (states,), header.num_prefix)

            yield text, load


def _load_from(load, key: str, source: int, sources: dict) -> Record:
    record = load()
    sources[key] = source
    return record


def _remove_new_store(path: str, made_dir: bool) -> None:
    """Remove the store a refused merge created (only its own files)."""
    for name in (["data.mdb", "lock.mdb", LOCK_FILE]
                 + [os.path.basename(segment_path(path, n)) for n in segment_numbers(path)]):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))
    if made_dir:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def merge_stores(out_path: str, in_paths) -> MergeSummary:
    """Merge the stores at `in_paths` into `out_path` (created if missing, else merged into)."""
    out_path = os.fspath(out_path)
    in_paths = [os.fspath(p) for p in in_paths]
    if not in_paths:
        raise CorecapError("merge: no input store given")
    seen: dict[str, str] = {os.path.realpath(out_path): out_path}
    for p in in_paths:
        real = os.path.realpath(p)
        if real in seen:
            raise CorecapError(f"merge: {p} is given twice (also as {seen[real]})")
        seen[real] = p
    out_exists = os.path.exists(os.path.join(out_path, "data.mdb"))
    with contextlib.ExitStack() as stack:
        inputs = [stack.enter_context(Store.open(p)) for p in in_paths]
        for other in inputs[1:]:
            _check_meta(inputs[0], other)
        if out_exists:
            # LMDB allows one environment per file per process: read OUT, close it, then write it.
            with Store.open(out_path) as existing:
                _check_meta(existing, inputs[0])
                num_duplicates, winners = _check_keys([existing, *inputs])
                meta = existing.meta
        else:
            num_duplicates, winners = _check_keys(inputs)
            # format 4 only once a reference is committed (Store._refer)
            meta = msgspec.structs.replace(inputs[0].meta,
                                           format_version=min(inputs[0].meta.format_version, FORMAT_VERSION))
        first = 1 if out_exists else 0  # inputs[i]'s index in the winners
        references = _References(winners)
        made_dir = not os.path.isdir(out_path)
        out = Store.create_or_open(out_path, meta)  # a refusal here has touched nothing
        sources: dict[str, int] = {}  # key → the input its record came from
        txns = [stack.enter_context(src.env.begin(buffers=True)) for src in inputs]

        def entries():
            for i, src in enumerate(inputs):
                for key, load in _entries(src, first + i, references):
                    yield key, functools.partial(_load_from, load, key, i, sources)

        def header_of(key: str) -> bytes:
            i = sources[key]
            with lmdb_errors(inputs[i].path, f"sample {key!r}"):
                return references.header(first + i, txns[i].get(key.encode(), db=inputs[i].headers_db))

        try:
            with out:
                num_copied, nbytes = put_all(out, entries(), header_of, _BATCH_BYTES)
                num_samples = len(out)
        except BaseException:
            if not out_exists:
                _remove_new_store(out_path, made_dir)
            raise
    return MergeSummary(store=out_path, num_inputs=len(inputs), num_copied=num_copied, num_duplicates=num_duplicates,
                        num_samples=num_samples, nbytes=nbytes)


def put_all(
    store: Store, entries: Iterable[tuple[str, Callable[[], Record]]], header_of: Callable[[str], bytes],
    batch_bytes: int = 256 << 20, commit_records: int = 8192,
) -> tuple[int, int]:
    """Commit the record `load()` of every (key, load) in `entries` whose key `store` does
    not hold yet (nor came earlier), all or none as far as a damaged input goes: first every
    record is loaded (and so checked) and its states are written past the committed end,
    `batch_bytes` at a time; an error there (a damaged input) cuts them off again and leaves
    the store as it was. Only then, once the states are durable, the headers (`header_of(key)`
    reads a key's header again) and pointers are committed, `commit_records` per transaction:
    one transaction for a million samples would hold gigabytes of dirty pages (LMDB keeps them
    in memory until the commit). A crash between those commits leaves a store whose committed
    samples are whole. Returns (records committed, bytes committed)."""
    with lmdb_errors(store.path, "states_end"), store.env.begin() as txn:
        committed = store.committed_end(txn) or (0, 0)
        held = lambda raw: txn.get(raw, db=store.headers_db) is not None  # noqa: E731
        store.append([])  # the writer, holding the store's lock
        copied: list[tuple[str, bytes, int]] = []  # (key, pointer, the record's num_prefix), in order
        taken: set[str] = set()
        nbytes = 0
        try:
            batch: list[Record] = []
            pending = 0
            for key, load in entries:
                if key in taken or held(key.encode()):
                    continue
                taken.add(key)
                batch.append(load())
                pending += batch[-1].nbytes
                nbytes += batch[-1].nbytes
                if pending >= batch_bytes:
                    copied += zip((r.key for r in batch), store.append(batch).pointers, (r.num_prefix for r in batch))
                    batch, pending = [], 0
            copied += zip((r.key for r in batch), store.append(batch).pointers, (r.num_prefix for r in batch))
            store.writer.sync()  # the states are durable before any pointer to them commits
        except BaseException:
            store.writer.cut(committed)
            raise
    end = segments.END.pack(*store.writer.end)
    copied.sort(key=lambda c: c[2])  # an owner's prefix is shorter than its referrers' (refs.py): it commits first
    for i in range(0, len(copied), commit_records):
        while True:
            try:
                batch = copied[i : i + commit_records]
                with lmdb_errors(store.path, "the merged headers"), store.env.begin(write=True) as txn:
                    meta = store._refer(txn, batch[-1][2] > 0)  # sorted: the last has the longest prefix
                    for key, pointer, _ in batch:
                        txn.put(key.encode(), header_of(key), db=store.headers_db)
                        txn.put(key.encode(), pointer, db=store.samples_db)
                    txn.put(b"states_end", end, db=store.meta_db)
                store.meta = meta
                break
            except lmdb.MapFullError:
                store.env.set_mapsize(2 * store.env.info()["map_size"])
    return len(copied), nbytes
