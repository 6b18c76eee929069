"""Tiny Llamas built from a fixed seed and saved as HF checkpoints (never downloaded), and the
prompts the exactness scripts capture."""

from __future__ import annotations

import json
import os


def tiny_llama(path: str, seed: int = 0, **config) -> str:
    """A float32 Llama of `config` (LlamaConfig's fields) at path, built once: the same seed and
    shape give the same weights."""
    import torch
    import transformers

    if not os.path.exists(os.path.join(path, "config.json")):
        fields = dict(bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **config)
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).to(torch.float32).save_pretrained(path)
    return path


def exactness_rows(vocab: int, low: int, max_random: int) -> list[dict]:
    """The rows an exactness check captures: one token, a prompt longer than a step's token budget
    (chunked prefill), two sharing a 300-token prefix, two identical, and 24 random ones of
    2..max_random tokens; ids from `low` (the prefix and duplicates from 3)."""
    import numpy as np

    rng = np.random.default_rng(1234)
    prefix = rng.integers(3, vocab, size=300).tolist()
    dup = rng.integers(3, vocab, size=200).tolist()
    out = [
        {"id": "one", "input_ids": [7]},
        {"id": "long-chunked", "input_ids": rng.integers(low, vocab, size=700).tolist()},
        {"id": "prefix-a", "input_ids": prefix + rng.integers(low, vocab, size=50).tolist()},
        {"id": "prefix-b", "input_ids": prefix + rng.integers(low, vocab, size=90).tolist()},
        {"id": "dup-1", "input_ids": dup},
        {"id": "dup-2", "input_ids": dup},
    ]
    sizes = rng.integers(2, max_random, size=24)
    randoms = [rng.integers(low, vocab, size=int(n)).tolist() for n in sizes]
    return out + [{"id": f"rand-{i}", "input_ids": ids} for i, ids in enumerate(randoms)]


def write_rows(path: str, rows: list[dict]) -> str:
    """rows as JSONL at path (corecap's --data), which it returns."""
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path
