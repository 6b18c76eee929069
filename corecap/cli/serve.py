"""`corecap serve`: the command, its options, and the signals that stop it (the server itself is
corecap/serve/)."""

from __future__ import annotations

import signal
import socket
import threading

import click

from corecap.cli.options import _ENGINE_OPTIONS, _ENGINE_NAMES, _LAYERS_OPTION, _PASS_THROUGH, _one_line_errors, _with
from corecap.errors import CorecapError


@click.command(context_settings=_PASS_THROUGH)
@click.option("--host", type=str, default="127.0.0.1", show_default=True,
              help="Address to listen on; one other than loopback needs --api-key.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--api-key", type=str, default=None,
              help="Required from clients on /v1/* as `Authorization: Bearer KEY`.")
@click.option("--served-model-name", type=str, default=None, help="The model's name in requests (default: --model).")
@click.option("--hidden-states-backend", type=click.Choice(["file", "fp8", "mooncake"]), default="file",
              show_default=True,
              help="How states reach the trainer: a safetensors file per request (file), the same quantized to fp8 "
                   "with a scale per token (fp8), or an object in a Mooncake store (mooncake), as speculators' "
                   "backends of these names read them.")
@click.option("--mooncake-master", type=str, default="127.0.0.1:50051", show_default=True,
              help="The Mooncake master's address (--hidden-states-backend mooncake).")
@click.option("--mooncake-metadata-server", type=str, default="P2PHANDSHAKE", show_default=True,
              help="Mooncake's metadata server, as the trainer names it.")
@click.option("--mooncake-protocol", type=click.Choice(["tcp", "rdma"]), default="tcp", show_default=True)
@click.option("--mooncake-device", type=str, default="", help="RDMA device names (with --mooncake-protocol rdma).")
@click.option("--mooncake-local-hostname", type=str, default=None,
              help="This server's address as the trainer reaches it (default: the host name's address).")
@click.option("--mooncake-global-segment-gib", type=click.FloatRange(min=0.001), default=4.0, show_default=True,
              help="Memory this server gives the Mooncake store: the states put and not yet taken, at most.")
@click.option("--mooncake-local-buffer-gib", type=click.FloatRange(min=0.001), default=2.0, show_default=True)
@click.option("--hidden-states-path", type=str, default="/tmp/hidden_states", show_default=True,
              help="Directory the files are written to; the trainer reads and removes them.")
@click.option("--hidden-states-quota-gb", type=click.FloatRange(min=0.001), default=16.0, show_default=True,
              help="States written and not yet taken, at most; beyond, requests are answered 503 with Retry-After.")
@click.option("--nixl-sidecar-port", type=click.IntRange(1, 65535), default=None,
              help="Also serve ModelOpt's streaming dataset on this port (its data.streaming_server_url): the "
                   "completions asked there are read over NIXL from the server's memory, guided by the sidecar's "
                   "/meta, /desc and /done on the same port.")
@click.option("--nixl-pool-gb", type=click.FloatRange(min=0.001), default=2.0, show_default=True,
              help="Memory registered with NIXL for the states not yet read (--nixl-sidecar-port); beyond, requests "
                   "are answered 503 with Retry-After.")
@click.option("--store", type=str, default=None,
              help="Also commit every sample delivered to the corecap store at this directory, as `corecap run` "
                   "stores it (corecap get/ls/info/export and StoreDataset read it); made if absent, else it must "
                   "hold this model's layers and dtype.")
@click.option("--verbose", "-v", is_flag=True, help="Show vLLM's own log on the terminal too.")
@_LAYERS_OPTION
@click.option("--buffer-gb", type=click.FloatRange(min=0.0), default=None,
              help="The sink's host memory for states: of requests in flight and, with prefix caching, a copy of "
                   "each cached block's (default: 40% of the memory available at start, at least 4).")
@click.option("--prefix-blocks", type=click.IntRange(min=1), default=None,
              help="With prefix caching: the most blocks an engine keeps in vLLM's prefix cache, whose states the "
                   "sink copies (default: what a quarter of --buffer-gb holds, at most the KV cache's blocks); "
                   "beyond, the least recently used leave it.")
@click.option("--private-network/--no-private-network", default=True, show_default=True,
              help="Run vLLM's workers in a network namespace with only loopback (where the machine allows it).")
@_with(_ENGINE_OPTIONS)
@click.pass_context
@_one_line_errors
def serve(ctx, **options) -> None:
    """Serve hidden states to trainers that train online (speculators' --vllm-endpoint).

    Each request (/v1/completions with token ids, or /v1/chat/completions with messages) is
    captured as `corecap run` captures a sample, written to a file under --hidden-states-path in
    the trainer's layout, and answered with that file's path. Any other vLLM engine argument may
    follow, as for `run`. Stops on Ctrl-C or SIGTERM once the requests in flight are answered."""
    from corecap.console import RunLog
    from corecap.serve import serve as serve_states

    cfg = _serve_config(ctx.args, {k: v for k, v in options.items() if k != "verbose"})
    runlog = RunLog(cfg.hidden_states_path, options["verbose"])
    stop = threading.Event()

    def on_signal(signum, frame):  # the first stops serving; a second Ctrl-C interrupts at once
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    error = None
    with runlog:
        try:
            serve_states(cfg, log=runlog.say, stop=stop)
        except CorecapError as e:
            runlog.record(f"corecap: error: {e}\n")
            error = str(e)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if error is not None:
        raise CorecapError(error)


def _serve_config(extra_args: list[str], options: dict):
    """The frozen ServeConfig of `corecap serve`'s options."""
    from corecap.config import EngineOptions, RunConfig, parse_layers
    from corecap.serve.config import ServeConfig
    from corecap.sink.mooncake import MooncakeOptions

    engine = EngineOptions(**{k: v for k, v in options.items() if k in _ENGINE_NAMES}, extra_args=tuple(extra_args))
    layers = options["layers"]
    run = RunConfig(data=None, store="", layers=parse_layers(layers) if layers is not None else None, engine=engine,
                    buffer_bytes=None if options["buffer_gb"] is None else int(options["buffer_gb"] * 2**30),
                    prefix_blocks=options["prefix_blocks"], private_network=options["private_network"])
    return ServeConfig(
        run=run, host=options["host"], port=options["port"], api_key=options["api_key"],
        served_model_name=options["served_model_name"], backend=options["hidden_states_backend"],
        hidden_states_path=options["hidden_states_path"], quota_bytes=int(options["hidden_states_quota_gb"] * 2**30),
        nixl_sidecar_port=options["nixl_sidecar_port"], nixl_pool_bytes=int(options["nixl_pool_gb"] * 2**30),
        store=options["store"],
        mooncake=MooncakeOptions(
            master=options["mooncake_master"], metadata_server=options["mooncake_metadata_server"],
            protocol=options["mooncake_protocol"], device=options["mooncake_device"],
            local_hostname=options["mooncake_local_hostname"] or socket.gethostbyname(socket.gethostname()),
            global_segment_bytes=int(options["mooncake_global_segment_gib"] * 2**30),
            local_buffer_bytes=int(options["mooncake_local_buffer_gib"] * 2**30),
        ),
    )
