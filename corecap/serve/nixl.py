"""ModelOpt's streaming dataset (`data.streaming_server_url`) reads each sample's states with a
NIXL READ from the server's memory, guided by a small HTTP sidecar. This module is that memory
and that sidecar's answers: `NixlStates` holds one pool registered with NIXL once, when the
server starts (the reader fetches the server's agent metadata once per host, so memory
registered later would be unknown to it), and places each sample's states in a range of it
until the reader says `/done`.

A request that arrives on the sidecar's port (`--nixl-sidecar-port`) is answered with
`kv_transfer_params` `{hs_req_id, hs_sidecar_port, hs_max_tokens}`, as vLLM's RDMA hidden-states
connector answers; the reader then asks, on that port:

    GET /meta                   {"agent_metadata": base64 of the server's NIXL agent metadata}
    GET /desc?req_id=ID         {"ready": true, "hs_descs": base64 of the serialized descriptors,
                                 "hs_shape": [T, L, H], "hs_dtype": "float32", "token_ids": [...],
                                 "slot": N}; 404 for an ID the server does not hold
    GET /done?req_id=ID         {"freed": ID, "valid": true}: the range is free again

The states are vLLM's `extract_hidden_states` layout: the aux layers ascending, then the last
decoder layer's output before the final norm (the layers of speculators' file), in the stored
dtype, every token of the request."""

from __future__ import annotations

import base64
import os
import threading
import uuid
from dataclasses import dataclass

import torch

from corecap.errors import CorecapError

INSTALL = "pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
_ALIGN = 64  # each sample's range starts on a cache line


class PoolFull(CorecapError):
    """No room in the pool for another sample's states now (HTTP 503, with Retry-After)."""


@dataclass
class Held:
    """One sample's range of the pool, from its request until the reader's /done; its states,
    once written (`descs` set)."""

    offset: int
    nbytes: int  # reserved: the most the sample's states may take
    shape: tuple[int, ...] = ()
    dtype: str = ""
    token_ids: list[int] | None = None
    descs: bytes | None = None  # NIXL's serialized descriptor of the states' bytes


def check_installed() -> None:
    """NIXL's Python package is importable (checked before the model loads)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        raise CorecapError(f"--nixl-sidecar-port: NIXL is not installed ({e}): {INSTALL}") from None


def backends() -> list[str]:
    """NIXL's transports, as ModelOpt's reader picks them (`NIXL_BACKENDS`, default UCX): both
    ends must use the same one."""
    return os.environ.get("NIXL_BACKENDS", "UCX").split(",")


class NixlStates:
    def __init__(self, port: int, pool_bytes: int, max_tokens: int):
        from nixl._api import nixl_agent, nixl_agent_config

        self.port, self.max_tokens = port, max_tokens
        self.pool = torch.empty(pool_bytes, dtype=torch.uint8)
        self.agent = nixl_agent(f"corecap-serve-{uuid.uuid4()}", nixl_agent_config(backends=backends()))
        self.registration = self.agent.register_memory([self.pool])
        self.metadata = self.agent.get_agent_metadata()  # unchanged from here on: nothing else is registered
        self.held: dict[str, Held] = {}
        self.lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self.lock:
            return self._used_locked()

    def params(self, name: str) -> dict:
        """The `kv_transfer_params` ModelOpt's reader takes from the completion's answer."""
        return {"hs_req_id": name, "hs_sidecar_port": self.port, "hs_max_tokens": self.max_tokens}

    def reserve(self, name: str, nbytes: int) -> None:
        """A range for a request's states, taken when it is asked (so a full pool is a 503 before
        any work, never a failure after it); PoolFull without one."""
        with self.lock:
            offset = self._free_range(nbytes)
            if offset is None:
                raise PoolFull(f"{self._line_locked()}: no room for {nbytes / 2**20:,.1f} MiB more; "
                               "the trainer has not read the states held so far")
            self.held[name] = Held(offset=offset, nbytes=nbytes)

    def hold(self, name: str, states: torch.Tensor, token_ids: list[int]) -> None:
        """Copy a sample's states [T, L, H] into its range (none: its request was abandoned)."""
        nbytes = states.numel() * states.element_size()
        with self.lock:
            held = self.held.get(name)
        if held is None:
            return
        assert nbytes <= held.nbytes, (name, nbytes, held.nbytes)
        view = self.pool[held.offset:held.offset + nbytes]
        view.view(states.dtype).view(states.shape).copy_(states)
        descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs([view]))
        with self.lock:
            held.shape, held.dtype = tuple(states.shape), str(states.dtype).removeprefix("torch.")
            held.token_ids, held.descs = token_ids, descs

    def describe(self, name: str) -> dict | None:
        """/desc's answer for a sample held, or None; `ready` false while its states are computed."""
        with self.lock:
            held = self.held.get(name)
            if held is None:
                return None
            if held.descs is None:
                return {"ready": False}
            return {"ready": True, "hs_descs": base64.b64encode(held.descs).decode(), "hs_shape": list(held.shape),
                    "hs_dtype": held.dtype, "token_ids": held.token_ids, "slot": held.offset // _ALIGN}

    def release(self, name: str) -> bool:
        """/done: the reader has the states; their range is free. False for a name not held."""
        with self.lock:
            return self.held.pop(name, None) is not None

    def _free_range(self, nbytes: int) -> int | None:
        """The first gap between the ranges held that fits `nbytes` (first fit, aligned)."""
        start = 0
        for held in sorted(self.held.values(), key=lambda h: h.offset):
            if held.offset - start >= nbytes:
                return start
            start = -(-(held.offset + held.nbytes) // _ALIGN) * _ALIGN
        return start if self.pool.numel() - start >= nbytes else None

    def _used_locked(self) -> int:
        return sum(h.nbytes for h in self.held.values())

    def _line_locked(self) -> str:
        return (f"{self._used_locked() / 2**20:,.0f} MiB of states not yet read over NIXL, the pool holds "
                f"{self.pool.numel() / 2**20:,.0f} MiB (--nixl-pool-gb)")
