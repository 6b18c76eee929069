"""`corecap export --format deepspec`: DeepSpec's target cache (manifest.json, samples.idx,
shard-NNNNN.bin) read back equals the store, and the teacher logits DeepSpec computes from it
(`lm_head(target_last_hidden_states)`, no norm) equal HF's on the verifier, whose final norm is
not all ones. The stores come from conftest's `captured` fixture (no engine).

DeepSpec's own code is NOT run here: it is not on PyPI (a checkout of deepseek-ai/DeepSpec with
a CUDA torch pinned) and CI reaches only PyPI. The files are read by tests/support/
deepspec_reader.py, written from DeepSpec's format (its target_cache_dataset.py), with the
checks its `CacheDataset` makes; docs/export.md says so too.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import corecap.export.deepspec as deepspec_layout
from support.deepspec_reader import TargetCache, collate
from support.exports import exported, exported_mask, interrupt, manifest, refused, relative
from support.verifier import VERIFIER_HIDDEN, VERIFIER_LAYERS, write_captured_store

AUX = (1, 2, 3)  # the captured layers but N and prenorm
N = VERIFIER_LAYERS
SMALL_SHARDS = 30_000  # bytes: a few samples a shard, so that rows cross shards


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(deepspec_layout, "SHARD_BYTES", SMALL_SHARDS)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def test_deepspec_cache_reads_the_store(tmp_path, captured, verifier, small_shards):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "ds"
    result = exported(store, out, "deepspec", "--workers", "3")
    assert "model.target_layer_ids=[0, 1, 2]" in result.output  # HF 1, 2, 3 minus one
    assert f"aux layers {list(AUX)} + {N}, bfloat16" in result.output
    assert "DSpark and DFlash only" in result.output  # 3 layers: not DeepSpec's EAGLE-3 (exactly 5)
    cache = TargetCache(str(out))
    assert cache.manifest["target_layer_ids"] == [0, 1, 2]
    assert cache.manifest["hidden_size"] == VERIFIER_HIDDEN
    assert cache.manifest["target_model_name_or_path"] == verifier  # what its trainer compares with its config
    assert cache.manifest["num_shards"] > 2
    rows = manifest(out)
    assert [r["key"] for r in rows] == sorted(captured) and len(cache) == len(captured)
    items = [cache[i] for i in range(len(cache))]
    for row, item in zip(rows, items):
        ids, mask, ref = captured[row["key"]]
        assert item["input_ids"].dtype == torch.int32 and torch.equal(item["input_ids"], torch.from_numpy(ids))
        assert torch.equal(item["loss_mask"].long(), exported_mask(mask, ids.size))
        assert torch.equal(item["attention_mask"], torch.ones(ids.size, dtype=torch.uint8))
        layers = item["target_hidden_states"].view(ids.size, len(AUX), VERIFIER_HIDDEN)
        for j, k in enumerate(AUX):  # every target layer's slice
            assert torch.equal(layers[:, j], bf16(ref[k]))
        assert torch.equal(item["target_last_hidden_states"], bf16(ref[N]))  # after the final norm
    batch = collate(items)
    for j, row in enumerate(rows):
        ids, mask, ref = captured[row["key"]]
        assert torch.equal(batch["input_ids"][j, : ids.size], torch.from_numpy(ids))
        assert not batch["attention_mask"][j, ids.size :].any()


def _teacher_and_references(out, captured, verifier_model):
    """DeepSpec's teacher (`self.lm_head(target_last_hidden_states)`, in float32 here) over every
    token, HF's logits of the same state rounded to bf16 as the cache holds it, and HF's own."""
    cache, rows = TargetCache(str(out)), manifest(out)
    lm_head = verifier_model.lm_head
    with torch.no_grad():
        teacher = torch.cat([lm_head(cache[i]["target_last_hidden_states"].float()) for i in range(len(cache))])
        rounded = torch.cat([lm_head(bf16(captured[r["key"]][2][N]).float()) for r in rows])
    hf = torch.cat([captured[r["key"]][2]["logits"] for r in rows])
    return teacher, rounded, hf


def test_deepspec_teacher_logits_equal_hf(tmp_path, captured, verifier, verifier_model):
    """The teacher's logits are HF's from the bf16 state to float32 precision, and HF's own within
    bf16's rounding of the state; the prenorm state in its place (the norm's weights are not all
    ones) is far off, so the check sees which state was written."""
    norm = verifier_model.model.norm.weight
    assert not torch.allclose(norm, torch.ones_like(norm))
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    exported(store, tmp_path / "ds", "deepspec")
    teacher, rounded, hf = _teacher_and_references(tmp_path / "ds", captured, verifier_model)
    assert relative(teacher, rounded) < 1e-6, relative(teacher, rounded)
    assert relative(teacher, hf) < 2**-7, relative(teacher, hf)
    wrong = write_captured_store(str(tmp_path / "w"), captured, verifier, replace={N: "prenorm"})
    exported(wrong, tmp_path / "wrong", "deepspec")
    teacher, _, hf = _teacher_and_references(tmp_path / "wrong", captured, verifier_model)
    assert relative(teacher, hf) > 0.05


def test_deepspec_bfloat16_store_and_target_layers(tmp_path, captured, verifier):
    """A bf16 store is written bit for bit; --aux-layers chooses the target layers, the
    embeddings named -1 as DeepSpec's own capture names them."""
    from corecap.store import Store

    layers = (0, 1, 2, 3, N, "prenorm")
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, dtype=torch.bfloat16, layers=layers)
    out = tmp_path / "ds"
    result = exported(store, out, "deepspec", "--aux-layers", "3,0")
    assert "model.target_layer_ids=[-1, 2]" in result.output
    cache = TargetCache(str(out))
    assert cache.manifest["target_layer_ids"] == [-1, 2] and cache.manifest["num_shards"] == 1
    with Store.open(store) as s:
        for i, row in enumerate(manifest(out)):
            stored = s.get(row["key"]).hidden_states  # [L, T, H]: layers 0, 1, 2, 3, N, prenorm
            item = cache[i]
            assert torch.equal(item["target_hidden_states"], torch.cat([stored[0], stored[3]], dim=-1))
            assert torch.equal(item["target_last_hidden_states"], stored[4])


def test_deepspec_refusals_name_the_flag_that_captures_it(tmp_path, captured, verifier):
    no_final = write_captured_store(str(tmp_path / "a"), captured, verifier, layers=(1, 2, 3, "prenorm"))
    line = refused(tmp_path, no_final, "deepspec")
    assert f"needs layer {N} (the final hidden state after the norm, DeepSpec's target_last_hidden_states)" in line
    assert "`corecap run --layers 1,2,3,4`" in line
    no_aux = write_captured_store(str(tmp_path / "b"), captured, verifier, layers=(N, "prenorm"))
    line = refused(tmp_path, no_aux, "deepspec")
    assert "needs at least one target layer" in line and "`corecap run --layers 1,2,4,prenorm`" in line
    store = write_captured_store(str(tmp_path / "c"), captured, verifier)
    assert "--format deepspec holds bfloat16 only" in refused(tmp_path, store, "deepspec", "--dtype", "float32")
    assert "--format deepspec holds bfloat16 only" in refused(tmp_path, store, "deepspec", "--dtype", "fp8")


def test_an_interrupted_deepspec_export_resumes_keeping_its_complete_shards(tmp_path, captured, verifier, monkeypatch,
                                                                            small_shards):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    clean, out = tmp_path / "clean", tmp_path / "out"
    exported(store, clean, "deepspec")
    interrupt(store, out, "deepspec", monkeypatch, after=7)
    partial = tmp_path / "out.partial"
    kept = {p.name: p.stat().st_ino for p in partial.glob("shard-*.bin")}
    assert kept and not out.exists()
    num_kept = sum(r["file"] in kept for r in manifest(clean))
    assert 0 < num_kept <= 7
    result = exported(store, out, "deepspec")
    assert f"{num_kept} kept from an interrupted export" in result.output
    assert {name: (out / name).stat().st_ino for name in kept} == kept  # kept, not rewritten
    names = ["manifest.json", "samples.idx", *(p.name for p in clean.glob("shard-*.bin"))]
    assert {n: (out / n).read_bytes() for n in names} == {n: (clean / n).read_bytes() for n in names}
    assert json.loads((out / "manifest.json").read_text())["num_samples"] == len(captured)
    assert np.array_equal(np.fromfile(out / "samples.idx", np.uint8), np.fromfile(clean / "samples.idx", np.uint8))
