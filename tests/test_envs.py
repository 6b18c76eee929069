"""corecap/store/envs.py: every `Store.open` of one store in a process shares one read-only LMDB
environment (py-lmdb refuses a second open of it), so `corecap.open_store` and `StoreDataset`
work together; the environment closes with the last `Store` that uses it."""

from __future__ import annotations

import torch

import corecap
from corecap.store.envs import readers
from support.verifier import CAPTURED_LAYERS, check_item, write_captured_store


def test_open_store_and_store_dataset_read_one_store_together(tmp_path, captured, verifier):
    path = write_captured_store(str(tmp_path / "s"), captured, verifier)
    with corecap.open_store(path) as held:
        ds = corecap.StoreDataset(path)  # opens the store too, while `held` is open
        for i, key in enumerate(sorted(captured)):
            check_item(ds[i], captured, CAPTURED_LAYERS)
            assert torch.equal(held.get(key).hidden_states, ds[key]["hidden_states"])
        batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))
        assert batch["key"] == sorted(captured)[:2]
        with corecap.open_store(path) as second:
            assert second.env is held.env
        assert held.get(sorted(captured)[0]).input_ids.tolist() == captured[sorted(captured)[0]][0].tolist()
    assert not readers.envs  # the last Store closed the environment
    with corecap.open_store(path) as again:  # and a later open makes a new one
        assert sorted(again.keys()) == sorted(captured)


def test_closing_one_store_leaves_the_shared_environment_to_the_others(tmp_path, captured, verifier):
    path = write_captured_store(str(tmp_path / "s"), captured, verifier)
    first = corecap.open_store(path)
    second = corecap.open_store(path)
    second.close()
    assert first.get(sorted(captured)[0]).input_ids.tolist() == captured[sorted(captured)[0]][0].tolist()
    first.close()
    assert not readers.envs
