"""corecap: capture an LLM's hidden states at chosen layers, at serving speed, into a store.

    corecap run --model DIR --data FILE.jsonl --store out.lmdb --layers 2,16,29,32,prenorm
    corecap get KEY --store out.lmdb --out sample.safetensors

From Python: `corecap.capture(...)` (corecap/api.py); `corecap.StoreDataset(store)`, a torch
Dataset over a store (corecap/store/dataset.py).
"""

__version__ = "0.2.0"


from corecap.errors import CorecapError  # noqa: E402  (re-exported: `corecap.CorecapError`)


def __getattr__(name: str):
    # The heavy parts (vLLM, torch) load only when asked for: `import corecap` stays cheap.
    if name == "capture":
        from corecap.api import capture

        return capture
    if name == "StoreDataset":
        from corecap.store.dataset import StoreDataset

        return StoreDataset
    raise AttributeError(f"module 'corecap' has no attribute {name!r}")
