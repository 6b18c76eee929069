"""The built-in demo: a tiny Llama made from a fixed seed, and a small dataset in the package.

`corecap run` with no --model/--data uses them, so it works on a fresh machine with no download.
The model (8 layers, hidden 128, head_dim 32: CPU attention needs head_dim >= 32) and a BPE
tokenizer trained on the demo text are built once and cached under $CORECAP_CACHE (default
~/.cache/corecap); the directory is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources

DEMO_VERSION = 1
DEMO_SEED = 0


def demo_data_path() -> str:
    return str(resources.files("corecap") / "demo_data.jsonl")


def cache_dir() -> str:
    return os.environ.get("CORECAP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "corecap")


def demo_model_dir() -> str:
    """The demo model's directory, built on first use."""
    path = os.path.join(cache_dir(), f"demo-llama-v{DEMO_VERSION}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=cache_dir())
    try:
        build_tiny_llama(tmp, seed=DEMO_SEED)
        build_tokenizer(tmp, _demo_texts(), vocab_size=512)
        os.rename(tmp, path)
    except OSError:
        if not os.path.exists(os.path.join(path, "config.json")):  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_tiny_llama(
    path: str, *, seed: int, num_layers: int = 8, vocab_size: int = 512, max_position_embeddings: int = 4096,
    random_norms: bool = False,
) -> None:
    """A tiny Llama from `seed`. `random_norms`: every RMSNorm weight drawn around 1 instead of
    HF's all-ones init, so that a state taken before a norm differs from the one after it in
    more than scale (the tests need that to tell the pre-norm final state from layer N)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    if random_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.5 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)


def build_tokenizer(path: str, texts: list[str], vocab_size: int) -> None:
    """A byte-level BPE trained on `texts`, saved as a HF fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
        "{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(path)


def _demo_texts() -> list[str]:
    with open(demo_data_path()) as f:
        return [obj["text"] for obj in map(json.loads, f) if "text" in obj]
