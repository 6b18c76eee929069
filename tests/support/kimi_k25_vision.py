"""The tiny Kimi-K2.5 of tests/support/kimi_k25.py made usable with images: its tokenizer (the
media tokens at the config's ids), a chat template that renders image parts as Kimi-K2.5's
`<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`, and the processor config
(`preprocessor_config.json`, `media_proc_cfg`) that vLLM's KimiK25FusedVisionProcessor reads,
with patch limits so small that an image gives a few tokens. `images` writes PNGs of given sizes.

HF's reference (`reference`) runs transformers' Kimi_K25ForConditionalGeneration on the expanded
ids the store holds and the pixel values vLLM's own image processor makes of the same files
(normalized on the host: the engine runs with `mm_device_do_normalize` off), in a process of its
own as tiny_models.reference does; in float32 on the CPU by default, in another dtype or on a
GPU for tools/gpu/images_exact.py, which runs this file as a script. `expected_prefix_hits`: what
vLLM's prefix cache may serve a run's samples with images, derived from the stored ids and images
alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

try:
    from support import kimi_k25
except ImportError:  # run as a script
    import kimi_k25

# Patches of 2 px, merged 2 x 2 into one token: an image of W x H px gives ceil(W/4) * ceil(H/4)
# tokens (up to the limits), a 12 x 8 image 6.
MEDIA_PROC_CFG = dict(
    patch_size=2, merge_kernel_size=2, in_patch_limit=256, patch_limit_on_one_side=16, fixed_output_tokens=None,
    in_patch_limit_each_frame=256, in_patch_limit_video=256, temporal_merge_kernel_size=4,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
)
MEDIA_TOKENS = ("<|media_pad|>", "<|kimi_k25_video_placeholder|>", "<|media_begin|>", "<|media_end|>")
_PART = ("{%- macro part(p) -%}{%- if p is string -%}{{ p }}"
         "{%- elif p['type'] == 'image' or p['type'] == 'image_url' -%}"
         "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
         "{%- else -%}{{ p['text'] }}{%- endif -%}{%- endmacro -%}")
CHAT_TEMPLATE = (
    _PART + "{%- macro content(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{%- for p in c -%}{{ part(p) }}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ content(m['content']) }}<|end|>{% endgeneration %}"
    "{% else %}{{ content(m['content']) }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build(path: str, seed: int = 0, **options) -> str:
    """kimi_k25.build's checkpoint (`options`: its keyword arguments), with a tokenizer and the
    processor config."""
    kimi_k25.build(path, seed=seed, **options)
    return processor_files(path)


def checkpoint(path: str, text: dict | None = None, vision: dict | None = None,
               media_proc_cfg: dict | None = None) -> str:
    """A checkpoint without weights, for dummy weights (tools/gpu/images.py runs this file as a
    script): kimi_k25.write_config's config, the tokenizer (its vocabulary the config's) and the
    processor config (`media_proc_cfg`, by default MEDIA_PROC_CFG)."""
    kimi_k25.write_config(path, text, vision)
    return processor_files(path, media_proc_cfg)


def processor_files(path: str, media_proc_cfg: dict | None = None) -> str:
    """The tokenizer and the processor config beside the config.json at `path`."""
    _tokenizer(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"media_proc_cfg": media_proc_cfg or MEDIA_PROC_CFG}, f, indent=2)
    return path


def _tokenizer(path: str) -> None:
    """A byte-level BPE below the config's first media token id (filled up to it with unused
    tokens), then the four media tokens at the config's ids, and <|media_content|> among the fill."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|media_content|>"]
    texts = ["the quick brown fox jumps over the lazy dog", "what is in this picture", "a red square and a circle",
             "describe the image", "two pictures of different sizes"] * 20
    trainer = trainers.BpeTrainer(vocab_size=config["image_token_id"], special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fill = config["image_token_id"] - tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(f"<|unused_{i}|>", special=True) for i in range(fill)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in MEDIA_TOKENS])
    ids = [tok.token_to_id(t) for t in MEDIA_TOKENS]
    want = [config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    assert ids == want, (ids, want)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def images(directory: str, sizes, seed: int = 0) -> list[str]:
    """PNG files of random RGB pixels, one per (width, height), named image-W-H-K.png."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for k, (w, h) in enumerate(sizes):
        p = os.path.join(directory, f"image-{w}-{h}-{k}.png")
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


def pixel_values(model_dir: str, paths: list[str]):
    """(pixel_values, grid_thws) of the images, as vLLM's own Kimi image processor makes them
    (normalized on the host)."""
    from PIL import Image
    from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

    processor = KimiK25FusedVisionProcessor.from_pretrained(model_dir)
    medias = [{"type": "image", "image": Image.open(p).convert("RGB"), "uuid": None} for p in paths]
    out = processor.preprocess(medias, return_tensors="pt")
    return out["pixel_values"], out["grid_thws"]


def reference(model_dir: str, samples: str, out: str, dtype: str = "float32", device: str = "cpu") -> None:
    """HF's states for each sample of `samples` (JSON: [{"id", "input_ids", "images": [paths]}]):
    every hidden state and the last decoder layer's output before the final norm (as float32 on
    the CPU, whatever `dtype` and `device` the model ran in); with "prompt" and "greedy" (counts),
    HF's greedy answer of that many tokens to the first "prompt" ids."""
    import torch
    import transformers

    model, loading = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), output_loading_info=True)
    unread = {key: sorted(names) for key, names in loading.items() if names}
    if unread:
        raise SystemExit(f"{model_dir}: transformers did not read every weight: {unread}")
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
            # greedy decoding from the first `prompt` ids, the whole sequence run again each step
            ids = list(row["input_ids"][: row.get("prompt", 0)])
            for _ in range(row.get("greedy", 0)):
                logits = model(torch.tensor([ids], device=device), **kwargs).logits
                ids.append(int(logits[0, -1].argmax()))
            refs[row["id"]]["greedy"] = ids[row.get("prompt", 0):]
    torch.save(refs, out)


def expected_prefix_hits(samples, block: int) -> dict:
    """Per stored sample ((key, sample), in the order the run added them): the prompt tokens a
    prefix cache over whole blocks may serve it from an earlier sample, where a block is shared
    only when the ids up to its end are and so is every image (by its bytes' SHA-256, at its
    offset) that starts before its end. A request computes its prompt's last token itself: at
    most (prompt - 1) // block blocks, of the earlier sample's whole blocks."""
    import numpy as np

    def images_before(sample, end):
        media = sample.header.media
        return [(i.offset, i.sha256) for i in (media.items if media else ()) if i.offset < end]

    out = {}
    for k, (key, sample) in enumerate(samples):
        ids, best = sample.input_ids, 0
        generation = sample.header.generation
        prompt = generation.num_prompt if generation is not None else len(ids)
        for _, earlier in samples[:k]:
            n = 0
            while ((n + 1) * block <= min(prompt - 1, len(earlier.input_ids))
                   and np.array_equal(ids[:(n + 1) * block], earlier.input_ids[:(n + 1) * block])
                   and images_before(sample, (n + 1) * block) == images_before(earlier, (n + 1) * block)):
                n += 1
            best = max(best, n * block)
        out[key] = best
    return out


def reference_in_a_process(model_dir: str, rows: list[dict], workdir: str, dtype: str = "float32",
                           device: str = "cpu") -> dict:
    """`reference` of `rows` in a process of its own (its memory, and the GPU's, given back)."""
    import torch

    samples, out = os.path.join(workdir, "hf-samples.json"), os.path.join(workdir, f"hf-refs-{dtype}.pt")
    with open(samples, "w") as f:
        json.dump(rows, f)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "reference", model_dir, samples, out,
                           dtype, device], timeout=600, capture_output=True, text=True)
    if done.returncode:
        raise AssertionError(f"HF reference failed:\n{done.stderr[-4000:]}")
    return torch.load(out)


if __name__ == "__main__":  # reference MODEL SAMPLES OUT [DTYPE [DEVICE]] | build PATH [OPTIONS_JSON]
    if sys.argv[1] == "reference":
        reference(*sys.argv[2:])
    elif sys.argv[1] == "build":
        build(sys.argv[2], **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
    elif sys.argv[1] == "checkpoint":  # checkpoint PATH OPTIONS_JSON: checkpoint's keyword arguments
        checkpoint(sys.argv[2], **json.loads(sys.argv[3]))
