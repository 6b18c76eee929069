"""`corecap export`: a store's samples in a trainer's own offline layout, streamed.

    corecap export --store out.lmdb --format speculators --out train-spec   # speculators 0.9.0
    corecap export --store out.lmdb --format specforge --out train-sf       # SpecForge 0.2.0
    corecap export --store out.lmdb --format modelopt --out train-mo        # NVIDIA ModelOpt 0.47.0
    corecap export --store out.lmdb --format deepspec --out train-ds        # DeepSpec's target cache

(The samples as text, without states, `--format jsonl`, are corecap/export/jsonl.py's.)

The layouts are in corecap/export/speculators.py, specforge.py, modelopt.py, dflash.py and
deepspec.py (the formats by name: corecap/export/formats.py) and docs/export.md. Everything is
checked before anything is written: a store that lacks what the format needs (speculators: the
`prenorm` layer; SpecForge: layer N and exactly three aux layers; ModelOpt: layer N or
`prenorm`, and an aux layer; DeepSpec: layer N and a target layer) or an unknown key is refused
in one line that names what is missing and the `corecap run --layers` that would capture it;
speculators' --data rows are joined to every sample with images, and all that do not match
refused together (corecap/data/conversations.py).

One read transaction walks the samples (a snapshot: a run writing the store meanwhile is neither
blocked nor seen half-way) in the store's key order, or in the order of `keys`; row i of the
export is the i-th sample walked, and corecap_manifest.jsonl says which key it is. The walking
thread reads each sample's header and encoded states; a pool of `workers` threads decodes them
(fp8 dequantized), gathers and casts the layers and writes the sample's file, with at most
2 × workers samples in flight, so memory stays at a few samples whatever the store's size.

Everything goes to OUT.partial/ beside OUT, renamed to OUT when complete. Each sample's file is
written under a temporary name, fsync'd and renamed, so a file that exists is complete (DeepSpec's
samples share shard files: a shard is renamed once all its rows are written). A rerun
that finds OUT.partial from an interrupted export of the same store (the same keys) with the same
options keeps those files and writes the rest; anything else in it is replaced. A complete OUT is
never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np

from corecap import __version__
from corecap.errors import CorecapError
from corecap.export.files import TMP_SUFFIX, commit_file, fsync_dir
from corecap.export.formats import LAYOUTS
from corecap.export.layers import describe_layer
from corecap.export.plan import EXPORT_DTYPES, ExportPlan, plan_export, plan_finals
from corecap.export.summary import ExportSummary
from corecap.progress import Progress
from corecap.store import Store, refs
from corecap.store.checks import checked_header
from corecap.store.store import key_text, prefixed

EXPORT_VERSION = 1  # the options record in corecap_export.json; a different one starts over
MANIFEST = "corecap_manifest.jsonl"
INFO = "corecap_export.json"


def export_store(
    store_path: str, out: str, fmt: str, *, aux_layers: str | None = None, dtype: str = "auto",
    keys: list[str] | None = None, workers: int | None = None, progress: bool | None = False, log=lambda line: None,
    conversations=None,
) -> ExportSummary:
    """Export the store at `store_path` to `out` in `fmt`'s layout (see the module docstring).
    `conversations` (speculators only): the data file's conversations with images by key
    (corecap.data.conversations), for the `messages` of the samples with images."""
    workers = workers or min(8, os.cpu_count() or 1)
    shown, out = out, os.path.abspath(out)  # messages name OUT as given
    partial = out + ".partial"
    with Store.open(store_path) as store:
        plan = plan_export(store.meta, store.path, fmt, aux_layers, dtype)
        LAYOUTS[fmt].check_available()
        assert conversations is None or getattr(LAYOUTS[fmt], "takes_messages", False), fmt  # the CLI refuses --data
        if os.path.lexists(out):
            raise CorecapError(f"{shown}: already exists (a finished export?); remove it or choose another --out")
        try:
            with store.env.begin(buffers=True) as txn:
                num_rows, digest = select_keys(txn, store, keys)
                if conversations is not None:  # a bad --data is refused before OUT.partial is made or cleared
                    conversations.join(_exported_headers(txn, store, keys))
                options = _options(store, plan, num_rows, digest)
                lock, resumed = _open_partial(partial, options, log)
                try:
                    for note in plan.notes:
                        if note.startswith("warning: "):
                            log(f"corecap: {note}")
                    final = "".join(f" + {k}" for k in plan_finals(plan.final_layer))
                    log(f"exporting {num_rows} samples of {store.path} to {shown} ({fmt}): "
                        f"aux layers {list(plan.aux_layers)}{final}, {plan.dtype}"
                        + (" (resuming an interrupted export)" if resumed else ""))
                    summary = _write(txn, store, plan, partial, shown, keys, num_rows, resumed, workers,
                                     Progress(num_rows, progress), conversations)
                    _finish(partial, out, options, summary)
                finally:
                    os.close(lock)
        except lmdb.Error as e:
            raise CorecapError(f"{store.path}: the LMDB itself is damaged ({e})") from None
    return summary


def select_keys(txn, store: Store, keys: list[str] | None) -> tuple[int, str]:
    """(rows, a digest of the exported keys in row order), every key checked to exist."""
    digest = hashlib.blake2b(digest_size=16)
    if keys is None:
        num = 0
        for k in txn.cursor(db=store.headers_db).iternext(keys=True, values=False):
            digest.update(bytes(k) + b"\0")
            num += 1
    else:
        seen = set()
        for key in keys:
            if key in seen:
                raise CorecapError(f"--keys: key {key!r} is listed twice")
            seen.add(key)
            if txn.get(key.encode(), db=store.headers_db) is None:
                raise CorecapError(f"--keys: {store.path} has no sample with key {key!r}")
            digest.update(key.encode() + b"\0")
        num = len(keys)
    if num == 0:
        raise CorecapError(f"{store.path}: no samples to export")
    return num, digest.hexdigest()


def _walk(txn, store: Store, keys: list[str] | None):
    """The keys exported, in row order: the store's key order, or `keys`'."""
    if keys is not None:
        return iter(keys)
    return (key_text(store.path, bytes(k)) for k in txn.cursor(db=store.headers_db).iternext(keys=True, values=False))


def _exported_headers(txn, store: Store, keys: list[str] | None):
    """(key, header) of each sample the walk exports, in row order. A sample flagged NaN/Inf is
    left out, as the walk leaves it; one without a header is the walk's to report (a damaged store)."""
    for key in _walk(txn, store, keys):
        value = txn.get(key.encode(), db=store.headers_db)
        if value is None:
            continue
        header = prefixed(store.path, checked_header, key, value, store.meta)
        if not header.nonfinite:
            yield key, header


def _options(store: Store, plan: ExportPlan, num_rows: int, digest: str) -> dict:
    """What decides the exported bytes: an interrupted export is resumed only if all agree."""
    meta = store.meta
    return {
        "export_version": EXPORT_VERSION, "format": plan.fmt, "store": os.path.abspath(store.path),
        "config_hash": meta.model.config_hash, "weights_fingerprint": meta.model.weights_fingerprint,
        "num_layers": meta.model.num_layers, "store_layers": list(meta.layers), "store_dtype": meta.dtype,
        "codec": meta.codec,
        "aux_layers": list(plan.aux_layers), "final_layer": plan.final_layer, "dtype": plan.dtype,
        "num_rows": num_rows, "keys_digest": digest,
    }


def _open_partial(partial: str, options: dict, log) -> tuple[int, bool]:
    """OUT.partial locked for this export: (its directory's fd, whether earlier files are kept)."""
    import fcntl

    if os.path.lexists(partial) and not os.path.isdir(partial):
        raise CorecapError(f"{partial}: exists and is not a directory (corecap export writes OUT there first); "
                           "remove it")
    os.makedirs(partial, exist_ok=True)
    fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise CorecapError(f"{partial}: another corecap export is writing there") from None
    try:
        with open(os.path.join(partial, INFO)) as f:
            earlier = json.load(f).get("options")
    except (OSError, ValueError, AttributeError):
        earlier = None
    resumed = earlier == options
    if not resumed and os.listdir(partial):
        log(f"corecap: note: {partial}: an interrupted export of other samples or options was left there: "
            "starting over")
    for entry in os.scandir(partial):
        if not resumed:
            shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
    if resumed:  # files being written when it stopped
        for root, _, files in os.walk(partial):
            for name in files:
                if name.endswith(TMP_SUFFIX):
                    os.unlink(os.path.join(root, name))
    else:
        _write_json(os.path.join(partial, INFO), {"complete": False, "options": options})
    return fd, resumed


def _write_json(path: str, obj) -> None:
    with open(path + TMP_SUFFIX, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + TMP_SUFFIX, path)


def _write(txn, store, plan, partial, out, keys, num_rows, resumed, workers, progress, conversations) -> ExportSummary:
    layout = LAYOUTS[plan.fmt](partial, plan)
    if conversations is not None:
        layout.conversations = conversations
    end = store.committed_end(txn)  # no sample reads past the committed states (docs/store.md)
    layout.begin()
    dtype = EXPORT_DTYPES[plan.dtype]
    start = time.monotonic()
    counts = {"tokens": 0, "kept": 0, "no_mask": 0, "nonfinite": 0, "ineligible": 0, "images": 0, "image_tokens": 0,
              "no_mask_images": 0, "no_mask_image_tokens": 0, "nbytes": 0}
    pending: deque = deque()  # (num_tokens, future), in row order

    def collect_oldest() -> None:
        num_tokens, future = pending.popleft()
        nbytes = future.result().result()  # written, then synced and renamed
        counts["nbytes"] += nbytes
        progress.update(1, num_tokens, nbytes)

    walk = _walk(txn, store, keys)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="corecap-export")
    syncs = ThreadPoolExecutor(workers, thread_name_prefix="corecap-export-sync")  # waits for the disk
    manifest = open(os.path.join(partial, MANIFEST + TMP_SUFFIX), "w")
    try:
        for key in walk:
            header_value = txn.get(key.encode(), db=store.headers_db)
            value = txn.get(key.encode(), db=store.samples_db)
            if header_value is None or value is None:
                raise CorecapError(f"{store.path}: sample {key!r} has "
                                   f"{'no header' if header_value is None else 'no states'} "
                                   "(a damaged store: corecap verify)")
            header = prefixed(store.path, checked_header, key, header_value, store.meta)  # before any of it is used
            if header.nonfinite:
                counts["nonfinite"] += 1
                continue
            ids = np.frombuffer(header.input_ids, dtype="<i4")
            if header.loss_mask is None:
                mask = np.ones(len(ids), dtype=np.uint8)
            else:
                mask = np.frombuffer(header.loss_mask, dtype=np.uint8)
                if len(mask) != len(ids):
                    raise CorecapError(f"{store.path}: sample {key!r} has a loss mask of {len(mask)} entries "
                                       f"for {len(ids)} tokens")
            if header.media is not None:  # no trainer trains on an image token, whatever the stored mask says
                mask = header.media.masked(mask)
            if not layout.keeps(mask):  # one the trainer's own reader would refuse mid-training
                counts["ineligible"] += 1
                continue
            counts["no_mask"] += header.loss_mask is None
            if header.media is not None:
                num_image_tokens = sum(item.length for item in header.media.items)
                counts["images"] += 1
                counts["image_tokens"] += num_image_tokens
                if header.loss_mask is None:  # its all-ones mask has zeros after all: the note says where
                    counts["no_mask_images"] += 1
                    counts["no_mask_image_tokens"] += num_image_tokens
            row = layout.num_rows
            layout.add_row(ids, mask, key, header)
            relative = layout.path(row)
            manifest.write(json.dumps({"row": row, "key": key, "num_tokens": header.num_tokens, "file": relative})
                           + "\n")
            counts["tokens"] += header.num_tokens
            path = os.path.join(partial, relative)
            if resumed and os.path.exists(path):
                counts["kept"] += 1
                progress.update(1, header.num_tokens)
                continue
            states = store.states(key, header, value, end)
            parts = refs.read_owners(store, txn, key, header, end) if header.prefix else ()
            future = pool.submit(_export_one, layout, syncs, row, path, store, key, header, (states, parts), ids,
                                 mask, plan.positions, dtype)
            pending.append((header.num_tokens, future))
            while len(pending) >= 2 * workers:
                collect_oldest()
        while pending:
            collect_oldest()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        syncs.shutdown(wait=True)
        manifest.close()
        progress.close()
        raise
    pool.shutdown(wait=True)
    syncs.shutdown(wait=True)
    progress.close()
    manifest.flush()
    os.fsync(manifest.fileno())
    manifest.close()
    os.rename(os.path.join(partial, MANIFEST + TMP_SUFFIX), os.path.join(partial, MANIFEST))
    layout.finish()
    for directory in layout.dirs():
        fsync_dir(directory)
    return ExportSummary(
        out=out, plan=plan, num_samples=layout.num_rows, num_tokens=counts["tokens"], num_kept=counts["kept"],
        num_no_mask=counts["no_mask"], num_no_mask_with_images=counts["no_mask_images"],
        num_no_mask_image_tokens=counts["no_mask_image_tokens"],
        num_nonfinite=counts["nonfinite"], num_ineligible=counts["ineligible"],
        num_with_images=counts["images"], num_image_tokens=counts["image_tokens"], images_note=layout.images_note(),
        nbytes=counts["nbytes"], seconds=time.monotonic() - start,
    )


def _export_one(layout, syncs, row, path, store, key, header, stored, ids, mask, positions, dtype):
    """On a pool thread: decode one sample (checksum checked, fp8 dequantized; a reference's
    parts assembled) and write its file under a temporary name; returns the future of its fsync
    and rename, on another thread. A layout whose samples share files (DeepSpec's shards) writes
    the row where it placed it, and commits a file once all its rows are in."""
    sample = store.decode(key, header, *stored)
    if getattr(layout, "shares_files", False):
        layout.write_row(row, ids, mask, sample.hidden_states, positions, dtype)
        return syncs.submit(layout.commit_row, row)
    tmp = path + TMP_SUFFIX
    layout.write(tmp, ids, mask, sample.hidden_states, positions, dtype)
    return syncs.submit(commit_file, tmp, path)


def _finish(partial: str, out: str, options: dict, summary: ExportSummary) -> None:
    """The description beside the data, then OUT.partial → OUT."""
    plan = summary.plan
    _write_json(os.path.join(partial, INFO), {
        "complete": True,
        "options": options,
        "corecap_version": __version__,
        "num_samples": summary.num_samples,
        "num_tokens": summary.num_tokens,
        "layers": [
            describe_layer(k, k in plan.aux_layers, options["num_layers"])
            for k in plan.aux_layers + plan_finals(plan.final_layer)
        ],
        "draft_config": plan.draft_config(),
        "dtype": plan.dtype,
        "notes": summary.notes(),
        "manifest": MANIFEST,
    })
    fsync_dir(partial)
    if os.path.lexists(out):
        raise CorecapError(f"{out}: appeared while exporting; the export is complete in {partial}")
    os.rename(partial, out)
    fsync_dir(os.path.dirname(out))


def read_keys(path: str) -> list[str]:
    """The keys of a --keys file: one per line, blank lines skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise CorecapError(f"--keys {path}: cannot read ({e})") from None

