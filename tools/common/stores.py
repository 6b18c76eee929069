"""Synthetic stores of EAGLE-3-sized samples (4 layers of a Llama-3-8B, hidden 4,096, bf16), so the
store-side benchmarks (export, dataset, verify) need no engine and no model."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from corecap.store import (
    FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Record, Store, StoreMeta, decode_header, encode_sample,
)
from corecap.store.format import header_crc

HIDDEN, NUM_LAYERS, VOCAB = 4096, 32, 128256
# speculators' store holds layers 2,16,29,prenorm, SpecForge's 2,16,29,32.
LAYERS = {"speculators": (2, 16, 29, "prenorm"), "specforge": (2, 16, 29, 32)}


def eagle3_meta(layers: tuple, codec: str = "zstd-planes", version: str = "bench") -> StoreMeta:
    identity = ModelIdentity(
        path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB,
    )
    return StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=layers, layer_meaning=LAYER_MEANING,
        dtype="bfloat16", hidden_size=HIDDEN, corecap_version=version, vllm_version="none", codec=codec,
    )


def build_store(path: str, fmt: str, first: int, count: int, tokens: int, codec: str = "zstd-planes",
                distinct: int = 8) -> None:
    """Samples first..first+count-1 (keys s000000...) with `fmt`'s layers, committed 8 at a time.
    Activation-like states (per-channel scales: a few channels much larger, so zstd-planes
    compresses them as it does real ones); only `distinct` tensors are encoded and reused under
    other keys, since encoding is the slow part of building."""
    layers = LAYERS[fmt]
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(HIDDEN, generator=g))
    base = []
    for i in range(distinct):
        states = (torch.randn(len(layers), tokens, HIDDEN, generator=g) * scale).bfloat16()
        ids = np.random.default_rng(i).integers(0, VOCAB, size=tokens).astype(np.int32)
        mask = (np.arange(tokens) >= tokens // 4).astype(np.uint8)
        base.append(encode_sample("x", ids, states, layers, codec=codec, loss_mask=mask))
    encoder = msgspec.msgpack.Encoder()
    with Store.create_or_open(path, eagle3_meta(layers, codec)) as store:
        batch = []
        for i in range(first, first + count):
            r = base[i % distinct]
            key = f"s{i:06d}"
            header = msgspec.structs.replace(decode_header("x", r.header), id=key)
            header = msgspec.structs.replace(header, header_crc=header_crc(header))  # over the new id too
            batch.append(Record(key, encoder.encode(header), r.parts))
            if len(batch) == 8:
                store.put_many(batch)
                batch = []
        if batch:
            store.put_many(batch)


def random_store(path: str, num_samples: int, tokens: int, codec: str) -> None:
    """num_samples distinct samples of unit-normal states (nothing for a codec to find), layers 2,16,29,32."""
    layers = LAYERS["specforge"]
    g = torch.Generator().manual_seed(0)
    with Store.create_or_open(path, eagle3_meta(layers, codec, version="0")) as store:
        for i in range(num_samples):
            states = torch.randn(len(layers), tokens, HIDDEN, generator=g).bfloat16()
            ids = np.arange(tokens, dtype=np.int32)
            store.put_many([encode_sample(f"s{i:06d}", ids, states, layers, codec=codec)])
