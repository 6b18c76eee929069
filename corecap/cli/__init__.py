"""The `corecap` command line: every command (the only package that knows click; the options of a
capture and the RunConfig they make are in corecap/cli/options.py).

Each command builds what it needs (a frozen RunConfig for `run`) and calls a library function.
Every user-caused error is a `CorecapError`, printed as one line `corecap: error: ...` with exit
status 2; nothing already in a store is touched by a failed command.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import click

from corecap import writer_lock
from corecap.cli.options import (
    _CAPTURE_OPTIONS, _ENGINE_OPTIONS, _GENERATION_OPTIONS, _PASS_THROUGH, _Min1, _one_line_errors, _run_config,
    _with, print_version,
)
from corecap.cli.export import export
from corecap.cli.serve import serve
from corecap.errors import CorecapError


def _log(message: str) -> None:
    click.echo(message, err=True)


@click.group()
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=print_version,
              help="Show corecap's version and the vLLM and torch it runs on, and exit.")
def main() -> None:
    """Capture an LLM's hidden states at chosen layers into a store (for EAGLE-3 draft heads)."""


def capture(cfg, log, terminal=None):
    """`corecap.api.capture` with SIGTERM and the first Ctrl-C turned into a request to stop: the
    run then commits every complete sample and exits non-zero saying how many it kept (a
    second Ctrl-C interrupts at once). A test may wrap this function."""
    from corecap.api import capture as api_capture
    from corecap.run import Stop

    stop = Stop()

    def on_signal(signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        stop.request("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return api_capture(cfg, log=log, stop=stop, terminal=terminal)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# --- commands ------------------------------------------------------------------------------------


@main.command(context_settings=_PASS_THROUGH)
@click.option("--store", type=str, default="corecap.lmdb", show_default=True, help="Store directory.")
@click.option("--verbose", "-v", is_flag=True,
              help="Show vLLM's own log on the terminal too (it is in STORE/corecap.log, or where the error says).")
@_with(_ENGINE_OPTIONS)
@_with(_CAPTURE_OPTIONS)
@_with(_GENERATION_OPTIONS)
@click.pass_context
@_one_line_errors
def run(ctx, store, verbose, **options) -> None:
    """Capture hidden states for every sample of --data into --store.

    Any other vLLM engine argument may follow, spelled as vLLM spells it (e.g. --block-size 32).
    The terminal shows corecap's lines and a progress line; everything else the engine prints
    goes to STORE/corecap.log."""
    import traceback

    from corecap.console import RunLog

    runlog = RunLog(store, verbose)  # before the lock makes the directory: whether it was there
    error, internal, status = None, False, 2
    # The writer lock first: a second run on this store is refused in its first second (nothing
    # heavy imported yet), before it writes to the first one's log, reads the data or imports vLLM.
    with writer_lock.held(store):
        cfg = _run_config(store, ctx.args, options)
        with runlog:
            try:
                summary = capture(cfg, log=runlog.say, terminal=runlog.terminal_err)
            except CorecapError as e:
                runlog.record(f"corecap: error: {e}\n")
                error = str(e)
                status = getattr(e, "exit_status", 2)  # run.Interrupted: the signal's
            except Exception as e:  # a bug: one line here, the traceback in the log
                runlog.record(traceback.format_exc())
                error, internal = f"internal error: {type(e).__name__}: {e}", True
            else:
                runlog.say(summary.line(), err=False)
    if error is not None:  # known once the log is closed: where it is
        click.echo(f"corecap: error: {runlog.final_error(error, internal)}", err=True)
        sys.exit(status)



@main.command()
@click.option("--master-addr", required=True, help="Node 0's address, as its `corecap run --master-addr` gives it.")
@click.option("--master-port", type=click.IntRange(1, 65533), default=29501, show_default=True,
              help="As node 0's --master-port; corecap's own channel is the port after it.")
@click.option("--node-rank", type=_Min1, required=True, help="This node's rank, 1 to --nnodes minus 1.")
@click.option("--model", type=str, default=None,
              help="This node's copy of the model (default: node 0's path); must be the same model.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds to wait for node 0.")
@_one_line_errors
def worker(master_addr, master_port, node_rank, model, timeout) -> None:
    """Run this node's share of an engine that spans nodes (node 0 runs `corecap run --nnodes N
    --master-addr ADDR ...` and holds the store): the engine options come from node 0; the
    versions and the model are checked against node 0's before any weights load
    (docs/multinode.md)."""
    from corecap._vllm.nodes import follow

    follow(master_addr, master_port, node_rank, model, timeout, log=_log)


def _response(generation) -> str:
    """A generated sample's response, as `get` and `ls --long` show it."""
    stop = f" {generation.stop!r}" if generation.stop is not None else ""
    tokens = "token" if generation.num_generated == 1 else "tokens"
    return f"response of {generation.num_generated} {tokens} (finished by {generation.finish_reason}{stop})"


@main.command()
@click.argument("key")
@click.option("--store", type=str, default="corecap.lmdb", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write a .safetensors file.")
@_one_line_errors
def get(key, store, out) -> None:
    """Summarize one stored sample (for a generated one, its response's length and finish reason;
    for one with images, each image's token span and reference);
    with --out, export it as safetensors (input_ids, hidden_states, and loss_mask when the sample
    has one; a generated sample's record, JSON, in the metadata's "generation")."""
    import msgspec

    from corecap.store import Store

    with Store.open(store) as s:
        sample = s.get(key)
        layers = list(s.meta.layers)
    hs = sample.hidden_states
    generation = sample.header.generation
    click.echo(
        f"{key}: {sample.header.num_tokens} tokens, layers {layers}, dtype {sample.header.dtype}, "
        f"hidden_states shape {list(hs.shape)}, codec {sample.header.codec}"
        + ("" if sample.loss_mask is None else f", loss mask on {int(sample.loss_mask.sum())} tokens")
        + ("" if generation is None else f", prompt of {generation.num_prompt} tokens, {_response(generation)}")
        + ("" if sample.header.media is None else f", {sample.header.media.summary()}")
    )
    if out:
        import torch
        from safetensors.torch import save_file

        tensors = {"input_ids": torch.from_numpy(sample.input_ids.astype("int64")), "hidden_states": hs.contiguous()}
        if sample.loss_mask is not None:
            tensors["loss_mask"] = torch.from_numpy(sample.loss_mask)
        metadata = {"key": key, "layers": json.dumps(layers), "codec": sample.header.codec}
        if generation is not None:
            metadata["generation"] = json.dumps(msgspec.structs.asdict(generation))
        if sample.header.media is not None:
            metadata["media"] = json.dumps(sample.header.media.record())
        save_file(tensors, out, metadata=metadata)
        click.echo(f"wrote {out}")


@main.command(name="ls")
@click.option("--store", type=str, default="corecap.lmdb", show_default=True)
@click.option("--long", "-l", "long", is_flag=True,
              help="Per key, tab-separated: its tokens and, for a generated sample, its prompt's and response's "
              "lengths and finish reason.")
@_one_line_errors
def ls(store, long) -> None:
    """List the keys in a store, one per line."""
    from corecap.store import Store
    from corecap.store.verify import headers

    with Store.open(store) as s:
        if not long:
            for key in s.keys():
                click.echo(key)
            return
        for key, header in headers(s, utf8_keys=True):
            generation = header.generation
            click.echo(f"{key}\t{header.num_tokens} tokens"
                       + ("" if generation is None
                          else f"\tprompt of {generation.num_prompt} tokens, {_response(generation)}")
                       + ("" if header.media is None else f"\t{header.media.summary()}"))


@main.command()
@click.option("--store", type=str, default="corecap.lmdb", show_default=True)
@_one_line_errors
def info(store) -> None:
    """Print a store's metadata (JSON), its number of samples and tokens, how many of those it
    stores (the rest, samples refer to others for: stored once), the samples whose response the
    model wrote (their tokens and finish reasons) and its state files' bytes."""
    import msgspec

    from corecap.store import Store
    from corecap.store.verify import contents

    with Store.open(store) as s:
        meta = msgspec.to_builtins(s.meta)
        meta["num_samples"] = len(s)
        meta.update(contents(s))
    click.echo(json.dumps(meta, indent=2))


@main.command()
@click.option("--store", type=str, default="corecap.lmdb", show_default=True, help="Store directory.")
@click.option("--threads", type=_Min1, default=None,
              help="Threads that decode and check samples (default: the cores, at most 8).")
@_one_line_errors
def verify(store, threads) -> None:
    """Check every stored sample (complete, consistent, checksums, finite, no zero layers).
    Exit 0: all good; 1: problems (listed); 2: not a store."""
    from corecap.store.verify import verify_store

    report = verify_store(store, on_problem=lambda key, problems: click.echo(f"{key}: {'; '.join(problems)}"),
                          num_threads=threads)
    for problem in report.store_problems:
        click.echo(f"{report.store}: {problem}")
    click.echo(report.line())
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("out", type=str)
@click.argument("inputs", nargs=-1, required=True, type=str)
@_one_line_errors
def merge(out, inputs) -> None:
    """Merge the stores INPUTS into OUT (created if missing): e.g. the shards of one run."""
    from corecap.store.merge import merge_stores

    click.echo(merge_stores(out, inputs).line())


@main.command()
@click.option("--model", type=str, default=None,
              help="Model directory whose class to check too (default: a config-only Llama; no weights read).")
@click.option("--deep", is_flag=True,
              help="Import vLLM too (7-25 s) and make the checks that need it: the aux-state semantics, "
              "the engine configuration vLLM builds, the model class its resolver picks "
              "(every `corecap run` makes them).")
@_one_line_errors
def doctor(model, deep) -> None:
    """Check the installed vLLM against what corecap relies on in its internals, in about a second,
    by reading vLLM's source without importing it; no GPU, no weights (`corecap run` does the same
    first). Exit 0: all good; 1: something moved (named, with the vLLM versions known to work)."""
    started = time.perf_counter()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report (--deep imports vLLM)
    from corecap._vllm.doctor import doctor as check

    report = check(model, deep, started)
    for line in report.lines():
        click.echo(line)
    sys.exit(1 if report.num_moved else 0)


@main.command(context_settings=_PASS_THROUGH)
@click.option("--store", type=str, default=None, help="Store whose trace.json to read (default: corecap.lmdb).")
@click.option("--chrome", type=click.Path(dir_okay=False), default=None, help="Write Chrome trace events (Perfetto).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="Write a timeline PNG.")
@click.option("--steps", type=_Min1, default=None,
              help="Instead of reading --store, capture about N engine steps into a temporary store and profile them "
              "(the options below are corecap run's, for this).")
@_with(_ENGINE_OPTIONS)
@_with(_CAPTURE_OPTIONS)
@_with(_GENERATION_OPTIONS)
@click.pass_context
@_one_line_errors
def trace(ctx, store, chrome, plot_path, steps, **options) -> None:
    """Where a run's time went: phase table, tokens/s, bottleneck; optionally a Chrome trace and a PNG."""
    from corecap.trace.analysis import summarize
    from corecap.trace.timeline import load_trace
    from corecap.trace.views import check_plot

    given = [p for p in ctx.command.params
             if p.name in options and ctx.get_parameter_source(p.name) != click.core.ParameterSource.DEFAULT]
    check_plot(plot_path)  # before the table, or a profiling run
    if steps is None:
        if given or ctx.args:
            first = "/".join(o for o in given[0].opts if o.startswith("--")) if given else ctx.args[0]
            raise CorecapError(f"{first} applies only with --steps (profile a short run)")
        store = store or "corecap.lmdb"
        record, title = load_trace(store), store
    else:
        if store is not None:
            raise CorecapError("--store and --steps exclude each other: --steps captures into a temporary store")
        from corecap.probe import profile_run

        record, title = profile_run(steps, _run_config("", ctx.args, options), log=_log), f"--steps {steps}"
    click.echo(summarize(record))
    if chrome:
        from corecap.trace.views import to_chrome

        try:
            with open(chrome, "w") as f:
                json.dump(to_chrome(record), f, separators=(",", ":"))
        except OSError as e:
            raise CorecapError(f"--chrome {chrome}: cannot write ({e.strerror})") from None
        click.echo(f"wrote {chrome} (open it in ui.perfetto.dev or chrome://tracing)")
    if plot_path:
        from corecap.trace.views import plot

        plot(record, plot_path, title=title)
        click.echo(f"wrote {plot_path}")


main.add_command(export)
main.add_command(serve)
