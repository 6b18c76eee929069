"""corecap.StoreDataset: items equal HF's states for the captured samples (by index, in the store's
key order, and by key), with the layers asked for; DataLoader workers (forked and spawned) and
DistributedSampler work; a store being written is read at its committed samples only."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import corecap
from corecap.errors import CorecapError
from support.verifier import CAPTURED_LAYERS, VERIFIER_HIDDEN, check_item, expected_item, write_captured_store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_items_by_index_and_key_equal_the_captured_states(tmp_path, captured, verifier, dtype):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, dtype=dtype)
    ds = corecap.StoreDataset(store)
    assert ds.keys == tuple(sorted(captured)) and len(ds) == len(captured) and ds.layers == CAPTURED_LAYERS
    for i, key in enumerate(sorted(captured)):
        assert ds[i]["key"] == key
        check_item(ds[i], captured, CAPTURED_LAYERS, dtype)
        check_item(ds[key], captured, CAPTURED_LAYERS, dtype)
    assert ds[-1]["key"] == sorted(captured)[-1]
    with pytest.raises(IndexError):
        ds[len(captured)]
    with pytest.raises(CorecapError, match="no sample with key 'nope'"):
        ds["nope"]
    assert [item["key"] for item in ds] == sorted(captured)  # iteration stops at IndexError


def test_layers_are_chosen_and_ordered_as_asked(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    for layers in (["prenorm", 2], "prenorm,2", ("prenorm", "2")):
        ds = corecap.StoreDataset(store, layers=layers)
        assert ds.layers == ("prenorm", 2)
        item = ds[3]
        assert item["hidden_states"].shape == (2, captured[item["key"]][0].size, VERIFIER_HIDDEN)
        check_item(item, captured, ("prenorm", 2))
    with pytest.raises(CorecapError, match=r"layers \[0\]: the store has \[1, 2, 3, 4, 'prenorm'\]"):
        corecap.StoreDataset(store, layers=[0])
    with pytest.raises(CorecapError, match="not a corecap store"):
        corecap.StoreDataset(tmp_path / "nowhere")


def test_fp8_stores_are_dequantized(tmp_path, captured, verifier):
    from corecap.store import Store

    store = write_captured_store(str(tmp_path / "s"), captured, verifier, dtype=torch.bfloat16,
                                 codec="fp8-e4m3-rowscale")
    with Store.open(store) as s:
        full = {key: s.get(key).hidden_states for key in s.keys()}
    ds = corecap.StoreDataset(store, layers=[2, "prenorm"])
    for item in ds:
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], full[item["key"]][[1, 4]])
        ref = expected_item(captured, item["key"], (2, "prenorm"))[2]
        err = (item["hidden_states"].float() - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)
        assert float(err.max()) <= 1 / 14  # e4m3 with a scale per row, then bf16 rounding
    with Store.open(store) as held:  # LMDB's one open per process: the dataset shares the held environment
        assert torch.equal(ds[0]["hidden_states"], full[ds.keys[0]][[1, 4]])
        assert held.get(ds.keys[0]).hidden_states.shape == full[ds.keys[0]].shape


def test_dataloader_workers_and_distributed_sampler(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    ds = corecap.StoreDataset(store, layers=[1, "prenorm"])
    ds[0]  # the parent reads first: forked workers must not share its LMDB environment
    seen = []
    for rank in range(2):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        for item in torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler, num_workers=2):
            check_item(item, captured, (1, "prenorm"))
            seen.append(item["key"])
    assert sorted(seen) == sorted(captured)  # 12 samples over 2 ranks: each exactly once


def test_spawned_dataloader_workers(tmp_path, captured, verifier):
    """Spawned workers get the dataset pickled, and open the store themselves."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    ds = corecap.StoreDataset(store, layers="2")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    keys = []
    for item in loader:
        check_item(item, captured, (2,))
        keys.append(item["key"])
    assert keys == sorted(captured)  # unshuffled: the store's key order


_HALF_COMMIT = """
import os, sys, time, numpy as np, torch
from corecap.store import Store, encode_sample
path, layers, hidden, go = sys.argv[1], eval(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with Store.open(path) as s:
    meta = s.meta
with Store.create_or_open(path, meta) as store:
    appended = store.append([encode_sample("zz-late", np.arange(4), torch.ones(len(layers), 4, hidden), layers)])
    open(go + ".appended", "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    store.commit(appended)
"""


def test_only_committed_samples_are_seen_while_a_run_writes(tmp_path, captured, verifier):
    """States appended but not committed (a run between the two halves of a commit) are not
    there; once committed, a new dataset has them and an old one reads them by key."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    go = str(tmp_path / "go")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen([sys.executable, "-c", _HALF_COMMIT, store, repr(CAPTURED_LAYERS), str(VERIFIER_HIDDEN),
                               go], env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(go + ".appended"):
            assert writer.poll() is None and time.monotonic() < deadline, "the writer did not append"
            time.sleep(0.01)
        ds = corecap.StoreDataset(store)
        assert len(ds) == len(captured) and "zz-late" not in ds.keys
        with pytest.raises(CorecapError, match="no sample with key 'zz-late'"):
            ds["zz-late"]
        open(go, "w").close()
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
        writer.wait()
    assert len(ds) == len(captured) and torch.equal(ds["zz-late"]["hidden_states"], torch.ones(5, 4, VERIFIER_HIDDEN))
    assert len(corecap.StoreDataset(store)) == len(captured) + 1


_WRITER = """
import sys, numpy as np, torch
from corecap.store import Store, encode_sample
path, layers, hidden = sys.argv[1], eval(sys.argv[2]), int(sys.argv[3])
with Store.open(path) as s:
    meta = s.meta
with Store.create_or_open(path, meta) as store:
    for i in range(150):
        n = 64 + i % 50
        states = torch.full((len(layers), n, hidden), float(i))
        store.put_many([encode_sample(f"w{i:04d}", np.full(n, i % 256), states, layers)])
"""


def test_reading_while_another_process_commits(tmp_path, captured, verifier):
    """A writer process commits 150 samples one by one; datasets made meanwhile see a growing
    prefix of whole samples, each exactly what was written (its checksum checked on decode)."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, store, repr(CAPTURED_LAYERS), str(VERIFIER_HIDDEN)],
                              env=env)
    sizes = []
    try:
        deadline = time.monotonic() + 120
        while writer.poll() is None and time.monotonic() < deadline:
            ds = corecap.StoreDataset(store, layers=[2])
            sizes.append(len(ds))
            for key in ds.keys[-5:]:
                if key.startswith("w"):
                    item = ds[key]
                    i = int(key[1:])
                    assert item["hidden_states"].shape == (1, 64 + i % 50, VERIFIER_HIDDEN)
                    assert (bool((item["hidden_states"] == float(i)).all())
                            and bool((item["input_ids"] == i % 256).all()))
        assert writer.wait(timeout=120) == 0
    finally:
        writer.kill()
        writer.wait()
    assert sizes == sorted(sizes) and len(set(sizes)) > 1  # read while it grew
    assert len(corecap.StoreDataset(store)) == len(captured) + 150
