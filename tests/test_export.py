"""`corecap export`: what the trainers' OWN loaders read from an export equals the store, and the
teacher logits each trainer computes from it equal HF's logits for the same verifier.

speculators 0.9.0 is read through ArrowDataset + CollateFn (+ shift_batch), SpecForge 0.2.0
through OfflineManifestReader + LocalFeatureStore + FeatureDataLoader + normalize_offline_sample,
exactly as their trainers build them (/work/research/trainers.md). The stores come from the
`captured` fixture (tests/conftest.py): HF's own states of a tiny verifier whose final norm is
not all ones, written without an engine.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from corecap.cli import main
from support.exports import interrupt
from support.reference import record_error, relative_errors
from support.speculators_reader import speculators
from support.speculators_reader import speculators_teacher as _speculators_teacher
from support.verifier import CAPTURED_LAYERS, VERIFIER_HIDDEN, VERIFIER_LAYERS, write_captured_store

AUX = (1, 2, 3)  # CAPTURED_LAYERS but N and prenorm


def _export(store, out, fmt, *args):
    result = CliRunner().invoke(main, ["export", "--store", str(store), "--format", fmt, "--out", str(out), *args])
    return result


def _ok(store, out, fmt, *args):
    result = _export(store, out, fmt, *args)
    assert result.exit_code == 0, result.output
    return result


def _manifest(out) -> list[dict]:
    with open(os.path.join(out, "corecap_manifest.jsonl")) as f:
        return [json.loads(line) for line in f]


def _mask(mask, num_tokens):
    return torch.ones(num_tokens, dtype=torch.int64) if mask is None else torch.from_numpy(mask.astype(np.int64))


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def test_speculators_loader_reads_the_store(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "spec"
    _ok(store, out, "speculators")
    ArrowDataset, CollateFn, shift_batch, _, _ = speculators()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # speculators only warns when token ids do not match
        dataset = ArrowDataset(max_len=64, datapath=str(out), on_missing="raise")
        rows = _manifest(out)
        assert [r["key"] for r in rows] == sorted(captured)  # the store's key order
        assert len(dataset) == len(captured) and dataset.approx_lengths == [captured[r["key"]][0].size for r in rows]
        for row in rows:
            ids, mask, ref = captured[row["key"]]
            item = dataset[row["row"]]
            assert item["input_ids"].dtype == torch.int64 and torch.equal(item["input_ids"],
                                                                          torch.from_numpy(ids.astype(np.int64)))
            assert item["loss_mask"].dtype == torch.int64 and torch.equal(item["loss_mask"], _mask(mask, ids.size))
            # every aux slice, float32 as stored
            assert torch.equal(item["hidden_states"], torch.cat([ref[k] for k in AUX], dim=-1))
            assert torch.equal(item["verifier_last_hidden_states"], ref["prenorm"])
        collate = CollateFn(max_len=256, hidden_size=VERIFIER_HIDDEN, num_target_layers=len(AUX), dtype=torch.float32,
                            preprocess=shift_batch)
        batch = collate([dataset[i] for i in range(len(dataset))])
    assert batch["error_records"] == 0
    # token_freq.pt, as speculators' own prepare_data counts it from the same table.
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    save_token_frequency_distribution(load_from_disk(str(out)), tmp_path / "freq.pt")
    assert torch.load(out / "token_freq.pt") == torch.load(tmp_path / "freq.pt")
    # shift_batch: input_ids[1:], aux[:-1], last[1:]; documents packed one after another.
    at = 0
    for row in rows:
        ids, mask, ref = captured[row["key"]]
        n = ids.size - 1
        assert torch.equal(batch["input_ids"][0, at : at + n], torch.from_numpy(ids[1:].astype(np.int64)))
        assert torch.equal(batch["loss_mask"][0, at : at + n], _mask(mask, ids.size)[1:])
        assert torch.equal(batch["hidden_states"][0, at : at + n], torch.cat([ref[k][:-1] for k in AUX], dim=-1))
        assert torch.equal(batch["verifier_last_hidden_states"][0, at : at + n], ref["prenorm"][1:])
        at += n


def _speculators_batch(out):
    ArrowDataset, CollateFn, shift_batch, _, _ = speculators()
    dataset = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise")
    collate = CollateFn(max_len=512, hidden_size=VERIFIER_HIDDEN, num_target_layers=len(AUX), dtype=torch.float32,
                        preprocess=shift_batch)
    batch = collate([dataset[i] for i in range(len(dataset))])
    assert batch["error_records"] == 0
    return batch


def _shifted_logits(captured, rows) -> torch.Tensor:
    """HF's logits in the packed order shift_batch leaves: positions 1.. of each sample."""
    return torch.cat([captured[r["key"]][2]["logits"][1:] for r in rows])


def _speculators_logits(tmp_path, captured, verifier, replace=None):
    """speculators' teacher logits from its loader's batch of an export, and HF's in that order."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, replace=replace)
    out = tmp_path / "spec"
    _ok(store, out, "speculators")
    batch, teacher = _speculators_batch(out), _speculators_teacher(verifier)
    ref = _shifted_logits(captured, _manifest(out))
    with torch.no_grad():
        return teacher(batch["verifier_last_hidden_states"][0, : len(ref)]), ref


def test_speculators_teacher_logits_equal_hf(tmp_path, captured, verifier):
    logits, ref = _speculators_logits(tmp_path, captured, verifier)
    record_error("export: speculators teacher logits", *relative_errors(logits[None], ref[None]))
    assert _relative(logits, ref) < 1e-5, _relative(logits, ref)


def test_a_post_norm_last_state_gives_speculators_wrong_logits(tmp_path, captured, verifier):
    """The check above can see the difference: the final norm's output in the prenorm slot (what
    HF's hidden_states[N] is) gets normed twice by speculators, and its logits are far off."""
    logits, ref = _speculators_logits(tmp_path, captured, verifier, replace={"prenorm": VERIFIER_LAYERS})
    assert _relative(logits, ref) > 0.05, _relative(logits, ref)


# --- SpecForge ------------------------------------------------------------------------------------


def _specforge_loader(out, max_len=512, batch_size=4):
    """SpecForge's offline data path as launch.build_offline_runtime builds it, with each file
    validated eagerly (keys, tensors) by its reader."""
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer, build_offline_reader
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    refs = build_offline_reader(str(out), run_id="t", ttt_length=7, max_len=max_len).read()
    checked = OfflineManifestReader(str(out), run_id="t", max_len=max_len, validate_files=True).read()
    loader = FeatureDataLoader(
        LocalFeatureStore("t"), refs=refs, batch_size=batch_size, collate_fn=build_offline_collator(),
        per_sample_transform=build_offline_normalizer(max_len, ttt_length=7), drop_last=False, strategy="eagle3",
    )
    return refs, checked, loader


def test_specforge_loader_reads_the_store(tmp_path, captured, verifier, monkeypatch):
    import corecap.export.specforge as layouts
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file

    monkeypatch.setattr(layouts, "FILE_GROUP", 5)  # several rows_* directories
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "sf"
    result = _ok(store, out, "specforge", "--dtype", "float32")
    assert '"eagle_aux_hidden_state_layer_ids": [0, 1, 2]' in result.output  # HF 1, 2, 3 minus one
    assert "SpecForge's trainer needs bfloat16" in result.output
    rows = _manifest(out)
    assert [r["key"] for r in rows] == sorted(captured)
    assert len({os.path.dirname(r["file"]) for r in rows}) == 3
    refs, checked, loader = _specforge_loader(out)
    # SpecForge orders its files by path: that order must be the row order.
    assert [ref.feature_store_uri for ref in refs] == [f"file://{out / r['file']}" for r in rows]
    for r, ref in zip(rows, checked):
        ids = captured[r["key"]][0]
        assert ref.num_tokens == ids.size
        assert ref.feature_specs["hidden_state"].shape == (1, ids.size, VERIFIER_HIDDEN)
        assert ref.feature_specs["aux_hidden_state"].shape == (1, ids.size, 3 * VERIFIER_HIDDEN)
    for r in rows:  # per sample, through SpecForge's normalizer
        ids, mask, ref = captured[r["key"]]
        norm = normalize_offline_sample(load_feature_file(str(out / r["file"])), max_len=512)
        expected_mask = _mask(mask, ids.size).clone()
        expected_mask[-1] = 0  # normalize_offline_sample never trains on the last position
        assert torch.equal(norm["input_ids"][0], torch.from_numpy(ids.astype(np.int64)))
        assert torch.equal(norm["loss_mask"][0], expected_mask)
        assert torch.equal(norm["hidden_state"][0], torch.cat([ref[k] for k in AUX], dim=-1))
        assert torch.equal(norm["target"][0], ref[VERIFIER_LAYERS])
    seen = 0
    for batch in loader:  # the whole loader: padded batches in row order
        t = batch.tensors
        for j, sample_id in enumerate(batch.sample_ids):
            ids, mask, ref = captured[rows[int(sample_id.split(":")[1])]["key"]]
            n = ids.size
            assert torch.equal(t["input_ids"][j, :n], torch.from_numpy(ids.astype(np.int64)))
            assert torch.equal(t["hidden_state"][j, :n], torch.cat([ref[k] for k in AUX], dim=-1))
            assert torch.equal(t["target"][j, :n], ref[VERIFIER_LAYERS])
            seen += 1
    assert seen == len(captured)


def _lm_head(verifier) -> torch.Tensor:
    from safetensors import safe_open

    index = json.load(open(os.path.join(verifier, "model.safetensors.index.json")))["weight_map"]
    with safe_open(os.path.join(verifier, index["lm_head.weight"]), framework="pt") as f:
        return f.get_tensor("lm_head.weight")


def test_specforge_teacher_logits_equal_hf(tmp_path, captured, verifier):
    """SpecForge's teacher is lm_head(hidden_state), no norm (TargetHead.fc): exact in float32."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "sf"
    _ok(store, out, "specforge", "--dtype", "float32")
    rows = _manifest(out)
    weight = _lm_head(verifier)
    _, _, loader = _specforge_loader(out)
    for batch in loader:
        for j, sample_id in enumerate(batch.sample_ids):
            ref = captured[rows[int(sample_id.split(":")[1])]["key"]][2]
            n = ref["logits"].shape[0]
            logits = batch.tensors["target"][j, :n] @ weight.T
            record_error("export: SpecForge teacher logits", *relative_errors(logits[None], ref["logits"][None]))
            assert _relative(logits, ref["logits"]) < 1e-5, _relative(logits, ref["logits"])


def test_a_pre_norm_hidden_state_gives_specforge_wrong_logits(tmp_path, captured, verifier):
    """And for SpecForge: the residual stream before the norm as its hidden_state (lm_head only)."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, replace={VERIFIER_LAYERS: "prenorm"})
    out = tmp_path / "sf"
    _ok(store, out, "specforge", "--dtype", "float32")
    rows, weight = _manifest(out), _lm_head(verifier)
    got = torch.cat([torch.load(out / r["file"])["hidden_state"][0] for r in rows]) @ weight.T
    assert _relative(got, torch.cat([captured[r["key"]][2]["logits"] for r in rows])) > 0.05


def test_specforge_default_export_is_bfloat16_and_trains(tmp_path, captured, verifier):
    """The default export is what SpecForge's training step takes: bf16 tensors through its own
    TargetHead and _prepare_eagle_target, whose logits agree with HF's to bf16 precision."""
    from specforge.modeling.target.target_head import TargetHead
    from specforge.training.strategies.base import _prepare_eagle_target

    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "sf"
    result = _ok(store, out, "specforge")
    assert "bfloat16 (SpecForge's target head runs in bfloat16" in result.output
    rows = _manifest(out)
    head = TargetHead.from_pretrained(verifier)
    _, _, loader = _specforge_loader(out)
    for batch in loader:
        t = batch.tensors
        assert t["hidden_state"].dtype == t["target"].dtype == torch.bfloat16
        assert t["hidden_state"].shape[-1] == 3 * VERIFIER_HIDDEN and t["input_ids"].dtype == torch.int64
        ids, logits, loss_mask = _prepare_eagle_target(
            target_head=head, target_repr="hidden_state", input_ids=t["input_ids"], target=t["target"],
            loss_mask=t["loss_mask"], device=torch.device("cpu"),
        )
        for j, sample_id in enumerate(batch.sample_ids):
            ref = captured[rows[int(sample_id.split(":")[1])]["key"]][2]["logits"]
            n = ref.shape[0] - 1  # preprocess shifts left by one
            if n:
                assert _relative(logits[j, :n].float(), ref[1:]) < 2e-2


# --- stores of other dtypes and codecs ----------------------------------------------------------


@pytest.mark.parametrize("codec", ["zstd-planes", "fp8-e4m3-rowscale"])
def test_bfloat16_and_fp8_stores_export_what_the_store_reads(tmp_path, captured, verifier, codec):
    """bf16 stays bf16 (speculators' default: the stored dtype), fp8 comes out dequantized (with
    a warning), and each value equals what the store itself returns for the sample."""
    from corecap.store import Store

    store = write_captured_store(str(tmp_path / "s"), captured, verifier, dtype=torch.bfloat16, codec=codec)
    out = tmp_path / "spec"
    result = _ok(store, out, "speculators")
    assert ("lossy fp8" in result.output) == (codec == "fp8-e4m3-rowscale")
    assert (f"{sum(m is None for _, m, _ in captured.values())} of {len(captured)} samples had no loss mask: "
            "exported with all ones") in result.output
    ArrowDataset = speculators()[0]
    dataset = ArrowDataset(max_len=64, datapath=str(out), on_missing="raise")
    with Store.open(store) as s:
        for row in _manifest(out):
            stored = s.get(row["key"]).hidden_states  # [L, T, H]
            item = dataset[row["row"]]
            assert item["hidden_states"].dtype == torch.bfloat16
            assert torch.equal(item["hidden_states"], torch.cat(list(stored[:3]), dim=-1))
            assert torch.equal(item["verifier_last_hidden_states"], stored[4])


def test_a_float32_store_exports_bfloat16_for_specforge_by_default(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    result = _ok(store, tmp_path / "sf", "specforge")
    assert "rounded from the stored float32 to bfloat16" in result.output


def test_aux_layers_choose_and_order_the_exported_layers(tmp_path, captured, verifier):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "spec"
    result = _ok(store, out, "speculators", "--aux-layers", "3,1")
    assert "--target-layer-ids 1 3" in result.output
    ArrowDataset = speculators()[0]
    dataset = ArrowDataset(max_len=64, datapath=str(out), on_missing="raise")
    row = _manifest(out)[1]
    ref = captured[row["key"]][2]
    assert torch.equal(dataset[1]["hidden_states"], torch.cat([ref[1], ref[3]], dim=-1))
    info = json.load(open(out / "corecap_export.json"))
    assert [layer["layer"] for layer in info["layers"]] == [1, 3, "prenorm"] and info["complete"]


# --- refusals: nothing is written ------------------------------------------------------------------


def _refused(tmp_path, store, fmt, *args, out=None) -> str:
    out = out or tmp_path / "out"
    result = _export(store, out, fmt, *args)
    assert result.exit_code == 2, result.output
    assert not os.path.exists(out) and not os.path.exists(f"{out}.partial")
    line = result.output.strip()
    assert line.startswith("corecap: error: ") and "\n" not in line
    return line


def test_refusals_name_what_is_missing_and_the_flag_that_captures_it(tmp_path, captured, verifier):
    no_prenorm = write_captured_store(str(tmp_path / "a"), captured, verifier, layers=(1, 2, 3, 4))
    assert "needs the 'prenorm' layer" in (line := _refused(tmp_path, no_prenorm, "speculators"))
    assert "`corecap run --layers 1,2,3,4,prenorm`" in line
    no_final = write_captured_store(str(tmp_path / "b"), captured, verifier, layers=(1, 2, 3, "prenorm"))
    assert "needs layer 4 (the final hidden state after the norm" in (line := _refused(tmp_path, no_final, "specforge"))
    assert "`corecap run --layers 1,2,3,4`" in line
    two_aux = write_captured_store(str(tmp_path / "c"), captured, verifier, layers=(1, 2, 4, "prenorm"))
    assert "exactly 3 aux layers, the store gives 2 ([1, 2]" in (line := _refused(tmp_path, two_aux, "specforge"))
    assert "capture three with `corecap run --layers 1,2,3,4,prenorm`" in line
    full = write_captured_store(str(tmp_path / "d"), captured, verifier)
    assert "the store has no layer 7" in _refused(tmp_path, full, "speculators", "--aux-layers", "1,7")
    assert "capture three with `corecap run --layers 1,2,3,4,prenorm`" in _refused(tmp_path, full, "specforge",
                                                                                    "--aux-layers", "1,2")
    four = write_captured_store(str(tmp_path / "e"), captured, verifier, layers=(0, 1, 2, 3, 4))
    assert "choose three with --aux-layers, e.g. --aux-layers 1,2,3" in _refused(tmp_path, four, "specforge")
    assert "SpecForge names aux layers by HF index - 1" in _refused(tmp_path, full, "specforge",
                                                                    "--aux-layers", "2,3,4")
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{sorted(captured)[0]}\nnot-a-key\n")
    assert "has no sample with key 'not-a-key'" in _refused(tmp_path, full, "speculators", "--keys", str(keys))


def test_missing_or_damaged_stores_and_existing_outputs_are_refused(tmp_path, captured, verifier):
    from corecap.store.segments import segment_path

    assert "not a corecap store" in _refused(tmp_path, tmp_path / "nowhere", "speculators")
    (tmp_path / "plain").mkdir()
    assert "not a corecap store" in _refused(tmp_path, tmp_path / "plain", "specforge")
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    (tmp_path / "exists").mkdir()
    result = _export(store, tmp_path / "exists", "speculators")
    assert result.exit_code == 2 and "already exists" in result.output and os.listdir(tmp_path / "exists") == []
    with open(segment_path(store, 0), "r+b") as f:  # damage a sample's states in place
        f.seek(os.path.getsize(segment_path(store, 0)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = _export(store, tmp_path / "out", "speculators")
    assert result.exit_code == 2 and "checksum mismatch" in result.output, result.output
    assert not os.path.exists(tmp_path / "out")  # never renamed: the partial export stays partial


def test_samples_flagged_nonfinite_are_left_out_and_a_partial_file_is_refused(tmp_path, captured, verifier):
    from corecap.store import Store, encode_sample

    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    with Store.open(store) as s:
        meta = s.meta
    bad = torch.full((5, 3, VERIFIER_HIDDEN), float("nan"))
    with Store.create_or_open(store, meta) as s:  # as `corecap run --nonfinite store` keeps them
        s.put_many([encode_sample("aaa-nan", np.arange(3), bad, CAPTURED_LAYERS, nonfinite=True)])
    result = _ok(store, tmp_path / "sf", "specforge")
    assert "1 sample flagged NaN/Inf at capture (--nonfinite store) left out" in result.output
    assert [r["key"] for r in _manifest(tmp_path / "sf")] == sorted(captured)
    (tmp_path / "x.partial").write_text("")
    result = _export(store, tmp_path / "x", "specforge")
    assert result.exit_code == 2 and "x.partial: exists and is not a directory" in result.output
    assert not (tmp_path / "x").exists() and (tmp_path / "x.partial").read_text() == ""


def test_the_speculators_format_names_its_missing_extra(tmp_path, captured, verifier, monkeypatch):
    import sys

    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert "pip install 'corecap[speculators]'" in _refused(tmp_path, store, "speculators")


# --- interrupted exports ---------------------------------------------------------------------------


def _files(root) -> dict[str, tuple[int, bytes]]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = (os.stat(path).st_ino, open(path, "rb").read())
    return out


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_an_interrupted_export_resumes_keeping_what_it_wrote(tmp_path, captured, verifier, monkeypatch, fmt):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    clean = tmp_path / "clean"
    _ok(store, clean, fmt)
    out = tmp_path / "out"
    interrupt(store, out, fmt, monkeypatch, after=4)
    partial = tmp_path / "out.partial"
    assert not out.exists()
    before = {k: v for k, v in _files(partial).items() if k.endswith((".safetensors", ".ckpt"))}
    assert len(before) == 4
    open(partial / "stray.corecap-tmp", "w").close()  # a file being written when it stopped
    result = _ok(store, out, fmt)
    assert "4 kept from an interrupted export" in result.output and not partial.exists()
    after = _files(out)
    for name, (inode, _) in before.items():
        assert after[name][0] == inode  # kept, not rewritten
    assert "stray.corecap-tmp" not in after
    samples = {k: v[1] for k, v in after.items() if k.endswith((".safetensors", ".ckpt"))}
    assert samples == {k: v[1] for k, v in _files(clean).items() if k.endswith((".safetensors", ".ckpt"))}
    assert (out / "corecap_manifest.jsonl").read_text() == (clean / "corecap_manifest.jsonl").read_text()
    if fmt == "speculators":
        ArrowDataset = speculators()[0]
        assert len(ArrowDataset(max_len=64, datapath=str(out), on_missing="raise")) == len(captured)


def test_an_interrupted_export_with_other_options_or_samples_starts_over(tmp_path, captured, verifier, monkeypatch):
    from corecap.store import Store, encode_sample

    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "out"
    interrupt(store, out, "specforge", monkeypatch, after=3)
    result = _ok(store, out, "specforge", "--dtype", "float32")
    assert "starting over" in result.output and "kept from an interrupted export" not in result.output
    import shutil

    shutil.rmtree(out)
    interrupt(store, out, "specforge", monkeypatch, after=3)
    with Store.open(store) as s:
        meta = s.meta
    with Store.create_or_open(store, meta) as s:  # a run committed one more sample meanwhile
        s.put_many([encode_sample("aaa-new", np.arange(3), torch.zeros(5, 3, VERIFIER_HIDDEN), CAPTURED_LAYERS)])
    result = _ok(store, out, "specforge")
    assert "starting over" in result.output and f"{len(captured) + 1} samples" in result.output


def test_two_exports_into_one_place_at_once_are_refused(tmp_path, captured, verifier):
    import fcntl

    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    partial = tmp_path / "out.partial"
    partial.mkdir()
    fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        result = _export(store, tmp_path / "out", "specforge")
    finally:
        os.close(fd)
    assert result.exit_code == 2 and "another corecap export is writing there" in result.output
