"""A tiny random Qwen2.5-VL (M-RoPE, windowed vision tower) for tools/gpu/images_exact.py: the
checkpoint, saved with its processor (Qwen2VLImageProcessor with small `min_pixels`/`max_pixels`,
so that an image is a few tokens) and a small byte-level BPE tokenizer trained here, with Qwen's
special tokens and a chat template that renders an image part as
`<|vision_start|><|image_pad|><|vision_end|>`; and HF's states for the samples corecap stored.
Nothing is downloaded.

transformers' Qwen2.5-VL processor holds a video processor, which needs torchvision:
`require_torchvision` says so in one line where it is missing.

    python3 -m tools.gpu.qwen25_vl reference MODEL SAMPLES OUT DTYPE DEVICE   # what images_exact runs
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

NUM_LAYERS = 4
SEED = 0
# Patches of 14 px, merged 2 x 2 into one token: one token per 28 x 28 px after the processor's
# resize (to multiples of 28), between 1 and 16 tokens an image.
MIN_PIXELS, MAX_PIXELS = 28 * 28, 16 * 28 * 28
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
_PART = ("{%- macro part(p) -%}{%- if p is string -%}{{ p }}"
         "{%- elif p['type'] == 'image' or p['type'] == 'image_url' -%}<|vision_start|><|image_pad|><|vision_end|>"
         "{%- else -%}{{ p['text'] }}{%- endif -%}{%- endmacro -%}")
CHAT_TEMPLATE = (
    _PART + "{%- macro content(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{%- for p in c -%}{{ part(p) }}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ content(m['content']) }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ content(m['content']) }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def require_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is None:
        raise SystemExit("images_exact --arch qwen2.5-vl: transformers' Qwen2.5-VL processor needs torchvision "
                         "(its video processor), which is not installed")


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["the quick brown fox jumps over the lazy dog", "what is in this picture", "a red square and a circle",
             "describe the image", "two pictures of different sizes", "user assistant system"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(path: str, seed: int = SEED) -> str:
    """The checkpoint at `path`: heads of 64 (the smallest the GPU's attention kernels are built
    for) in the language model and the vision tower, weights of std 0.02 from `seed`."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    tokenizer = _tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    vision = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=128, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight") and ".norm" not in name and "ln_q" not in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    image = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    video = Qwen2VLVideoProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    Qwen2_5_VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                        chat_template=CHAT_TEMPLATE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def pixel_values(model_dir: str, paths: list[str]):
    """(pixel_values, image_grid_thw) of the images, as the checkpoint's own processor makes them
    (the one vLLM runs)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    out = processor.image_processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def reference(model_dir: str, samples: str, out: str, dtype: str = "float32", device: str = "cpu") -> None:
    """HF's states for each sample of `samples` (JSON: [{"id", "input_ids", "images": [paths]}]):
    every hidden state and the last decoder layer's output before the final norm, as float32 on
    the CPU."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.to(device).eval()
    seen = {}
    model.model.language_model.layers[-1].register_forward_hook(
        lambda module, args, output: seen.__setitem__("prenorm", output[0] if isinstance(output, tuple) else output))
    with open(samples) as f:
        rows = json.load(f)
    refs = {}
    with torch.no_grad():
        for row in rows:
            kwargs = {}
            if row["images"]:
                pixels, grids = pixel_values(model_dir, row["images"])
                kwargs = dict(pixel_values=pixels.to(device, model.dtype), image_grid_thw=grids.to(device))
            hidden = model(torch.tensor([row["input_ids"]], device=device), output_hidden_states=True,
                           **kwargs).hidden_states
            refs[row["id"]] = {"hidden_states": torch.stack([h[0] for h in hidden]).float().cpu(),
                               "prenorm": seen["prenorm"][0].float().cpu()}
    torch.save(refs, out)


def reference_in_a_process(model_dir: str, rows: list[dict], workdir: str, dtype: str = "float32",
                           device: str = "cpu") -> dict:
    """`reference` of `rows` in a process of its own (its memory, and the GPU's, given back)."""
    import torch

    samples, out = os.path.join(workdir, "hf-samples.json"), os.path.join(workdir, f"hf-refs-{dtype}.pt")
    with open(samples, "w") as f:
        json.dump(rows, f)
    done = subprocess.run([sys.executable, "-m", "tools.gpu.qwen25_vl", "reference", model_dir, samples, out,
                           dtype, device], timeout=600, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"HF reference failed:\n{done.stderr[-4000:]}")
    return torch.load(out)


if __name__ == "__main__":  # reference MODEL SAMPLES OUT DTYPE DEVICE
    if sys.argv[1] == "reference":
        reference(*sys.argv[2:])
