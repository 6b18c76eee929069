"""deepseek-ai/DeepSpec's target cache (`corecap export --format deepspec`), the offline data its
DSpark, DFlash and EAGLE-3 trainers read (docs/export.md has a literal example), and what it
needs from a store.

DeepSpec (its `deepspec/data/target_cache_dataset.py`: `CacheDataset`, `CacheCollator`, and the
manifest checks `load_target_cache_manifest` and `validate_train_cache` make), version 2:
    DIR/manifest.json     version 2, num_samples, num_shards, target_layer_ids (ascending),
                          hidden_dtype "bfloat16", token_dtype "int32", mask_dtype "uint8",
                          index_record_size 56, hidden_size, shards [{shard_id, file_name}] (ids
                          0, 1, ...), target_model_name_or_path (its trainer compares it with its
                          config's, as strings)
    DIR/samples.idx       one 56-byte record per sample, in sample order: little-endian
                          <QIIQQQQQ: sample_id (= its index), shard_id, seq_len, then the byte
                          offsets in that shard of its input_ids, attention_mask, loss_mask,
                          target_hidden_states, target_last_hidden_states
    DIR/shard-NNNNN.bin   each sample's arrays back to back, raw: input_ids int32 [T],
                          attention_mask uint8 [T] (ones; its reader rebuilds it from T),
                          loss_mask uint8 [T], target_hidden_states bf16 [T, L*H] (the target
                          layers concatenated, ascending), target_last_hidden_states bf16 [T, H]
DeepSpec's own capture hooks `layers[i]` of the target's backbone (HF index i + 1; -1 hooks the
embeddings, HF index 0) and stores the backbone's `last_hidden_state`, AFTER the final norm: its
teacher is `lm_head(target_last_hidden_states)`, with no norm.

The samples share shard files, so unlike the other layouts the driver does not write a file per
sample: the walking thread places each row (the shard and offset follow from its length alone),
the workers write their rows there with pwrite, and a shard is fsync'd and renamed from its
temporary name once it is full and all its rows are written. A shard that exists is complete, so
a rerun keeps the shards an interrupted export finished and writes the others again.
"""

from __future__ import annotations

import json
import os
import struct
import threading

import numpy as np
import torch

from corecap.config import PRENORM, Layer
from corecap.errors import CorecapError
from corecap.export.files import TMP_SUFFIX, scratch_tensor
from corecap.export.layers import require_after_norm, run_flag
from corecap.store.format import StoreMeta

CACHE_VERSION = 2
RECORD = struct.Struct("<QIIQQQQQ")  # 56 bytes (8 + 4 + 4 + 5 × 8), DeepSpec's INDEX_RECORD_STRUCT
# A shard is the unit an interrupted export redoes, so smaller than DeepSpec's own default (64 GiB):
# its reader maps at most 4 shards at a time whatever their size. Rows are placed by it, so a new
# value needs a new driver.EXPORT_VERSION (an interrupted export's shards would not fit the index).
SHARD_BYTES = 4 << 30


class _Shard:
    """A shard being written: its temporary file, rows not yet written, and whether rows may
    still be added (the walking thread closes it when the next row does not fit)."""

    def __init__(self, path: str | None):
        self.path = path  # None: complete already (kept from an interrupted export)
        self.file = open(path + TMP_SUFFIX, "wb", buffering=0) if path else None
        self.num_pending = 0
        self.closed = False


class DeepSpec:
    """manifest.json, samples.idx and shard-NNNNN.bin, as DeepSpec's prepare_target_cache leaves them."""

    name = "deepspec"
    writes_fp8 = False  # --dtype fp8 is speculators' only (its hs_connectors fp8 files)
    shares_files = True  # rows are written into shards (write_row/commit_row), not a file each

    def __init__(self, root: str, plan=None):
        self.root = root
        self.plan = plan
        self.num_rows = 0
        self._lock = threading.Lock()
        self._shards: list[_Shard] = []
        self._size = 0  # bytes placed in the last shard
        self._places: dict[int, tuple[int, int, int]] = {}  # row → (shard, offset, bytes) until written
        self._index = None
        self._row_shard = 0  # the shard of the row added last (path() names it)

    @staticmethod
    def check_available() -> None:
        pass

    def begin(self) -> None:
        self._index = open(os.path.join(self.root, "samples.idx" + TMP_SUFFIX), "wb")

    def _shard_name(self, shard: int) -> str:
        return f"shard-{shard:05d}.bin"

    def path(self, row: int) -> str:
        """The row's shard: existing, it is complete and holds the row."""
        return self._shard_name(self._row_shard)

    def dirs(self) -> list[str]:
        return [self.root]

    ineligible = ""  # every sample is kept

    @staticmethod
    def keeps(mask: np.ndarray) -> bool:
        return True

    @staticmethod
    def images_note() -> str:
        return ""

    def add_row(self, ids: np.ndarray, mask: np.ndarray, key: str = "", header=None) -> None:
        """On the walking thread, in row order: the row's place and its index record."""
        num_tokens, hidden = len(ids), self.plan.hidden_size
        num_layers = len(self.plan.positions) - 1
        nbytes = num_tokens * (4 + 1 + 1 + 2 * num_layers * hidden + 2 * hidden)
        if not self._shards or (self._size and self._size + nbytes > SHARD_BYTES):
            self._close_last()
            name = self._shard_name(len(self._shards))
            done = os.path.exists(os.path.join(self.root, name))
            self._shards.append(_Shard(None if done else os.path.join(self.root, name)))
            self._size = 0
        shard, offset = len(self._shards) - 1, self._size
        self._size += nbytes
        self._row_shard = shard
        if self._shards[shard].file is not None:
            with self._lock:
                self._shards[shard].num_pending += 1
            self._places[self.num_rows] = (shard, offset, nbytes)
        hidden_at = offset + 6 * num_tokens
        self._index.write(RECORD.pack(
            self.num_rows, shard, num_tokens, offset, offset + 4 * num_tokens, offset + 5 * num_tokens,
            hidden_at, hidden_at + 2 * num_tokens * num_layers * hidden,
        ))
        self.num_rows += 1

    def write_row(self, row: int, ids: np.ndarray, mask: np.ndarray, states: torch.Tensor, positions, dtype) -> None:
        """On a worker thread: the row's arrays, gathered into one buffer, written at its place."""
        shard, offset, nbytes = self._places[row]
        *aux, final = positions
        num_tokens, hidden = states.shape[1], states.shape[2]
        buffer = scratch_tensor((nbytes,), torch.uint8, 0)
        buffer[: 4 * num_tokens].view(torch.int32).copy_(torch.from_numpy(ids.astype(np.int32)))
        buffer[4 * num_tokens : 5 * num_tokens].fill_(1)  # attention_mask: every token is real
        buffer[5 * num_tokens : 6 * num_tokens].copy_(torch.from_numpy(mask.astype(np.uint8)))
        hidden_end = 6 * num_tokens + 2 * num_tokens * len(aux) * hidden
        layers = buffer[6 * num_tokens : hidden_end].view(torch.bfloat16).view(num_tokens, len(aux) * hidden)
        for j, p in enumerate(aux):
            layers[:, j * hidden : (j + 1) * hidden].copy_(states[p])
        buffer[hidden_end:].view(torch.bfloat16).view(num_tokens, hidden).copy_(states[final])
        view, fd = memoryview(buffer.numpy()), self._shards[shard].file.fileno()
        while view:  # a regular file takes it all at once; a short write goes on where it stopped
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    def commit_row(self, row: int) -> int:
        """On a sync thread, once the row is written: the shard committed if that was its last
        row. Returns the row's bytes."""
        shard, _, nbytes = self._places.pop(row)
        with self._lock:
            state = self._shards[shard]
            state.num_pending -= 1
            ready = state.closed and state.num_pending == 0
        if ready:
            self._commit(state)
        return nbytes

    def _close_last(self) -> None:
        if not self._shards:
            return
        state = self._shards[-1]
        with self._lock:
            state.closed = True
            ready = state.num_pending == 0
        if ready:
            self._commit(state)

    @staticmethod
    def _commit(state: _Shard) -> None:
        if state.file is None:
            return
        os.fsync(state.file.fileno())
        state.file.close()
        os.rename(state.path + TMP_SUFFIX, state.path)

    def finish(self) -> None:
        """The last shard, the index and the manifest (every row is written by now)."""
        self._close_last()
        self._index.flush()
        os.fsync(self._index.fileno())
        self._index.close()
        os.rename(os.path.join(self.root, "samples.idx" + TMP_SUFFIX), os.path.join(self.root, "samples.idx"))
        manifest = {
            "version": CACHE_VERSION,
            "num_samples": self.num_rows,
            "num_shards": len(self._shards),
            "target_layer_ids": self.draft_config(self.plan.aux_layers)["target_layer_ids"],
            "hidden_dtype": "bfloat16",
            "token_dtype": "int32",
            "mask_dtype": "uint8",
            "index_record_size": RECORD.size,
            "hidden_size": self.plan.hidden_size,
            "shards": [{"shard_id": i, "file_name": self._shard_name(i)} for i in range(len(self._shards))],
            "target_model_name_or_path": self.plan.model_path,
        }
        path = os.path.join(self.root, "manifest.json")
        with open(path + TMP_SUFFIX, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.rename(path + TMP_SUFFIX, path)

    # --- the plan: what DeepSpec needs from a store (corecap/export/plan.py asks) ---

    @staticmethod
    def final_layer(meta: StoreMeta, path: str) -> Layer:
        """target_last_hidden_states: HF's hidden_states[N], after the final norm."""
        return require_after_norm(meta, path, "deepspec", "DeepSpec's target_last_hidden_states")

    @staticmethod
    def check_aux(aux: tuple[int, ...], meta: StoreMeta, path: str) -> None:
        num_layers, stored = meta.model.num_layers, tuple(meta.layers)
        if not aux:
            raise CorecapError(
                f"{path}: --format deepspec needs at least one target layer besides {num_layers} and {PRENORM}; the "
                f"store has {list(stored)}: capture some with "
                f"`{run_flag([2, num_layers // 2, num_layers - 3] + list(stored))}`"
            )
        if not all(0 <= k < num_layers for k in aux):
            raise CorecapError(
                f"{path}: DeepSpec names target layers by HF index - 1 (-1 for the embeddings, up to "
                f"{num_layers - 2}), so HF layers {list(aux)} cannot all be named: "
                f"choose --aux-layers among 0..{num_layers - 1}"
            )

    only_dtype = "bfloat16"  # its reader refuses a manifest whose hidden_dtype is anything else

    @staticmethod
    def auto_dtype(meta: StoreMeta) -> tuple[str, str]:
        """(--dtype auto's choice, why)."""
        return "bfloat16", "the only dtype DeepSpec's target cache holds"

    @staticmethod
    def dtype_note(dtype: str) -> str | None:
        return None

    @staticmethod
    def draft_config(aux_layers: tuple[int, ...]) -> dict:
        """The layer ids its config names (docs/export.md, "Layer indices")."""
        # prepare_target_cache hooks layers[id]: HF index - 1, and -1 for the embeddings (HF 0)
        return {"target_layer_ids": [k - 1 for k in aux_layers]}

    @staticmethod
    def draft_note(aux_layers: tuple[int, ...]) -> str:
        ids = [k - 1 for k in aux_layers]
        eagle = "" if len(ids) == 5 and min(ids) >= 0 else (
            "; DSpark and DFlash only: DeepSpec's EAGLE-3 takes exactly 5 decoder layers, no embeddings")
        return (
            f"DeepSpec config: model.target_layer_ids={ids} (decoder layers counted from 0, one lower than HF: "
            f"HF layers {list(aux_layers)}{eagle}); data.target_cache_path=DIR, and model.target_model_name_or_path "
            "as manifest.json names the model (DeepSpec compares the strings)"
        )
