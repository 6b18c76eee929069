"""corecap/training/pool.py: DataLoader workers decode into shared-memory slots and reuse a slot only
once nothing uses the item it held, in the worker or in the main process; what the trainer holds
never changes under it, forked children keep what they inherit, and whatever the pool cannot
take goes torch's own way. The first tests pickle across the two ends in one process (as the
DataLoader's queue does); the last run real DataLoader workers."""

from __future__ import annotations

import gc
import os
import pickle
import threading
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.utils.data

import corecap
from corecap.training import pool as shared
from support.verifier import CAPTURED_LAYERS, write_captured_store
from support.verifier import check_item


def _send(t: torch.Tensor) -> torch.Tensor:
    """What a DataLoader worker's result queue does with a tensor, both ends in this process."""
    return pickle.loads(ForkingPickler.dumps(t))


def _slot(t: torch.Tensor):
    return t._corecap_slot[0]


def test_capacity_rounds_up_by_at_most_an_eighth_in_whole_pages():
    page = 4096
    assert shared.capacity(1) == page and shared.capacity(page) == page
    assert shared.capacity(64 << 20) == 64 << 20
    assert shared.capacity((64 << 20) + 1) == 72 << 20
    for n in (5_000, 123_457, 10_000_019, 67_108_863):
        c = shared.capacity(n)
        assert n <= c <= n + n // 8 + page and c % page == 0


def test_a_slot_is_reused_only_when_neither_process_uses_it():
    pool = shared.Pool()
    a = pool.tensor((3, 5, 64), torch.bfloat16)
    a.copy_(torch.randn(3, 5, 64))
    want, first = a.as_subclass(torch.Tensor).clone(), _slot(a)
    got = _send(a)
    assert type(got) is torch.Tensor and torch.equal(got, want)
    del a
    gc.collect()
    b = pool.tensor((3, 5, 64), torch.bfloat16)  # the main process still holds `got`
    assert _slot(b) is not first
    b.fill_(7)
    view = got[1:]
    del got
    gc.collect()
    c = pool.tensor((3, 5, 64), torch.bfloat16)  # a view still holds it
    assert _slot(c) not in (first, _slot(b))
    assert torch.equal(view, want[1:])
    del view
    gc.collect()
    assert _slot(pool.tensor((3, 5, 64), torch.bfloat16)) is first
    assert pool.created == 3


def test_a_tensor_dropped_in_the_worker_frees_its_slot():
    pool = shared.Pool()
    a = pool.tensor((1000,), torch.float32)
    first = _slot(a)
    stacked = torch.stack([a, a])  # what a collate function makes: a plain tensor, a copy
    assert type(stacked) is torch.Tensor
    del a
    gc.collect()
    assert _slot(pool.tensor((900,), torch.float32)) is first and pool.created == 1


def test_a_fork_pins_what_the_main_process_holds():
    pool = shared.Pool()
    a = pool.tensor((4, 1024), torch.float32)
    first = _slot(a)
    got = _send(a)
    del a
    pid = os.fork()
    if pid == 0:  # the child may still read `got`: its slot must never be reused
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    want = got.clone()
    second = pool.tensor((4, 1024), torch.float32)  # the pinned slot leaves the pool, its memory stays
    assert _slot(second) is not first and first not in pool.slots and first.map.closed
    second.fill_(7)
    assert torch.equal(got, want)
    del got
    gc.collect()
    assert len(pool.slots) == 1 and pool.created == 2


def test_a_tensor_sent_twice_is_copied_the_second_time():
    """One _Lease a slot: the first copy in the main process dying must not free what the second
    still reads."""
    pool = shared.Pool()
    a = pool.tensor((1024,), torch.float32).fill_(1)
    slot = _slot(a)
    first, second = _send(a), _send(a)  # a worker's own cache of items, sent again
    assert torch.equal(first, second) and len(shared._leases) == 1
    del first
    gc.collect()
    assert not shared._leases and slot.map[slot.capacity] == 0  # FREE: the worker may reuse it
    slot.map[: 4096] = b"\x07" * 4096  # as it would
    assert torch.equal(second, torch.ones(1024))


def test_threads_never_share_a_slot(monkeypatch):
    """Items read from several threads at once each get their own slot."""
    pool, hand_out = shared.Pool(), shared._Slot.hand_out

    def slow_hand_out(slot, *args):  # widen the window between choosing a slot and taking it
        time.sleep(0.001)
        return hand_out(slot, *args)

    monkeypatch.setattr(shared._Slot, "hand_out", slow_hand_out)
    barrier, held = threading.Barrier(4, timeout=60), []

    def take():
        for _ in range(5):
            barrier.wait()
            t = pool.tensor((256,), torch.float32)
            barrier.wait()
            held.append(t._corecap_slot[0])
            barrier.wait()
            del t
            gc.collect()

    threads = [threading.Thread(target=take, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    rounds = [held[i : i + 4] for i in range(0, len(held), 4)]
    assert len(held) == 20 and all(len(set(r)) == 4 for r in rounds)


def test_a_full_pool_and_a_changed_tensor_go_torchs_way(monkeypatch):
    monkeypatch.setattr(shared, "MAX_SLOTS", 2)
    pool = shared.Pool()
    held = [pool.tensor((1000,), torch.float32) for _ in range(2)]
    extra = pool.tensor((1000,), torch.float32)
    assert type(extra) is torch.Tensor and pool.created == 2  # full, none free: new memory
    small = _slot(held.pop(0))
    gc.collect()
    big = pool.tensor((50_000,), torch.float32)  # no free slot fits: the free small one makes room
    assert _slot(big) is not small and small.map.closed and len(pool.slots) == 2
    assert type(pool.tensor((0, 4), torch.float32)) is torch.Tensor  # nothing to share
    # Set to other memory after being handed out: pickled by torch (its copy), the slot not sent.
    moved = held[0]
    moved.set_(torch.arange(1000.0))
    assert torch.equal(_send(moved), torch.arange(1000.0))
    assert _slot(moved).map[_slot(moved).capacity] == 0


class _SlotsMade(corecap.StoreDataset):
    """Items also say how many slots their worker has made so far."""

    def __getitem__(self, item):
        out = super().__getitem__(item)
        out["slots_made"] = shared.pool().created
        return out


@pytest.mark.parametrize("codec", ["zstd-planes", "raw", "fp8-e4m3-rowscale"])
def test_dataloader_items_stay_intact_while_workers_reuse_slots(tmp_path, captured, verifier, codec):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, dtype=torch.bfloat16, codec=codec)
    ds = _SlotsMade(store)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    held = list(loader)  # every item held while the later ones are decoded
    for item in held:
        assert type(item["hidden_states"]) is torch.Tensor
        assert torch.equal(item["hidden_states"], ds[item["key"]]["hidden_states"])  # read here, without the pool
        if codec != "fp8-e4m3-rowscale":
            check_item(item, captured, CAPTURED_LAYERS, torch.bfloat16)
    assert max(item["slots_made"] for item in held) == len(held) // 2  # a slot an item, 6 a worker
    del held, item
    gc.collect()
    made = []
    for _ in range(3):
        for item in loader:
            assert torch.equal(item["hidden_states"], ds[item["key"]]["hidden_states"])
            made.append(item["slots_made"])
    assert max(made) <= shared.MAX_SLOTS < len(made) // 2  # 18 more items a worker, in at most 8 slots
    off = torch.utils.data.DataLoader(_SlotsMade(store, reuse_shared_memory=False), batch_size=None, num_workers=2)
    assert {item["slots_made"] for item in off} == {0}


def test_dataloader_with_a_collate_function_and_chosen_layers(tmp_path, captured, verifier):
    """Items a collate function copies are freed in the worker; chosen layers go into slots too."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    ds = _SlotsMade(store, layers=["prenorm", 2])

    def collate(items):
        return {"keys": [i["key"] for i in items], "states": torch.cat([i["hidden_states"] for i in items], dim=1),
                "slots_made": max(i["slots_made"] for i in items)}

    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=collate, persistent_workers=True)
    made = []
    for _ in range(3):
        for batch in loader:
            want = torch.cat([ds[k]["hidden_states"] for k in batch["keys"]], dim=1)  # read in this process
            assert torch.equal(batch["states"], want)
            made.append(batch["slots_made"])
    assert max(made) <= shared.MAX_SLOTS < 3 * len(ds) // 2  # 18 items a worker, in at most 8 slots
