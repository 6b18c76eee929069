"""`corecap.StoreDataset`: a torch Dataset over a store, to train straight from it.

    from corecap import StoreDataset
    ds = StoreDataset("out.lmdb", layers=[2, 16, 29, "prenorm"])
    item = ds[0]          # or ds["some-key"]
    # {"key": str, "input_ids": [T] int64, "loss_mask": [T] int64,
    #  "hidden_states": [len(layers), T, H] in the stored dtype (fp8 stores: dequantized),
    #  and for a sample whose response the model wrote (`corecap run --max-tokens`):
    #  "num_prompt": int (tokens [0, num_prompt) are the prompt, the rest the response),
    #  "finish_reason": "eos" | "stop" | "length"}
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                         sampler=torch.utils.data.DistributedSampler(ds))
    batches = torch.utils.data.DataLoader(ds, batch_size=4)  # padded: corecap/training/collate.py

Index i is the i-th key in the store's key order (LMDB's, bytewise) among the samples committed
when the dataset was made: a stable order, and a fixed length for samplers, even while a
`corecap run` is still writing the store. Later samples are readable by key; make a new dataset
to index them. Each item is read in one LMDB read transaction and its states are immutable once
committed, so an item is never torn (and its checksum is checked as it decodes).

Each item opens the store, reads and closes it again (cheap against decoding an EAGLE-3-sized
sample: docs/benchmarks.md, "Export"): nothing is held open between
items, so a DataLoader worker, forked or spawned, never uses an LMDB environment opened by another
process (LMDB forbids that across fork), and a `Store` of the same directory may be held open in
this process meanwhile (every `Store.open` of a store in a process shares one LMDB environment:
corecap/store/envs.py). A sample without a loss mask gets all ones, as `corecap export` gives it.
Only a generated sample's item has `num_prompt` and `finish_reason` (a capture-only store's items
are as they were): a trainer filters on them with `item.get("finish_reason")`.

In a DataLoader worker, states are decoded into shared memory that the worker reuses once the
trainer is done with an item (corecap/training/pool.py): torch's pickler would otherwise copy every
item into new shared memory, which cost as much as decoding it. What the trainer gets is a plain
tensor either way; `reuse_shared_memory=False` turns the pool off.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.utils.data

from corecap.config import PRENORM, Layer, parse_layers
from corecap.errors import CorecapError
from corecap.training import pool
from corecap.training.collate import Sample, pad_collate
from corecap.store.store import Store


class StoreDataset(torch.utils.data.Dataset):
    """Samples of the store at `store`, with the stored layers `layers` (default: all, in the
    stored order), by index or by key."""

    def __init__(self, store: str | os.PathLike, layers: list[Layer] | str | None = None, *,
                 reuse_shared_memory: bool = True):
        self.path = os.fspath(store)
        self.reuse_shared_memory = reuse_shared_memory
        with Store.open(self.path) as s:
            self.meta = s.meta
            self.keys = tuple(s.keys())  # each checked (UTF-8, its length)
        stored = tuple(self.meta.layers)
        if layers is None:
            self.layers = stored
        else:
            chosen = (parse_layers(layers) if isinstance(layers, str)
                      else tuple(PRENORM if k == PRENORM else int(k) for k in layers))
            missing = [k for k in chosen if k not in stored]
            if missing or not chosen:
                raise CorecapError(f"{self.path}: layers {list(chosen)}: the store has {list(stored)}")
            self.layers = chosen
        positions = [stored.index(k) for k in self.layers]
        self._positions = None if positions == list(range(len(stored))) else positions

    collate = staticmethod(pad_collate)  # a DataLoader's collate_fn: samples padded to the batch's longest

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, item: int | str) -> dict:
        if isinstance(item, str):
            key = item
        else:
            index = int(item)
            if not -len(self.keys) <= index < len(self.keys):
                raise IndexError(f"index {index} is out of range for {len(self.keys)} samples")
            key = self.keys[index]
        alloc = (pool.pool().tensor if self.reuse_shared_memory and torch.utils.data.get_worker_info() is not None
                 else None)
        with Store.open(self.path) as store:
            sample = store.get(key, alloc if self._positions is None else None)
        states = sample.hidden_states
        if self._positions is not None:
            chosen = (len(self._positions), *states.shape[1:])
            states = (torch.index_select(states, 0, torch.tensor(self._positions), out=alloc(chosen, states.dtype))
                      if alloc else states[self._positions])
        mask = sample.loss_mask
        num_tokens = len(sample.input_ids)
        item = Sample({
            "key": key,
            "input_ids": torch.from_numpy(sample.input_ids.astype(np.int64)),
            "loss_mask": (torch.ones(num_tokens, dtype=torch.int64) if mask is None
                          else torch.from_numpy(mask.astype(np.int64))),
            "hidden_states": states,
        })
        generation = sample.header.generation
        if generation is not None:  # what a trainer may filter on (e.g. drop responses cut off by length)
            item["num_prompt"] = generation.num_prompt
            item["finish_reason"] = generation.finish_reason
        return item
