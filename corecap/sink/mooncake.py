"""Each sample into a Mooncake store instead of a file (`corecap serve --hidden-states-backend
mooncake`): no shared file system between the server and the trainer, only Mooncake's transfer
engine. Two layouts, each its trainer's own:

- speculators (`/v1/completions`): one object a sample, as hs_connectors'
  `MooncakeHiddenStatesStore.get_sample` loads it: `hidden_states` [T, L, H] in the captured
  dtype, then `token_ids` [T] int64, each at a 64-byte-aligned offset, described by the manifest
  the server answers with (`kv_transfer_params`). A write that fails for another reason than
  room leaves `KEY:error` ({"error": why}), as vLLM's connector does for its reader, which waits
  for one key or the other.
- SpecForge (`/generate` with `spec_capture`): one object a tensor, `{store_id}/{sample_id}/g{gen}/
  {name}` as its `MooncakeFeatureStore` reads them: the raw bytes of the aux layers concatenated
  [1, T, A*H], the state after the final norm [1, T, H], and the client's own tensors
  (`passthrough`); the shapes and dtypes travel in the HTTP answer.

The objects live in the segment this process (the sink) gives the store, hard-pinned (`_pinned`):
they last until the trainer removes each once read, or the server those of a client that went
away, or the server stops."""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from corecap.errors import CorecapError

ALIGN = 64  # each tensor's offset in the object, as hs_connectors packs them
VERSION = 1  # the manifest's version that speculators' reader takes
ERROR_SUFFIX = ":error"
STORE_FULL = -200  # Mooncake's NO_AVAILABLE_HANDLE: no segment has room for the object


class StoreFull(OSError):
    """The store has no room for a sample now: the trainer has not yet taken enough of the objects
    put so far (the server answers 503, and the client asks again)."""


class Passthrough(msgspec.Struct, array_like=True):
    """A tensor the client sends to be stored as it is (SpecForge's input_ids, loss_mask, ...)."""

    name: str
    data: bytes  # its raw bytes, C order


class SpecCapture(msgspec.Struct, array_like=True, kw_only=True):
    """Where SpecForge wants one sample's tensors: `{prefix}{name}` for each."""

    prefix: str  # "{store_id}/{sample_id}/g{gen}/"
    aux: str | None  # the aux layers' feature name (None: not wanted)
    target: str | None  # the post-norm state's feature name (None: not wanted)
    replace: bool = False  # a retry: what an earlier attempt put under these keys goes first
    passthrough: list[Passthrough] = []

    def keys(self) -> list[str]:
        """The objects the sample's tensors are put under, in the order they are put."""
        names = [n for n in (self.aux, self.target) if n is not None] + [p.name for p in self.passthrough]
        return [self.prefix + name for name in names]


@dataclass(frozen=True, kw_only=True)
class MooncakeOptions:
    """How the server joins the Mooncake store: speculators' launcher's settings, same defaults."""

    master: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    local_hostname: str = "127.0.0.1"  # where the trainer reaches this server's segment
    global_segment_bytes: int = 4 << 30  # what the server gives the store: the states not yet taken
    local_buffer_bytes: int = 2 << 30


def layout(num_tokens: int, num_layers: int, hidden_size: int, dtype: torch.dtype) -> tuple[dict, int]:
    """Each tensor's shape, dtype (torch's name), bytes and offset; the object's aligned size."""
    tensors, offset = {}, 0
    for name, shape, kind in (("hidden_states", [num_tokens, num_layers, hidden_size], dtype),
                              ("token_ids", [num_tokens], torch.int64)):
        nbytes = int(np.prod(shape)) * kind.itemsize
        tensors[name] = {"shape": shape, "dtype": str(kind), "nbytes": nbytes, "offset": offset}
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    return tensors, offset


def manifest(handle: str, num_tokens: int, num_layers: int, hidden_size: int, dtype: torch.dtype,
             with_response: bool = False) -> dict:
    """What the server answers with: where the sample is, and how to read it."""
    tensors, total = layout(num_tokens, num_layers, hidden_size, dtype)
    mode = "all" if with_response else "prompt_only"  # hs_connectors' names: the response's tokens too, or not
    return {"handle": handle, "version": VERSION, "tensors": tensors,
            "metadata": {"num_tokens": num_tokens, "total_aligned_bytes": total, "extract_mode": mode}}


class MooncakeWriter:
    """The sink's client of the Mooncake store (its segment holds what the server puts)."""

    def __init__(self, options: MooncakeOptions):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise CorecapError(f"--hidden-states-backend mooncake needs Mooncake's transfer engine ({e}): "
                               "pip install mooncake-transfer-engine (mooncake-transfer-engine-non-cuda "
                               "without CUDA; it needs libibverbs1)") from None
        self.store = MooncakeDistributedStore()
        status = self.store.setup(options.local_hostname, options.metadata_server, options.global_segment_bytes,
                                  options.local_buffer_bytes, options.protocol, options.device, options.master)
        if status != 0:
            raise CorecapError(f"--mooncake-master {options.master}: joining the Mooncake store failed (status "
                               f"{status}); is mooncake_master running there, with --mooncake-metadata-server "
                               f"{options.metadata_server} as its clients use?")

    def put_tensors(self, capture: SpecCapture, tensors: dict[str, torch.Tensor]) -> int:
        """SpecForge's objects, one a tensor (`tensors`: the aux and target features, in that
        order); their bytes. On a failure, what this call put is removed again (no half sample is
        ever readable) and OSError says why (StoreFull where the store has no room now)."""
        config = _pinned()
        tensors = dict(tensors, **{p.name: torch.frombuffer(bytearray(p.data), dtype=torch.uint8)
                                   for p in capture.passthrough})
        keys = capture.keys()
        if capture.replace:  # Mooncake keeps the first value put under a key: an earlier attempt's goes
            for key in keys:
                self.store.remove(key, force=True)
        written, total = [], 0
        for key, tensor in zip(keys, tensors.values()):
            tensor = tensor.contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            self.store.register_buffer(tensor.data_ptr(), nbytes)
            try:
                status = self.store.put_from(key, tensor.data_ptr(), nbytes, config)
            finally:
                self.store.unregister_buffer(tensor.data_ptr())
            if status != 0:
                for done in written:
                    self.store.remove(done, force=True)
                if status == STORE_FULL:
                    raise StoreFull(f"the Mooncake store has no room for {key} ({nbytes:,} bytes) until the trainer "
                                    "takes what was put before")
                raise OSError(f"the Mooncake store refused {key} ({nbytes:,} bytes, status {status})")
            written.append(key)
            total += nbytes
        return total

    def put(self, handle: str, token_ids: np.ndarray, states: torch.Tensor) -> int:
        """One sample (`states` [T, L, H]) under `handle`; its bytes. Raises StoreFull where the
        store has no room for it now, OSError where it refuses it otherwise."""
        tensors, total = layout(states.shape[0], states.shape[1], states.shape[2], states.dtype)
        packed = torch.zeros(total, dtype=torch.uint8)
        hs, ids = tensors["hidden_states"], tensors["token_ids"]
        packed[hs["offset"] : hs["offset"] + hs["nbytes"]].copy_(states.contiguous().view(-1).view(torch.uint8))
        packed[ids["offset"] : ids["offset"] + ids["nbytes"]].copy_(
            torch.from_numpy(np.asarray(token_ids, np.int64)).view(torch.uint8))
        self.store.register_buffer(packed.data_ptr(), total)
        try:
            status = self.store.put_from(handle, packed.data_ptr(), total, _pinned())
        finally:
            self.store.unregister_buffer(packed.data_ptr())
        if status == STORE_FULL:  # answered 503: no reader looks for this handle
            raise StoreFull(f"the Mooncake store has no room for {total:,} bytes until the trainer takes what "
                            "was put before")
        if status != 0:
            why = f"the Mooncake store refused {total:,} bytes (status {status})"
            self.store.put(handle + ERROR_SUFFIX, json.dumps({"error": why}).encode())
            raise OSError(why)
        return total

    def discard(self, keys: list[str]) -> None:
        """Remove objects nobody will read (their client went away), error markers included."""
        for key in keys:
            for k in (key, key + ERROR_SUFFIX):
                self.store.remove(k, force=True)  # a key not there is no error


def _pinned():
    """Where each object goes: one replica, hard-pinned, as SpecForge's own writer puts them. The
    store never evicts it to make room for another (a reader waiting for it would wait in vain);
    once full, a put fails and the server answers 503 until the trainer takes (removes) objects."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = 1
    config.with_hard_pin = True
    return config
