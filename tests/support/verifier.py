"""A tiny verifier and the states a capture of it would store, for the exporters, the readers
and StoreDataset (no engine): its shape, HF's reference for a sample, a store built from the
references, and the check that a dataset item is exactly what was stored."""

from __future__ import annotations

import numpy as np
import torch

VERIFIER_LAYERS = 4
VERIFIER_HIDDEN = 64
VERIFIER_VOCAB = 256
CAPTURED_LAYERS = (1, 2, 3, VERIFIER_LAYERS, "prenorm")  # what `corecap run --layers 1,2,3,4,prenorm` stores
CAPTURED_LENGTHS = (9, 23, 1, 40, 17, 5, 31, 12, 2, 26, 8, 19)  # 12 samples: data_10 sorts after data_2 only if padded


def verifier_reference(model, token_ids) -> dict:
    """HF's states for one sample, [layer] → [T, H] float32: hidden_states[k] for every k
    (k = N is after the final norm), "prenorm" (the last decoder layer's output, taken with a
    hook, before the norm) and the logits [T, V]."""
    captured = []

    def hook(module, args, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach())

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(map(int, token_ids))]), output_hidden_states=True)
    finally:
        handle.remove()
    ref = {k: h[0] for k, h in enumerate(out.hidden_states)}
    ref["prenorm"] = captured[0][0]
    ref["logits"] = out.logits[0]
    return ref


def write_captured_store(path: str, captured, verifier: str, *, dtype=torch.float32, codec: str = "zstd-planes",
                         layers=CAPTURED_LAYERS, replace: dict | None = None, fields: dict | None = None) -> str:
    """A store holding `captured` at `layers` in `dtype`, built without an engine (several
    commits, as a run makes them). `replace` maps a stored layer to the reference layer whose
    values it gets instead (to build deliberately wrong stores); `fields` maps a key to more of
    its header (encode_sample's `media`, `generation`), as a run on image rows stores them."""
    from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample

    identity = ModelIdentity(
        path=verifier, architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
        num_layers=VERIFIER_LAYERS, hidden_size=VERIFIER_HIDDEN, vocab_size=VERIFIER_VOCAB,
    )
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=tuple(layers), layer_meaning=LAYER_MEANING,
        dtype=str(dtype).removeprefix("torch."), hidden_size=VERIFIER_HIDDEN, corecap_version="test",
        vllm_version="none", codec=codec,
    )
    replace = replace or {}
    records = []
    for key, (ids, mask, ref) in captured.items():
        states = torch.stack([ref[replace.get(k, k)] for k in layers]).to(dtype)
        records.append(encode_sample(key, ids, states, tuple(layers), codec=codec, loss_mask=mask,
                                     **(fields or {}).get(key, {})))
    with Store.create_or_open(path, meta) as store:
        store.put_many(records[:5])
        store.put_many(records[5:])
    return path


def expected_item(captured, key, layers):
    """What StoreDataset must return for `key` at `layers`: input ids, loss mask (all ones when
    none was stored), states, from `captured` (conftest's fixture)."""
    ids, mask, ref = captured[key]
    return (
        torch.from_numpy(ids.astype(np.int64)),
        torch.ones(ids.size, dtype=torch.int64) if mask is None else torch.from_numpy(mask.astype(np.int64)),
        torch.stack([ref[k] for k in layers]),
    )


def check_item(item, captured, layers, dtype=torch.float32):
    ids, mask, states = expected_item(captured, item["key"], layers)
    assert item["input_ids"].dtype == torch.int64 and torch.equal(item["input_ids"], ids)
    assert item["loss_mask"].dtype == torch.int64 and torch.equal(item["loss_mask"], mask)
    assert item["hidden_states"].dtype == dtype
    assert torch.equal(item["hidden_states"], states.to(dtype))
