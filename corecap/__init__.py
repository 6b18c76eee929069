"""corecap: capture an LLM's hidden states at chosen layers, at serving speed, into a store.

    corecap run --model DIR --data FILE.jsonl --store out.lmdb --layers 2,16,29,32,prenorm
    corecap get KEY --store out.lmdb --out sample.safetensors

From Python: `corecap.capture(...)` runs a capture (corecap/api.py); `corecap.open_store(path)`
reads a store (`.keys()`, `.get(key)`: corecap/store/store.py); `corecap.StoreDataset(store)` is
a torch Dataset over one (corecap/training/__init__.py); `corecap.Client(url)` asks a `corecap serve`
for a sample's states and `corecap.ServerDataset(rows, url)` is a torch IterableDataset over one
(corecap/client/). Every user-caused error is a
`corecap.CorecapError` with a one-line message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from corecap.errors import CorecapError

__version__ = "0.2.0"
__all__ = ["Client", "CorecapError", "ServerDataset", "StoreDataset", "__version__", "capture", "open_store"]

if TYPE_CHECKING:  # the names __getattr__ loads on first use, for type checkers
    from corecap.api import capture
    from corecap.client import Client
    from corecap.client.dataset import ServerDataset
    from corecap.training import StoreDataset
    from corecap.store.store import Store

    def open_store(path: str) -> Store: ...


def __getattr__(name: str):
    # The heavy parts (vLLM, torch) load only when asked for: `import corecap` stays cheap.
    if name == "capture":
        from corecap.api import capture

        return capture
    if name == "open_store":
        from corecap.store.store import Store

        return Store.open
    if name == "Client":
        from corecap.client import Client

        return Client
    if name == "ServerDataset":
        from corecap.client.dataset import ServerDataset

        return ServerDataset
    if name == "StoreDataset":
        from corecap.training import StoreDataset

        return StoreDataset
    raise AttributeError(f"module 'corecap' has no attribute {name!r}")
