"""What the driver and the sink process say to each other (corecap/sink/process.py): the driver's
control messages, in order on one socket, and the sink's final status."""

from __future__ import annotations

import msgspec

from corecap.sink.mooncake import SpecCapture
from corecap.store.generated import Generation
from corecap.store.media import Media


class Expect(msgspec.Struct, array_like=True, tag=1, kw_only=True):
    req_id: str
    key: str
    token_ids: bytes  # int32 LE
    loss_mask: bytes | None = None
    block_hashes: list[bytes] | None = None  # vLLM's, of each full block, with prefix caching on
    max_new: int = 0  # the model writes up to this many tokens after token_ids (`Generated` says which)
    reserved: int = 0  # bytes of --buffer-gb the driver reserved for it, released at its commit (sink/budget.py)
    spec_capture: SpecCapture | None = None  # `corecap serve`'s /generate: SpecForge's objects, not the default
    lossless: bool = False  # `corecap serve`: this sample's file in the stored dtype, whatever the backend
    store_key: str = ""  # `corecap serve --store`: once delivered, also committed under this key ("": not)
    media: Media | None = None  # the sample's images (store/media.py)


class Hits(msgspec.Struct, array_like=True, tag=6):
    """vLLM took this request's first `num_blocks` blocks from its prefix cache (sink/prefix_cache.py)."""

    req_id: str
    num_blocks: int


class Drop(msgspec.Struct, array_like=True, tag=7):
    """Stop keeping this block's states: the driver counted `count` productions of it."""

    block_hash: bytes
    count: int


class BlockHash(msgspec.Struct, array_like=True, tag=8):
    """The hash of block `index` of a generating request, which its response completes."""

    req_id: str
    index: int
    block_hash: bytes


class Generated(msgspec.Struct, array_like=True, tag=9):
    """The response the model wrote for a request: the sample is its prompt, then these tokens."""

    req_id: str
    token_ids: bytes  # int32 LE
    generation: Generation


class Forget(msgspec.Struct, array_like=True, tag=11):
    """Drop this request's sample, what is here and what is still on its way (the server aborted it);
    with prefix caching on, once the states of its first `until` positions are here (sink/collect.py)."""

    req_id: str
    until: int = 0


class Discard(msgspec.Struct, array_like=True, tag=13):
    """Remove these Mooncake objects, written for a client that went away (`corecap serve`)."""

    keys: list[str]


class Finish(msgspec.Struct, array_like=True, tag=2):
    pass


class Abort(msgspec.Struct, array_like=True, tag=3):
    pass


class Done(msgspec.Struct, array_like=True, kw_only=True, tag=4):
    num_committed: int
    num_tokens: int
    nbytes: int
    raw_bytes: int
    num_incomplete: int
    flagged: list[str]
    chunks: list[dict]
    commits: list[dict]
    encodes: list[dict]
    writes: list[dict]
    num_referring: int = 0  # stored once: samples committed with a reference to others
    referred_bytes: int = 0  # the raw states those references stand for, not written
    num_stored_whole: int = 0  # samples with cache hits stored whole (their source not yet committed)
    num_streamed: int = 0  # long samples streamed to disk as their chunks came (sink/stream.py)
    rss_start: int = 0  # the sink's resident bytes once ready, before any chunk
    rss_peak: int = 0  # its peak resident bytes (VmHWM)
    buffers_peak: int = 0  # the most its buffers for states held at once (BufferPool.peak_bytes)


class Delivered(msgspec.Struct, array_like=True, tag=10):
    """A sample written to its file (`corecap serve`: corecap/sink/deliver.py), or why not."""

    req_id: str
    nbytes: int
    error: str = ""
    full: bool = False  # the error: the Mooncake store has no room now (the client may ask again)


class Kept(msgspec.Struct, array_like=True, kw_only=True, tag=12):
    """`corecap serve --store`: what the sink's copy to the store has done since it started
    (sink/store_copy.py), sent as it changes."""

    num_committed: int
    num_tokens: int
    nbytes: int
    num_same: int = 0  # delivered, not stored again: their key was stored already, with the same input
    num_other: int = 0  # delivered, not stored: their key was stored already, with another input
    first_other: str = ""  # the first of those keys
    failure: str = ""  # why the store takes no more samples ("": it does)


class Failed(msgspec.Struct, array_like=True, tag=5):
    message: str
    num_committed: int


Control = Expect | Finish | Abort | Hits | Drop | BlockHash | Generated | Forget | Discard
Status = Done | Failed | Delivered | Kept
