"""The one rule the driver's prefix tracker (corecap/_vllm/prefix_tracker.py) and the sink's
states cache (corecap/sink/prefix_cache.py) both apply to the same steps, so that they count the
same productions of each cached block: a block is produced when a step computes its last
position, which is when vLLM caches it under its hash."""

from __future__ import annotations


def completed_blocks(start: int, end: int, block_size: int, num_hashes: int) -> range:
    """The full blocks whose last position lies in [start, end): the blocks a step that computes
    those positions completes (vLLM caches each, under its hash, in that step)."""
    return range(start // block_size, min(end // block_size, num_hashes))
