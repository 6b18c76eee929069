"""The options of a capture, shared by `corecap run` and `trace --steps`: vLLM's engine
arguments as vLLM spells them, corecap's own, the sampling of `--max-tokens`, and the frozen
RunConfig they make."""

from __future__ import annotations

import functools
import json
import sys

import click

from corecap.errors import CorecapError

# --- the options of a capture, shared by `run` and `trace --steps` -------------------------------

_Min1 = click.IntRange(min=1)
# vLLM's engine arguments, spelled as vLLM spells them (short forms users already type after).
_ENGINE_OPTIONS = (
    click.option("--model", type=str, default=None,
                 help="HF model directory or a model id in the local HF cache (default: the built-in demo model)."),
    click.option("--tokenizer", type=str, default=None, help="Tokenizer directory (default: the model's)."),
    click.option("--tensor-parallel-size", "-tp", "--tp", type=_Min1, default=1, show_default=True),
    click.option("--pipeline-parallel-size", "-pp", "--pp", type=_Min1, default=1, show_default=True),
    click.option("--data-parallel-size", "-dp", "--dp", type=_Min1, default=1, show_default=True,
                 help="Engine replicas feeding one store, each with its own TP x PP ranks."),
    click.option("--max-num-seqs", "--batch", type=_Min1, default=None,
                 help="Most sequences in flight (default: vLLM's for offline work on this device)."),
    click.option("--max-num-batched-tokens", "--max-batched-tokens", type=_Min1, default=None,
                 help="Token budget per engine step; longer samples are chunked (default: vLLM's for offline work)."),
    click.option("--max-model-len", "--max-len", type=_Min1, default=None,
                 help="The longest sample, in tokens (default: the model's limit)."),
    click.option("--gpu-memory-utilization", "--memory-utilization", type=click.FloatRange(0.01, 0.99), default=None,
                 help="Share of device memory for vLLM (RAM on a CPU; default 0.9 GPU, 0.2 CPU)."),
    click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
                 show_default=True),
    click.option("--quantization", "-q", type=str, default=None, help="vLLM's quantization method (e.g. fp8)."),
    click.option("--kv-cache-dtype", type=str, default="auto", show_default=True),
    click.option("--trust-remote-code", is_flag=True),
    click.option("--load-format", type=str, default="auto", show_default=True, help="auto, safetensors, dummy, ..."),
    click.option("--enforce-eager", is_flag=True, help="Disable torch.compile and CUDA graphs."),
    click.option("--model-impl", type=click.Choice(["auto", "vllm", "transformers"]), default="auto",
                 show_default=True),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
                 help="vLLM's prefix caching, kept exact by corecap (default: on, off for models with sliding-window "
                      "or hybrid attention)."),
    click.option("--async-scheduling/--no-async-scheduling", default=None,
                 help="vLLM's async scheduling: the next step is scheduled while this one runs, its sampled tokens "
                      "filled in on the device (default: vLLM's, on with a GPU; off with pipeline parallelism or "
                      "across nodes)."),
)
_LAYERS_OPTION = click.option(
    "--layers", type=str, default=None,
    help="Comma-separated HF hidden_states indices and 'prenorm' (default: 2,N//2,N-3,N,prenorm).")
_CAPTURE_OPTIONS = (
    click.option("--data", type=str, default=None,
                 help="JSON Lines, JSON array or Parquet file of input_ids, text, messages or conversations "
                      "(default: the built-in demo dataset)."),
    _LAYERS_OPTION,
    click.option("--codec", type=click.Choice(["zstd-planes", "raw"]), default=None,
                 help="Lossless codec for stored states (default: zstd-planes)."),
    click.option("--store-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
                 help="fp8: lossy e4m3 with a per-row scale (half the bytes)."),
    click.option("--nonfinite", type=click.Choice(["stop", "store"]), default="stop", show_default=True,
                 help="NaN/Inf in captured states: stop the run, or store and flag the sample."),
    click.option("--overflow", type=click.Choice(["error", "truncate", "skip"]), default="error", show_default=True,
                 help="Samples longer than --max-len: stop, cut, or leave out."),
    click.option("--invalid", type=click.Choice(["error", "skip"]), default=None,
                 help="Invalid rows: stop, or skip and count (default: skip under --overflow skip)."),
    click.option("--shard", type=str, default=None,
                 help="K/N: capture only shard K of N (by a stable hash of the key)."),
    click.option("--image-dir", type=str, default=None,
                 help="Where the conversations' images may be read from (default: the data file's directory)."),
    click.option("--progress/--no-progress", default=None,
                 help="A progress line (default: when stderr is a terminal)."),
    click.option("--buffer-gb", type=click.FloatRange(min=0.0), default=None,
                 help="The sink's host memory for states: samples from their first chunk to their commit, "
                      "responses being written included (default: 4; with --max-tokens, 40% of the memory "
                      "available at start, at least 4)."),
    click.option("--prefix-blocks", type=click.IntRange(min=1), default=None,
                 help="With --enable-prefix-caching: the most cached blocks an engine's hits may name "
                      "(default: as many as its KV cache holds); beyond, the least recently used leave vLLM's "
                      "prefix cache."),
    click.option("--private-network/--no-private-network", default=True, show_default=True,
                 help="Run vLLM's workers in a network namespace with only loopback (where the machine allows it)."),
)
# `--max-tokens`: the model writes the responses (corecap/generation.py), sampled as vLLM samples.
_GENERATION_OPTIONS = (
    click.option("--max-tokens", type=click.IntRange(min=0), default=0, show_default=True,
                 help="The model writes up to N tokens after each sample (a chat row: the answer to its turns "
                      "before the last assistant turn), captured in the same run; 0: capture the given tokens only."),
    click.option("--temperature", type=float, default=None,
                 help="Sampling temperature (default: the model's generation_config.json, else 1.0; 0: greedy)."),
    click.option("--top-p", type=float, default=None, help="Nucleus sampling (default: the model's, else 1.0)."),
    click.option("--top-k", type=int, default=None, help="Top-k sampling (default: the model's, else off)."),
    click.option("--min-p", type=float, default=None, help="Min-p sampling (default: the model's, else off)."),
    click.option("--repetition-penalty", type=float, default=None, help="(default: the model's, else 1.0)"),
    click.option("--presence-penalty", type=float, default=None, help="(default: the model's, else 0)"),
    click.option("--frequency-penalty", type=float, default=None, help="(default: the model's, else 0)"),
    click.option("--stop", type=str, multiple=True,
                 help="A string that ends a response (repeat for several); the tokens up to it are stored."),
    click.option("--ignore-eos", is_flag=True, help="Do not end a response at the end-of-sequence token."),
    click.option("--rewrite-turns", type=click.Choice(["last", "all"]), default="last", show_default=True,
                 help="Chat rows: answer the last turn (one sample a row), or rewrite every assistant turn in order, "
                      "each given the rewritten ones before it (one sample a turn, KEY/turn-K)."),
    click.option("--chat-template-kwargs", type=str, default=None,
                 help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\'.'),
)
_SAMPLING_NAMES = {
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "stop", "ignore_eos", "rewrite_turns",
}
_ENGINE_NAMES = {
    "model", "tokenizer", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "dtype", "quantization", "kv_cache_dtype",
    "trust_remote_code", "load_format", "enforce_eager", "model_impl", "seed", "enable_prefix_caching",
    "async_scheduling",
}
_PASS_THROUGH = dict(ignore_unknown_options=True, allow_extra_args=True)


def _with(options):
    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def _run_config(store: str | None, extra_args: list[str], options: dict):
    """The frozen RunConfig of `corecap run`'s (or `trace --steps`') options."""
    from corecap.config import DEFAULT_CODEC, EngineOptions, RunConfig, SamplingOptions, parse_layers
    from corecap.data import parse_shard
    from corecap.store import FP8

    engine = EngineOptions(**{k: v for k, v in options.items() if k in _ENGINE_NAMES}, extra_args=tuple(extra_args))
    sampling = SamplingOptions(**{k: tuple(v) if k == "stop" else v for k, v in options.items()
                                  if k in _SAMPLING_NAMES})
    rest = {k: v for k, v in options.items() if k not in _ENGINE_NAMES | _SAMPLING_NAMES}
    if rest["store_dtype"] == "fp8" and rest["codec"] is not None:
        raise CorecapError("--store-dtype fp8 and --codec exclude each other (fp8 is its own encoding)")
    return RunConfig(
        data=rest["data"],
        store=store,
        layers=parse_layers(rest["layers"]) if rest["layers"] is not None else None,
        engine=engine,
        codec=FP8 if rest["store_dtype"] == "fp8" else rest["codec"] or DEFAULT_CODEC,
        nonfinite=rest["nonfinite"],
        overflow=rest["overflow"],
        invalid=rest["invalid"],
        shard=parse_shard(rest["shard"]) if rest["shard"] else None,
        progress=rest["progress"],
        buffer_bytes=None if rest["buffer_gb"] is None else int(rest["buffer_gb"] * 2**30),
        prefix_blocks=rest["prefix_blocks"],
        private_network=rest["private_network"],
        sampling=sampling,
        chat_template_kwargs=_template_kwargs(rest["chat_template_kwargs"]),
        image_dir=rest["image_dir"],
    )


def _template_kwargs(text: str | None) -> tuple:
    if text is None:
        return ()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorecapError(f"--chat-template-kwargs {text!r}: not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise CorecapError(f"--chat-template-kwargs {text!r}: "
                           "expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    return tuple(value.items())


def print_version(ctx: click.Context, _param, value: bool) -> None:
    """`corecap --version`: corecap's, and the vLLM and torch it runs on (corecap/_vllm/versions.py)."""
    if not value or ctx.resilient_parsing:
        return
    from corecap import __version__
    from corecap._vllm.versions import version_lines

    click.echo("\n".join(version_lines(__version__)))
    ctx.exit()


def _one_line_errors(fn):
    """A command whose CorecapError is printed as one line, `corecap: error: ...`, exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CorecapError as e:
            click.echo(f"corecap: error: {e}", err=True)
            sys.exit(2)

    return wrapper
