"""A tiny Kimi-K2.5 checkpoint in the layout moonshotai/Kimi-K2.5 ships on the Hub, built from a
seed by transformers' own Kimi_K25ForConditionalGeneration: a one-layer MoonViT vision tower, its
projector, and a DeepSeek-V3 language model under `text_config` (MLA, a dense first layer, then
MoE with a shared expert, `noaux_tc`/sigmoid routing with a non-zero correction bias).

Why the weights are renamed by hand: transformers 5 keeps Kimi-K2.5 in its own layout
(`model.language_model.layers.N...`, fused experts, split q/k/v in the tower) and reverses its
conversion mapping on save, which does not give the release's names back (it writes
`language_model.model.blocks.N`, renames the language model's `self_attn.q_proj` to `self_wqkv`,
and leaves `model.mm_projector.pre_norm`). What a user points corecap at is the release's layout,
the one vLLM's KimiK25ForConditionalGeneration reads (its `hf_to_vllm_mapper` maps only
`mm_projector.proj.0/2` and the legacy `language_model.layers.`): `language_model.model.layers.N`
with one tensor per expert, `language_model.lm_head`, `vision_tower.patch_embed`,
`vision_tower.encoder.blocks.N.{wqkv,wo,norm0,norm1,mlp.fc0,mlp.fc1}`, `mm_projector.pre_norm`,
`mm_projector.proj.{0,2}`. The HF reference reads the same files back through transformers' own
conversion (tiny_models.reference), so both sides read one checkpoint.

tools/gpu/deepseek_exact.py builds its Kimi-K2.5 (its DeepSeek-V3's sizes) with this file run as a
script (tools do not import tests): `python tests/support/kimi_k25.py build PATH [OPTIONS_JSON]`.
`write_config` writes the config alone, for a model run with dummy weights (tools/gpu/images.py,
through tests/support/kimi_k25_vision.py's `checkpoint`).
"""

from __future__ import annotations

import json
import os
import sys

try:
    from support import tiny_models
except ImportError:  # run as a script (tools/gpu/deepseek_exact.py): this file's directory is on sys.path
    import tiny_models

ARCHITECTURE = "KimiK25ForConditionalGeneration"  # the release's config.json spelling (vLLM's class)
# The four media tokens sit above every id the dataset draws (tiny_models.rows: below its VOCAB), as
# the release's sit near the top of its vocabulary: HF embeds a media token as token 0 without pixels.
NUM_MEDIA_TOKENS = 4
VOCAB = tiny_models.VOCAB + NUM_MEDIA_TOKENS
_VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
               num_hidden_layers=1, hidden_size=16, intermediate_size=32, merge_kernel_size=(2, 2))
_LANGUAGE_SHARD = "model-00001-of-00002.safetensors"
_VISION_SHARD = "model-00002-of-00002.safetensors"  # the release keeps the tower in its last shard


def config(text: dict | None = None, vision: dict | None = None):
    """transformers' Kimi_K25Config: `text` the language model's DeepseekV3Config fields
    (tiny_models' by default), its vocabulary grown by the media tokens; `vision` changes to the
    tower's (tools/gpu/deepseek_exact.py widens its heads to 64, the GPU kernels' smallest)."""
    import transformers as T

    if text is None:
        text = tiny_models.configs()["deepseek_v3"][0].to_dict()
    vocab = text["vocab_size"] + NUM_MEDIA_TOKENS
    vision = {**_VISION, **(vision or {})}
    media = dict(image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
                 vision_end_token_id=vocab - 1)
    return T.Kimi_K25Config(text_config=dict(text, vocab_size=vocab), vision_config=vision,
                            projection_hidden_size=vision["hidden_size"], tie_word_embeddings=False, **media)


def build(path: str, seed: int = 0, text: dict | None = None, vision: dict | None = None, std: float = 0.08,
          bias_std: float = 0.5) -> str:
    """Save the tiny model (config's `text` and `vision`; weights ~N(0, std) as tiny_models.randomize,
    routing biases ~N(0, bias_std)) to `path` under the release's names and config spelling."""
    import torch
    import transformers as T
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = T.Kimi_K25ForConditionalGeneration(config(text, vision)).to(torch.float32).eval()
    tiny_models.randomize(model, std=std)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:  # zero by default: a bias that moves the routing is what vLLM must load
                gate.e_score_correction_bias.copy_(bias_std * torch.randn_like(gate.e_score_correction_bias))
    shards: dict[str, dict] = {_LANGUAGE_SHARD: {}, _VISION_SHARD: {}}
    for name, tensor in model.state_dict().items():
        for hub_name, value in _hub_tensors(name, tensor):
            shard = _LANGUAGE_SHARD if hub_name.startswith("language_model.") else _VISION_SHARD
            shards[shard][hub_name] = value.contiguous().clone()
    _merge_qkv(shards[_VISION_SHARD])
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    total = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    model.config.save_pretrained(path)
    _release_config(os.path.join(path, "config.json"))
    return path


def write_config(path: str, text: dict | None = None, vision: dict | None = None) -> str:
    """config(text, vision) saved to `path` in the release's spelling, without weights (a model
    loaded with dummy weights needs no more of the checkpoint than this, a tokenizer and a processor)."""
    os.makedirs(path, exist_ok=True)
    config(text, vision).save_pretrained(path)
    _release_config(os.path.join(path, "config.json"))
    return path


def _hub_tensors(name: str, tensor):
    """(release name, tensor) for one of transformers' state-dict entries (the fused experts give
    one per expert; the tower's q, k and v are merged afterwards by _merge_qkv)."""
    if name.startswith("model.language_model."):
        rest = name[len("model.language_model."):]
        if rest.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            prefix = "language_model.model." + rest[:-len("gate_up_proj")]
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, half:]
        elif rest.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix = "language_model.model." + rest[:-len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield "language_model.model." + rest, tensor
    elif name == "lm_head.weight":
        yield "language_model.lm_head.weight", tensor
    elif name == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
        yield "vision_tower.patch_embed.pos_emb.weight", tensor
    elif name.startswith("model.vision_tower.patch_embed."):
        yield name[len("model."):], tensor
    elif name.startswith("model.vision_tower.final_layernorm."):
        yield "vision_tower.encoder." + name[len("model.vision_tower."):], tensor
    elif name.startswith("model.vision_tower.layers."):
        index, rest = name[len("model.vision_tower.layers."):].split(".", 1)
        for old, new in (("norm1.", "norm0."), ("norm2.", "norm1."), ("mlp.fc1.", "mlp.fc0."), ("mlp.fc2.", "mlp.fc1."),
                         ("attn.proj.", "wo."), ("attn.", "")):
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        yield f"vision_tower.encoder.blocks.{index}.{rest}", tensor
    elif name.startswith("model.mm_projector."):
        rest = name[len("model.mm_projector."):]
        rest = rest.replace("in_proj.", "proj.0.").replace("out_proj.", "proj.2.")
        yield "mm_projector." + rest, tensor
    else:
        raise AssertionError(f"no release name for {name}")


def _merge_qkv(tensors: dict) -> None:
    """The tower's q, k and v as the release's one `wqkv` per block. Not the inverse of the rotary
    permutation transformers applies on load: the tower's values do not reach a text sample, and
    the HF reference reads these same files back."""
    import torch

    for name in [n for n in tensors if ".q_proj." in n]:
        parts = [tensors.pop(name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        tensors[name.replace("q_proj", "wqkv")] = torch.cat(parts)


def _release_config(path: str) -> None:
    """The release's spelling: vLLM's architecture name, `kimi_k2` as the text model's type (which
    both transformers' and vLLM's Kimi_K25Config read as DeepSeek-V3), and beside transformers'
    names the release's `init_pos_emb_*` and `media_placeholder_token_id`, which vLLM 0.26's own
    KimiK25Config reads instead (without them it builds the tower's position embedding at its
    default 64x64, and the checkpoint's does not load). The release spells the tower's sizes
    `vt_*`, which transformers and vLLM 0.26 both ignore (their defaults are the release's sizes):
    a tiny tower keeps transformers' names."""
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = [ARCHITECTURE]
    config["text_config"]["model_type"] = "kimi_k2"
    config["media_placeholder_token_id"] = config["image_token_id"]
    for dim in ("height", "width", "time"):
        config["vision_config"][f"init_pos_emb_{dim}"] = config["vision_config"][f"pos_emb_{dim}"]
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


if __name__ == "__main__":  # python tests/support/kimi_k25.py build PATH [OPTIONS_JSON: build's keyword arguments]
    assert sys.argv[1] == "build", sys.argv
    build(sys.argv[2], **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
