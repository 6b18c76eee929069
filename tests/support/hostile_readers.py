"""The store readers that tests/test_hostile.py runs on each damaged store, in a process of their
own whose memory is limited and measured, so that a reader that allocates what a damaged store
claims shows up as a number (and cannot take the machine down).

    python tests/support/hostile_readers.py REFERENCE.pt      # then one JSON line per store on stdin

REFERENCE.pt holds, per original key, the input ids, states and loss mask the stores were made
from. Each input line {"store": PATH, "keys": [its original keys], "scratch": DIR, "into": a copy of
a clean store to merge into, "into_keys": [its keys]} gets one output line: per reader in READERS,
{"ok": what it read} or {"error": the CorecapError's message} or {"crash": a traceback}, and the
process's peak RSS so far. A reader compares what it read with the reference itself ("right" or
"wrong: ...") and returns plain JSON; the test asserts the rest.
To fuzz another reader, add a function to READERS.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import traceback

import numpy as np
import torch

from corecap.errors import CorecapError
from corecap.store import Store
from corecap.store.merge import merge_stores
from corecap.store.verify import verify_store


def _compare(sample, ref) -> str:
    """'right' when the sample is what the store was made from, else what differs."""
    ids, states, mask = ref["input_ids"], ref["hidden_states"], ref.get("loss_mask")
    if not np.array_equal(sample.input_ids, ids.numpy()):
        return "wrong: input_ids"
    hs = sample.hidden_states
    if (hs.dtype != states.dtype or hs.shape != states.shape
            or not torch.equal(hs.view(torch.uint8), states.view(torch.uint8))):
        return f"wrong: hidden_states {hs.dtype} {list(hs.shape)}"
    got = sample.loss_mask
    if (got is None) != (mask is None) or got is not None and not np.array_equal(got, mask.numpy()):
        return "wrong: loss_mask"
    return "right"


def _get_all(path: str, reference: dict, keys: list[str]) -> dict:
    """Every key of `keys` through Store.get: 'right', 'wrong: ...' or 'error: message'."""
    out = {}
    with Store.open(path) as store:
        for key in keys:
            try:
                out[key] = _compare(store.get(key), reference[key])
            except CorecapError as e:
                out[key] = f"error: {e}"
    return out


def read_get(path: str, line: dict, reference: dict):
    return _get_all(path, reference, line["keys"])


def read_ls(path: str, line: dict, reference: dict):
    with Store.open(path) as store:
        return list(store.keys())


def read_info(path: str, line: dict, reference: dict):
    import msgspec

    with Store.open(path) as store:
        return {"meta": msgspec.to_builtins(store.meta), "num_samples": len(store)}


def read_verify(path: str, line: dict, reference: dict):
    report = verify_store(path, num_threads=2)
    return {"problems": report.problems, "store_problems": report.store_problems, "num_samples": report.num_samples}


def read_merge(path: str, line: dict, reference: dict):
    """A new store merged from the damaged one: refused (then nothing is left) or all it copied
    reads back right and verifies."""
    out = os.path.join(line["scratch"], "merged")
    try:
        merge_stores(out, [path])
    except CorecapError:
        if os.path.exists(out):
            return {"left_behind": sorted(os.listdir(out))}
        raise
    return {"get": _get_all(out, reference, line["keys"]), "verify": read_verify(out, line, reference)}


def read_merge_into(path: str, line: dict, reference: dict):
    """The damaged store merged into a copy of a clean one: refused (then that store is as it was,
    byte for byte in its LMDB, its state files cut back) or it reads back right."""
    into = line["into"]
    before = _files(into)
    try:
        merge_stores(into, [path])
    except CorecapError:
        after = _files(into)
        if after != before:
            return {"changed": [name for name in sorted(set(before) | set(after))
                                if before.get(name) != after.get(name)]}
        raise
    return {"get": _get_all(into, reference, line["keys"] + line["into_keys"]),
            "verify": read_verify(into, line, reference)}


def _files(path: str) -> dict:
    """data.mdb's bytes and the state files' sizes (lock.mdb and writer.lock change on any open)."""
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == "data.mdb":
            with open(full, "rb") as f:
                out[name] = f.read()
        elif name.startswith("states-"):
            out[name] = os.path.getsize(full)
    return out


def read_dataset(path: str, line: dict, reference: dict):
    """Every key through corecap.StoreDataset, compared with the reference as Store.get's are."""
    from types import SimpleNamespace

    from corecap import StoreDataset

    dataset = StoreDataset(path)
    out = {}
    for key in line["keys"]:
        try:
            item = dataset[key]
        except CorecapError as e:
            out[key] = f"error: {e}"
            continue
        mask = item["loss_mask"].numpy().astype(np.uint8)
        ref_mask = reference[key].get("loss_mask")
        sample = SimpleNamespace(input_ids=item["input_ids"].numpy().astype(np.int32),
                                 hidden_states=item["hidden_states"], loss_mask=mask if ref_mask is not None else None)
        out[key] = _compare(sample, reference[key]) if ref_mask is not None or mask.all() else "wrong: loss_mask"
    return out


def read_export(path: str, line: dict, reference: dict):
    """`corecap export --format speculators`: refused in one line, or every exported file holds
    its sample's ids and states ([T, L, H], the stored layers in order)."""
    from safetensors.torch import load_file

    from corecap.export.driver import MANIFEST, export_store

    out = os.path.join(line["scratch"], "export")
    for leftover in (out, out + ".partial"):
        shutil.rmtree(leftover, ignore_errors=True)
    export_store(path, out, "speculators", workers=2)
    got = {}
    with open(os.path.join(out, MANIFEST)) as f:
        for row in map(json.loads, f):
            tensors = load_file(os.path.join(out, row["file"]))
            ref = reference[row["key"]]
            right = torch.equal(tensors["token_ids"], ref["input_ids"].to(torch.int64)) and torch.equal(
                tensors["hidden_states"].view(torch.uint8),
                ref["hidden_states"].transpose(0, 1).contiguous().view(torch.uint8))
            got[row["key"]] = "right" if right else "wrong: exported states or ids"
    return got


READERS = {
    "get": read_get,
    "ls": read_ls,
    "info": read_info,
    "verify": read_verify,
    "merge": read_merge,
    "merge_into": read_merge_into,
    "dataset": read_dataset,
    "export": read_export,
}


def run_readers(line: dict, reference: dict) -> dict:
    results = {}
    for name, reader in READERS.items():
        try:
            results[name] = {"ok": reader(line["store"], line, reference)}
        except CorecapError as e:
            results[name] = {"error": str(e)}
        except Exception:
            results[name] = {"crash": traceback.format_exc()}
    return results


def main() -> None:
    reference = torch.load(sys.argv[1], weights_only=True)
    for raw in sys.stdin:
        line = json.loads(raw)
        if line.get("limit_as"):  # after the warm-up: more address space than this is a failure
            resource.setrlimit(resource.RLIMIT_AS, (line["limit_as"], resource.RLIM_INFINITY))
            print(json.dumps({"limited": True}), flush=True)
            continue
        results = run_readers(line, reference)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        status = open("/proc/self/status").read()
        vm_peak = int(status.split("VmPeak:")[1].split()[0]) * 1024  # address space: LMDB maps 1 GiB per store open
        print(json.dumps({"results": results, "maxrss": usage.ru_maxrss * 1024, "vm_peak": vm_peak}, default=str),
              flush=True)


if __name__ == "__main__":
    main()
