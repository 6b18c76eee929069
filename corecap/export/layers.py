"""How each trainer names a layer (docs/export.md, "Layer indices"), and the `corecap run --layers`
that would capture what a store lacks.

HF index k (corecap's layers) is vLLM's and speculators' aux id k, and SpecForge's (SGLang's) id
k - 1; speculators' verifier state is corecap's "prenorm" (vLLM's id N, before the final norm),
SpecForge's hidden_state is HF's hidden_states[N] (after it).
"""

from __future__ import annotations

from corecap.config import PRENORM, Layer, layer_order
from corecap.errors import CorecapError


def run_flag(layers) -> str:
    return "corecap run --layers " + ",".join(str(k) for k in sorted(set(layers), key=layer_order))


def require_after_norm(meta, path: str, fmt: str, named: str) -> int:
    """HF's hidden_states[N] (after the final norm), which `fmt` exports as `named`: N, or a one-line
    refusal naming the `corecap run --layers` that would capture it."""
    num_layers, stored = meta.model.num_layers, tuple(meta.layers)
    if num_layers not in stored:
        ints = [k for k in stored if k != PRENORM]
        raise CorecapError(
            f"{path}: --format {fmt} needs layer {num_layers} (the final hidden state after the norm, {named}); "
            f"the store has layers {list(stored)}: capture it with `{run_flag(ints + [num_layers])}`"
        )
    return num_layers


def check_one_lower(aux: tuple[int, ...], num_layers: int, path: str, named: str) -> None:
    """Refuse aux layers that a trainer naming decoder outputs from 0 (HF index - 1: SpecForge,
    ModelOpt) cannot name: HF's 0 (the embeddings) and N. `named`: how the message says it, e.g.
    "SpecForge names aux layers"."""
    if not all(1 <= k < num_layers for k in aux):
        raise CorecapError(
            f"{path}: {named} by HF index - 1 (0..{num_layers - 2}), so HF layers {list(aux)} "
            f"cannot all be named: choose --aux-layers among 1..{num_layers - 1}"
        )


def describe_layer(layer: Layer, aux: bool, num_layers: int) -> dict:
    """One exported layer in every convention (docs/export.md, "Layer indices")."""
    if layer == PRENORM:
        return {"layer": PRENORM, "role": "final",
                "meaning": f"output of decoder layer {num_layers} before the final norm",
                "vllm_id": num_layers, "specforge_id": None}
    if not aux:
        return {"layer": layer, "role": "final", "meaning": f"HF hidden_states[{layer}]: after the final norm",
                "vllm_id": None, "specforge_id": None}
    meaning = "the token embeddings" if layer == 0 else f"output of decoder layer {layer}"
    return {"layer": layer, "role": "aux", "meaning": f"HF hidden_states[{layer}]: {meaning}",
            "vllm_id": layer, "specforge_id": layer - 1 if layer >= 1 else None}
