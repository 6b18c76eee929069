"""SpecForge's offline layout (`corecap export --format specforge`), written one sample file at a
time (corecap/export/driver.py walks the store; docs/export.md has literal examples), and what
it needs from a store.

SpecForge 0.2.0 (`specforge.runtime.data_plane.offline_reader.OfflineManifestReader`):
    DIR/rows_{a:08d}-{b:08d}/data_{row:08d}.ckpt
                              torch.save of {input_ids [T] int64, loss_mask [T] int64,
                              aux_hidden_state [1, T, 3H] (three aux layers concatenated, ascending),
                              hidden_state [1, T, H] AFTER the final norm}. SpecForge finds the files
                              by suffix and sorts their paths as strings: zero-padded numbers keep
                              that order the row order.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from corecap.config import PRENORM, Layer
from corecap.errors import CorecapError
from corecap.export.files import scratch_tensor
from corecap.export.layers import check_one_lower, require_after_norm, run_flag
from corecap.store.format import StoreMeta

FILE_GROUP = 2000  # SpecForge files per directory, as SpecForge's own prepare_hidden_states groups them


class SpecForge:
    """rows_{a}-{b}/data_{row}.ckpt per sample; no table (SpecForge lists the files)."""

    name = "specforge"
    writes_fp8 = False  # --dtype fp8 is speculators' only (its hs_connectors fp8 files)

    def __init__(self, root: str, plan=None):
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

    ineligible = ""  # every sample is kept

    @staticmethod
    def keeps(mask: np.ndarray) -> bool:
        return True

    @staticmethod
    def images_note() -> str:
        return ""

    def add_row(self, ids: np.ndarray, mask: np.ndarray, key: str = "", header=None) -> None:
        directory = os.path.dirname(self.path(self.num_rows))
        if directory not in self._made:
            os.makedirs(os.path.join(self.root, directory), exist_ok=True)
            self._made.add(directory)
        self.num_rows += 1

    def finish(self) -> None:
        pass

    # --- the plan: what SpecForge needs from a store (corecap/export/plan.py asks) ---

    @staticmethod
    def final_layer(meta: StoreMeta, path: str) -> Layer:
        """SpecForge's hidden_state: HF's hidden_states[N], after the final norm."""
        return require_after_norm(meta, path, "specforge", "SpecForge's hidden_state")

    @staticmethod
    def check_aux(aux: tuple[int, ...], meta: StoreMeta, path: str) -> None:
        num_layers, stored = meta.model.num_layers, tuple(meta.layers)
        if len(aux) != 3:
            given = (f"{path}: --format specforge trains on exactly 3 aux layers, the store gives {len(aux)} "
                     f"({list(aux)}, besides {num_layers} and {PRENORM})")
            if len(aux) > 3:
                pick = _three(aux, num_layers)
                raise CorecapError(f"{given}: choose three with --aux-layers, "
                                   f"e.g. --aux-layers {','.join(map(str, pick))}")
            keep = [PRENORM] if PRENORM in stored else []
            raise CorecapError(f"{given}: capture three with "
                               f"`{run_flag(_three(aux, num_layers) + [num_layers] + keep)}`")
        check_one_lower(aux, num_layers, path, "SpecForge names aux layers")

    @staticmethod
    def auto_dtype(meta: StoreMeta) -> tuple[str, str]:
        """(--dtype auto's choice, why)."""
        return "bfloat16", "SpecForge's target head runs in bfloat16 and fails on other dtypes"

    @staticmethod
    def dtype_note(dtype: str) -> str | None:
        if dtype != "bfloat16":
            return (f"hidden states exported in {dtype}: SpecForge's trainer needs bfloat16 "
                    f"(its target head fails on {dtype})")
        return None

    @staticmethod
    def draft_config(aux_layers: tuple[int, ...]) -> dict:
        """The layer ids its draft config names (docs/export.md, "Layer indices")."""
        # SGLang's id j is captured before layer j + 1: HF index - 1
        return {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux_layers]}

    @staticmethod
    def draft_note(aux_layers: tuple[int, ...]) -> str:
        ids = [k - 1 for k in aux_layers]
        return (
            f"SpecForge draft config: \"eagle_aux_hidden_state_layer_ids\": {ids} "
            f"(SGLang counts one lower than HF: HF layers {list(aux_layers)})"
        )


def _three(have, num_layers: int) -> list[int]:
    """Three aux layers SpecForge can name (1..N-1): those in `have` first (EAGLE-3's 2, N//2,
    N-3 among them before others), then EAGLE-3's, then any."""
    eagle3 = (2, num_layers // 2, num_layers - 3)
    valid = [k for k in have if 1 <= k < num_layers]
    order = [k for k in eagle3 if k in valid] + valid + list(eagle3) + list(range(1, num_layers))
    pick = []
    for k in order:
        if 1 <= k < num_layers and k not in pick:
            pick.append(k)
    return sorted(pick[:3])
