"""`corecap serve`'s settings: the capture's own (RunConfig: the model, the engine options, the
layers) and the server's, built once by the CLI (or `corecap.serve.build`) and never changed."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from corecap.config import RunConfig
from corecap.errors import CorecapError
from corecap.sink.mooncake import MooncakeOptions

BACKENDS = ("file", "fp8", "mooncake")  # speculators' --hidden-states-backend names that corecap serves
DEFAULT_QUOTA_BYTES = 16 * 2**30
DEFAULT_NIXL_POOL_BYTES = 2 * 2**30


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    run: RunConfig = field(default_factory=RunConfig)  # the model, its engine options, the layers
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required in `Authorization: Bearer KEY` on /v1/* when set
    served_model_name: str | None = None  # what /v1/models lists and requests name (default: --model)
    backend: str = "file"  # how the states reach the trainer: one of BACKENDS
    hidden_states_path: str = "/tmp/hidden_states"  # speculators' launcher's default
    quota_bytes: int = DEFAULT_QUOTA_BYTES  # states written and not yet taken by a reader, at most
    mooncake: MooncakeOptions = field(default_factory=MooncakeOptions)  # with backend "mooncake"
    # ModelOpt's streaming dataset: the port of its sidecar (and of its completions), whose states
    # go to a pool of this many bytes registered with NIXL (corecap/serve/nixl.py)
    nixl_sidecar_port: int | None = None
    nixl_pool_bytes: int = DEFAULT_NIXL_POOL_BYTES
    store: str | None = None  # also commit every sample delivered to this corecap store (serve/store_copy.py)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise CorecapError(f"--hidden-states-backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if not 0 < self.port < 65536:
            raise CorecapError(f"--port {self.port}: expected 1 to 65535")
        if self.nixl_sidecar_port is not None and not (0 < self.nixl_sidecar_port < 65536
                                                       and self.nixl_sidecar_port != self.port):
            raise CorecapError(f"--nixl-sidecar-port {self.nixl_sidecar_port}: expected 1 to 65535, not --port")
        if self.nixl_pool_bytes <= 0:
            raise CorecapError("--nixl-pool-gb: expected more than 0")
        if self.quota_bytes <= 0:
            raise CorecapError("--hidden-states-quota-gb: expected more than 0")
        if not _loopback(self.host) and not self.api_key:
            raise CorecapError(f"--host {self.host}: a server reachable from other machines needs --api-key "
                               "(clients then send it as `Authorization: Bearer KEY`)")
        if self.store is not None and (not self.store or os.path.realpath(self.store) == os.path.realpath(
                self.hidden_states_path)):
            raise CorecapError(f"--store {self.store!r}: expected a directory of its own, not --hidden-states-path "
                               "(the trainer takes its files from there)")
        if self.run.sampling.generate:
            raise CorecapError("--max-tokens: each request of `corecap serve` names its own max_tokens")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything
