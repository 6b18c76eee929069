"""The trainers' offline layouts that `corecap export` writes, one sample file at a time
(corecap/export/driver.py walks the store; docs/export.md has literal examples).

speculators 0.9.0 (`speculators.train.data.ArrowDataset`):
    DIR/                      a HF `datasets` directory (`save_to_disk` after `set_format("torch")`):
                              columns input_ids, loss_mask (lists of int64), seq_len (int64)
    DIR/token_freq.pt         {token id: count} over the trained-on tokens (its draft vocabulary)
    DIR/hidden_states/hs_{row}.safetensors
                              hidden_states [T, L, H]: the aux layers ascending, then the verifier's
                              last state BEFORE its final norm (speculators applies the norm itself);
                              token_ids [T] int64 (speculators checks them against input_ids)
SpecForge 0.2.0 (`specforge.runtime.data_plane.offline_reader.OfflineManifestReader`):
    DIR/rows_{a:08d}-{b:08d}/data_{row:08d}.ckpt
                              torch.save of {input_ids [T] int64, loss_mask [T] int64,
                              aux_hidden_state [1, T, 3H] (three aux layers concatenated, ascending),
                              hidden_state [1, T, H] AFTER the final norm}. SpecForge finds the files
                              by suffix and sorts their paths as strings: zero-padded numbers keep
                              that order the row order.
Every file is unshifted (row t holds token t's states): both trainers shift themselves.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import torch

from corecap.errors import CorecapError

TMP_SUFFIX = ".corecap-tmp"  # a file being written; renamed when complete, so existence = complete
FILE_GROUP = 2000  # SpecForge files per directory, as SpecForge's own prepare_hidden_states groups them
_TABLE_DIR = ".rows"  # the speculators table while rows are added (save_to_disk copies it into DIR)
_TABLE_BATCH = 1024


def commit_file(tmp: str, path: str) -> int:
    """fsync the finished temporary file and rename it to `path`: a file that exists is complete
    and durable. Returns its size. (Apart from the writing so that a worker thread goes on
    decoding while another waits for the disk.)"""
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return size


_scratch = threading.local()


def scratch_tensor(shape: tuple[int, ...], dtype: torch.dtype, slot: int) -> torch.Tensor:
    """A tensor of exactly `shape` over this thread's reused buffer number `slot`. A fresh 64 MiB
    tensor costs more in page faults than copying a sample into it (50-150 ms against 10-15 ms
    here), and glibc maps every allocation that large anew. The tensor's storage is exactly its
    own bytes, so torch.save writes no more than them; it is valid until the slot is reused."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(slot)
    if buffer is None or len(buffer) < nbytes:
        buffer = buffers[slot] = bytearray(nbytes + nbytes // 4)  # room for somewhat longer samples
    return torch.frombuffer(memoryview(buffer)[:nbytes], dtype=dtype).view(shape)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Speculators:
    """hs_{row}.safetensors per sample, and the row table written through HF `datasets`."""

    name = "speculators"

    def __init__(self, root: str):
        self.root = root
        self.num_rows = 0
        self._batch: list[tuple[np.ndarray, np.ndarray]] = []
        self._freq = np.zeros(0, dtype=np.int64)  # token id → times trained on (token_freq.pt)
        self._writer = None
        self._sink = None

    @staticmethod
    def check_available() -> None:
        try:
            import datasets  # noqa: F401  (only this format needs it)
        except ImportError:
            raise CorecapError(
                "--format speculators writes a HF `datasets` directory, and the datasets package is not installed: "
                "pip install 'corecap[speculators]'"
            ) from None

    def begin(self) -> None:
        os.makedirs(os.path.join(self.root, "hidden_states"), exist_ok=True)

    def path(self, row: int) -> str:
        return os.path.join("hidden_states", f"hs_{row}.safetensors")

    def dirs(self) -> list[str]:
        return [os.path.join(self.root, "hidden_states")]

    def write(self, tmp: str, ids: np.ndarray, mask: np.ndarray, states: torch.Tensor, positions, dtype) -> None:
        from safetensors.torch import save_file

        # [T, L, H] gathered and cast in one copy per layer, from the stored [L_stored, T, H].
        hs = scratch_tensor((states.shape[1], len(positions), states.shape[2]), dtype, 0)
        for j, p in enumerate(positions):
            hs[:, j].copy_(states[p])
        save_file({"hidden_states": hs, "token_ids": torch.from_numpy(ids.astype(np.int64))}, tmp)

    def add_row(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """The row's entry in the table, in row order (rows are added by one thread)."""
        self._batch.append((ids, mask))
        self.num_rows += 1
        counts = np.bincount(ids[mask.astype(bool)].astype(np.int64))
        if len(counts) > len(self._freq):
            self._freq = np.concatenate([self._freq, np.zeros(len(counts) - len(self._freq), np.int64)])
        self._freq[: len(counts)] += counts
        if len(self._batch) >= _TABLE_BATCH:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._writer is None:
            os.makedirs(os.path.join(self.root, _TABLE_DIR), exist_ok=True)
            self._sink = pa.OSFile(os.path.join(self.root, _TABLE_DIR, "rows.arrow"), "wb")
            self._writer = pa.ipc.new_stream(self._sink, _table_schema())
        if not self._batch:
            return
        lengths = np.array([len(ids) for ids, _ in self._batch], dtype=np.int64)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        ids = pa.array(np.concatenate([i for i, _ in self._batch]).astype(np.int64))
        masks = pa.array(np.concatenate([m for _, m in self._batch]).astype(np.int64))
        self._writer.write_batch(pa.record_batch(
            [pa.ListArray.from_arrays(offsets, ids), pa.ListArray.from_arrays(offsets, masks), pa.array(lengths)],
            schema=_table_schema(),
        ))
        self._batch.clear()

    def finish(self) -> None:
        """The `datasets` directory, exactly as speculators' prepare_data leaves it: the table with
        the torch format set, saved with `save_to_disk` (into DIR, beside hidden_states/)."""
        import shutil

        import datasets
        from datasets import utils as ds_utils

        self._flush()
        self._writer.close()
        self._sink.close()
        table_dir = os.path.join(self.root, _TABLE_DIR)
        bars = not ds_utils.are_progress_bars_disabled()  # corecap draws its own progress line
        if bars:
            ds_utils.disable_progress_bars()
        try:
            ds = datasets.Dataset.from_file(os.path.join(table_dir, "rows.arrow"))
            ds.set_format("torch")
            ds.save_to_disk(self.root)
            del ds
        finally:
            if bars:
                ds_utils.enable_progress_bars()
        shutil.rmtree(table_dir)
        # What speculators' prepare_data also leaves: the trained-on tokens' counts, from which its
        # trainer builds the draft vocabulary (--draft-vocab-size).
        ids = np.flatnonzero(self._freq)
        torch.save(dict(zip(ids.tolist(), self._freq[ids].tolist())), os.path.join(self.root, "token_freq.pt"))


def _table_schema():
    import pyarrow as pa

    return pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())])


class SpecForge:
    """rows_{a}-{b}/data_{row}.ckpt per sample; no table (SpecForge lists the files)."""

    name = "specforge"

    def __init__(self, root: str):
        self.root = root
        self.num_rows = 0
        self._made: set[str] = set()

    @staticmethod
    def check_available() -> None:
        pass

    def begin(self) -> None:
        pass

    def path(self, row: int) -> str:
        first = row // FILE_GROUP * FILE_GROUP
        return os.path.join(f"rows_{first:08d}-{first + FILE_GROUP:08d}", f"data_{row:08d}.ckpt")

    def dirs(self) -> list[str]:
        return sorted(os.path.join(self.root, d) for d in self._made)

    def write(self, tmp: str, ids: np.ndarray, mask: np.ndarray, states: torch.Tensor, positions, dtype) -> None:
        *aux, final = positions
        num_tokens, hidden = states.shape[1], states.shape[2]
        aux_state = scratch_tensor((1, num_tokens, len(aux) * hidden), dtype, 0)
        for j, p in enumerate(aux):
            aux_state[0, :, j * hidden : (j + 1) * hidden].copy_(states[p])
        # A tensor of its own, not a view of the states: torch.save stores a view's whole storage.
        hidden_state = scratch_tensor((1, num_tokens, hidden), dtype, 1)
        hidden_state[0].copy_(states[final])
        record = {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.int64)),
            "aux_hidden_state": aux_state,
            "hidden_state": hidden_state,
        }
        torch.save(record, tmp)

    def add_row(self, ids: np.ndarray, mask: np.ndarray) -> None:
        directory = os.path.dirname(self.path(self.num_rows))
        if directory not in self._made:
            os.makedirs(os.path.join(self.root, directory), exist_ok=True)
            self._made.add(directory)
        self.num_rows += 1

    def finish(self) -> None:
        pass


LAYOUTS = {"speculators": Speculators, "specforge": SpecForge}
