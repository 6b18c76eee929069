"""What `corecap export` writes, decided before it writes anything (docs/export.md): the layers
and dtype of the export, or a one-line refusal saying what the store lacks for the format. What
each trainer needs is its own module's (corecap/export/formats.py lists them); this is the part
they share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corecap.config import PRENORM, Layer, parse_layers
from corecap.dtypes import DTYPES
from corecap.errors import CorecapError
from corecap.export.formats import FORMATS, LAYOUTS
from corecap.export.layers import run_flag
from corecap.store.format import FP8 as FP8_CODEC
from corecap.store.format import StoreMeta

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "fp8")
FP8 = "fp8"  # --dtype fp8: speculators' per-token fp8 files (corecap/export/fp8_per_token.py)
EXPORT_DTYPES = {**DTYPES, FP8: torch.float8_e4m3fn}  # what a layout's write() is given


@dataclass(frozen=True, kw_only=True)
class ExportPlan:
    fmt: str
    aux_layers: tuple[int, ...]
    final_layer: Layer | None  # speculators: PRENORM; SpecForge: N; DFlash: none
    positions: tuple[int, ...]  # indices into the stored layers: the aux layers, then the final one if any
    dtype: str
    notes: tuple[str, ...]  # what the user should know (dtype, lossy fp8)
    hidden_size: int = 0  # the store's; a layout that places rows by their size (DeepSpec) needs it
    model_path: str = ""  # the store's model, as recorded (DeepSpec's manifest names it)

    def draft_config(self) -> dict:
        """The layer ids each trainer's draft config names (docs/export.md, "Layer indices")."""
        return LAYOUTS[self.fmt].draft_config(self.aux_layers)


def plan_export(meta: StoreMeta, path: str, fmt: str, aux_layers: str | None = None, dtype: str = "auto") -> ExportPlan:
    """What the export writes, or a CorecapError saying what the store lacks for `fmt`."""
    if fmt not in FORMATS:
        raise CorecapError(f"--format {fmt!r}: expected one of {list(FORMATS)}")
    if dtype not in DTYPE_CHOICES:
        raise CorecapError(f"--dtype {dtype!r}: expected one of {list(DTYPE_CHOICES)}")
    layout = LAYOUTS[fmt]
    only = getattr(layout, "only_dtype", None)
    if only is not None and dtype not in ("auto", only):
        raise CorecapError(f"--dtype {dtype}: --format {fmt} holds {only} only (its reader refuses any other dtype)")
    if dtype == FP8 and not layout.writes_fp8:
        raise CorecapError(f"--dtype fp8: only --format speculators writes fp8 files (hs_connectors' per-token "
                           f"layout, which speculators reads); --format {fmt} takes bfloat16, float16 or float32")
    num_layers, stored = meta.model.num_layers, tuple(meta.layers)
    ints = [k for k in stored if k != PRENORM]
    final = layout.final_layer(meta, path)
    if aux_layers is None:
        aux = tuple(k for k in ints if k != num_layers)
    else:
        aux = parse_layers(aux_layers)
        if len(set(aux)) != len(aux) or PRENORM in aux:
            raise CorecapError(f"--aux-layers {aux_layers!r}: expected distinct HF indices "
                               "(the final state is added by the format)")
        missing = [k for k in aux if k not in stored]
        if missing:
            raise CorecapError(
                f"--aux-layers {aux_layers!r}: the store has no layer {missing[0]} (it has {list(stored)}): "
                "capture it with "
                f"`{run_flag(list(stored) + list(missing))}`"
            )
        aux = tuple(sorted(aux))
    layout.check_aux(aux, meta, path)
    notes = []
    if dtype == "auto":
        dtype, why = layout.auto_dtype(meta)
        choose = "" if only is not None else "; --dtype to choose"
        notes.append(f"hidden states exported in {dtype} ({why}{choose})")
    elif (note := layout.dtype_note(dtype)) is not None:
        notes.append(note)
    if dtype == FP8:
        notes.append(f"warning: hidden states quantized from the stored {meta.dtype} to fp8 (lossy: each value within "
                     "2^-4 of itself, or 2^-10 of its token's scale; docs/export.md)")
    elif DTYPES[dtype].itemsize < DTYPES[meta.dtype].itemsize:
        notes.append(f"warning: hidden states rounded from the stored {meta.dtype} to {dtype}")
    if meta.codec == FP8_CODEC and dtype == FP8:
        notes.append(f"warning: the store holds lossy fp8 states ({FP8_CODEC}, a scale per token and layer): "
                     "exported dequantized and quantized again with one scale per token, so rounded twice")
    elif meta.codec == FP8_CODEC:
        notes.append(f"warning: the store holds lossy fp8 states ({FP8_CODEC}): "
                     "exported dequantized, not the captured values")
    positions = tuple(stored.index(k) for k in aux + plan_finals(final))
    return ExportPlan(fmt=fmt, aux_layers=aux, final_layer=final, positions=positions, dtype=dtype, notes=tuple(notes),
                      hidden_size=meta.hidden_size, model_path=meta.model.path)


def plan_finals(final: Layer | None) -> tuple[Layer, ...]:
    """The final state's layer as a tuple: empty for a format that takes none (DFlash)."""
    return () if final is None else (final,)
