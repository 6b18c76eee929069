"""`corecap merge OUT IN...`: combine stores (e.g. the shards of one `--shard K/N` run) into one.

    corecap merge all.lmdb shard0.lmdb shard1.lmdb shard2.lmdb

Every check runs before anything is written, so a refused merge leaves OUT as it was:
- the stores' metadata must agree on every field except corecap_version, vllm_version,
  format_version (OUT keeps its own) and model.path (the same model may sit in another
  directory on another machine);
- a key held by two stores (OUT included, when it exists) must have the same input
  fingerprint in both; such identical duplicates are kept once.
Records are copied as stored (header and encoded states, no decoding, no re-encoding), one
durable commit per batch. LMDB keeps keys sorted, so the duplicate check is a k-way merge of
the stores' key cursors, in memory independent of the number of samples.
"""

from __future__ import annotations

import contextlib
import heapq
import os
from dataclasses import dataclass

import msgspec

from corecap.errors import CorecapError
from corecap.store import Record, Store, StoreMeta, decode_header

IGNORED_FIELDS = ("corecap_version", "vllm_version", "format_version", "model.path")
_BATCH_RECORDS = 1024
_BATCH_BYTES = 256 << 20


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
            fp_first = decode_header(key.decode(), txns[first].get(key, db=stores[first].headers_db)).input_fingerprint
            fp = decode_header(key.decode(), txns[i].get(key, db=stores[i].headers_db)).input_fingerprint
            if fp != fp_first:
                raise CorecapError(
                    f"key {key.decode()!r} is in {stores[first].path} (input fingerprint {fp_first}) and in "
                    f"{stores[i].path} (input fingerprint {fp}): different inputs under one key"
                )
            group.append(i)
    return num_duplicates


def _copy(src: Store, out: Store) -> tuple[int, int]:
    """Copy the samples OUT does not hold yet (duplicates were checked to be the same input)."""
    num = nbytes = 0
    batch: list[Record] = []
    batch_bytes = 0
    # buffers=True: headers are views into src's map, valid while its read txn lives.
    with src.env.begin(buffers=True) as txn:
        for key in txn.cursor(db=src.headers_db).iternext(keys=True, values=False):
            text = bytes(key).decode()
            if text in out:
                continue
            value = txn.get(key, db=src.samples_db)
            if value is None:
                raise CorecapError(f"{src.path}: sample {text!r} has a header but no states")
            header = txn.get(key, db=src.headers_db)
            record = Record(text, header, (src.states(text, decode_header(text, header), value),))
            batch.append(record)
            batch_bytes += record.nbytes
            if len(batch) >= _BATCH_RECORDS or batch_bytes >= _BATCH_BYTES:
                nbytes += out.put_many(batch)
                num, batch, batch_bytes = num + len(batch), [], 0
        if batch:
            nbytes += out.put_many(batch)
            num += len(batch)
    return num, nbytes


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
        num_copied = nbytes = 0
        with Store.create_or_open(out_path, meta) as out:
            for src in inputs:
                n, b = _copy(src, out)
                num_copied, nbytes = num_copied + n, nbytes + b
            num_samples = len(out)
    return MergeSummary(out_path, len(inputs), num_copied, num_duplicates, num_samples, nbytes)
