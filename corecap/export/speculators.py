"""speculators' offline layout (`corecap export --format speculators`), written one sample file at
a time (corecap/export/driver.py walks the store; docs/export.md has literal examples), and what
it needs from a store.

speculators 0.9.0 (`speculators.train.data.ArrowDataset`):
    DIR/                      a HF `datasets` directory (`save_to_disk` after `set_format("torch")`):
                              columns input_ids, loss_mask (lists of int64), seq_len (int64)
    DIR/token_freq.pt         {token id: count} over the trained-on tokens (its draft vocabulary)
    DIR/hidden_states/hs_{row}.safetensors
                              hidden_states [T, L, H]: the aux layers ascending, then the verifier's
                              last state BEFORE its final norm (speculators applies the norm itself);
                              token_ids [T] int64 (speculators checks them against input_ids)
                              --dtype fp8: hidden_states float8_e4m3fn [T, L, H] and
                              hidden_states_scales float32 [T, 1, 1], one scale per token, as
                              hs_connectors' fp8 backend writes them (corecap/export/fp8_per_token.py);
                              read with `speculators train --hidden-states-backend fp8`
    with --data FILE:         a `messages` column too, as speculators keeps for a model that takes
                              images: each image sample's conversation, every content a list of
                              parts (`text`, `image_url` with a file:// URL); [] for the others
                              (corecap/data/conversations.py reads them from the data file)
"""

from __future__ import annotations

import os

import numpy as np
import torch

from corecap.config import PRENORM, Layer
from corecap.errors import CorecapError
from corecap.export.files import scratch_tensor
from corecap.export.fp8_per_token import SCALES_KEY, quantize_per_token
from corecap.export.layers import run_flag
from corecap.store.format import StoreMeta

_TABLE_DIR = ".rows"  # the speculators table while rows are added (save_to_disk copies it into DIR)
_TABLE_BATCH = 1024


class Speculators:
    """hs_{row}.safetensors per sample, and the row table written through HF `datasets`."""

    name = "speculators"
    takes_messages = True  # --data: the `messages` of the samples with images

    def __init__(self, root: str, plan=None):
        self.root = root
        self.num_rows = 0
        self.conversations = None  # corecap.data.conversations.Conversations, from --data
        self._num_images = 0  # samples with images
        self._num_answered = 0  # of them, those the model answered: no `messages` (the answer is not in --data)
        self._batch: list[tuple[np.ndarray, np.ndarray, list]] = []
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

        token_ids = torch.from_numpy(ids.astype(np.int64))
        if dtype == torch.float8_e4m3fn:  # hs_connectors' fp8 file (--dtype fp8)
            codes, scales = quantize_per_token(states, positions)
            save_file({"hidden_states": codes, SCALES_KEY: scales, "token_ids": token_ids}, tmp)
            return
        # [T, L, H] gathered and cast in one copy per layer, from the stored [L_stored, T, H].
        hs = scratch_tensor((states.shape[1], len(positions), states.shape[2]), dtype, 0)
        for j, p in enumerate(positions):
            hs[:, j].copy_(states[p])
        save_file({"hidden_states": hs, "token_ids": token_ids}, tmp)

    ineligible = ""  # every sample is kept

    @staticmethod
    def keeps(mask: np.ndarray) -> bool:
        return True

    def add_row(self, ids: np.ndarray, mask: np.ndarray, key: str = "", header=None) -> None:
        """The row's entry in the table, in row order (rows are added by one thread)."""
        media = None if header is None else header.media
        self._num_images += media is not None
        messages = []  # speculators goes by the token ids where the messages hold no list content
        if media is not None and self.conversations is not None:
            if header.generation is None:
                messages = self.conversations.messages(key)
            else:
                self._num_answered += 1
        self._batch.append((ids, mask, messages))
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
            self._writer = pa.ipc.new_stream(self._sink, self._schema())
        if not self._batch:
            return
        lengths = np.array([len(ids) for ids, _, _ in self._batch], dtype=np.int64)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        ids = pa.array(np.concatenate([i for i, _, _ in self._batch]).astype(np.int64))
        masks = pa.array(np.concatenate([m for _, m, _ in self._batch]).astype(np.int64))
        columns = [pa.ListArray.from_arrays(offsets, ids), pa.ListArray.from_arrays(offsets, masks), pa.array(lengths)]
        if self.conversations is not None:
            columns.append(pa.array([m for _, _, m in self._batch], type=_messages_type()))
        self._writer.write_batch(pa.record_batch(columns, schema=self._schema()))
        self._batch.clear()

    def _schema(self):
        import pyarrow as pa

        schema = _table_schema()
        return schema if self.conversations is None else schema.append(pa.field("messages", _messages_type()))

    def images_note(self) -> str:
        if self.conversations is None:
            return ("; their rows carry no `messages` (speculators makes a missing hs file's states again from them; "
                    "from the token ids alone it would run without the images): --data FILE writes them")
        if self._num_answered:
            return (f"; `messages` from --data, but not for the {self._num_answered} the model answered (their "
                    "answers are not in the data file): keep their hs files, which speculators would otherwise make "
                    "again from the token ids alone, without the images")
        return "; their conversations in `messages`, from --data"

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

    # --- the plan: what speculators needs from a store (corecap/export/plan.py asks) ---

    @staticmethod
    def final_layer(meta: StoreMeta, path: str) -> Layer:
        """The verifier's state: corecap's "prenorm" (vLLM's id N, before the final norm)."""
        stored = tuple(meta.layers)
        if PRENORM not in stored:
            ints = [k for k in stored if k != PRENORM]
            raise CorecapError(
                f"{path}: --format speculators needs the '{PRENORM}' layer (the last decoder layer's output before the "
                f"final norm, which speculators applies itself); the store has layers {list(stored)}: capture it with "
                f"`{run_flag(ints + [PRENORM])}`"
            )
        return PRENORM

    @staticmethod
    def check_aux(aux: tuple[int, ...], meta: StoreMeta, path: str) -> None:
        if not aux:
            num_layers, stored = meta.model.num_layers, tuple(meta.layers)
            raise CorecapError(
                f"{path}: --format speculators needs at least one aux layer besides {PRENORM}; "
                f"the store has {list(stored)}: capture some with "
                f"`{run_flag([2, num_layers // 2, num_layers - 3, PRENORM])}`"
            )

    @staticmethod
    def auto_dtype(meta: StoreMeta) -> tuple[str, str]:
        """(--dtype auto's choice, why)."""
        return meta.dtype, "the stored dtype; speculators casts to its --hidden-states-dtype, bfloat16 by default"

    writes_fp8 = True  # --dtype fp8: hs_connectors' per-token fp8 files

    @staticmethod
    def dtype_note(dtype: str) -> str | None:
        if dtype != "fp8":
            return None
        return ("hidden states quantized to float8_e4m3fn, one scale per token across the exported layers "
                "(hs_connectors' fp8 files): train with `speculators train ... --hidden-states-backend fp8`, "
                "whose reader dequantizes them to bfloat16 (its default `file` backend would read the codes unscaled)")

    @staticmethod
    def draft_config(aux_layers: tuple[int, ...]) -> dict:
        """The layer ids its draft config names (docs/export.md, "Layer indices")."""
        return {"target_layer_ids": list(aux_layers)}  # vLLM's ids are HF's indices

    @staticmethod
    def draft_note(aux_layers: tuple[int, ...]) -> str:
        return f"speculators: --target-layer-ids {' '.join(map(str, aux_layers))} (vLLM's ids, equal to HF's indices)"


def _table_schema():
    import pyarrow as pa

    return pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                      ("seq_len", pa.int64())])


def _messages_type():
    """The `messages` column: every row's turns, each content a list of parts; the fields a part
    does not use are null, as `datasets` stores speculators' own parts."""
    import pyarrow as pa

    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("image_url", pa.struct([("url", pa.string())]))])
    return pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(part))]))
