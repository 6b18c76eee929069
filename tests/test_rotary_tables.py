"""corecap/_vllm/rotary_tables.py on vLLM's own rotary embeddings (plain, and DeepSeek's YaRN
that Kimi-K2.5 uses), without an engine: a table off from position 64 on (what some engines
built on a CPU with AMX: docs/tests.md) is rebuilt in place and named once however many layers
share it; a table as defined, one on another device and one of a builder that takes arguments
are left alone; the rebuild runs on one thread and puts the thread count back. CI runs this file
on every vLLM release of its version matrix."""

from __future__ import annotations

import pytest
import torch

from corecap._vllm.rotary_tables import TOLERANCE, rebuild_off_tables

pytestmark = pytest.mark.matrix


def _rotary(kind: str = "plain"):
    """vLLM's own rotary embedding, built as a model's constructor builds it (inside a config):
    `plain` (Llama's, the tiny DeepSeek-V3's: 512 positions) or `yarn` (DeepSeek-V3's and
    Kimi-K2.5's YaRN scaling: 128 original positions times 4)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        if kind == "yarn":
            return DeepseekScalingRotaryEmbedding(64, 64, 128, 10000.0, False, 4.0, torch.float32, mscale=1.0,
                                                  mscale_all_dim=1.0)
        return RotaryEmbedding(64, 64, 512, 10000.0, False, torch.float32)


class _Decoder(torch.nn.Module):
    """Two layers sharing one rotary module, as vLLM's models do."""

    def __init__(self, rotary):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        for layer in self.layers:
            layer.rotary_emb = rotary


@pytest.mark.parametrize("kind, name", [("plain", "RotaryEmbedding"), ("yarn", "DeepseekScalingRotaryEmbedding")])
def test_an_off_table_is_rebuilt_in_place_and_named_once(kind, name):
    rotary = _rotary(kind)
    table = rotary.cos_sin_cache
    held = table  # what a layer holding the table itself sees
    defined = rotary._compute_cos_sin_cache()
    table[64:] += 1.5e-4
    lines = rebuild_off_tables(_Decoder(rotary))
    assert len(lines) == 1
    assert lines[0].startswith(f"layers.0.rotary_emb ({name}, (512, 64)): off by up to 1.5")
    assert "from position 64 on, rebuilt" in lines[0]
    assert rotary.cos_sin_cache is held
    assert torch.equal(held, defined)


def test_a_table_as_defined_is_left_alone():
    rotary = _rotary()
    before = rotary.cos_sin_cache.clone()
    rotary.cos_sin_cache[100:] += TOLERANCE / 2  # within the tolerance
    expected = rotary.cos_sin_cache.clone()
    assert rebuild_off_tables(_Decoder(rotary)) == []
    assert torch.equal(rotary.cos_sin_cache, expected)
    assert not torch.equal(expected, before)


def test_tables_elsewhere_and_other_builders_are_left_alone():
    meta = _rotary()
    meta.cos_sin_cache = torch.empty_like(meta.cos_sin_cache, device="meta")

    class TwoTables(torch.nn.Module):  # Phi-3's long RoPE builds its tables from arguments
        def __init__(self):
            super().__init__()
            self.cos_sin_cache = torch.zeros(8, 4)

        def _compute_cos_sin_cache(self, max_positions, factors):
            raise AssertionError("called without its arguments")

    model = torch.nn.ModuleDict({"meta": meta, "phi": TwoTables()})
    assert rebuild_off_tables(model) == []
    assert torch.equal(model["phi"].cos_sin_cache, torch.zeros(8, 4))


def test_the_rebuild_runs_on_one_thread_and_puts_the_count_back():
    rotary = _rotary()
    seen = []
    build = rotary._compute_cos_sin_cache
    rotary._compute_cos_sin_cache = lambda: (seen.append(torch.get_num_threads()), build())[1]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rebuild_off_tables(_Decoder(rotary))
        assert seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
