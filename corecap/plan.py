"""What a run knows before its engine starts (`Plan`), and `prepare`, which finds it out: the
model's identity, the layers, vLLM's configuration (no weights), the sampling settings, the whole
dataset checked against the store, the sink's memory bound. Everything here can fail before any
weight loads (corecap/run.py then starts the engine and steps it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from corecap import __version__, data, demo
from corecap.checkpoint import check_checkpoint
from corecap.config import RunConfig, resolve_layers
from corecap.errors import CorecapError
from corecap.generation import Conversations, StopRule, buffer_bytes
from corecap.model import load_tokenizer, model_identity, resolve_model_dir
from corecap.data.media import Images
from corecap.data.todo import TodoSamples
from corecap.resume import ResumeCheck, committed_fingerprints
from corecap.sink import stream
from corecap.sink.buffers import size_class
from corecap.store import FORMAT_VERSION, FP8, LAYER_MEANING, Store, StoreMeta


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a run knows before its engine starts."""

    cfg: RunConfig
    model_dir: str
    data_path: str
    read: dict  # data.read_samples' options
    samples: TodoSamples  # the samples still to capture, read and tokenized once, by `prepare`
    committed: dict  # key → input fingerprint, already in the store
    dataset: data.DatasetSummary
    todo: int
    vllm_config: object
    layers: tuple
    identity: object  # store.ModelIdentity
    devices: list  # per replica: the environment its workers start with (_vllm.placement)
    sampling: dict | None = None  # --max-tokens: the sampling settings in effect (vLLM's names)
    stop_rule: StopRule | None = None  # --max-tokens: when a response ends
    total: int = 0  # the input's samples (a rewritten conversation: one a turn)
    buffer_bytes: int = 0  # the sink's memory bound (generation.buffer_bytes)
    # Image rows: vLLM's input processor the validation pass expanded them with, made on
    # `vllm_config`; the engine made on that configuration takes its requests through it too.
    media: object = None


def prepare(cfg: RunConfig, log) -> Plan:
    """Everything that can fail before the engine starts: the model's identity, the layers, the
    engine configuration (no weights), the whole dataset, the store's metadata."""
    from corecap._vllm import (Engine, checked_vllm_config, check_pipeline, effective_settings, max_prompt_len, nodes,
                               placement, prefix_tracker, vllm_version)

    model_dir = resolve_model_dir(cfg.model) if cfg.model else demo.demo_model_dir()
    data_path = cfg.data or demo.demo_data_path()
    identity = model_identity(model_dir, cfg.engine.load_format)
    images = Images.for_model(identity.architecture, cfg.image_dir or os.path.dirname(os.path.abspath(data_path)))
    # Every bad row of the input at once, before vLLM's import; their lengths once --max-len is known.
    checked = data.check_rows(data_path, vocab_size=identity.vocab_size, overflow=cfg.overflow, invalid=cfg.invalid,
                              shard=cfg.shard, max_tokens=cfg.sampling.max_tokens,
                              all_turns=cfg.sampling.generate and cfg.sampling.rewrite_turns == "all", images=images)
    with_images = checked.num_images > 0
    check_checkpoint(model_dir, cfg.engine.load_format)  # whole, before vLLM is asked anything
    layers = resolve_layers(cfg.layers, identity.num_layers)
    # vLLM's contract (its source first), the preflight
    vllm_config = checked_vllm_config(cfg.engine, model_dir, log, layers, images=with_images)
    version = vllm_version()  # vLLM is imported by now, not before its source was checked
    check_pipeline(vllm_config, version)
    devices = placement(vllm_config, cfg.engine.data_parallel_size)
    nodes.cluster(vllm_config)  # node 0 only
    tokenizer = load_tokenizer(model_dir)
    settings, stop_rule, generation_line = _generation(cfg, vllm_config, tokenizer)
    sink_bytes = buffer_bytes(cfg.buffer_bytes, cfg.sampling.generate, psutil.virtual_memory().available)
    if cfg.sampling.generate:  # it bounds the responses in flight, and so the decode batch
        generation_line += f", sink buffers {sink_bytes / 2**20:,.0f} MiB (--buffer-gb)"
    log(effective_settings(vllm_config) + (f", {len(devices)} replicas" if len(devices) > 1 else "") + generation_line)
    max_len = max_prompt_len(vllm_config)
    media = media_inputs(vllm_config) if with_images else None
    read = dict(
        tokenizer=tokenizer, vocab_size=identity.vocab_size, max_len=max_len,
        overflow=cfg.overflow, invalid=cfg.invalid, shard=cfg.shard,
        max_tokens=cfg.sampling.max_tokens, template_kwargs=dict(cfg.chat_template_kwargs),
        all_turns=cfg.sampling.generate and cfg.sampling.rewrite_turns == "all",
        images=images, expand=media.expand if media is not None else None,
    )
    # Keys already committed, read before validating so that the same pass checks their inputs;
    # the store itself is created (and its metadata checked) only once the input is known good.
    committed = committed_fingerprints(cfg.store)
    resume = ResumeCheck(committed)
    samples = TodoSamples()  # the pass that validates also keeps what the step loop will take

    def keep(sample) -> None:
        resume(sample)
        if sample.points or sample.key not in committed:  # a rewritten conversation: its turns are checked later
            samples.add(sample)

    try:
        dataset = data.validate(data_path, **read, on_sample=keep)
    except BaseException:
        samples.close()
        raise
    for message in dataset.skip_examples:
        log(f"skipped: {message}")
    check_long_samples(cfg, resume.longest, max_len, _token_bytes(cfg, identity, vllm_config, layers),
                       sink_bytes, prefix_tracker.block_size(vllm_config))
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=layers, layer_meaning=LAYER_MEANING,
        dtype=Engine.dtype_of(vllm_config), hidden_size=identity.hidden_size,
        corecap_version=__version__, vllm_version=version, codec=cfg.codec,
    )
    Store.create_or_open(cfg.store, meta).close()
    log(
        f"{data_path}: {dataset.outcomes()}; {dataset.num_tokens} tokens; "
        f"{resume.total - resume.todo} already in {cfg.store}; layers {list(layers)}"
    )
    return Plan(
        cfg=cfg, model_dir=model_dir, data_path=data_path, read=read, samples=samples, committed=committed,
        dataset=dataset,
        todo=resume.todo, vllm_config=vllm_config, layers=layers, identity=identity, devices=devices,
        sampling=settings, stop_rule=stop_rule, total=resume.total, buffer_bytes=sink_bytes, media=media,
    )


def media_inputs(vllm_config):
    """vLLM's input processor for requests with images (corecap/_vllm/media.py): made once, as
    making it loads the model's processor and tokenizer (seconds)."""
    from corecap._vllm.media import MediaInputs

    return MediaInputs(vllm_config)


def _generation(cfg: RunConfig, vllm_config, tokenizer) -> tuple[dict | None, StopRule | None, str]:
    """With --max-tokens: the sampling settings in effect (checked by vLLM), when a response
    ends, and the run's first line's part that says both."""
    from corecap._vllm import sampling

    options = cfg.sampling
    if not options.generate:
        return None, None, ""
    settings, source = sampling.effective_sampling(options, vllm_config)
    sampling.check_sampling(settings, options)
    eos = frozenset() if options.ignore_eos else sampling.eos_token_ids(vllm_config, tokenizer)
    if options.stop and tokenizer is None:
        raise CorecapError("--stop needs the model's tokenizer to read the responses, and the model directory has none")
    decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    return settings, StopRule(eos, options.stop, decode), "; " + sampling.describe(options, settings, source, eos)


def conversations(plan: Plan) -> Conversations:
    """--rewrite-turns all: where each conversation's later answers come from."""
    from corecap.data.chat import ChatRenderer

    tokenizer, cfg = plan.read["tokenizer"], plan.cfg
    renderer = (ChatRenderer(tokenizer, plan.data_path, "messages", plan.read["template_kwargs"])
                if plan.read["all_turns"] else None)

    def stored_answer(key: str) -> str:
        with Store.open(cfg.store) as store:
            sample = store.get(key)
        return tokenizer.decode(sample.input_ids[sample.header.generation.num_prompt :].tolist(),
                                skip_special_tokens=True)

    return Conversations(
        renderer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), cfg.sampling.max_tokens,
        plan.read["max_len"], cfg.overflow, plan.committed, stored_answer, plan.read["expand"],
    )


def token_bytes(plan: Plan) -> int:
    """A token's bytes in the sink's buffers: a row of each layer (fp8: its codes and scale)."""
    return _token_bytes(plan.cfg, plan.identity, plan.vllm_config, plan.layers)


def _token_bytes(cfg: RunConfig, identity, vllm_config, layers) -> int:
    from corecap._vllm import Engine
    from corecap.dtypes import DTYPES
    from corecap.store.fp8rows import ROW_EXTRA

    hidden = identity.hidden_size
    row = hidden + ROW_EXTRA if cfg.codec == FP8 else hidden * DTYPES[Engine.dtype_of(vllm_config)].itemsize
    return len(layers) * row


def check_long_samples(cfg: RunConfig, longest: int, max_len: int, token_bytes: int, buffer_bytes: int,
                       block_size: int) -> None:
    """A sample of given tokens whose states exceed half of --buffer-gb streams to disk
    (corecap/sink/stream.py); refuse, before the model loads, what streaming does not do yet
    rather than hold such a sample whole: vLLM's prefix caching. A sample whose response
    the model writes never streams (its length, and so its stored layout, is known only at its
    end): the sink holds it whole, so refuse one whose prompt and --max-tokens (at most --max-len)
    exceed --buffer-gb itself. `longest`: the longest sample still to do (its prompt), in tokens."""
    limit = f"--buffer-gb {buffer_bytes / 2**30:g}"
    if cfg.sampling.generate:
        longest = min(max_len, longest + cfg.sampling.max_tokens)
        nbytes = size_class(longest * token_bytes)  # the sink's buffer for it (sink/buffers.py)
        if nbytes > buffer_bytes:
            raise CorecapError(
                f"{limit}: a sample of up to {longest} tokens with its response holds {nbytes / 2**20:,.0f} MiB of "
                f"states, more than that, and a sample the model writes is held whole in the sink (it cannot "
                f"stream to disk yet); raise --buffer-gb to {_gib(nbytes):.3g} or lower --max-tokens"
            )
        return
    nbytes = longest * token_bytes
    if stream.streams(nbytes, buffer_bytes) and block_size:
        raise CorecapError(
            f"{limit}: a sample of {longest} tokens holds {nbytes / 2**20:,.0f} MiB of states, more than half of "
            f"that, and such a sample streams to disk, which prefix caching cannot do yet; "
            f"raise --buffer-gb to {_gib(2 * nbytes):.3g} or add --no-enable-prefix-caching"
        )


def _gib(nbytes: int) -> float:
    """`nbytes` in GiB, rounded up to the MiB."""
    return -(-nbytes // 2**20) / 1024
