"""`corecap trace --steps N`: profile a short run of the demo (or any data) directly: capture
about N engine steps into a temporary store, deleted afterwards, and return its trace.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterable

from corecap import data, demo
from corecap.errors import CorecapError
from corecap.data.media import Images
from corecap.model import load_tokenizer, model_identity, read_config, resolve_model_dir
from corecap.plan import media_inputs
from corecap.run import run
from corecap.trace.timeline import load_trace


def samples_for_steps(lengths: Iterable[int], num_steps: int, max_num_seqs: int, token_budget: int | None) -> int:
    """How many samples, in file order, finish within `num_steps` engine steps.

    A model of vLLM's FIFO chunked-prefill scheduler: each step serves the running requests
    first, then admits waiting ones while fewer than `max_num_seqs` run, all within
    `token_budget` tokens; a sample finishes with the step that completes its prompt (corecap
    samples one token). Without a budget, every step is taken to finish `max_num_seqs` samples."""
    if token_budget is None:
        return num_steps * max_num_seqs
    lengths = iter(lengths)
    running: list[int] = []  # tokens each running sample has left
    done = 0
    exhausted = False
    for _ in range(num_steps):
        budget = token_budget
        for i, left in enumerate(running):
            take = min(left, budget)
            running[i] -= take
            budget -= take
        while budget > 0 and len(running) < max_num_seqs:
            n = next(lengths, None)
            if n is None:
                exhausted = True
                break
            take = min(n, budget)
            running.append(n - take)
            budget -= take
        done += sum(1 for left in running if left == 0)
        running = [left for left in running if left]
        if exhausted and not running:
            break
    return max(done, 1)


def _head(path: str, num_samples: int, out_path: str) -> bool:
    """Copy lines of `path` up to its `num_samples`-th sample (blank lines kept, so line numbers
    and default keys stay the same); True when samples were left out."""
    try:
        with open(path, "rb") as src, open(out_path, "wb") as dst:
            count = 0
            for raw in src:
                if raw.strip():
                    if count == num_samples:
                        return True
                    count += 1
                dst.write(raw)
    except OSError as e:
        raise CorecapError(f"--data {path}: cannot read ({e.strerror})") from None
    return False


def profile_run(num_steps: int, cfg, log=print) -> dict:
    """Capture about `num_steps` engine steps of `cfg`'s data into a temporary store (deleted
    afterwards) and return its trace. run() has no step limit, so the data is cut to the samples
    that `samples_for_steps` expects to finish in that many steps."""
    from corecap._vllm import build_vllm_config, environment, max_prompt_len

    model_dir = resolve_model_dir(cfg.model) if cfg.model else demo.demo_model_dir()
    data_path = cfg.data or demo.demo_data_path()
    # the head of the data goes to a temporary file: its images stay where the rows name them
    image_dir = cfg.image_dir or os.path.dirname(os.path.abspath(data_path))
    images = Images.for_model(model_identity(model_dir, cfg.engine.load_format).architecture, image_dir)
    with environment():  # the effective budget and lengths; a model that takes images, its processor's
        vllm_config = build_vllm_config(cfg.engine, model_dir, images=not images.refusal)
    scheduler = vllm_config.scheduler_config
    config = read_config(model_dir)
    read = dict(
        tokenizer=load_tokenizer(model_dir), vocab_size=config.get("text_config", config)["vocab_size"],
        max_len=max_prompt_len(vllm_config),
        images=images, expand=None if images.refusal else media_inputs(vllm_config).expand,
    )
    lengths = (len(s.token_ids) for s in data.read_samples(data_path, **read))
    num_samples = samples_for_steps(lengths, num_steps, scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    tmp = tempfile.mkdtemp(prefix="corecap-trace-")
    head = os.path.join(tmp, "data.jsonl")
    try:
        truncated = _head(data_path, num_samples, head)
        log(f"--steps {num_steps}: profiling the first {num_samples} samples of {data_path}"
            + ("" if truncated else " (all of them)"))
        store = os.path.join(tmp, "store.lmdb")
        short = dataclasses.replace(cfg, data=head, store=store, image_dir=image_dir)
        try:
            log(run(short, log=log).line())
        except CorecapError as e:  # name the user's file, not our temporary copy
            raise CorecapError(str(e).replace(head, data_path).replace(store, "(temporary store)")) from None
        return load_trace(store)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
