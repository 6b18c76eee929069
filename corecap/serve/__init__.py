"""`corecap serve`: the capture server that trainers call while they train (online training).

A trainer's data loader asks for each sample's hidden states over HTTP (speculators'
`--vllm-endpoint`: `POST /v1/completions` with the token ids, or `/v1/chat/completions`);
corecap captures them with the same engine and exactness as `corecap run`, batching the
requests that arrive together, writes each sample to a file in the layout the trainer's own
reader loads (`--hidden-states-backend file|fp8`), and answers with its path in
`kv_transfer_params`. docs/serve.md has the endpoints, backends and limits.

    serve(ServeConfig(run=build(model=..., layers=...), port=8000), log=print)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from corecap import writer_lock as lock
from corecap.errors import CorecapError
from corecap.serve.config import ServeConfig

_SHUTDOWN_S = 30  # on SIGTERM or Ctrl-C: how long requests in flight get to be answered


def serve(cfg: ServeConfig, log=print, stop: threading.Event | None = None) -> None:
    """Serve until `stop` is set (returns: the CLI sets it on SIGTERM and Ctrl-C) or until the
    engine fails (raises CorecapError). Installs no signal handler of its own."""
    import uvicorn

    from corecap._vllm import environment
    from corecap.serve.app import build_app
    from corecap.serve.engine_loop import EngineLoop
    from corecap.serve.metrics import Metrics
    from corecap.serve.prepare import prepare
    from corecap.serve.store_copy import StoreReport, open_store

    _check_port(cfg.host, cfg.port)
    if cfg.nixl_sidecar_port is not None:
        from corecap.serve import nixl

        nixl.check_installed()
        _check_port(cfg.host, cfg.nixl_sidecar_port, "--nixl-sidecar-port")
    # --store: its one writer from the start, as `corecap run` holds it (a second is refused at once)
    with lock.held(cfg.store) if cfg.store else contextlib.nullcontext(), environment():
        plan = prepare(cfg, log)
        log(plan.settings_line)
        log(f"layers {list(plan.layers)}: files hold {[*plan.aux_layers, 'prenorm']} "
            f"(--hidden-states-backend {cfg.backend}, in {plan.cfg.hidden_states_path})")
        loop = EngineLoop(plan, log, Metrics())
        if cfg.store:  # made, or checked against this model, its layers and dtype, before any weight loads
            loop.num_requests = open_store(plan, log)
            loop.store = StoreReport(cfg.store, loop.metrics, log)
        if cfg.nixl_sidecar_port is not None:
            loop.nixl = nixl.NixlStates(cfg.nixl_sidecar_port, cfg.nixl_pool_bytes, plan.max_len)
            log(f"ModelOpt's streaming dataset: data.streaming_server_url http://{cfg.host}:{cfg.nixl_sidecar_port} "
                f"(states over NIXL, {nixl.backends()}; --nixl-pool-gb {cfg.nixl_pool_bytes / 2**30:g})")
        loop.start()
        loop.started = time.time()
        server = _server_class()(uvicorn.Config(
            build_app(plan, loop), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=_SHUTDOWN_S, lifespan="off",
        ))

        def stop_serving() -> None:
            server.should_exit = True

        loop.on_failure = stop_serving
        stop = stop or threading.Event()

        def stop_when_asked() -> None:
            stop.wait()
            stop_serving()

        threading.Thread(target=stop_when_asked, daemon=True, name="corecap-stop").start()
        log(f"serving {plan.model_name} on http://{cfg.host}:{cfg.port}/v1 (Ctrl-C or SIGTERM stops)")
        try:
            server.run(sockets=_sockets(cfg))
        finally:
            loop.stop(timeout=_SHUTDOWN_S)
            if loop.store is not None:
                log(loop.store.line())
    if loop.failure is not None:
        raise CorecapError(loop.failure)
    log("stopped")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its signal handlers (which re-raise the signal once it has
        stopped, killing the process before the engine is shut down): the caller's `stop` ends it."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server


def _check_port(host: str, port: int, option: str = "--port") -> None:
    """The address is free, before the model loads (a taken port is a minute's load wasted)."""
    _bound(host, port, option).close()


def _bound(host: str, port: int, option: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise CorecapError(f"--host {host} {option} {port}: cannot listen there ({e.strerror})") from None
    return s


def _sockets(cfg: ServeConfig) -> list[socket.socket]:
    """The API's port and, with --nixl-sidecar-port, the sidecar's: one app answers both (the
    handlers tell them apart by the port a request came to)."""
    sockets = [_bound(cfg.host, cfg.port, "--port")]
    if cfg.nixl_sidecar_port is not None:
        sockets.append(_bound(cfg.host, cfg.nixl_sidecar_port, "--nixl-sidecar-port"))
    return sockets


__all__ = ["ServeConfig", "serve"]
