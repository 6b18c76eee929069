"""What each trainer needs from a store, and how each names layers (docs/export.md): the checks
`corecap export` makes before it writes anything, and the layer ids a draft config then needs.

HF index k (corecap's layers) is vLLM's and speculators' aux id k, and SpecForge's (SGLang's) id
k - 1; speculators' verifier state is corecap's "prenorm" (vLLM's id N, before the final norm),
SpecForge's hidden_state is HF's hidden_states[N] (after it).
"""

from __future__ import annotations

from dataclasses import dataclass

from corecap.config import PRENORM, Layer, layer_order, parse_layers
from corecap.errors import CorecapError
from corecap.store.codec import DTYPES
from corecap.store.format import FP8, StoreMeta

FORMATS = ("speculators", "specforge")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ExportPlan:
    fmt: str
    aux_layers: tuple[int, ...]
    final_layer: Layer  # speculators: PRENORM; SpecForge: N
    positions: tuple[int, ...]  # indices into the stored layers: the aux layers, then the final one
    dtype: str
    notes: tuple[str, ...]  # what the user should know (dtype, lossy fp8)

    def draft_config(self) -> dict:
        """The layer ids each trainer's draft config names (docs/export.md, "Layer indices")."""
        if self.fmt == "specforge":  # SGLang's id j is captured before layer j + 1: HF index - 1
            return {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in self.aux_layers]}
        return {"target_layer_ids": list(self.aux_layers)}  # vLLM's ids are HF's indices


def _run_flag(layers) -> str:
    return "corecap run --layers " + ",".join(str(k) for k in sorted(set(layers), key=layer_order))


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


def plan_export(meta: StoreMeta, path: str, fmt: str, aux_layers: str | None = None, dtype: str = "auto") -> ExportPlan:
    """What the export writes, or a CorecapError saying what the store lacks for `fmt`."""
    if fmt not in FORMATS:
        raise CorecapError(f"--format {fmt!r}: expected one of {list(FORMATS)}")
    if dtype not in DTYPE_CHOICES:
        raise CorecapError(f"--dtype {dtype!r}: expected one of {list(DTYPE_CHOICES)}")
    num_layers, stored = meta.model.num_layers, tuple(meta.layers)
    ints = [k for k in stored if k != PRENORM]
    if fmt == "speculators":
        final = PRENORM
        if PRENORM not in stored:
            raise CorecapError(
                f"{path}: --format speculators needs the '{PRENORM}' layer (the last decoder layer's output before the "
                f"final norm, which speculators applies itself); the store has layers {list(stored)}: capture it with "
                f"`{_run_flag(ints + [PRENORM])}`"
            )
    else:
        final = num_layers
        if num_layers not in stored:
            raise CorecapError(
                f"{path}: --format specforge needs layer {num_layers} (the final hidden state after the norm, SpecForge's "
                f"hidden_state); the store has layers {list(stored)}: capture it with `{_run_flag(ints + [num_layers])}`"
            )
    if aux_layers is None:
        aux = tuple(k for k in ints if k != num_layers)
    else:
        aux = parse_layers(aux_layers)
        if len(set(aux)) != len(aux) or PRENORM in aux:
            raise CorecapError(f"--aux-layers {aux_layers!r}: expected distinct HF indices (the final state is added by the format)")
        missing = [k for k in aux if k not in stored]
        if missing:
            raise CorecapError(
                f"--aux-layers {aux_layers!r}: the store has no layer {missing[0]} (it has {list(stored)}): capture it with "
                f"`{_run_flag(list(stored) + list(missing))}`"
            )
        aux = tuple(sorted(aux))
    if fmt == "specforge":
        if len(aux) != 3:
            given = f"{path}: --format specforge trains on exactly 3 aux layers, the store gives {len(aux)} ({list(aux)}, besides {num_layers} and {PRENORM})"
            if len(aux) > 3:
                pick = _three(aux, num_layers)
                raise CorecapError(f"{given}: choose three with --aux-layers, e.g. --aux-layers {','.join(map(str, pick))}")
            keep = [PRENORM] if PRENORM in stored else []
            raise CorecapError(f"{given}: capture three with `{_run_flag(_three(aux, num_layers) + [num_layers] + keep)}`")
        if not all(1 <= k < num_layers for k in aux):
            raise CorecapError(
                f"{path}: SpecForge names aux layers by HF index - 1 (0..{num_layers - 2}), so HF layers {list(aux)} cannot all "
                f"be named: choose --aux-layers among 1..{num_layers - 1}"
            )
    elif not aux:
        raise CorecapError(
            f"{path}: --format speculators needs at least one aux layer besides {PRENORM}; the store has {list(stored)}: "
            f"capture some with `{_run_flag([2, num_layers // 2, num_layers - 3, PRENORM])}`"
        )
    notes = []
    if dtype == "auto":
        dtype = "bfloat16" if fmt == "specforge" else meta.dtype
        why = "SpecForge's target head runs in bfloat16 and fails on other dtypes" if fmt == "specforge" else (
            "the stored dtype; speculators casts to its --hidden-states-dtype, bfloat16 by default")
        notes.append(f"hidden states exported in {dtype} ({why}; --dtype to choose)")
    elif fmt == "specforge" and dtype != "bfloat16":
        notes.append(f"hidden states exported in {dtype}: SpecForge's trainer needs bfloat16 (its target head fails on {dtype})")
    if DTYPES[dtype].itemsize < DTYPES[meta.dtype].itemsize:
        notes.append(f"warning: hidden states rounded from the stored {meta.dtype} to {dtype}")
    if meta.codec == FP8:
        notes.append(f"warning: the store holds lossy fp8 states ({FP8}): exported dequantized, not the captured values")
    positions = tuple(stored.index(k) for k in aux + (final,))
    return ExportPlan(fmt, aux, final, positions, dtype, tuple(notes))


def describe_layer(layer: Layer, aux: bool, num_layers: int) -> dict:
    """One exported layer in every convention (docs/export.md, "Layer indices")."""
    if layer == PRENORM:
        return {"layer": PRENORM, "role": "final", "meaning": f"output of decoder layer {num_layers} before the final norm",
                "vllm_id": num_layers, "specforge_id": None}
    if not aux:
        return {"layer": layer, "role": "final", "meaning": f"HF hidden_states[{layer}]: after the final norm",
                "vllm_id": None, "specforge_id": None}
    meaning = "the token embeddings" if layer == 0 else f"output of decoder layer {layer}"
    return {"layer": layer, "role": "aux", "meaning": f"HF hidden_states[{layer}]: {meaning}",
            "vllm_id": layer, "specforge_id": layer - 1 if layer >= 1 else None}
