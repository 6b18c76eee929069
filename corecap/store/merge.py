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
(~30 GB/s) where decoding would cost ~1 GB/s; `corecap verify` decodes. A damaged record
refuses the merge with one line naming the input, the key and the field, and OUT is left as it
was: every record is copied and checked before any of their headers is committed (a new OUT is
removed again); the headers then go in in batches (`Store.put_all`). LMDB keeps keys
sorted, so the duplicate check is a k-way merge of the stores' key cursors, in memory
independent of the number of samples.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import os
from dataclasses import dataclass

import msgspec

from corecap.errors import CorecapError
from corecap.store import Record, Store, StoreMeta, decode_header
from corecap.store.format import check_stored, checked_header
from corecap.store.segments import LOCK_FILE, segment_numbers, segment_path
from corecap.store.store import key_text, lmdb_errors, prefixed

IGNORED_FIELDS = ("corecap_version", "vllm_version", "format_version", "model.path")
_BATCH_BYTES = 256 << 20  # states read before they are written out


@dataclass(frozen=True)
class MergeSummary:
    store: str
    num_inputs: int
    num_copied: int  # records written to OUT
    num_duplicates: int  # keys found in more than one store with the same input, kept once
    num_samples: int  # samples in OUT after the merge
    nbytes: int  # bytes copied

    def line(self) -> str:
        return (
            f"{self.store}: {self.num_samples} samples after merging {self.num_inputs} stores: copied "
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


def _check_keys(stores: list[Store]) -> int:
    """Refuse a key held by two stores with different inputs; return the number of duplicates."""
    num_duplicates = 0
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
            fp_first, fp = (_fingerprint(stores[j], txns[j], key) for j in (first, i))
            if fp != fp_first:
                raise CorecapError(
                    f"key {key.decode()!r} is in {stores[first].path} (input fingerprint {fp_first}) and in "
                    f"{stores[i].path} (input fingerprint {fp}): different inputs under one key"
                )
            group.append(i)
    return num_duplicates


def _fingerprint(store: Store, txn, key: bytes) -> str:
    text = key_text(store.path, key)
    with lmdb_errors(store.path, f"sample {text!r}"):
        return prefixed(store.path, decode_header, text, txn.get(key, db=store.headers_db)).input_fingerprint


def _entries(src: Store):
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
                return Record(text, bytes(header_value), (states,))

            yield text, load


def _load_from(load, key: str, source: int, sources: dict) -> Record:
    record = load()
    sources[key] = source
    return record


def _remove_new_store(path: str, made_dir: bool) -> None:
    """Remove the store a refused merge created (only its own files)."""
    for name in ["data.mdb", "lock.mdb", LOCK_FILE] + [os.path.basename(segment_path(path, n)) for n in segment_numbers(path)]:
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
                num_duplicates = _check_keys([existing, *inputs])
                meta = existing.meta
        else:
            num_duplicates = _check_keys(inputs)
            meta = inputs[0].meta
        made_dir = not os.path.isdir(out_path)
        out = Store.create_or_open(out_path, meta)  # a refusal here has touched nothing
        sources: dict[str, int] = {}  # key → the input its record came from
        txns = [stack.enter_context(src.env.begin(buffers=True)) for src in inputs]

        def entries():
            for i, src in enumerate(inputs):
                for key, load in _entries(src):
                    yield key, functools.partial(_load_from, load, key, i, sources)

        def header_of(key: str) -> bytes:
            i = sources[key]
            with lmdb_errors(inputs[i].path, f"sample {key!r}"):
                return bytes(txns[i].get(key.encode(), db=inputs[i].headers_db))

        try:
            with out:
                num_copied, nbytes = out.put_all(entries(), header_of, _BATCH_BYTES)
                num_samples = len(out)
        except BaseException:
            if not out_exists:
                _remove_new_store(out_path, made_dir)
            raise
    return MergeSummary(out_path, len(inputs), num_copied, num_duplicates, num_samples, nbytes)
