"""A reader of deepseek-ai/DeepSpec's target cache (version 2), written for the tests from the
format as DeepSpec's `deepspec/data/target_cache_dataset.py` defines it, not from corecap's
writer. DeepSpec is not on PyPI (its repository is installed from a checkout, with a CUDA torch
pinned) and CI reaches only PyPI, so its own `CacheDataset` cannot run here; this reader makes
the checks its loader makes (the manifest's fields, versions and dtypes, the index's size, dense
sample ids, every array inside its shard) and returns what its `CacheDataset.__getitem__` and
`CacheCollator` return, plus the attention mask its writer stores and its reader skips.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import torch

RECORD = struct.Struct("<QIIQQQQQ")  # sample_id, shard_id, seq_len, five byte offsets
REQUIRED = {"version", "num_samples", "num_shards", "target_layer_ids", "hidden_dtype", "token_dtype", "mask_dtype",
            "index_record_size", "hidden_size", "shards"}


class TargetCache:
    def __init__(self, cache_dir: str):
        self.dir = cache_dir
        with open(os.path.join(cache_dir, "manifest.json"), encoding="utf-8") as f:
            self.manifest = m = json.load(f)
        assert not REQUIRED - set(m), sorted(REQUIRED - set(m))
        assert m["version"] == 2 and m["hidden_dtype"] == "bfloat16"
        assert m["token_dtype"] == "int32" and m["mask_dtype"] == "uint8"
        assert m["index_record_size"] == RECORD.size == 56  # 8 + 4 + 4 + 5 × 8
        assert m["target_layer_ids"] and m["target_layer_ids"] == sorted(m["target_layer_ids"])
        assert m["num_shards"] == len(m["shards"])
        self.shards = []
        for i, shard in enumerate(m["shards"]):
            assert shard["shard_id"] == i
            with open(os.path.join(cache_dir, shard["file_name"]), "rb") as f:
                self.shards.append(f.read())
        with open(os.path.join(cache_dir, "samples.idx"), "rb") as f:
            self.index = f.read()
        assert len(self.index) == m["num_samples"] * RECORD.size
        self.hidden = m["hidden_size"]
        self.num_layers = len(m["target_layer_ids"])

    def __len__(self) -> int:
        return self.manifest["num_samples"]

    def _array(self, shard: bytes, offset: int, count: int, dtype) -> np.ndarray:
        assert offset + count * np.dtype(dtype).itemsize <= len(shard)
        return np.frombuffer(shard, dtype=dtype, count=count, offset=offset).copy()

    def __getitem__(self, i: int) -> dict:
        sample_id, shard_id, n, ids_at, attention_at, loss_at, hidden_at, last_at = RECORD.unpack_from(
            self.index, i * RECORD.size)
        assert sample_id == i and n > 0
        shard = self.shards[shard_id]
        layers = self._array(shard, hidden_at, n * self.num_layers * self.hidden, np.uint16)
        last = self._array(shard, last_at, n * self.hidden, np.uint16)
        return {
            "input_ids": torch.from_numpy(self._array(shard, ids_at, n, np.int32)),
            "loss_mask": torch.from_numpy(self._array(shard, loss_at, n, np.uint8)),
            "target_hidden_states": torch.from_numpy(layers).view(torch.bfloat16).view(n, -1),
            "target_last_hidden_states": torch.from_numpy(last).view(torch.bfloat16).view(n, self.hidden),
            "attention_mask": torch.from_numpy(self._array(shard, attention_at, n, np.uint8)),
        }


def collate(items: list[dict]) -> dict:
    """What DeepSpec's CacheCollator makes of the items: zero-padded to the longest, and an
    attention mask of ones over each sample's tokens."""
    longest = max(len(item["input_ids"]) for item in items)
    batch = {}
    for key in ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"):
        first = items[0][key]
        out = torch.zeros((len(items), longest, *first.shape[1:]), dtype=first.dtype)
        for j, item in enumerate(items):
            out[j, : len(item[key])] = item[key]
        batch[key] = out
    batch["attention_mask"] = torch.zeros((len(items), longest), dtype=torch.long)
    for j, item in enumerate(items):
        batch["attention_mask"][j, : len(item["input_ids"])] = 1
    return batch
