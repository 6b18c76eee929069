"""corecap/training/collate.py: StoreDataset in a DataLoader with a batch size, with torch's default
collate and with `pad_collate`, in the main process and in workers: every sample padded to its
batch's longest, its own tokens and states equal to HF's (support.verifier's reference), the
padding zero, the attention mask one exactly on its tokens."""

from __future__ import annotations

import functools

import pytest
import torch

import corecap
from corecap.training.collate import pad_collate
from support.verifier import CAPTURED_LAYERS, expected_item, write_captured_store


def _check_batch(batch, captured, layers, pad_token_id=0):
    lengths = [len(captured[key][0]) for key in batch["key"]]
    num_tokens = max(lengths)
    assert batch["lengths"].tolist() == lengths
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape == (len(lengths), num_tokens)
    assert batch["hidden_states"].shape[:3] == (len(lengths), len(layers), num_tokens)
    for row, (key, n) in enumerate(zip(batch["key"], lengths)):
        ids, mask, states = expected_item(captured, key, layers)
        assert torch.equal(batch["input_ids"][row, :n], ids)
        assert torch.equal(batch["loss_mask"][row, :n], mask)
        assert torch.equal(batch["hidden_states"][row, :, :n], states)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (num_tokens - n)
        assert batch["input_ids"][row, n:].eq(pad_token_id).all() and not batch["loss_mask"][row, n:].any()
        assert not batch["hidden_states"][row, :, n:].any()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batched_dataloader_pads_with_torchs_default_collate(tmp_path, captured, verifier, num_workers):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    ds = corecap.StoreDataset(store)
    lengths = {len(captured[key][0]) for key in captured}
    assert len(lengths) > 1  # the samples differ in length: stacking them as they are would fail
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=num_workers)
    keys = []
    for batch in loader:
        _check_batch(batch, captured, CAPTURED_LAYERS)
        keys += batch["key"]
    assert keys == sorted(captured)


def test_pad_collate_as_collate_fn_with_a_pad_token_and_chosen_layers(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    layers = ["prenorm", 2]
    ds = corecap.StoreDataset(store, layers=layers)
    assert ds.collate is pad_collate
    loader = torch.utils.data.DataLoader(ds, batch_size=3, shuffle=True,
                                         collate_fn=functools.partial(pad_collate, pad_token_id=-100))
    seen = 0
    for batch in loader:
        _check_batch(batch, captured, ["prenorm", 2], pad_token_id=-100)
        seen += len(batch["key"])
    assert seen == len(captured)


def test_an_unbatched_item_is_still_a_plain_dict(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    item = corecap.StoreDataset(store)[0]
    assert isinstance(item, dict) and set(item) == {"key", "input_ids", "loss_mask", "hidden_states"}
    loaded = next(iter(torch.utils.data.DataLoader(corecap.StoreDataset(store), batch_size=None)))
    assert isinstance(loaded, dict) and torch.equal(loaded["input_ids"], item["input_ids"])
