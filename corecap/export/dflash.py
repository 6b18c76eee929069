"""SpecForge's DFlash-family offline layouts (`corecap export --format specforge-dflash`, for
DFlash and Domino drafts, and `--format specforge-dspark`), written one sample file at a time
(corecap/export/driver.py walks the store; docs/export.md has literal examples), and what they
need from a store. The files are placed and named as SpecForge's EAGLE-3 files are
(corecap/export/specforge.py): its one offline reader lists every `*.ckpt` under the directory.

SpecForge 0.2.0 (`specforge.algorithms.common.dflash_family_data`, the normalizers its DFlash,
Domino and DSpark providers register):
    DIR/rows_{a:08d}-{b:08d}/data_{row:08d}.ckpt
        DFlash, Domino: torch.save of {input_ids [T] int64, loss_mask [T] int64,
                        hidden_states [T, kH] (the draft's target layers concatenated, ascending)}
        DSpark:         the same and target_last_hidden_states [T, H], AFTER the final norm (its
                        teacher is lm_head(target_last_hidden_states), with no norm)
Its normalizer refuses a sample without two consecutive trained-on tokens (its own data
preparation filters them out first): such samples are left out, and counted.
"""

from __future__ import annotations

import numpy as np
import torch

from corecap.config import PRENORM, Layer
from corecap.errors import CorecapError
from corecap.export.files import scratch_tensor
from corecap.export.layers import check_one_lower, require_after_norm, run_flag
from corecap.export.specforge import SpecForge
from corecap.store.format import StoreMeta


class SpecForgeDFlash(SpecForge):
    """data_{row}.ckpt per sample, as SpecForge's EAGLE-3 layout places them, holding the
    target layers only (DFlash's drafts predict tokens, with no teacher state)."""

    name = "specforge-dflash"
    ineligible = "without two consecutive trained-on tokens (SpecForge's DFlash-family normalizer refuses them)"

    @staticmethod
    def keeps(mask: np.ndarray) -> bool:
        # specforge.data.loss_mask.has_consecutive_supervised_tokens, which its normalizer applies
        trained = mask != 0
        return bool(np.any(trained[:-1] & trained[1:]))

    def write(self, tmp: str, ids: np.ndarray, mask: np.ndarray, states: torch.Tensor, positions, dtype) -> None:
        torch.save(self._record(ids, mask, states, positions, dtype), tmp)

    def _record(self, ids: np.ndarray, mask: np.ndarray, states: torch.Tensor, positions, dtype) -> dict:
        num_tokens, hidden = states.shape[1], states.shape[2]
        layers = scratch_tensor((num_tokens, len(positions) * hidden), dtype, 0)
        for j, p in enumerate(positions):
            layers[:, j * hidden : (j + 1) * hidden].copy_(states[p])
        return {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.int64)),
            "hidden_states": layers,
        }

    # --- the plan: what DFlash needs from a store (corecap/export/plan.py asks) ---

    @staticmethod
    def final_layer(meta: StoreMeta, path: str) -> Layer | None:
        return None  # no teacher state: DFlash's loss is on the tokens

    @staticmethod
    def check_aux(aux: tuple[int, ...], meta: StoreMeta, path: str, fmt: str = "specforge-dflash") -> None:
        num_layers, stored = meta.model.num_layers, tuple(meta.layers)
        if not aux:
            raise CorecapError(
                f"{path}: --format {fmt} needs at least one target layer besides {num_layers} and {PRENORM}; the store "
                f"has {list(stored)}: capture some with "
                f"`{run_flag([2, num_layers // 2, num_layers - 3] + list(stored))}`"
            )
        check_one_lower(aux, num_layers, path, "SpecForge names target layers")

    @staticmethod
    def auto_dtype(meta: StoreMeta) -> tuple[str, str]:
        """(--dtype auto's choice, why)."""
        return "bfloat16", "as SpecForge's own capture of a bf16 model writes them"

    @staticmethod
    def dtype_note(dtype: str) -> str | None:
        return None

    @staticmethod
    def draft_config(aux_layers: tuple[int, ...]) -> dict:
        """The layer ids its draft config names (docs/export.md, "Layer indices")."""
        # extract_context_feature reads HF hidden_states[id + 1]: HF index - 1
        return {"dflash_config": {"target_layer_ids": [k - 1 for k in aux_layers]}}

    @staticmethod
    def draft_note(aux_layers: tuple[int, ...]) -> str:
        ids = [k - 1 for k in aux_layers]
        return (
            f"SpecForge draft config: \"dflash_config\": {{\"target_layer_ids\": {ids}}} (decoder layers counted "
            f"from 0, one lower than HF: HF layers {list(aux_layers)})"
        )


class SpecForgeDSpark(SpecForgeDFlash):
    """DFlash's file and the verifier's last state after the norm, DSpark's teacher."""

    name = "specforge-dspark"

    def write(self, tmp: str, ids: np.ndarray, mask: np.ndarray, states: torch.Tensor, positions, dtype) -> None:
        *aux, final = positions
        record = self._record(ids, mask, states, aux, dtype)
        # A tensor of its own, not a view of the states: torch.save stores a view's whole storage.
        last = scratch_tensor((states.shape[1], states.shape[2]), dtype, 1)
        last.copy_(states[final])
        record["target_last_hidden_states"] = last
        torch.save(record, tmp)

    @staticmethod
    def final_layer(meta: StoreMeta, path: str) -> Layer:
        """DSpark's target_last_hidden_states: HF's hidden_states[N], after the final norm."""
        return require_after_norm(meta, path, "specforge-dspark", "DSpark's target_last_hidden_states")

    @staticmethod
    def check_aux(aux: tuple[int, ...], meta: StoreMeta, path: str, fmt: str = "specforge-dspark") -> None:
        SpecForgeDFlash.check_aux(aux, meta, path, fmt)
