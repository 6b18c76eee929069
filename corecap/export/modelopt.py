"""NVIDIA ModelOpt's offline EAGLE-3 layout (`corecap export --format modelopt`), written one
sample file at a time (corecap/export/driver.py walks the store; docs/export.md has literal
examples), and what it needs from a store.

ModelOpt 0.47.0 (`modelopt.torch.speculative.eagle.utils.OfflineSupervisedDataset`, fed the
`*.pt` files its trainer finds under `data.offline_data_path` with `rglob`):
    DIR/{row:08d}.pt          torch.save of {input_ids [T] int64, loss_mask [T] int64,
                              aux_hidden_states [T, kH] (the aux layers concatenated, ascending),
                              hidden_states [T, H] (the verifier's last state),
                              hidden_states_prenorm: bool}
`hidden_states` is HF's hidden_states[N], after the final norm, as ModelOpt's own
compute_hidden_states_hf.py dumps it (its teacher is then lm_head(hidden_states)). A store without
layer N but with `prenorm` is exported with `hidden_states_prenorm: True`, which ModelOpt reads to
re-apply the verifier's final norm before lm_head (plugins/modeling_final_norm.py).
"""

from __future__ import annotations

import numpy as np
import torch

from corecap.config import PRENORM, Layer
from corecap.errors import CorecapError
from corecap.export.files import scratch_tensor
from corecap.export.layers import check_one_lower, run_flag
from corecap.store.format import StoreMeta


class ModelOpt:
    """{row:08d}.pt per sample in one directory, as ModelOpt's dump scripts leave them."""

    name = "modelopt"
    writes_fp8 = False  # --dtype fp8 is speculators' only (its hs_connectors fp8 files)

    def __init__(self, root: str, plan=None):
        self.root = root
        self.num_rows = 0
        # ModelOpt's reader takes the file's word for which state it holds (None: a bench's gather).
        self.prenorm = plan is not None and plan.final_layer == PRENORM

    @staticmethod
    def check_available() -> None:
        pass

    def begin(self) -> None:
        pass

    def path(self, row: int) -> str:
        # Zero-padded: ModelOpt's calibration reader sorts the names, and then they sort as rows.
        return f"{row:08d}.pt"

    def dirs(self) -> list[str]:
        return [self.root]

    def write(self, tmp: str, ids: np.ndarray, mask: np.ndarray, states: torch.Tensor, positions, dtype) -> None:
        *aux, final = positions
        num_tokens, hidden = states.shape[1], states.shape[2]
        aux_state = scratch_tensor((num_tokens, len(aux) * hidden), dtype, 0)
        for j, p in enumerate(aux):
            aux_state[:, j * hidden : (j + 1) * hidden].copy_(states[p])
        # A tensor of its own, not a view of the states: torch.save stores a view's whole storage.
        last = scratch_tensor((num_tokens, hidden), dtype, 1)
        last.copy_(states[final])
        record = {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.int64)),
            "aux_hidden_states": aux_state,
            "hidden_states": last,
            "hidden_states_prenorm": self.prenorm,
        }
        torch.save(record, tmp)

    ineligible = ""  # every sample is kept

    @staticmethod
    def keeps(mask: np.ndarray) -> bool:
        return True

    @staticmethod
    def images_note() -> str:
        # OfflineSupervisedDataset uses an all-ones mask unless answer_only_loss is set
        return (" (ModelOpt reads the masks only with training.answer_only_loss=true; without it, it trains on every "
                "token, image tokens included)")

    def add_row(self, ids: np.ndarray, mask: np.ndarray, key: str = "", header=None) -> None:
        self.num_rows += 1

    def finish(self) -> None:
        pass

    # --- the plan: what ModelOpt needs from a store (corecap/export/plan.py asks) ---

    @staticmethod
    def final_layer(meta: StoreMeta, path: str) -> Layer:
        """HF's hidden_states[N] (after the final norm) where stored, else `prenorm` (flagged)."""
        num_layers, stored = meta.model.num_layers, tuple(meta.layers)
        if num_layers in stored:
            return num_layers
        if PRENORM in stored:
            return PRENORM
        ints = [k for k in stored if k != PRENORM]
        raise CorecapError(
            f"{path}: --format modelopt needs layer {num_layers} (the final hidden state after the norm, ModelOpt's "
            f"hidden_states) or '{PRENORM}'; the store has layers {list(stored)}: capture it with "
            f"`{run_flag(ints + [num_layers])}`"
        )

    @staticmethod
    def check_aux(aux: tuple[int, ...], meta: StoreMeta, path: str) -> None:
        num_layers, stored = meta.model.num_layers, tuple(meta.layers)
        if not aux:
            keep = [k for k in stored if k == num_layers or k == PRENORM]
            raise CorecapError(
                f"{path}: --format modelopt needs at least one aux layer besides {num_layers} and {PRENORM} (EAGLE-3's "
                f"aux_hidden_states); the store has {list(stored)}: capture three with "
                f"`{run_flag([2, num_layers // 2, num_layers - 3] + (keep or [num_layers]))}`"
            )
        check_one_lower(aux, num_layers, path, "ModelOpt names aux layers (decoder layers from 0)")

    @staticmethod
    def auto_dtype(meta: StoreMeta) -> tuple[str, str]:
        """(--dtype auto's choice, why)."""
        return meta.dtype, "the stored dtype, as ModelOpt's dump scripts write the verifier's own"

    @staticmethod
    def dtype_note(dtype: str) -> str | None:
        return None

    @staticmethod
    def draft_config(aux_layers: tuple[int, ...]) -> dict:
        """The layer ids its eagle config names (docs/export.md, "Layer indices")."""
        # ModelOpt hooks base_model.layers[i]: the output of decoder layer i counted from 0, HF index - 1.
        return {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux_layers]}

    @staticmethod
    def draft_note(aux_layers: tuple[int, ...]) -> str:
        ids = [k - 1 for k in aux_layers]
        return (
            f"ModelOpt eagle config: \"eagle_aux_hidden_state_layer_ids\": {ids} (decoder layers counted from 0, one "
            f"lower than HF: HF layers {list(aux_layers)}); train with data.offline_data_path=DIR and "
            "training.answer_only_loss=true to use the loss masks"
        )
