"""The `corecap` command line: run, get, ls, info.

Every user-caused error is a `CorecapError`, printed as one line `corecap: error: ...` with exit
status 2; nothing already in the store is touched by a failed command.
"""

from __future__ import annotations

import functools
import json
import sys

import click

from corecap import CorecapError, __version__


def _one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CorecapError as e:
            click.echo(f"corecap: error: {e}", err=True)
            sys.exit(2)

    return wrapper


@click.group()
@click.version_option(__version__, prog_name="corecap")
def main() -> None:
    """Capture an LLM's hidden states at chosen layers into an LMDB store (for EAGLE-3)."""


@main.command()
@click.option("--model", type=str, default=None, help="HF model directory (default: the built-in demo model).")
@click.option("--data", type=str, default=None, help="JSON Lines, JSON array or Parquet file of input_ids, text, messages or conversations (default: the built-in demo dataset).")
@click.option("--store", type=str, default="corecap.lmdb", show_default=True, help="Store directory.")
@click.option("--layers", type=str, default=None, help="Comma-separated HF hidden_states indices (default: 2,N//2,N-3,N).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True, help="Most sequences in flight.")
@click.option("--max-len", type=click.IntRange(min=1), default=2048, show_default=True, help="Max sequence length.")
@click.option("--max-batched-tokens", type=click.IntRange(min=1), default=None, help="Token budget per step (longer samples are chunked).")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto", show_default=True)
@click.option("--load-format", type=click.Choice(["auto", "dummy"]), default="auto", show_default=True)
@click.option("--enforce-eager", is_flag=True, help="Disable torch.compile and CUDA graphs.")
@click.option("--memory-utilization", type=click.FloatRange(0.01, 0.99), default=None, help="Share of device memory (RAM on CPU) for vLLM (default: 0.9 GPU, 0.2 CPU).")
@click.option("--codec", type=click.Choice(["zstd-planes", "raw"]), default=None, help="Lossless codec for stored states (default: zstd-planes).")
@click.option("--store-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True, help="fp8: lossy e4m3 with a per-row scale (half the bytes).")
@click.option("--nonfinite", type=click.Choice(["stop", "store"]), default="stop", show_default=True, help="NaN/Inf in captured states: stop the run, or store and flag the sample.")
@click.option("--overflow", type=click.Choice(["error", "truncate", "skip"]), default="error", show_default=True, help="Samples longer than --max-len: stop, cut, or leave out.")
@click.option("--invalid", type=click.Choice(["error", "skip"]), default=None, help="Invalid rows: stop, or skip and count (default: skip under --overflow skip).")
@click.option("--shard", type=str, default=None, help="K/N: capture only shard K of N (by a stable hash of the key).")
@click.option("--progress/--no-progress", default=None, help="A progress line (default: when stderr is a terminal).")
@click.option("--buffer-gb", type=click.FloatRange(min=0.0), default=4.0, show_default=True, help="Host memory for states awaiting their commit.")
@_one_line_errors
def run(model, data, store, layers, tp, batch, max_len, max_batched_tokens, dtype, load_format, enforce_eager, memory_utilization, codec, store_dtype, nonfinite, overflow, invalid, shard, progress, buffer_gb) -> None:
    """Capture hidden states for every sample of --data into --store."""
    from corecap.codec import DEFAULT_CODEC
    from corecap.config import RunConfig, parse_layers
    from corecap.data import parse_shard
    from corecap.run import run as run_capture
    from corecap.store import FP8

    if store_dtype == "fp8" and codec is not None:
        raise CorecapError("--store-dtype fp8 and --codec exclude each other (fp8 is its own encoding)")

    cfg = RunConfig(
        model=model,
        data=data,
        store=store,
        layers=parse_layers(layers) if layers is not None else None,
        tp=tp,
        batch=batch,
        max_len=max_len,
        max_batched_tokens=max_batched_tokens,
        dtype=dtype,
        load_format=load_format,
        enforce_eager=enforce_eager,
        memory_utilization=memory_utilization,
        codec=FP8 if store_dtype == "fp8" else codec or DEFAULT_CODEC,
        nonfinite=nonfinite,
        overflow=overflow,
        invalid=invalid,
        shard=parse_shard(shard) if shard else None,
        progress=progress,
        buffer_bytes=int(buffer_gb * 2**30),
    )
    summary = run_capture(cfg, log=lambda m: click.echo(m, err=True))
    click.echo(summary.line())


@main.command()
@click.argument("key")
@click.option("--store", type=str, default="corecap.lmdb", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write a .safetensors file.")
@_one_line_errors
def get(key, store, out) -> None:
    """Summarize one stored sample; with --out, export it as safetensors (input_ids, hidden_states,
    and loss_mask when the sample has one)."""
    from corecap.store import Store

    with Store.open(store) as s:
        sample = s.get(key)
        layers = list(s.meta.layers)
    hs = sample.hidden_states
    click.echo(
        f"{key}: {sample.header.num_tokens} tokens, layers {layers}, dtype {sample.header.dtype}, "
        f"hidden_states shape {list(hs.shape)}, codec {sample.header.codec}"
        + ("" if sample.loss_mask is None else f", loss mask on {int(sample.loss_mask.sum())} tokens")
    )
    if out:
        import torch
        from safetensors.torch import save_file

        tensors = {"input_ids": torch.from_numpy(sample.input_ids.astype("int64")), "hidden_states": hs.contiguous()}
        if sample.loss_mask is not None:
            tensors["loss_mask"] = torch.from_numpy(sample.loss_mask)
        save_file(tensors, out, metadata={"key": key, "layers": json.dumps(layers), "codec": sample.header.codec})
        click.echo(f"wrote {out}")


@main.command(name="ls")
@click.option("--store", type=str, default="corecap.lmdb", show_default=True)
@_one_line_errors
def ls(store) -> None:
    """List the keys in a store, one per line."""
    from corecap.store import Store

    with Store.open(store) as s:
        for key in s.keys():
            click.echo(key)


@main.command()
@click.option("--store", type=str, default="corecap.lmdb", show_default=True)
@_one_line_errors
def info(store) -> None:
    """Print a store's metadata (JSON) and its number of samples."""
    import msgspec

    from corecap.store import Store

    with Store.open(store) as s:
        meta = msgspec.to_builtins(s.meta)
        meta["num_samples"] = len(s)
    click.echo(json.dumps(meta, indent=2))


# Commands defined in their own modules.
from corecap.merge import merge  # noqa: E402
from corecap.trace import trace  # noqa: E402
from corecap.verify import verify  # noqa: E402

main.add_command(merge)
main.add_command(trace)
main.add_command(verify)

if __name__ == "__main__":
    main()
