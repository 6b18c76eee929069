"""Batches of StoreDataset items: each sample padded to the batch's longest, with an attention mask.

    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
    batch = next(iter(loader))
    # {"key": [B] str, "input_ids": [B, T] int64 (pad_token_id after each sample's end),
    #  "loss_mask": [B, T] int64 (0 on padding), "attention_mask": [B, T] int64 (1: a token),
    #  "lengths": [B] int64, "hidden_states": [B, len(layers), T, H] (0 on padding),
    #  and where any sample was generated: "num_prompt", "finish_reason": [B] lists, None for the others}

Samples differ in length, so torch's default collate cannot stack them. An item is a `Sample` (a
dict), which this module registers with torch's default collate (`default_collate_fn_map`, the
extension point torch documents for `collate`): a DataLoader given a batch size pads without
being told to. `pad_collate` is the same function to pass as `collate_fn` (e.g. with another
pad token: `functools.partial(pad_collate, pad_token_id=tokenizer.pad_token_id)`).
"""

from __future__ import annotations

import torch
import torch.utils.data._utils.collate as torch_collate


class Sample(dict):
    """A StoreDataset item: a plain dict whose type tells torch's default collate to pad."""


GENERATION = ("num_prompt", "finish_reason")  # only a generated sample's item has them


def pad_collate(batch: list[dict], *, pad_token_id: int = 0, collate_fn_map=None) -> dict:
    """A batch of StoreDataset items, each padded at its end to the longest (see the module's docstring);
    `collate_fn_map`: what torch's collate passes, unused."""
    if not batch:
        raise ValueError("pad_collate: an empty batch")
    lengths = torch.tensor([len(item["input_ids"]) for item in batch], dtype=torch.int64)
    num_tokens = int(lengths.max())
    states = batch[0]["hidden_states"]
    out = {
        "key": [item["key"] for item in batch],
        "input_ids": torch.full((len(batch), num_tokens), pad_token_id, dtype=torch.int64),
        "loss_mask": torch.zeros(len(batch), num_tokens, dtype=torch.int64),
        "attention_mask": torch.zeros(len(batch), num_tokens, dtype=torch.int64),
        "lengths": lengths,
        "hidden_states": torch.zeros(len(batch), states.shape[0], num_tokens, states.shape[2], dtype=states.dtype),
    }
    for row, item in enumerate(batch):
        n = len(item["input_ids"])
        out["input_ids"][row, :n] = item["input_ids"]
        out["loss_mask"][row, :n] = item["loss_mask"]
        out["attention_mask"][row, :n] = 1
        out["hidden_states"][row, :, :n] = item["hidden_states"]
    if any(name in item for item in batch for name in GENERATION):
        for name in GENERATION:
            out[name] = [item.get(name) for item in batch]
    return out


# torch's default collate looks an element's exact type up in this map before its generic cases.
torch_collate.default_collate_fn_map[Sample] = pad_collate
