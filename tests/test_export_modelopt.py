"""`corecap export --format modelopt`: what NVIDIA ModelOpt 0.47.0's OWN offline reader
(`OfflineSupervisedDataset` + `EagleOfflineDataCollator`, as its trainer builds them from the
`*.pt` files it finds under data.offline_data_path) reads equals the store, and the teacher
logits ModelOpt computes from it (its offline base model `FakeBaseModel`: lm_head, after its
final norm where the file says the state is pre-norm) equal HF's on the verifier, whose final
norm is not all ones. The stores come from conftest's `captured` fixture (no engine).

ModelOpt is installed `--no-deps` (its pins would replace the CPU torch) with the two light
packages its modules import on the way to the reader: omegaconf and pulp (.ci/run).
"""

from __future__ import annotations

import functools
import pathlib
import re
import sys

import numpy as np
import pytest
import torch

from support.exports import exported, exported_mask, interrupt, manifest, refused, relative
from support.reference import record_error, relative_errors
from support.trainers import INSTALL, require_trainer
from support.verifier import VERIFIER_HIDDEN, VERIFIER_LAYERS, write_captured_store

AUX = (1, 2, 3)  # the captured layers but N and prenorm
N = VERIFIER_LAYERS


@functools.cache
def modelopt():
    """ModelOpt's reader and its offline teacher's parts (importing modelopt.torch takes ~10 s)."""
    require_trainer("modelopt")
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.modeling_eagle import EagleBaseModelOutput
    from modelopt.torch.speculative.plugins.modeling_fakebase import FakeBaseModel
    from modelopt.torch.speculative.plugins.modeling_final_norm import _maybe_apply_base_final_norm

    return (
        OfflineSupervisedDataset, EagleOfflineDataCollator, EagleBaseModelOutput, FakeBaseModel,
        _maybe_apply_base_final_norm,
    )


def _dumped_files(out) -> list[str]:
    """The files ModelOpt's trainer gives its dataset (main.py: `offline_data_path.rglob("*.pt")`)."""
    return [str(p) for p in pathlib.Path(out).rglob("*.pt")]


def _rows_by_file(out) -> dict[str, dict]:
    return {str(pathlib.Path(out) / r["file"]): r for r in manifest(out)}


def test_modelopt_reader_reads_the_store(tmp_path, captured, verifier):
    OfflineSupervisedDataset, EagleOfflineDataCollator, *_ = modelopt()
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    out = tmp_path / "mo"
    result = exported(store, out, "modelopt", "--workers", "3")
    assert '"eagle_aux_hidden_state_layer_ids": [0, 1, 2]' in result.output  # HF 1, 2, 3 minus one
    assert f"aux layers {list(AUX)} + {N}, float32" in result.output
    rows = _rows_by_file(out)
    assert [r["key"] for r in manifest(out)] == sorted(captured)
    files = _dumped_files(out)
    assert sorted(files) == sorted(rows)  # every sample, and nothing else that ends in .pt
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    items = [dataset[i] for i in range(len(dataset))]
    for path, item in zip(files, items):
        ids, mask, ref = captured[rows[path]["key"]]
        assert item["input_ids"].dtype == torch.int64
        assert torch.equal(item["input_ids"], torch.from_numpy(ids.astype(np.int64)))
        assert torch.equal(item["loss_mask"], exported_mask(mask, ids.size))
        assert torch.equal(item["labels"][:-1], item["input_ids"][1:])
        assert torch.equal(item["aux_hidden_states"], torch.cat([ref[k] for k in AUX], dim=-1))  # every aux slice
        assert torch.equal(item["base_model_hidden_states"], ref[N])  # after the final norm
        assert item["base_hidden_prenorm"] is False
    batch = EagleOfflineDataCollator(train_len=48)(items)  # padded or truncated to 48
    for j, path in enumerate(files):
        ids, mask, ref = captured[rows[path]["key"]]
        n = min(ids.size, 48)
        assert torch.equal(batch["input_ids"][j, :n], torch.from_numpy(ids[:n].astype(np.int64)))
        assert torch.equal(batch["loss_mask"][j, :n], exported_mask(mask, ids.size)[:n])
        assert not batch["attention_mask"][j, n:].any()
        outputs = batch["base_model_outputs"]
        assert torch.equal(outputs["aux_hidden_states"][j, :n], torch.cat([ref[k][:n] for k in AUX], dim=-1))
        assert torch.equal(outputs["base_model_hidden_states"][j, :n], ref[N][:n])
    assert batch["base_model_outputs"]["base_hidden_prenorm"] is False


def _teacher_logits(out, verifier) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's teacher logits for every sample of an export, as HFEagleModel.forward makes
    them offline (hf_eagle.py): base outputs from the collated batch, the final norm re-applied
    where the batch says pre-norm, then lm_head; with the parts of its offline base model
    (FakeBaseModel.from_source: lm_head and, for Llama, the final norm, from the verifier)."""
    OfflineSupervisedDataset, EagleOfflineDataCollator, EagleBaseModelOutput, FakeBaseModel, maybe_norm = modelopt()
    base = FakeBaseModel.from_source(verifier)
    assert not torch.allclose(base.norm.weight, torch.ones_like(base.norm.weight))  # the norm matters here
    files = _dumped_files(out)
    dataset = OfflineSupervisedDataset(files)
    batch = EagleOfflineDataCollator(train_len=64)([dataset[i] for i in range(len(dataset))])
    outputs = EagleBaseModelOutput.from_offline_dict(batch["base_model_outputs"])
    assert outputs.logits is None  # so ModelOpt computes them from the hidden states
    with torch.no_grad():
        logits = base.lm_head(maybe_norm(outputs.out_hiddens, batch["base_model_outputs"], getattr(base, "norm", None)))
    return logits, batch["attention_mask"]


def _hf_logits(out, captured, mask) -> torch.Tensor:
    rows = _rows_by_file(out)
    refs = [captured[rows[path]["key"]][2]["logits"] for path in _dumped_files(out)]
    ref = torch.zeros(len(refs), mask.shape[1], refs[0].shape[-1])
    for j, r in enumerate(refs):
        ref[j, : len(r)] = r
    return ref


@pytest.mark.parametrize("layers", [(1, 2, 3, N, "prenorm"), (1, 2, 3, "prenorm")], ids=["layer-N", "prenorm-only"])
def test_modelopt_teacher_logits_equal_hf(tmp_path, captured, verifier, layers):
    """Layer N as ModelOpt's hidden_states (lm_head only), or, in a store without it, prenorm
    flagged so that ModelOpt applies the final norm first: HF's logits either way."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, layers=layers)
    out = tmp_path / "mo"
    exported(store, out, "modelopt")
    logits, mask = _teacher_logits(out, verifier)
    ref = _hf_logits(out, captured, mask)
    on = mask.bool()
    record_error(
        f"export: ModelOpt teacher logits ({'N' if N in layers else 'prenorm'})",
        *relative_errors(logits[on][None], ref[on][None]),
    )
    assert relative(logits[on], ref[on]) < 1e-5, relative(logits[on], ref[on])


@pytest.mark.parametrize("layers,replace", [((1, 2, 3, N), {N: "prenorm"}), ((1, 2, 3, "prenorm"), {"prenorm": N})],
                         ids=["pre-norm-as-N", "post-norm-as-prenorm"])
def test_the_wrong_final_state_gives_modelopt_wrong_logits(tmp_path, captured, verifier, layers, replace):
    """The check above can see the difference: the residual stream before the norm where
    ModelOpt expects it after (lm_head only), or a normed state flagged pre-norm (normed twice)."""
    store = write_captured_store(str(tmp_path / "s"), captured, verifier, layers=layers, replace=replace)
    out = tmp_path / "mo"
    exported(store, out, "modelopt")
    logits, mask = _teacher_logits(out, verifier)
    on = mask.bool()
    assert relative(logits[on], _hf_logits(out, captured, mask)[on]) > 0.05


def test_modelopt_bfloat16_store_and_aux_layers(tmp_path, captured, verifier):
    """--dtype auto keeps the stored dtype (bf16 here: what ModelOpt's own dumps of a bf16
    model hold); --aux-layers chooses and orders the aux slices."""
    from corecap.store import Store

    store = write_captured_store(str(tmp_path / "s"), captured, verifier, dtype=torch.bfloat16)
    out = tmp_path / "mo"
    result = exported(store, out, "modelopt", "--aux-layers", "3,1")
    assert '"eagle_aux_hidden_state_layer_ids": [0, 2]' in result.output
    assert "bfloat16 (the stored dtype" in result.output
    OfflineSupervisedDataset = modelopt()[0]
    rows, files = _rows_by_file(out), _dumped_files(out)
    dataset = OfflineSupervisedDataset(files)
    with Store.open(store) as s:
        for i, path in enumerate(files):
            stored = s.get(rows[path]["key"]).hidden_states  # [L, T, H]: layers 1, 2, 3, N, prenorm
            item = dataset[i]
            assert item["aux_hidden_states"].dtype == torch.bfloat16
            assert torch.equal(item["aux_hidden_states"], torch.cat([stored[0], stored[2]], dim=-1))
            assert torch.equal(item["base_model_hidden_states"], stored[3])
            assert item["aux_hidden_states"].shape[-1] == 2 * VERIFIER_HIDDEN


def test_modelopt_refusals_name_the_flag_that_captures_it(tmp_path, captured, verifier):
    no_final = write_captured_store(str(tmp_path / "a"), captured, verifier, layers=(1, 2, 3))
    line = refused(tmp_path, no_final, "modelopt")
    assert f"needs layer {N} (the final hidden state after the norm, ModelOpt's hidden_states) or 'prenorm'" in line
    assert "`corecap run --layers 1,2,3,4`" in line
    no_aux = write_captured_store(str(tmp_path / "b"), captured, verifier, layers=(N, "prenorm"))
    line = refused(tmp_path, no_aux, "modelopt")
    assert "needs at least one aux layer" in line and "`corecap run --layers 1,2,4,prenorm`" in line
    embeddings = write_captured_store(str(tmp_path / "c"), captured, verifier, layers=(0, 1, 2, N))
    assert "choose --aux-layers among 1..3" in refused(tmp_path, embeddings, "modelopt")


def test_an_interrupted_modelopt_export_resumes_keeping_what_it_wrote(tmp_path, captured, verifier, monkeypatch):
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    clean, out = tmp_path / "clean", tmp_path / "out"
    exported(store, clean, "modelopt")
    interrupt(store, out, "modelopt", monkeypatch, after=4)
    partial = tmp_path / "out.partial"
    kept = {p.name: p.stat().st_ino for p in partial.glob("*.pt")}
    assert len(kept) == 4 and not out.exists()
    result = exported(store, out, "modelopt")
    assert "4 kept from an interrupted export" in result.output
    assert {name: (out / name).stat().st_ino for name in kept} == kept  # kept, not rewritten
    assert {p.name: p.read_bytes() for p in out.glob("*.pt")} == {p.name: p.read_bytes() for p in clean.glob("*.pt")}


def test_without_modelopt_its_tests_skip_naming_the_line_that_installs_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelopt", None)  # as an environment without it imports
    monkeypatch.delenv("CI", raising=False)
    line = f"modelopt is not installed; install it with: {INSTALL['modelopt']}"
    with pytest.raises(pytest.skip.Exception, match=re.escape(line)):
        modelopt.__wrapped__()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"\(CI=true: mandatory\)"):
        modelopt.__wrapped__()


def test_the_loader_example_never_suggests_modelopts_hf_extra(tmp_path, captured, verifier):
    """examples/load_mo.py: ModelOpt's own warning (transformers outside its tested range) suggests
    `pip install -U nvidia-modelopt[hf]`, which would replace vLLM's torch; the loader says instead
    not to run it and gives the safe line, and without ModelOpt it exits naming that line."""
    import subprocess

    require_trainer("modelopt")
    loader = str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "load_mo.py")
    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    exported(store, tmp_path / "mo", "modelopt")
    result = subprocess.run([sys.executable, loader, str(tmp_path / "mo")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    import transformers
    from packaging.version import Version

    if not Version("4.57") <= Version(transformers.__version__) < Version("5.15"):  # where ModelOpt 0.47.0 warns
        assert "do not run `pip install -U nvidia-modelopt[hf]`" in result.stderr, result.stderr
    for line in result.stderr.splitlines():
        if "nvidia-modelopt[hf]" in line:
            assert "do not run `pip install -U nvidia-modelopt[hf]`" in line and INSTALL["modelopt"] in line, line
    hidden = ("import runpy, sys; sys.modules['modelopt'] = None; sys.argv = [sys.argv[1], 'x']; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hidden, loader], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().endswith(f"install ModelOpt beside vLLM with: {INSTALL['modelopt']}"), result.stderr
