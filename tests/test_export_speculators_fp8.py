"""`corecap export --format speculators --dtype fp8`: speculators 0.9.0's fp8 files, read back
through the path its trainer takes with `--hidden-states-backend fp8` (hs_connectors 0.9.0's
FP8Transfer under ArrowDataset, then CollateFn + shift_batch), equal the store within the bound
derived below, and its teacher's logits from them equal HF's within a stated bound.

The bound, per element x (the value the store reads back, exact in float64) of a token whose
file scale is s (checked to be float32(amax over the token's exported layers / 448)):
  - e4m3 has 4 significant bits: rounding x/s moves it by at most half an ulp, 2^-4 of it, or
    2^-10 below the normal range (2^-6; subnormal spacing 2^-9): |q s - x| <= r = max(2^-4 |x|, 2^-10 s);
  - FP8Transfer computes bf16(q) * bf16(s) in bf16: q is exact in bf16, s and the product are
    rounded once each (8 significant bits, 2^-8 each), so |x_hat - q s| <= (2^-7 + 2^-16) |q s|.
  Together: |x_hat - x| <= r + (2^-7 + 2^-16) (|x| + r).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from support.exports import exported, exported_mask, interrupt, manifest, refused, relative
from support.reference import record_error, relative_errors
from support.speculators_reader import backend_transfer, speculators, speculators_teacher
from support.verifier import VERIFIER_HIDDEN, write_captured_store

AUX = (1, 2, 3)  # the captured layers but N and prenorm
POSITIONS = (0, 1, 2, 4)  # their indices among the stored layers, then prenorm's: the file's layer order
FP8_ROWSCALE = "fp8-e4m3-rowscale"  # corecap's own fp8 store: a scale per token and layer
EPS_BF16 = 2.0**-7 + 2.0**-16  # the reader's two bf16 roundings (scale, product)
LOGITS_BOUND = 2.0**-4  # teacher logits, relative (Frobenius) to HF's: see test_fp8_teacher_logits_are_near_hf


def fp8_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most the reader's value may differ from x (float64 [T, L, H]; scale [T, 1, 1])."""
    r = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * scale)
    return r + EPS_BF16 * (x.abs() + r)


def _store_states(path) -> dict[str, torch.Tensor]:
    """What the store reads back, per key, at the exported layers: float64 [T, L, H]."""
    from corecap.store import Store

    with Store.open(path) as s:
        return {k: s.get(k).hidden_states[list(POSITIONS)].double().permute(1, 0, 2) for k in s.keys()}


def _fp8_dataset(out):
    ArrowDataset = speculators()[0]
    return ArrowDataset(max_len=512, datapath=str(out), on_missing="raise", transfer=backend_transfer("fp8", str(out)))


def _check_export(out, stored, captured) -> float:
    """The files and what speculators' fp8 path reads from them, against the store; returns the
    worst error seen as a fraction of the bound."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8
    from safetensors.torch import load_file

    worst = 0.0
    speculators()  # imported first: importing it warns (DeprecationWarning) on the way
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # speculators only warns when token ids do not match
        dataset = _fp8_dataset(out)
        rows = manifest(out)
        assert [r["key"] for r in rows] == sorted(captured) and len(dataset) == len(rows)
        for row in rows:
            ids, mask, _ = captured[row["key"]]
            x = stored[row["key"]]
            raw = load_file(os.path.join(out, row["file"]))
            assert sorted(raw) == ["hidden_states", "hidden_states_scales", "token_ids"]
            codes, scale = raw["hidden_states"], raw["hidden_states_scales"]
            assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
            # ONE scale per token across the layers, amax / 448 (float32: within 2^-24 relative)
            assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1, 1)
            want = (x.abs().amax(dim=(1, 2), keepdim=True) / 448).clamp(min=1e-12)
            assert torch.allclose(scale.double(), want, rtol=2.0**-23, atol=0)
            # the file hs_connectors' own writer would make of the same states, to the bit
            ref_codes, ref_scale = quantize_tensor_to_fp8(x.float())
            assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(scale, ref_scale)
            item = dataset[row["row"]]
            assert torch.equal(item["input_ids"], torch.from_numpy(ids.astype(np.int64)))
            assert torch.equal(item["loss_mask"], exported_mask(mask, ids.size))
            got = torch.cat([item["hidden_states"].view(x.shape[0], len(AUX), -1),
                             item["verifier_last_hidden_states"][:, None]], dim=1)
            assert got.dtype == torch.bfloat16  # FP8Transfer's dequantize dtype
            err = (got.double() - x).abs()
            bound = fp8_bound(x, want)  # the scale the file should hold, not the one it holds
            assert bool((err <= bound).all()), f"{row['key']}: {float((err - bound).max())} beyond the bound"
            worst = max(worst, float((err / bound).max()))
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculators_fp8_backend_reads_the_store_within_the_bound(tmp_path, captured, verifier, dtype):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, dtype=dtype)
    out = tmp_path / "spec"
    result = exported(store, out, "speculators", "--dtype", "fp8", "--workers", "3")
    assert f"aux layers {list(AUX)} + prenorm, fp8" in result.output
    assert "--hidden-states-backend fp8" in result.output and "rounded twice" not in result.output
    worst = _check_export(out, _store_states(store), captured)
    assert 0 < worst <= 1
    # The batch its trainer builds from those items (shifted, packed) holds the same values.
    ArrowDataset, CollateFn, shift_batch, _, _ = speculators()
    dataset = _fp8_dataset(out)
    items = [dataset[i] for i in range(len(dataset))]
    batch = CollateFn(max_len=512, hidden_size=VERIFIER_HIDDEN, num_target_layers=len(AUX),
                      preprocess=shift_batch)([dict(i) for i in items])
    assert batch["error_records"] == 0
    at = 0
    for item in items:
        n = item["input_ids"].shape[0] - 1
        assert torch.equal(batch["input_ids"][0, at : at + n], item["input_ids"][1:])
        assert torch.equal(batch["hidden_states"][0, at : at + n], item["hidden_states"][:-1])
        last = item["verifier_last_hidden_states"]
        assert torch.equal(batch["verifier_last_hidden_states"][0, at : at + n], last[1:])
        at += n


def _batch(out, backend: str):
    ArrowDataset, CollateFn, shift_batch, _, _ = speculators()
    dataset = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise",
                           transfer=backend_transfer(backend, str(out)))
    return CollateFn(max_len=512, hidden_size=VERIFIER_HIDDEN, num_target_layers=len(AUX), dtype=torch.float32,
                     preprocess=shift_batch)([dataset[i] for i in range(len(dataset))])


def test_fp8_teacher_logits_are_near_hf(tmp_path, captured, verifier):
    """lm_head(norm(last)) from the fp8 files against HF's logits. The bound is the per-element
    one of e4m3 (2^-4): each state element is within about that of itself (above), RMSNorm and
    lm_head are smooth, and the rounding errors of the elements are of either sign, so the logits'
    relative (Frobenius) error sits well under it (recorded in the test session's error table).
    RMSNorm cancels any per-token scale, so these logits cannot see a wrong scale (the raw codes
    give nearly the same ones); the aux states can, and the bound above checks them: read with
    speculators' default `file` backend, which does not dequantize, they are far off."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "spec"
    exported(store, out, "speculators", "--dtype", "fp8")
    batch = _batch(out, "fp8")
    ref = torch.cat([captured[r["key"]][2]["logits"][1:] for r in manifest(out)])
    with torch.no_grad():
        logits = speculators_teacher(verifier)(batch["verifier_last_hidden_states"][0, : len(ref)])
    record_error("export: speculators fp8 teacher logits", *relative_errors(logits[None], ref[None]))
    assert relative(logits, ref) < LOGITS_BOUND, relative(logits, ref)
    aux = torch.cat([torch.cat([captured[r["key"]][2][k][:-1] for k in AUX], dim=-1) for r in manifest(out)])
    assert relative(batch["hidden_states"][0, : len(aux)], aux) < LOGITS_BOUND
    unscaled = _batch(out, "file")["hidden_states"][0, : len(aux)]
    assert relative(unscaled, aux) > 1, relative(unscaled, aux)


def test_an_fp8_store_is_requantized_per_token(tmp_path, captured, verifier):
    """corecap's fp8 store (a scale per token and layer) is dequantized and quantized again with
    one scale per token: within the bound of what the store reads back, and against the
    captured (float32) values within the two roundings' bounds added. What the second rounding
    costs is measured against a float32 store's export of the same states (docs/export.md)."""
    direct = write_captured_store(str(tmp_path / "f32"), captured, verifier)
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, codec=FP8_ROWSCALE)
    out = tmp_path / "spec"
    result = exported(store, out, "speculators", "--dtype", "fp8")
    assert "rounded twice" in result.output
    warned = [line for line in result.output.splitlines() if "warning: " in line]
    assert len(warned) == 2 and all(line.startswith("corecap: warning: ") for line in warned)  # each said once
    assert len({line.split("warning: ")[1][:40] for line in warned}) == 2, warned
    stored = _store_states(store)
    assert _check_export(out, stored, captured) <= 1
    exported(direct, tmp_path / "once", "speculators", "--dtype", "fp8")
    original = _store_states(direct)
    rms = {}
    for name, path in (("a float32 store", tmp_path / "once"), ("an fp8 store, re-quantized", out)):
        dataset, sq_err, sq = _fp8_dataset(path), 0.0, 0.0
        for row in manifest(path):
            x0, item = original[row["key"]], dataset[row["row"]]
            got = torch.cat([item["hidden_states"].view(x0.shape[0], len(AUX), -1),
                             item["verifier_last_hidden_states"][:, None]], dim=1).double()
            record_error(f"export: speculators fp8 from {name}", *relative_errors(got.permute(1, 0, 2),
                                                                                  x0.permute(1, 0, 2)))
            sq_err, sq = sq_err + float(((got - x0) ** 2).sum()), sq + float((x0**2).sum())
            if path == out:
                # the store's rounding (a row's scale: its amax / 448 in float32, decoded in float32) plus ours
                s_row = (x0.abs().amax(dim=2, keepdim=True) / 448).clamp(min=2.0**-126)
                first = torch.maximum(2.0**-4 * x0.abs(), 2.0**-10 * s_row) + 2.0**-23 * x0.abs()
                x1 = stored[row["key"]]
                bound = first + fp8_bound(x1, x1.abs().amax(dim=(1, 2), keepdim=True) / 448)
                assert bool(((got - x0).abs() <= bound).all())
        rms[name] = (sq_err / sq) ** 0.5
    for key, x0 in original.items():  # for comparison: the fp8 store's own rounding, a scale per token and layer
        record_error("export: the fp8 store itself, read back", *relative_errors(stored[key].permute(1, 0, 2),
                                                                               x0.permute(1, 0, 2)))
    print(f"speculators fp8 export, relative rms error against the captured states: {rms}")
    # Rounding twice costs something, and less than rounding once more at full cost would.
    once, twice = rms["a float32 store"], rms["an fp8 store, re-quantized"]
    assert once < twice < 2 * once, rms


@pytest.mark.parametrize("fmt", ["specforge", "specforge-dflash", "specforge-dspark", "modelopt"])
def test_fp8_is_refused_for_the_other_formats(tmp_path, captured, verifier, fmt):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    line = refused(tmp_path, store, fmt, "--dtype", "fp8")
    assert "--dtype fp8: only --format speculators writes fp8 files" in line and f"--format {fmt}" in line


def test_an_interrupted_fp8_export_resumes_and_another_dtype_starts_over(tmp_path, captured, verifier, monkeypatch):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    clean = tmp_path / "clean"
    exported(store, clean, "speculators", "--dtype", "fp8")
    out = tmp_path / "out"
    interrupt(store, out, "speculators", monkeypatch, after=4, dtype="fp8")
    result = exported(store, out, "speculators", "--dtype", "fp8")
    assert "4 kept from an interrupted export" in result.output
    for row in manifest(clean):
        assert (out / row["file"]).read_bytes() == (clean / row["file"]).read_bytes()
    assert len(_fp8_dataset(out)) == len(captured)
    interrupt(store, tmp_path / "other", "speculators", monkeypatch, after=4)  # bf16 files, then fp8
    result = exported(store, tmp_path / "other", "speculators", "--dtype", "fp8")
    assert "starting over" in result.output and "kept from an interrupted export" not in result.output
