"""What `corecap serve` knows before its engine starts (`ServePlan`), and `prepare`, which finds
it out: the model's identity, the layers and where each goes in a trainer's file, vLLM's
configuration (no weights), the tokenizer, the sink's memory and its share for the blocks of
vLLM's prefix cache. Everything here fails before any weight loads."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from corecap import demo
from corecap.checkpoint import check_checkpoint
from corecap.config import PRENORM, resolve_layers
from corecap.errors import CorecapError
from corecap.generation import buffer_bytes
from corecap.model import load_tokenizer, model_identity, resolve_model_dir
from corecap.serve.config import ServeConfig


@dataclass(frozen=True, kw_only=True)
class ServePlan:
    cfg: ServeConfig
    model_dir: str
    model_name: str  # what /v1/models lists
    layers: tuple  # captured, in the order the workers send them
    aux_layers: tuple[int, ...]  # the file's layers before the pre-norm state
    positions: tuple[int, ...]  # the stored layer index of each of the file's layers
    # SpecForge's layout (/generate): the stored positions of its aux layers and of N, the state
    # after the final norm (None: N not captured); the aux layers' ids as SGLang counts them
    spec_positions: tuple[tuple[int, ...], int] | None
    spec_layer_ids: tuple[int, ...]
    vllm_config: object
    devices: list
    tokenizer: object  # None: the model has none (token-id prompts only)
    eos_token_ids: frozenset  # what ends a response (vLLM's frontend's: the tokenizer's, the generation config's)
    max_len: int  # the longest prompt
    vocab_size: int
    buffer_bytes: int  # the sink's memory bound: the samples' buffers and the cached blocks' copies
    settings_line: str  # the engine's settings, as `corecap run` logs them
    # vLLM's prefix caching (0: off): its block size, the bytes of one block's states in the sink
    # (every captured layer), and the most blocks each engine keeps cached (`prefix_blocks`)
    block_size: int = 0
    block_bytes: int = 0
    prefix_blocks: int = 0


# With prefix caching on and no --prefix-blocks: the share of the sink's memory (--buffer-gb) for
# the states of the blocks vLLM may keep cached (the sink keeps a copy of each: a delivered
# sample's buffer is reused); the samples in flight get the rest.
PREFIX_MEMORY_SHARE = 0.25


def prepare(cfg: ServeConfig, log) -> ServePlan:
    from corecap._vllm import checked_vllm_config, check_pipeline, effective_settings, max_prompt_len, placement
    from corecap._vllm import prefix_tracker, sampling, vllm_version

    run = cfg.run
    engine = run.engine
    model_dir = resolve_model_dir(run.model) if run.model else demo.demo_model_dir()
    identity = model_identity(model_dir, engine.load_format)
    check_checkpoint(model_dir, engine.load_format)
    layers = resolve_layers(run.layers, identity.num_layers)
    aux, positions = file_layers(layers, identity.num_layers)
    spec_positions, spec_ids = specforge_layers(layers, aux, identity.num_layers)
    _check_directory(cfg.hidden_states_path)
    vllm_config = checked_vllm_config(engine, model_dir, log, layers)
    check_pipeline(vllm_config, vllm_version())
    devices = placement(vllm_config, engine.data_parallel_size)
    tokenizer = load_tokenizer(model_dir)
    if vllm_config.parallel_config.nnodes > 1:
        raise CorecapError("--nnodes: `corecap serve` runs on one node (use -tp, -pp and -dp within it)")
    # a server may be asked for responses at any time: its default is `corecap run --max-tokens`'s,
    # so that as many requests generate at once as the engine runs
    memory = buffer_bytes(run.buffer_bytes, True, psutil.virtual_memory().available)
    block_size = prefix_tracker.block_size(vllm_config)
    block_bytes = prefix_blocks = 0
    if block_size:
        model_config = vllm_config.model_config
        block_bytes = len(layers) * block_size * model_config.get_hidden_size() * model_config.dtype.itemsize
        prefix_blocks = _prefix_blocks(run.prefix_blocks, memory, block_bytes, len(devices))
    elif run.prefix_blocks is not None:
        raise CorecapError("--prefix-blocks: prefix caching is off (see the engine's line)")
    return ServePlan(
        cfg=cfg, model_dir=model_dir,
        model_name=cfg.served_model_name or run.model or os.path.basename(model_dir),
        layers=layers, aux_layers=aux, positions=positions, spec_positions=spec_positions, spec_layer_ids=spec_ids,
        vllm_config=vllm_config, devices=devices,
        tokenizer=tokenizer, eos_token_ids=sampling.eos_token_ids(vllm_config, tokenizer),
        max_len=max_prompt_len(vllm_config), vocab_size=identity.vocab_size,
        buffer_bytes=memory,
        settings_line=effective_settings(vllm_config) + (f", {len(devices)} replicas" if len(devices) > 1 else ""),
        block_size=block_size, block_bytes=block_bytes, prefix_blocks=prefix_blocks,
    )


def _prefix_blocks(given: int | None, memory: int, block_bytes: int, num_engines: int) -> int:
    """The most blocks each engine keeps in vLLM's prefix cache (prefix_tracker.py's bound, lowered
    to the KV cache's size once the engine has one): the sink holds a copy of every such block's
    states, of all the engines, in its memory (--buffer-gb). --prefix-blocks, or what
    PREFIX_MEMORY_SHARE of that memory holds."""
    if given is None:
        return max(1, int(PREFIX_MEMORY_SHARE * memory) // (block_bytes * num_engines))
    if given * block_bytes * num_engines >= memory:
        engines = f" in each of {num_engines} engines" if num_engines > 1 else ""
        raise CorecapError(
            f"--prefix-blocks {given}: the states of that many cached blocks{engines} "
            f"({given * block_bytes * num_engines / 2**30:.3g} GiB, {block_bytes} bytes a block) leave nothing of "
            f"--buffer-gb {memory / 2**30:g} for the requests in flight: raise --buffer-gb or lower --prefix-blocks")
    return given


def file_layers(layers: tuple, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """speculators' file: the aux layers (every captured index below N, ascending), then the
    pre-norm final state; N itself (after the final norm) is not one of its layers. Returns the
    aux layers and the stored position of each of the file's layers."""
    if PRENORM not in layers:
        raise CorecapError(f"--layers {','.join(map(str, layers))}: the trainer's file ends with '{PRENORM}' (the "
                           "last decoder layer's output before the final norm, which speculators applies itself): "
                           f"add it, e.g. --layers 2,{num_layers // 2},{num_layers - 3},{PRENORM}")
    aux = tuple(sorted(k for k in layers if k != PRENORM and k < num_layers))
    if not aux:
        raise CorecapError(f"--layers {','.join(map(str, layers))}: no aux layer below {num_layers} besides "
                           f"'{PRENORM}', e.g. --layers 2,{num_layers // 2},{num_layers - 3},{PRENORM}")
    return aux, tuple(layers.index(k) for k in (*aux, PRENORM))


def specforge_layers(layers: tuple, aux: tuple[int, ...], num_layers: int):
    """SpecForge's tensors: the same aux layers, named one lower (SGLang counts a decoder layer's
    output from 0: HF's hidden_states[k] is its layer k - 1), and N, the state after the final
    norm (its `target`). ((aux positions, N's position), their ids), or (None, ()) without N or
    with layer 0 among the aux ones (no SGLang id names the embeddings)."""
    if num_layers not in layers or 0 in aux:
        return None, ()
    return (tuple(layers.index(k) for k in aux), layers.index(num_layers)), tuple(k - 1 for k in aux)


def _check_directory(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CorecapError(f"--hidden-states-path {path}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CorecapError(f"--hidden-states-path {path}: not writable")
