"""`corecap export --format specforge-dflash|specforge-dspark`: what SpecForge 0.2.0's OWN
offline path for its DFlash-family drafts reads (the reader, normalizer and collator its DFlash
and DSpark providers register, fed to FeatureDataLoader as launch.build_offline_runtime does)
equals the store, and DSpark's teacher logits (lm_head of the target state its
`_aligned_target_hidden` picks for each label, with SpecForge's own target lm_head) equal HF's
on the verifier, whose final norm is not all ones. DFlash's files hold no teacher state: its
loss is on the tokens. The stores come from conftest's `captured` fixture (no engine).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from support.exports import exported, exported_mask, interrupt, manifest, refused, relative
from support.reference import record_error, relative_errors
from support.verifier import VERIFIER_HIDDEN, VERIFIER_LAYERS, write_captured_store

AUX = (1, 2, 3)  # the captured layers but N and prenorm
N = VERIFIER_LAYERS
FORMATS = {"specforge-dflash": "dflash", "specforge-dspark": "dspark"}  # corecap's name → SpecForge's algorithm


def _provider(algorithm: str):
    """The offline data provider SpecForge registers for `algorithm` (text)."""
    if algorithm == "dflash":
        from specforge.algorithms.dflash.providers import create_registration
    else:
        from specforge.algorithms.dspark.providers import create_registration
    return create_registration().providers.offline_for("text")


def _loader(out, algorithm: str, max_len=512, batch_size=4):
    """SpecForge's offline loader as launch.build_offline_runtime assembles it."""
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    provider = _provider(algorithm)
    refs = provider.build_reader(str(out), run_id="t", ttt_length=7, max_len=max_len).read()
    loader = FeatureDataLoader(
        LocalFeatureStore("t"), refs=refs, batch_size=batch_size, collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(max_len, ttt_length=7, use_usp_preprocess=False),
        drop_last=False, strategy=algorithm,
    )
    return refs, loader


def _eligible(captured) -> list[str]:
    """The keys SpecForge's own data preparation keeps for DFlash-family drafts (its filter, on
    the mask as exported: the stored one, or all ones)."""
    from specforge.data.loss_mask import has_consecutive_supervised_tokens

    return [
        k for k in sorted(captured)
        if has_consecutive_supervised_tokens(exported_mask(captured[k][1], captured[k][0].size))
    ]


def _with_alternating_mask(captured) -> dict:
    """`captured` with one more sample whose every other token is trained on: trained tokens,
    but no two consecutive ones, which SpecForge's DFlash-family normalizer refuses."""
    ids, _, ref = captured[sorted(captured)[1]]
    return {**captured, "alternating": (ids, (np.arange(ids.size) % 2).astype(np.uint8), ref)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_specforge_dflash_family_loader_reads_the_store(tmp_path, captured, verifier, monkeypatch, fmt):
    import corecap.export.specforge as layouts
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    algorithm = FORMATS[fmt]
    monkeypatch.setattr(layouts, "FILE_GROUP", 4)  # several rows_* directories
    captured = _with_alternating_mask(captured)
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "df"
    result = exported(store, out, fmt, "--dtype", "float32", "--workers", "3")
    assert '"dflash_config": {"target_layer_ids": [0, 1, 2]}' in result.output  # HF 1, 2, 3 minus one
    keep = _eligible(captured)
    assert 0 < len(keep) < len(captured) and "alternating" not in keep  # samples SpecForge would refuse
    assert f"{len(captured) - len(keep)} samples left out: without two consecutive trained-on tokens" in result.output
    rows = manifest(out)
    assert [r["key"] for r in rows] == keep
    refs, loader = _loader(out, algorithm)
    assert [ref.feature_store_uri for ref in refs] == [f"file://{out / r['file']}" for r in rows]  # its order = rows
    last = ("target_last_hidden_states",) if algorithm == "dspark" else ()
    keys = ("input_ids", "loss_mask", "hidden_states") + last
    checked = OfflineManifestReader(
        str(out), run_id="t", strategy=algorithm, feature_keys=keys, validate_files=True
    ).read()
    normalize = _provider(algorithm).build_normalizer(512)
    for r, ref in zip(rows, checked):
        ids, mask, hf = captured[r["key"]]
        assert ref.num_tokens == ids.size
        assert ref.feature_specs["hidden_states"].shape == (ids.size, len(AUX) * VERIFIER_HIDDEN)
        sample = normalize(load_feature_file(str(out / r["file"])))  # raises on a sample it refuses
        assert torch.equal(sample["input_ids"][0], torch.from_numpy(ids.astype(np.int64)))
        assert torch.equal(sample["loss_mask"][0], exported_mask(mask, ids.size))
        assert torch.equal(sample["hidden_states"][0], torch.cat([hf[k] for k in AUX], dim=-1))  # every layer slice
        if algorithm == "dspark":
            assert torch.equal(sample["target_last_hidden_states"][0], hf[N])  # after the final norm
        else:
            assert set(sample) == {"input_ids", "loss_mask", "hidden_states"}
    seen = 0
    for batch in loader:  # the whole loader: padded batches in row order
        t = batch.tensors
        for j, sample_id in enumerate(batch.sample_ids):
            ids, mask, hf = captured[rows[int(sample_id.split(":")[1])]["key"]]
            n = ids.size
            assert torch.equal(t["input_ids"][j, :n], torch.from_numpy(ids.astype(np.int64)))
            assert torch.equal(t["loss_mask"][j, :n], exported_mask(mask, n)) and not t["loss_mask"][j, n:].any()
            assert torch.equal(t["hidden_states"][j, :n], torch.cat([hf[k] for k in AUX], dim=-1))
            if algorithm == "dspark":
                assert torch.equal(t["target_last_hidden_states"][j, :n], hf[N])
            seen += 1
    assert seen == len(keep)


def _dspark_teacher_logits(out, verifier) -> list[tuple[str, torch.Tensor]]:
    """DSpark's teacher logits per sample from its loader's batches: for label position i,
    OnlineDSparkModel._aligned_target_hidden picks the target state at i - 1, and its loss
    applies the target lm_head (SpecForge's TargetEmbeddingsAndHead) to it, with no norm."""
    from specforge.algorithms.common.dflash_family_model import OnlineDSparkModel
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead

    head = TargetEmbeddingsAndHead.from_pretrained(verifier, "model.embed_tokens.weight", "lm_head.weight",
                                                   device="cpu", dtype=torch.float32)
    rows = manifest(out)
    _, loader = _loader(out, "dspark")
    got = []
    for batch in loader:
        target = batch.tensors["target_last_hidden_states"]
        labels = torch.arange(1, target.shape[1]).expand(target.shape[0], -1)  # every position but the first
        with torch.no_grad():
            aligned = OnlineDSparkModel._aligned_target_hidden(None, target, labels)
            logits = head.lm_head(aligned)
        for j, sample_id in enumerate(batch.sample_ids):
            key = rows[int(sample_id.split(":")[1])]["key"]
            got.append((key, logits[j]))
    return got


def test_dspark_teacher_logits_equal_hf(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "ds"
    exported(store, out, "specforge-dspark", "--dtype", "float32")
    for key, logits in _dspark_teacher_logits(out, verifier):
        ref = captured[key][2]["logits"]
        n = ref.shape[0] - 1  # labels 1..T-1, predicted from states 0..T-2
        record_error("export: DSpark teacher logits", *relative_errors(logits[None, :n], ref[None, :n]))
        assert relative(logits[:n], ref[:n]) < 1e-5, relative(logits[:n], ref[:n])


def test_a_pre_norm_last_state_gives_dspark_wrong_logits(tmp_path, captured, verifier):
    """The check above can see the difference: the residual stream before the norm as DSpark's
    target_last_hidden_states (lm_head only) gives other logits."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, replace={N: "prenorm"})
    out = tmp_path / "ds"
    exported(store, out, "specforge-dspark", "--dtype", "float32")
    got = _dspark_teacher_logits(out, verifier)
    logits = torch.cat([g[: captured[k][0].size - 1] for k, g in got])
    ref = torch.cat([captured[k][2]["logits"][:-1] for k, _ in got])
    assert relative(logits, ref) > 0.05


def test_dflash_family_default_is_bfloat16_and_aux_layers_choose(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "df"
    result = exported(store, out, "specforge-dflash", "--aux-layers", "3,1")
    assert "exported in bfloat16" in result.output and '"target_layer_ids": [0, 2]' in result.output
    row = manifest(out)[0]
    record = torch.load(out / row["file"])
    ref = captured[row["key"]][2]
    assert record["hidden_states"].dtype == torch.bfloat16 and "target_last_hidden_states" not in record
    assert torch.equal(record["hidden_states"], torch.cat([ref[1], ref[3]], dim=-1).to(torch.bfloat16))
    assert os.path.basename(row["file"]) == "data_00000000.ckpt"


def test_dflash_family_refusals_name_the_flag_that_captures_it(tmp_path, captured, verifier):
    no_targets = write_captured_store(str(tmp_path / "a"), captured, verifier, layers=(N, "prenorm"))
    line = refused(tmp_path, no_targets, "specforge-dflash")
    assert "needs at least one target layer" in line and "`corecap run --layers 1,2,4,prenorm`" in line
    no_final = write_captured_store(str(tmp_path / "b"), captured, verifier, layers=(1, 2, 3, "prenorm"))
    line = refused(tmp_path, no_final, "specforge-dspark")
    assert f"needs layer {N} (the final hidden state after the norm, DSpark's target_last_hidden_states)" in line
    assert "`corecap run --layers 1,2,3,4`" in line
    embeddings = write_captured_store(str(tmp_path / "c"), captured, verifier, layers=(0, 1, N))
    assert "choose --aux-layers among 1..3" in refused(tmp_path, embeddings, "specforge-dflash")


def test_an_interrupted_dspark_export_resumes_keeping_what_it_wrote(tmp_path, captured, verifier, monkeypatch):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    clean, out = tmp_path / "clean", tmp_path / "out"
    exported(store, clean, "specforge-dspark")
    interrupt(store, out, "specforge-dspark", monkeypatch, after=3)
    partial = tmp_path / "out.partial"
    kept = {p.relative_to(partial): p.stat().st_ino for p in partial.rglob("*.ckpt")}
    assert len(kept) == 3 and not out.exists()
    result = exported(store, out, "specforge-dspark")
    assert "3 kept from an interrupted export" in result.output
    assert {name: (out / name).stat().st_ino for name in kept} == kept  # kept, not rewritten
    written = {p.relative_to(out): p.read_bytes() for p in out.rglob("*.ckpt")}
    assert written == {p.relative_to(clean): p.read_bytes() for p in clean.rglob("*.ckpt")}
